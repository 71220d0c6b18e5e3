"""A real Mosquitto running the deploy/ configuration, and a small paho client that records what happens.

The broker runs ``deploy/mosquitto/mosquitto.conf`` and ``deploy/mosquitto/acl`` as shipped, with only the
ports (free loopback ports instead of 1883/8883), the file locations (a tmp dir instead of the image's
/mosquitto/...) and the user (the current one, so that the tmp files stay readable) substituted. Passwords
and certificates come from ``deploy/make-passwords.sh`` and ``deploy/make-test-ca.sh``.
"""

from __future__ import annotations

import getpass
import os
import queue
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fedge.localnet.broker import free_port, wait_for_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MOSQUITTO = "/usr/sbin/mosquitto"
NODES = ("node-a", "node-b")
TIMEOUT_S = 10.0


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``deploy/<name>`` with ``args``; the result carries rc, stdout and stderr."""
    return subprocess.run(
        [str(DEPLOY / name), *args], capture_output=True, text=True, timeout=60, check=False
    )


@dataclass(frozen=True)
class Secrets:
    """What the deploy scripts generated: the broker's password file, client passwords, TLS files."""

    root: Path

    @property
    def passwd(self) -> Path:
        return self.root / "mosquitto" / "passwd"

    @property
    def tls(self) -> Path:
        return self.root / "tls"

    def password(self, user: str) -> str:
        return (self.root / "credentials" / f"{user}.password").read_text().strip()


def broker_config(template: str, *, plain_port: int, tls_port: int, secrets: Secrets, data_dir: Path) -> str:
    """The deploy config with ports, paths and user substituted; fails if the config no longer has them."""
    listeners = {"listener 1883 127.0.0.1": f"listener {plain_port} 127.0.0.1"}
    listeners["listener 8883"] = f"listener {tls_port} 127.0.0.1"  # the test never listens beyond loopback
    paths = {
        "/mosquitto/config/passwd": str(secrets.passwd),
        "/mosquitto/config/acl": str(DEPLOY / "mosquitto" / "acl"),
        "/mosquitto/certs/": f"{secrets.tls}/",
        "/mosquitto/data/": f"{data_dir}/",
    }
    lines = []
    for line in template.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line in listeners:
            line = listeners.pop(line)
        substituted = line
        for original, replacement in paths.items():
            substituted = substituted.replace(original, replacement)
        assert substituted != line or "/mosquitto/" not in line, f"no test path for: {line}"
        lines.append(substituted)
    assert not listeners, f"deploy config lost its listeners: {sorted(listeners)}"
    return "\n".join([*lines, f"user {getpass.getuser()}", ""])


@dataclass
class Broker:
    """A running Mosquitto: its ports, and the log to show when a test fails."""

    plain_port: int
    tls_port: int
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_broker(workdir: Path, secrets: Secrets, *, edits: dict[str, str] | None = None) -> Broker:
    """Start Mosquitto on the deploy config; ``edits`` replace whole lines (e.g. to turn on mutual TLS)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "data").mkdir(exist_ok=True)
    plain_port, tls_port = free_port(), free_port()
    template = (DEPLOY / "mosquitto" / "mosquitto.conf").read_text()
    for old, new in (edits or {}).items():
        assert re.search(rf"^{re.escape(old)}$", template, re.M), f"deploy config has no line {old!r}"
        template = re.sub(rf"^{re.escape(old)}$", new, template, flags=re.M)
    config = workdir / "mosquitto.conf"
    config.write_text(
        broker_config(
            template, plain_port=plain_port, tls_port=tls_port, secrets=secrets, data_dir=workdir / "data"
        )
    )
    log = workdir / "mosquitto.log"
    with log.open("wb") as out:
        process = subprocess.Popen([MOSQUITTO, "-c", str(config)], stdout=out, stderr=subprocess.STDOUT)
    broker = Broker(plain_port, tls_port, log, process)
    try:
        for port in (plain_port, tls_port):
            wait_for_port("127.0.0.1", port, TIMEOUT_S)
    except TimeoutError:
        broker.stop()
        pytest.fail(f"mosquitto did not start: {log.read_text()[-2000:]}")
    return broker


class Probe:
    """A paho MQTT v5 client that records the broker's answers and every message it receives.

    Parameters
    ----------
    port : int
        Broker port on 127.0.0.1.
    username, password : str or None
        Credentials; None connects anonymously.
    client_id : str
        MQTT client id (the broker replaces it by the username on the deploy config).
    ca_file : str or None
        Trust anchor for TLS; None with ``tls=True`` trusts the system's CAs only.
    tls : bool
        Connect with TLS.
    cert_file, key_file : str or None
        Client certificate for mutual TLS.
    """

    def __init__(
        self,
        port: int,
        username: str | None = None,
        password: str | None = None,
        *,
        client_id: str = "",
        clean_start: bool = True,
        ca_file: str | None = None,
        tls: bool = False,
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> None:
        self.port, self.clean_start = port, clean_start
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connack: ReasonCode | None = None
        self.disconnected = threading.Event()
        self._connected = threading.Event()
        self._acks: dict[int, list[ReasonCode]] = {}
        self._ack_ready = threading.Condition()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id or f"probe-{username}-{os.urandom(3).hex()}",
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls:
            self.client.tls_set(ca_certs=ca_file, certfile=cert_file, keyfile=key_file)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = lambda _client, _userdata, msg: self.messages.put((msg.topic, msg.payload))
        self.client.on_subscribe = lambda _c, _u, mid, codes, _p: self._ack(mid, list(codes))
        self.client.on_publish = lambda _c, _u, mid, code, _p: self._ack(mid, [code])

    def connect(self) -> ReasonCode:
        """Connect and wait for CONNACK; return its reason code.

        A failed TLS handshake raises ``ssl.SSLError`` (or ``ConnectionError`` when the server's refusal
        only shows after the handshake, as with TLS 1.3 and a missing client certificate).
        """
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = 3600  # a session that outlives its connection, as fedge's do
        self.client.connect(
            "127.0.0.1", self.port, keepalive=30, clean_start=self.clean_start, properties=properties
        )
        self.client.loop_start()
        if not self._connected.wait(TIMEOUT_S):
            raise TimeoutError("no CONNACK")
        if self.connack is None:
            raise ConnectionError("connection closed before CONNACK")
        return self.connack

    def subscribe(self, topic_filter: str) -> ReasonCode:
        """Subscribe with QoS 1 and return the SUBACK reason code."""
        _, mid = self.client.subscribe(topic_filter, qos=1)
        return self._wait_ack(mid)[0]

    def publish(self, topic: str, payload: bytes) -> ReasonCode:
        """Publish with QoS 1 and return the PUBACK reason code."""
        info = self.client.publish(topic, payload, qos=1)
        return self._wait_ack(info.mid)[0]

    def received(self, until: bytes, timeout_s: float = TIMEOUT_S) -> list[tuple[str, bytes]]:
        """Every message up to and including the first whose payload is ``until`` (a barrier message)."""
        deadline = time.monotonic() + timeout_s
        seen: list[tuple[str, bytes]] = []
        while True:
            try:
                message = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{until!r} never arrived; got {seen}") from None
            seen.append(message)
            if message[1] == until:
                return seen

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, _client, _userdata, _flags, reason_code: ReasonCode, _properties) -> None:
        self.connack = reason_code
        self._connected.set()

    def _on_disconnect(self, _client, _userdata, _flags, _reason_code, _properties) -> None:
        self.disconnected.set()
        self._connected.set()  # a refused CONNECT ends here too

    def _ack(self, mid: int, codes: list[ReasonCode]) -> None:
        with self._ack_ready:
            self._acks[mid] = codes
            self._ack_ready.notify_all()

    def _wait_ack(self, mid: int) -> list[ReasonCode]:
        with self._ack_ready:
            if not self._ack_ready.wait_for(lambda: mid in self._acks, TIMEOUT_S):
                raise TimeoutError(f"no acknowledgement for message {mid}")
            return self._acks.pop(mid)
