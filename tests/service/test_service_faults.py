"""Faults in one run, all real processes: an agent killed mid-round, the broker restarted mid-round, the
coordinator killed after round 2 and resumed. Every round finishes and no update counts twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from fedge.localnet import MosquittoBroker
from fedge.server.audit import counted_rounds
from fedge.simulation.mqtt_engine import write_agent_config

AGENTS = 4
ROUNDS = 5


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "fedge", *args], stdout=handle, stderr=subprocess.STDOUT, env=env
        )


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


class _Fleet:
    def __init__(self, root: Path, broker: MosquittoBroker) -> None:
        self.root, self.broker = root, broker
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.config = root / "coordinator.toml"
        self.state = root / "coordinator"
        self.config.write_text(
            f'state_dir = "{self.state}"\nround_timeout_s = 60.0\nwait_for_nodes_s = 120.0\n'
            f'[mqtt]\nbroker_url = "{broker.url}"\nfleet = "sim"\nreconnect_max_s = 0.5\n'
            f'[app]\nrounds = {ROUNDS}\nmin_nodes = {AGENTS}\nlocal_epochs = 8\nout_dir = "{root / "out"}"\n'
            'codec = "topk:0.05+int8"\ndownlink_codec = "topk:0.2+int8"\n'
        )
        self.coordinator: subprocess.Popen[bytes] | None = None

    def start_agent(self, index: int) -> None:
        config = write_agent_config(self.root, index, AGENTS, self.broker.url)
        self.agents[index] = _spawn(["agent", "--config", str(config)], self.root / f"agent-{index}.log")

    def start_coordinator(self, resume: bool = False) -> None:
        args = ["coordinator", "--config", str(self.config), "--log-json"] + (["--resume"] if resume else [])
        self.coordinator = _spawn(args, self.root / "coordinator.log")

    def inbox(self, index: int) -> list[Path]:
        return list((self.root / f"agent-{index}" / "inbox").glob("*.msg"))

    def completed_round(self) -> int:
        try:
            return json.loads((self.state / "status.json").read_text())["round"]
        except (OSError, ValueError, KeyError):
            return 0

    def stop(self) -> None:
        for process in [*self.agents.values(), self.coordinator]:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)


@pytest.mark.slow
def test_agent_broker_and_coordinator_faults_in_one_run(tmp_path):
    with MosquittoBroker(tmp_path / "broker") as broker:
        fleet = _Fleet(tmp_path, broker)
        try:
            for index in range(AGENTS):
                fleet.start_agent(index)
            fleet.start_coordinator()

            # 1. kill -9 an agent while it works on an instruction (received, reply not yet sent), restart it
            _wait_for(lambda: fleet.inbox(0), 180, "agent 0 to receive an instruction")
            fleet.agents[0].send_signal(signal.SIGKILL)
            fleet.agents[0].wait(10)
            fleet.start_agent(0)

            # 2. kill -9 the coordinator once round 2 is checkpointed, restart it with --resume
            _wait_for(lambda: fleet.completed_round() >= 2, 240, "round 2", poll=0.05)
            fleet.coordinator.send_signal(signal.SIGKILL)
            fleet.coordinator.wait(10)
            killed_after = fleet.completed_round()
            fleet.start_coordinator(resume=True)

            # 3. restart the broker while an agent works on a later round
            _wait_for(
                lambda: fleet.inbox(1) and fleet.completed_round() >= killed_after, 240, "a later round"
            )
            broker.restart()

            assert fleet.coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[
                -3000:
            ]
        finally:
            fleet.stop()

    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [r["round"] for r in metrics["rounds"]] == list(range(1, ROUNDS + 1))
    assert all(r["clients_replied"] >= 1 for r in metrics["rounds"])
    # What counted, from the log: each node at most once per round, every round by someone, and per round
    # exactly as many updates as the metrics of the model the coordinator holds say were aggregated.
    counted = counted_rounds(fleet.state / "audit.jsonl")
    per_round = Counter(r for rounds in counted.values() for r in rounds)
    assert set(per_round) == set(range(1, ROUNDS + 1))
    assert [per_round[r["round"]] for r in metrics["rounds"]] == [r["accepted"] for r in metrics["rounds"]]
    audit = subprocess.run(
        [sys.executable, "-m", "fedge", "status", "--config", str(fleet.config), "--audit", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(audit.stdout) == counted
    logs = (tmp_path / "coordinator.log").read_text().splitlines()
    records = [json.loads(line) for line in logs if line.startswith("{")]
    assert any(r["message"].startswith("resuming after round") for r in records)
    status = subprocess.run(
        [sys.executable, "-m", "fedge", "status", "--config", str(fleet.config), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(status.stdout)["round"] == ROUNDS


@pytest.mark.slow
def test_a_fedbuff_coordinator_killed_after_an_aggregation_resumes_from_its_checkpoint(tmp_path):
    """Buffered asynchronous aggregation (K = 2 of C = 3 in flight) with compressed updates: the
    coordinator is killed once aggregation 2 is checkpointed and restarted with --resume; versions go on
    from the checkpoint and the run completes."""
    with MosquittoBroker(tmp_path / "broker") as broker:
        fleet = _Fleet(tmp_path, broker)
        config = fleet.config.read_text().replace(
            f"rounds = {ROUNDS}\n", 'rounds = 6\nstrategy = "fedbuff"\nbuffer_size = 2\nconcurrency = 3\n'
        )
        fleet.config.write_text(config.replace(f"min_nodes = {AGENTS}", "min_nodes = 3"))
        try:
            for index in range(3):
                fleet.start_agent(index)
            fleet.start_coordinator()
            _wait_for(lambda: fleet.completed_round() >= 2, 240, "aggregation 2", poll=0.05)
            fleet.coordinator.send_signal(signal.SIGKILL)
            fleet.coordinator.wait(10)
            killed_after = fleet.completed_round()
            fleet.start_coordinator(resume=True)
            assert fleet.coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[
                -3000:
            ]
        finally:
            fleet.stop()

    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert 2 <= killed_after < 6  # killed mid-run: the resumed coordinator ran the rest
    assert [r["round"] for r in metrics["rounds"]] == [1, 2, 3, 4, 5, 6]
    assert [r["version"] for r in metrics["rounds"]] == [1, 2, 3, 4, 5, 6]
    assert all(r["accepted"] >= 1 for r in metrics["rounds"][killed_after:])
    logs = (tmp_path / "coordinator.log").read_text().splitlines()
    records = [json.loads(line) for line in logs if line.startswith("{")]
    assert any(r["message"] == f"resuming after round {killed_after}" for r in records)
