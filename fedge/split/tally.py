"""What a round of the split engine brought in: every trained copy of each parameter, losses, bytes, time.

Full-model clients' replies carry their trained model (dense) or their update as one payload
(``update_codec``, decoded with caps by :func:`fedge.split.updates.decode_update`); split sessions carry
their collected front (and U-shaped head) or its payload, and the coordinator's server-side stage. The
contributions are in the driver's order (full clients, then per split client its front and its server
stage) for :func:`fedge.split.rounds.average_deltas`. Sequential split learning hands one front around,
so, as in the driver, every split client that took its turn contributes the last front handed in. With an
:class:`~fedge.split.engine_clock.EngineClock` the round is also charged on the simulated clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from flwr.app import Message

from fedge.split.engine_clock import EngineClock, SplitCharge
from fedge.split.rounds import Delta, stage_delta
from fedge.split.session import SplitSession
from fedge.split.updates import UpdateRejected, check_delta, decode_update

__all__ = ["RoundTally", "local_delta", "tally_round"]

log = logging.getLogger(__name__)


@dataclass
class RoundTally:
    """A round's contributions (delta by model key, weight), losses (value, weight), partitions whose
    update was averaged in, update bytes up, and the simulated time (0 without a clock)."""

    contributions: list[tuple[Delta, float]] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    update_bytes: int = 0
    round_s: float = 0.0


def _numel(delta: Delta) -> int:
    return sum(v.numel() for v in delta.values())


def _shapes(start: dict[str, torch.Tensor], keys: Sequence[str]) -> dict[str, torch.Size]:
    """The floating tensors an update of ``keys`` must hold (what the driver's deltas hold)."""
    return {k: start[k].shape for k in keys if start[k].is_floating_point()}


def tally_round(
    full_replies: Sequence[Message],
    sessions: Sequence[SplitSession],
    start: dict[str, torch.Tensor],
    partition_of: Callable[[int], int],
    *,
    epochs: int,
    clock: EngineClock | None = None,
    sequential: bool = False,
) -> RoundTally:
    """Gather the round's contributions from the full clients' replies and the split sessions.

    Parameters
    ----------
    full_replies : sequence of Message
        The full-model clients' replies (errors are logged and left out).
    sessions : sequence of SplitSession
        The round's split sessions, settled.
    start : dict of str to tensor
        The global model at the round's start.
    partition_of : callable(node id) -> int
        A node's partition.
    epochs : int
        Local epochs (the clock's compute of full clients).
    clock : EngineClock or None (default: None)
        Charges the round when given.
    sequential : bool (default: False)
        Sequential split learning: every split client's front contribution is the last one handed in.
    """
    tally = RoundTally()
    durations: list[float] = []
    floating = _shapes(start, list(start))
    down_full = 4 * sum(start[k].numel() for k in floating)
    for reply in full_replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("full client %s failed: %s", node, reply.error.reason)
            continue
        metrics = reply.content["metrics"]
        weight = float(metrics["num-examples"])
        try:
            delta, nbytes = _full_update(reply, start, floating)
        except UpdateRejected as err:
            log.warning("full client %s: update left out: %s", node, err)
            continue
        tally.contributions.append((delta, weight))
        tally.losses.append((float(metrics["train_loss"]), weight))
        tally.trained.append(partition_of(node))
        tally.update_bytes += nbytes
        if clock is not None:
            durations.append(clock.full_s(partition_of(node), int(weight), epochs, down_full, nbytes))
    charges = []
    deltas: dict[int, Delta] = {}
    for s in sessions:
        if not s.server_steps and (s.front is not None or s.update):
            # its front took no step (every batch lost or rejected): averaged in, it only pulled the model
            # back to the round's start (one client whose batches were all NaN left the model at chance)
            log.warning("split client %d: no batch stepped this round; its front is left out", s.partition)
        elif s.front is not None or s.update:
            try:
                deltas[s.partition] = local_delta(s, start)
            except UpdateRejected as err:
                log.warning("split client %d: update left out: %s", s.partition, err)
    last = deltas[next(s.partition for s in reversed(sessions) if s.partition in deltas)] if deltas else {}
    for s in sessions:
        local_keys = list(s.keys[0].values()) + list(s.keys[2].values())
        nbytes = 0
        if s.partition in deltas:
            delta = deltas[s.partition]
            nbytes = len(s.update) if s.update else 4 * _numel(delta)
            tally.contributions.append((last if sequential else delta, float(s.examples)))
            tally.trained.append(s.partition)
            tally.update_bytes += nbytes
        if s.server_steps:
            server = stage_delta(s.back.back.state_dict(), s.keys[1], start)
            tally.contributions.append((server, float(s.examples)))
            tally.losses.append((s.loss[0] / max(1.0, s.loss[1]), s.loss[1]))
        stage_bytes = 4 * sum(start[k].numel() for k in _shapes(start, local_keys))
        charges.append(SplitCharge(s.partition, s.cut, s.exchanges, stage_bytes, nbytes))
    if clock is not None:
        tally.round_s = clock.charge(durations + clock.split_s(charges))
    return tally


def _full_update(
    reply: Message, start: dict[str, torch.Tensor], shapes: dict[str, torch.Size]
) -> tuple[Delta, int]:
    """A full client's delta from the round's start, and its bytes on the wire."""
    if "update" in reply.content.config_records:
        payload = bytes(reply.content["update"]["payload"])
        return decode_update(payload, shapes), len(payload)
    state = reply.content["arrays"].to_torch_state_dict()
    if not shapes.keys() <= state.keys():
        raise UpdateRejected(f"model misses {sorted(shapes.keys() - state.keys())[:3]}")
    trained = check_delta({k: state[k] for k in shapes}, shapes)  # shapes first: a subtraction broadcasts
    delta = {k: trained[k] - start[k] for k in shapes}
    return check_delta(delta, shapes), 4 * _numel(delta)


def local_delta(s: SplitSession, start: dict[str, torch.Tensor]) -> Delta:
    """A split client's collected front (and head) minus the round's start, by model key.

    An encoded update is relative to what the client started from (``s.base``: the round's start, or in
    sequential split learning the front handed to it).

    Raises
    ------
    UpdateRejected
        The encoded update fails the caps (:func:`fedge.split.updates.decode_update`).
    """
    local_keys = list(s.keys[0].values()) + list(s.keys[2].values())
    if s.update:
        delta = decode_update(s.update, _shapes(start, local_keys))
        base = s.base or {}
        return {k: v + (base[k] - start[k]).reshape(v.shape) if k in base else v for k, v in delta.items()}
    assert s.front is not None
    stages = [(s.front, s.keys[0]), *([(s.head, s.keys[2])] if s.head is not None else [])]
    delta: Delta = {}
    for state, keys in stages:
        missing = sorted(keys.keys() - state.keys())[:3]
        if missing:
            raise UpdateRejected(f"the collected stage misses {missing}")
        trained = {keys[k]: v for k, v in state.items() if k in keys}
        check_delta(trained, _shapes(start, list(keys.values())))  # before a subtraction broadcasts
        delta.update(stage_delta(state, keys, start))
    return check_delta(delta, _shapes(start, local_keys))
