"""The device agent: runs a Flower ClientApp for every instruction that reaches this node over MQTT.

What it runs. Only the ClientApp its own configuration names, and only for instructions whose task (the
``"task"`` key of the ``"config"`` ConfigRecord, which the reference ClientApp imports) is in its ``tasks``
allow-list. With the coordinator's public keys configured (``instruction_keys``), an instruction the
coordinator did not sign is not even decoded. Whoever can write this node's inbox (an anonymous or
compromised broker) therefore cannot make it import a module of their choosing. An instruction it will
not run (too large, unsigned or badly signed, undecodable, for another node, expired, a task not allowed)
is logged and answered at once with a refusal (:mod:`fedge.transport.signing`): the round need not wait.

Exactly once. An instruction is written to ``state_dir/inbox`` before it is worked on; the node's ``Context``
(with error-feedback residuals and anything else the ClientApp keeps in ``context.state``), the reply and a
journal of answered instruction ids with their expiry are written together, atomically, to
``state_dir/state.bin`` before the reply is sent. The transport's own memory of what it delivered does not
survive a restart, so after one an instruction may come again, from the inbox directory (``kill -9`` while
working) or from the coordinator (a redelivery). The last one answered gets its reply again (the
coordinator keeps the first copy that arrives); an older answered one is dropped with a log line (its reply
is no longer held); otherwise the ClientApp runs from the last saved Context. No instruction is run twice,
so an update is never applied to the residuals twice.

An instruction's inbox file is removed once the coordinator has its reply (the transfer completed), not
when the reply is queued: an agent stopped while a reply was still on its way (SIGTERM during training, a
slow uplink) finds the file when it starts again and sends the saved reply once more.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedge.atomic import write_bytes_atomic
from fedge.client.agent_config import REFERENCE_TASK, AgentConfig
from fedge.client.agent_state import (
    STATE_FILE,
    AgentState,
    Journal,
    load_state,
    read_saved_context,
    save_state,
)
from fedge.config import ConfigError, make_state_dir
from fedge.devices.profile import measure_device
from fedge.flower.compat import (
    MessageDecodeError,
    message_from_bytes,
    message_to_bytes,
)
from fedge.flower.node import call_client_app, error_reply, make_context
from fedge.importing import import_attribute
from fedge.protocol.envelope import encode_message
from fedge.protocol.fleet import PROFILE_PREFIX, REPLY_PREFIX, flower_node_id
from fedge.transport.endpoints import Delivery
from fedge.transport.node_endpoint import NodeEndpoint
from fedge.transport.rejections import RejectionLog
from fedge.transport.sender import TransferError, TransferHandle
from fedge.transport.signing import (
    INSTRUCTION_REFUSED,
    InstructionVerifier,
    Refusal,
    SignatureError,
    encode_refusal,
    is_signed_instruction,
    sign,
    strip_instruction_signature,
)

__all__ = ["REFERENCE_TASK", "AgentConfig", "DeviceAgent", "load_client_app", "read_saved_context"]

log = logging.getLogger(__name__)

_CONFLICT_WINDOW_S = 60.0  # how recent another session's announcement must be to explain flapping


def load_client_app(path: str) -> ClientApp:
    """Import ``package.module:attribute`` and check it is a ClientApp."""
    app = import_attribute(path, "client app")
    if not isinstance(app, ClientApp):
        raise ValueError(f"{path!r} does not name a flwr ClientApp")
    return app


class _Refused(Exception):
    """Raised while admitting an instruction; ``message`` is set once it decoded and is this node's."""

    def __init__(self, reason: str, detail: str, message: Message | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.refusal, self.message = Refusal(reason, detail), message


class DeviceAgent:
    """Connects to the broker, runs the ClientApp per admitted instruction, keeps its state on disk.

    Parameters
    ----------
    config : AgentConfig
        Who this node is, where the broker is, where state lives, what it may run and whom it trusts.
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.flower_node_id = flower_node_id(config.node_id)
        self._app = load_client_app(config.client_app)
        self._verifier = InstructionVerifier(config.instruction_keys) if config.instruction_keys else None
        self._state_dir = Path(config.state_dir)
        self._inbox_dir = self._state_dir / "inbox"
        make_state_dir(self._inbox_dir)
        state_file = self._state_dir / STATE_FILE
        if state_file.exists() and not state_file.is_file():  # it could be neither read nor replaced
            raise ConfigError(f"{state_file} is not a file: the agent keeps its node's state there")
        self._lock = threading.Lock()
        self._unsent: dict[str, TransferHandle] = {}  # replies on their way, by instruction id
        # not _lock, which training holds: the transport's timer must not wait on it
        self._unsent_lock = threading.Lock()
        self._endpoint = NodeEndpoint(config.mqtt, config.node_id, on_message=self._on_delivery)
        self._endpoint.channel.add_timer(lambda _now: self.forget_sent())
        self._endpoint.channel.connection.on_flapping = self._flapping
        self._endpoint.channel.connection.on_publish_refused = self._publish_refused
        # set when the agent cannot serve its node (another live process holds its node id, or the broker's
        # ACL refuses what it publishes): run_forever stops
        self.conflict = ""
        self.handled = 0
        self.refused: Counter[str] = Counter()
        self._refusal_log = RejectionLog()

    def start(self) -> None:
        """Connect, report the device profile and finish instructions left by a crash."""
        if self._verifier is None:  # the default: said once, where an operator looks
            log.warning(
                "no instruction_key_files: this agent runs instructions from anyone who can publish on its "
                "inbox; give it the coordinator's public key (docs/deployment.md)"
            )
        self._endpoint.start()
        self._endpoint.send(  # signed as replies are: the coordinator samples and budgets by it
            self._sign(dataclasses.replace(measure_device(), **self.config.link).to_bytes()),
            message_id=f"{PROFILE_PREFIX}{self._endpoint.epoch}",
            expiry_s=3600,
        )
        for path in sorted(self._inbox_dir.glob("*.msg")):
            log.info("resuming instruction %s left by a previous run", path.stem)
            try:
                self._process(path.stem, path.read_bytes())
            except Exception:  # it would fail again at every start: a service that never comes up
                aside = path.with_suffix(".failed")
                log.exception("instruction %s failed again; set aside as %s", path.stem, aside.name)
                path.replace(aside)

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Start, then serve until ``stop`` is set (or forever)."""
        stop = stop or threading.Event()
        self.start()
        try:
            while not stop.wait(0.5) and not self.conflict:
                pass
        finally:
            self.close()
        if self.conflict:
            raise ConfigError(self.conflict)

    def close(self) -> None:
        self.forget_sent()  # before the channel fails what is still on its way: that stays in the inbox
        self._endpoint.close()

    def _flapping(self) -> None:
        """The broker keeps closing this agent's connection right after accepting it. With other sessions
        announcing this node online meanwhile (:meth:`NodeEndpoint.foreign_sessions`), another live process
        holds this node id: it answers some of the node's instructions from a state of its own, and the two
        would train the node's updates from diverging contexts. This agent stops rather than go on (a lossy
        link flaps, but announces no one else)."""
        if self._endpoint.foreign_sessions(_CONFLICT_WINDOW_S) >= 2 and not self.conflict:
            self.conflict = (
                f"another live process uses node id {self.config.node_id!r} (it keeps announcing this node"
                " online while the broker keeps closing this agent's connection): this agent stops; give each"
                " agent its own node_id"
            )
            log.error("%s", self.conflict)

    def _publish_refused(self, reason: str) -> None:
        """The broker refused one of this agent's publishes. "Not authorized" is its ACL: the presence,
        replies and acknowledgements of this node reach no one, however long the agent runs (as a service,
        "active" and silent), so it stops and says which user and node the broker would not match."""
        if reason == "Not authorized" and not self.conflict:
            self.conflict = (
                f"the broker refuses this agent's publishes (Not authorized): its ACL does not let user "
                f"{self.config.mqtt.username!r} publish as node {self.config.node_id!r} (fedge's deploy ACL "
                "expects each node's username to be its node_id, the default)"
            )
            log.error("%s", self.conflict)

    def forget_sent(self) -> None:
        """Remove the inbox files of instructions whose replies the coordinator has (see the module
        docstring; the transport calls it about once a second). A reply that failed for good (it expired)
        is not sent again either."""
        with self._unsent_lock:
            done = [(i, handle) for i, handle in self._unsent.items() if handle.done()]
            for instruction_id, _ in done:
                del self._unsent[instruction_id]
        for instruction_id, handle in done:
            if handle.error is not None:
                log.warning("reply to instruction %s not delivered: %s", instruction_id, handle.error)
            if getattr(handle.error, "rejected", "") == "TOO_LARGE":
                # The coordinator will never have this reply: a refusal says so, or its round waits it out.
                refusal = Refusal("too-large", "this node's reply is over what the coordinator takes")
                self._send(instruction_id, self._sign(encode_refusal(refusal)))
            (self._inbox_dir / f"{instruction_id}.msg").unlink(missing_ok=True)

    # -- instructions ----------------------------------------------------------------------------------

    def _on_delivery(self, delivery: Delivery) -> None:
        instruction_id = _safe(delivery.message_id)
        size, limit = len(delivery.payload), self.config.max_instruction_bytes
        if size > limit:
            refused = _Refused("too-large", f"{size} bytes; this agent takes at most {limit}")
            self._send(instruction_id, self._refusal_bytes(instruction_id, refused))
            return
        path = self._inbox_dir / f"{instruction_id}.msg"
        write_bytes_atomic(path, bytes(delivery.payload))
        self._process(instruction_id, bytes(delivery.payload))

    def _process(self, instruction_id: str, payload: bytes) -> None:
        inbox_file = self._inbox_dir / f"{instruction_id}.msg"
        with self._lock:
            state = self._load_state()
            if instruction_id == state.last_id:
                log.info("instruction %s was answered already; its reply is sent again", instruction_id)
                reply_bytes = state.last_reply
            elif instruction_id in state.journal.answered:
                log.info(
                    "instruction %s was answered before and its reply is no longer held; dropped",
                    instruction_id,
                )
                inbox_file.unlink(missing_ok=True)
                return
            else:
                try:
                    message = self._admit(instruction_id, payload, state.journal)
                except _Refused as refused:
                    reply_bytes = self._refusal_bytes(instruction_id, refused)
                else:
                    context = self._context(state.context, message.metadata.run_id)
                    # The compact envelope where the reply's shape allows: the coordinator derives the rest.
                    reply_bytes = self._sign(_encoded(message, self._run_app(message, context)))
                    expires_at = message.metadata.created_at + message.metadata.ttl
                    state.journal.add(instruction_id, expires_at, time.time(), self._skew_s)
                    self._save_state(context, instruction_id, reply_bytes, state.journal)
                    self.handled += 1
        try:
            handle = self._send(instruction_id, reply_bytes)
        except TransferError:  # the agent is closing: the inbox file brings the reply back at its next start
            log.info(
                "instruction %s: the agent stopped before its reply was sent; it is sent at the next start",
                instruction_id,
            )
            return
        with self._unsent_lock:
            self._unsent[instruction_id] = handle

    def _admit(self, instruction_id: str, payload: bytes, journal: Journal) -> Message:
        """The instruction as a Flower message, if this agent will run it; else raise :class:`_Refused`."""
        body = payload
        if self._verifier is not None:
            try:
                body = self._verifier.verify(self.config.node_id, instruction_id, payload)
            except SignatureError as err:
                raise _Refused("signature", str(err)) from None
        elif is_signed_instruction(payload):
            body = strip_instruction_signature(payload)  # no coordinator key configured: nothing to check
        try:
            message = message_from_bytes(body, max_bytes=self.config.max_instruction_bytes)
        except MessageDecodeError as err:
            raise _Refused("undecodable", str(err)) from None
        metadata = message.metadata
        if metadata.dst_node_id != self.flower_node_id or metadata.message_id != instruction_id:
            # Not answerable as a Flower reply: the coordinator matches replies by these very fields.
            raise _Refused(
                "wrong-recipient", f"message {metadata.message_id!r} for Flower node {metadata.dst_node_id}"
            )
        expires_at = metadata.created_at + metadata.ttl
        if time.time() > expires_at + self._skew_s:
            raise _Refused("expired", f"expired at {expires_at:.0f} (Unix time)", message)
        if expires_at <= journal.floor:
            raise _Refused(
                "stale", "older than instructions this agent no longer remembers answering", message
            )
        config = message.content.config_records.get("config") if message.has_content() else None
        if config is not None and "task" in config:
            task = config["task"]
            if not isinstance(task, str) or task not in self.config.tasks:
                raise _Refused("task-not-allowed", f"task {task!r} is not in this agent's tasks", message)
        return message

    def _refusal_bytes(self, instruction_id: str, refused: _Refused) -> bytes:
        """A Flower error reply if the instruction decoded, else a refusal notice; logged and counted."""
        self.refused[refused.refusal.reason] += 1
        # a flood of forged instructions (an open broker) must not fill the device's log: the first of a
        # reason at once, then one line a minute saying how many
        reason, detail = refused.refusal.reason, str(refused.refusal)
        for report in self._refusal_log.drop("inbox", instruction_id, reason, detail, time.time()):
            more = f" ({report.count} refused for {reason} since the last line)" if report.count > 1 else ""
            log.warning("refused instruction %s: %s%s", report.server_round, report.detail, more)
        if refused.message is not None:
            reply = error_reply(refused.message, INSTRUCTION_REFUSED, str(refused.refusal))
            return self._sign(message_to_bytes(reply))
        return self._sign(encode_refusal(refused.refusal))

    def _sign(self, reply: bytes) -> bytes:
        return reply if self.config.signing_key is None else sign(self.config.signing_key, reply)

    def _send(self, instruction_id: str, reply: bytes) -> TransferHandle:
        return self._endpoint.send(reply, message_id=f"{REPLY_PREFIX}{instruction_id}")

    @property
    def _skew_s(self) -> float:
        return self.config.mqtt.transfer.clock_skew_s

    def _run_app(self, message: Message, context: Context) -> Message:
        started = time.perf_counter()
        reply = call_client_app(self._app, message, context)  # an exception becomes an error reply
        log.info("instruction %s done in %.2f s", message.metadata.message_id, time.perf_counter() - started)
        return reply

    def _context(self, saved: Context | None, run_id: int) -> Context:
        """The saved Context (its state: residuals, counters), with the node config this agent's file
        gives now: a restarted agent whose ``[node_config]`` was edited (its memory, its partition) kept
        the values saved with the Context."""
        node_config = {"node-name": self.config.node_id, **self.config.node_config}
        if saved is None:
            return make_context(run_id, self.flower_node_id, node_config)
        if dict(saved.node_config) != node_config:
            log.info("node_config changed since the state was saved; the agent's file is followed")
            saved.node_config = node_config
        return saved

    # -- state file (fedge.client.agent_state) -----------------------------------------------------------

    def _load_state(self) -> AgentState:
        return load_state(self._state_dir / STATE_FILE)

    def _save_state(self, context: Context, instruction_id: str, reply: bytes, journal: Journal) -> None:
        save_state(self._state_dir / STATE_FILE, AgentState(context, instruction_id, reply, journal))


def _safe(message_id: str) -> str:
    """Instruction ids come from the coordinator; keep them to file-name characters.

    MqttGrid's ids are hex and pass unchanged, which the signature and metadata checks rely on (an inbox
    file found after a restart is known by this name only)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in message_id)[:128]


def _encoded(instruction: Message, reply: Message) -> bytes:
    """``reply``'s bytes; a reply that cannot be encoded (a figure no wire format holds) is answered with
    an error naming why, at once, so no round waits out its timeout for this node."""
    try:
        return encode_message(reply)
    except Exception as err:  # whatever the app put in its reply, the coordinator hears back
        log.warning("instruction %s: reply not encodable: %r", instruction.metadata.message_id, err)
        reason = f"the ClientApp's reply could not be encoded: {type(err).__name__}: {err}"
        return encode_message(error_reply(instruction, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason))
