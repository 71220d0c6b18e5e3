"""The torch-free inference agent over a real Mosquitto: model distribution, serving, hot swap, refusals."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner
from waiting import wait_until

from fedge.cli import app
from fedge.inference.agent import InferenceAgent, InferenceAgentConfig
from fedge.inference.distribution import publish_model
from fedge.inference.remote import InferenceClient, InferenceError
from fedge.inference.serving import ModelServer
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.artifacts import ArtifactHeader, split_chunks
from fedge.transport.connection import MessageProperties, MqttConnection
from fedge.transport.signing import InstructionSigner
from fedge.transport.topics import Topics


@pytest.fixture
def coordinator(mqtt) -> Iterator[MqttConnection]:
    connection = MqttConnection(mqtt(), f"coord-{uuid.uuid4().hex[:6]}")
    connection.start()
    yield connection
    connection.close()


def _publish(publisher: ArtifactPublisher, path, manifest, version: str) -> ArtifactHeader:
    (header,) = publish_model(publisher, version, {"fp32": (path.read_bytes(), manifest)})
    return header


def _agent(mqtt, tmp_path, **fields) -> InferenceAgent:
    config = InferenceAgentConfig(node_id="dev-1", mqtt=mqtt(), model_dir=str(tmp_path / "dev-1"), **fields)
    return InferenceAgent(config)


def test_device_serves_published_model_and_swaps_mid_stream(
    mqtt, coordinator, variants, digits_test, tmp_path
):
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    fp32_path, fp32 = variants["fp32"]
    int8_path, int8 = variants["int8-static"]
    _publish(publisher, fp32_path, fp32, "v1")  # before the device exists: retained, so it still gets it
    x = digits_test[0][:8]
    expected = {"v1": ModelServer(), "v2": ModelServer()}
    expected["v1"].load(fp32_path)
    expected["v2"].load(int8_path)
    with _agent(mqtt, tmp_path) as agent, InferenceClient(mqtt()) as client:
        wait_until(lambda: agent.server.serving_version == "v1")
        first = client.predict("dev-1", x)
        assert first.version == "v1"
        np.testing.assert_allclose(first.outputs, expected["v1"].predict(x), atol=1e-5)

        answers: list[tuple[str, bool]] = []
        stop = threading.Event()

        def stream() -> None:  # about 100 requests/s while the new version arrives
            while not stop.is_set():
                try:
                    answers.append((client.predict("dev-1", x[:1], timeout=10).version, True))
                except (InferenceError, TimeoutError):
                    answers.append(("", False))
                stop.wait(0.01)

        thread = threading.Thread(target=stream)
        thread.start()
        wait_until(lambda: len(answers) >= 20)
        files = {"fp32": (fp32_path.read_bytes(), fp32), "int8-static": (int8_path.read_bytes(), int8)}
        publish_model(publisher, "v2", files)  # the device measures both here and serves the faster
        wait_until(lambda: agent.server.serving_version == "v2")
        count = len(answers)
        wait_until(lambda: len(answers) >= count + 20)
        stop.set()
        thread.join()
        assert all(ok for _, ok in answers), "a request failed during the swap"
        versions = [v for v, _ in answers]
        assert versions[0] == "v1" and versions[-1] == "v2"
        assert versions == sorted(versions), "answers went back to the old model after the swap"
        status = agent.status()
        chosen = status["variant"]
        assert set(status["variant_latency_ms"]) == {"fp32", "int8-static"}
        fastest = min(status["variant_latency_ms"], key=status["variant_latency_ms"].get)
        assert chosen == fastest or (chosen == "fp32" and "not faster" in status["variant_reason"])
        local = expected["v2"] if chosen == "int8-static" else expected["v1"]
        np.testing.assert_allclose(client.predict("dev-1", x).outputs, local.predict(x), atol=1e-5)
        assert status["swaps"] == 2 and status["version"] == "v2"
        assert [entry["version"] for entry in status["swap_log"]] == ["v1", "v2"]
        # the new session served from swapped_at; writing it to disk for a restart came after
        entry = status["swap_log"][-1]
        assert entry["install_at"] <= entry["swapped_at"] <= entry["kept_at"] <= entry["logged_at"]
        assert (tmp_path / "dev-1" / "model.onnx").read_bytes() == files[chosen][0]
        assert status["latency_ms"]["count"] >= count and status["latency_ms"]["p99"] > 0
        # The thread count was measured once for the CNN's layout and the serving session has it.
        options = agent.server.current.session.get_session_options()
        assert status["threads"] == options.intra_op_num_threads >= 1
        measured = {int(n): p50 for n, p50 in status["threads_latency_ms"].items()}
        if len(measured) == 2:  # a machine with more than one CPU: one thread unless more is clearly faster
            most = max(measured)
            assert status["threads"] == (most if measured[most] < 0.95 * measured[1] else 1)

    # The retained status says the device went offline; a restart serves the kept model without a download,
    # with a thread count chosen for it as well.
    with _agent(mqtt, tmp_path) as again:
        assert again.server.serving_version == "v2"
        kept_options = again.server.current.session.get_session_options()
        assert again.status()["threads"] == kept_options.intra_op_num_threads
        # The retained v2 header arrives on subscribing and must not start a transfer.
        wait_until(lambda: again.subscribers["fp32"].stats.headers_seen >= 1)
        status = again.status()
        assert status["models"]["fp32"]["receiving"] == "" and status["models"]["fp32"]["delivered"] == 0


def test_unsigned_and_corrupt_models_are_refused_and_old_model_keeps_serving(
    mqtt, coordinator, variants, digits_test, tmp_path
):
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    topics = Topics(coordinator.config.fleet)
    signed = ArtifactPublisher(coordinator, topics, InstructionSigner(key), chunk_size=32 * 1024)
    unsigned = ArtifactPublisher(coordinator, topics)
    fp32_path, fp32 = variants["fp32"]
    x = digits_test[0][:4]
    with _agent(mqtt, tmp_path, instruction_keys=(public,)) as agent, InferenceClient(mqtt()) as client:
        _publish(signed, fp32_path, fp32, "good")
        wait_until(lambda: agent.server.serving_version == "good")
        _publish(unsigned, fp32_path, fp32, "forged")
        wait_until(lambda: agent.subscribers["fp32"].stats.headers_refused == 1)
        # Signed, but the bytes are not an ONNX model: built beside the old one, refused, old one serves.
        garbage = np.random.default_rng(0).bytes(5000)
        publish_model(
            signed, "broken", {"fp32": (garbage, fp32.with_(sha256=hashlib.sha256(garbage).hexdigest()))}
        )
        wait_until(lambda: len(agent.swap_log) == 2)  # logged once the swap has returned
        assert agent.status()["failed_swaps"].get("load", 0) == 1
        assert client.predict("dev-1", x).version == "good"
        status = agent.status()
        assert status["models"]["fp32"]["refused_reasons"] == {"header": 1}
        assert "not signed" in status["models"]["fp32"]["last_error"]
        assert [e["ok"] for e in status["swap_log"]] == [True, False]
        # Signed, with a manifest whose checksum is a number: refused as a manifest problem, logged, counted
        meta = {**fp32.with_(version="odd").to_dict(), "sha256": 5, "extra": {"variants": ["fp32"]}}
        signed.publish("model-fp32", "odd", fp32_path.read_bytes(), meta)
        wait_until(lambda: len(agent.swap_log) == 3)
        entry = agent.swap_log[-1]
        assert (entry["version"], entry["ok"], entry["reason"]) == ("odd", False, "manifest")
        assert "sha256 must be a string" in entry["message"]
        assert agent.status()["failed_swaps"].get("manifest", 0) == 1
        assert client.predict("dev-1", x).version == "good"


def test_bad_requests_get_error_answers_and_are_counted(mqtt, coordinator, variants, digits_test, tmp_path):
    fp32_path, fp32 = variants["fp32"]
    _publish(ArtifactPublisher(coordinator, Topics(coordinator.config.fleet)), fp32_path, fp32, "v1")
    with _agent(mqtt, tmp_path, max_batch=16) as agent, InferenceClient(mqtt()) as client:
        wait_until(lambda: agent.server.serving_version == "v1")
        request_topic = client.topics.infer_request("dev-1")
        future = client.submit("dev-1", np.zeros((1, 1, 8, 8), np.float32))
        future.result(10)
        with pytest.raises(InferenceError, match="exceeds the cap of 16"):
            client.predict("dev-1", np.zeros((17, 1, 8, 8), np.float32))
        with pytest.raises(InferenceError, match=r"each input row has 3 values but the model takes 64"):
            client.predict("dev-1", np.zeros((2, 3), np.float32))
        # one row without its batch axis: ORT's "Invalid rank for input" before (inference sweep)
        with pytest.raises(InferenceError, match=r"the input is one axis of 8 values.*after a batch axis"):
            client.predict("dev-1", np.zeros(8, np.float32))
        flat = digits_test[0][:2].reshape(2, -1)  # rows as in a CSV: the device fits its model's shape
        np.testing.assert_array_equal(
            client.predict("dev-1", flat).outputs, client.predict("dev-1", digits_test[0][:2]).outputs
        )
        # ONNX Runtime's message for a wrong inner dimension spans lines; a line break in a user property made
        # Mosquitto drop the agent ("Malformed UTF-8"), so this request went unanswered
        with pytest.raises(InferenceError, match=r"invalid dimensions.*index: 3 Got: 9 Expected: 8"):
            client.predict("dev-1", np.zeros((2, 1, 8, 9), np.float32), timeout=10)
        client.connection.publish(
            request_topic, b"\x93NUMPY garbage"
        )  # no response topic: counted, unanswered
        wait_until(lambda: agent.failed_requests.get("no-response-topic", 0) == 1)
        wildcard = MessageProperties(response_topic=client.topics.infer_reply("x") + "/#")
        client.connection.publish(request_topic, b"", message_properties=wildcard)  # cannot be answered
        wait_until(lambda: agent.failed_requests.get("bad-response-topic", 0) == 1)
        # another device's request topic, the fleet's artifacts, an answer topic of another device: the
        # agent had published its answer on each (inference sweep)
        for elsewhere in (
            request_topic.replace("dev-1", "dev-2"),
            client.topics.artifact("model-fp32"),
            client.topics.infer_reply("x", "dev-2"),
        ):
            props = MessageProperties(response_topic=elsewhere, correlation_data=b"c")
            client.connection.publish(request_topic, b"", message_properties=props)
        wait_until(lambda: agent.failed_requests.get("bad-response-topic", 0) == 4)
        with pytest.raises(InferenceError, match="Invalid rank"):  # the request's fault: a bad request
            client.predict("dev-1", np.zeros((2, 1, 64), np.float32), timeout=10)
        assert agent.failed_requests == {
            "bad-request": 5,
            "no-response-topic": 1,
            "bad-response-topic": 4,
        }
        assert client.predict("dev-1", np.zeros((2, 1, 8, 8), np.float32)).outputs.shape == (2, 10)
        assert agent.connection.connects == 1  # never dropped by the broker


def test_transfer_interrupted_mid_way_resumes_from_retained_chunks(mqtt, coordinator, variants, tmp_path):
    """Half the chunks, then the link drops; after reconnecting the device keeps what it had."""
    topics = Topics(coordinator.config.fleet)
    fp32_path, fp32 = variants["fp32"]
    data = fp32_path.read_bytes()
    header = ArtifactHeader.for_data("model-fp32", "v1", data, 8 * 1024, fp32.to_dict())
    chunks = split_chunks(data, header.chunk_size)
    half = len(chunks) // 2
    for index in range(half):
        coordinator.publish(topics.artifact_chunk("model-fp32", "v1", index), chunks[index], retain=True)
    coordinator.publish(topics.artifact("model-fp32"), header.encode(), retain=True)
    with _agent(mqtt, tmp_path) as agent:
        subscriber = agent.subscribers["fp32"]
        wait_until(lambda: subscriber.stats.receiving == "v1")
        wait_until(
            lambda: subscriber._assembler is not None and subscriber._assembler.missing == len(chunks) - half
        )
        agent.models_connection.drop_link()
        for index in range(half, len(chunks)):
            coordinator.publish(topics.artifact_chunk("model-fp32", "v1", index), chunks[index], retain=True)
        wait_until(lambda: subscriber.stats.delivered == 1)  # counted once the swap returns
        stats = subscriber.stats
        assert stats.delivered == 1 and stats.transfers_abandoned == 0
        assert agent.models_connection.connects >= 2
        kept = json.loads((tmp_path / "dev-1" / "model.onnx.json").read_text())
        assert kept["sha256"] == fp32.sha256


def test_two_replicas_take_turns_so_one_always_answers(mqtt, coordinator, variants, digits_test, tmp_path):
    """With replicas = 2 each replica leaves the shared request group to fetch and swap while the other
    answers."""
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet))
    fp32_path, fp32 = variants["fp32"]
    int8_path, int8 = variants["int8-static"]
    _publish(publisher, fp32_path, fp32, "v1")
    config = InferenceAgentConfig(
        node_id="dev-1", mqtt=mqtt(), model_dir=str(tmp_path / "dev-1"), replicas=2, status_every_s=0.2
    )
    replicas = [InferenceAgent(config, 0), InferenceAgent(config, 1)]
    for replica in replicas:
        replica.start()
    try:
        wait_until(lambda: all(r.server.serving_version == "v1" for r in replicas))
        wait_until(lambda: all(r.group._peer_serving() for r in replicas))  # each sees the other's status
        if all(r.model_work_lowered for r in replicas):  # where the OS lets a thread lower itself
            # model threads (chunks, checks, installs) run lowered; the request threads do not
            nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()}
            assert all(v == config.model_work_nice for k, v in nice.items() if k.startswith("artifact-model"))
            assert nice["paho-mqtt-client-dev-1-models"] == nice["paho-mqtt-client-dev-1-models-1"] == 10
            assert nice["paho-mqtt-client-dev-1-infer"] == nice["MainThread"]
        with InferenceClient(mqtt()) as client:
            answers: list[str] = []
            stop = threading.Event()

            def stream() -> None:
                while not stop.is_set():
                    answers.append(client.predict("dev-1", digits_test[0][:1], timeout=10).version)
                    stop.wait(0.01)

            thread = threading.Thread(target=stream)
            thread.start()
            wait_until(lambda: len(answers) >= 20)
            before = [r.group.swaps_out_of_group for r in replicas]  # v1 may or may not have found a peer
            turns_before = [r.group.turns for r in replicas]
            fetched_out_of_group: list[bool] = []  # for each chunk of v2: did its replica hold the turn, out?
            for replica in replicas:
                for subscriber in replica.subscribers.values():
                    on_chunk, group = subscriber._on_chunk, replica.group

                    def observed(topic, payload, on_chunk=on_chunk, group=group) -> None:
                        fetched_out_of_group.append(group._holders > 0 and group._left)
                        on_chunk(topic, payload)

                    subscriber._on_chunk = observed
            files = {"fp32": (fp32_path.read_bytes(), fp32), "int8-static": (int8_path.read_bytes(), int8)}
            publish_model(publisher, "v2", files)
            wait_until(lambda: all(r.server.serving_version == "v2" for r in replicas))
            count = len(answers)
            wait_until(lambda: len(answers) >= count + 20)
            stop.set()
            thread.join()
        assert answers[0] == "v1" and answers[-1] == "v2"
        after = [r.group.swaps_out_of_group for r in replicas]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]  # v2: each swapped outside
        # ... in one turn each: the fetches of both variants and the swap (one leave and rejoin per version)
        assert [r.group.turns - b for r, b in zip(replicas, turns_before, strict=True)] == [1, 1]
        # Both variants' chunks reached each replica only in its turn, out of the group: the serving replica
        # spends nothing on a transfer.
        assert len(fetched_out_of_group) >= 4 and all(fetched_out_of_group)
        assert all(r.requests > 0 for r in replicas), "the broker did not share the requests"
        assert sum(r.requests for r in replicas) == len(answers)
    finally:
        for replica in replicas:
            replica.stop()


def test_a_corrupt_int8_variant_does_not_hold_up_its_fp32(mqtt, coordinator, variants, digits_test, tmp_path):
    """The int8 artifact's bytes do not match its header: the device serves the version's fp32 anyway."""
    topics = Topics(coordinator.config.fleet)
    fp32_path, fp32 = variants["fp32"]
    int8_path, int8 = variants["int8-static"]
    int8_bytes = int8_path.read_bytes()
    meta = {"variants": ["fp32", "int8-static"]}
    header = ArtifactHeader.for_data(
        "model-int8-static", "v1", int8_bytes, 16 * 1024, int8.with_(extra={**int8.extra, **meta}).to_dict()
    )
    for index, chunk in enumerate(split_chunks(int8_bytes, header.chunk_size)):
        damaged = bytes([chunk[0] ^ 1]) + chunk[1:] if index == 0 else chunk
        coordinator.publish(topics.artifact_chunk("model-int8-static", "v1", index), damaged, retain=True)
    coordinator.publish(topics.artifact("model-int8-static"), header.encode(), retain=True)
    publisher = ArtifactPublisher(coordinator, topics)
    publisher.publish(
        "model-fp32", "v1", fp32_path.read_bytes(), fp32.with_(extra={**fp32.extra, **meta}).to_dict()
    )
    with _agent(mqtt, tmp_path) as agent:
        wait_until(lambda: len(agent.swap_log) == 2)  # the refused int8, then the installed fp32
        status = agent.status()
        assert status["version"] == "v1" and status["variant"] == "fp32"
        assert status["models"]["int8-static"]["refused_reasons"] == {"sha256": 1}
        assert [(e["variant"], e["ok"]) for e in status["swap_log"]] == [
            ("int8-static", False),
            ("fp32", True),
        ]


def test_large_requests_and_answers_travel_in_chunks_and_survive_a_dropped_link(
    mqtt, coordinator, variants, digits_test, tmp_path
):
    fp32_path, fp32 = variants["fp32"]
    _publish(ArtifactPublisher(coordinator, Topics(coordinator.config.fleet)), fp32_path, fp32, "v1")
    x = digits_test[0][:64]  # 16 KiB of inputs, 2.5 KiB of logits
    local = ModelServer()
    local.load(fp32_path)
    with (
        _agent(mqtt, tmp_path, chunk_bytes=1024) as agent,
        InferenceClient(mqtt(), chunk_bytes=2048) as client,
    ):
        wait_until(lambda: agent.server.serving_version == "v1")
        np.testing.assert_allclose(client.predict("dev-1", x).outputs, local.predict(x), atol=1e-5)
        agent.connection.drop_link()  # the request's chunks wait in the broker for the agent's session
        future = client.submit("dev-1", x)
        np.testing.assert_allclose(future.result(30).outputs, local.predict(x), atol=1e-5)
        assert agent.connection.connects >= 2 and agent.failed_requests == {}


def test_a_request_larger_than_the_device_accepts_is_refused_once_in_the_requesters_terms(
    mqtt, coordinator, variants, digits_test, tmp_path
):
    """The assembler's budget error named the requester's reply topic; the refusal names the device's cap."""
    fp32_path, fp32 = variants["fp32"]
    _publish(ArtifactPublisher(coordinator, Topics(coordinator.config.fleet)), fp32_path, fp32, "v1")
    x = np.tile(digits_test[0][:64], (8, 1, 1, 1))  # 128 KiB of inputs, in 2 KiB chunks
    with (
        _agent(mqtt, tmp_path, max_request_bytes=32 * 1024) as agent,
        InferenceClient(mqtt(), chunk_bytes=2048) as client,
    ):
        wait_until(lambda: agent.server.serving_version == "v1")
        with pytest.raises(InferenceError, match=r"this device accepts at most 32768 \(max_request_bytes\)"):
            client.predict("dev-1", x)
        np.testing.assert_allclose(client.predict("dev-1", x[:4]).outputs.shape, (4, 10))  # still serving
        assert agent.failed_requests == {"bad-chunk": 1}  # one refusal, not one per chunk


def test_a_version_served_before_and_published_again_is_installed_again(
    mqtt, coordinator, variants, tmp_path
):
    """A partition pipeline going back to a placement it had publishes the same content under the same
    version: the device had dropped it as a duplicate of the fp32 it once received, and kept serving the
    other version."""
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    fp32_path, fp32 = variants["fp32"]
    other_path, other = variants["int8-static"]
    with _agent(mqtt, tmp_path) as agent:
        for count, (version, path, manifest) in enumerate(
            (("a", fp32_path, fp32), ("b", other_path, other), ("a", fp32_path, fp32)), start=1
        ):
            _publish(publisher, path, manifest, version)
            wait_until(  # the swap log's entry follows the swap itself
                lambda v=version, n=count: (
                    agent.server.serving_version == v and sum(e["ok"] for e in agent.swap_log) >= n
                ),
                30,
                what=f"{version} served",
            )
        assert [e["version"] for e in agent.swap_log if e["ok"]] == ["a", "b", "a"]


def test_an_older_export_replayed_is_refused_after_a_restart_too(mqtt, coordinator, variants, tmp_path):
    """A broker replaying round 1's signed header after round 2 had the device go back to round 1: nothing
    compared exports (inference sweep). A coordinator's exports carry when their exporter started."""
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    fp32_path, fp32 = variants["fp32"]

    def exported(server_round: int, started: float):
        return fp32.with_(round=server_round, extra={**fp32.extra, "exporter_started": started})

    with _agent(mqtt, tmp_path) as agent:
        _publish(publisher, fp32_path, exported(1, 1000.0), "r0001")
        wait_until(lambda: agent.server.serving_version == "r0001")
        _publish(publisher, fp32_path, exported(2, 1000.0), "r0002")
        wait_until(lambda: agent.server.serving_version == "r0002")
        _publish(publisher, fp32_path, exported(1, 1000.0), "r0001")  # the replay
        wait_until(lambda: agent.status()["failed_swaps"].get("rollback", 0) == 1)
        assert agent.server.serving_version == "r0002"
        assert agent.swap_log[-1]["reason"] == "rollback"
    with _agent(mqtt, tmp_path) as agent:  # restarted: it serves the kept r0002 and still knows its order
        wait_until(lambda: agent.server.serving_version == "r0002")
        _publish(publisher, fp32_path, exported(1, 1000.0), "r0001b")  # (the broker retains r0001 too)
        wait_until(lambda: any(e["version"] == "r0001b" for e in agent.swap_log))
        assert agent.swap_log[-1]["reason"] == "rollback" and agent.server.serving_version == "r0002"
        _publish(publisher, fp32_path, exported(1, 2000.0), "r0001-new-run")  # a new run starts at round 1
        wait_until(lambda: agent.server.serving_version == "r0001-new-run")


def test_fedge_infer_asks_a_device_and_lists_what_it_serves(
    mqtt, coordinator, variants, digits_test, tmp_path
):
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    path, manifest = variants["fp32"]
    _publish(publisher, path, manifest, "v7")
    inputs = tmp_path / "x.npy"
    np.save(inputs, digits_test[0][:5])
    config = mqtt()
    where = ["--broker", config.broker_url, "--fleet", config.fleet]
    with _agent(mqtt, tmp_path, status_every_s=0.2) as agent:
        wait_until(lambda: agent.server.serving_version == "v7")
        question = ["infer", *where, "--node", "dev-1", "--input", str(inputs), "--json"]
        asked = CliRunner().invoke(app, question)
        assert asked.exit_code == 0, asked.output
        answer = json.loads(asked.stdout)
        assert answer["version"] == "v7"
        expected = ModelServer()
        expected.load(path)
        assert answer["predictions"] == expected.classify(digits_test[0][:5]).tolist()
        threads = agent.status()["threads"]
        wait_until(lambda: _listed(where, "model v7 ", f"(fp32, {threads} thread"))


def test_fedge_infer_prints_values_for_a_model_whose_manifest_says_so(
    mqtt, coordinator, variants, digits_test, tmp_path
):
    """A regressor of two or more targets was printed as argmax classes (inference sweep): the agent passes
    on its manifest's ``outputs`` kind, and ``fedge infer`` prints values for ``values``."""
    publisher = ArtifactPublisher(coordinator, Topics(coordinator.config.fleet), chunk_size=16 * 1024)
    path, manifest = variants["fp32"]
    _publish(publisher, path, manifest.with_(extra={**manifest.extra, "outputs": "values"}), "v8")
    inputs = tmp_path / "x.npy"
    rows = digits_test[0][:4].copy()
    rows[3] = np.nan  # NaN in, NaN out: warned, and null in the JSON (bare NaN is not JSON)
    np.save(inputs, rows)
    config = mqtt()
    question = ["infer", "--broker", config.broker_url, "--fleet", config.fleet, "--node", "dev-1"]
    with _agent(mqtt, tmp_path) as agent:
        wait_until(lambda: agent.server.serving_version == "v8")
        asked = CliRunner().invoke(app, [*question, "--input", str(inputs), "--json"])
    assert asked.exit_code == 0, asked.output
    assert "warning: 1 of 4 rows have NaN or infinite outputs" in asked.output
    answer = json.loads(asked.stdout.strip().splitlines()[-1])
    assert "predictions" not in answer and answer["shape"] == [4, 10]
    assert answer["outputs"][3] == [None] * 10
    expected = ModelServer()
    expected.load(path)
    np.testing.assert_allclose(answer["outputs"][:3], expected.predict(digits_test[0][:3]), atol=1e-5)


def _listed(where: list[str], *texts: str) -> bool:
    """Whether ``fedge infer --status`` lists dev-1 with every one of ``texts`` in its line."""
    listed = CliRunner().invoke(app, ["infer", *where, "--status", "--timeout", "0.5"])
    assert listed.exit_code == 0, listed.output
    lines = [line for line in listed.stdout.splitlines() if line.startswith("dev-1")]
    return any(all(text in line for text in texts) for line in lines)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: SIM115
    except OSError:
        return False
    return state != "Z"


def test_a_replica_stops_when_the_serve_process_that_started_it_is_killed(mqtt, tmp_path):
    """SIGKILL (or the OOM killer) of the first replica left the second serving under the device's name and
    fighting every restarted agent for its client id (CLI sweep)."""
    config = mqtt()
    (tmp_path / "infer.toml").write_text(
        f'node_id = "dev-r"\nmodel_dir = "{tmp_path / "models"}"\nreplicas = 2\n\n'
        f'[mqtt]\nbroker_url = "{config.broker_url}"\nfleet = "{config.fleet}"\n'
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    command = [sys.executable, "-m", "fedge", "serve", "--config", str(tmp_path / "infer.toml")]
    main = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    replicas: list[int] = []
    try:
        wait_until(lambda: replicas.extend(_children(main.pid)) or replicas, 60)
        main.kill()
        main.wait(30)
        wait_until(lambda: not _alive(replicas[0]), 60)
    finally:
        main.kill()
        for pid in replicas:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_agent_that_takes_models_from_anyone_says_so(mqtt, tmp_path, caplog):
    """Without instruction_key_files a device installs unsigned models from anyone; it had started silently
    (inference sweep)."""
    import logging

    caplog.set_level(logging.WARNING, logger="fedge.inference.agent")
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    with _agent(mqtt, tmp_path / "signed", instruction_keys=(public,)):
        assert "no instruction_key_files" not in caplog.text
    with _agent(mqtt, tmp_path / "open"):
        assert "no instruction_key_files: this device installs and serves models from anyone" in caplog.text
