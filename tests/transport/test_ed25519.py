"""The pure-Python Ed25519 verifier agrees with cryptography's, and signing works without cryptography."""

from __future__ import annotations

import os
import sys

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.config import ConfigError
from fedge.transport import ed25519, signing

# RFC 8032, 7.1, TEST 1 and TEST 2: (secret key, public key, message, signature).
RFC_VECTORS = [
    (
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
    ),
    (
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
    ),
]


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@pytest.mark.parametrize(("secret", "public", "message", "signature"), RFC_VECTORS)
def test_rfc_8032_vectors(secret, public, message, signature):
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(secret))
    assert _raw(key).hex() == public and key.sign(bytes.fromhex(message)).hex() == signature
    assert ed25519.verify(bytes.fromhex(public), bytes.fromhex(message), bytes.fromhex(signature))


@settings(max_examples=40, deadline=None)
@given(message=st.binary(max_size=300), flip=st.integers(0, 64 * 8 - 1))
def test_agrees_with_cryptography_on_good_and_tampered_signatures(message, flip):
    key = Ed25519PrivateKey.generate()
    public, signature = _raw(key), key.sign(message)
    assert ed25519.verify(public, message, signature)
    tampered = bytearray(signature)
    tampered[flip // 8] ^= 1 << (flip % 8)
    assert not ed25519.verify(public, message, bytes(tampered))
    assert not ed25519.verify(public, message + b"\0", signature)
    assert not ed25519.verify(_raw(Ed25519PrivateKey.generate()), message, signature)


def test_malformed_inputs_are_false_not_errors():
    public = _raw(Ed25519PrivateKey.generate())
    assert not ed25519.verify(public[:31], b"m", bytes(64))
    assert not ed25519.verify(public, b"m", bytes(63))
    assert not ed25519.verify(b"\xff" * 32, b"m", bytes(64))  # y outside the field
    assert not ed25519.verify(public, b"m", bytes(32) + b"\xff" * 32)  # S >= L
    for _ in range(20):
        assert not ed25519.verify(os.urandom(32), os.urandom(10), os.urandom(64))


def test_instructions_verify_and_keys_load_without_cryptography(tmp_path, monkeypatch):
    key = Ed25519PrivateKey.generate()
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "coordinator.pub").write_bytes(pem)
    payload = signing.InstructionSigner(key).sign("node-1", "m-7", b"body")
    # As in a fedge[infer] install: importing cryptography fails.
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.asymmetric.ed25519", None)
    public = signing.load_public_key(tmp_path / "coordinator.pub")
    assert public == _raw(key)
    for verifier in (
        signing.InstructionVerifier([public]),
        signing.InstructionVerifier([public], pure_python=True),
    ):
        assert verifier.verify("node-1", "m-7", payload) == b"body"
        with pytest.raises(signing.SignatureError, match="does not match"):
            verifier.verify("node-2", "m-7", payload)
    (tmp_path / "bad.pub").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ConfigError, match="does not hold an Ed25519 public key"):
        signing.load_public_key(tmp_path / "bad.pub")
