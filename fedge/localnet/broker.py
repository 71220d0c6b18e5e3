"""Brokers for tests, benchmarks and the one-machine default.

:class:`MosquittoBroker` runs a real Mosquitto on a free loopback port with a generated config (persistence
on), and can be stopped and started again on the same port and persistence directory.
:class:`EmbeddedBroker` runs amqtt (pure Python, MQTT 3.1.1 only) in a background thread with its own loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fedge.localnet.background import BackgroundLoop

__all__ = ["EmbeddedBroker", "MosquittoBroker", "free_port", "wait_for_port"]

logger = logging.getLogger(__name__)

MOSQUITTO = "/usr/sbin/mosquitto"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind port 0 and let the kernel choose)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float = 10.0) -> None:
    """Block until ``host:port`` accepts TCP connections; raise TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nothing accepts connections on {host}:{port} after {timeout_s:g} s"
                ) from None
            time.sleep(0.02)


class MosquittoBroker:
    """A Mosquitto process on loopback for tests and benchmarks.

    Parameters
    ----------
    workdir : str or Path, optional
        Where config, log and persistence go; None makes a temporary directory (removed by :meth:`stop`).
    port : int, default 0
        0 picks a free port once; restarts reuse it.
    persistence : bool, default True
        Keep sessions, subscriptions, queued and retained messages across restarts (saved on shutdown).
    max_packet_size : int, optional
        Broker's Maximum Packet Size (announced to MQTT 5 clients in CONNACK).
    max_queued_messages : int, default 1000
        Messages queued per client beyond the in-flight ones (Mosquitto drops the rest silently).
    extra_config : list of str, optional
        More config lines (e.g. ``password_file``, ``acl_file``); anonymous access is allowed unless these
        contain an ``allow_anonymous`` line.
    binary : str, default "/usr/sbin/mosquitto"
        The broker executable.
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        port: int = 0,
        persistence: bool = True,
        max_packet_size: int | None = None,
        max_queued_messages: int = 1000,
        extra_config: list[str] | None = None,
        binary: str = MOSQUITTO,
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedge-mosquitto-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.binary = binary
        extra = list(extra_config or [])
        # set_tcp_nodelay: without it small ACK frames wait for delayed TCP acks (40 ms stalls).
        lines = [f"listener {self.port} 127.0.0.1", f"max_queued_messages {max_queued_messages}"]
        lines.append("set_tcp_nodelay true")
        if not any(line.startswith("allow_anonymous") for line in extra):
            lines.append("allow_anonymous true")
        if os.geteuid() == 0 and not any(line.startswith("user ") for line in extra):
            # Started as root, Mosquitto switches to user "mosquitto", who cannot write our private directory.
            lines.append("user root")
        if persistence:
            lines += ["persistence true", f"persistence_location {self.workdir}/", "autosave_interval 60"]
        if max_packet_size is not None:
            lines.append(f"max_packet_size {max_packet_size}")
        lines += [f"log_dest file {self.workdir / 'mosquitto.log'}", "log_type error", "log_type warning"]
        self.config_path = self.workdir / "mosquitto.conf"
        self.config_path.write_text("\n".join(lines + extra) + "\n")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``mqtt://127.0.0.1:<port>``."""
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> MosquittoBroker:
        """Start the broker and wait until it accepts connections."""
        if self._process is not None:
            raise RuntimeError("broker already running")
        self._process = subprocess.Popen(
            [self.binary, "-c", str(self.config_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            wait_for_port("127.0.0.1", self.port, timeout_s)
        except TimeoutError:
            self.kill()
            log = (
                (self.workdir / "mosquitto.log").read_text()
                if (self.workdir / "mosquitto.log").exists()
                else ""
            )
            raise RuntimeError(f"mosquitto did not start on port {self.port}: {log.strip()[-500:]}") from None
        return self

    def kill(self) -> None:
        """Stop at once (SIGKILL): nothing is saved."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM): Mosquitto saves its persistence file; the directory is kept."""
        if self._process is not None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def restart(self) -> None:
        """Shut down and start again on the same port and persistence directory."""
        self.shutdown()
        self.start()

    def stop(self) -> None:
        """Shut down and remove the working directory if this object created it."""
        self.shutdown()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _OneLineClientErrors(logging.Filter):
    """amqtt logs a traceback for every connection it cannot use: say what was wrong in one line instead.

    The MQTT 5 connects it refuses are dropped altogether: fedge's clients then fall back to 3.1.1.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if "Invalid protocol" in f"{message} {error}" or message.startswith("No data from"):
            return False  # "No data from": a client that closed its connection, the normal end of one
        if error is not None:  # a client's bad bytes are the client's problem, not a broker fault
            record.msg, record.args = f"{record.getMessage()}: {type(error).__name__}: {error}", None
            record.exc_info, record.exc_text = None, None
        return True


class _AmqttToFedge(logging.Handler):
    """amqtt's lines under fedge's logger (its configuration decides what shows), what it says of clients
    (sessions that failed, take-overs: WARNING and below) at INFO: they are the clients' business."""

    def emit(self, record: logging.LogRecord) -> None:
        level = logging.INFO if record.levelno <= logging.WARNING else record.levelno
        logger.log(level, "amqtt: %s", record.getMessage())


def _client_gone(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An exception in amqtt's handling of one connection reached asyncio's handler, which printed a
    traceback in every ``--engine mqtt`` run: a connection that broke while amqtt set it up or closed it
    (``OSError``), or amqtt's own race on its subscriptions (``RuntimeError: dictionary changed size
    during iteration``; the client reconnects). One line at INFO instead; other errors go to asyncio."""
    error = context.get("exception")
    if isinstance(error, OSError | RuntimeError) and "client_connected_cb" in str(context.get("message")):
        logger.info("amqtt dropped a client connection: %s: %s", type(error).__name__, error)
        return
    loop.default_exception_handler(context)


class EmbeddedBroker:
    """amqtt, the pure-Python MQTT 3.1.1 broker, in a background thread (or in the foreground: :meth:`serve`).

    Parameters
    ----------
    host : str, default "127.0.0.1"
        Address to listen on.
    port : int, default 0
        0 picks a free port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._background = BackgroundLoop("fedge-amqtt")

    @property
    def url(self) -> str:
        """``mqtt://<host>:<port>``."""
        return f"mqtt://{self.host}:{self.port}"

    def config(self) -> dict[str, Any]:
        """The amqtt configuration: one TCP listener, anonymous access."""
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }

    async def serve(self, stop: asyncio.Event | None = None, ready: threading.Event | None = None) -> None:
        """Run the broker on the current event loop until ``stop`` is set (forever if None)."""
        from amqtt.broker import Broker  # optional dependency: fedge[broker]

        for name in ("amqtt.broker", "amqtt.mqtt.protocol.broker_handler"):
            logging.getLogger(name).addFilter(_OneLineClientErrors())
        amqtt_log = logging.getLogger("amqtt")
        if not any(isinstance(h, _AmqttToFedge) for h in amqtt_log.handlers):
            amqtt_log.addHandler(_AmqttToFedge())
            amqtt_log.propagate = False
        asyncio.get_running_loop().set_exception_handler(_client_gone)
        broker = Broker(self.config())
        await broker.start()
        if ready is not None:
            ready.set()
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            await broker.shutdown()

    def start(self, timeout_s: float = 10.0) -> EmbeddedBroker:
        """Start in a daemon thread and wait until the port accepts connections."""
        self._background.start(self.serve, timeout_s)
        wait_for_port(self.host, self.port, timeout_s)
        return self

    def stop(self) -> None:
        """Shut the broker down and end its thread."""
        self._background.stop()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
