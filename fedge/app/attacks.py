"""Model-poisoning clients for simulations: a Flower client mod that corrupts chosen clients' updates.

The reference ClientApp installs :class:`AttackMod` inside :class:`fedge.client.CompressionMod`
(``mods=[CompressionMod(), AttackMod()]``), so it changes the dense trained weights before they are turned
into an update and encoded, exactly as a malicious device running its own code could. With dense FedAvg
(no instruction) it changes the weights the client replies with.

It acts only on train messages whose ``config`` ConfigRecord names an ``attack`` (the reference app puts
``attack`` and ``attackers`` there when :class:`fedge.app.config.AppConfig` sets them), and only on the
clients :func:`attacker_ids` chooses from the node's ``partition-id``. With ``r`` the received weights,
``t`` the honestly trained ones and ``u = t − r``, an attacker replies with

* ``sign-flip``: ``r − u`` (gradient ascent: it undoes as much progress as an honest client makes);
* ``scale``: ``r + 10 · u`` (a boosted update, to dominate an average);
* ``noise``: ``r + ε``, ``ε ~ N(0, σ²)`` per element with ``σ = ‖u‖ / √D``, so ``‖ε‖ ≈ ‖u‖``: a random
  direction as long as an honest update;
* ``free-ride``: ``r``, the model sent back untrained with the client's examples claimed (a free-rider
  that wants the model without spending its own compute; an update of zero under compression).

Two attacks collude. Every attacker trains the received model honestly on each attacker's partition (it
can: a simulation's task serves any partition), so all of them know the ``m`` honest updates ``u_1 … u_m``
of their group, with per-coordinate mean ``μ`` and standard deviation ``σ``, and all send the same reply:

* ``alie`` ("a little is enough", Baruch et al., NeurIPS 2019): ``r + μ − z · σ``, with
  ``z = Φ⁻¹((N − s) / N)`` and ``s = ⌊N/2 + 1⌋ − m``: the largest shift per coordinate that still keeps the
  attackers inside the spread of honest values a median or trimmed mean picks from. Small in norm, the
  same sign everywhere: it defeats defences that look for outliers.
* ``ipm`` (inner-product manipulation, Xie et al., UAI 2019): ``r − ε · μ`` with ``ε =``
  :data:`IPM_EPSILON`: the colluders' mean, reversed and shrunk so its norm stays below an honest update's,
  to turn the aggregate's inner product with the true gradient negative.

Two attacks poison data instead; the reference ClientApp's ``train`` applies them and the weights are not
touched afterwards. ``label-flip`` clients train honestly on their partition with every label ``y``
replaced by ``C − 1 − y`` (``C`` classes, from the task's test labels; :func:`flip_labels`); ``backdoor``
clients with a trigger stamped on half their examples, relabelled as one target class
(:mod:`fedge.app.backdoor`, whose success the server's evaluation reports as ``backdoor_success``).

Norms and ``D`` run over the floating-point tensors; integer buffers (BatchNorm's ``num_batches_tracked``)
keep their trained values. Which clients attack is fixed for a run: the first ``round(attackers · N)``
(at least one) of a permutation of the ``N`` partition ids seeded by the run's ``seed``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.records import arrays_to_record, record_to_arrays

__all__ = [
    "ATTACKS",
    "COLLUDING",
    "DATA_ATTACKS",
    "IPM_EPSILON",
    "SCALE_FACTOR",
    "AttackMod",
    "alie_z",
    "attacker_ids",
    "flip_labels",
    "is_attacker",
    "poison",
    "round_attackers",
]

ATTACKS = ("sign-flip", "scale", "noise", "free-ride", "alie", "ipm", "label-flip", "backdoor")
COLLUDING = ("alie", "ipm")
"""Attacks whose reply is computed from every attacker's honest update."""
DATA_ATTACKS = ("label-flip", "backdoor")
"""Attacks on the training data; the trained weights are sent as they are."""
SCALE_FACTOR = 10.0
IPM_EPSILON = 0.5


def attacker_ids(num_partitions: int, fraction: float, seed: int) -> frozenset[int]:
    """The partition ids that attack: ``round(fraction · num_partitions)`` of them (at least one if
    ``fraction > 0``), drawn by a permutation seeded with ``seed``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the fraction of attackers must be in [0, 1], got {fraction}")
    if fraction == 0.0 or num_partitions < 1:
        return frozenset()
    count = min(num_partitions, max(1, math.floor(fraction * num_partitions + 0.5)))
    order = np.random.default_rng(seed).permutation(num_partitions)
    return frozenset(int(i) for i in order[:count])


def round_attackers(config: Mapping[str, Any], node_config: Mapping[str, Any]) -> frozenset[int]:
    """The partition ids that attack in the run a train ConfigRecord ``config`` describes, for a node of
    ``node_config`` (its ``num-partitions``)."""
    return attacker_ids(
        int(node_config["num-partitions"]), float(config.get("attackers", 0.0)), int(config.get("seed", 0))
    )


def is_attacker(config: Mapping[str, Any], node_config: Mapping[str, Any], attack: str) -> bool:
    """Whether this node runs ``attack`` in the training round ``config`` (a train ConfigRecord) describes."""
    if str(config.get("attack", "")) != attack:
        return False
    return int(node_config["partition-id"]) in round_attackers(config, node_config)


def flip_labels(labels: Any, num_classes: int) -> Any:
    """``C − 1 − y`` for integer class labels ``y`` in ``[0, C)`` (a torch tensor or numpy array)."""
    if hasattr(labels, "is_floating_point"):  # torch
        integer = not (labels.is_floating_point() or labels.is_complex())
    else:
        integer = np.asarray(labels).dtype.kind in "iu"
    if not integer:
        raise ValueError("label-flip needs integer class labels; this task's labels are not")
    return (num_classes - 1) - labels


def alie_z(num_clients: int, num_attackers: int) -> float:
    """ALIE's shift in standard deviations, ``Φ⁻¹((N − s) / N)`` with ``s = ⌊N/2 + 1⌋ − m``; the share is
    kept in [0.5, 0.999], so ``z`` in [0, 3.09] (a majority of attackers would make it infinite)."""
    supporters = math.floor(num_clients / 2 + 1) - num_attackers
    share = min(max((num_clients - supporters) / num_clients, 0.5), 0.999)
    return NormalDist().inv_cdf(share)


def poison(
    attack: str,
    received: dict[str, np.ndarray],
    trained: dict[str, np.ndarray],
    seed: int = 0,
    group: Sequence[dict[str, np.ndarray]] = (),
    num_clients: int = 0,
) -> dict[str, np.ndarray]:
    """The weights an attacker replies with instead of ``trained``.

    Parameters
    ----------
    attack : str
        One of :data:`ATTACKS`.
    received, trained : dict of float32 arrays
        The weights the client received and those it trained, same names and shapes (floating-point
        tensors only: every array here is changed).
    seed : int (default: 0)
        Seeds the noise of ``noise``.
    group : sequence of dicts of float32 arrays (default: ())
        For :data:`COLLUDING` attacks: the weights every attacker (this one included) trained honestly.
    num_clients : int (default: 0)
        For ``alie``: the clients of the run, ``N``.

    Returns
    -------
    dict of float32 arrays
        The poisoned weights, by name.
    """
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; choose one of: {', '.join(ATTACKS)}")
    if attack in COLLUDING:
        return _colluding(attack, received, list(group) or [trained], num_clients)
    update = {name: trained[name] - received[name] for name in trained}
    if attack == "sign-flip":
        return {name: received[name] - update[name] for name in trained}
    if attack == "scale":
        return {name: received[name] + np.float32(SCALE_FACTOR) * update[name] for name in trained}
    if attack == "free-ride":
        return {name: received[name].copy() for name in trained}
    size = sum(u.size for u in update.values())
    norm = math.sqrt(sum(float(np.dot(u.reshape(-1), u.reshape(-1))) for u in update.values()))
    sigma = norm / math.sqrt(size) if size else 0.0
    rng = np.random.default_rng(seed)
    return {
        name: received[name] + rng.normal(0.0, sigma, size=u.shape).astype(np.float32)
        for name, u in update.items()
    }


def _colluding(
    attack: str, received: dict[str, np.ndarray], group: list[dict[str, np.ndarray]], num_clients: int
) -> dict[str, np.ndarray]:
    poisoned = {}
    z = alie_z(max(num_clients, len(group)), len(group)) if attack == "alie" else 0.0
    for name, start in received.items():
        updates = np.stack([weights[name] - start for weights in group]).astype(np.float64)
        mean = updates.mean(axis=0)
        step = mean - z * updates.std(axis=0) if attack == "alie" else -IPM_EPSILON * mean
        poisoned[name] = (start + step).astype(np.float32)
    return poisoned


class AttackMod:
    """Corrupt the trained weights of the clients :func:`attacker_ids` chooses (see the module docs).

    Parameters
    ----------
    config_key : str (default: "config")
        The train message's ConfigRecord holding ``attack``, ``attackers`` and ``seed``.
    """

    def __init__(self, config_key: str = "config") -> None:
        self.config_key = config_key

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        config = msg.content.get(self.config_key)
        attack = str(config.get("attack", "")) if config is not None else ""
        if not attack:
            return call_next(msg, context)
        seed = int(config.get("seed", 0))
        partition = int(context.node_config["partition-id"])
        chosen = round_attackers(config, context.node_config)
        if partition not in chosen or attack in DATA_ATTACKS:  # data attacks act in the ClientApp's train
            return call_next(msg, context)
        records = [v for v in msg.content.values() if isinstance(v, ArrayRecord)]
        if len(records) != 1:
            raise ValueError(f"attack {attack!r}: expected one ArrayRecord in the train message")
        received, _ = record_to_arrays(records[0])
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        keys = [k for k, v in reply.content.items() if isinstance(v, ArrayRecord)]
        if len(keys) != 1:
            raise ValueError(f"attack {attack!r}: expected one ArrayRecord in the reply")
        trained, dtypes = record_to_arrays(reply.content[keys[0]])
        floating = [name for name, dtype in dtypes.items() if np.dtype(dtype).kind == "f"]
        noise_seed = zlib.crc32(f"attack/{seed}/{partition}/{config.get('server-round', 0)}".encode())
        group = []
        if attack in COLLUDING:  # train honestly on every attacker's partition, as each of them did
            for other in sorted(chosen):
                weights = trained if other == partition else self._honest(msg, context, call_next, other)
                group.append({name: weights[name] for name in floating})
        poisoned = poison(
            attack,
            {name: received[name] for name in floating},
            {name: trained[name] for name in floating},
            noise_seed,
            group,
            int(context.node_config["num-partitions"]),
        )
        reply.content[keys[0]] = arrays_to_record(trained | poisoned, dtypes)
        return reply

    @staticmethod
    def _honest(
        msg: Message, context: Context, call_next: ClientAppCallable, partition: int
    ) -> dict[str, np.ndarray]:
        """The weights an honest client of ``partition`` replies to ``msg`` with."""
        other = Context(
            run_id=context.run_id,
            node_id=context.node_id,
            node_config={**context.node_config, "partition-id": partition},
            state=RecordDict(),
            run_config=context.run_config,
        )
        reply = call_next(msg, other)
        if reply.has_error():
            raise RuntimeError(
                f"colluding attack: training partition {partition} failed: {reply.error.reason}"
            )
        (record,) = [v for v in reply.content.values() if isinstance(v, ArrayRecord)]
        return record_to_arrays(record)[0]
