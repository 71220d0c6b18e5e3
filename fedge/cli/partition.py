"""``fedge partition plan|export|run``: partition a model over a fleet, export its stages, run them.

``--model MODULE:FACTORY`` names a function (in an importable module or a ``path/to/file.py``) that takes no
arguments and returns ``(model, example_input)``: a torch ``nn.Module`` and a tensor (or tuple of tensors)
with the batch first; the batch dimension is made symbolic on export. ``--devices`` is a fleet TOML file
(see :mod:`fedge.partitioning.fleet`). Register with::

    partition = typer.Typer(help="Partition a model across devices.")
    partition.command("plan")(partition_plan)
    partition.command("export")(partition_export)
    partition.command("run")(partition_run)
    app.add_typer(partition, name="partition")

(or ``app.add_typer(partition_app, name="partition")``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from fedge.cli.common import check_out_dir, config_errors, fail
from fedge.config import error_line

__all__ = ["partition_app", "partition_export", "partition_plan", "partition_run"]

_MODEL = typer.Option(
    ..., "--model", help="MODULE:FACTORY or path/to/file.py:FACTORY returning (model, input)."
)
_DEVICES = typer.Option(..., "--devices", help="Fleet TOML file ([[device]] tables).")
_OBJECTIVE = typer.Option(
    "throughput", "--objective", help="'throughput' (pipeline) or 'latency' (one batch)."
)
_BATCH = typer.Option(1, "--batch", min=1, max=65536, help="Examples per batch to plan for.")
_MAX_FEED_BYTES = 1 << 30  # the example batch is built, calibrated on and saved: keep it to 1 GiB
_BOUNDARY = typer.Option("fp32", "--boundary", help="Encoding between stages: fp32, fp16 or int8.")
_OUT = typer.Option(Path("runs/partition"), "--out", help="Directory for plan.json, plan.png, stages.")
_CALIBRATE = typer.Option(False, "--calibrate", help="Time ONNX Runtime on this host for node costs.")
_HOST_FLOPS = typer.Option(1e11, "--host-flops", help="flops_per_s this host stands for (with --calibrate).")


def _load_model(spec: str) -> tuple[Any, Any]:
    from fedge.importing import import_attribute

    factory = import_attribute(spec, "--model")
    if factory is None or not callable(factory):
        raise ValueError(f"--model {spec!r} names no callable factory")
    try:
        made = factory()
    except Exception as err:  # the user's factory: its failure is one line naming it
        raise ValueError(f"--model {spec!r} raised {type(err).__name__}: {error_line(err)}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise ValueError(f"--model {spec!r} must return (model, example_input)")
    return made


def _captured(model: str) -> tuple[Any, Any, dict]:
    """The ``--model`` factory's model exported and read (:func:`fedge.partitioning.onnx_graph.capture`);
    ValueError in one line when it cannot be."""
    from fedge.partitioning.onnx_graph import capture

    torch_model, example = _load_model(model)
    try:
        return capture(torch_model, example)
    except Exception as err:  # not a torch module, an input it cannot take, an op ONNX lacks, ...
        raise ValueError(
            f"--model {model!r}: cannot capture its graph: {type(err).__name__}: {error_line(err)}"
        ) from None


def _planned(
    model: str, devices: str, objective: str, batch: int, boundary: str, calibrate: bool, host_flops: float
) -> tuple[Any, Any, Any, Any]:
    import numpy as np

    from fedge.partitioning import CostModel, load_fleet, plan
    from fedge.partitioning.calibrate import calibrate as run_calibration

    if calibrate and not (math.isfinite(host_flops) and host_flops > 0):
        raise ValueError(f"--host-flops must be a positive number, got {host_flops}")
    fleet = load_fleet(devices)
    onnx_model, graph, feeds = _captured(model)
    feed_bytes = batch * sum(v[:1].nbytes for v in feeds.values())
    if feed_bytes > _MAX_FEED_BYTES:
        raise ValueError(
            f"--batch {batch} makes an example batch of {feed_bytes / 2**30:.1f} GiB (at most 1 GiB)"
        )
    feeds = {k: np.concatenate([v[:1]] * batch) for k, v in feeds.items()}
    cal = run_calibration(onnx_model, graph, feeds, host_flops_per_s=host_flops) if calibrate else None
    cost = CostModel(graph, fleet, batch=batch, boundary=boundary, calibration=cal)
    result = plan(cost, objective)
    if not result.feasible:
        raise ValueError(
            "no partition is feasible on these devices (their memory, or a stage no device or link can carry)"
        )
    return onnx_model, graph, feeds, result


def partition_plan(
    model: str = _MODEL,
    devices: str = _DEVICES,
    objective: str = _OBJECTIVE,
    batch: int = _BATCH,
    boundary: str = _BOUNDARY,
    out: Path = _OUT,
    calibrate: bool = _CALIBRATE,
    host_flops: float = _HOST_FLOPS,
) -> None:
    """Plan the partition: print the stage table, write plan.json and plan.png."""
    from fedge.atomic import write_bytes_atomic
    from fedge.partitioning.plot import plot_plan

    with config_errors():
        check_out_dir(out)
        _, _, _, result = _planned(model, devices, objective, batch, boundary, calibrate, host_flops)
    typer.echo(result.explain())
    write_bytes_atomic(out / "plan.json", json.dumps(result.to_json(), indent=1).encode())
    plot_plan(result, out / "plan.png")
    typer.echo(f"plan: {out / 'plan.json'}\npicture: {out / 'plan.png'}")


def partition_export(
    model: str = _MODEL,
    devices: str = _DEVICES,
    objective: str = _OBJECTIVE,
    batch: int = _BATCH,
    boundary: str = _BOUNDARY,
    out: Path = _OUT,
    calibrate: bool = _CALIBRATE,
    host_flops: float = _HOST_FLOPS,
) -> None:
    """Plan, then write one ONNX file per stage, manifest.json, the full model and an example input."""
    import numpy as np

    from fedge.atomic import write_bytes_atomic
    from fedge.partitioning.plot import plot_plan
    from fedge.partitioning.stages import export_stages

    with config_errors():
        check_out_dir(out)
        onnx_model, graph, feeds, result = _planned(
            model, devices, objective, batch, boundary, calibrate, host_flops
        )
    typer.echo(result.explain())
    try:
        artefacts, written = export_stages(onnx_model, graph, result, out)
    except Exception as err:  # an ONNX check of a stage, a disk that refuses the files
        raise fail(f"cannot export the stages to {out}: {type(err).__name__}: {error_line(err)}") from None
    write_bytes_atomic(out / "model.onnx", onnx_model.SerializeToString())
    np.savez(out / "example_input.npz", **feeds)
    plot_plan(result, out / "plan.png")
    typer.echo(f"{len(artefacts)} stages ({written} written, {len(artefacts) - written} reused) in {out}")


def partition_run(
    out: Path = _OUT,
    micro_batch: int = typer.Option(
        0, "--micro-batch", min=0, help="Examples per micro-batch (0: whole batch)."
    ),
    repeat: int = typer.Option(
        8, "--repeat", min=1, help="Copies of the example input batch to push through."
    ),
    broker: str = typer.Option(
        "",
        "--broker",
        help="Run on `fedge serve` stage agents over this MQTT 5 broker (with --model, --devices).",
    ),
    fleet: str = typer.Option("default", "--fleet", help="The agents' fleet (with --broker)."),
    model: str = typer.Option("", "--model", help="MODULE:FACTORY (with --broker)."),
    devices: str = typer.Option(
        "", "--devices", help="Fleet TOML whose device names are the agents' node ids."
    ),
    objective: str = _OBJECTIVE,
) -> None:
    """Run exported stages locally (pipelined micro-batches), or place and run them on MQTT stage agents, and
    compare with the full model."""
    import numpy as np

    from fedge.partitioning.runtime import OrtExecutor
    from fedge.partitioning.stages import load_runner

    if broker:
        _run_over_mqtt(out, micro_batch, repeat, broker, fleet, model, devices, objective)
        return
    if not (out / "manifest.json").exists():
        raise fail(f"no manifest.json in {out}: run 'fedge partition export' first")
    try:  # anything wrong with the directory's files (edited, truncated, mixed up) is one line
        runner = load_runner(out)
        with np.load(out / "example_input.npz", allow_pickle=False) as data:
            feeds = _varied({k: data[k] for k in data.files}, repeat)
        outputs = runner.run(feeds, micro_batch or None)
        full = OrtExecutor(str(out / "model.onnx")).run(feeds)
        diff = _max_difference(outputs, full)
    except Exception as err:  # json, KeyError, TypeError, OSError, ONNX Runtime's errors, ...
        raise fail(f"cannot run the stages in {out}: {type(err).__name__}: {error_line(err)}") from None
    if not math.isfinite(diff):
        raise fail(
            f"the chained stages give non-finite outputs where the full model does not (max |chained - full| "
            f"= {diff}): a boundary encoding cannot hold the values crossing a cut?"
        )
    typer.echo(
        f"{len(runner.executors)} stages, {len(next(iter(feeds.values())))} examples in "
        f"{runner.stats.wall_s:.3f} s; "
        f"max |chained - full| = {diff:.3g}; bytes per link: {runner.stats.link_bytes}"
    )


def _varied(feeds: dict[str, Any], repeat: int) -> dict[str, Any]:
    """``repeat`` copies of the example batch, the floating inputs of every copy after the first moved by a
    little noise: with every row alike, a pipeline mixing rows between examples (a micro-batch joined in the
    wrong order, a statistic over the batch) would still match the full model. Integer and boolean inputs
    (token ids, masks) are repeated as they are."""
    import numpy as np

    rng = np.random.default_rng(0)
    varied = {}
    for name, values in feeds.items():
        copies = [values]
        for _ in range(repeat - 1):
            if values.dtype.kind == "f" and values.size:
                spread = float(np.nanstd(values)) or 1.0
                noise = rng.standard_normal(values.shape) * (0.1 * spread)
                copies.append((values + noise).astype(values.dtype))
            else:
                copies.append(values)
        varied[name] = np.concatenate(copies)
    return varied


def _max_difference(outputs: dict[str, Any], full: dict[str, Any]) -> float:
    """The largest ``|chained - full|`` over the outputs; NaN where both are NaN counts as equal, a
    non-finite value where the other is finite as ``inf``."""
    import numpy as np

    largest = 0.0
    for name, chained in outputs.items():
        a, b = np.asarray(chained, np.float64), np.asarray(full[name], np.float64)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        gap = np.where(same, 0.0, np.abs(a - b))
        largest = max(largest, float(np.nan_to_num(gap, nan=np.inf).max(initial=0.0)))
    return largest


def _run_over_mqtt(
    out: Path,
    micro_batch: int,
    repeat: int,
    broker: str,
    fleet: str,
    model: str,
    devices: str,
    objective: str,
) -> None:
    """Plan over the fleet's online agents, deploy the stages to them, run the example input through."""
    import time

    from fedge.partitioning import CostModel, load_fleet
    from fedge.partitioning.mqtt_runtime import MqttPipeline
    from fedge.partitioning.runtime import OrtExecutor
    from fedge.protocol.fleet import validate_name
    from fedge.transport.config import MqttConfig

    if not (model and devices):
        raise fail("--broker needs --model and --devices")
    with config_errors():
        config = MqttConfig(broker_url=broker, fleet=fleet)
        fleet_spec = load_fleet(devices)
        for device in fleet_spec.devices:  # each is a stage agent's node id on the broker
            validate_name(device.name, "device name (a stage agent's node id)")
        onnx_model, graph, feeds = _captured(model)
    feeds = _varied(feeds, repeat)
    try:
        with MqttPipeline(
            onnx_model, graph, CostModel(graph, fleet_spec), config, out, objective=objective
        ) as pipe:
            pipe.dead |= {d.name for d in fleet_spec.devices} - pipe.wait_online(timeout_s=30)
            placed = pipe.deploy()
            typer.echo(placed.explain())
            start = time.perf_counter()
            outputs = pipe.run(feeds, micro_batch or None)
            wall = time.perf_counter() - start
            final = pipe.plan or placed  # a device lost mid-run: its stage was re-placed
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as err:  # ValueError: a micro-batch join
        raise fail(str(err)) from None
    full = OrtExecutor(onnx_model.SerializeToString()).run(feeds)
    diff = _max_difference(outputs, full)
    if final is not placed:
        typer.echo(f"re-placed during the run:\n{final.explain()}")
    typer.echo(
        f"{len(final.stages)} stages on {', '.join(s.device for s in final.stages)}: "
        f"{len(next(iter(feeds.values())))} examples in {wall:.3f} s; max |chained - full| = {diff:.3g}"
    )


partition_app = typer.Typer(help="Partition a model across devices.", no_args_is_help=True)
partition_app.command("plan")(partition_plan)
partition_app.command("export")(partition_export)
partition_app.command("run")(partition_run)
