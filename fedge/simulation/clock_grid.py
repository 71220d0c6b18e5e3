"""Heterogeneous fleets in simulation: a Grid that puts every client's round on a simulated clock.

:class:`ClockGrid` wraps an engine's Grid. The ClientApps still really train (on the local worker pool or
Ray); what a fleet of phones, boards and gateways would take is *computed*, never slept: for every reply,
:func:`fedge.devices.clock.time_client` charges the instruction's real wire bytes over the client's
downlink, the round's training FLOPs (counted with torch's FLOP counter) over its device's throughput,
the codec's time, and the reply's real wire bytes over its uplink, with disconnects costing only what the
resumable transport re-sends. A client whose availability (a trace) ends before its reply arrives is cut
off and loses its work (on the local engine, one cut off before it finished training also keeps the Context
it had before the call: it never trained; Ray holds its nodes' Contexts itself, so there they move on). The
:class:`Schedule` then decides, as a coordinator would, which replies the
round aggregates (a deadline, fixed or adapted from recent rounds; over-selection: the first M of those
sampled) and when the round ends; late and cut-off replies are dropped, exactly as the MQTT Grid drops
late replies, so error feedback sees a lost update as one.

Sampling sees the fleet too: with ``availability_aware`` only clients available now are offered to the
strategy (and the clock skips ahead when nobody is), with ``memory_aware`` only clients whose memory holds
training. Identical seeds give identical simulated times.

Asynchronous strategies (FedBuff, :mod:`fedge.server.async_runner`) use ``push_messages`` and
``pull_messages`` instead of rounds, and the same Grid puts them on the clock: train messages pushed start
at the clock's ``now_s`` (an instruction to a client that is away waits, as the broker's session holds
it, until the client is back), and each pull returns the earliest reply still to arrive, moving the clock
to its arrival. A client cut off by its availability answers, at the moment it goes away, with an error
reply: its work is lost. ``take_round`` then reports the time since the previous one.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, MessageType
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedge.config import ConfigError
from fedge.devices.clock import ClientTiming, bytes_moved, select_replies, time_client
from fedge.devices.fleet import ClientProfile, LinkProfile
from fedge.devices.traces import AvailabilityTrace
from fedge.flower.compat import Run, set_message_id
from fedge.flower.grid import RunGrid
from fedge.flower.node import error_reply
from fedge.protocol.envelope import wire_size
from fedge.server.runner import RunFailed
from fedge.server.schedule import Schedule

__all__ = ["ClockGrid", "Schedule"]

_BEFORE_TRAINED = ("download", "decode", "compute")  # phases a client cut off in had not finished training

log = logging.getLogger(__name__)

TrainFlops = Callable[[Message, Message], float]
"""FLOPs of the training a reply reports, from its instruction and the reply itself."""


@dataclass
class _Round:
    """The clock's account of one round, taken by the metering Grid."""

    sim_time_s: float = 0.0
    timeline: list[dict[str, Any]] = field(default_factory=list)


class ClockGrid(RunGrid):
    """``inner``'s nodes as a heterogeneous fleet on a simulated clock.

    Parameters
    ----------
    inner : Grid
        The engine's Grid (fedge's local Grid reports wire sizes; others' messages are serialized here).
    profiles : sequence of ClientProfile
        Client ``i``'s device and link (``i`` = its partition id).
    client_of : mapping of int to int
        Flower node id to client index.
    train_flops : callable(instruction, reply) -> float
        FLOPs of the training the reply reports.
    model_bytes : int
        Dense fp32 bytes of the model (what the codec reads and writes).
    schedule : Schedule (default: Schedule())
        Deadline, over-selection, availability- and memory-aware sampling.
    trace : AvailabilityTrace or None (default: None)
        When each client is available; None: always.
    seed : int (default: 0)
        Seeds the disconnect draws (with the round and client).
    """

    def __init__(
        self,
        inner: Grid,
        profiles: Sequence[ClientProfile],
        client_of: Mapping[int, int],
        train_flops: TrainFlops,
        model_bytes: int,
        schedule: Schedule | None = None,
        trace: AvailabilityTrace | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._inner, self._profiles, self._client_of = inner, list(profiles), dict(client_of)
        self._train_flops, self._model_bytes = train_flops, model_bytes
        self.schedule, self._trace, self._seed = schedule or Schedule(), trace, seed
        # each node's row in the trace's clients: one vectorised query answers for every node
        position = {client: i for i, client in enumerate(trace.clients)} if trace is not None else {}
        self._trace_row = {node: position[client] for node, client in self._client_of.items() if position}
        self.now_s = 0.0
        self._round = 0
        self._delays: list[float] = []  # recent reply delays, most recent first: Schedule.next_deadline's
        self._report = _Round()
        self._sizes: dict[str, list[int]] = {}  # instruction id -> [down bytes, up bytes]
        self._queued: dict[str, tuple[float, int, Message, dict[str, Any]]] = {}  # pushed id -> arrival
        self._async_rows: list[dict[str, Any]] = []  # timeline of the replies pulled since the last take
        self._taken_s = 0.0  # the clock at the last take_round
        if self.schedule.memory_aware and not any(map(self._fits, self._client_of)):
            largest = max(p.compute.memory_bytes for p in self._profiles)
            needed = self.schedule.training_memory_bytes
            raise ConfigError(  # Flower's sampling would wait for a node forever
                f"schedule.training_memory_bytes: no client can hold training ({needed:.3g} bytes; the "
                f"largest device has {largest:.3g})"
            )
        # Nodes the trace never has available (a FedScale entry without intervals) never connect: they are
        # not offered. The asynchronous runner refills a freed slot at once, so it picked such a node again
        # and again, each loss at the same instant, and the clock never reached the real replies.
        self._absent = (
            set()
            if trace is None
            else {n for n, client in self._client_of.items() if math.isinf(trace.next_available(client, 0.0))}
        )
        if self._absent and len(self._absent) == len(self._client_of):
            raise ConfigError(
                f"availability: none of the run's {len(self._client_of)} clients is ever available (the "
                "trace clients drawn for them, by the run's seed, have no interval before their "
                "finish_time, where the trace loops)"
            )
        if self._absent:  # never offered, as memory-aware sampling's unfit: said once
            log.warning(
                "availability: %d of the run's %d clients are never available in the trace and never train",
                len(self._absent),
                len(self._client_of),
            )
        # Memory-aware sampling never offers these: say so once, and in every round's figures (a schedule
        # that is fast because it leaves a device class out must show it; the fleet table had no row).
        unfit = Counter(self._profiles[c].name for n, c in self._client_of.items() if not self._fits(n))
        self._unfit = sum(unfit.values())
        if unfit:
            log.warning(
                "memory-aware sampling: %d clients cannot hold training and are never offered (%s)",
                self._unfit,
                ", ".join(f"{name or 'unnamed'} x{count}" for name, count in sorted(unfit.items())),
            )
        self._pushed = 0
        if isinstance(inner, RunGrid):
            inner.on_wire = self._on_inner_wire
        self._reports_bytes = isinstance(inner, RunGrid)

    # -- Grid ------------------------------------------------------------------------------------------

    def set_run(self, run: Run) -> None:
        self._inner.set_run(run)

    @property
    def run(self) -> Run:
        return self._inner.run

    def _available(self, trace: AvailabilityTrace, nodes: list[int]) -> list[int]:
        """The ``nodes`` available now, from one vectorised query of the whole trace (asking it client by
        client had cost 0.3 s a round at 20,000 clients, each call a search of its own)."""
        here = trace.available(self.now_s)
        return [n for n in nodes if here[self._trace_row[n]]]

    def get_node_ids(self) -> Iterable[int]:
        nodes = [n for n in self._inner.get_node_ids() if self._fits(n) and n not in self._absent]
        if self.schedule.availability_aware and self._trace is not None:
            available = self._available(self._trace, nodes)
            if not available and nodes and not self._queued:  # nobody is there: wait for the first
                first = min(self._trace.next_available(self._client_of[n], self.now_s) for n in nodes)
                if not math.isfinite(first):  # Flower's sampling would wait for a node forever
                    raise RunFailed(
                        f"no client of the availability trace is available after t = {self.now_s:.1f} s"
                    )
                self.now_s = first
                available = self._available(self._trace, nodes)
            nodes = available
        return nodes

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Train messages start on the clock at ``now_s`` (see the module docstring); others pass through."""
        messages = list(messages)
        if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
            return self._inner.push_messages(messages)
        try:
            return self._start_clocked(messages)
        finally:
            self._sizes.clear()

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The earliest reply still to arrive among ``message_ids`` (the clock moves to its arrival), and
        whatever the inner Grid has of the others."""
        message_ids = list(message_ids)
        clocked = [i for i in message_ids if i in self._queued]
        others = [i for i in message_ids if i not in self._queued]
        replies = list(self._inner.pull_messages(others)) if others else []
        if clocked:
            arrival, _, reply, row = self._queued.pop(min(clocked, key=lambda i: self._queued[i][:2]))
            self.now_s = max(self.now_s, arrival)
            self._async_rows.append(row)
            replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        before = self._contexts_of(messages)
        replies = list(self._inner.send_and_receive(messages, timeout=timeout))
        try:
            if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
                return replies
            return self._schedule_round(messages, replies, before)
        finally:
            self._sizes.clear()

    def node_links(self) -> dict[int, LinkProfile]:
        """Every node's link (from its client's profile), for strategies that budget uploads per client."""
        return {node: self._profiles[client].link for node, client in self._client_of.items()}

    def take_round(self) -> dict[str, Any]:
        """The last round's simulated time and timeline (for the round's metrics), then reset."""
        report, self._report = self._report, _Round()
        # The time since the previous take: a round's own time, and any wait before it for the fleet to be
        # available (so the rounds' times add up to the clock); asynchronous, with the replies pulled in it.
        report = _Round(self.now_s - self._taken_s, self._async_rows + report.timeline)
        self._async_rows = []
        self._taken_s = self.now_s
        figures = {"sim_time_s": report.sim_time_s, "sim_clock_s": self.now_s, "timeline": report.timeline}
        return figures | ({"clients_unfit": self._unfit} if self._unfit else {})

    # -- the clock -------------------------------------------------------------------------------------

    def _contexts_of(self, messages: list[Message]) -> dict[int, Any]:
        """The Contexts the inner Grid holds for the messages' nodes now (an engine that keeps them, the
        local one): kept by reference, as its calls return new Context objects rather than change these."""
        contexts = getattr(self._inner, "contexts", None)
        if not isinstance(contexts, dict):
            return {}
        return {m.metadata.dst_node_id: contexts[m.metadata.dst_node_id] for m in messages}

    def _undo_training(self, node: int, timing: ClientTiming, before: Mapping[int, Any]) -> None:
        """A client cut off before it finished training never trained: its Context goes back to how it was
        (with a codec its update was folded into its residual and sent a round later, work the clock had
        lost). One cut off while encoding or uploading did train, and keeps what that left it."""
        if timing.cut_off and timing.cut_off_phase in _BEFORE_TRAINED and node in before:
            self._inner.contexts[node] = before[node]  # type: ignore[attr-defined]

    def _schedule_round(
        self, messages: list[Message], replies: list[Message], before: Mapping[int, Any]
    ) -> list[Message]:
        self._round += 1
        start = self.now_s
        by_id = {m.metadata.message_id: m for m in messages}
        timings: dict[int, ClientTiming] = {}
        answered: dict[int, Message] = {}
        sizes: dict[int, tuple[Message, Message, int, int]] = {}  # node -> its messages and their bytes
        failed: list[Message] = []
        for reply in replies:
            instruction = by_id.get(reply.metadata.reply_to_message_id)
            if instruction is None:
                continue
            if reply.has_error():
                failed.append(reply)  # the runner reports failures; they never arrive as updates
                self._meter(instruction, reply, None, *self._message_sizes(instruction, reply))
                continue
            node = instruction.metadata.dst_node_id
            client = self._client_of[node]
            down, up = self._message_sizes(instruction, reply)
            sizes[node] = (instruction, reply, down, up)
            away = self._trace.available_until(client, start) if self._trace is not None else math.inf
            timings[node] = time_client(
                self._profiles[client],
                start_s=start,
                download_bytes=down,
                train_flops=self._train_flops(instruction, reply),
                upload_bytes=up,
                model_bytes=self._model_bytes,
                away_s=away,
                seed=(self._seed, self._round, client),
            )
            answered[node] = reply
        keep = None
        if self.schedule.over_select > 1:
            keep = max(1, math.ceil(len(messages) / self.schedule.over_select))
        outcome = select_replies(timings, round_start_s=start, deadline_s=self._deadline(), keep=keep)
        self.now_s = max(outcome.end_s, start)
        if not outcome.accepted and self.now_s == start and self._trace is not None and timings:
            # every client was away when the round began: the coordinator waits until one of them is back
            back = min(self._trace.next_available(self._client_of[n], start) for n in timings)
            self.now_s = back if math.isfinite(back) else start
        # What a coordinator sees: the arrivals it waited for; a reply the deadline cut off is known only
        # to take longer than the round did. (Replies after the first M say nothing of the deadline.)
        ended_by_keep = keep is not None and len(outcome.accepted) == keep
        censored = [] if ended_by_keep else [outcome.end_s - start] * len(outcome.late)
        arrived = [timings[n].arrival_s - start for n in outcome.accepted]
        self._delays = (arrived + censored + self._delays)[:200]
        status = {n: "accepted" for n in outcome.accepted}
        status.update({n: "late" for n in outcome.late})
        status.update({n: "cut_off" for n in outcome.cut_off})
        for node in outcome.cut_off:
            self._undo_training(node, timings[node], before)
        for node, (instruction, reply, down, up) in sizes.items():  # what moved on the clock, metered
            self._meter(instruction, reply, timings[node], down, up)
        self._report = _Round(self.now_s - start, [_row(self._client_of[n], self._profiles, t, status[n])
                                                   for n, t in timings.items()])  # fmt: skip
        for reply in failed:
            client = self._client_of.get(reply.metadata.src_node_id, -1)
            self._report.timeline.append({"client": client, "status": "error"})
        return [answered[n] for n in outcome.accepted] + failed

    def _start_clocked(self, messages: list[Message]) -> list[str]:
        """Run ``messages`` now (really), queue each reply at its simulated arrival; return their ids."""
        self._round += 1  # seeds this dispatch's disconnect draws
        start, starts, waiting = self.now_s, {}, []
        for message in messages:
            client = self._client_of[message.metadata.dst_node_id]
            begin = self._trace.next_available(client, start) if self._trace is not None else start
            (waiting.append(message) if math.isinf(begin) else starts.setdefault(id(message), begin))
        running = [m for m in messages if id(m) in starts]
        before = self._contexts_of(running)
        replies = list(self._inner.send_and_receive(running)) if running else []
        by_id = {m.metadata.message_id: m for m in running}
        for reply in replies:
            instruction = by_id.pop(reply.metadata.reply_to_message_id, None)
            if instruction is None:
                continue
            client = self._client_of[instruction.metadata.dst_node_id]
            begin = starts[id(instruction)]
            down, up = self._message_sizes(instruction, reply)
            if reply.has_error():
                self._meter(instruction, reply, None, down, up)
                self._queue(instruction, reply, begin, {"client": client, "status": "error"})
                continue
            away = self._trace.available_until(client, begin) if self._trace is not None else math.inf
            timing = time_client(
                self._profiles[client],
                start_s=begin,
                download_bytes=down,
                train_flops=self._train_flops(instruction, reply),
                upload_bytes=up,
                model_bytes=self._model_bytes,
                away_s=away,
                seed=(self._seed, self._round, client),
            )
            row = _row(client, self._profiles, timing, "cut_off" if timing.cut_off else "accepted")
            self._meter(instruction, reply, timing, down, up)
            if timing.cut_off:  # the coordinator learns it when the client goes away; the work is lost
                self._undo_training(instruction.metadata.dst_node_id, timing, before)
                reason = f"client {client} went away at {timing.away_s:.1f} s ({timing.cut_off_phase})"
                self._queue(instruction, _lost(instruction, reason), max(timing.away_s, begin), row)
            else:
                self._queue(instruction, reply, timing.arrival_s, row)
        for instruction in [*by_id.values(), *waiting]:  # no reply at all, or never available
            never = not instruction.metadata.message_id  # never sent to the inner Grid: never available
            if never:
                set_message_id(instruction, uuid.uuid4().hex)
            client = self._client_of[instruction.metadata.dst_node_id]
            reason = f"client {client} is never available again (its availability)" if never else "no reply"
            self._queue(instruction, _lost(instruction, reason), start, {"client": client, "status": "error"})
        return [m.metadata.message_id for m in messages]

    def _queue(self, instruction: Message, reply: Message, arrival_s: float, row: dict[str, Any]) -> None:
        self._pushed += 1  # ties in arrival go in push order
        self._queued[instruction.metadata.message_id] = (arrival_s, self._pushed, reply, row)

    def _deadline(self) -> float | None:
        return self.schedule.next_deadline(self._delays, rounds_done=self._round - 1)

    def _fits(self, node: int) -> bool:
        if not self.schedule.memory_aware:
            return True
        memory = self._profiles[self._client_of[node]].compute.memory_bytes
        return memory >= self.schedule.training_memory_bytes

    def _on_inner_wire(self, message: Message, nbytes: int) -> None:
        """Sizes as the inner Grid serialized them (instructions down, replies up). A train message's are
        metered once the clock says what moved (:meth:`_meter`); the others' are passed on as they are."""
        if message.metadata.message_type != MessageType.TRAIN:
            self._report_wire(message, nbytes)
            return
        reply_to = message.metadata.reply_to_message_id
        sizes = self._sizes.setdefault(reply_to or message.metadata.message_id, [0, 0])
        sizes[1 if reply_to else 0] = nbytes

    def _message_sizes(self, instruction: Message, reply: Message) -> tuple[int, int]:
        if self._reports_bytes:
            down, up = self._sizes.get(instruction.metadata.message_id, [0, 0])
            return down, up
        return wire_size(instruction), wire_size(reply)  # e.g. Ray's Grid: measured here

    def _meter(
        self, instruction: Message, reply: Message, timing: ClientTiming | None, down: int, up: int
    ) -> None:
        """Report what a client's round moved: all of it, or (cut off) what it moved before it went away:
        a client that was never there moved nothing (an error reply travelled whole)."""
        if timing is not None:
            down, up = bytes_moved(timing, down, up)
        self._report_wire(instruction, down)
        self._report_wire(reply, up)


def _lost(instruction: Message, reason: str) -> Message:
    """The error reply standing for work that never arrives."""
    reply = error_reply(instruction, ErrorCode.NODE_UNAVAILABLE, reason)
    set_message_id(reply, uuid.uuid4().hex)
    return reply


def _row(client: int, profiles: Sequence[ClientProfile], timing: ClientTiming, status: str) -> dict[str, Any]:
    """One client's line of the round's timeline (what the timeline plot draws)."""
    return {
        "client": client,
        "device": profiles[client].name,
        "status": status,
        "start_s": round(timing.start_s, 6),
        "download_s": round(timing.download_s, 6),
        "compute_s": round(timing.compute_s + timing.decode_s + timing.encode_s, 6),  # the three below
        "decode_s": round(timing.decode_s, 6),
        "train_s": round(timing.compute_s, 6),
        "encode_s": round(timing.encode_s, 6),
        "upload_s": round(timing.upload_s, 6),
        "arrival_s": round(timing.arrival_s, 6),
        "away_s": timing.away_s if math.isfinite(timing.away_s) else None,
        "cut_off_phase": timing.cut_off_phase or None,
        "resent_bytes": timing.resent_bytes,
        "disconnects": timing.disconnects,
    }
