"""fedge bench faults: a seeded soak of crashes, restarts and a flooding node over real processes.

Each trial runs a real Mosquitto, ``agents`` device agents (``fedge agent`` processes) and the coordinator
service (``fedge coordinator``) with compressed uploads and downloads, for a few rounds of the reference
task. While it runs, one node with valid credentials floods its own outbox as an attacker would (a chunk
header claiming 300 MB, then hundreds of half-finished transfers), and at seeded random moments the bench

* kills ``kill -9`` an agent a random moment after an instruction reached it (mid-training or mid-upload),
  and starts it again;
* kills the coordinator at a random moment of a round, and restarts it with ``--resume``;
* restarts the broker.

Per trial it checks that the run completed (every round, exit status 0), that no update counted twice
(``fedge.server.audit.counted_rounds`` against the aggregated counts of the rounds the final model holds),
that no trained update was lost (every agent's error-feedback tallies: each delivered payload counted,
folded back into its residual or still pending, in agreement with the audit) and that no honest reply was
dropped by the transport because of the flood (per-sender drop counters in ``status.json``).

Headline: ``trials``, ``trials_completed`` (= trials), ``double_counted`` (= 0), ``lost_updates`` (= 0),
``honest_replies_dropped_under_flood`` (= 0).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from fedge.bench._common import emit, parse_args, timed
from fedge.client.agent import read_saved_context
from fedge.client.compression_mod import FEEDBACK_COUNTS_KEY, PENDING_KEY
from fedge.localnet import MosquittoBroker
from fedge.server.audit import counted_rounds
from fedge.simulation.mqtt_engine import write_agent_config
from fedge.transport.frames import encode_data
from fedge.transport.topics import Topics

FLEET = "sim"
FLOODER = "flood"
BUDGET_REASONS = ("memory", "partials", "budget-bytes", "budget-transfers", "evicted", "too-large")


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "fedge", *args], stdout=handle, stderr=subprocess.STDOUT, env=env
        )


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


class _Flooder(threading.Thread):
    """A node with valid credentials abusing its own outbox: huge claims and many half-finished transfers."""

    def __init__(self, broker_url: str, stop: threading.Event) -> None:
        super().__init__(name="flooder", daemon=True)
        self.port = int(broker_url.rsplit(":", 1)[1])
        self.stop_event, self.frames = stop, 0
        self.topic = Topics(FLEET).outbox(FLOODER)

    def run(self) -> None:
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"fedge-{FLEET}-{FLOODER}")
        client.reconnect_delay_set(0.1, 1.0)
        client.connect_async("127.0.0.1", self.port)
        client.loop_start()
        try:
            while not self.stop_event.is_set():
                deadline_ms = int((time.time() + 3600) * 1000)
                claim = encode_data(
                    uuid.uuid4().bytes, 0, 256 * 1024, 300_000_000, deadline_ms, b"x", b"\0" * 1024
                )
                client.publish(self.topic, claim, qos=1)
                for _ in range(300):  # half-finished 4 kB messages: chunk 0 of 2, never chunk 1
                    half = encode_data(uuid.uuid4().bytes, 0, 2048, 4096, deadline_ms, b"h", b"\0" * 2048)
                    client.publish(self.topic, half, qos=1)
                self.frames += 301
                self.stop_event.wait(2.0)
        finally:
            client.loop_stop()
            client.disconnect()


class _Trial:
    """One trial's processes and files."""

    def __init__(self, root: Path, broker: MosquittoBroker, agents: int, rounds: int, seed: int) -> None:
        self.root, self.broker, self.count, self.rounds = root, broker, agents, rounds
        self.rng = random.Random(seed)
        self.state = root / "coordinator"
        self.config = root / "coordinator.toml"
        self.config.write_text(
            f'state_dir = "{self.state}"\nround_timeout_s = 60.0\n'
            "wait_for_nodes_s = 300.0\nnode_stall_s = 60.0\n"
            f'[mqtt]\nbroker_url = "{broker.url}"\nfleet = "{FLEET}"\nreconnect_max_s = 0.5\n'
            f"[app]\nrounds = {rounds}\nmin_nodes = {agents}\nlocal_epochs = 1\nseed = {seed}\n"
            f'out_dir = "{root / "out"}"\ncodec = "topk:0.05+int8"\ndownlink_codec = "topk:0.2+int8"\n'
        )
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.faults: Counter[str] = Counter()

    def start_agent(self, index: int) -> None:
        config = write_agent_config(self.root, index, self.count, self.broker.url)
        self.agents[index] = _spawn(["agent", "--config", str(config)], self.root / f"agent-{index}.log")

    def start_coordinator(self, resume: bool = False) -> None:
        args = ["coordinator", "--config", str(self.config), "--log-json"] + (["--resume"] if resume else [])
        self.coordinator = _spawn(args, self.root / "coordinator.log")

    def completed_round(self) -> int:
        try:
            return int(json.loads((self.state / "status.json").read_text())["round"])
        except (OSError, ValueError, KeyError):
            return 0

    def working(self, index: int) -> bool:
        return any((self.root / f"agent-{index}" / "inbox").glob("*.msg"))

    def run(self) -> None:
        for index in range(self.count):
            self.start_agent(index)
        self.start_coordinator()
        victim = self.rng.randrange(self.count)
        _wait_for(lambda: self.working(victim), 300, f"agent {victim} to receive an instruction")
        time.sleep(self.rng.uniform(0.0, 1.0))  # somewhere in training or upload
        self._kill_agent(victim)
        crash_round = self.rng.randrange(1, self.rounds - 1)  # rounds follow the restart for the broker fault
        _wait_for(lambda: self.completed_round() >= crash_round, 300, f"round {crash_round}")
        _wait_for(lambda: any(self.working(i) for i in range(self.count)), 120, "the next round to start")
        time.sleep(self.rng.uniform(0.0, 1.5))  # a random moment of the round
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait(10)
        self.faults["coordinator_killed"] += 1
        self.start_coordinator(resume=True)
        _wait_for(
            lambda: any(self.working(i) for i in range(self.count)) or self.coordinator.poll() is not None,
            300,
            "a round after the restart",
        )
        time.sleep(self.rng.uniform(0.0, 1.0))
        if self.coordinator.poll() is None:  # it may have finished the last round in the meantime
            self.broker.restart()
            self.faults["broker_restarted"] += 1
        self.coordinator.wait(timeout=600)

    def _kill_agent(self, index: int) -> None:
        self.agents[index].send_signal(signal.SIGKILL)
        self.agents[index].wait(10)
        self.faults["agent_killed"] += 1
        self.start_agent(index)

    def stop(self) -> None:
        for process in [*self.agents.values(), self.coordinator]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*self.agents.values(), self.coordinator]:
            if process is not None:
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def outcome(self) -> dict[str, Any]:
        """What the trial left behind: completion, double counting, lost updates, flood damage."""
        code = self.coordinator.returncode if self.coordinator else None
        try:
            rows = json.loads((self.root / "out" / "metrics.json").read_text())["rounds"]
        except (OSError, ValueError, KeyError):
            rows = []
        completed = code == 0 and [r["round"] for r in rows] == list(range(1, self.rounds + 1))
        counted = counted_rounds(self.state / "audit.jsonl")
        per_round = Counter(r for rounds in counted.values() for r in rounds)
        aggregated = {r["round"]: int(r.get("accepted", r["clients_replied"])) for r in rows}
        double = sum(max(0, per_round[r] - aggregated.get(r, 0)) for r in per_round)
        missing = sum(max(0, n - per_round[r]) for r, n in aggregated.items())
        lost, double_in_agents = self._conservation(counted)
        return {
            "completed": completed,
            "exit_code": code,
            "double_counted": double + double_in_agents,
            "audit_missing": missing,
            "lost_updates": lost,
            "honest_dropped": self._honest_dropped(),
            "flood_dropped": self._flood_dropped(),
            **self.faults,
        }

    def _status(self) -> dict[str, Any]:
        try:
            return json.loads((self.state / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def _honest_dropped(self) -> int:
        drops = self._status().get("transport_drops", {})
        return sum(
            count
            for sender, reasons in drops.items()
            if sender != FLOODER
            for reason, count in reasons.items()
            if reason in BUDGET_REASONS
        )

    def _flood_dropped(self) -> int:
        return sum(self._status().get("transport_drops", {}).get(FLOODER, {}).values())

    def _conservation(self, counted: dict[str, list[int]]) -> tuple[int, int]:
        """(lost, double) updates, from every agent's saved error-feedback tallies against the audit.

        An agent's compression mod tallies each payload it delivered as counted, folded back into the
        residual, lost, or still pending. Conservation holds when no payload is lost and the tallies add up;
        and the coordinator's audit must agree with the agent: it counted at least what the agent was told
        counted, and at most that plus the one payload still pending. More is an update in the model *and*
        back in the residual (counted twice); less is one the agent dropped that the model lacks (lost).
        """
        lost = double = 0
        for index in range(self.count):
            context = read_saved_context(self.root / f"agent-{index}")
            state = context.state if context is not None else {}
            tally = state.get(FEEDBACK_COUNTS_KEY) if context is not None else None
            delivered, told, folded, refused, dropped = (
                (int(tally.get(k, 0)) for k in ("delivered", "counted", "folded", "discarded", "lost"))
                if tally
                else (0, 0, 0, 0, 0)
            )
            pending = int(PENDING_KEY in state)
            lost += dropped + abs(delivered - told - folded - refused - dropped - pending)
            audited = len(counted.get(f"sim-{index}", []))
            double += max(0, audited - told - pending)
            lost += max(0, told - audited)
        return lost, double


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    trials, agents, rounds = (1, 10, 4) if args.quick else (20, 10, 4)
    results = []
    with timed() as total:
        for trial in range(trials):
            root = Path(tempfile.mkdtemp(prefix=f"fedge-faults-{trial}-"))
            stop = threading.Event()
            with MosquittoBroker(root / "broker") as broker:
                flooder = _Flooder(broker.url, stop)
                flooder.start()
                run = _Trial(root, broker, agents, rounds, seed=trial)
                try:
                    with timed() as t:
                        run.run()
                except TimeoutError as err:
                    run.faults["timeout"] += 1
                    print(f"trial {trial}: {err}", file=sys.stderr)
                finally:
                    stop.set()
                    run.stop()
                    flooder.join(5)
                outcome = {
                    "trial": trial,
                    "wall_s": t.get("wall_s", 0.0),
                    **run.outcome(),
                    "flood_frames": flooder.frames,
                }
                results.append(outcome)
                print(json.dumps(outcome), file=sys.stderr, flush=True)
    headline = {
        "trials": trials,
        "trials_completed": sum(r["completed"] for r in results),
        "double_counted": sum(r["double_counted"] for r in results),
        "lost_updates": sum(r["lost_updates"] for r in results),
        "honest_replies_dropped_under_flood": sum(r["honest_dropped"] for r in results),
    }
    result = {
        "agents": agents,
        "rounds": rounds,
        "wall_s": total["wall_s"],
        "audit_missing": sum(r["audit_missing"] for r in results),
        "flood_frames_dropped": sum(r["flood_dropped"] for r in results),
        "trials_detail": results,
        "headline": headline,
    }
    rows = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in results]
    emit(
        result,
        as_json=args.json,
        title="faults soak: agents, coordinator and broker killed, one node flooding",
        rows=rows,
    )


if __name__ == "__main__":
    main()
