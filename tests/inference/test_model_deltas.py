"""Weights-only updates end to end: the coordinator plans a delta, a device rebuilds the version from it."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from waiting import wait_until

from fedge.inference.agent import InferenceAgent, InferenceAgentConfig
from fedge.inference.delta_receiver import BASE_FILE, DeltaReceiver
from fedge.inference.distribution import publish_model
from fedge.inference.manifest import read_manifest, sha256_bytes, write_manifest
from fedge.inference.serving import ModelServer
from fedge.server.export import export_onnx
from fedge.server.model_delta import DeltaPlanner
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.artifacts import ArtifactHeader
from fedge.transport.connection import MqttConnection
from fedge.transport.topics import Topics


@pytest.fixture(scope="module")
def versions(cnn, digits_test, tmp_path_factory):
    """Three versions of the CNN, a training step apart: ``[(bytes, manifest), ...]``."""
    out = tmp_path_factory.mktemp("versions")
    model = copy.deepcopy(cnn)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.from_numpy(digits_test[0][:64]), torch.from_numpy(digits_test[1][:64]).long()
    files = []
    for i in range(3):
        path = out / f"v{i + 1}.onnx"
        manifest = export_onnx(model.eval(), digits_test[0][:2], path, version=f"v{i + 1}", round=i + 1)
        files.append((path.read_bytes(), manifest))
        model.train()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return files


def _agent(mqtt, model_dir: Path) -> InferenceAgent:
    return InferenceAgent(InferenceAgentConfig(node_id="dev-1", mqtt=mqtt(), model_dir=str(model_dir)))


def test_a_device_rebuilds_each_new_version_from_a_delta_and_a_late_one_gets_the_same_bytes(
    mqtt, versions, digits_test, tmp_path
):
    coordinator = MqttConnection(mqtt(), f"coord-{uuid.uuid4().hex[:6]}")
    coordinator.start()
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    planner = DeltaPlanner("fp16")
    first = planner.plan("v1", *versions[0])
    assert first.delta is None and first.model == versions[0][0]  # nothing held yet: in full, exact
    publish_model(publisher, "v1", {"fp32": (first.model, first.manifest)})
    x = digits_test[0][:16]
    try:
        with _agent(mqtt, tmp_path / "dev") as agent:
            wait_until(lambda: agent.server.serving_version == "v1")
            planned = []
            base = tmp_path / "dev" / "model.onnx"  # fp32 serves: the served file is the base
            for i, (data, manifest) in enumerate(versions[1:], start=2):
                # the base is kept just after the install: a delta that comes sooner is ignored (full file)
                wait_until(lambda i=i: getattr(read_manifest(base), "version", None) == f"v{i - 1}")
                plan = planner.plan(f"v{i}", data, manifest)
                assert plan.delta is not None and plan.delta.base == f"v{i - 1}"
                assert len(plan.delta.payload) < 0.6 * len(data)  # fp16: about half the model
                assert plan.manifest.sha256 == sha256_bytes(plan.model) != manifest.sha256
                assert plan.manifest.extra["output_diff_vs_export"] <= 1e-4
                publish_model(publisher, f"v{i}", {"fp32": (plan.model, plan.manifest)}, delta=plan.delta)
                wait_until(lambda i=i: agent.server.serving_version == f"v{i}")
                planned.append(plan)
            # counted once the install returns (it swaps first)
            wait_until(lambda: agent.status()["models"]["fp32-delta"]["delivered"] == 2)
            status = agent.status()
            assert status["deltas"]["applied"] == 2 and status["deltas"]["refused"] == 0
            assert status["models"]["fp32"]["delivered"] == 1  # only v1 came in full
            wait_until(lambda: base.read_bytes() == planned[-1].model)
            local = ModelServer()
            assert local.swap(planned[-1].model, planned[-1].manifest).ok
            np.testing.assert_allclose(agent.server.predict(x), local.predict(x), atol=1e-6)
        # A device holding nothing ignores the retained delta and fetches v3 in full: the same bytes.
        with _agent(mqtt, tmp_path / "late") as late:
            wait_until(lambda: (tmp_path / "late" / "model.onnx").is_file())  # kept after the swap
            assert late.server.serving_version == "v3"
            assert late.status()["deltas"]["applied"] == 0
            assert (tmp_path / "late" / "model.onnx").read_bytes() == planned[-1].model
    finally:
        coordinator.close()


def test_a_delta_that_strays_from_the_export_is_not_sent(versions):
    """When the rebuilt model's outputs would differ from the export's by more than the bound, the export
    goes out in full and exact, and the next delta starts from it."""
    planner = DeltaPlanner("topk:0.01+int8", max_output_diff=1e-6)
    planner.plan("v1", *versions[0])
    second = planner.plan("v2", *versions[1])
    assert second.delta is None and second.model == versions[1][0]
    loose = DeltaPlanner("topk:0.01+int8", max_output_diff=10.0)
    loose.plan("v1", *versions[0])
    third = loose.plan("v2", *versions[1])
    assert third.delta is not None and len(third.delta.payload) < 0.1 * len(versions[1][0])


def test_a_delta_that_does_not_rebuild_the_signed_file_falls_back_to_the_full_file(mqtt, versions, tmp_path):
    """The device skips the full transfer when the delta's header names the base it holds; when the rebuilt
    file then fails the manifest's sha256, it fetches the full file after all."""
    coordinator = MqttConnection(mqtt(), f"coord-{uuid.uuid4().hex[:6]}")
    coordinator.start()
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    planner = DeltaPlanner("fp16")
    first = planner.plan("v1", *versions[0])
    publish_model(publisher, "v1", {"fp32": (first.model, first.manifest)})
    try:
        with _agent(mqtt, tmp_path / "dev") as agent:
            wait_until(lambda: agent.server.serving_version == "v1")
            wait_until(lambda: (tmp_path / "dev" / "model.onnx").is_file())
            plan = planner.plan("v2", *versions[1])
            # the full file is the exact export, so the delta (which rebuilds the planned file) misses its sha
            publish_model(publisher, "v2", {"fp32": versions[1]}, delta=plan.delta)
            wait_until(lambda: agent.server.serving_version == "v2")
            wait_until(lambda: (tmp_path / "dev" / "model.onnx").read_bytes() == versions[1][0])
            wait_until(lambda: agent.status()["models"]["fp32"]["delivered"] == 2)  # counted after install
            status = agent.status()
            assert status["deltas"]["refused"] == 1 and status["deltas"]["applied"] == 0
            assert "sha256" in status["deltas"]["last_error"]
    finally:
        coordinator.close()


def test_the_base_is_the_served_file_when_fp32_serves_else_the_kept_fp32_file(versions, tmp_path):
    served = tmp_path / "model.onnx"
    receiver = DeltaReceiver(served, 1 << 26, full=None, deliver=None)  # type: ignore[arg-type]
    (v1, m1), (v2, m2) = versions[0], versions[1]
    meta = {"extra": {"delta_base": "v1"}}
    assert not receiver.holds_base(meta)  # nothing held
    served.write_bytes(v1)
    write_manifest(served, m1.with_(version="v1"))
    assert receiver.holds_base(meta) and not (tmp_path / BASE_FILE).exists()
    # an int8 variant of v2 serves: the fp32 file of v2 is kept beside it and is the base
    served.write_bytes(b"int8 bytes")
    write_manifest(served, m2.with_(version="v2", variant="int8-static"))
    assert not receiver.holds_base(meta)
    receiver.keep_base(v2, m2.with_(version="v2"))
    assert receiver.holds_base({"extra": {"delta_base": "v2"}})
    planner = DeltaPlanner("fp16")
    planner.plan("v2", v2, m2)
    plan = planner.plan("v3", *versions[2])
    assert (
        receiver.rebuild(
            "v3",
            plan.manifest.with_(
                version="v3",
                extra={
                    **plan.manifest.extra,
                    "delta_base": "v2",
                    "delta_base_sha256": plan.delta.base_sha256,
                },
            ),
            plan.delta.payload,
        )
        == plan.model
    )


def test_a_delta_whose_chunks_never_come_falls_back_to_the_full_file(mqtt, versions, tmp_path):
    """The device skipped the full transfer for the delta: when the delta is not whole in time, it fetches
    the full file after all."""
    coordinator = MqttConnection(mqtt(), f"coord-{uuid.uuid4().hex[:6]}")
    coordinator.start()
    topics = Topics(coordinator.config.fleet)
    publisher = ArtifactPublisher(coordinator, topics, chunk_size=16 * 1024)
    planner = DeltaPlanner("fp16")
    first = planner.plan("v1", *versions[0])
    publish_model(publisher, "v1", {"fp32": (first.model, first.manifest)})
    try:
        with _agent(mqtt, tmp_path / "dev") as agent:
            agent.deltas.wait_s = 1.0
            wait_until(
                lambda: getattr(read_manifest(tmp_path / "dev" / "model.onnx"), "version", None) == "v1"
            )
            plan = planner.plan("v2", *versions[1])
            # the delta's header only: its chunks are lost
            meta = plan.manifest.with_(
                version="v2", extra={**plan.manifest.extra, "variants": ["fp32"], "delta_base": "v1"}
            )
            header = ArtifactHeader.for_data(
                "model-fp32-delta", "v2", plan.delta.payload, 16 * 1024, meta.to_dict()
            )
            coordinator.publish(topics.artifact("model-fp32-delta"), header.encode(), retain=True)
            wait_until(lambda: agent.status()["models"]["fp32-delta"]["receiving"] == "v2")
            publisher.publish("model-fp32", "v2", plan.model, meta.to_dict())
            wait_until(lambda: agent.server.serving_version == "v2")
            status = agent.status()
            assert status["deltas"]["refused"] == 1 and "not whole" in status["deltas"]["last_error"]
    finally:
        coordinator.close()
