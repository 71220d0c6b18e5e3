"""Thread priorities: a device's model work yields the CPU to its requests.

Receiving a model (MQTT chunks), checking it, building and warming its session and freeing the old one
are a few milliseconds of CPU now and then; a request waits for a core while they run, and a small device
has two. On Linux a thread's nice value is its own, and a thread it starts inherits it. So the inference
agent starts the threads that do model work (the model connection's network thread, the artifact
subscribers' workers) from a short-lived thread that lowered its own priority first: the scheduler then
lets a request's threads run as soon as they wake. The serving threads keep their priority.

ONNX Runtime creates a session's intra-op threads on the thread that builds the session, and they too
inherit its priority: :class:`~fedge.inference.serving.ModelServer` therefore builds sessions on a thread
of its own, started at the priority of the thread that created the server.

An unprivileged process may raise its nice value but never lower it again, hence threads started already
lowered rather than a thread that lowers itself for a while. Where the OS does not allow it (no per-thread
nice, a sandbox that forbids it) nothing changes and the agent runs as before.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["MAX_NICE", "lower_this_thread", "start_at_lower_priority", "thread_nice"]

log = logging.getLogger(__name__)

MAX_NICE = 19


def thread_nice() -> int | None:
    """The calling thread's nice value, or None where threads have none of their own (not Linux)."""
    if not sys.platform.startswith("linux"):  # elsewhere PRIO_PROCESS takes a process id, not a thread's
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


def lower_this_thread(nice: int) -> bool:
    """Raise the calling thread's nice value to ``nice`` (never lowers it); whether it now is at least that.

    On Linux ``setpriority(PRIO_PROCESS, tid)`` applies to one thread, not the whole process.
    """
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice must be in 0..{MAX_NICE}, got {nice}")
    current = thread_nice()
    if current is None:
        return False
    if current >= nice:
        return True
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as err:
        log.debug("cannot lower this thread's priority to nice %d: %s", nice, err)
        return False
    return thread_nice() == nice


def start_at_lower_priority(
    nice: int, start: Callable[[], None], *, name: str = "fedge-low-priority"
) -> bool:
    """Call ``start`` on a short-lived thread whose nice value was raised to ``nice`` first.

    Threads ``start`` creates inherit that priority and keep it after it returns. Whatever ``start``
    raises is raised here. Returns whether the priority was lowered (``start`` runs either way).
    """
    outcome: dict[str, object] = {}

    def run() -> None:
        outcome["lowered"] = lower_this_thread(nice) if nice > 0 else False
        try:
            start()
        except BaseException as err:  # re-raised on the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    error = outcome.get("error")
    if isinstance(error, BaseException):
        raise error
    return bool(outcome.get("lowered"))
