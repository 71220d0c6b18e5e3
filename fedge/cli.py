"""The ``fedge`` command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

app = typer.Typer(
    name="fedge",
    help="Federated and edge learning for constrained devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


@app.callback()
def _root() -> None:
    """Federated and edge learning for constrained devices."""


def fail(message: str) -> typer.Exit:
    """Print one line naming the problem to stderr and return the exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@app.command()
def bench(
    name: str = typer.Argument(..., help="Benchmark name, e.g. 'engines' (see bench/)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object as the last stdout line."),
    quick: bool = typer.Option(False, "--quick", help="A smaller run that finishes in under a minute."),
) -> None:
    """Run a benchmark from bench/ and compare it with its baseline."""
    available = sorted(p.stem for p in _BENCH_DIR.glob("[!_]*.py"))
    if name not in available:
        raise fail(f"unknown bench {name!r}; available: {', '.join(available) or 'none'}")
    args = [sys.executable, str(_BENCH_DIR / f"{name}.py")]
    args += ["--json"] if json_out else []
    args += ["--quick"] if quick else []
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    raise typer.Exit(code=subprocess.call(args, env=env))


def main() -> None:
    """Entry point for ``python -m fedge``."""
    app()


if __name__ == "__main__":
    main()
