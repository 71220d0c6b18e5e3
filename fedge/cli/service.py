"""``fedge coordinator``, ``fedge agent`` and ``fedge status``: the MQTT services and their status."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path

import typer

from fedge.cli.common import config_errors, configure_logging, fail, interrupt_on_sigterm
from fedge.config import ConfigError

__all__ = ["agent", "coordinator", "status"]


def coordinator(
    config: Path = typer.Option(
        ...,
        "--config",
        help="coordinator.toml: state_dir (default ./coordinator-state), [mqtt] (default broker "
        "mqtt://127.0.0.1:1883, fleet 'default'), [app] (the run's settings).",
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue after the last completed round."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
    log_json: bool = typer.Option(False, "--log-json", help="Log one JSON object per line."),
) -> None:
    """Run the coordinator service: rounds over MQTT, a checkpoint and an audit log per round."""
    from rich.console import Console

    from fedge.app.coordinator import CoordinatorConfig, run_coordinator
    from fedge.reporting.display import summary_table
    from fedge.server.runner import RunFailed
    from fedge.server.status import read_status

    with config_errors():
        settings = CoordinatorConfig.from_toml(config)
        settings.service.node_keys()
    configure_logging(verbose, service=True, json_lines=log_json)
    stopped_by = interrupt_on_sigterm()
    try:
        with config_errors():
            history = run_coordinator(settings, resume=resume)
    except ConnectionError as err:  # the broker: its address, credentials or TLS settings, most often
        raise fail(str(err)) from None
    except (TimeoutError, RunFailed) as err:  # a fleet short for good, or no round trained: the run failed
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        try:
            done = read_status(settings.service.state_dir).get("round", 0)
        except ConfigError:  # stopped before it wrote any status
            done = 0
        typer.echo(f"stopped after round {done}; 'fedge coordinator --resume' continues from there", err=True)
        raise typer.Exit(0 if stopped_by else 130) from None
    Console().print(summary_table(history, title="fedge coordinator"))


def agent(
    config: Path = typer.Option(
        ..., "--config", help="agent.toml (node_id, state_dir, [mqtt], [node_config])."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and fedge's logs."),
    log_json: bool = typer.Option(False, "--log-json", help="Log one JSON object per line."),
) -> None:
    """Run the device agent: execute the ClientApp for every instruction from the coordinator."""
    from fedge.client.agent import AgentConfig, DeviceAgent

    with config_errors():
        settings = AgentConfig.from_toml(config)
        device = DeviceAgent(settings)
    configure_logging(verbose, service=True, json_lines=log_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        device.run_forever(stop)
    except (ConnectionError, ConfigError) as err:  # ConfigError: another process holds its node id
        raise fail(str(err)) from None
    except KeyboardInterrupt:
        pass


def status(
    config: Path = typer.Option(..., "--config", help="The coordinator's coordinator.toml."),
    json_out: bool = typer.Option(False, "--json", help="Print the raw status as JSON."),
    audit: bool = typer.Option(False, "--audit", help="Per node, the rounds its update counted in."),
) -> None:
    """Show the coordinator's round, online nodes and last accuracy (or, with --audit, who counted when)."""
    from fedge.app.coordinator import CoordinatorConfig
    from fedge.server.audit import AUDIT_FILE, audit_events, counted_rounds
    from fedge.server.status import read_status

    with config_errors():
        state_dir = Path(CoordinatorConfig.from_toml(config).service.state_dir)
        current = {} if audit else read_status(state_dir)
    if audit:
        log = state_dir / AUDIT_FILE
        if not log.is_file():
            raise fail(f"no audit log {log}: not a coordinator's state directory, or no round has run yet")
        counted = counted_rounds(log)
        if not counted and log.stat().st_size and not audit_events(log):
            raise fail(f"{log} holds no audit events")
        if json_out:
            typer.echo(json.dumps(counted))
        elif not counted:  # say so: an empty screen reads as a broken command
            typer.echo("no node's update has counted in any round yet")
        for node, rounds in counted.items() if not json_out else ():
            typer.echo(f"{node:<24} {len(rounds):>4} rounds: {_ranges(rounds)}")
        return
    try:
        _check_status(current)  # --json too: it printed a damaged file and exited 0
        if json_out:
            typer.echo(json.dumps(current))
            return
        _print_status(current)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        why = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        raise fail(f"{state_dir / 'status.json'} is not a coordinator's status: {why}") from None


_STATUS_KEYS = ("round", "rounds", "online_nodes", "updated_at", "pid")


def _check_status(current: object) -> None:
    """ValueError naming what a coordinator's ``status.json`` would hold and this one does not."""
    if not isinstance(current, dict):
        raise ValueError(f"it holds a JSON {type(current).__name__}, not an object")
    missing = [key for key in _STATUS_KEYS if key not in current]
    if missing:
        raise ValueError(f"it lacks {', '.join(map(repr, missing))}")
    if not isinstance(current["online_nodes"], list):
        raise ValueError(f"online_nodes is {current['online_nodes']!r}, not a list")


def _print_status(current: dict) -> None:
    """The status's lines (KeyError, TypeError, ValueError on a file that is not a coordinator's status)."""
    accuracy = current.get("last_accuracy")
    typer.echo(f"round         {current['round']}/{current['rounds']}")
    typer.echo(f"last accuracy {'-' if accuracy is None else f'{100 * accuracy:.2f}%'}")
    typer.echo(f"online nodes  {len(current['online_nodes'])}: {' '.join(current['online_nodes'])}")
    age = time.time() - _moment(current["updated_at"], "updated_at")
    typer.echo(f"state         {_state_line(current, age)}")
    typer.echo(f"updated       {age:.0f} s ago (pid {current['pid']})")
    for name, profile in current.get("profiles", {}).items():
        typer.echo(
            f"  {name:<22} {profile.get('cpus', '?')} CPUs, {profile.get('memory_total_mb', '?')} MB, "
            f"{profile.get('machine', '')}"
        )
    for name, device in sorted(current.get("inference_devices", {}).items()):
        typer.echo(f"  infer {name:<16} {_device_line(device)}")
    dropped = current.get("dropped_replies", {})
    if dropped:
        typer.echo(
            "dropped       " + ", ".join(f"{reason} {count}" for reason, count in sorted(dropped.items()))
        )


def _state_line(current: dict, age: float) -> str:
    """How the run stands: running (or silent too long: the coordinator may have died), or how it ended."""
    state = current.get("state", "running")
    if state == "running":
        # the status is rewritten every two seconds while the coordinator lives
        if age >= 10:
            return f"running? (no update for {age:.0f} s: the coordinator may be gone)"
        short = current.get("waiting_for_nodes")
        if isinstance(short, dict):  # the fleet fell below what the run needs
            since = short.get("since")
            waited = f" for {time.time() - _moment(since, 'since'):.0f} s" if since is not None else ""
            online, needed = short.get("online", "?"), short.get("needed", "?")
            return f"waiting for nodes{waited}: {online} of {needed} online"
        return "running"
    ended = current.get("ended_at")
    when = f" {time.time() - _moment(ended, 'ended_at'):.0f} s ago" if ended is not None else ""
    error = f": {current['error']}" if current.get("error") else ""
    return f"{state}{when}{error}"


def _moment(value: object, key: str) -> float:
    """A status's Unix time ``key``; ValueError for anything else (a damaged file had shown "-inf s ago")."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} is {value!r}, not a time")
    return float(value)


def _device_line(device: dict) -> str:
    """One inference device's status: model, variant, latency percentiles, requests (or offline)."""
    if not device.get("online"):
        return "offline"
    latency = device.get("latency_ms", {})
    percentiles = " ".join(f"{q} {latency.get(q, 0):.2f}" for q in ("p50", "p95", "p99"))
    model = f"{device.get('version') or '-'} ({device.get('variant') or '-'})"
    return f"model {model}, {percentiles} ms, {device.get('requests', 0)} requests"


def _ranges(rounds: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``"1-3, 5"``."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
