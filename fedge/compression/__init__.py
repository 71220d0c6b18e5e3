"""Update compression: sparsifiers, quantizers, low rank, error feedback and the wire format (pure numpy).

Arrays in, bytes out; bytes in, arrays out. No Flower, no I/O::

    codec = build_codec("topk:0.01+int8")
    payload = codec.encode({"fc.weight": delta}, seed=round_number)
    decoded = decode(payload)                    # the header names the codec
    decode_add(payload, running_sum, weight=n)   # streaming aggregation, no dense copy for sparse codecs

Decoding untrusted bytes raises only :class:`CodecError` subclasses. The spec grammar is documented in
:mod:`fedge.compression.spec`, the byte layout in ``docs/wire-format.md``.
"""

from fedge.compression.bound import Schema, bind, is_bound, unbind
from fedge.compression.codec import DEFAULT_DENSE_PATTERNS, Codec, TensorPolicy, dense_nbytes
from fedge.compression.conformance import nonconforming
from fedge.compression.describe import describe_codec
from fedge.compression.errors import (
    CodecConfigError,
    CodecError,
    CorruptPayloadError,
    InvalidTensorError,
    MalformedPayloadError,
    NonFiniteValueError,
    PayloadTooLargeError,
    TensorMismatchError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)
from fedge.compression.feedback import ErrorFeedback
from fedge.compression.powersgd import PowerSGD
from fedge.compression.quantize import QSGD, BFloat16, BlockInt4, BlockInt8, Float16, Float32, Sign
from fedge.compression.rice import position_bound_bits
from fedge.compression.sparsify import RandomK, Threshold, TopK
from fedge.compression.spec import build_codec
from fedge.compression.wire import (
    DEFAULT_MAX_ELEMENTS,
    PayloadInfo,
    TensorInfo,
    decode,
    decode_add,
    inspect_payload,
)

__all__ = [
    "DEFAULT_DENSE_PATTERNS",
    "DEFAULT_MAX_ELEMENTS",
    "QSGD",
    "BFloat16",
    "BlockInt4",
    "BlockInt8",
    "Codec",
    "CodecConfigError",
    "CodecError",
    "CorruptPayloadError",
    "ErrorFeedback",
    "Float16",
    "Float32",
    "InvalidTensorError",
    "MalformedPayloadError",
    "NonFiniteValueError",
    "PayloadInfo",
    "PayloadTooLargeError",
    "PowerSGD",
    "RandomK",
    "Schema",
    "Sign",
    "TensorInfo",
    "TensorMismatchError",
    "TensorPolicy",
    "Threshold",
    "TopK",
    "TruncatedPayloadError",
    "UnsupportedVersionError",
    "bind",
    "build_codec",
    "decode",
    "decode_add",
    "dense_nbytes",
    "describe_codec",
    "inspect_payload",
    "is_bound",
    "nonconforming",
    "position_bound_bits",
    "unbind",
]
