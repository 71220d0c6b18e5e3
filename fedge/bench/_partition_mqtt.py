"""The measured over-MQTT run of ``fedge bench partition``: the edge plan on three emulated devices.

Three ``fedge serve`` processes stand for the bench's 3-device fleet (one device at a tenth of this host's
speed, two at a fortieth; 20 Mbit/s links with 1 ms latency): each runs its stage ``k`` times slower than this
host does (:mod:`fedge.bench._emulated_stage`) and reaches the broker through its own rate-limited proxy
(:class:`~fedge.localnet.netem.LossyLinkProxy`). :class:`~fedge.partitioning.mqtt_runtime.MqttPipeline`
deploys the plan and pushes micro-batches through; the period (seconds per micro-batch in steady state) is
measured as the difference between a long and a short run, which cancels the pipeline's fill and drain, and
compared with the plan's predicted period.

The cost model takes the input to be on the first stage's device already and the output to stay on the last;
over MQTT the coordinator sends one and receives the other through those devices' links. The prediction
compared here is therefore the plan's stage times with those two transfers added (the plan's own period is
reported too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedge.localnet import MosquittoBroker
from fedge.localnet.netem import LinkProfile, LossyLinkProxy
from fedge.partitioning import CostModel, Plan
from fedge.partitioning.mqtt_runtime import MqttPipeline, stage_artifact
from fedge.transport.config import MqttConfig

__all__ = ["measure_over_mqtt"]


def measure_over_mqtt(
    onnx_model: Any, graph: Any, cost: CostModel, feeds: dict[str, np.ndarray], host_flops: float, quick: bool
) -> dict[str, Any]:
    """Deploy ``cost``'s throughput plan on emulated devices; its measured period against the plan's."""
    batch = len(next(iter(feeds.values())))
    short, long = (4, 16) if quick else (8, 40)
    with (
        tempfile.TemporaryDirectory(prefix="fedge-pipe-") as tmp,
        MosquittoBroker(Path(tmp) / "mq") as broker,
    ):
        proxies, agents = [], []
        try:
            for device in cost.fleet.devices:
                link = LinkProfile(  # every message pays its whole serialization time: no free burst
                    latency_ms=1e3 * device.latency_s,
                    rate_bytes_per_s=device.bandwidth_bytes_per_s,
                    burst_bytes=1500,
                )
                proxy = LossyLinkProxy("127.0.0.1", broker.port, link).start()
                proxies.append(proxy)
                agents.append(_agent(Path(tmp), device.name, proxy.url, host_flops / device.flops_per_s))
            config = MqttConfig(broker_url=broker.url, fleet="bench", reconnect_max_s=0.5)
            with MqttPipeline(onnx_model, graph, cost, config, Path(tmp) / "stages", timeout_s=60.0) as pipe:
                missing = {d.name for d in cost.fleet.devices} - pipe.wait_online(timeout_s=60)
                if missing:
                    raise TimeoutError(f"stage agents {sorted(missing)} did not come online")
                placed: Plan = pipe.deploy()
                warm = pipe.run(_repeat(feeds, 2), micro_batch=batch)  # warm every session and link
                output_bytes = sum(v.nbytes for v in warm.values()) // 2
                walls = {}
                for count in (short, long):
                    start = time.perf_counter()
                    pipe.run(_repeat(feeds, count), micro_batch=batch)
                    walls[count] = time.perf_counter() - start
        finally:
            for agent in agents:
                agent.terminate()
                agent.wait(30)
            for proxy in proxies:
                proxy.stop()
    measured = (walls[long] - walls[short]) / (long - short)
    stages = list(placed.stage_seconds)
    first, last = (
        cost.fleet.devices[cost.fleet.index(s.device)].link for s in (placed.stages[0], placed.stages[-1])
    )
    stages[0] += first.seconds(sum(v.nbytes for v in feeds.values()))
    stages[-1] += last.seconds(output_bytes)
    predicted = max(stages)
    return {
        "mqtt_plan": [(s.device, s.start, s.end) for s in placed.stages],
        "mqtt_period_ms_plan": 1e3 * placed.period_s,
        "mqtt_period_ms_predicted": 1e3 * predicted,
        "mqtt_period_ms_measured": 1e3 * measured,
        "mqtt_measured_over_predicted": measured / predicted,
    }


def _agent(tmp: Path, name: str, broker_url: str, slowdown: float) -> subprocess.Popen:
    config = tmp / f"{name}.toml"
    config.write_text(
        f'node_id = "{name}"\nmodel_dir = "{tmp / name}"\nartifact = "{stage_artifact(name)}"\n'
        f'status_every_s = 0.5\nmax_request_bytes = 67108864\n\n[mqtt]\nbroker_url = "{broker_url}"\n'
        'fleet = "bench"\nreconnect_max_s = 0.5\n\n[session]\nintra_op_threads = 1\n'
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    command = [sys.executable, "-m", "fedge.bench._emulated_stage", str(config), str(slowdown)]
    return subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)


def _repeat(feeds: dict[str, np.ndarray], times: int) -> dict[str, np.ndarray]:
    return {k: np.concatenate([v] * times) for k, v in feeds.items()}
