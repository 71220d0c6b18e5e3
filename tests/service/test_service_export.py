"""The coordinator service exports the global model after every round by default, hands each export to
``on_model_exported`` and shows the export's state in status.json."""

from __future__ import annotations

import json

from service_helpers import reference_agent
from waiting import wait_until

from fedge.app.config import AppConfig
from fedge.app.coordinator import CoordinatorConfig, run_coordinator
from fedge.inference import read_manifest, sha256_file
from fedge.inference.agent import InferenceAgent, InferenceAgentConfig
from fedge.server.checkpoint import set_aside_checkpoint
from fedge.server.model_export import ExportedModel, read_latest
from fedge.server.service import ServiceConfig


def test_the_service_exports_every_round_and_survives_a_failing_publisher(mqtt, tmp_path):
    agent = reference_agent(mqtt(), tmp_path / "agent", "ada")
    published: list[ExportedModel] = []

    def publish(exported: ExportedModel) -> None:
        published.append(exported)
        if exported.server_round == 1:
            raise ConnectionError("broker went away")

    agent.start()
    try:
        state_dir = tmp_path / "coordinator"
        service = ServiceConfig(mqtt=mqtt(), state_dir=str(state_dir), wait_for_nodes_s=60.0)
        app = AppConfig(rounds=2, local_epochs=1, min_nodes=1)  # no out_dir: models go to state_dir
        history = run_coordinator(CoordinatorConfig(service=service, app=app), on_model_exported=publish)
    finally:
        agent.close()
    assert [r.extra["export_version"] for r in history.rounds] == ["r0001", "r0002"]
    assert [e.version for e in published] == ["r0001", "r0002"]
    assert history.rounds[0].extra["export_publish_failures"] == 1
    for exported in published:
        manifest = read_manifest(exported.files["fp32"])
        assert manifest.round == exported.server_round
        assert manifest.sha256 == sha256_file(exported.files["fp32"])
    assert read_latest(state_dir) == published[-1]
    status = json.loads((state_dir / "status.json").read_text())
    assert status["export_version"] == "r0002"
    assert status["export_failures"] == 0 and status["export_publish_failures"] == 1
    assert status["last_export_error"] == "on_export: ConnectionError: broker went away"
    assert status["state"] == "finished" and status["ended_at"] <= status["updated_at"]
    # resuming a run that holds all its rounds: nothing to do, at once (no broker, no nodes waited for)
    resumed = run_coordinator(CoordinatorConfig(service=service, app=app), resume=True)
    assert [r.round for r in resumed.rounds] == [1, 2]
    # a fresh start keeps the finished run's checkpoint under a name of its own
    assert set_aside_checkpoint(state_dir) is not None
    assert not (state_dir / "checkpoint.npz").exists() and len(list(state_dir.glob("checkpoint-*.npz"))) == 1
    assert set_aside_checkpoint(state_dir) is None


def test_the_service_publishes_each_export_and_an_inference_device_serves_the_last(mqtt, tmp_path):
    """Coordinator, training agent and torch-free inference agent on one real broker: the device ends up
    serving the last round's model, chosen among the variants by measuring them itself."""
    trainer = reference_agent(mqtt(), tmp_path / "agent", "ada")
    device = InferenceAgent(
        InferenceAgentConfig(node_id="cam", mqtt=mqtt(), model_dir=str(tmp_path / "cam"), status_every_s=0.2)
    )
    trainer.start()
    device.start()
    try:
        service = ServiceConfig(mqtt=mqtt(), state_dir=str(tmp_path / "coordinator"), wait_for_nodes_s=60.0)
        app = AppConfig(rounds=2, local_epochs=1, min_nodes=1, export_variants=["fp32", "int8-dynamic"])
        history = run_coordinator(CoordinatorConfig(service=service, app=app))
        # The swap log records a swap once it has returned (the choice of variant included).
        wait_until(lambda: any(e["version"] == "r0002" for e in device.swap_log), 60, what="r0002 installed")
        status = device.status()
    finally:
        trainer.close()
        device.stop()
    assert history.rounds[-1].extra["export_version"] == "r0002"
    assert set(status["variant_latency_ms"]) == {"fp32", "int8-dynamic"}
    # r0002's fp32 weights also went out as a delta of r0001: applied if the device held r0001 by then
    deltas = status["deltas"]
    assert deltas["applied"] + deltas["ignored"] == 1 and deltas["refused"] == 0
    assert status["variant"] in ("fp32", "int8-dynamic") and status["swaps"] >= 1
    coordinator_status = json.loads((tmp_path / "coordinator" / "status.json").read_text())
    assert coordinator_status["inference_devices"]["cam"]["online"] is True  # what `fedge status` shows
    served = read_manifest(tmp_path / "cam" / "model.onnx")
    assert served.version == "r0002" and served.round == 2 and served.variant == status["variant"]
