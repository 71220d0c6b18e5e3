"""Shared plumbing for fedge benchmarks.

Every bench is a module ``fedge/bench/NAME.py`` run by ``fedge bench NAME [--json] [--quick]``. It measures
its subject and a baseline in the same process run, reports ratios (these machines are noisy), prints a
rich table for people and, last on stdout, one JSON object for machines.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

from fedge.atomic import strict_json

__all__ = ["emit", "parse_args", "peak_rss_bytes", "timed"]


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the two flags every bench takes: ``--json`` and ``--quick``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes in under a minute")
    return parser.parse_args(argv)


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """Measure wall and CPU seconds of a block: ``with timed() as t: ...; t["wall_s"]``."""
    out: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield out
    finally:
        out["wall_s"] = time.perf_counter() - wall
        out["cpu_s"] = time.process_time() - cpu


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def emit(
    result: dict[str, Any],
    *,
    as_json: bool,
    title: str,
    rows: list[dict[str, Any]] | None = None,
) -> None:
    """Show ``rows`` as a table (stderr when ``as_json``) and print ``result`` as the last stdout line."""
    console = Console(stderr=as_json)
    if rows:
        table = Table(title=title)
        for key in rows[0]:
            table.add_column(str(key))
        for row in rows:
            table.add_row(*(_fmt(row.get(key)) for key in rows[0]))
        console.print(table)
    headline = result.get("headline", {})
    if headline:
        console.print({k: _fmt(v) for k, v in headline.items()})
    sys.stdout.flush()
    if as_json:
        print(strict_json(result))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
