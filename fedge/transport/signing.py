"""Who may tell a device what to do, and how a device says no.

Three small wire conventions, each recognised by a 4-byte magic that no serialized Flower ``Message`` can
start with (a protobuf message starts with a field tag; ``F`` would be field 8 with the invalid wire type 6):

Replies: ``FSG1 || HMAC-SHA256(node key, body) || body``
    Optional, one key per node. The broker's ACLs already stop a node from publishing as another; the
    signature adds end-to-end integrity that survives a compromised broker or bridge.

Instructions: ``FSI1 || key id (8) || Ed25519 signature (64) || body``
    The coordinator signs every instruction with its one private key; agents hold only public keys, so a
    compromised device can forge nothing (with a shared HMAC key it could forge instructions to every other
    device). The signature covers a domain tag, the recipient node, the transport message id and SHA-256 of
    the body, so a signed instruction cannot be redirected to another node or replayed under another id.
    The key id is the first 8 bytes of SHA-256 of the raw public key; an agent may trust several keys at
    once, which is how the coordinator's key is rotated.

Refusals: ``FRF1 || UTF-8 JSON {"reason": ..., "detail": ...}``
    What an agent sends (with message id ``reply:<instruction id>``) for an instruction it will not run and
    cannot answer with a Flower error reply because it did not decode or verify it. The coordinator's Grid
    turns it into a Flower error reply with code :data:`INSTRUCTION_REFUSED`, as the agent does itself for
    an instruction it decoded but refuses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from fedge.config import ConfigError
from fedge.transport import ed25519

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = [
    "INSTRUCTION_REFUSED",
    "REFUSAL_REASONS",
    "InstructionSigner",
    "InstructionVerifier",
    "Refusal",
    "SignatureError",
    "decode_refusal",
    "encode_refusal",
    "is_refusal",
    "is_signed_instruction",
    "key_id",
    "load_public_key",
    "sign",
    "strip_instruction_signature",
    "verify",
]

_MAGIC = b"FSG1"
_DIGEST = hashlib.sha256().digest_size
_INSTRUCTION_MAGIC = b"FSI1"
_INSTRUCTION_DOMAIN = b"fedge instruction v1"
_KEY_ID = 8
_ED25519_SIGNATURE = 64
_ED25519_PUBLIC = 32
_REFUSAL_MAGIC = b"FRF1"
_MAX_REFUSAL_BYTES = 16 * 1024

INSTRUCTION_REFUSED = 403
"""Flower ``Error.code`` of the reply to an instruction an agent refused (Flower's own codes are 0-8); the
reason reads ``"<reason>: <detail>"``, ``<reason>`` one word such as ``signature`` or ``task-not-allowed``."""


class SignatureError(ValueError):
    """A payload that is unsigned, truncated or signed with another key."""


# -- replies: per-node HMAC ----------------------------------------------------------------------------


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


# -- instructions: the coordinator's Ed25519 key -------------------------------------------------------


def key_id(public_key: bytes) -> bytes:
    """The 8-byte id of a raw Ed25519 public key, as signed instructions carry it."""
    return hashlib.sha256(public_key).digest()[:_KEY_ID]


def load_public_key(path: str | Path) -> bytes:
    """The raw 32 bytes of an Ed25519 public key in a PEM file (``openssl pkey -pubout``)."""
    try:
        text = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"instruction key file {path} cannot be read: {err}") from None
    return _raw_public_key(text, path)


# An Ed25519 SubjectPublicKeyInfo is this fixed DER prefix (algorithm 1.3.101.112) and the 32 key bytes.
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


def _raw_public_key(pem: bytes, path: str | Path) -> bytes:
    """The key bytes of an Ed25519 public-key PEM, parsed without ``cryptography``."""
    lines = pem.decode("ascii", "replace").strip().splitlines()
    if len(lines) < 3 or lines[0] != "-----BEGIN PUBLIC KEY-----" or lines[-1] != "-----END PUBLIC KEY-----":
        raise ConfigError(f"instruction key file {path} is not a PEM public key")
    try:
        der = base64.b64decode("".join(lines[1:-1]), validate=True)
    except binascii.Error as err:
        raise ConfigError(f"instruction key file {path} cannot be read: {err}") from None
    if len(der) != 44 or not der.startswith(_ED25519_SPKI_PREFIX):
        raise ConfigError(f"instruction key file {path} does not hold an Ed25519 public key")
    return der[len(_ED25519_SPKI_PREFIX) :]


def _signed_message(node: str, message_id: str, body: bytes | memoryview) -> bytes:
    """What the signature covers: domain tag, recipient, message id (length-prefixed), SHA-256 of the body.

    Signing a digest rather than the body keeps Ed25519 to one short message; the body is hashed once.
    """
    parts = [_INSTRUCTION_DOMAIN, node.encode(), message_id.encode()]
    return b"".join(struct.pack(">H", len(p)) + p for p in parts) + hashlib.sha256(body).digest()


class InstructionSigner:
    """Signs instructions with the coordinator's Ed25519 private key.

    Parameters
    ----------
    private_key : Ed25519PrivateKey
        The coordinator's key; :meth:`from_file` reads one from PEM (``openssl genpkey -algorithm ed25519``).
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        # Signing happens on the coordinator only, which always has cryptography (a base dependency);
        # devices import this module without it (and without its 8 MB of resident memory).
        from cryptography.hazmat.primitives import serialization

        self._key = private_key
        public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.key_id = key_id(public)

    @classmethod
    def from_file(cls, path: str | Path) -> InstructionSigner:
        """Read an unencrypted PEM (PKCS#8) Ed25519 private key; a bad file is a ConfigError naming it."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"instruction key file {path} cannot be read: {err}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"instruction key file {path} does not hold an Ed25519 private key")
        return cls(key)

    def sign(self, node: str, message_id: str, body: bytes) -> bytes:
        """The signed payload of instruction ``message_id`` for ``node``."""
        signature = self._key.sign(_signed_message(node, message_id, body))
        return _INSTRUCTION_MAGIC + self.key_id + signature + body


class InstructionVerifier:
    """Checks instructions against the coordinator public keys an agent trusts.

    Parameters
    ----------
    public_keys : iterable of bytes
        Raw 32-byte Ed25519 public keys; an instruction signed by any of them is accepted (two during a
        key rotation).
    pure_python : bool (default: False)
        Verify with :mod:`fedge.transport.ed25519` even where ``cryptography`` is installed. About 2.7 ms
        a signature instead of 0.1 ms, and 8 MB less resident memory: right for a device that verifies a
        model version now and then (the inference agent), not for one that verifies every instruction.
    """

    def __init__(self, public_keys: Iterable[bytes], *, pure_python: bool = False) -> None:
        self._pure_python = pure_python
        self._keys = {key_id(k): bytes(k) for k in public_keys}
        if any(len(k) != _ED25519_PUBLIC for k in self._keys.values()):
            raise ValueError("Ed25519 public keys are 32 bytes")
        if not self._keys:
            raise ValueError("an InstructionVerifier needs at least one public key")

    def verify(self, node: str, message_id: str, payload: bytes | bytearray) -> bytes:
        """The body of a signed instruction to ``node`` with transport id ``message_id``.

        Raises
        ------
        SignatureError
            If the payload is unsigned, signed by a key not trusted here, or signed for another node, another
            message id or other bytes.
        """
        view = memoryview(payload)
        header = len(_INSTRUCTION_MAGIC) + _KEY_ID + _ED25519_SIGNATURE
        if not is_signed_instruction(payload) or len(payload) < header:
            raise SignatureError("instruction is not signed")
        start = len(_INSTRUCTION_MAGIC)
        kid = bytes(view[start : start + _KEY_ID])
        key = self._keys.get(kid)
        if key is None:
            raise SignatureError(f"instruction is signed by key {kid.hex()}, which this agent does not trust")
        signature = bytes(view[start + _KEY_ID : header])
        message = _signed_message(node, message_id, view[header:])
        if not _verify_ed25519(key, signature, message, pure_python=self._pure_python):
            raise SignatureError(
                f"signature of key {kid.hex()} does not match this instruction, node and message id"
            )
        return bytes(view[header:])


def _verify_ed25519(public_key: bytes, signature: bytes, message: bytes, *, pure_python: bool) -> bool:
    """Ed25519 verification with ``cryptography`` where installed and wanted, in pure Python otherwise."""
    if not pure_python:
        try:
            from cryptography.exceptions import InvalidSignature
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        except ImportError:  # a torch-free inference install (fedge[infer]) has no cryptography
            pure_python = True
    if pure_python:
        return ed25519.verify(public_key, message, signature)
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except InvalidSignature:
        return False
    return True


def is_signed_instruction(payload: bytes | bytearray) -> bool:
    """Whether ``payload`` carries an instruction signature (valid or not)."""
    return payload[: len(_INSTRUCTION_MAGIC)] == _INSTRUCTION_MAGIC


def strip_instruction_signature(payload: bytes | bytearray) -> bytes:
    """The body of a signed instruction, unchecked (for agents that trust no key)."""
    return bytes(payload[len(_INSTRUCTION_MAGIC) + _KEY_ID + _ED25519_SIGNATURE :])


# -- refusals: an agent's answer to an instruction it will not run --------------------------------------


class Refusal(ValueError):
    """An instruction an agent will not run: ``reason`` (one word) and a human-readable ``detail``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail

    @classmethod
    def from_error_reason(cls, text: str) -> Refusal:
        """Parse the ``"<reason>: <detail>"`` of an :data:`INSTRUCTION_REFUSED` error reply; a reason not in
        :data:`REFUSAL_REASONS` is ``other`` (a node's own words, as a count's key, could be anything)."""
        reason, _, detail = text.partition(": ")
        if reason not in REFUSAL_REASONS:
            reason, detail = "other", text
        return cls(reason, detail)


REFUSAL_REASONS = frozenset(
    {"too-large", "expired", "stale", "undecodable", "signature", "wrong-recipient", "task-not-allowed"}
)
"""Why fedge's agents refuse an instruction (:class:`Refusal`'s ``reason``)."""


def encode_refusal(refusal: Refusal) -> bytes:
    """The refusal notice for an instruction that could not be decoded or verified."""
    detail = refusal.detail[:2000]  # a notice, not a dump of the offending bytes
    return _REFUSAL_MAGIC + json.dumps({"reason": refusal.reason, "detail": detail}).encode()


def is_refusal(payload: bytes | bytearray) -> bool:
    """Whether a reply payload (after its HMAC, if any) is a refusal notice rather than a Flower message."""
    return payload[: len(_REFUSAL_MAGIC)] == _REFUSAL_MAGIC


def decode_refusal(payload: bytes | bytearray) -> Refusal:
    """The refusal in a notice from :func:`encode_refusal`; ValueError if it is malformed or too large."""
    if not is_refusal(payload) or len(payload) > _MAX_REFUSAL_BYTES:
        raise ValueError("not a refusal notice, or larger than 16 KiB")
    try:
        fields = json.loads(bytes(payload[len(_REFUSAL_MAGIC) :]).decode())
        reason, detail = fields["reason"], fields["detail"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"malformed refusal notice: {err}") from None
    if not (isinstance(reason, str) and isinstance(detail, str)):
        raise ValueError("malformed refusal notice: reason and detail must be strings")
    return Refusal(reason, detail)
