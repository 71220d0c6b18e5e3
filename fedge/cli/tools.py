"""``fedge broker`` (the embedded MQTT broker) and ``fedge netem`` (the lossy-link proxy).

Imported by the CLI at start-up, so heavy modules (amqtt, asyncio servers) are imported inside the commands.
"""

from __future__ import annotations

import logging
import math
import socket

import typer

from fedge.cli.common import check_finite, fail

__all__ = ["broker_command", "netem_command"]

_THIS_MACHINE = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}


def broker_command(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(1883, min=1, max=65535, help="TCP port to listen on."),
) -> None:
    """Run the embedded MQTT broker (amqtt, MQTT 3.1.1, anonymous) in the foreground until Ctrl-C.

    The one-machine default when no broker URL is given; use Mosquitto for fleets (docs/mqtt-protocol.md).
    """
    import asyncio
    import importlib.util

    from fedge.localnet.broker import EmbeddedBroker

    if importlib.util.find_spec("amqtt") is None:
        raise fail("the embedded broker needs amqtt: pip install 'fedge[broker]'")
    _check_free(host, port)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    typer.echo(f"fedge broker on mqtt://{host}:{port} (MQTT 3.1.1, anonymous); Ctrl-C stops it")
    try:
        asyncio.run(EmbeddedBroker(host, port).serve())
    except KeyboardInterrupt:
        typer.echo("broker stopped")


def netem_command(
    listen: int = typer.Option(..., "--listen", min=1, max=65535, help="Port to listen on."),
    upstream: str = typer.Option(..., "--upstream", help="HOST:PORT to forward to, e.g. the broker."),
    latency_ms: float = typer.Option(0.0, "--latency-ms", min=0, help="One-way delay per direction."),
    jitter_ms: float = typer.Option(0.0, "--jitter-ms", min=0, help="Extra delay, uniform in [0, jitter]."),
    rate_mbps: float | None = typer.Option(
        None, "--rate-mbps", help="Link rate per direction in megabits per second (160 = 20 MB/s)."
    ),
    reset_mean_s: float | None = typer.Option(
        None, "--reset-mean-s", help="Reset all connections at exponential intervals with this mean."
    ),
    blackhole: bool = typer.Option(False, "--blackhole", help="Swallow all bytes; connections stay open."),
    listen_host: str = typer.Option("127.0.0.1", "--listen-host", help="Address to listen on."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for jitter and reset times."),
) -> None:
    """Run the lossy-link TCP proxy in the foreground until Ctrl-C: point MQTT clients at --listen."""
    import asyncio

    from fedge.localnet.netem import LinkProfile, LossyLinkProxy

    for flag, value in (("--latency-ms", latency_ms), ("--jitter-ms", jitter_ms)):
        check_finite(value, flag)
    for flag, value in (("--rate-mbps", rate_mbps), ("--reset-mean-s", reset_mean_s)):
        if value is not None and not 0 < value < math.inf:
            raise fail(f"{flag} must be positive, got {value:g}")
    if "://" in upstream:
        raise fail(f"--upstream {upstream!r} must be HOST:PORT, not a URL")
    host, _, port_text = upstream.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:1883
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise fail(f"--upstream {upstream!r} must be HOST:PORT")
    if int(port_text) == listen and (host == listen_host or host in _THIS_MACHINE):
        raise fail(f"--upstream {upstream!r} is netem's own --listen address: it would forward to itself")
    try:
        profile = LinkProfile(
            latency_ms=latency_ms,
            jitter_ms=jitter_ms,
            rate_bytes_per_s=None if rate_mbps is None else rate_mbps * 1e6 / 8,
            reset_mean_s=reset_mean_s,
            blackhole=blackhole,
            seed=seed,
        )
    except ValueError as err:
        raise fail(str(err)) from None
    _check_free(listen_host, listen)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = LossyLinkProxy(host, int(port_text), profile, listen_host=listen_host, listen_port=listen)
    typer.echo(f"netem {listen_host}:{listen} -> {host}:{port_text} ({profile}); Ctrl-C stops it")
    try:
        asyncio.run(proxy.serve())
    except KeyboardInterrupt:
        stats = proxy.stats
        typer.echo(
            f"connections {stats.connections}, resets {stats.resets}, "
            f"upstream unreachable {stats.upstream_failures}"
        )
        typer.echo(f"bytes up {stats.bytes_up}, down {stats.bytes_down}")


def _check_free(host: str, port: int) -> None:
    """Fail with one line if ``host:port`` cannot be listened on (in use, or not a local address)."""
    with socket.socket() as sock:
        # as the servers bind: a port whose last connections linger in TIME_WAIT is free to listen on (a
        # broker restarted at once was refused for a minute)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise fail(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
