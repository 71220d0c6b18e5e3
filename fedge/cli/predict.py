"""``fedge predict``: run an ONNX model on a file of inputs with ONNX Runtime (torch-free).

Registered in :mod:`fedge.cli` as ``app.command("predict")(predict)``. Heavy modules load inside the command.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer

from fedge.cli.common import check_out_dir, config_errors, fail, json_values, non_finite_rows

__all__ = ["predict"]


def predict(
    model: Path = typer.Option(
        ..., "--model", help="The .onnx file (its manifest, model.onnx.json, is checked)."
    ),
    input_file: Path = typer.Option(
        ..., "--input", help="Inputs: .npy (batch first), .csv (one row per line) or .npz (by input name)."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Also write predictions here (.csv or .npy; .npz for a model of several outputs)."
    ),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Rows per inference call."),
    threads: int = typer.Option(
        0, "--threads", min=0, max=256, help="Intra-op threads (0: the CPUs available)."
    ),
    no_arena: bool = typer.Option(False, "--no-arena", help="Turn ORT's memory arena off (less memory)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of lines."),
    raw: bool = typer.Option(
        False,
        "--raw",
        help="Report the model's outputs as they are, not classes (automatic for outputs "
        "that are not (rows, classes), and for a model whose manifest says its outputs are values).",
    ),
) -> None:
    """Print the predicted class of every input row (or its outputs), the model version and p50/p95/p99
    latency."""
    import numpy as np

    from fedge.inference import (
        InputError,
        ModelServer,
        SessionConfig,
        fit_to_shape,
        read_inputs,
        write_predictions,
    )
    from fedge.inference.feeds import feed_rows
    from fedge.inference.io import is_class_scores, read_named_inputs, write_outputs

    if not model.is_file():
        raise fail(f"model file {model} {'is a directory' if model.is_dir() else 'does not exist'}")
    if model.suffix == ".json":  # models/latest.json or a manifest: they name the file to give
        raise fail(f"--model {model} is JSON: give the .onnx file (models/latest.json names the latest one)")
    if out is not None and (out.suffix not in (".csv", ".npy", ".npz") or out.is_dir()):
        raise fail(f"--out {out} must be a .csv, .npy or .npz file")
    if out is not None and out.resolve() in (input_file.resolve(), model.resolve()):
        raise fail(f"--out {out} is the input or model file itself: it would be overwritten")
    if out is not None:  # before any work: a place it cannot write fails in one line, not after the rows
        with config_errors():
            check_out_dir(out.parent, what=f"--out {out}: {out.parent}")
    # The server logs a refused model for a service's operator; here the one line below says it.
    logging.getLogger("fedge.inference.serving").setLevel(logging.ERROR)
    server = ModelServer(SessionConfig(intra_op_threads=threads, memory_arena=not no_arena))
    loaded = server.load(model)
    if not loaded.ok:
        raise fail(f"cannot serve {model}: {loaded.message}")
    session = server.current.session
    inputs, output_names = session.get_inputs(), [o.name for o in session.get_outputs()]
    if len(inputs) > 1 and input_file.suffix != ".npz":
        names = ", ".join(i.name for i in inputs)
        raise fail(f"the model takes {len(inputs)} inputs ({names}): give them by name in an .npz file")
    try:
        if input_file.suffix == ".npz":  # a model of several inputs: arrays by input name
            rows = read_named_inputs(input_file)
            takes = [i.name for i in inputs]
            if not set(takes) <= set(rows):  # more is fine: an exporter drops an input the model never reads
                raise InputError(f"the model takes inputs {takes}; {input_file} holds {sorted(rows)}")
            rows = {i.name: fit_to_shape(rows[i.name], i.shape) for i in inputs}
        else:
            rows = {inputs[0].name: fit_to_shape(read_inputs(input_file), inputs[0].shape)}
        count = len(next(iter(rows.values())))
        if not count:  # as an empty .csv: nothing to predict is a mistake, not a run
            raise InputError(f"{input_file} holds no rows")
    except InputError as err:
        raise fail(str(err)) from None
    server.reset_stats()  # warm-up runs are not requests
    batches: dict[str, list[np.ndarray]] = {name: [] for name in output_names}
    try:
        for i in range(0, count, batch_size):
            for name, value in server.run_named(feed_rows(rows, i, i + batch_size))[0].items():
                batches[name].append(value)
    except Exception as err:  # ORT's errors name the bad input (shape, dtype)
        raise fail(f"inference failed: {type(err).__name__}: {err}") from None
    empty = np.empty((0, 0), np.float32)
    named = {name: np.concatenate(parts) if parts else empty for name, parts in batches.items()}
    broken = non_finite_rows(named.values(), count)
    if broken:  # NaN in, NaN out: argmax would call every such row class 0
        typer.echo(f"warning: {broken} of {count} rows have NaN or infinite outputs", err=True)
    if len(named) > 1:  # every output by name, as they are
        _report_named(named, out, as_json, server.stats())
        return
    outputs = named[output_names[0]]
    manifest = server.current.manifest
    values = manifest is not None and manifest.extra.get("outputs") == "values"  # a regressor's, say
    classify = not raw and not values and is_class_scores(outputs)
    predictions = outputs.argmax(axis=1) if classify else outputs
    if out is not None and out.suffix == ".npz":
        np.savez(out, **named)
    elif out is not None:
        if classify:
            write_predictions(out, predictions, outputs.max(axis=1))
        else:
            write_outputs(out, outputs)
    stats = server.stats()
    summary = {
        "version": stats.version,
        "rows": len(outputs),
        "p50_ms": stats.p50_ms,
        "p95_ms": stats.p95_ms,
        "p99_ms": stats.p99_ms,
        "threads": server.config.threads(),
    }
    if as_json:
        key = "predictions" if classify else "outputs"
        listed = json_values(predictions)
        typer.echo(json.dumps({**summary, key: listed, "output_shape": list(outputs.shape)}, allow_nan=False))
        return
    for i, row in enumerate(predictions):
        typer.echo(f"{i}\t{row if classify else np.array2string(np.asarray(row), precision=6)}")
    typer.echo(
        f"model {stats.version}: {len(outputs)} rows in {stats.count} calls, latency per call "
        f"p50 {stats.p50_ms:.3f} ms, p95 {stats.p95_ms:.3f} ms, p99 {stats.p99_ms:.3f} ms",
        err=True,
    )


def _report_named(named: dict, out: Path | None, as_json: bool, stats: Any) -> None:
    """A model of several outputs: each by name (to ``out`` as an .npz), with the version and latency."""
    import numpy as np

    if out is not None:
        if out.suffix != ".npz":
            raise fail(f"the model has {len(named)} outputs ({', '.join(named)}): write them to an .npz")
        np.savez(out, **named)
    rows = len(next(iter(named.values())))
    if as_json:
        shapes = {name: list(value.shape) for name, value in named.items()}
        listed = {name: json_values(value) for name, value in named.items()}
        latency = {"p50_ms": stats.p50_ms, "p95_ms": stats.p95_ms, "p99_ms": stats.p99_ms}
        typer.echo(
            json.dumps(
                {
                    "version": stats.version,
                    "rows": rows,
                    **latency,
                    "outputs": listed,
                    "output_shapes": shapes,
                },
                allow_nan=False,
            )
        )
        return
    for name, value in named.items():
        typer.echo(f"{name}: {np.array2string(value, precision=6, threshold=64)}")
    typer.echo(
        f"model {stats.version}: {rows} rows, {len(named)} outputs, latency per call "
        f"p50 {stats.p50_ms:.3f} ms, p95 {stats.p95_ms:.3f} ms, p99 {stats.p99_ms:.3f} ms",
        err=True,
    )
