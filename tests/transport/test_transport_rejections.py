"""Dropped replies are counted per node and reported at a bounded rate: a flood cannot fill the disk."""

from __future__ import annotations

from fedge.transport.rejections import RejectionLog


def test_the_first_drop_is_reported_at_once_and_a_flood_once_an_interval_with_its_count():
    rejections = RejectionLog(interval_s=60.0)
    (first,) = rejections.drop("mallory", "3", "undecodable", "bad magic", now_s=0.0)
    assert (first.node, first.server_round, first.count, first.total, first.detail) == (
        "mallory",
        "3",
        1,
        1,
        "bad magic",
    )
    flood = [
        rejections.drop("mallory", "?", "undecodable", f"junk {i}", now_s=1.0 + i / 1000) for i in range(1499)
    ]
    assert not any(flood)  # held back: within the interval of the first report
    (other,) = rejections.drop("alice", "3", "late", "reply to 'x'", now_s=2.0)  # another node: its own pair
    assert other.node == "alice" and other.total == 1
    assert rejections.flush(now_s=59.0) == []
    (summary,) = rejections.flush(now_s=61.0)
    assert (summary.count, summary.total, summary.detail) == (1499, 1500, "junk 1498")
    assert rejections.most_dropped(top=1) == {"mallory": {"undecodable": 1500}}


def test_what_is_held_back_is_reported_when_the_coordinator_stops():
    rejections = RejectionLog(interval_s=60.0)
    rejections.drop("n1", "1", "late", "a", now_s=0.0)
    rejections.drop("n1", "1", "late", "b", now_s=1.0)
    (last,) = rejections.flush_all()
    assert (last.count, last.total, last.detail) == (1, 2, "b")
    assert rejections.flush_all() == []


def test_invented_senders_beyond_the_cap_share_one_counter():
    rejections = RejectionLog(max_nodes=2)
    for i in range(5):
        rejections.drop(f"sybil{i}", "?", "unknown-instruction", "", now_s=float(i))
    assert rejections.most_dropped() == {
        "sybil0": {"unknown-instruction": 1},
        "sybil1": {"unknown-instruction": 1},
        "(other nodes)": {"unknown-instruction": 3},
    }
