"""Waiting on a condition with a deadline, for tests that watch state other threads or processes change.

Tests must hold on a loaded machine, so they never wait a fixed time for something to happen: they re-check
the condition until it holds or the deadline passes (and fail at once if a process they depend on exited).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    condition: Callable[[], object],
    timeout: float = 30.0,
    *,
    process: subprocess.Popen | None = None,
    what: str = "condition",
) -> None:
    """Return once ``condition()`` is true; fail after ``timeout`` s, or as soon as ``process`` has exited."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: a re-check interval that never outlasts the deadline
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what} not met: process {process.pid} exited with {process.returncode}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{what} not met within {timeout:g} s")
        pause.wait(min(0.01, remaining))
