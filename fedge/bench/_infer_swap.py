"""The hot-swap test of ``fedge bench inference``, over a real broker with a real ``fedge serve`` process.

A Mosquitto on a free port; the inference agent as its own process (the torch-free ``fedge serve``); a
requester sending one request every 10 ms (100 requests/s, paced by the clock, not by answers); the
coordinator's :class:`~fedge.transport.artifact_channel.ArtifactPublisher` publishing ``swaps`` new
versions, alternating two fp32 model files (two different sets of weights; one variant per version, so a
swap measures no variants). The agent's status gives each swap's window, from the moment the
new version's header arrived to the moment the new session serves (wall clock, the same machine's).

Figures: failed requests (error answers or no answer within 5 s), requests whose flight overlaps a swap
window, and ``pause_p99_ms`` = p99 latency of those requests minus p99 latency of the requests outside
every window (what a swap adds to the tail; MQTT's own jitter is in both). Also the agent process's RSS
and, for comparison, the RSS of a bare ``import numpy, onnxruntime`` process (the runtime's floor).
"""

from __future__ import annotations

import contextlib
import json
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


def swap_over_broker(paths: list[Path], swaps: int = 20, rate_hz: float = 100.0) -> dict:
    """Run the swap test; see the module docstring for what the figures mean."""
    models = [(p.read_bytes(), read_manifest(p)) for p in paths]
    with (
        tempfile.TemporaryDirectory(prefix="fedge-swap-") as tmp,
        MosquittoBroker(Path(tmp) / "mq") as broker,
    ):
        config = MqttConfig(broker_url=broker.url, fleet=_FLEET, reconnect_max_s=0.5)
        topics = Topics(_FLEET)
        statuses: list[dict] = []
        coordinator = MqttConnection(config, "bench-coordinator")
        coordinator.route(
            topics.infer_status(_NODE), lambda _t, p: statuses.append(json.loads(p)) if p else None
        )
        coordinator.start()
        publisher = ArtifactPublisher(coordinator, topics)
        publish_model(publisher, "v0", {"fp32": models[0]})
        agent = _start_agent(Path(tmp), broker.url)
        try:
            _wait(lambda: any(s.get("version") == "v0" for s in statuses), 60, agent)
            records, failures = _drive(config, publisher, models, swaps, rate_hz, statuses, agent)
            rss = _rss(agent.pid)
            final = statuses[-1]
        finally:
            agent.terminate()
            agent.wait(30)
            coordinator.close()
    windows = [(e["received_at"], e["swapped_at"]) for e in final["swap_log"] if e["version"] != "v0"]
    return {
        **_pause_figures(records, windows),
        **failures,
        **rss,
        "swaps_ok": sum(e["ok"] for e in final["swap_log"] if e["version"] != "v0"),
        "version": final["version"],
        "agent_latency_ms": final["latency_ms"],
    }


def _start_agent(tmp: Path, broker_url: str) -> subprocess.Popen:
    config = tmp / "infer.toml"
    config.write_text(
        f'node_id = "{_NODE}"\nmodel_dir = "{tmp / "agent"}"\nstatus_every_s = 0.5\n\n'
        f'[mqtt]\nbroker_url = "{broker_url}"\nfleet = "{_FLEET}"\nreconnect_max_s = 0.5\n'
    )
    return subprocess.Popen(
        [sys.executable, "-m", "fedge", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _drive(config, publisher, models, swaps, rate_hz, statuses, agent) -> tuple[list, dict]:
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
            data, manifest = models[i % len(models)]
            publish_model(publisher, f"v{i}", {"fp32": (data, manifest)})
            _wait(lambda i=i: any(s.get("swaps", 0) >= i + 1 for s in statuses), 60, agent)
            stop.wait(0.2)
        count = len(records)
        _wait(lambda: len(records) >= count + rate_hz // 2, 30, agent)
        stop.set()
        thread.join()
        deadline = time.monotonic() + 5
        for future in pending:  # every request sent gets its answer or counts as failed
            with contextlib.suppress(Exception):
                future.result(max(0.0, deadline - time.monotonic()))
        _wait(lambda: statuses and statuses[-1].get("swaps", 0) >= swaps + 1, 30, agent)
    unanswered = sum(not f.done() for f in pending)
    return records, {
        "requests": len(pending),
        "failed_requests": sum(not ok for *_, ok in records) + unanswered,
    }


def _record(future, sent_wall: float, sent: float) -> tuple[float, float, bool]:
    latency = time.perf_counter() - sent
    ok = future.exception() is None and isinstance(future.result(), Prediction)
    return sent_wall, latency, ok


def _pause_figures(records: list[tuple[float, float, bool]], windows: list[tuple[float, float]]) -> dict:
    def overlaps(sent: float, latency: float) -> bool:
        return any(start <= sent + latency and sent <= end for start, end in windows)

    during = np.asarray([lat for sent, lat, ok in records if ok and overlaps(sent, lat)]) * 1e3
    outside = np.asarray([lat for sent, lat, ok in records if ok and not overlaps(sent, lat)]) * 1e3
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
    """The agent process's memory, and whether it mapped torch's library (it must not)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    kb = {key: int(status[key].split()[0]) for key in ("VmRSS", "RssAnon", "RssFile")}
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {
        "agent_rss_mb": kb["VmRSS"] / 1024,
        "agent_anon_mb": kb["RssAnon"] / 1024,
        "agent_file_mb": kb["RssFile"] / 1024,
        "agent_loaded_torch": "libtorch" in maps,
    }


def runtime_floor_rss() -> float:
    """RSS (MB) of a process that only imports numpy and onnxruntime: no agent can be smaller."""
    script = "import numpy, onnxruntime\nprint(open('/proc/self/status').read())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
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
