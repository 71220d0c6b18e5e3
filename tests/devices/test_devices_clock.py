"""The simulated clock on hand-computed cases, deadline/over-selection, and FedBuff's staleness."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fedge.config import ConfigError
from fedge.devices import (
    CATALOGUE,
    ClientProfile,
    ComputeProfile,
    LinkProfile,
    Update,
    buffered_schedule,
    bytes_moved,
    draw_disconnects,
    select_replies,
    staleness_weight,
    time_client,
    transfer,
)

COMPUTE = ComputeProfile(flops_per_s=1e9, memory_bytes=2**30, encode_bytes_per_s=1e8, decode_bytes_per_s=2e8)
LINK = LinkProfile(uplink_bytes_per_s=1e6, downlink_bytes_per_s=2e6, latency_s=0.1)
CLIENT = ClientProfile(COMPUTE, LINK, "test")
ROUND = {"download_bytes": 4e6, "train_flops": 3e9, "upload_bytes": 1e6, "model_bytes": 4e6}


def test_phases_add_up_by_hand():
    t = time_client(CLIENT, start_s=10.0, **ROUND)
    assert t.download_s == pytest.approx(0.1 + 4e6 / 2e6)  # 2.1
    assert t.decode_s == pytest.approx(4e6 / 2e8)  # 0.02
    assert t.compute_s == pytest.approx(3.0)
    assert t.encode_s == pytest.approx(4e6 / 1e8)  # 0.04
    assert t.upload_s == pytest.approx(0.1 + 1.0)
    assert t.arrival_s == pytest.approx(10 + 2.1 + 0.02 + 3 + 0.04 + 1.1)
    assert not t.cut_off and t.cut_off_phase == "" and t.resent_bytes == 0 and t.disconnects == 0


def test_measured_codec_times_override_the_profile():
    t = time_client(CLIENT, start_s=0.0, **ROUND, encode_s=0.5, decode_s=0.25)
    assert (t.encode_s, t.decode_s) == (0.5, 0.25)


def test_a_disconnect_charges_only_the_resent_window():
    seconds, resent = transfer(
        10e6, 1e6, latency_s=0.1, disconnects=2, resend_window_bytes=256 * 1024, reconnect_s=0.5
    )
    assert resent == 2 * 256 * 1024  # not the whole 10 MB again
    assert seconds == pytest.approx(0.1 + (10e6 + 2 * 262_144) / 1e6 + 2 * 0.5)
    assert transfer(1000, 1000, disconnects=1, resend_window_bytes=4096) == (2.0, 1000)  # at most the payload
    assert transfer(0, 1000, latency_s=5, disconnects=3) == (0.0, 0)


def test_disconnects_in_the_clock_are_seeded_and_resend_windows():
    link = LinkProfile(1e6, 1e6, disconnects_per_s=0.5, reconnect_s=1.0, resend_window_bytes=100_000)
    client = ClientProfile(COMPUTE, link)
    args = {"start_s": 0.0, "download_bytes": 0, "train_flops": 0, "upload_bytes": 4e6}
    timings = [time_client(client, **args, seed=(7, 1, c)) for c in range(400)]
    assert timings == [time_client(client, **args, seed=(7, 1, c)) for c in range(400)]
    for t in timings:
        assert t.resent_bytes == t.disconnects * 100_000
        expected, _ = transfer(
            4e6, 1e6, disconnects=t.disconnects, resend_window_bytes=100_000, reconnect_s=1.0
        )
        assert t.upload_s == pytest.approx(expected)
    # Poisson with mean 0.5/s x 4 s = 2 disconnects per upload.
    assert np.mean([t.disconnects for t in timings]) == pytest.approx(2.0, abs=0.2)
    rng = np.random.default_rng(0)
    assert draw_disconnects(LINK, 1e9, 1e6, rng) == 0  # a link without losses


def test_disconnects_per_mb():
    link = LinkProfile(1e6, 1e6, disconnects_per_mb=1.0)
    draws = [draw_disconnects(link, 3e6, 1e6, np.random.default_rng(s)) for s in range(500)]
    assert np.mean(draws) == pytest.approx(3.0, abs=0.25)


def test_client_cut_off_mid_upload_and_mid_download():
    upload_starts = 10 + 2.1 + 0.02 + 3 + 0.04
    t = time_client(CLIENT, start_s=10.0, **ROUND, away_s=upload_starts + 0.5)
    assert t.cut_off and t.cut_off_phase == "upload" and t.away_s == pytest.approx(upload_starts + 0.5)
    t = time_client(CLIENT, start_s=10.0, **ROUND, away_s=11.0)
    assert t.cut_off and t.cut_off_phase == "download"
    t = time_client(CLIENT, start_s=10.0, **ROUND, away_s=12.5)
    assert t.cut_off_phase == "compute"
    exact = time_client(CLIENT, start_s=10.0, **ROUND).arrival_s
    assert not time_client(CLIENT, start_s=10.0, **ROUND, away_s=exact).cut_off  # gone just after it replied


def test_catalogue_orders_clients_sensibly():
    rnd = {"start_s": 0.0, "download_bytes": 100_000, "train_flops": 1e9, "upload_bytes": 20_000}
    arrival = {name: time_client(p, **rnd).arrival_s for name, p in CATALOGUE.items()}
    assert arrival["server"] < arrival["jetson_nano_eth"] < arrival["pi4_wifi"] < arrival["nbiot_gateway"]
    assert arrival["nbiot_gateway"] > 40  # 100 kB down at 25 kbit/s (32 s) and 20 kB up at 20 kbit/s (8 s)


def test_deadline_selection():
    arrivals = {"a": 5.0, "b": 3.0, "c": 8.0, "d": math.inf}
    out = select_replies(arrivals, round_start_s=0.0, deadline_s=6.0)
    assert (out.accepted, out.late, out.cut_off, out.end_s) == (("b", "a"), ("c",), ("d",), 6.0)
    out = select_replies({"a": 1.0, "b": 2.0}, round_start_s=0.0, deadline_s=10.0)
    assert out.end_s == 2.0  # everyone replied: no need to wait for the deadline
    out = select_replies(arrivals, round_start_s=0.0)
    assert out.accepted == ("b", "a", "c") and out.end_s == 8.0


def test_a_reply_at_an_infinite_or_undefined_time_never_comes():
    """A link of 1e308 s latency passed validation, and its replies came at t = inf, "accepted"."""
    ok = time_client(CLIENT, start_s=0.0, **ROUND)
    never = dataclasses.replace(ok, arrival_s=math.inf)
    undefined = dataclasses.replace(ok, arrival_s=math.nan)
    out = select_replies({"ok": ok, "never": never, "nan": undefined}, round_start_s=0.0)
    assert out.accepted == ("ok",) and set(out.cut_off) == {"never", "nan"} and math.isfinite(out.end_s)


def test_a_client_cut_off_moved_only_the_share_of_the_transfer_it_was_there_for():
    timing = time_client(CLIENT, start_s=0.0, **ROUND)
    down, up = ROUND["download_bytes"], ROUND["upload_bytes"]
    assert bytes_moved(timing, down, up) == (down, up)
    never_there = dataclasses.replace(timing, cut_off=True, cut_off_phase="download", away_s=0.0)
    assert bytes_moved(never_there, down, up) == (0, 0)
    half_down = dataclasses.replace(
        timing, cut_off=True, cut_off_phase="download", away_s=timing.download_s / 2
    )
    assert bytes_moved(half_down, down, up) == (down // 2, 0)
    upload_start = timing.arrival_s - timing.upload_s
    mid_upload = dataclasses.replace(
        timing, cut_off=True, cut_off_phase="upload", away_s=upload_start + timing.upload_s / 4
    )
    assert bytes_moved(mid_upload, down, up) == (down, int(up * 0.25))


def test_a_link_figure_whose_sums_would_overflow_is_refused():
    for field in ("latency_s", "reconnect_s"):
        with pytest.raises(ConfigError, match=rf"{field} must be in \[0, 1e\+06\] seconds, got 1e\+308"):
            LinkProfile(1e6, 1e6, **{field: 1e308})


def test_over_selection_keeps_the_first_k():
    arrivals = {"a": 105.0, "b": 103.0, "c": 108.0, "d": 101.0}
    out = select_replies(arrivals, round_start_s=100.0, keep=2)
    assert out.accepted == ("d", "b") and out.late == ("a", "c") and out.end_s == 103.0
    out = select_replies(arrivals, round_start_s=100.0, keep=3, deadline_s=4.0)
    assert out.accepted == ("d", "b") and out.end_s == 104.0  # K not reached: the deadline ends it


def test_selection_uses_client_timings():
    ok = time_client(CLIENT, start_s=0.0, **ROUND)
    gone = time_client(CLIENT, start_s=0.0, **ROUND, away_s=1.0)
    out = select_replies({"ok": ok, "gone": gone}, round_start_s=0.0, deadline_s=100.0)
    assert out.accepted == ("ok",) and out.cut_off == ("gone",) and out.end_s == 100.0


def test_a_round_everyone_left_lasts_until_the_last_went_away():
    """With no deadline it ended at its start: the clock stood still, and the run repeated the round."""
    early = time_client(CLIENT, start_s=10.0, **ROUND, away_s=11.0)
    later = time_client(CLIENT, start_s=10.0, **ROUND, away_s=12.5)
    out = select_replies({"a": early, "b": later}, round_start_s=10.0)
    assert out.accepted == () and out.cut_off == ("a", "b") and out.end_s == 12.5


def test_fedbuff_flushes_and_staleness():
    updates = [
        ("A", 0.0, 1.0), ("B", 0.0, 2.0), ("C", 0.0, 3.0), ("D", 1.5, 4.0),
        ("E", 2.5, 5.0), ("F", 4.5, 6.0), ("G", 0.0, 7.0),
    ]  # fmt: skip
    schedule = buffered_schedule(updates[::-1], buffer_size=2)  # input order does not matter
    assert [(f.time_s, f.version) for f in schedule.flushes] == [(2.0, 1), (4.0, 2), (6.0, 3)]
    assert [[u.client for u in f.updates] for f in schedule.flushes] == [["A", "B"], ["C", "D"], ["E", "F"]]
    assert [f.staleness for f in schedule.flushes] == [(0, 0), (1, 1), (1, 0)]
    assert schedule.pending == (Update("G", 0.0, 7.0),)
    assert buffered_schedule(updates, 2, initial_version=10).flushes[-1].version == 13
    assert staleness_weight(3) == 0.5
    assert staleness_weight(np.array([0, 3])).tolist() == [1.0, 0.5]
