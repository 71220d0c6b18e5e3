"""A lossy-link TCP proxy (kernel netem is not available here): latency, jitter, rate cap, resets, black hole.

Put it between an MQTT client and the broker. Each direction of each connection reads from one socket, pays
for the bytes at the link rate (one token bucket per direction, shared by all connections: it is one link),
then delivers them after the latency plus jitter, never reordering. Resets abort every open connection at
exponential intervals (a Poisson process with the given mean). In black-hole mode bytes are read and
silently discarded, so peers only notice through their keepalive.

Runs in a background thread (:meth:`LossyLinkProxy.start`) for tests and benchmarks, or in the foreground
(:meth:`LossyLinkProxy.serve`) for ``fedge netem``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import struct
import threading
from dataclasses import dataclass, replace

from fedge.localnet.background import BackgroundLoop

__all__ = ["LinkProfile", "LossyLinkProxy", "ProxyStats"]

logger = logging.getLogger(__name__)

_READ_SIZE = 64 * 1024
_QUEUE_SEGMENTS = 256


@dataclass(frozen=True)
class LinkProfile:
    """How the emulated link behaves.

    Parameters
    ----------
    latency_ms : float, default 0.0
        One-way delay added to every byte, each direction.
    jitter_ms : float, default 0.0
        Uniform extra delay in ``[0, jitter_ms]`` per segment (order is kept, so jitter never reorders).
    rate_bytes_per_s : float or None, default None
        Link rate per direction; None is unlimited.
    burst_bytes : float or None, default None
        Bytes an idle link may pass at once before the rate applies; None: 5 ms at the rate, at least one
        64 KiB read (smooth pacing). A small burst (one MTU) charges every message its full serialization
        time, as a real link does, which matters when messages are smaller than the default burst.
    reset_mean_s : float or None, default None
        Mean seconds between connection resets (exponentially distributed); None never resets.
    blackhole : bool, default False
        Swallow all bytes while connections stay open.
    seed : int or None, default None
        Seed for jitter and reset times (None: not reproducible).
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_bytes_per_s: float | None = None
    burst_bytes: float | None = None
    reset_mean_s: float | None = None
    blackhole: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("latency_ms", "jitter_ms", "burst_bytes", "rate_bytes_per_s", "reset_mean_s"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.latency_ms < 0 or self.jitter_ms < 0:
            raise ValueError("latency_ms and jitter_ms must be >= 0")
        if self.burst_bytes is not None and self.burst_bytes <= 0:
            raise ValueError("burst_bytes must be positive")
        if self.rate_bytes_per_s is not None and self.rate_bytes_per_s <= 0:
            raise ValueError("rate_bytes_per_s must be positive")
        if self.reset_mean_s is not None and self.reset_mean_s <= 0:
            raise ValueError("reset_mean_s must be positive")


@dataclass
class ProxyStats:
    """Counters: connections accepted, reset events, bytes read from clients (up) and from upstream (down),
    clients dropped for want of the upstream."""

    connections: int = 0
    resets: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    upstream_failures: int = 0  # clients dropped because the upstream could not be reached


class _TokenBucket:
    """Pays for bytes at ``rate`` per second with bursts up to ``burst`` bytes (debt is paid by sleeping)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._last = 0.0

    async def take(self, n: int) -> None:
        now = asyncio.get_running_loop().time()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


class _Connection:
    """A client connection and its upstream, so a reset can abort both."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.writers = [client]
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                # Linger 0: close with RST, like a dropped radio link seen by the next packet.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class LossyLinkProxy:
    """A TCP proxy that makes a good link bad.

    Parameters
    ----------
    upstream_host, upstream_port : str, int
        Where to forward (e.g. the broker).
    profile : LinkProfile, default LinkProfile()
        Link behaviour; change it while running with :meth:`set_profile`.
    listen_host : str, default "127.0.0.1"
        Address to listen on.
    listen_port : int, default 0
        0 lets the kernel choose (see :attr:`port` after start).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        profile: LinkProfile | None = None,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.port = listen_port
        self.stats = ProxyStats()
        self._profile = profile or LinkProfile()
        self._rng = random.Random(self._profile.seed)
        self._buckets: dict[bool, _TokenBucket] = {}
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[object]] = set()
        self._down = False
        self._background = BackgroundLoop("fedge-netem")

    @property
    def profile(self) -> LinkProfile:
        """The current link behaviour."""
        return self._profile

    @property
    def open_connections(self) -> int:
        """Connections open through the proxy now."""
        return len(self._connections)

    @property
    def url(self) -> str:
        """``mqtt://<listen host>:<port>``, for pointing an MQTT client at the proxy."""
        return f"mqtt://{self.listen_host}:{self.port}"

    def set_profile(self, profile: LinkProfile | None = None, **changes: object) -> None:
        """Replace the profile, or change some of its fields (``set_profile(blackhole=True)``)."""
        self._profile = replace(profile or self._profile, **changes)  # type: ignore[arg-type]
        self._buckets.clear()

    def reset_connections(self) -> int:
        """Abort every open connection now (thread-safe); return how many were open."""
        if self._background.in_loop_thread():
            return self._reset_all()
        return self._background.run(self._async_reset())

    def set_down(self, down: bool) -> None:
        """Take the link down (reset open connections, refuse new ones) or bring it back up."""
        self._down = down
        if down:
            self.reset_connections()

    # --------------------------------------------------------------------------------------------- running
    async def serve(self, stop: asyncio.Event | None = None, ready: threading.Event | None = None) -> None:
        """Run on the current event loop until ``stop`` is set (forever if None)."""
        server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        resets = asyncio.create_task(self._reset_loop())
        if ready is not None:
            ready.set()
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            resets.cancel()
            server.close()
            self._reset_all()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await server.wait_closed()

    def start(self, timeout_s: float = 10.0) -> LossyLinkProxy:
        """Run in a daemon thread; return once listening."""
        self._background.start(self.serve, timeout_s)
        return self

    def stop(self) -> None:
        """Stop the background proxy and close every connection."""
        self._background.stop()

    def __enter__(self) -> LossyLinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --------------------------------------------------------------------------------------------- internals
    async def _async_reset(self) -> int:
        return self._reset_all()

    def _reset_all(self) -> int:
        count = len(self._connections)
        for connection in list(self._connections):
            connection.abort()
        self._connections.clear()
        return count

    async def _reset_loop(self) -> None:
        while True:
            mean = self._profile.reset_mean_s
            if mean is None:
                await asyncio.sleep(0.1)
                continue
            await asyncio.sleep(self._rng.expovariate(1.0 / mean))
            if self._profile.reset_mean_s is not None and self._reset_all():
                self.stats.resets += 1
                logger.debug("reset connections (event %d)", self.stats.resets)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        if self._down:
            connection.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError as err:
            self.stats.upstream_failures += 1
            # the first time said where a user sees it; later ones (a client retrying) in the debug log
            level = logging.WARNING if self.stats.upstream_failures == 1 else logging.DEBUG
            logger.log(level, "upstream %s:%d unreachable: %s; the client is dropped", *self.upstream, err)
            connection.abort()
            return
        self.stats.connections += 1
        connection.writers.append(up_writer)
        self._connections.add(connection)
        connection.tasks = [
            asyncio.create_task(self._pipe(reader, up_writer, up=True)),
            asyncio.create_task(self._pipe(up_reader, writer, up=False)),
        ]
        await asyncio.gather(*connection.tasks, return_exceptions=True)
        self._connections.discard(connection)
        connection.abort()

    def _bucket(self, up: bool) -> _TokenBucket | None:
        rate = self._profile.rate_bytes_per_s
        if rate is None:
            return None
        if up not in self._buckets:
            # By default a burst of 5 ms at the link rate (at least one read) keeps pacing smooth.
            burst = self._profile.burst_bytes or max(rate * 0.005, _READ_SIZE)
            self._buckets[up] = _TokenBucket(rate, burst)
        return self._buckets[up]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool) -> None:
        """Copy one direction: pay for bytes at the link rate, then deliver them after the latency."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_SEGMENTS)
        deliver = asyncio.create_task(self._deliver(queue, writer))
        last_at = 0.0
        try:
            while data := await reader.read(_READ_SIZE):
                if up:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                profile = self._profile
                if profile.blackhole:
                    continue
                bucket = self._bucket(up)
                if bucket is not None:
                    await bucket.take(len(data))
                delay = (profile.latency_ms + self._rng.uniform(0, profile.jitter_ms)) / 1000
                last_at = max(last_at, loop.time() + delay)
                await queue.put((last_at, data))
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            deliver.cancel()
            raise
        await queue.put((0.0, b""))
        await deliver

    @staticmethod
    async def _deliver(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                at, data = await queue.get()
                if not data:
                    break
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
