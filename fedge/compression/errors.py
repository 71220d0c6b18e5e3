"""The errors of :mod:`fedge.compression`.

Decoding untrusted bytes raises only subclasses of :class:`CodecError`, each naming what is wrong, so a
coordinator can drop one bad reply with ``except CodecError`` and carry on. Building a codec from a bad
spec raises :class:`CodecConfigError`, which is also a ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "CodecConfigError",
    "CodecError",
    "CorruptPayloadError",
    "InvalidTensorError",
    "MalformedPayloadError",
    "NonFiniteValueError",
    "PayloadTooLargeError",
    "TensorMismatchError",
    "TruncatedPayloadError",
    "UnsupportedVersionError",
]


class CodecError(Exception):
    """Base class of every error this package raises."""


class CodecConfigError(CodecError, ValueError):
    """A codec spec, TOML table or parameter is unknown or out of range."""


class InvalidTensorError(CodecError, ValueError):
    """A tensor handed to the encoder cannot be encoded: unsupported dtype, bad name, too many dimensions."""


class TruncatedPayloadError(CodecError):
    """The payload ends before the data its header announces."""


class CorruptPayloadError(CodecError):
    """The payload's bytes were altered: bad magic or CRC32 mismatch."""


class UnsupportedVersionError(CodecError):
    """The payload was written by a wire-format version this decoder does not read."""


class MalformedPayloadError(CodecError):
    """The payload is intact but inconsistent: unknown codes, bad sizes, positions out of range."""


class PayloadTooLargeError(CodecError):
    """The header claims more elements (or other resources) than the decoder's cap allows."""


class NonFiniteValueError(CodecError, ValueError):
    """A tensor (to encode) or a decoded value or scale holds NaN or infinity."""


class TensorMismatchError(CodecError):
    """Payload tensors do not match the names or shapes of the arrays they should be added into."""
