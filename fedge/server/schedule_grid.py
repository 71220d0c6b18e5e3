"""The :class:`~fedge.server.schedule.Schedule` in real time: a Grid that ends training rounds on the clock.

:class:`ScheduledGrid` wraps a Grid whose replies arrive in real time (fedge's MQTT Grid, Flower's gRPC Grid)
and applies the schedule the simulated clock applies (:class:`fedge.simulation.clock_grid.ClockGrid`), with
seconds measured on the coordinator's monotonic clock instead of computed:

* **deadline**: a training round waits at most ``deadline_s`` real seconds (never longer than the runner's
  round timeout); with ``adaptive_deadline``, ``deadline_slack`` times the ``deadline_quantile`` of recent
  rounds' reply delays, a reply the deadline cut off counting at its round's length (the clock's rule,
  :meth:`Schedule.next_deadline`, on measured delays);
* **over-selection**: the round returns as soon as the first ``ceil(sampled / over_select)`` updates arrived;
* replies still outstanding when the round ends are **dropped and counted**: the inner Grid is told to stop
  awaiting them (``abandon(message_ids)``, where it has one) or they are drained and discarded at the next
  round; either way a late reply is never delivered into a later round, and error feedback sees a lost update;
* **availability-aware**: the inner Grid offers only nodes online now (MQTT presence), which is the real-time
  meaning of available, so there is nothing more to filter;
* **memory-aware**: nodes whose reported device memory cannot hold training are not offered (a node that has
  not reported a profile yet is offered: its memory is unknown, not short).

Error replies (a failed ClientApp, a refused instruction) are passed on but never count towards the first M.
Each round's account (``schedule_*`` figures: seconds, deadline used, late, cut) is taken by the metering Grid
(:meth:`take_round`), as the clock's is, so it lands in the round's metrics.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from fedge.devices.fleet import LinkProfile
from fedge.devices.profile import DeviceProfile
from fedge.flower.compat import Run
from fedge.flower.grid import RunGrid
from fedge.protocol.envelope import wire_size
from fedge.server.schedule import Schedule

__all__ = ["ScheduledGrid"]

log = logging.getLogger(__name__)

_KEEP_DELAYS = 200  # recent arrival delays the adaptive deadline looks at (the clock keeps as many)
_FORGET_AFTER = (
    10_000  # abandoned instruction ids remembered for draining, when the inner Grid cannot abandon
)


@dataclass
class _Account:
    """One training round's schedule, in real seconds (what :meth:`ScheduledGrid.take_round` reports)."""

    round_s: float = 0.0
    deadline_s: float | None = None
    sampled: int = 0
    unsent: int = 0  # instructions the inner Grid did not send (the node went offline)
    accepted: int = 0
    failed: int = 0
    late: int = 0  # no reply by the deadline (or the round timeout)
    cut: int = 0  # not awaited (or dropped) once the first M had arrived: over-selection
    late_arrived: int = 0  # replies to earlier rounds' abandoned instructions, discarded
    unfit: int = 0  # online nodes not offered: their memory cannot hold training


class ScheduledGrid(RunGrid):
    """``inner``'s training rounds under a :class:`Schedule`, in real seconds.

    Parameters
    ----------
    inner : Grid
        A Grid whose replies arrive in real time (fedge's ``MqttGrid``, Flower's Grids). If it has
        ``abandon(message_ids)``, outstanding instructions are handed to it when a round ends (it then drops
        their replies itself); otherwise their replies are pulled and discarded at later rounds.
    schedule : Schedule (default: Schedule())
        Deadline, over-selection, memory-aware sampling.
    profiles : callable() -> mapping of int to DeviceProfile, optional
        The nodes' reported device profiles by Flower node id (memory-aware sampling reads them).
    links : callable() -> mapping of int to LinkProfile, optional
        The nodes' links by Flower node id (:meth:`node_links`, for per-client upload budgets); the inner
        Grid's ``node_links()`` when not given.
    clock : callable() -> float (default: time.monotonic)
        Seconds; tests pass a fake one.
    pause : callable(float), optional
        Waits that many seconds between polls of the inner Grid (default: a real wait).
    poll_s : float (default: 0.02)
        How often a round polls the inner Grid for replies.
    """

    def __init__(
        self,
        inner: Grid,
        schedule: Schedule | None = None,
        *,
        profiles: Callable[[], Mapping[int, DeviceProfile]] | None = None,
        links: Callable[[], Mapping[int, LinkProfile]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], object] | None = None,
        poll_s: float = 0.02,
    ) -> None:
        super().__init__()
        self._inner, self.schedule = inner, schedule or Schedule()
        self._profiles, self._links = profiles, links
        self._clock, self._poll_s = clock, poll_s
        self._pause = pause or threading.Event().wait  # never set: a plain wait
        self._delays: list[float] = []  # recent reply delays, most recent first: Schedule.next_deadline's
        self._rounds_done = 0  # training rounds so far (the deadline quantile's ramp)
        self._abandoned: OrderedDict[str, None] = OrderedDict()
        self._late_seen = 0  # the inner Grid's late replies counted so far (one that drops them itself)
        self._account = _Account()
        self._unfit = 0
        # fedge's Grids report the bytes they carry; for the others, this Grid serializes to report them.
        self._inner_reports_bytes = isinstance(inner, RunGrid)
        if isinstance(inner, RunGrid):
            inner.on_wire = self._forward_wire

    # -- Grid ------------------------------------------------------------------------------------------

    def set_run(self, run: Run) -> None:
        self._inner.set_run(run)

    @property
    def run(self) -> Run:
        return self._inner.run

    def get_node_ids(self) -> Iterable[int]:
        nodes = list(self._inner.get_node_ids())
        if not self.schedule.memory_aware:
            return nodes
        profiles = dict(self._profiles()) if self._profiles is not None else {}
        fit = [n for n in nodes if self._fits(profiles.get(n))]
        self._unfit = len(nodes) - len(fit)
        return fit

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self._inner.push_messages(messages))
        if not self._inner_reports_bytes:
            for message in messages:
                self._report_wire(message, wire_size(message))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self._inner.pull_messages(message_ids))
        if not self._inner_reports_bytes:
            for reply in replies:
                self._report_wire(reply, wire_size(reply))
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        self._drain()
        if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
            # Only training rounds are scheduled, as on the clock; the rest waits as the inner Grid does.
            replies = list(self._inner.send_and_receive(messages, timeout=timeout))
            if not self._inner_reports_bytes:
                for message in [*messages, *replies]:
                    self._report_wire(message, wire_size(message))
            return replies
        return self._train_round(messages, timeout)

    def node_links(self) -> dict[int, LinkProfile]:
        """Every node's link where one is known (``links``, else the inner Grid's), for upload budgets."""
        if self._links is not None:
            return dict(self._links())
        node_links = getattr(self._inner, "node_links", None)
        return dict(node_links()) if callable(node_links) else {}

    def take_round(self) -> dict[str, float]:
        """The last training round's ``schedule_*`` figures (for the round's metrics), then reset."""
        self._drain()
        account, self._account = self._account, _Account()
        return {f"schedule_{k}": float(v) for k, v in asdict(account).items() if v is not None}

    # -- the schedule ----------------------------------------------------------------------------------

    def current_deadline(self) -> float | None:
        """The deadline the next training round gets, seconds (None: none)."""
        return self.schedule.next_deadline(self._delays, rounds_done=self._rounds_done)

    def _train_round(self, messages: list[Message], timeout: float | None) -> list[Message]:
        deadline = self.current_deadline()
        self._rounds_done += 1
        waits = [w for w in (deadline, timeout) if w is not None]
        wait = min(waits) if waits else None
        keep = None
        if self.schedule.over_select > 1:
            keep = max(1, math.ceil(len(messages) / self.schedule.over_select))
        start = self._clock()
        pending = dict.fromkeys(self.push_messages(messages))  # ordered: the instructions still awaited
        account = _Account(deadline_s=deadline, sampled=len(messages), unfit=self._unfit)
        account.unsent = len(messages) - len(pending)
        accepted: list[Message] = []
        failed: list[Message] = []
        delays: list[float] = []
        while pending:
            for reply in self.pull_messages(list(pending)):
                pending.pop(reply.metadata.reply_to_message_id, None)
                if reply.has_error():
                    failed.append(reply)  # passed on for the runner to report; never an update
                elif keep is not None and len(accepted) >= keep:
                    account.cut += 1  # came in the same poll as the M-th: over-selection drops it
                else:
                    accepted.append(reply)
                    delays.append(self._clock() - start)
            if not pending or (keep is not None and len(accepted) >= keep):
                break
            left = None if wait is None else start + wait - self._clock()
            if left is not None and left <= 0:
                break
            self._pause(self._poll_s if left is None else min(self._poll_s, left))
        account.round_s = self._clock() - start
        if pending:
            if keep is not None and len(accepted) >= keep:
                account.cut += len(pending)  # over-selection had enough: says nothing of the deadline
            else:
                account.late += len(pending)
                delays += [account.round_s] * len(pending)  # the deadline cut them off: slower than that
            self._abandon(list(pending))
        account.accepted, account.failed = len(accepted), len(failed)
        account.late_arrived = self._account.late_arrived  # drained before this round started
        self._account = account
        self._delays = (delays + self._delays)[:_KEEP_DELAYS]
        log.info(
            "training round: %d of %d sampled aggregated after %.2f s (deadline %s); %d late, %d cut, "
            "%d failed",
            account.accepted,
            account.sampled,
            account.round_s,
            "none" if deadline is None else f"{deadline:.2f} s",
            account.late,
            account.cut,
            account.failed,
        )
        return accepted + failed

    def _abandon(self, message_ids: list[str]) -> None:
        """Stop awaiting ``message_ids``: their replies, if they ever come, must not reach any round."""
        abandon = getattr(self._inner, "abandon", None)
        if callable(abandon):
            abandon(message_ids)
            return
        # The inner Grid keeps awaiting them: pull and discard their replies later (see _drain).
        self._abandoned.update(dict.fromkeys(message_ids))
        while len(self._abandoned) > _FORGET_AFTER:
            self._abandoned.popitem(last=False)

    def _drain(self) -> None:
        """Discard replies that came in for abandoned instructions, counting them as late arrivals."""
        late = getattr(self._inner, "late_replies", None)
        if isinstance(late, int):  # the inner Grid drops them itself (MqttGrid): count what it dropped
            self._account.late_arrived += late - self._late_seen
            self._late_seen = late
        if not self._abandoned:
            return
        for reply in self.pull_messages(list(self._abandoned)):
            self._abandoned.pop(reply.metadata.reply_to_message_id, None)
            self._account.late_arrived += 1
            log.info("dropped a late reply from node %s", reply.metadata.src_node_id)

    def _fits(self, profile: DeviceProfile | None) -> bool:
        """Whether a node's reported memory holds training (unknown memory: offered)."""
        if profile is None:
            return True
        memory_mb = profile.memory_available_mb or profile.memory_total_mb
        return memory_mb == 0 or memory_mb * 2**20 >= self.schedule.training_memory_bytes

    def _forward_wire(self, message: Message, nbytes: int) -> None:
        self._report_wire(message, nbytes)
