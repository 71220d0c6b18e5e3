"""Optional HMAC signatures on payloads, with one key per node.

A signed payload is ``MAGIC || HMAC-SHA256(key, body) || body``. The broker's ACLs already stop a node from
publishing as another; signatures add end-to-end integrity that survives a compromised broker or bridge.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["SignatureError", "sign", "verify"]

_MAGIC = b"FSG1"
_DIGEST = hashlib.sha256().digest_size


class SignatureError(ValueError):
    """A payload that is unsigned, truncated or signed with another key."""


def sign(key: bytes, body: bytes) -> bytes:
    """Prefix ``body`` with its HMAC-SHA256 under ``key``."""
    return _MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def verify(key: bytes, payload: bytes | bytearray) -> bytes:
    """Return the body of a payload from :func:`sign`; raise :class:`SignatureError` if it does not verify."""
    payload = bytes(payload)
    if len(payload) < len(_MAGIC) + _DIGEST or not payload.startswith(_MAGIC):
        raise SignatureError("payload is not signed")
    tag, body = payload[len(_MAGIC) : len(_MAGIC) + _DIGEST], payload[len(_MAGIC) + _DIGEST :]
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        raise SignatureError("signature does not match the node's key")
    return body
