"""What an agent runs, and that it answers each instruction exactly once, against a real Mosquitto.

Agents run in-process with real Flower messages from a real MqttGrid: instructions must be signed by the
coordinator's key when the agent has its public key; a task outside the agent's allow-list is never imported;
refused instructions are answered at once (the round does not wait out its timeout) and audited; an
instruction answered before a restart and delivered again does not run the ClientApp again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from service_helpers import reference_agent

import fedge.client.agent as agent_module
import fedge.client.agent_state as agent_state_module
import fedge.transport.grid as grid_module
from fedge.app.config import AppConfig
from fedge.app.coordinator import CoordinatorConfig, run_coordinator
from fedge.client.agent import AgentConfig, DeviceAgent
from fedge.config import ConfigError
from fedge.flower.compat import message_to_bytes, set_task_identity
from fedge.protocol.fleet import flower_node_id
from fedge.server.service import ServiceConfig
from fedge.transport.grid import MqttGrid
from fedge.transport.signing import (
    INSTRUCTION_REFUSED,
    InstructionSigner,
    InstructionVerifier,
    Refusal,
    SignatureError,
    decode_refusal,
    encode_refusal,
    load_public_key,
)

TIMEOUT = 60.0  # a round's timeout: a refused instruction must be answered long before it


def _keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """An Ed25519 key pair as PEM files, as ``deploy/make-passwords.sh`` writes them (openssl genpkey)."""
    key = Ed25519PrivateKey.generate()
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def _counting_app(runs: list[int]) -> ClientApp:
    """A ClientApp whose every run bumps a counter kept in the node's Context (like EF residuals)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        count = int(context.state["n"]["count"]) + 1 if "n" in context.state else 1
        context.state["n"] = MetricRecord({"count": count})
        runs.append(count)
        return Message(RecordDict({"metrics": MetricRecord({"count": count})}), reply_to=msg)

    return app


def _instruction(node: str, config: dict | None = None, size: int = 3, ttl: float = 60.0) -> Message:
    set_task_identity(run_id=3)
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.ones(size, dtype=np.float32))}),
            "config": ConfigRecord({"server-round": 1, **(config or {})}),
        }
    )
    return Message(content, flower_node_id(node), "train", ttl=ttl)


def _one_reply(grid: MqttGrid, message: Message) -> Message:
    started = time.monotonic()
    replies = list(grid.send_and_receive([message], timeout=TIMEOUT))
    assert len(replies) == 1, "no reply: the round waited its whole timeout"
    assert time.monotonic() - started < TIMEOUT / 2
    return replies[0]


def _refusal(reply: Message) -> Refusal:
    assert reply.has_error() and reply.error.code == INSTRUCTION_REFUSED, reply
    return Refusal.from_error_reason(reply.error.reason)


@pytest.fixture
def counting(monkeypatch) -> list[int]:
    """Agents built in this test run a counting ClientApp; the list holds each run's counter."""
    runs: list[int] = []
    app = _counting_app(runs)
    monkeypatch.setattr(agent_module, "load_client_app", lambda path: app)
    return runs


def test_only_instructions_the_coordinator_signed_are_run(mqtt, tmp_path, counting, caplog):
    caplog.set_level(logging.WARNING, logger="fedge.client.agent")
    key, public = _keypair(tmp_path, "coordinator")
    rogue_key, _ = _keypair(tmp_path, "rogue")
    broker = mqtt()
    (tmp_path / "agent.toml").write_text(
        f'node_id = "gina"\nstate_dir = "{tmp_path / "state"}"\ninstruction_key_files = ["{public}"]\n'
        f'[mqtt]\nbroker_url = "{broker.broker_url}"\nfleet = "{broker.fleet}"\nreconnect_max_s = 0.5\n'
    )
    agent = DeviceAgent(AgentConfig.from_toml(tmp_path / "agent.toml"))
    agent.start()
    audit: list[dict] = []
    try:
        # The coordinator with its key, then impostors that can write the inbox: no key, another key.
        for index, signer in enumerate([key, None, rogue_key, InstructionSigner.from_file(key)]):
            with MqttGrid(mqtt(client_id=f"c{index}"), instruction_key=signer, audit=audit.append) as grid:
                assert grid.wait_for_nodes(1, timeout=20)
                reply = _one_reply(grid, _instruction("gina"))
                if signer is None or signer == rogue_key:
                    assert _refusal(reply).reason == "signature"
                else:
                    assert reply.content["metrics"]["count"] == len(counting)
    finally:
        agent.close()
    assert counting == [1, 2], "a refused instruction ran the ClientApp"
    assert agent.refused == {"signature": 2}
    # every refusal counted; the log says the first of a reason at once, the rest at most once a minute
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused instruction")]
    assert len(lines) == 1, lines
    refused = [e for e in audit if e["event"] == "refused"]
    assert [e["reason"] for e in refused] == ["signature", "signature"]
    assert "not signed" in refused[0]["detail"] and "does not trust" in refused[1]["detail"]
    assert [e["event"] for e in audit if e["event"] != "refused"] == ["accepted", "accepted"]


def test_a_task_outside_the_allow_list_is_refused_and_never_imported(mqtt, tmp_path):
    marker = tmp_path / "imported"
    evil = tmp_path / "evil.py"
    evil.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nclass Evil: pass\n")
    config = AgentConfig(
        node_id="hank",
        mqtt=mqtt(),
        state_dir=str(tmp_path / "state"),
        node_config={"partition-id": 0, "num-partitions": 2},
    )
    assert config.tasks == ("fedge.app.task:DigitsTask",) and config.client_app == "fedge.app.client_app:app"
    agent = DeviceAgent(config)  # the reference ClientApp, which imports the task an instruction names
    agent.start()
    audit: list[dict] = []
    train = {
        "task-args": "{}",
        "alpha": 0.5,
        "seed": 0,
        "local-epochs": 1,
        "learning-rate": 0.05,
        "batch-size": 4,
    }
    try:
        with MqttGrid(mqtt(), audit=audit.append) as grid:
            assert grid.wait_for_nodes(1, timeout=20)
            instruction = _instruction("hank", {**train, "task": f"{evil}:Evil"})
            reply = _one_reply(grid, instruction)
    finally:
        agent.close()
    assert not marker.exists(), "the agent imported a module an instruction named"
    refusal = _refusal(reply)
    assert refusal.reason == "task-not-allowed" and "evil.py:Evil" in refusal.detail
    assert grid.refusals == {"task-not-allowed": 1} and agent.handled == 0
    assert [(e["event"], e["node"], e["reason"]) for e in audit] == [("refused", "hank", "task-not-allowed")]


def test_refused_instructions_are_answered_at_once(mqtt, tmp_path, counting, monkeypatch):
    config = AgentConfig(node_id="ivy", mqtt=mqtt(), state_dir=str(tmp_path), max_instruction_bytes=4096)
    agent = DeviceAgent(config)
    agent.start()
    audit: list[dict] = []
    try:
        with MqttGrid(mqtt(), audit=audit.append) as grid:
            assert grid.wait_for_nodes(1, timeout=20)
            too_large = _refusal(_one_reply(grid, _instruction("ivy", size=10_000)))
            expired = _instruction("ivy")
            expired.metadata.created_at = time.time() - 3600  # a copy kept by a broker for an hour
            stale = _refusal(_one_reply(grid, expired))
            with monkeypatch.context() as patch:  # the bytes are mangled on the way: they do not decode
                patch.setattr(grid_module.MessageEncoder, "encode", lambda self, message: b"\x00\xffgarbage")
                garbage = _refusal(_one_reply(grid, _instruction("ivy")))
            assert _one_reply(grid, _instruction("ivy")).content["metrics"]["count"] == 1
    finally:
        agent.close()
    assert too_large.reason == "too-large" and "4096" in too_large.detail
    assert stale.reason == "expired"
    assert garbage.reason == "undecodable"
    assert counting == [1]
    refused = [(e["event"], e["reason"]) for e in audit if e["event"] != "accepted"]
    assert refused == [("refused", "too-large"), ("refused", "expired"), ("refused", "undecodable")]
    assert agent.refused == {"too-large": 1, "expired": 1, "undecodable": 1}
    assert not list((tmp_path / "inbox").iterdir()), "a refused instruction stayed in the inbox"


def test_an_answered_instruction_delivered_again_after_a_restart_does_not_run_again(
    mqtt, tmp_path, counting, caplog
):
    caplog.set_level(logging.INFO, logger="fedge.client.agent")
    config = AgentConfig(node_id="kate", mqtt=mqtt(), state_dir=str(tmp_path))
    with MqttGrid(mqtt()) as grid:
        first = DeviceAgent(config)
        first.start()
        assert grid.wait_for_nodes(1, timeout=20)
        sent = []
        for expected in (1, 2):
            instruction = _instruction("kate")
            assert _one_reply(grid, instruction).content["metrics"]["count"] == expected
            sent.append((instruction.metadata.message_id, message_to_bytes(instruction)))
        first.close()

        # A new process: its transport has forgotten what it delivered, so both come through again.
        second = DeviceAgent(config)
        second.start()
        try:
            for message_id, payload in sent:
                assert grid.endpoint.send("kate", payload, message_id=message_id).wait(30)
            # Handled in order, so by the time a new instruction is answered both redeliveries were.
            assert _one_reply(grid, _instruction("kate")).content["metrics"]["count"] == 3
        finally:
            second.close()
    assert counting == [1, 2, 3], "an instruction ran twice"
    assert f"instruction {sent[0][0]} was answered before and its reply is no longer held" in caplog.text
    assert f"instruction {sent[1][0]} was answered already; its reply is sent again" in caplog.text


def test_the_journal_is_bounded_and_what_it_forgot_is_refused(mqtt, tmp_path, counting, monkeypatch):
    monkeypatch.setattr(agent_state_module, "JOURNAL_SIZE", 2)
    config = AgentConfig(node_id="liam", mqtt=mqtt(), state_dir=str(tmp_path))
    with MqttGrid(mqtt()) as grid:
        first = DeviceAgent(config)
        first.start()
        assert grid.wait_for_nodes(1, timeout=20)
        oldest = _instruction("liam")
        for instruction in (oldest, _instruction("liam"), _instruction("liam")):
            _one_reply(grid, instruction)
        first.close()
        second = DeviceAgent(config)
        second.start()
        try:
            payload = message_to_bytes(oldest)
            assert grid.endpoint.send("liam", payload, message_id=oldest.metadata.message_id).wait(30)
            assert _one_reply(grid, _instruction("liam")).content["metrics"]["count"] == 4
        finally:
            second.close()
    assert counting == [1, 2, 3, 4]
    assert second.refused == {"stale": 1}


def test_the_coordinator_service_signs_what_its_agents_require(mqtt, tmp_path):
    key, public = _keypair(tmp_path, "coordinator")
    agent = reference_agent(mqtt(), tmp_path / "agent", "mona", instruction_keys=(load_public_key(public),))
    agent.start()
    try:
        service = ServiceConfig(
            mqtt=mqtt(), state_dir=str(tmp_path / "coordinator"), instruction_key_file=str(key)
        )
        app = AppConfig(rounds=1, local_epochs=1, min_nodes=1, out_dir=str(tmp_path / "out"))
        history = run_coordinator(CoordinatorConfig(service=service, app=app))
    finally:
        agent.close()
    assert [r.clients_replied for r in history.rounds] == [1]
    assert agent.handled == 1 and not agent.refused


def test_instruction_signatures_bind_key_node_message_id_and_bytes(tmp_path):
    old_key, old_public = _keypair(tmp_path, "old")
    new_key, new_public = _keypair(tmp_path, "new")
    old, new = InstructionSigner.from_file(old_key), InstructionSigner.from_file(new_key)
    rotating = InstructionVerifier([load_public_key(old_public), load_public_key(new_public)])
    assert rotating.verify("n1", "m1", old.sign("n1", "m1", b"body")) == b"body"
    assert rotating.verify("n1", "m1", new.sign("n1", "m1", b"body")) == b"body"

    verifier = InstructionVerifier([load_public_key(new_public)])
    signed = new.sign("n1", "m1", b"body")
    tampered = bytearray(signed)
    tampered[-1] ^= 0x01
    for node, message_id, payload, needle in [
        ("n1", "m1", old.sign("n1", "m1", b"body"), "does not trust"),
        ("n2", "m1", signed, "does not match"),
        ("n1", "m2", signed, "does not match"),
        ("n1", "m1", bytes(tampered), "does not match"),
        ("n1", "m1", b"body", "not signed"),
        ("n1", "m1", signed[:40], "not signed"),
    ]:
        with pytest.raises(SignatureError, match=needle):
            verifier.verify(node, message_id, payload)

    assert decode_refusal(encode_refusal(Refusal("signature", "x" * 5000))).detail == "x" * 2000
    for bad in [b"FRF1[]", b"FRF1{", b"\x0agarbage", b"FRF1" + b" " * 20_000]:
        with pytest.raises(ValueError):
            decode_refusal(bad)
    with pytest.raises(ConfigError, match="public key"):
        load_public_key(old_key)  # a private key where the public one belongs
    with pytest.raises(ConfigError, match="cannot be read"):
        InstructionSigner.from_file(old_public)


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('tasks = ["fedge.app.task"]\n', "tasks entry"),
        ("tasks = [1]\n", r"tasks\[0\] must be str"),
        ("tasks = []\n", "tasks is empty: the agent could run no task"),
        ("instruction_key_files = []\n", "non-empty list"),
        ('instruction_key_files = ["/nonexistent.pub"]\n', "instruction key file"),
    ],
)
def test_bad_agent_security_settings_are_config_errors(tmp_path, toml, needle):
    path = tmp_path / "agent.toml"
    path.write_text(f'node_id = "n1"\nstate_dir = "s"\n{toml}')
    with pytest.raises(ConfigError, match=needle):
        AgentConfig.from_toml(path)


def test_an_instruction_that_fails_again_after_a_restart_is_set_aside(mqtt, tmp_path, monkeypatch, caplog):
    """An instruction left in the inbox is resumed at start; one whose handling raises (a decoder bug that
    a crafted message reached) had stopped the agent at every start: a device in a crash loop."""
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "poison.msg").write_bytes(b"crafted")

    def broken(*_args, **_kwargs):
        raise AttributeError("'NoneType' object has no attribute 'endswith'")

    monkeypatch.setattr(agent_module, "message_from_bytes", broken)
    agent = DeviceAgent(AgentConfig(node_id="una", mqtt=mqtt(), state_dir=str(tmp_path)))
    try:
        agent.start()
    finally:
        agent.close()
    assert not (tmp_path / "inbox" / "poison.msg").exists()
    assert (tmp_path / "inbox" / "poison.failed").read_bytes() == b"crafted"
    assert "instruction poison failed again; set aside as poison.failed" in caplog.text


def test_a_reply_over_the_coordinators_limit_is_answered_by_a_refusal(mqtt, tmp_path, monkeypatch):
    """The coordinator's transport refused the reply at once and the agent knew it, but the round waited
    its whole timeout for a reply that could never come (attack sweep: a 1.6 MB metric)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"big": [0.5] * 20_000})}), reply_to=msg)

    monkeypatch.setattr(agent_module, "load_client_app", lambda path: app)
    agent = DeviceAgent(AgentConfig(node_id="lea", mqtt=mqtt(), state_dir=str(tmp_path)))
    agent.start()
    try:
        with MqttGrid(mqtt()) as grid:
            grid.endpoint.set_message_limit(lambda node: 4096)
            assert grid.wait_for_nodes(1, timeout=20)
            refused = _refusal(_one_reply(grid, _instruction("lea")))
    finally:
        agent.close()
    assert refused.reason == "too-large" and "reply is over what the coordinator takes" in refused.detail
