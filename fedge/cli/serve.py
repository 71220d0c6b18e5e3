"""``fedge serve`` (the torch-free inference agent) and ``fedge infer`` (ask devices over MQTT).

Registered in :mod:`fedge.cli`. Both import only the inference package and the MQTT transport when they
run, so they work in a ``fedge[infer]`` install without torch or Flower.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import typer

from fedge.cli.common import (
    check_finite,
    config_errors,
    configure_logging,
    fail,
    json_values,
    non_finite_rows,
)

__all__ = ["infer", "serve"]


def serve(
    config: Path = typer.Option(
        ..., "--config", help="infer.toml (node_id, model_dir, instruction_key_files, [mqtt], [session])."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show fedge's logs."),
    log_json: bool = typer.Option(False, "--log-json", help="Log one JSON object per line."),
    replica: int | None = typer.Option(
        None, "--replica", min=0, help="Run only this replica (with replicas = 2, the first starts the rest)."
    ),
) -> None:
    """Run the inference agent: receive the fleet's models, hot-swap them, answer requests over MQTT."""
    from fedge.inference.agent import InferenceAgent, InferenceAgentConfig

    with config_errors():
        settings = InferenceAgentConfig.from_toml(config)
        agent = InferenceAgent(settings, replica or 0)
    configure_logging(verbose, service=True, json_lines=log_json)
    # Requests are answered on one paho thread while model chunks arrive on another and swaps run on a
    # third: with Python's default 5 ms switch interval a request could wait that long for the GIL, and it
    # takes the GIL back several times (after the run, the socket writes). At 0.1 ms, 20 swap tests each
    # measured a median swap pause of 1.1 ms (worst 1.9) against 1.3 ms (worst 2.4) at 0.5 ms.
    sys.setswitchinterval(0.0001)
    others = [] if replica is not None else range(1, settings.replicas)
    flags = [*(["-v"] if verbose else []), *(["--log-json"] if log_json else [])]
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "fedge", "serve", "--config", str(config), "--replica", str(i), *flags],
            env={**os.environ, _PARENT_ENV: str(os.getpid())},
        )
        for i in others
    ]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if replica is not None and os.environ.get(_PARENT_ENV, "").isdigit():
        _stop_with_parent(int(os.environ[_PARENT_ENV]), stop)
    try:
        agent.run_forever(stop)
    except ConnectionError as err:
        raise fail(str(err)) from None
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(30)


_PARENT_ENV = "FEDGE_SERVE_PARENT"  # the pid of the serve process that started a replica


def _stop_with_parent(parent: int, stop: threading.Event, every_s: float = 0.5) -> None:
    """Set ``stop`` once the process that started this replica is gone (killed, crashed, out of memory):
    an orphaned replica went on answering under the device's name and fought every restarted one for its
    client id."""
    import logging

    log = logging.getLogger("fedge.cli")

    def watch() -> None:
        while os.getppid() == parent:  # re-parented (to init or a subreaper) once it is gone
            if stop.wait(every_s):
                return
        log.warning("the serve process %d that started this replica is gone", parent)
        stop.set()

    threading.Thread(target=watch, name="fedge-replica-parent", daemon=True).start()


def infer(
    broker: str = typer.Option("mqtt://127.0.0.1:1883", "--broker", help="Broker URL (MQTT 5)."),
    fleet: str = typer.Option("default", "--fleet", help="The fleet's name."),
    node: str = typer.Option("", "--node", help="The device to ask (with --input)."),
    input_file: Path | None = typer.Option(
        None, "--input", help="Inputs: .npy (batch first), .csv (one row per line) or .npz (inputs by name)."
    ),
    status: bool = typer.Option(False, "--status", help="Show every device's serving status instead."),
    timeout: float = typer.Option(
        10.0, "--timeout", min=0.1, max=86400.0, help="Seconds to wait for the broker and for the answer."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Ask a device for predictions, or (with --status) list devices' model versions and latencies."""
    from fedge.transport.config import MqttConfig

    check_finite(timeout, "--timeout")
    with config_errors():
        # A throw-away client: its session must not outlive it, nor may connecting outwait --timeout.
        wait_s = min(MqttConfig.connect_timeout_s, timeout)
        config = MqttConfig(
            broker_url=broker, fleet=fleet, persistent_session=False, connect_timeout_s=wait_s
        )
    if status:
        _print_status(config, timeout, as_json)
        return
    if not node or input_file is None:
        raise fail("give --node and --input, or --status")
    from fedge.inference import InputError, read_inputs
    from fedge.inference.io import read_named_inputs
    from fedge.inference.remote import InferenceClient, InferenceError
    from fedge.protocol.fleet import validate_name

    with config_errors():
        validate_name(node, "--node")
    try:  # an .npz holds a multi-input model's inputs by name; a device fits .csv rows to its model's shape
        rows = read_named_inputs(input_file) if input_file.suffix == ".npz" else read_inputs(input_file)
    except InputError as err:
        raise fail(str(err)) from None
    try:
        with InferenceClient(config) as client:
            answer = client.predict(node, rows, timeout=timeout)
    except (ConnectionError, InferenceError) as err:
        raise fail(str(err)) from None
    except TimeoutError:
        raise fail(f"{node} did not answer within {timeout:g} s") from None
    import numpy as np

    from fedge.inference.io import is_class_scores

    outputs = answer.outputs
    named_outputs = outputs if isinstance(outputs, dict) else {"output": outputs}
    count = len(next(iter(named_outputs.values()), []))
    broken = non_finite_rows(named_outputs.values(), count)
    if broken:  # NaN in, NaN out: argmax would call every such row class 0
        typer.echo(f"warning: {broken} of {count} rows have NaN or infinite outputs", err=True)
    if isinstance(outputs, dict):  # a named request is answered with every output by name
        if as_json:
            named = {name: json_values(value) for name, value in outputs.items()}
            typer.echo(json.dumps({"version": answer.version, "outputs": named}))
            return
        typer.echo(f"model {answer.version}:")
        for name, value in outputs.items():
            typer.echo(f"  {name}: {np.array2string(value, precision=6, threshold=64)}")
        return
    if answer.other_outputs:
        others = ", ".join(answer.other_outputs)
        typer.echo(
            f"warning: the model's other outputs ({others}) are not in the answer: send the rows in an .npz "
            "by input name to get every output",
            err=True,
        )
    classify = answer.kind != "values" and is_class_scores(outputs)  # a regressor's columns are values
    classes = outputs.argmax(axis=1).tolist() if classify else None
    if as_json:
        found = {"predictions": classes} if classes is not None else {"outputs": json_values(outputs)}
        typer.echo(json.dumps({"version": answer.version, **found, "shape": outputs.shape}))
        return
    shown = classes if classes is not None else np.array2string(outputs, precision=6, threshold=64)
    typer.echo(f"model {answer.version}: {shown}")


def _print_status(config, timeout: float, as_json: bool) -> None:
    """Collect the retained status of every device of the fleet for a moment and print it."""
    from fedge.transport.connection import MqttConnection
    from fedge.transport.topics import Topics

    found: dict[str, dict] = {}
    connection = MqttConnection(config, f"infer-status-{time.time_ns() % 10**9}")
    connection.route(
        Topics(config.fleet).all_infer_status, lambda topic, payload: _collect(found, topic, payload)
    )
    try:
        connection.start()
        time.sleep(min(timeout, 1.0))  # retained messages arrive right after SUBACK; give them a moment
    except ConnectionError as err:
        raise fail(str(err)) from None
    finally:
        connection.close()
    if as_json:
        typer.echo(json.dumps(found))
        return
    if not found:
        typer.echo("no inference device has reported")
    for name, info in sorted(found.items()):
        if not info.get("online"):
            typer.echo(f"{name:<20} offline")
            continue
        lat = info.get("latency_ms", {})
        threads = info.get("threads", 0)
        served = f"{info.get('variant') or 'fp32'}, {threads} thread{'s' if threads != 1 else ''}"
        typer.echo(
            f"{name:<20} model {info.get('version') or '-':<10} ({served})  p50 {lat.get('p50', 0):.2f} ms  "
            f"p95 {lat.get('p95', 0):.2f} ms  p99 {lat.get('p99', 0):.2f} ms  "
            f"requests {info.get('requests', 0)}  swaps {info.get('swaps', 0)}"
        )


def _collect(found: dict[str, dict], topic: str, payload: bytes) -> None:
    try:
        info = json.loads(payload)
    except ValueError:
        return
    if isinstance(info, dict):
        found[topic.split("/")[-2]] = info
