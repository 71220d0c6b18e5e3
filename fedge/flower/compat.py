"""The one place fedge touches Flower's private internals.

Flower 1.42 has no public API for three things a custom ``Grid`` needs: turning a ``Message`` into bytes and
back (``flwr.common.serde``), stamping the process-wide task identity that ``Message(...)`` reads
(``flwr.supercore.task_identity.TaskIdentity``), and building the ``Run`` that ``Grid.set_run`` takes
(``flwr.supercore.run.Run``); nor for a strategy subclass to screen replies as ``FedAvg`` does
(``FedAvg._check_and_log_replies``); nor for the length of a message's protobuf without building it
(:func:`message_proto_size` follows Flower's schema). Every such import lives here, pinned by
``flwr~=1.42.0`` and checked by ``tests/foundation/test_compat.py``; when Flower moves them, this module
and its contract tests are all that change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.common import serde
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = [
    "SUPERLINK_NODE_ID",
    "MessageDecodeError",
    "MessageEncoder",
    "Run",
    "check_replies",
    "content_proto_size",
    "context_from_bytes",
    "context_to_bytes",
    "ensure_task_identity",
    "message_from_bytes",
    "message_proto_size",
    "message_to_bytes",
    "set_message_id",
    "set_task_identity",
]

DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


class MessageDecodeError(ValueError):
    """Bytes that do not decode to a Flower ``Message`` (or ``Context``) within the size cap."""


def message_to_bytes(message: Message) -> bytes:
    """Serialize a Flower ``Message`` (metadata, content or error) to its protobuf wire bytes."""
    return serde.message_to_proto(message).SerializeToString()


class MessageEncoder:
    """Serialize a batch of messages, encoding each distinct content ``RecordDict`` once.

    A strategy sends one ``RecordDict`` object (the global model) to every node it samples, and its encoding
    is nearly all of each message. Protobuf writes fields in number order (metadata 1, content 2) and parses
    concatenated encodings as one message, so the metadata's bytes followed by the content's cached bytes
    are exactly :func:`message_to_bytes`. Use one encoder per batch: contents are cached by identity and
    must not change while it lives.
    """

    def __init__(self) -> None:
        self._contents: dict[int, tuple[RecordDict, bytes]] = {}  # the object is kept so its id stays unique

    def encode(self, message: Message) -> bytes:
        """``message_to_bytes(message)``, reusing the encoding of a content already seen."""
        if not message.has_content():
            return message_to_bytes(message)
        cached = self._contents.get(id(message.content))
        if cached is None:
            content = ProtoMessage(content=serde.recorddict_to_proto(message.content)).SerializeToString()
            cached = self._contents[id(message.content)] = (message.content, content)
        metadata = ProtoMessage(metadata=serde.metadata_to_proto(message.metadata)).SerializeToString()
        return metadata + cached[1]


def message_from_bytes(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode untrusted bytes into a ``Message``.

    Parameters
    ----------
    data : bytes
        Protobuf bytes as produced by :func:`message_to_bytes`.
    max_bytes : int (default: 512 MiB)
        Refuse larger inputs before parsing them.

    Raises
    ------
    MessageDecodeError
        If ``data`` is too large, is not a valid protobuf ``Message`` or its records do not rebuild.
    """
    return _parse(ProtoMessage, serde.message_from_proto, data, max_bytes, "message")


def message_proto_size(message: Message, *, content_size: int | None = None) -> int:
    """``len(message_to_bytes(message))``, without copying any array's values into a protobuf.

    Flower's serializer copies every array's bytes into a new protobuf (0.15 ms for the digits CNN's weights,
    on each message), so a transport that moves messages some other way (the local engine's pickled pipes)
    still learns what each would weigh on Flower's wire from this: the small parts are serialized as
    Flower does, and each ``ArrayRecord`` is sized field by field from Flower's ``Array`` schema.
    ``content_size``: the content's :func:`content_proto_size`, if the caller has it (a content many
    messages share is sized once).
    """
    size = _field_size(serde.metadata_to_proto(message.metadata).ByteSize())
    if message.has_content():
        size += _field_size(content_proto_size(message.content) if content_size is None else content_size)
    if message.has_error():
        size += _field_size(serde.error_to_proto(message.error).ByteSize())
    return size


def context_to_bytes(context: Context) -> bytes:
    """Serialize a node's ``Context`` (its state survives a restart when these bytes are on disk)."""
    return serde.context_to_proto(context).SerializeToString()


def context_from_bytes(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Context:
    """Decode bytes from :func:`context_to_bytes`; raises :class:`MessageDecodeError` on bad input."""
    return _parse(ProtoContext, serde.context_from_proto, data, max_bytes, "context")


def set_message_id(message: Message, message_id: str) -> None:
    """Assign the id a SuperLink would assign when it accepts a message (metadata has no public setter)."""
    message.metadata.__dict__["_message_id"] = message_id


def set_task_identity(run_id: int, node_id: int = SUPERLINK_NODE_ID, task_id: int = 1) -> None:
    """Stamp the process-wide identity that ``Message(content, dst_node_id, ...)`` reads for its metadata."""
    TaskIdentity.task_id = task_id
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id


def ensure_task_identity(run_id: int) -> None:
    """Stamp the identity :func:`set_task_identity` sets, unless something has already: Flower's runtime
    does for a ServerApp, but a library user driving rounds on a Grid of their own has nothing set, and
    Flower's ``Message`` then fails with ``TaskIdentity.run_id is not set``."""
    if TaskIdentity._run_id is None:  # private: the property raises while unset
        set_task_identity(run_id)


def check_replies(strategy: FedAvg, replies: Iterable[Message], *, train: bool) -> list[Message]:
    """The replies Flower's ``FedAvg`` would aggregate: no errors, consistent records (logged as Flower does).

    ``FedAvg._check_and_log_replies`` is private; a subclass that aggregates differently still screens
    replies exactly as Flower does through this.
    """
    valid, _errors = strategy._check_and_log_replies(replies, is_train=train)
    return list(valid)


def _parse(proto_type: type, from_proto: Callable[[Any], Any], data: bytes, max_bytes: int, what: str) -> Any:
    """Check the size cap, parse the protobuf, rebuild the Flower object; failures are MessageDecodeError."""
    if len(data) > max_bytes:
        raise MessageDecodeError(f"{what} of {len(data)} bytes exceeds the cap of {max_bytes} bytes")
    proto = proto_type()
    try:
        proto.ParseFromString(data)
        return from_proto(proto)
    except Exception as err:  # untrusted bytes: whatever parsing or Flower's rebuilding raises is the
        # message's fault (a metric entry without a value had raised AttributeError past this)
        raise MessageDecodeError(f"not a Flower {what}: {type(err).__name__}: {err}") from err


# Protobuf's encoding of Flower's records (flwr/proto/recorddict.proto): every field number below 16, so each
# tag is one byte; a length-delimited field is tag, varint length, payload; proto3 leaves out empty strings
# and bytes, but writes a sub-message that is set even when it is empty.


def _varint_size(value: int) -> int:
    if value < 0:  # a negative int32 is sign-extended to 64 bits
        return 10
    return max(1, (value.bit_length() + 6) // 7)


def _field_size(payload: int) -> int:
    """A length-delimited field (sub-message, string, bytes, packed repeated) that is written."""
    return 1 + _varint_size(payload) + payload


def _string_size(text: str | bytes) -> int:
    """A string or bytes field: left out when empty."""
    length = len(text.encode() if isinstance(text, str) else text)
    return _field_size(length) if length else 0


# (dtype, shape, stype, bytes of data) -> an Array's size: a model's arrays come back every round with the
# same layout; an adversary cycling shapes costs only speed
_array_sizes: dict[tuple[str, tuple[int, ...], str, int], int] = {}
_MAX_CACHED_SIZES = 4096


def _array_size(array: Array) -> int:
    key = (array.dtype, tuple(array.shape), array.stype, len(array.data))
    size = _array_sizes.get(key)
    if size is None:
        shape = sum(_varint_size(dim) for dim in array.shape)  # packed repeated int32
        size = (
            _string_size(array.dtype)
            + (_field_size(shape) if array.shape else 0)
            + _string_size(array.stype)
            + _string_size(array.data)
        )
        if len(_array_sizes) < _MAX_CACHED_SIZES:
            _array_sizes[key] = size
    return size


def _array_record_size(record: ArrayRecord) -> int:
    return sum(_field_size(_string_size(key) + _field_size(_array_size(a))) for key, a in record.items())


def content_proto_size(content: RecordDict) -> int:
    """The length of ``content``'s protobuf (a ``RecordDict``), as :func:`message_proto_size` counts it."""
    size = 0
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            item = _string_size(key) + _field_size(_array_record_size(record))
        else:  # metrics and configs are small: Flower's own serializer sizes them
            item = serde.recorddict_to_proto(RecordDict({key: record})).items[0].ByteSize()
        size += _field_size(item)
    return size
