"""The local engine's worker processes: a worker that dies fails only its own call."""

import os
import signal
import time

import pytest

from fedge.simulation.workers import WorkerDied, WorkerPool


def _call(payload: bytes, context: bytes, shared: bytes | None = None) -> tuple[bytes, bytes]:
    """Echo reversed, reply with this worker's pid; b"exit" and b"kill" end the worker mid-call."""
    if payload == b"exit":
        os._exit(7)
    if payload == b"kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if payload.startswith(b"sleep"):
        time.sleep(float(payload[5:]))
    return [payload[::-1]], str(os.getpid()).encode() + context


def _reply(future) -> bytes:
    """A call's reply frames, joined."""
    return b"".join(future.result()[0])


@pytest.fixture
def pool():
    workers = WorkerPool(_call, size=2)
    yield workers
    workers.shutdown()


def test_calls_run_in_worker_processes_and_return_their_results(pool):
    futures = [pool.submit(f"m{i}".encode(), b"") for i in range(20)]
    pool.wait(futures)
    assert [_reply(f) for f in futures] == [f"m{i}".encode()[::-1] for i in range(20)]
    pids = {int(f.result()[1]) for f in futures}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_a_result_carries_the_seconds_its_call_ran_in_the_worker(pool):
    """Measured in the worker, so neither the wait in the queue nor the reading of the reply is in it."""
    quick, slow = pool.submit(b"m", b""), pool.submit(b"sleep0.3", b"")
    pool.wait([quick, slow])
    assert slow.result().seconds >= 0.3 > quick.result().seconds >= 0


@pytest.mark.parametrize(("payload", "cause"), [(b"exit", "exit code 7"), (b"kill", "killed by signal 9")])
def test_a_dying_worker_fails_only_its_own_call_and_is_replaced(pool, payload, cause):
    futures = [pool.submit(p, b"") for p in (b"a", b"b", payload, b"c", b"d", b"e")]
    pool.wait(futures)
    with pytest.raises(WorkerDied, match=cause):
        futures[2].result()
    assert [_reply(f) for i, f in enumerate(futures) if i != 2] == [b"a", b"b", b"c", b"d", b"e"]
    again = [pool.submit(b"x", b"") for _ in range(4)]
    pool.wait(again)
    assert all(_reply(f) == b"x" for f in again)


def test_a_worker_that_died_while_idle_costs_no_call(pool):
    first = pool.submit(b"a", b"")
    pool.wait([first])
    os.kill(int(first.result()[1]), signal.SIGKILL)
    time.sleep(0.2)
    later = [pool.submit(b"b", b"") for _ in range(4)]
    pool.wait(later)
    assert all(_reply(f) == b"b" for f in later)


def _shared(payload: bytes, context: bytes, shared: bytes | None) -> tuple[bytes, bytes]:
    """Reply with the shared blob and which object it is in this worker (the same object until a new
    blob arrives); b"kill" ends the worker mid-call."""
    if payload == b"kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return [shared or b"-"], f"{os.getpid()}:{id(shared)}".encode()


def test_a_shared_blob_reaches_each_worker_once_and_every_call_that_names_it():
    pool = WorkerPool(_shared, size=2)
    try:
        first = [pool.submit(b"", b"", ("round-1", b"A" * 100_000)) for _ in range(12)]
        pool.wait(first)
        assert all(_reply(f) == b"A" * 100_000 for f in first)
        # one blob object per worker: it crossed once, and later calls used the copy the worker held
        by_worker: dict[bytes, set[bytes]] = {}
        for f in first:
            pid, blob = f.result()[1].split(b":")
            by_worker.setdefault(pid, set()).add(blob)
        assert all(len(blobs) == 1 for blobs in by_worker.values())
        mixed = [pool.submit(b"", b"", ("round-2", b"B")), pool.submit(b"", b""), pool.submit(b"", b"", None)]
        mixed += [pool.submit(b"", b"", ("round-2", b"B")) for _ in range(4)]
        pool.wait(mixed)
        assert [_reply(f) for f in mixed] == [b"B", b"-", b"-", b"B", b"B", b"B", b"B"]
        # a worker that dies mid-call is replaced, and its successor is sent the blob afresh
        dead = pool.submit(b"kill", b"", ("round-2", b"B"))
        pool.wait([dead])
        after = [pool.submit(b"", b"", ("round-2", b"B")) for _ in range(4)]
        pool.wait(after)
        assert all(_reply(f) == b"B" for f in after)
    finally:
        pool.shutdown()


def test_wait_returns_at_its_timeout_and_shutdown_finishes_queued_calls():
    pool = WorkerPool(_call, size=1)
    slow, queued = pool.submit(b"sleep0.5", b""), pool.submit(b"q", b"")
    started = time.monotonic()
    pool.wait([slow, queued], timeout=0.1)
    assert time.monotonic() - started < 0.4 and not queued.done()
    pool.shutdown()
    assert _reply(queued) == b"q" and slow.done()


def test_polling_without_a_timeout_makes_progress(pool):
    futures = [pool.submit(b"p", b"") for _ in range(6)]
    deadline = time.monotonic() + 10
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        pool.wait(futures, timeout=0)
        time.sleep(0.01)
    assert all(_reply(f) == b"p" for f in futures)


def test_cancel_drops_queued_calls_and_stops_running_ones():
    pool = WorkerPool(_call, size=1)
    try:
        running, queued = pool.submit(b"sleep30", b""), pool.submit(b"q", b"")
        pool.wait([running], timeout=0.2)
        pool.cancel([running, queued])
        assert queued.cancelled()
        with pytest.raises(WorkerDied, match="past its deadline"):
            running.result(timeout=0)
        after = pool.submit(b"z", b"")
        pool.wait([after], timeout=10)
        assert _reply(after) == b"z"
    finally:
        pool.shutdown()


def _collect(payload: bytes, context: bytes, shared: bytes | None) -> tuple[bytes, bytes]:
    import gc

    return [str(gc.collect()).encode()], b""


class _Finalized:
    """Garbage whose finalizer says which process ran it (like an ONNX Runtime session's destructor)."""

    def __init__(self, record: str) -> None:
        self.record, self.cycle = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as out:
            out.write(f"{os.getpid()}\n")


def test_a_worker_never_collects_the_parents_garbage(tmp_path):
    """Garbage this process holds must be finalized here, never in a forked worker: an ONNX Runtime session's
    destructor there waits for thread-pool threads that exist only here (a worker hung in
    pthread_cond_destroy)."""
    import gc

    record = tmp_path / "finalized"
    gc.disable()  # keep the garbage alive until the pool forks
    try:
        _Finalized(str(record))  # a reference cycle: only the collector frees it
        pool = WorkerPool(_collect, size=1)
        try:
            future = pool.submit(b"", b"")
            pool.wait([future], timeout=60)
            assert future.done()
        finally:
            pool.shutdown(cancel=True)
    finally:
        gc.enable()
        gc.collect()
    assert record.read_text().split() == [str(os.getpid())]


def test_a_call_waiting_behind_one_that_kills_its_worker_runs_on_the_next_worker():
    """A busy worker is sent its next call early; if the running call kills it, that next call has not begun,
    so it runs on the replacement instead of failing with it."""
    pool = WorkerPool(_call, size=1)
    try:
        futures = [pool.submit(p, b"") for p in (b"kill", b"x", b"y", b"z")]
        assert len(pool._workers[0].jobs) == 2  # the killer and the call sent behind it
        pool.wait(futures, timeout=60)
        with pytest.raises(WorkerDied, match="killed by signal 9"):
            futures[0].result()
        assert [_reply(f) for f in futures[1:]] == [b"x", b"y", b"z"]
    finally:
        pool.shutdown()


def test_cancelling_a_call_sent_behind_a_running_one_drops_its_reply():
    pool = WorkerPool(_call, size=1)
    try:
        running, behind, last = (pool.submit(p, b"") for p in (b"sleep0.3", b"q", b"r"))
        assert [j.future for j in pool._workers[0].jobs] == [running, behind]
        pool.cancel([behind])
        pool.wait([running, last], timeout=60)
        assert behind.cancelled() and _reply(running) == b"3.0peels" and _reply(last) == b"r"
    finally:
        pool.shutdown()


def test_large_calls_are_not_sent_early_and_large_replies_do_not_block_the_pool():
    """Calls too big to wait in a pipe go to a worker only when it is free (a write to a computing worker
    would block this process while the other worker waits to hand in its reply), and replies bigger than a
    pipe still arrive."""
    pool = WorkerPool(_shared, size=2)
    big = b"B" * (4 << 20)
    try:
        futures = [pool.submit(b"", b"", (f"blob-{i}", big)) for i in range(8)]
        assert all(len(w.jobs) == 1 for w in pool._workers)
        pool.wait(futures, timeout=120)
        assert all(_reply(f) == big for f in futures)
    finally:
        pool.shutdown()


def _frames(payload: bytes, context: bytes, shared: bytes | None) -> tuple[list, bytes]:
    """Reply with frames of the sizes the payload lists (a frame larger than the pipe arrives in pieces)."""
    sizes = [int(size) for size in payload.split(b",")]
    return [bytes([i % 256]) * size for i, size in enumerate(sizes)], context


def test_a_reply_of_many_frames_arrives_whole_and_in_order():
    pool = WorkerPool(_frames, size=2)
    try:
        shapes = [b"0", b"5,300000", b"1,3000000,17,0", b"70000,70000,70000"]
        futures = [pool.submit(shape, b"ctx%d" % i) for i, shape in enumerate(shapes * 3)]
        pool.wait(futures)
        for i, future in enumerate(futures):
            frames, context, _ = future.result()
            sizes = [int(size) for size in shapes[i % len(shapes)].split(b",")]
            assert [len(frame) for frame in frames] == sizes and context == b"ctx%d" % i
            assert all(frame == bytes([j % 256]) * len(frame) for j, frame in enumerate(frames))
            assert all(type(frame) is bytes for frame in frames)
    finally:
        pool.shutdown()
