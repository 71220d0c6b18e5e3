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
  direction as long as an honest update.

Norms and ``D`` run over the floating-point tensors; integer buffers (BatchNorm's ``num_batches_tracked``)
keep their trained values. Which clients attack is fixed for a run: the first ``round(attackers · N)``
(at least one) of a permutation of the ``N`` partition ids seeded by the run's ``seed``.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.records import arrays_to_record, record_to_arrays

__all__ = ["ATTACKS", "SCALE_FACTOR", "AttackMod", "attacker_ids", "poison"]

ATTACKS = ("sign-flip", "scale", "noise")
SCALE_FACTOR = 10.0


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


def poison(
    attack: str, received: dict[str, np.ndarray], trained: dict[str, np.ndarray], seed: int = 0
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

    Returns
    -------
    dict of float32 arrays
        The poisoned weights, by name.
    """
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; choose one of: {', '.join(ATTACKS)}")
    update = {name: trained[name] - received[name] for name in trained}
    if attack == "sign-flip":
        return {name: received[name] - update[name] for name in trained}
    if attack == "scale":
        return {name: received[name] + np.float32(SCALE_FACTOR) * update[name] for name in trained}
    size = sum(u.size for u in update.values())
    norm = math.sqrt(sum(float(np.dot(u.reshape(-1), u.reshape(-1))) for u in update.values()))
    sigma = norm / math.sqrt(size) if size else 0.0
    rng = np.random.default_rng(seed)
    return {
        name: received[name] + rng.normal(0.0, sigma, size=u.shape).astype(np.float32)
        for name, u in update.items()
    }


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
        chosen = attacker_ids(
            int(context.node_config["num-partitions"]), float(config.get("attackers", 0.0)), seed
        )
        if partition not in chosen:
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
        poisoned = poison(
            attack,
            {name: received[name] for name in floating},
            {name: trained[name] for name in floating},
            noise_seed,
        )
        reply.content[keys[0]] = arrays_to_record(trained | poisoned, dtypes)
        return reply
