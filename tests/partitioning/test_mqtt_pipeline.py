"""A 3-stage pipeline on 3 real ``fedge serve`` processes over a real Mosquitto: 100 requests with outputs
identical to the local chain, and a stage agent killed mid-run whose stage is re-placed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from waiting import wait_until

from fedge.localnet import MosquittoBroker
from fedge.partitioning import CostModel, Device, Fleet
from fedge.partitioning.models import chain_cnn
from fedge.partitioning.mqtt_runtime import MqttPipeline, StageFailed, stage_artifact
from fedge.partitioning.onnx_graph import capture
from fedge.partitioning.runtime import OrtExecutor
from fedge.partitioning.stages import load_runner
from fedge.transport import MqttConfig

DEVICES = ("dev-a", "dev-b", "dev-c")


def _start_agent(tmp: Path, broker_url: str, name: str) -> subprocess.Popen:
    config = tmp / f"{name}.toml"
    config.write_text(
        f'node_id = "{name}"\nmodel_dir = "{tmp / name}"\nartifact = "{stage_artifact(name)}"\n'
        "status_every_s = 0.2\nmax_batch = 256\nchunk_bytes = 4096\n\n"
        f'[mqtt]\nbroker_url = "{broker_url}"\nfleet = "pipe"\n'
        "reconnect_max_s = 0.5\n\n[session]\nintra_op_threads = 1\n"
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "fedge", "serve", "--config", str(config)], env=env, stderr=subprocess.DEVNULL
    )


@pytest.mark.timeout(240)
def test_three_stage_pipeline_over_mqtt_survives_a_killed_stage_agent(tmp_path):
    onnx_model, graph, feeds = capture(*chain_cnn(16))
    fleet = Fleet(tuple(Device(name, 1e10, bandwidth_bytes_per_s=1e12) for name in DEVICES))
    cost = CostModel(graph, fleet)
    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((100, *v.shape[1:])).astype(np.float32) for k, v in feeds.items()}
    with MosquittoBroker(tmp_path / "mq") as broker:
        agents = {name: _start_agent(tmp_path, broker.url, name) for name in DEVICES}
        config = MqttConfig(broker_url=broker.url, fleet="pipe", reconnect_max_s=0.5)
        try:
            # 4 KiB chunks: every activation crosses in several chunks, both ways.
            stages = tmp_path / "stages"
            with MqttPipeline(
                onnx_model, graph, cost, config, stages, timeout_s=3.0, chunk_bytes=4096
            ) as pipeline:
                assert pipeline.wait_online(timeout_s=60) == set(DEVICES)
                placed = pipeline.deploy()
                assert sorted(s.device for s in placed.stages) == list(DEVICES)  # one stage per agent

                out = pipeline.run(batch, micro_batch=1)  # 100 requests through 3 agents
                local = load_runner(tmp_path / "stages").run(batch, micro_batch=1)
                for name in local:
                    np.testing.assert_array_equal(out[name], local[name])

                victim = placed.stages[1].device  # the middle stage's agent dies mid-run
                result: dict[str, dict[str, np.ndarray]] = {}
                runner = threading.Thread(
                    target=lambda: result.update(out=pipeline.run(batch, micro_batch=1))
                )
                runner.start()
                wait_until(lambda: pipeline.client.sent >= 300 + 30)  # the first run sent 300; 30 more go
                agents[victim].send_signal(signal.SIGKILL)
                runner.join(120)
                assert "out" in result, "the run did not complete after the stage agent died"
                assert pipeline.dead == {victim} and pipeline.replans >= 1
                assert victim not in {s.device for s in pipeline.plan.stages}
                full = OrtExecutor(onnx_model.SerializeToString()).run(batch)
                for name in full:
                    np.testing.assert_allclose(result["out"][name], full[name], atol=1e-5)

                # Its agent back, the next placement uses it again, with the stage versions it had before
                # (the same content): it had been left out for good, and a version sent again never loaded.
                agents[victim].wait(30)
                agents[victim] = _start_agent(tmp_path, broker.url, victim)
                wait_until(lambda: victim in pipeline.online(), 60, what="the restarted agent online")
                again = pipeline.deploy()
                assert sorted(s.device for s in again.stages) == list(DEVICES) and not pipeline.dead
                out = pipeline.run(batch, micro_batch=1)
                for name in local:
                    np.testing.assert_array_equal(out[name], local[name])

                # A request over the 4 MiB message budgets is refused in an answer: the run
                # fails at once (it waited for the device to go offline, then sent it again, twice).
                row_bytes = sum(v[:1].nbytes for v in feeds.values())
                big = {
                    k: np.zeros((4 * 2**20 // row_bytes + 1, *v.shape[1:]), v.dtype) for k, v in feeds.items()
                }
                replans = pipeline.replans
                with pytest.raises(StageFailed, match="4194304"):  # the budget, by whichever side
                    pipeline.run(big)
                assert pipeline.replans == replans and not pipeline.dead
        finally:
            for agent in agents.values():
                if agent.poll() is None:
                    agent.terminate()
                agent.wait(30)


@pytest.mark.timeout(180)
def test_partition_run_over_mqtt_from_the_command_line(tmp_path):
    (tmp_path / "devices.toml").write_text(
        "".join(
            f'[[device]]\nname = "{n}"\nflops_per_s = 1e10\nbandwidth_bytes_per_s = 1e12\n\n'
            for n in DEVICES[:2]
        )
    )
    with MosquittoBroker(tmp_path / "mq") as broker:
        agents = [_start_agent(tmp_path, broker.url, name) for name in DEVICES[:2]]
        try:
            command = [
                *(
                    sys.executable,
                    "-m",
                    "fedge",
                    "partition",
                    "run",
                    "--broker",
                    broker.url,
                    "--fleet",
                    "pipe",
                ),
                *(
                    "--model",
                    "fedge.partitioning.models:chain_cnn",
                    "--devices",
                    str(tmp_path / "devices.toml"),
                ),
                *("--out", str(tmp_path / "out"), "--micro-batch", "2", "--repeat", "4"),
            ]
            env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
            done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
        finally:
            for agent in agents:
                agent.terminate()
                agent.wait(30)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("2 stages on ") and summary.endswith("max |chained - full| = 0"), summary


@pytest.mark.parametrize(
    ("outputs", "problem"),
    [
        ({"logits": np.full((4, 10), np.nan, np.float32)}, "NaN or infinity in logits"),
        ({"logits": np.zeros((4, 9), np.float32)}, "logits of shape (4, 9), the stage's is (4, 10)"),
        ({"logits": np.zeros((5, 10), np.float32)}, "logits of shape (5, 10), the stage's is (4, 10)"),
        ({"logits": np.zeros((4, 10), np.int64)}, "logits as int64, the stage's is float32"),
        ({"other": np.zeros((4, 10), np.float32)}, "outputs ['other'], the stage's are ['logits']"),
    ],
)
def test_a_stage_answer_that_does_not_fit_its_outputs_fails_the_stage(outputs, problem):
    """A device's NaN, wrong-shaped or wrong-typed answer came back from the pipeline as a result (and a bad
    first stage was blamed on the honest next one; pipeline sweep)."""
    from fedge.inference.manifest import TensorSpec
    from fedge.inference.remote import Prediction
    from fedge.partitioning.mqtt_runtime import RemoteStage

    class Device:  # answers every request with ``answer``
        def __init__(self, answer: dict[str, np.ndarray]) -> None:
            self.answer = answer

        def predict(self, device, inputs, timeout):
            return Prediction(outputs=self.answer, version="v1")

    spec = (TensorSpec("logits", ("batch", 10), "float32"),)
    batch = {"x": np.zeros((4, 64), np.float32)}
    with pytest.raises(StageFailed, match=rf"stage on dev-b: answered {re.escape(problem)}"):
        RemoteStage(Device(outputs), "dev-b", "v1", 1.0, spec).run(batch)  # type: ignore[arg-type]
    good = {"logits": np.ones((4, 10), np.float32)}
    assert RemoteStage(Device(good), "dev-b", "v1", 1.0, spec).run(batch) is good  # type: ignore[arg-type]
