"""Thread priorities: model work is started lowered, sessions keep the priority of their server's creator."""

import os
import threading

import numpy as np
import pytest

from fedge.inference import ModelServer, read_manifest
from fedge.inference.priority import lower_this_thread, start_at_lower_priority, thread_nice

pytestmark = pytest.mark.skipif(thread_nice() is None, reason="no per-thread nice values here")


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def test_threads_started_lowered_inherit_the_priority_and_the_caller_keeps_its_own():
    base = thread_nice()
    seen: dict[str, int] = {}
    release = threading.Event()
    children: list[threading.Thread] = []

    def start() -> None:
        def child() -> None:
            seen["child"] = thread_nice()
            release.wait(10)

        thread = threading.Thread(target=child)
        thread.start()
        children.append(thread)

    lowered = start_at_lower_priority(min(19, base + 5), start)
    release.set()
    children[0].join()
    if not lowered:
        pytest.skip("this sandbox forbids raising a thread's nice value")
    assert seen["child"] == min(19, base + 5)  # the thread it started runs lowered after start returned
    assert thread_nice() == base  # the caller is untouched


def test_errors_of_start_reach_the_caller_and_nice_zero_changes_nothing():
    def boom() -> None:
        raise ConnectionError("broker unreachable")

    with pytest.raises(ConnectionError, match="broker unreachable"):
        start_at_lower_priority(5, boom)
    seen = []
    assert start_at_lower_priority(0, lambda: seen.append(thread_nice())) is False
    assert seen == [thread_nice()]
    with pytest.raises(ValueError, match="nice"):
        lower_this_thread(20)


def test_a_swap_from_a_lowered_thread_serves_on_threads_of_the_servers_priority(variants):
    """ORT starts a session's intra-op threads on the thread that builds it: the server builds on its own
    thread, so a model installed by lowered model work does not serve on lowered threads."""
    path = variants["fp32"][0]
    data, manifest = path.read_bytes(), read_manifest(path)
    server = ModelServer()  # two intra-op threads on this machine: one pool thread per session
    if server.config.threads() < 2:
        pytest.skip("one CPU: sessions start no pool threads")
    base = thread_nice()
    result: list = []
    before = _tids()

    def install() -> None:
        result.append(server.swap(data, manifest, version="v1"))
        result.append(_tids() - before - {threading.get_native_id()})  # the threads the swap started

    if not start_at_lower_priority(min(19, base + 7), install):
        pytest.skip("this sandbox forbids raising a thread's nice value")
    swap, new = result
    assert swap.ok
    assert new, "the session started no thread"
    alive = new & _tids()
    assert alive, "the session's threads are gone"
    assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in alive}  # the kernel's figure == {base}
    assert server.predict(np.zeros((1, 1, 8, 8), np.float32)).shape == (1, 10)
