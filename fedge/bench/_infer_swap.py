"""The hot-swap test of ``fedge bench inference``, over a real broker with a real ``fedge serve`` process.

A Mosquitto on a free port; the inference agent as its own process (the torch-free ``fedge serve``); a
requester sending one request every 10 ms (100 requests/s, paced by the clock, not by answers); the
coordinator, in a process of its own, publishing ``swaps`` new versions with
:class:`~fedge.transport.artifact_channel.ArtifactPublisher`, alternating two fp32 model files (two
different sets of weights; one variant per version, so a swap measures no variants). The coordinator is
not in the requester's process because on a fleet it never is: sharing a GIL with the publisher, the
requester took in its answers late while a version was being published (requests in flight then:
4-6 ms against 2-3 ms), a delay no device causes.

The agent's status gives each replica's swap window, from the moment it starts installing the new
version (built and warmed beside the old one; with two replicas, from the moment it asks for its turn, in
which it leaves the request group and fetches the version) to the moment the new session serves; the
transfer before it, from the moment the coordinator began publishing the version (or its header arrived,
if that is earlier; wall clock, the same machine's); and the write after it that keeps the model on disk
for a restart (two fsyncs, 1.5-3 ms here, while the new model already serves).

Figures: failed requests (error answers or no answer within 5 s), requests whose flight overlaps a swap
window, and ``pause_p99_ms`` = p99 latency of those requests minus p99 latency of the requests clear of
every transfer, swap and write (what a swap adds to the tail; MQTT's own jitter is in both). The same with
the transfers and writes counted in (``with_transfer_*``): moving a model through the broker, which is
single-threaded, delays requests too, but that is the link's cost, not the swap's. Also the agent process's
RSS and, for comparison, the RSS of a bare ``import numpy, onnxruntime`` process (the runtime's floor).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from fedge.inference import read_manifest
from fedge.inference.distribution import publish_model
from fedge.inference.remote import InferenceClient, Prediction
from fedge.localnet import MosquittoBroker
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.config import MqttConfig
from fedge.transport.connection import MqttConnection
from fedge.transport.topics import Topics

__all__ = ["runtime_floor_rss", "swap_over_broker"]

_FLEET = "bench"
_NODE = "dev-1"


def swap_over_broker(paths: list[Path], swaps: int = 20, rate_hz: float = 100.0, replicas: int = 1) -> dict:
    """Run the swap test with ``replicas`` serving processes; see the module docstring for the figures."""
    with (
        tempfile.TemporaryDirectory(prefix="fedge-swap-") as tmp,
        MosquittoBroker(Path(tmp) / "mq") as broker,
    ):
        config = MqttConfig(broker_url=broker.url, fleet=_FLEET, reconnect_max_s=0.5)
        topics = Topics(_FLEET)
        statuses: dict[int, list[dict]] = {r: [] for r in range(replicas)}
        coordinator = MqttConnection(config, "bench-coordinator")
        for r in range(replicas):
            topic = topics.infer_status(_NODE) + (f"/{r}" if r else "")
            coordinator.route(topic, lambda _t, p, r=r: statuses[r].append(json.loads(p)) if p else None)
        coordinator.start()  # this process's connection only watches the agent's status
        publisher = _Publisher(broker.url, paths)
        publisher.publish("v0", 0)
        agent = _start_agent(Path(tmp), broker.url, replicas)
        try:
            _wait(lambda: all(_latest(statuses[r], "version") == "v0" for r in statuses), 60, agent)
            records, failures = _drive(config, publisher, len(paths), swaps, rate_hz, statuses, agent)
            rss = _rss(agent.pid)
            finals = [statuses[r][-1] for r in statuses]
        finally:
            agent.terminate()
            agent.wait(30)
            publisher.close()
            coordinator.close()
    logs = [[e for e in final["swap_log"] if e["version"] != "v0"] for final in finals]
    swaps_only = [(e["install_at"], e["swapped_at"]) for log in logs for e in log]  # every replica's
    published = publisher.published_at
    with_transfer = [  # the whole install: transfer, swap and writing the model to disk for a restart
        (
            min(e["received_at"], published.get(e["version"], e["received_at"])),
            e.get("kept_at", e["swapped_at"]),
        )
        for log in logs
        for e in log
    ]
    return {
        **_pause_figures(records, swaps_only, with_transfer),
        **{f"with_transfer_{k}": v for k, v in _pause_figures(records, with_transfer, with_transfer).items()},
        # The control: the same statistic over windows 80 ms after each swap, when nothing happens (swaps are
        # at least 200 ms apart). What it shows is the measurement's own noise on this machine.
        "null_pause_p99_ms": _pause_figures(
            records, shifted := _shift(swaps_only, 0.08), with_transfer + shifted
        )["pause_p99_ms"],
        **failures,
        **rss,
        "replicas": replicas,
        "model_work_nice": max(final.get("model_work_nice", 0) for final in finals),
        "swaps_ok": min(sum(e["ok"] for e in log) for log in logs),
        "version": finals[0]["version"],
        "agent_latency_ms": finals[0]["latency_ms"],
    }


class _Publisher:
    """The coordinator: a process that publishes version ``v`` of ``paths[i]`` when told ``"v i"``."""

    _SCRIPT = (
        "import sys\n"
        "from fedge.bench._infer_swap import _publish_from_stdin\n"
        "_publish_from_stdin(sys.argv[1], sys.argv[2:])\n"
    )

    def __init__(self, broker_url: str, paths: list[Path]) -> None:
        self.published_at: dict[str, float] = {}
        self._process = subprocess.Popen(
            [sys.executable, "-c", self._SCRIPT, broker_url, *map(os.fspath, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def publish(self, version: str, index: int) -> None:
        """Have the coordinator publish ``version`` (returns once its chunks and header are queued)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(f"{version} {index}\n")
        self._process.stdin.flush()
        reply = self._process.stdout.readline().split()
        if not reply or reply[0] != "published":
            raise RuntimeError(f"the coordinator process failed to publish {version}")
        self.published_at[version] = float(reply[1])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()


def _publish_from_stdin(broker_url: str, paths: list[str]) -> None:
    """The coordinator process's loop (see :class:`_Publisher`)."""
    models = [(Path(p).read_bytes(), read_manifest(Path(p))) for p in paths]
    config = MqttConfig(broker_url=broker_url, fleet=_FLEET)
    connection = MqttConnection(config, "bench-coordinator-publisher")
    connection.start()
    publisher = ArtifactPublisher(connection, Topics(_FLEET))
    try:
        for line in sys.stdin:
            version, index = line.split()
            started = time.time()
            publish_model(publisher, version, {"fp32": models[int(index)]})
            print(f"published {started}", flush=True)
    finally:
        connection.close()


def _shift(windows: list[tuple[float, float]], by_s: float) -> list[tuple[float, float]]:
    return [(start + by_s, end + by_s) for start, end in windows]


def _latest(statuses: list[dict], key: str):
    return statuses[-1].get(key) if statuses else None


def _all_swapped(statuses: dict[int, list[dict]], count: int) -> bool:
    """Whether every replica's latest status counts ``count`` swaps (the first load is one)."""
    return all((_latest(s, "swaps") or 0) >= count for s in statuses.values())


def _start_agent(tmp: Path, broker_url: str, replicas: int) -> subprocess.Popen:
    config = tmp / "infer.toml"
    config.write_text(
        f'node_id = "{_NODE}"\nmodel_dir = "{tmp / "agent"}"\nstatus_every_s = 0.5\nreplicas = {replicas}\n\n'
        f'[mqtt]\nbroker_url = "{broker_url}"\nfleet = "{_FLEET}"\nreconnect_max_s = 0.5\n'
    )
    return subprocess.Popen(
        [sys.executable, "-m", "fedge", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _drive(config, publisher, versions, swaps, rate_hz, statuses, agent) -> tuple[list, dict]:
    """Paced requests from one thread; swaps from this one. Returns (sent_at, latency_s, ok) records."""
    records: list[tuple[float, float, bool]] = []
    pending: list = []
    stop = threading.Event()
    sample = np.zeros((1, 1, 8, 8), np.float32)
    with InferenceClient(config, "bench-requester") as client:

        def send() -> None:
            tick = time.perf_counter()
            while not stop.is_set():
                sent_wall, sent = time.time(), time.perf_counter()
                future = client.submit(_NODE, sample)
                pending.append(future)
                future.add_done_callback(lambda f, w=sent_wall, s=sent: records.append(_record(f, w, s)))
                tick += 1 / rate_hz
                stop.wait(max(0.0, tick - time.perf_counter()))

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        _wait(lambda: len(records) >= rate_hz, 30, agent)  # one second of baseline
        for i in range(1, swaps + 1):
            publisher.publish(f"v{i}", i % versions)
            _wait(lambda i=i: _all_swapped(statuses, i + 1), 60, agent)
            stop.wait(0.2)
        count = len(records)
        _wait(lambda: len(records) >= count + rate_hz // 2, 30, agent)
        stop.set()
        thread.join()
        deadline = time.monotonic() + 5
        for future in pending:  # every request sent gets its answer or counts as failed
            with contextlib.suppress(Exception):
                future.result(max(0.0, deadline - time.monotonic()))
        _wait(lambda: _all_swapped(statuses, swaps + 1), 30, agent)
    unanswered = sum(not f.done() for f in pending)
    return records, {
        "requests": len(pending),
        "failed_requests": sum(not r[2] for r in records) + unanswered,
    }


def _record(future, sent_wall: float, sent: float) -> tuple[float, float, bool]:
    latency = time.perf_counter() - sent
    ok = future.exception() is None and isinstance(future.result(), Prediction)
    return sent_wall, latency, ok, future.result().replica if ok else -1


def _pause_figures(
    records: list[tuple[float, float, bool]],
    windows: list[tuple[float, float]],
    busy: list[tuple[float, float]],
) -> dict:
    """Latency of the requests in flight during ``windows`` against those clear of every ``busy`` window."""

    def overlaps(sent: float, latency: float, spans: list[tuple[float, float]]) -> bool:
        return any(start <= sent + latency and sent <= end for start, end in spans)

    during = np.asarray([lat for sent, lat, ok, _ in records if ok and overlaps(sent, lat, windows)]) * 1e3
    outside = np.asarray([lat for sent, lat, ok, _ in records if ok and not overlaps(sent, lat, busy)]) * 1e3
    p99_out = float(np.percentile(outside, 99)) if outside.size else 0.0
    p99_during = float(np.percentile(during, 99)) if during.size else p99_out
    return {
        "requests_during_swaps": int(during.size),
        "pause_p99_ms": max(0.0, p99_during - p99_out),
        "latency_p50_ms": float(np.median(outside)) if outside.size else 0.0,
        "latency_p99_ms": p99_out,
        "latency_p99_during_swaps_ms": p99_during,
        "latency_max_during_swaps_ms": float(during.max()) if during.size else 0.0,
        "swap_window_ms_p50": float(np.median([(b - a) * 1e3 for a, b in windows])) if windows else 0.0,
    }


def _rss(pid: int) -> dict:
    """Memory of the agent and its replica processes, and whether any mapped torch (none may)."""
    pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    totals = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    loaded_torch = False
    for each in pids:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{each}/status").read_text().splitlines())
        for key in totals:
            totals[key] += int(status[key].split()[0])
        loaded_torch |= "libtorch" in Path(f"/proc/{each}/maps").read_text()
    return {
        "processes": len(pids),
        "agent_rss_mb": totals["VmRSS"] / 1024,
        "agent_anon_mb": totals["RssAnon"] / 1024,
        "agent_file_mb": totals["RssFile"] / 1024,
        "agent_loaded_torch": loaded_torch,
    }


def runtime_floor_rss(model: Path | None = None) -> float:
    """RSS (MB) of a process that only imports numpy and onnxruntime: no agent can be smaller.

    With ``model``, the process also builds a default CPU session for it and runs it at batch 1 and 32
    (zeros): the floor of any process that serves that model with ONNX Runtime (building a session touches
    about 10 MB of the runtime's kernels, whatever the arena or thread settings).
    """
    script = "import sys, numpy, onnxruntime\n"
    if model is not None:
        script += (
            "s = onnxruntime.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
            "i = s.get_inputs()[0]\n"
            "for b in (1, 32):\n"
            "    shape = [d if isinstance(d, int) else b for d in i.shape]\n"
            "    s.run(None, {i.name: numpy.zeros(shape, numpy.float32)})\n"
        )
    script += "print(open('/proc/self/status').read())"
    args = [sys.executable, "-c", script, *([os.fspath(model)] if model is not None else [])]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _wait(condition, timeout: float, agent: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if agent.poll() is not None:
            raise RuntimeError(
                f"fedge serve exited ({agent.returncode}): {agent.stderr.read().decode()[-500:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError("the swap test did not progress in time")
        time.sleep(0.01)
