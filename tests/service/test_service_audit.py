"""The audit log tells the truth after any crash; nothing outside learns of a round before it is durable."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from service_helpers import reference_agent

from fedge.app import client_app as reference
from fedge.app.config import AppConfig
from fedge.app.coordinator import CoordinatorConfig, run_coordinator
from fedge.app.server_app import run_federated
from fedge.devices.profile import measure_device
from fedge.flower.compat import set_task_identity
from fedge.server import audit
from fedge.server.audit import AuditLog, counted_rounds, dropped_counts
from fedge.server.checkpoint import load_checkpoint, save_checkpoint
from fedge.server.profile_store import load_profiles, save_profiles
from fedge.server.service import ServiceConfig
from fedge.simulation.local_grid import LocalGrid


def _accept(log: AuditLog, node: str, server_round: int) -> None:
    log.write({"event": "accepted", "node": node, "round": str(server_round), "time": 0.0})


def test_only_committed_rounds_count_and_a_resume_voids_the_lost_round(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.start_run()
        for node in ("a", "b"):
            _accept(log, node, 1)
        log.commit(1)
        for node in ("a", "b"):
            _accept(log, node, 2)  # the coordinator is killed before round 2's checkpoint
    assert counted_rounds(path) == {"a": [1], "b": [1]}
    with AuditLog(path) as log:  # restarted with --resume from the checkpoint of round 1
        log.settle(completed_round=1)
        _accept(log, "a", 2)  # round 2 runs again; only a answers this time
        log.commit(2)
    assert counted_rounds(path) == {"a": [1, 2], "b": [1]}
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "void"] == [2]


def test_the_log_is_read_once_and_kept_up_with_its_own_writes(tmp_path: Path, monkeypatch) -> None:
    """Re-reading the whole log every round cost 0.7 s a round at 12 MB (long-run sweep)."""
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        _accept(log, "a", 1)
        log.commit(1)
        _accept(log, "b", 2)
    reads = []
    original = audit._scan
    monkeypatch.setattr(audit, "_scan", lambda p: reads.append(p) or original(p))
    with AuditLog(path) as log:  # a resumed coordinator
        assert log.accepted_nodes(2) == {"b"}
        _accept(log, "c", 2)
        assert log.accepted_nodes(2) == {"b", "c"}
        log.commit(2, ["c"])
        log.start_run()
        _accept(log, "d", 1)
        assert log.accepted_nodes(2) == set() and log.accepted_nodes(1) == {"d"}
        log.commit(1)
    assert len(reads) == 1
    assert counted_rounds(path) == {"d": [1]}


def test_a_crash_between_checkpoint_and_commit_keeps_the_round(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.start_run()
        _accept(log, "a", 1)  # checkpoint of round 1 written, then killed before the commit line
    with AuditLog(path) as log:
        log.settle(completed_round=1)
    assert counted_rounds(path) == {"a": [1]}


def test_a_fresh_run_starts_counting_again_and_torn_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.start_run()
        _accept(log, "a", 1)
        log.commit(1)
        log.start_run()
        _accept(log, "b", 1)
        log.commit(1)
    with path.open("a") as handle:
        handle.write('{"event": "accepted", "node": "c", "ro')  # torn by a crash
    assert counted_rounds(path) == {"b": [1]}


def test_listeners_hear_of_a_round_only_after_its_checkpoint(tmp_path: Path) -> None:
    """What status.json and progress displays are told is already in the checkpoint."""
    heard: list[tuple[int, int]] = []

    def checkpoint(server_round, arrays, history) -> None:
        save_checkpoint(tmp_path, server_round, arrays, history)

    def listener(metrics) -> None:
        heard.append((metrics.round, load_checkpoint(tmp_path).completed_round))

    set_task_identity(run_id=1)
    grid = LocalGrid(reference.app, 3, workers=1)
    try:
        run_federated(
            grid, AppConfig(rounds=2, local_epochs=1, min_nodes=3), [listener], on_round_end=checkpoint
        )
    finally:
        grid.shutdown()
    assert heard == [(1, 1), (2, 2)]


def test_a_commit_naming_nodes_counts_only_those(tmp_path: Path) -> None:
    """A strategy that screened out an accepted reply names the nodes it aggregated."""
    from fedge.protocol.fleet import flower_node_id

    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.start_run()
        for node in ("a", "b", "c"):
            _accept(log, node, 1)
        record = {flower_node_id("a"): 1, flower_node_id("b"): 1, flower_node_id("c"): 0}
        log.commit(1, log.counted_names(1, record))  # c's reply was rejected by screening
    assert counted_rounds(path) == {"a": [1], "b": [1]}


def test_a_resumed_coordinator_counts_the_runs_drops_from_the_log(tmp_path: Path) -> None:
    """status.json's dropped_replies had restarted from zero with every resume (the audit held them)."""
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.write(
            {"event": "rejected", "node": "old", "round": "1", "reason": "late", "count": 9, "time": 0.0}
        )
        log.start_run()  # a fresh run in the same directory: counting starts again
        for count in (1, 4):
            log.write(
                {
                    "event": "rejected",
                    "node": "a",
                    "round": "?",
                    "reason": "unknown-instruction",
                    "count": count,
                }
            )
        log.write({"event": "rejected", "node": "b", "round": "2", "reason": "late"})  # older logs: no count
        _accept(log, "a", 2)
    with path.open("a") as handle:
        handle.write("not json\n")
    assert dropped_counts(path) == {"unknown-instruction": 5, "late": 1}


def test_after_a_resume_the_first_round_reports_only_its_own_drops(mqtt, tmp_path: Path) -> None:
    """The run's earlier drops were added to the Grid's counts after the first round's baseline was taken:
    that round reported the run's whole total as its own (chaos sweep: 5 drops in round 7, 1 of them real)."""
    agent = reference_agent(mqtt(), tmp_path / "agent", "ann")
    agent.start()
    try:
        state_dir = tmp_path / "coordinator"
        state_dir.mkdir()
        save_profiles(state_dir / "profiles.json", {"bob": dataclasses.replace(measure_device(), cpus=64)})
        service = ServiceConfig(mqtt=mqtt(), state_dir=str(state_dir), wait_for_nodes_s=60.0)
        run_coordinator(
            CoordinatorConfig(service=service, app=AppConfig(rounds=1, min_nodes=1, export_every=0))
        )
        with AuditLog(state_dir / "audit.jsonl") as log:  # drops of the first process, reported late
            log.write(
                {"event": "rejected", "node": "x", "round": "?", "reason": "unknown-instruction", "count": 3}
            )
        app = AppConfig(rounds=2, min_nodes=1, export_every=0)
        history = run_coordinator(CoordinatorConfig(service=service, app=app), resume=True)
    finally:
        agent.close()
    assert [r.round for r in history.rounds] == [1, 2]
    assert "replies_dropped_unknown-instruction" not in history.rounds[1].extra
    status = json.loads((state_dir / "status.json").read_text())
    assert status["dropped_replies"] == {"unknown-instruction": 3}
    # profiles outlive the process that heard them (an agent sends its own once per connection): bob's,
    # heard by an earlier process, is known; ann's, if heard by now, is kept for the next
    assert "bob" in status["profiles"]
    kept = load_profiles(state_dir / "profiles.json")
    assert kept["bob"].cpus == 64 and set(kept) <= {"bob", "ann"}  # ann's too, if heard by the run's end


def test_a_rolled_back_round_counts_no_update_in_the_audit(mqtt, tmp_path: Path) -> None:
    """A round whose aggregate's loss blows up is undone; the audit must not say its updates counted."""
    agent = reference_agent(mqtt(), tmp_path / "agent", "huge", client_app="huge_update_app:app")
    agent.start()
    try:
        state_dir = tmp_path / "coordinator"
        service = ServiceConfig(mqtt=mqtt(), state_dir=str(state_dir), wait_for_nodes_s=60.0)
        app = AppConfig(rounds=3, local_epochs=1, min_nodes=1, export_every=0)
        history = run_coordinator(CoordinatorConfig(service=service, app=app))
    finally:
        agent.close()
    assert [r.extra.get("rolled_back", 0) for r in history.rounds] == [0, 1, 0]
    assert counted_rounds(state_dir / "audit.jsonl") == {"huge": [1, 3]}


def test_a_resume_settles_a_rolled_back_round_with_no_update_counted(tmp_path: Path) -> None:
    """The crash came between a rolled-back round's checkpoint and its commit line."""
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.start_run()
        _accept(log, "a", 1)
        log.commit(1)
        _accept(log, "a", 2)
        _accept(log, "a", 3)
        log.settle(completed_round=2, rolled_back={2})
    assert counted_rounds(path) == {"a": [1]}


def test_odd_lines_in_the_log_are_skipped_and_never_stop_the_coordinator(tmp_path: Path) -> None:
    """A round of 1e400 (OverflowError) or a node that is a list (TypeError outside the try) crashed the
    coordinator after every round's checkpoint, and every --resume, and `fedge status --audit`."""
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.start_run()
        _accept(log, "a", 1)
        for odd in (
            {"event": "commit", "round": 1e400, "nodes": ["a"]},
            {"event": "commit", "round": 1, "nodes": [["a"], {"b": 1}]},
            {"event": "accepted", "node": ["x"], "round": 1},
            {"event": "accepted", "node": "y", "round": True},
            {"event": "void", "round": -3},
            ["not", "an", "event"],
            {"event": 7, "round": 1},
        ):
            log._handle.write(json.dumps(odd) + "\n")  # as an edit or a damaged disk leaves them
        _accept(log, "b", 2)
        log.commit(2)
        assert log.counted_names(2, {}) == []
        log.settle(completed_round=2)
    assert counted_rounds(path) == {"b": [2]}  # round 1's commit named no valid node
