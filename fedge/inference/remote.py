"""Asking a device for predictions over MQTT: the requester's side of the inference agent's protocol.

Each request is an ``.npy`` batch published to the device's request topic with an MQTT 5 response topic
(this client's own, ending with the device's id) and a fresh random correlation id; the answer comes back on
the response topic with the same correlation data, and is matched to its waiting caller by it. Many requests
may be in flight at once.

An answer counts only on the topic of the device that was asked: under the fleet's ACL only that device may
write there and only this client read it, and the correlation data (16 random bytes) cannot be guessed from
answers seen before. (A counter had let a node that read one answer forge the next ones.)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from fedge.inference.io import InputError, decode_array, decode_arrays, encode_array, encode_arrays, is_npz
from fedge.transport.config import MqttConfig
from fedge.transport.connection import MessageProperties, MqttConnection
from fedge.transport.message_chunks import (
    CHUNK_PROPERTY,
    ChunkError,
    MessageAssembler,
    parse_chunk,
    split_message,
)
from fedge.transport.topics import Topics

__all__ = ["InferenceClient", "InferenceError", "Prediction"]


class InferenceError(RuntimeError):
    """The device answered with an error, or its answer could not be read."""


@dataclass(frozen=True)
class Prediction:
    """A device's answer: the model's first output (every output by name for a named request), the model
    version and the serving replica."""

    outputs: np.ndarray | dict[str, np.ndarray]
    version: str
    replica: int = 0
    kind: str = ""  # what the outputs are, as the model's manifest says: "classes", "values" or unknown
    other_outputs: tuple[str, ...] = ()  # outputs after the first an array request's answer leaves out


class InferenceClient:
    """Send inference requests to devices of a fleet and wait for their answers.

    Parameters
    ----------
    config : MqttConfig
        Broker and fleet (the broker must speak MQTT 5).
    client_id : str, optional
        This requester's MQTT client id; a random one by default, whose session the broker forgets when
        it disconnects. Its answers come under its broker
        username (``config.username``; without one, under this id): the broker's ACL lets only that user
        read them, and a client id, which any user may claim, is not checked against the user.
    max_answer_bytes : int, default 64 MiB
        Largest answer accepted.
    chunk_bytes : int, default 256 KiB
        A request larger than this travels in chunks at QoS 1 (:mod:`fedge.transport.message_chunks`), so a
        link that drops mid-request re-sends only the chunks the broker had not acknowledged.
    """

    def __init__(
        self,
        config: MqttConfig,
        client_id: str | None = None,
        *,
        max_answer_bytes: int = 64 * 1024 * 1024,
        chunk_bytes: int = 256 * 1024,
    ) -> None:
        if client_id is None:  # a random id no later run reuses: the broker need not keep its session
            config = dataclasses.replace(config, persistent_session=False)
        self.client_id = client_id or f"requester-{uuid.uuid4().hex[:12]}"
        self.topics = Topics(config.fleet)
        self.max_answer_bytes = max_answer_bytes
        self.chunk_bytes = chunk_bytes
        self._answers = MessageAssembler(max_answer_bytes, max_open=64)
        self.reply_name = config.username or self.client_id  # the level its answers come under
        self._reply_topic = self.topics.infer_reply(self.reply_name)
        self._pending: dict[bytes, Future[Prediction]] = {}
        self._targets: dict[bytes, str] = {}  # correlation -> the device asked (its answers' budget)
        self._lock = threading.Lock()
        self.sent = 0  # requests sent so far
        self.forged = 0  # answers on the wrong device's topic, dropped
        self.connection = MqttConnection(config, self.client_id)
        self.connection.route_with_properties(f"{self._reply_topic}/+", self._on_answer)

    def start(self) -> None:
        """Connect; :class:`ConnectionError` if the broker is unreachable or speaks only MQTT 3.1.1."""
        self.connection.start()
        if not self.connection.is_v5:
            self.connection.close()
            raise ConnectionError(
                "inference requests need an MQTT 5 broker (response topic, correlation data)"
            )

    def close(self) -> None:
        """Disconnect; requests still waiting fail with :class:`InferenceError`."""
        self.connection.close()
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(InferenceError("client closed before the answer arrived"))

    def __enter__(self) -> InferenceClient:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def submit(self, node_id: str, inputs: np.ndarray | dict[str, np.ndarray]) -> Future[Prediction]:
        """Send a batch (or named inputs) to ``node_id``; the future resolves to its :class:`Prediction`."""
        correlation = os.urandom(16)
        self.sent += 1
        future: Future[Prediction] = Future()
        with self._lock:
            self._pending[correlation] = future
            self._targets[correlation] = node_id
        payload = encode_arrays(inputs) if isinstance(inputs, dict) else encode_array(inputs)
        topic, chunks = self.topics.infer_request(node_id), split_message(payload, self.chunk_bytes)
        answer_topic = self.topics.infer_reply(self.reply_name, node_id)
        for index, chunk in enumerate(chunks):
            tag = ((CHUNK_PROPERTY, f"{index}/{len(chunks)}"),) if len(chunks) > 1 else ()
            properties = MessageProperties(answer_topic, correlation, tag)
            self.connection.publish(topic, chunk, qos=1 if tag else 0, message_properties=properties)
        return future

    def predict(
        self, node_id: str, inputs: np.ndarray | dict[str, np.ndarray], timeout: float = 10.0
    ) -> Prediction:
        """Send a batch and wait for the answer; :class:`TimeoutError` after ``timeout`` seconds."""
        future = self.submit(node_id, inputs)
        try:
            return future.result(timeout)
        except TimeoutError:  # concurrent.futures' says nothing; a caller's log line should
            raise TimeoutError(f"{node_id} did not answer within {timeout:g} s") from None
        finally:
            with self._lock:
                for key, pending in list(self._pending.items()):
                    if pending is future:
                        del self._pending[key]
                        self._targets.pop(key, None)

    def _on_answer(self, topic: str, payload: bytes, props: MessageProperties) -> None:
        correlation, fields = props.correlation_data or b"", dict(props.user_properties)
        with self._lock:
            device = self._targets.get(correlation)
        if device is None:
            return  # a late answer to a request that timed out, or not ours
        if topic != self.topics.infer_reply(self.reply_name, device):  # another device answering for it
            self.forged += 1
            return
        if CHUNK_PROPERTY in fields:  # one chunk of a large answer
            try:
                index, count = parse_chunk(fields[CHUNK_PROPERTY], max_chunks=1 << 16)
                whole = self._answers.add(device, correlation, index, count, payload, time.monotonic())
            except ChunkError as err:
                whole, fields = b"", {"status": "error", "error": f"unreadable answer: {err}"}
            if whole is None:
                return
            payload = whole
        with self._lock:
            future = self._pending.pop(correlation, None)
            self._targets.pop(correlation, None)
        if future is None:
            return  # a late answer to a request that timed out, or not ours
        if fields.get("status") != "ok":
            future.set_exception(InferenceError(fields.get("error", "the device answered with an error")))
            return
        caps = {"max_bytes": self.max_answer_bytes, "max_rows": 1 << 31}
        try:
            outputs = decode_arrays(payload, **caps) if is_npz(payload) else decode_array(payload, **caps)
        except InputError as err:
            future.set_exception(InferenceError(f"unreadable answer: {err}"))
            return
        replica = fields.get("replica", "0")
        future.set_result(
            Prediction(
                outputs,
                fields.get("version", ""),
                int(replica) if replica.isdigit() else 0,
                fields.get("outputs", ""),
                tuple(filter(None, fields.get("other_outputs", "").split(","))),
            )
        )
