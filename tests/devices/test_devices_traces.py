"""FedScale trace readers (safe unpickling), the availability queries, and synthetic traces."""

from __future__ import annotations

import logging
import math
import os
import pickle
import re

import numpy as np
import pytest

from fedge.devices import (
    CATALOGUE,
    AvailabilityTrace,
    Capacity,
    TraceError,
    diurnal_trace,
    random_trace,
    read_availability,
    read_capacity,
)

TRACE = {
    1: {"duration": 100, "active": [10, 50], "inactive": [20, 90], "finish_time": 100},
    2: {"duration": 100, "active": [0], "inactive": [100], "finish_time": 100},  # always there
    3: {"duration": 100, "active": [0, 90], "inactive": [10, 100], "finish_time": 100},  # wraps around
    4: {"duration": 100, "active": [], "inactive": [], "finish_time": 100},  # never there
}


def write(tmp_path, obj, protocol=pickle.HIGHEST_PROTOCOL, name="trace.pkl"):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_reads_fedscale_availability(tmp_path, protocol):
    trace = read_availability(write(tmp_path, TRACE, protocol))
    assert trace.clients == (1, 2, 3, 4)
    assert trace.is_available(1, 15) and not trace.is_available(1, 25) and not trace.is_available(1, 20)
    assert trace.is_available(1, 115)  # loops modulo finish_time
    assert trace.available_until(1, 15) == 20
    assert trace.available_until(1, 215) == 220
    assert trace.available_until(1, 25) == 25  # away now
    assert trace.next_available(1, 25) == 50
    assert trace.next_available(1, 95) == 110  # next loop
    assert trace.next_available(1, 55) == 55
    assert trace.available_until(2, 5) == math.inf
    assert trace.available_until(3, 95) == 110  # [90, 100) continues into [0, 10) of the next loop
    assert trace.next_available(4, 5) == math.inf and not trace.is_available(4, 5)
    assert trace.available(15).tolist() == [True, True, False, False]
    assert trace.fraction_available(5) == 0.5  # clients 2 and 3
    with pytest.raises(KeyError, match="client 9"):
        trace.is_available(9, 0)


def test_reads_fedscale_capacity(tmp_path):
    caps = read_capacity(write(tmp_path, {7: {"computation": 50.0, "communication": 800}}))
    assert caps == {7: Capacity(50.0, 800.0)}
    profile = caps[7].to_profile(CATALOGUE["phone_lte"], reference_forward_flops=1e7)
    assert profile.compute.flops_per_s == pytest.approx(2e8)  # 1e7 FLOPs per 50 ms
    assert profile.link.uplink_bytes_per_s == profile.link.downlink_bytes_per_s == 100_000
    assert profile.compute.memory_bytes == CATALOGUE["phone_lte"].compute.memory_bytes


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("reader", [read_availability, read_capacity])
def test_a_pickle_naming_os_system_is_refused(tmp_path, reader):
    marker = tmp_path / "pwned"
    path = write(tmp_path, {1: Exploit(marker)})
    with pytest.raises(TraceError, match="system"):
        reader(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({1: {"computation": np.float64(1.0), "communication": 1.0}}, "numpy"),
        ({1: {"computation": 1.0}}, "lacks 'communication'"),
        ([1, 2], "must be a dict"),
        ({1: {"computation": -1.0, "communication": 1.0}}, "non-positive"),
    ],
)
def test_bad_capacity_traces(tmp_path, obj, message):
    with pytest.raises(TraceError, match=message):
        read_capacity(write(tmp_path, obj))


def test_bad_availability_traces(tmp_path):
    with pytest.raises(TraceError, match="equal length"):
        read_availability(write(tmp_path, {1: {"active": [1], "inactive": [], "finish_time": 5}}))
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle")
    with pytest.raises(TraceError, match="is not a pickle"):
        read_availability(tmp_path / "junk.pkl")
    (tmp_path / "cut.pkl").write_bytes(pickle.dumps(TRACE)[:40])  # a pickle cut short
    with pytest.raises(TraceError, match="not a valid pickle"):
        read_availability(tmp_path / "cut.pkl")
    with pytest.raises(TraceError, match="more than"):
        read_availability(write(tmp_path, TRACE), max_bytes=10)
    for active, inactive in [([30], [10]), ([-100], [-50]), ([10], [10])]:  # reversed, negative, empty
        with pytest.raises(TraceError, match="want 0 <= active < inactive"):
            read_availability(
                write(tmp_path, {1: {"active": active, "inactive": inactive, "finish_time": 99}})
            )
    with pytest.raises(TraceError, match="negative finish_time"):
        read_availability(write(tmp_path, {1: {"active": [1], "inactive": [2], "finish_time": -5}}))
    with pytest.raises(TraceError, match="has no clients"):
        read_availability(write(tmp_path, {}))
    path = write(tmp_path, {1: {"active": [1], "inactive": [math.nan], "finish_time": 5}})
    with pytest.raises(TraceError, match=f"^{re.escape(str(path))}: client 1 inactive must be a finite"):
        read_availability(path)  # it named no file, unlike every other error here


def test_one_entry_named_by_every_client_counts_for_each_against_the_interval_cap(tmp_path, monkeypatch):
    """A pickle stores a shared object once: a 460 kB file whose 20,000 clients named one list of 20,000
    intervals stood for 400 million, and reading it ran out of memory (fleet-input sweep). The cap counts
    every use; the refusal comes before the intervals are built."""
    import fedge.devices.traces as traces

    monkeypatch.setattr(traces, "MAX_TRACE_INTERVALS", 1_000)
    shared = {"active": list(range(0, 200, 2)), "inactive": list(range(1, 201, 2)), "finish_time": 300}
    path = write(tmp_path, dict.fromkeys(range(50), shared))  # 50 x 100 intervals in a file of a few kB
    assert path.stat().st_size < 5_000
    with pytest.raises(TraceError, match="5,000 availability intervals, more than 1,000"):
        read_availability(path)
    assert len(read_availability(write(tmp_path, dict.fromkeys(range(10), shared))).clients) == 10


def test_untrusted_values_are_named_in_a_short_line(tmp_path):
    """An integer too large for a float, a list nested deeper than Python recurses, a 20 MB string: each is
    refused in one short line, as any other bad value (they had raised OverflowError and RecursionError,
    or echoed the whole string)."""
    for value in (10**400, _NestedList(100_000), "A" * 20_000_000):
        path = tmp_path / "trace.pkl"
        path.write_bytes(_pickled_entry(value))
        with pytest.raises(TraceError, match="client 0 active must be a finite number") as refused:
            read_availability(path)
        assert len(str(refused.value)) < 300 + len(str(path)) and "\n" not in str(refused.value)
    with pytest.raises(TraceError, match="computation must be a finite number"):
        read_capacity(write(tmp_path, {"A" * 10_000: {"computation": 10**400, "communication": 1.0}}))


class _NestedList:
    """A list nested ``depth`` deep, as a pickle holds it (pickle itself recurses to write one)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def _pickled_entry(active_value: object) -> bytes:
    """A trace pickle ``{0: {"inactive": [5.0], "finish_time": 10.0, "active": [active_value]}}``, written
    opcode by opcode, so that a value pickle cannot write (a list nested past Python's recursion) fits."""

    def body(obj: object) -> bytes:  # the opcodes that push ``obj`` (protocol 2, no PROTO, no STOP)
        return pickle.dumps(obj, protocol=2)[2:-1]

    if isinstance(active_value, _NestedList):  # EMPTY_LIST n times, then APPEND each into the one below
        value = b"]" * active_value.depth + b"a" * (active_value.depth - 1)
    else:
        value = body(active_value)
    entry = body({"inactive": [5.0], "finish_time": 10.0}) + body("active") + b"]" + value + b"as"
    return b"\x80\x02}" + body(0) + entry + b"s."


def test_intervals_after_the_loops_end_are_said_to_leave_a_client_never_available(tmp_path, caplog):
    trace = {1: {"active": [5000], "inactive": [5100], "finish_time": 100}, 2: TRACE[next(iter(TRACE))]}
    with caplog.at_level("WARNING", logger="fedge"):
        read = read_availability(write(tmp_path, trace))
    assert not read.available(0.0)[0] and read.next_available(1, 0.0) == math.inf
    assert "1 of 2 clients (first 1) are available only after their finish_time" in caplog.text


def test_remap_is_seeded():
    trace = AvailabilityTrace({c: [(c, c + 1)] for c in range(10)}, 20.0)
    a, b = trace.remap(5, seed=1), trace.remap(5, seed=1)
    assert a.clients == (0, 1, 2, 3, 4)
    assert [a.next_available(c, 0) for c in range(5)] == [b.next_available(c, 0) for c in range(5)]
    assert len({a.next_available(c, 0) for c in range(5)}) == 5  # distinct trace clients


def test_a_trace_of_fewer_clients_than_the_run_is_reused_with_a_warning(caplog):
    """The docs promised distinct trace clients; a trace of 5 for a run of 20 was reused without a word."""
    trace = AvailabilityTrace({c: [(c, c + 1)] for c in range(5)}, 20.0)
    with caplog.at_level(logging.WARNING, logger="fedge.devices.traces"):
        remapped = trace.remap(20, seed=0)
    assert len(remapped.clients) == 20
    assert "holds 5 clients for 20 run clients" in caplog.text
    caplog.clear()
    trace.remap(5, seed=0)
    assert "run clients" not in caplog.text


def test_random_trace_available_fraction():
    trace = random_trace(400, mean_on_s=1800, mean_off_s=5400, period_s=2 * 86_400, seed=1)
    times = np.linspace(0, 2 * 86_400, 97)[:-1]
    fractions = np.array([trace.fraction_available(t) for t in times])
    assert abs(fractions.mean() - 0.25) < 0.03
    assert fractions.max() < 0.5  # at any moment at least half the clients are away
    again = random_trace(400, mean_on_s=1800, mean_off_s=5400, period_s=2 * 86_400, seed=1)
    assert all(np.array_equal(trace.available(t), again.available(t)) for t in times[:10])
    assert [trace.is_available(c, 3600.0) for c in range(400)] == trace.available(3600.0).tolist()


def test_diurnal_trace_follows_the_day():
    trace = diurnal_trace(500, mean_availability=0.3, amplitude=0.2, peak_hour=22, seed=2)
    hours = np.arange(0, 24, 0.5)
    fractions = np.array([trace.fraction_available(h * 3600) for h in hours])
    assert abs(fractions.mean() - 0.3) < 0.04
    assert fractions[hours == 22][0] > 0.4 > 0.2 > fractions[hours == 10][0]
    assert fractions.max() <= 0.55
    # It loops with a one-day period.
    assert np.array_equal(trace.available(3600.0), trace.available(3600.0 + 86_400))


def test_periods_that_are_not_whole_seconds_keep_their_intervals_exact():
    """An interval that runs to the end of a 1000.1 s loop ended at 1000.0999999999999 for a quarter of the
    clients (their shared-line offset subtracted back), so always-available clients were cut off each loop."""
    period = 1000.1
    always = AvailabilityTrace({c: [(0.0, period)] for c in range(200)}, period)
    assert all(always.available_until(c, 5.0) == math.inf for c in range(200))
    wrap = AvailabilityTrace({c: [(0.0, period / 3), (period / 2, period)] for c in range(200)}, period)
    assert all(
        wrap.available_until(c, 0.75 * period) == pytest.approx(period + period / 3) for c in range(200)
    )
    assert all(wrap.next_available(c, 0.4 * period) == pytest.approx(period / 2) for c in range(200))
    remapped = wrap.remap(50, seed=1)
    assert all(remapped.available_until(c, 0.75 * period) == pytest.approx(period * 4 / 3) for c in range(50))


def test_a_file_that_is_not_a_pickle_is_named_as_such(tmp_path):
    """A TOML file given as the trace spelled pickle opcodes: 'trace pickle names lients = 3.rounds = 2'."""
    path = tmp_path / "fleet.toml"
    path.write_text("clients = 3\nrounds = 2\n")
    with pytest.raises(TraceError, match=r"fleet\.toml is not a pickle"):
        read_availability(path)


def test_periods_too_long_to_tell_seconds_apart_are_refused():
    """Laid end to end on one float64 line, periods of 1e16 s merged neighbouring clients' intervals: 20
    always-available clients showed as 1 available."""
    from fedge.devices.traces import TraceError

    assert all(
        AvailabilityTrace({c: [(0.0, 1e14)] for c in range(20)}, 1e14).is_available(c, 5.0) for c in range(20)
    )
    with pytest.raises(TraceError, match="periods add up to 2e\\+17 s"):
        AvailabilityTrace({c: [(0.0, 1e16)] for c in range(20)}, 1e16)
