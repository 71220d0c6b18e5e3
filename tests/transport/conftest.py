"""Brokers for the transport tests: a real Mosquitto (persistence on) and the embedded amqtt broker."""

from __future__ import annotations

import random
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fedge.localnet import EmbeddedBroker, MosquittoBroker
from fedge.transport import MqttConfig, TransferSettings
from fedge.transport.frames import AckFrame, AckStatus, encode_ack, encode_data


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """One Mosquitto per test module; tests isolate themselves with their own fleet."""
    with MosquittoBroker(tmp_path_factory.mktemp("mosquitto")) as broker:
        yield broker


@pytest.fixture
def own_mosquitto(tmp_path: Path) -> Iterator[Callable[..., MosquittoBroker]]:
    """Start a Mosquitto just for this test (e.g. to restart it or give it special settings)."""
    started: list[MosquittoBroker] = []

    def start(**options: object) -> MosquittoBroker:
        broker = MosquittoBroker(tmp_path / f"broker{len(started)}", **options).start()  # type: ignore[arg-type]
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


@pytest.fixture(scope="module")
def amqtt_broker() -> Iterator[EmbeddedBroker]:
    """The embedded pure-Python broker (MQTT 3.1.1 only)."""
    pytest.importorskip("amqtt")
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture
def make_config() -> Callable[..., MqttConfig]:
    """``make_config(url, protocol="auto", **transfer_settings)``: a config in a fleet of this test's own."""
    fleet = f"t{uuid.uuid4().hex[:10]}"

    def make(url: str, protocol: str = "auto", **settings: object) -> MqttConfig:
        transfer = TransferSettings(**settings)  # type: ignore[arg-type]
        # Quick reconnects keep tests that cut links short.
        return MqttConfig(
            broker_url=url,
            fleet=fleet,
            protocol=protocol,  # type: ignore[arg-type]
            transfer=transfer,
            reconnect_max_s=0.5,
        )

    return make


def fuzz_frames(seed: int, count: int, chunk_size: int = 1024) -> list[tuple[str, bytes]]:
    """``count`` hostile frames for a receiver, each tagged with the drop reason it must cause.

    Kinds: flipped bytes (``checksum``), payloads too long or short and inconsistent size fields with a
    valid checksum (``size``), headers cut short (``truncated``), random bytes (``magic``, or ``truncated``
    when tiny), and well-formed ACK frames for unknown transfers, sent where data is expected (``kind``).
    """
    rng = random.Random(seed)
    frames: list[tuple[str, bytes]] = []
    while len(frames) < count:
        transfer_id, index = rng.randbytes(16), rng.randrange(4)
        payload = rng.randbytes(chunk_size)
        valid = encode_data(transfer_id, index, chunk_size, 4 * chunk_size, 2**62, b"m", payload)
        kind = rng.randrange(6)
        if kind == 0:
            spot = rng.randrange(len(valid) - chunk_size, len(valid))
            frames.append(("checksum", valid[:spot] + bytes([valid[spot] ^ 0xFF]) + valid[spot + 1 :]))
        elif kind == 1:
            wrong = payload[: rng.randrange(chunk_size)] if rng.random() < 0.5 else payload + b"x"
            frames.append(
                ("size", encode_data(transfer_id, index, chunk_size, 4 * chunk_size, 2**62, b"m", wrong))
            )
        elif kind == 2:
            # A checksum that matches, over a chunk count that cannot hold the message size.
            head = struct.pack(
                "!2sBB16sIIIQQB", b"FE", 1, 1, transfer_id, 0, 4, chunk_size, 40 * chunk_size, 0, 1
            )
            head += b"m"
            crc = zlib.crc32(payload, zlib.crc32(head))
            frames.append(("size", head + struct.pack("!I", crc) + payload))
        elif kind == 3:
            frames.append(("truncated", valid[: rng.randrange(4, 40)]))
        elif kind == 4:
            junk = rng.randbytes(rng.randrange(0, 3000))
            frames.append(("truncated" if len(junk) < 8 else "magic", junk))
        else:
            ack = AckFrame(rng.randbytes(16), AckStatus.PROGRESS, 9, bytes(2))
            frames.append(("kind", encode_ack(ack)))
    return frames


@pytest.fixture
def hostile_frames() -> Callable[[int, int], list[tuple[str, bytes]]]:
    """:func:`fuzz_frames` as a fixture."""
    return fuzz_frames


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def wait_for() -> Callable[..., None]:
    """``wait_for(condition, timeout_s=10)``: poll until ``condition()`` holds; fail after the timeout."""
    return _wait_for
