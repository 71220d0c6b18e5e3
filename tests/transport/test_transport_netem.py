"""The lossy-link proxy against a plain TCP echo server: latency, rate cap, resets, black hole, link down."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from fedge.localnet import LinkProfile, LossyLinkProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except ConnectionError:  # the proxy's reset tests cut links on purpose: nothing to echo to
            pass


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _round_trip(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        start = time.perf_counter()
        sock.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got, time.perf_counter() - start


def _answer_or_cut(read: Callable[[], bytes]) -> bytes:
    """What ``read`` returns, or b"" if the connection was reset (RST) instead of closed (FIN)."""
    try:
        return read()
    except ConnectionResetError:
        return b""


def test_latency_applies_each_way(echo_port: int) -> None:
    with LossyLinkProxy("127.0.0.1", echo_port, LinkProfile(latency_ms=60)) as proxy:
        got, elapsed = _round_trip(proxy.port, b"ping")
    assert got == b"ping" and 0.12 <= elapsed < 2.0


def test_rate_cap_paces_bulk_data(echo_port: int) -> None:
    data = bytes(range(256)) * 2048  # 512 KiB, each way at 2 MB/s: about 0.26 s, in parallel directions
    with LossyLinkProxy("127.0.0.1", echo_port, LinkProfile(rate_bytes_per_s=2e6)) as proxy:
        got, elapsed = _round_trip(proxy.port, data)
        assert proxy.stats.bytes_up == len(data) == proxy.stats.bytes_down
    assert got == data and elapsed >= 0.2


def test_resets_cut_connections_at_the_mean_interval(echo_port: int) -> None:
    with LossyLinkProxy("127.0.0.1", echo_port, LinkProfile(reset_mean_s=0.1, seed=3)) as proxy:
        cuts = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                # A reset can land while the connection is still being set up: that is a cut too.
                with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as sock:
                    while sock.recv(1024) or True:
                        sock.sendall(b"x")
            except OSError:
                cuts += 1
    assert cuts >= 3 and proxy.stats.resets >= 3


def test_blackhole_swallows_bytes_but_keeps_the_connection(echo_port: int) -> None:
    with LossyLinkProxy("127.0.0.1", echo_port, LinkProfile(blackhole=True)) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3) as sock:
            sock.sendall(b"hello")
            with pytest.raises(TimeoutError):
                sock.recv(10)
            sock.sendall(b"still open")
        time.sleep(0.05)
        assert proxy.stats.bytes_up == 15 and proxy.stats.bytes_down == 0
        proxy.set_profile(blackhole=False)
        assert _round_trip(proxy.port, b"back")[0] == b"back"


def test_link_down_refuses_and_comes_back(echo_port: int) -> None:
    with LossyLinkProxy("127.0.0.1", echo_port) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as open_sock:
            assert _round_trip(proxy.port, b"up")[0] == b"up"
            proxy.set_down(True)
            assert _answer_or_cut(lambda: open_sock.recv(10)) == b""  # the open connection was cut
        assert _answer_or_cut(lambda: _round_trip(proxy.port, b"down", timeout_s=1)[0]) == b""
        proxy.set_down(False)
        assert _round_trip(proxy.port, b"up again")[0] == b"up again"


def test_link_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="rate"):
        LinkProfile(rate_bytes_per_s=0)
    with pytest.raises(ValueError, match="latency"):
        LinkProfile(latency_ms=-1)
