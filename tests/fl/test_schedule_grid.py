"""ScheduledGrid over a fake in-memory Grid on a fake clock: the schedule's rules, deterministically.

Each fake node answers ``delay`` seconds after its instruction is pushed (``inf``: never, ``"error"``: at
once, with an error). The fake clock only moves when the ScheduledGrid pauses between polls, so every
round's timing is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest
from flwr.app import Error, Message, MessageType, RecordDict

from fedge.app.coordinator import CoordinatorConfig
from fedge.config import ConfigError
from fedge.devices.fleet import LinkProfile
from fedge.devices.profile import DeviceProfile
from fedge.flower.compat import set_message_id
from fedge.flower.grid import RunGrid
from fedge.server.metered_grid import MeteredGrid
from fedge.server.schedule import Schedule
from fedge.server.schedule_grid import ScheduledGrid
from fedge.simulation.clock_grid import Schedule as ClockSchedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


class FakeGrid(RunGrid):
    """Nodes that answer after fixed delays; ``abandon`` is offered only when ``can_abandon``, and then the
    Grid drops an abandoned instruction's reply when it comes, counting it (as MqttGrid does)."""

    def __init__(self, clock: FakeClock, delays: dict[int, float | str], can_abandon: bool = False) -> None:
        super().__init__()
        self.clock, self.delays = clock, delays
        self.due: dict[str, tuple[float, Message]] = {}  # instruction id -> (when, reply)
        self.abandoned: list[str] = []
        self.late_due: dict[str, float] = {}  # abandoned instruction id -> when its reply comes
        self.can_abandon = can_abandon
        self.pushed = 0
        if can_abandon:
            self.abandon = self._abandon

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.delays)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            self.pushed += 1
            message_id = f"m{self.pushed}"
            set_message_id(message, message_id)
            delay = self.delays[message.metadata.dst_node_id]
            if delay == "error":
                reply = Message(Error(code=1, reason="boom"), reply_to=message)
                delay = 0.0
            else:
                reply = Message(RecordDict(), reply_to=message)
            self.due[message_id] = (self.clock.now + float(delay), reply)
            self._report_wire(message, 100)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ready = [i for i in message_ids if i in self.due and self.due[i][0] <= self.clock.now]
        replies = [self.due.pop(i)[1] for i in ready]
        for reply in replies:
            self._report_wire(reply, 1000)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise AssertionError("the ScheduledGrid must schedule training rounds itself")

    def _abandon(self, message_ids: list[str]) -> None:
        self.abandoned.extend(message_ids)
        for message_id in message_ids:
            self.late_due[message_id] = self.due.pop(message_id, (math.inf, None))[0]

    @property
    def late_replies(self) -> int | None:
        if not self.can_abandon:
            return None
        return sum(when <= self.clock.now for when in self.late_due.values())


def _grid(delays: dict[int, float | str], schedule: Schedule, **kwargs) -> tuple[ScheduledGrid, FakeGrid]:
    clock = FakeClock()
    inner = FakeGrid(clock, delays, can_abandon=kwargs.pop("can_abandon", False))
    return ScheduledGrid(inner, schedule, clock=clock, pause=clock.pause, poll_s=0.01, **kwargs), inner


def _train(grid: ScheduledGrid, timeout: float | None = 600.0) -> list[Message]:
    messages = [Message(RecordDict(), node, MessageType.TRAIN) for node in grid.get_node_ids()]
    return list(grid.send_and_receive(messages, timeout=timeout))


def _senders(replies: list[Message]) -> list[int]:
    return [r.metadata.src_node_id for r in replies]


def test_schedule_is_shared_with_the_clock_and_validated():
    assert ClockSchedule is Schedule
    with pytest.raises(ConfigError):
        Schedule(over_select=0.5)
    with pytest.raises(ConfigError):
        Schedule(deadline_s=0.0)
    with pytest.raises(ConfigError, match="memory_aware needs training_memory_bytes"):
        Schedule(memory_aware=True)  # it silently let a device of 0 bytes train (heterogeneity sweep)


def test_a_node_that_never_answers_delays_the_round_by_the_deadline_only():
    grid, _ = _grid({1: 0.5, 2: 1.0, 3: math.inf}, Schedule(deadline_s=3.0))
    replies = _train(grid)
    assert _senders(replies) == [1, 2]
    figures = grid.take_round()
    assert figures["schedule_round_s"] == pytest.approx(3.0, abs=0.02)
    assert figures["schedule_deadline_s"] == 3.0
    assert (figures["schedule_accepted"], figures["schedule_late"], figures["schedule_cut"]) == (2, 1, 0)


def test_without_a_deadline_the_round_timeout_bounds_the_wait():
    grid, _ = _grid({1: 0.5, 2: math.inf}, Schedule())
    assert _senders(_train(grid, timeout=2.0)) == [1]
    figures = grid.take_round()
    assert (
        figures["schedule_round_s"] == pytest.approx(2.0, abs=0.02) and "schedule_deadline_s" not in figures
    )


def test_a_round_everyone_answers_ends_at_the_last_reply():
    grid, _ = _grid({1: 0.5, 2: 1.0}, Schedule(deadline_s=10.0))
    assert _senders(_train(grid)) == [1, 2]
    assert grid.take_round()["schedule_round_s"] == pytest.approx(1.0, abs=0.02)


def test_over_selection_returns_after_the_first_m():
    grid, inner = _grid({1: 2.0, 2: 0.5, 3: math.inf, 4: 1.0}, Schedule(over_select=2.0), can_abandon=True)
    replies = _train(grid, timeout=None)  # without over-selection this would wait forever
    assert _senders(replies) == [2, 4]  # the first ceil(4 / 2) = 2, in arrival order
    figures = grid.take_round()
    assert figures["schedule_round_s"] == pytest.approx(1.0, abs=0.02)
    assert (figures["schedule_cut"], figures["schedule_late"]) == (2, 0)
    assert len(inner.abandoned) == 2  # the inner Grid was told to stop awaiting the other two


def test_error_replies_are_passed_on_but_do_not_count_towards_m():
    grid, _ = _grid({1: "error", 2: 0.5, 3: 1.0, 4: math.inf}, Schedule(over_select=2.0))
    replies = _train(grid, timeout=None)
    assert [r.has_error() for r in replies] == [False, False, True]
    assert _senders(replies) == [2, 3, 1]
    assert grid.take_round()["schedule_failed"] == 1


def test_adaptive_deadline_follows_recent_arrival_delays():
    # delays after round 1: 1.0, 2.0 and node 3's, missing at 100 s: their median is 2.0
    schedule = Schedule(deadline_s=100.0, adaptive_deadline=True, deadline_quantile=0.5, deadline_slack=1.5)
    grid, _ = _grid({1: 1.0, 2: 2.0, 3: math.inf}, schedule)
    _train(grid)
    assert grid.take_round()["schedule_round_s"] == pytest.approx(100.0, abs=0.02)  # the first round's value
    assert grid.current_deadline() == pytest.approx(1.5 * 2.0, abs=0.05)
    _train(grid)
    figures = grid.take_round()
    assert figures["schedule_deadline_s"] == pytest.approx(3.0, abs=0.05)
    assert figures["schedule_round_s"] == pytest.approx(figures["schedule_deadline_s"], abs=0.02)


def test_adaptive_deadline_grows_until_it_takes_in_the_slow_nodes():
    """Replies it cut off count at the round's length, so the deadline cannot settle on the fast nodes."""
    schedule = Schedule(deadline_s=1.0, adaptive_deadline=True, deadline_quantile=1.0, deadline_slack=1.5)
    grid, _ = _grid({1: 0.5, 2: 4.0}, schedule)
    deadlines, senders = [], []
    for _ in range(6):
        senders.append(_senders(_train(grid)))
        deadlines.append(grid.take_round()["schedule_deadline_s"])
    assert deadlines[:5] == pytest.approx([1.0, 1.5, 2.25, 3.375, 5.0625], abs=0.05)  # x1.5 a round
    assert senders[:4] == [[1]] * 4 and senders[4] == [1, 2]  # then node 2 fits
    assert deadlines[5] == pytest.approx(1.5 * 4.0, abs=0.1)  # and the deadline follows its delay


def test_the_deadline_quantile_ramps_to_its_final_value_over_the_rounds():
    """Fast rounds on the fast nodes first, then everyone (the quantile from 0.5 to 1.0 over 2 rounds)."""
    schedule = Schedule(
        deadline_s=100.0,
        adaptive_deadline=True,
        deadline_quantile=0.5,
        deadline_quantile_final=1.0,
        deadline_ramp_rounds=2,
        deadline_slack=1.0,
    )
    assert [schedule.quantile_at(n) for n in (0, 1, 2, 50)] == [0.5, 0.75, 1.0, 1.0]
    grid, _ = _grid({1: 1.0, 2: 2.0, 3: 3.0}, schedule)
    deadlines = []
    for _ in range(3):
        _train(grid)
        grid.take_round()
        deadlines.append(grid.current_deadline())
    # delays 1, 2, 3 s every round: their 0.75, then 1.0 quantile (1 round done, then 2)
    assert deadlines == pytest.approx([2.5, 3.0, 3.0], abs=0.05)
    with pytest.raises(ConfigError, match="deadline_quantile_final"):
        Schedule(deadline_quantile_final=1.5)


@pytest.mark.parametrize("can_abandon", [False, True], ids=["drained", "dropped-by-the-grid"])
def test_a_late_reply_never_reaches_a_later_round(can_abandon):
    """With a Grid that drops late replies itself (MqttGrid), the schedule counts what it dropped: over MQTT
    ``schedule_late_arrived`` was always 0."""
    # Node 2 answers 5 s after its instruction: after round 1's deadline, during round 2.
    grid, inner = _grid({1: 0.5, 2: 5.0}, Schedule(deadline_s=3.0), can_abandon=can_abandon)
    assert _senders(_train(grid)) == [1]
    grid.take_round()
    inner.delays[2] = math.inf  # round 2: node 2 is busy, only round 1's reply will come
    assert _senders(_train(grid)) == [1]  # round 1's late reply arrived meanwhile and was not delivered
    figures = grid.take_round()
    assert (figures["schedule_late"], figures["schedule_late_arrived"]) == (1, 1)
    assert "m2" not in inner.due  # pulled and discarded, or dropped by the Grid


def test_metering_sees_only_the_aggregated_replies_and_the_schedule_figures():
    grid, _ = _grid({1: 0.5, 2: math.inf}, Schedule(deadline_s=1.0))
    metered = MeteredGrid(grid)
    messages = [Message(RecordDict(), node, MessageType.TRAIN) for node in metered.get_node_ids()]
    list(metered.send_and_receive(messages, timeout=60.0))
    traffic = metered.take()
    assert (traffic.sampled, traffic.replied, traffic.bytes_down, traffic.bytes_up) == (2, 1, 200, 1000)
    assert traffic.clock["schedule_late"] == 1


def test_memory_aware_sampling_offers_only_nodes_whose_memory_holds_training():
    profiles = {
        1: DeviceProfile(memory_total_mb=4096, memory_available_mb=2048),
        2: DeviceProfile(memory_total_mb=512, memory_available_mb=100),
        # node 3 has not reported a profile: unknown memory is offered
    }
    schedule = Schedule(memory_aware=True, training_memory_bytes=1024 * 2**20)
    grid, _ = _grid({1: 0.5, 2: 0.5, 3: 0.5}, schedule, profiles=lambda: profiles)
    assert list(grid.get_node_ids()) == [1, 3]
    _train(grid)
    assert grid.take_round()["schedule_unfit"] == 1
    unaware, _ = _grid({1: 0.5, 2: 0.5}, Schedule(), profiles=lambda: profiles)
    assert list(unaware.get_node_ids()) == [1, 2]


def test_node_links_come_from_the_declared_links():
    link = LinkProfile(uplink_bytes_per_s=1e3, downlink_bytes_per_s=1e4)
    grid, _ = _grid({1: 0.5}, Schedule(), links=lambda: {1: link})
    assert grid.node_links() == {1: link}
    assert MeteredGrid(grid).node_links() == {1: link}
    bare, _ = _grid({1: 0.5}, Schedule())
    assert bare.node_links() == {}


def test_the_coordinator_reads_a_schedule_table(tmp_path):
    path = tmp_path / "coordinator.toml"
    path.write_text('state_dir = "s"\n[schedule]\ndeadline_s = 5\nover-select = 1.25\n')
    assert CoordinatorConfig.from_toml(path).service.schedule == Schedule(deadline_s=5.0, over_select=1.25)
    path.write_text('state_dir = "s"\n[schedule]\nover_select = 0.5\n')
    with pytest.raises(ConfigError, match="over_select"):
        CoordinatorConfig.from_toml(path)
