"""A Flower ``Grid`` over MQTT: the unchanged ServerApp and any Flower strategy reach devices via a broker.

Each instruction is a serialized Flower ``Message`` sent to the node's inbox with the message's TTL as its
expiry; each reply comes back on the node's outbox. The Grid samples only among online nodes (presence),
checks that a reply's sender matches the topic it came on and that it answers an instruction still awaited,
and hands every instruction at most one reply: duplicates and late replies to an earlier round are dropped,
logged and counted. Nodes are named by strings on the wire; Flower sees a stable 63-bit id per name.

With the coordinator's instruction key, every instruction is signed (Ed25519, :mod:`fedge.transport.signing`)
for its node and message id. An agent that refuses an instruction answers at once, either with a Flower
error reply (code ``INSTRUCTION_REFUSED``) or, if it could not decode or verify the instruction, with a
refusal notice on message id ``reply:<instruction id>``, which the Grid turns into that same error reply.
Either way the round stops waiting for the node, and the refusal is audited as ``refused``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Error, Message, Metadata, RecordDict

from fedge.config import ConfigError
from fedge.devices.profile import DeviceProfile
from fedge.flower.compat import MessageDecodeError, MessageEncoder, message_from_bytes
from fedge.flower.compat import set_message_id as _set_message_id
from fedge.flower.grid import RunGrid
from fedge.flower.node import cap_reason
from fedge.protocol.envelope import EnvelopeError, decode_content, is_envelope
from fedge.protocol.fleet import PROFILE_PREFIX, REPLY_PREFIX, flower_node_id
from fedge.transport.config import MqttConfig
from fedge.transport.endpoints import CoordinatorEndpoint, Delivery
from fedge.transport.rejections import Rejection, RejectionLog
from fedge.transport.sender import TransferError, TransferHandle
from fedge.transport.signing import (
    INSTRUCTION_REFUSED,
    InstructionSigner,
    Refusal,
    SignatureError,
    decode_refusal,
    is_refusal,
    verify,
)

__all__ = ["MqttGrid"]

log = logging.getLogger(__name__)

_FORGET_AFTER = 100_000  # answered or abandoned instruction ids remembered, to recognise late replies


@dataclass
class _Awaited:
    node: str
    server_round: str
    metadata: Metadata  # the instruction's, to answer it with an error reply on the node's behalf
    transfer: TransferHandle | None = None  # its transfer to the node, cancelled if it goes unanswered


class MqttGrid(RunGrid):
    """Flower Grid whose nodes are MQTT device agents.

    Parameters
    ----------
    config : MqttConfig
        Broker URL, credentials, TLS and transfer settings of the coordinator.
    node_keys : mapping of str to bytes, optional
        Per-node HMAC keys; when given, every reply must be signed with its node's key.
    max_message_bytes : int (default: 256 MiB)
        Replies larger than this are refused before decoding.
    audit : callable(dict), optional
        Told of every reply's fate: ``{"event": "accepted" | "rejected" | "refused", "node", "round",
        "reason", ...}`` (``refused``: the node answered that it will not run the instruction, and why).
    instruction_key : InstructionSigner, str or Path, optional
        The coordinator's Ed25519 private key (or the path of its PEM file); every instruction is signed
        with it, and agents configured with its public key refuse anything else.
    """

    def __init__(
        self,
        config: MqttConfig,
        *,
        node_keys: Mapping[str, bytes] | None = None,
        max_message_bytes: int = 256 * 1024 * 1024,
        audit: Callable[[dict[str, Any]], None] | None = None,
        instruction_key: InstructionSigner | str | Path | None = None,
    ) -> None:
        super().__init__()
        if isinstance(instruction_key, str | Path):
            instruction_key = InstructionSigner.from_file(instruction_key)
        self._signer = instruction_key
        self._node_keys = dict(node_keys) if node_keys is not None else None
        self._keyless_seen: set[str] = set()  # online nodes without a key, already warned about
        self._max_message_bytes = max_message_bytes
        self._audit = audit
        self._cond = threading.Condition()
        self._awaited: dict[str, _Awaited] = {}
        self._replies: dict[str, Message] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # instruction id -> its round
        self.profiles: dict[str, DeviceProfile] = {}
        self.on_profile: Callable[[], None] | None = None  # told after each profile kept (to persist them)
        self.dropped: Counter[str] = Counter()
        self.rejections = RejectionLog()  # the same drops per node, and which of them to log now
        self.refusals: Counter[str] = Counter()
        self.endpoint = CoordinatorEndpoint(config, on_message=self._on_delivery)
        # the instructed nodes' replies come first when the receiver is full (read under the transport's
        # lock: a copy of the values, never this Grid's lock)
        self.endpoint.set_awaited(lambda: [awaited.node for awaited in list(self._awaited.values())])

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> MqttGrid:
        """Connect to the broker and start tracking nodes."""
        self.endpoint.start()
        return self

    def close(self) -> None:
        self.endpoint.close()
        self._report(self.rejections.flush_all())

    def __enter__(self) -> MqttGrid:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_nodes(self, count: int, timeout: float, *, stall_timeout: float | None = None) -> bool:
        """Block until ``count`` nodes are online (True) or ``timeout`` seconds pass (False).

        With ``stall_timeout``, once the first node is online, also give up when that long passes without
        one more coming online: a fleet still starting on a loaded machine gets the time it needs, a stuck
        one is noticed sooner.
        """
        start = time.monotonic()
        best, last_progress = 0, None
        while (online := len(self._eligible())) < count:
            now = time.monotonic()
            if online > best:
                best, last_progress = online, now
            stalled = (
                stall_timeout is not None
                and last_progress is not None
                and now - last_progress > stall_timeout
            )
            if now - start > timeout or stalled:
                return False
            time.sleep(0.1)
        return True

    # -- Grid ------------------------------------------------------------------------------------------

    def get_node_ids(self) -> Iterable[int]:
        return sorted(flower_node_id(name) for name in self._eligible())

    def _eligible(self) -> set[str]:
        """The online nodes this Grid may instruct: with ``node_keys``, only those it holds a key for. Any
        client of an open broker can announce a node online; 2,000 invented ones were sampled, and every
        round waited out its timeout for them (resource sweep). A node without a key could not sign a reply
        this Grid would take anyway."""
        online = self.endpoint.online_nodes()
        if self._node_keys is None:
            return online
        keyless = online - self._node_keys.keys()
        for name in sorted(keyless - self._keyless_seen)[:10]:  # said once per node, a few at a time
            log.warning("node %s is online but has no key among node_keys: it is never instructed", name)
        self._keyless_seen |= keyless
        if len(self._keyless_seen) > 10_000:  # names from the network: a bounded memory of them
            self._keyless_seen = set(keyless)
        return online - keyless

    def node_name(self, node_id: int) -> str | None:
        """The wire name of an online node, from its Flower id."""
        return self._online_names().get(node_id)

    def _online_names(self) -> dict[int, str]:
        return {flower_node_id(name): name for name in self._eligible()}

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids, encoder = [], MessageEncoder()
        names = self._online_names()  # once per batch, not once per message
        for message in messages:
            name = names.get(message.metadata.dst_node_id)
            if name is None:
                log.warning("node %s is not online; instruction not sent", message.metadata.dst_node_id)
                continue
            message_id = uuid.uuid4().hex
            _set_message_id(message, message_id)
            with self._cond:
                self._awaited[message_id] = _Awaited(name, _round_of(message), deepcopy(message.metadata))
            payload = encoder.encode(message)
            # Signed per node: the signature binds the recipient and the message id, not just the bytes.
            wire = payload if self._signer is None else self._signer.sign(name, message_id, payload)
            try:
                transfer = self.endpoint.send(
                    name, wire, message_id=message_id, expiry_s=message.metadata.ttl
                )
            except (ValueError, TransferError) as err:  # too large, or the channel is closing
                log.error("instruction for node %s not sent: %s", name, err)
                with self._cond:
                    del self._awaited[message_id]
                continue
            with self._cond:
                if (awaited := self._awaited.get(message_id)) is not None:
                    awaited.transfer = transfer
            self._report_wire(message, payload)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._cond:
            return [self._replies.pop(i) for i in message_ids if i in self._replies]

    @property
    def late_replies(self) -> int:
        """Replies dropped because they came after their instruction stopped being awaited (abandoned, or
        its round's wait over)."""
        return self.dropped["late"]

    def abandon(self, message_ids: Iterable[str]) -> None:
        """Stop awaiting these instructions: a reply that still comes is late (dropped and counted, never
        recorded as accepted), and one already received but not pulled is discarded."""
        with self._cond:
            for message_id in message_ids:
                self._give_up(message_id)
                self._replies.pop(message_id, None)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(i in self._awaited for i in ids):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(timeout=remaining if remaining is not None else 1.0)
            for message_id in ids:  # replies that come after this are late: drop them
                self._give_up(message_id)
        self._report(self.rejections.flush(time.monotonic()))
        return self.pull_messages(ids)

    def _give_up(self, message_id: str) -> None:
        """Under the lock: stop awaiting an instruction, and stop sending it if it is still on its way (a
        node that announces itself but never takes its instructions pinned a model copy per round, for the
        message's whole lifetime: 12 hours by Flower's default)."""
        awaited = self._awaited.pop(message_id, None)
        if awaited is None:
            return
        self._finish(message_id, awaited.server_round)
        if awaited.transfer is not None and not awaited.transfer.done():
            self.endpoint.channel.cancel(awaited.transfer)

    # -- replies ---------------------------------------------------------------------------------------

    def _on_delivery(self, delivery: Delivery) -> None:
        payload = bytes(delivery.payload)
        if self._node_keys is not None:  # a profile too: it steers sampling and upload budgets
            key = self._node_keys.get(delivery.node_id)
            try:
                if key is None:
                    raise SignatureError("no key for this node")
                payload = verify(key, payload)
            except SignatureError as err:
                self._refuse(delivery, "signature", str(err))
                return
        if delivery.message_id.startswith(PROFILE_PREFIX):
            self._on_profile(delivery.node_id, payload)
            return
        if is_refusal(payload):
            self._on_refusal(delivery, payload)
            return
        if is_envelope(payload):
            self._on_envelope(delivery, payload)
            return
        try:
            reply = message_from_bytes(payload, max_bytes=self._max_message_bytes)
        except MessageDecodeError as err:
            self._refuse(delivery, "undecodable", str(err))
            return
        answered = reply.metadata.reply_to_message_id
        if delivery.message_id.startswith(REPLY_PREFIX) and delivery.message_id != REPLY_PREFIX + answered:
            # agents send a reply under reply:<the instruction it answers>: another one under that id (an old
            # round's reply again) would settle nothing and use up the id the real reply needs
            self._refuse(delivery, "undecodable", f"a reply to {answered!r} sent as {delivery.message_id!r}")
            return
        self._settle(delivery, answered, lambda awaited: reply)

    def _on_envelope(self, delivery: Delivery, payload: bytes) -> None:
        """A reply in the compact envelope: its metadata is the awaited instruction's, answered.

        As with refusals, the transport message id (``reply:<instruction id>``) names the instruction, and
        only the node it was sent to can publish on that node's outbox.
        """
        instruction_id = delivery.message_id.removeprefix(REPLY_PREFIX)
        try:
            if instruction_id == delivery.message_id:
                raise EnvelopeError(f"reply with message id {delivery.message_id!r}, not {REPLY_PREFIX}<id>")
            content = decode_content(payload)
        except EnvelopeError as err:
            self._refuse(delivery, "undecodable", str(err))
            return

        def reply_for(awaited: _Awaited) -> Message:
            instruction = Message(metadata=deepcopy(awaited.metadata), content=RecordDict())
            return Message(content, reply_to=instruction)

        self._settle(delivery, instruction_id, reply_for)

    def _on_refusal(self, delivery: Delivery, payload: bytes) -> None:
        """A node could not decode or verify an instruction: answer it with a Flower error on its behalf.

        Nothing in the notice names the instruction: the transport message id, ``reply:<instruction id>``,
        does (the node can only publish on its own outbox, so it can only refuse its own instructions).
        """
        instruction_id = delivery.message_id.removeprefix(REPLY_PREFIX)
        try:
            if instruction_id == delivery.message_id:
                raise ValueError(
                    f"refusal notice with message id {delivery.message_id!r}, not {REPLY_PREFIX}<id>"
                )
            refusal = decode_refusal(payload)
        except ValueError as err:
            self._refuse(delivery, "undecodable", str(err))
            return

        def error_reply(awaited: _Awaited) -> Message:
            instruction = Message(metadata=deepcopy(awaited.metadata), content=RecordDict())
            return Message(Error(code=INSTRUCTION_REFUSED, reason=str(refusal)), reply_to=instruction)

        self._settle(delivery, instruction_id, error_reply)

    def _settle(
        self, delivery: Delivery, instruction_id: str, reply_for: Callable[[_Awaited], Message]
    ) -> None:
        """Hand ``reply_for(awaited)`` to the ServerApp if it answers an awaited instruction of that node."""
        with self._cond:
            awaited = self._awaited.get(instruction_id)
            if awaited is None:
                server_round = self._finished.get(instruction_id)
                reason = "unknown-instruction" if server_round is None else "late"
                self._reject(delivery.node_id, server_round or "?", reason, f"reply to {instruction_id!r}")
                return
            reply = reply_for(awaited)
            if awaited.node == delivery.node_id and reply.metadata.src_node_id == flower_node_id(
                delivery.node_id
            ):
                del self._awaited[instruction_id]
                self._finish(instruction_id, awaited.server_round)
                if reply.has_error():
                    reply.error = Error(code=reply.error.code, reason=_node_text(reply.error.reason or ""))
                _set_message_id(reply, uuid.uuid4().hex)
                self._report_wire(reply, delivery.payload)
                # Recorded before the ServerApp can pull it: its round may be aggregated and committed at
                # once, and a commit naming the round's accepted nodes must find this one (it once left one
                # out).
                self._record_reply(delivery.node_id, awaited.server_round, instruction_id, reply)
                self._replies[instruction_id] = reply
                self._cond.notify_all()
                return
            self._reject(
                delivery.node_id, awaited.server_round, "wrong-sender", f"instruction for {awaited.node}"
            )
        # as _refuse does (outside the lock): the id goes back to the transport, for the node's real reply
        self.endpoint.forget_delivered(delivery.node_id, delivery.message_id)

    def _record_reply(self, node: str, server_round: str, instruction_id: str, reply: Message) -> None:
        """Count, log and audit a settled reply: refused, failed or accepted."""
        if reply.has_error() and reply.error.code == INSTRUCTION_REFUSED:
            refusal = Refusal.from_error_reason(reply.error.reason or "")
            self.refusals[refusal.reason] += 1
            log.warning(
                "node %s refused instruction %s (round %s): %s", node, instruction_id, server_round, refusal
            )
            self._record(
                "refused",
                node,
                server_round,
                instruction=instruction_id,
                reason=refusal.reason,
                detail=refusal.detail,
            )
            return
        # An error reply (the ClientApp failed) is answered but carries no update: it never counts.
        event = "failed" if reply.has_error() else "accepted"
        self._record(event, node, server_round, instruction=instruction_id)

    def _on_profile(self, node_id: str, payload: bytes) -> None:
        try:
            profile = DeviceProfile.from_bytes(payload)
        except ConfigError as err:
            self._reject(node_id, "-", "bad-profile", str(err))
            return
        self.profiles.pop(node_id, None)  # the newest last: the oldest go first past the bound
        self.profiles[node_id] = profile
        while len(self.profiles) > MAX_PROFILES:  # ids come from the network: a bounded record of them
            self.profiles.pop(next(iter(self.profiles)))
        log.info("node %s profile: %s", node_id, profile)
        if self.on_profile is not None:
            self.on_profile()

    def _finish(self, instruction_id: str, server_round: str) -> None:
        self._finished[instruction_id] = server_round
        while len(self._finished) > _FORGET_AFTER:
            self._finished.popitem(last=False)

    def _refuse(self, delivery: Delivery, reason: str, detail: str) -> None:
        """Drop a delivery that answers nothing, and let the transport take its message id again: one bad
        message under ``reply:<id>`` on a node's outbox had used up the id its real reply came with, which
        was then dropped as a duplicate while the round waited out its timeout."""
        self._reject(delivery.node_id, "?", reason, detail)
        self.endpoint.forget_delivered(delivery.node_id, delivery.message_id)

    def _reject(self, node: str, server_round: str, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        self._report(self.rejections.drop(node, server_round, reason, detail, time.monotonic()))

    def _report(self, rejections: list[Rejection]) -> None:
        """Log and audit drops at the rate :class:`RejectionLog` allows (each line says how many it stands
        for)."""
        for r in rejections:
            if r.total == 1:
                log.warning(
                    "dropped reply from node %s (round %s): %s: %s",
                    r.node,
                    r.server_round,
                    r.reason,
                    r.detail,
                )
            else:
                log.warning(
                    "dropped %d more replies from node %s: %s (%d in all; the latest, round %s: %s)",
                    r.count,
                    r.node,
                    r.reason,
                    r.total,
                    r.server_round,
                    r.detail,
                )
            self._record("rejected", r.node, r.server_round, reason=r.reason, detail=r.detail, count=r.count)

    def _record(self, event: str, node: str, server_round: str, **fields: Any) -> None:
        if self._audit is not None:
            self._audit({"event": event, "node": node, "round": server_round, "time": time.time(), **fields})


MAX_PROFILES = 10_000
"""Device profiles an MqttGrid keeps, the most recent ones (3,001 invented ids had grown status.json to
1.25 MB, rewritten every round; resource sweep)."""


def _round_of(message: Message) -> str:
    """The round Flower's strategies stamp into the instruction's config (``server-round``), if any."""
    config = message.content.config_records.get("config") if message.has_content() else None
    return str(config.get("server-round", "?")) if config is not None else "?"


def _node_text(reason: str) -> str:
    """A node's error reason as the coordinator keeps it: a few kB and lines (:func:`cap_reason`), every line
    after the first indented. Flower and fedge log it, and a line of its own could pass for a record of the
    coordinator's ("... INFO fedge.server.service: run finished OK"); 50,000 lines had flooded the log."""
    return cap_reason(reason).replace("\r", "\\r").replace("\n", "\n    ")
