"""Forked worker processes for the local engine, one ClientApp call at a time each.

``concurrent.futures.ProcessPoolExecutor`` treats a worker that dies (a segfault in native code, the kernel's
OOM killer, ``os._exit`` in user code) as a broken pool: every call still queued or running fails with it,
and so would most of a round. :class:`WorkerPool` talks to each worker over its own pipe, so it knows which
call a dead worker was running: that call alone fails with :class:`WorkerDied`, and a fresh worker takes
the dead one's place. There are no background threads: the caller drives the pool through :meth:`wait`,
and workers are only ever forked from the calling thread.

A reply is a sequence of frames (a pickle stream and the large buffers it refers to out of band, say):
the worker writes them as they are, after a header of their lengths, in one ``writev`` (so this process
wakes once per reply), and each is read here straight into a ``bytes`` object of its own, so a model's
values are copied once on the way, by the kernel (``Connection.recv_bytes`` copies a message three times,
into fresh memory each time: for the digits CNN's 290 kB replies that was 0.3 ms of this process's CPU per
reply, taken from the cores the workers train on).

Calls may name a *shared* blob (the round's global model, the same for every client): each worker keeps
the last one it received, so the blob crosses to a worker once rather than with every call.

A busy worker is sent its next call before it finishes (when the call's frames are small enough to wait in
its pipe), and each direction is its own pipe, enlarged where the OS allows: a worker that finishes writes
its reply without waiting for this process to read it and starts on the next call at once (this process
shares the cores with the workers, so it is often slow to read). In ``fedge bench engines`` a worker's time
spent handing in replies fell from about 0.3 to 0.2 ms per call.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import os
import signal
import struct
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

try:
    import fcntl
except ImportError:  # not POSIX: pipes keep their default size
    fcntl = None  # type: ignore[assignment]

__all__ = ["CallResult", "WorkerDied", "WorkerPool"]

Frames = tuple[bytes, ...]
"""A reply as it arrives: its frames, in the order the call returned them."""


class CallResult(NamedTuple):
    """A finished call: its reply frames, the new context, and the seconds the call ran in its worker."""

    frames: Frames
    context: bytes
    seconds: float


Call = Callable[[bytes, bytes, bytes | None], tuple[Sequence[Any], bytes]]
"""What a worker runs: message, context and the call's shared blob (or None) in; the reply's frames (any
objects with the buffer protocol) and the new context out."""

Shared = tuple[Hashable, bytes]
"""A blob many calls share, and the key that names it (equal keys: equal blobs)."""

# The first frame of a call says what the worker's shared blob is for it.
_NO_SHARED, _SAME_SHARED, _NEW_SHARED = b"0", b"=", b"+"
_NOTHING = object()  # the shared key of a worker that holds no blob: equal to no caller's key

_DEPTH = 2  # calls a worker holds at once: the one it runs and the next, waiting in its pipe
_PIPE_BYTES = 1 << 20  # Linux's default cap for an unprivileged pipe (/proc/sys/fs/pipe-max-size)
_FRAME_OVERHEAD = 64  # bytes of framing per call beyond its frames' lengths (generous)
# a reply: its frame count and the call's seconds, then every frame's length (the context's last)
_HEAD = struct.Struct("!Id")
_LENGTH = struct.Struct("!Q")


@dataclass
class _Job:
    future: Future[CallResult]
    payload: bytes
    context: bytes
    shared: Shared | None


class WorkerDied(RuntimeError):
    """The worker process running a call exited before it replied."""


@dataclass
class _Worker:
    process: BaseProcess
    replies: Connection  # the worker's replies, read here
    calls: Connection  # its calls, written here
    capacity: int  # bytes the calls pipe holds before a write blocks
    jobs: collections.deque[_Job] = field(default_factory=collections.deque)  # sent, oldest (running) first
    shared_key: Hashable = _NOTHING  # the key of the shared blob the worker holds (after its sent calls)

    @property
    def running(self) -> _Job | None:
        """The call the worker runs now (the oldest it has not answered)."""
        return self.jobs[0] if self.jobs else None


class WorkerPool:
    """``size`` forked processes running ``call``; a worker that dies fails only the call it was running.

    Parameters
    ----------
    call : callable(bytes, bytes, bytes or None) -> (bytes, bytes)
        Run in the workers; inherited through fork, so it need not be picklable.
    size : int
        Worker processes (started on first use, replaced when one dies).
    initializer : callable, optional
        Run once in each new worker before its first call.
    """

    def __init__(self, call: Call, size: int, initializer: Callable[[], None] | None = None) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self._call, self._size, self._initializer = call, size, initializer
        self._context = multiprocessing.get_context("fork")
        self._workers: list[_Worker] = []
        # Workers exit when their pipe closes; close them before multiprocessing joins its children at exit.
        weakref.finalize(self, _close_pipes, self._workers)
        self._queue: collections.deque[_Job] = collections.deque()

    def submit(self, payload: bytes, context: bytes, shared: Shared | None = None) -> Future[CallResult]:
        """Queue one call; it starts when a worker is free (during :meth:`submit` or :meth:`wait`).

        ``shared`` is a ``(key, blob)`` many calls pass: a worker that last received ``key`` is not sent
        the blob again.
        """
        future: Future[CallResult] = Future()
        self._queue.append(_Job(future, payload, context, shared))
        self._dispatch()
        return future

    def wait(self, futures: Iterable[Future[Any]], timeout: float | None = None) -> None:
        """Run the pool until every one of ``futures`` is done or ``timeout`` seconds have passed.

        ``timeout=0`` collects whatever has finished (and starts queued calls) without blocking.
        """
        pending = [f for f in futures if not f.done()]
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._step(remaining)
            pending = [f for f in pending if not f.done()]
            if remaining == 0.0:
                return

    def cancel(self, futures: Iterable[Future[Any]]) -> None:
        """Stop calls: queued ones are dropped, running ones end with their worker (a new one takes over).

        A call already sent to a worker behind the one it runs is cancelled too; the worker still runs it
        and its reply is dropped.
        """
        targets = set(futures)
        for worker in [w for w in self._workers if w.running is not None and w.running.future in targets]:
            worker.process.kill()
            self._bury(worker, cause="stopped: it ran past its deadline")
        self._queue = collections.deque(
            j for j in self._queue if not (j.future in targets and j.future.cancel())
        )
        for worker in self._workers:
            for job in list(worker.jobs)[1:]:
                if job.future in targets:
                    job.future.cancel()

    def shutdown(self, *, cancel: bool = False) -> None:
        """Finish queued and running calls (``cancel``: drop them, killing busy workers), then stop the
        workers."""
        pending = [job.future for job in self._queue] + [j.future for w in self._workers for j in w.jobs]
        if cancel:
            self.cancel(pending)
        self.wait(pending)
        for worker in self._workers:
            worker.calls.close()  # the worker reads end-of-file and exits
            worker.replies.close()
        for worker in self._workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
        self._workers.clear()

    def _dispatch(self) -> None:
        """Hand queued calls to workers: idle ones first, starting workers up to ``size``; then, while more
        calls wait than there are workers, a busy worker's next call (see the module docstring). Near the
        end of a batch a call waits for a worker to be free instead: queued behind a running call, it
        could leave another worker idle."""
        while self._queue:
            job = self._queue[0]
            worker = self._worker_for(job)
            if worker is None:
                return
            self._queue.popleft()
            if job.future.cancelled():
                continue
            try:
                _send(worker, job)
            except OSError:  # the worker died: not this call's doing, so it goes first again
                self._bury(worker)
                self._queue.appendleft(job)
                continue
            worker.jobs.append(job)
            if len(worker.jobs) == 1:  # the worker begins it now; one sent behind stays pending until then
                job.future.set_running_or_notify_cancel()

    def _worker_for(self, job: _Job) -> _Worker | None:
        """The worker to send ``job`` to now, or None if it should wait in the queue."""
        idle = next((w for w in self._workers if not w.jobs), None)
        if idle is not None:
            return idle
        if len(self._workers) < self._size:
            return self._start_worker()
        if len(self._queue) <= self._size:
            return None
        return next(
            (w for w in self._workers if len(w.jobs) < _DEPTH and _frames_bytes(w, job) <= w.capacity // 2),
            None,
        )

    def _step(self, timeout: float | None) -> None:
        """Collect replies (or deaths) of busy workers, waiting up to ``timeout``; then dispatch."""
        busy = {w.replies: w for w in self._workers if w.jobs}
        if not busy:
            self._dispatch()
            return
        finished = []
        for conn in wait_for_ready(list(busy), timeout):
            worker = busy[conn]  # type: ignore[index]
            try:
                result = _read_reply(conn.fileno())
            except (EOFError, OSError, struct.error):
                self._bury(worker)
                continue
            finished.append((worker.jobs.popleft().future, result))
            if worker.jobs:  # a call cancelled while it waited in the pipe stays cancelled
                worker.jobs[0].future.set_running_or_notify_cancel()
        self._dispatch()  # before the results: their futures' callbacks may take a while
        for future, result in finished:
            if not future.cancelled():
                future.set_result(result)

    def _start_worker(self) -> _Worker:
        calls_in, calls_out = self._context.Pipe(duplex=False)
        replies_in, replies_out = self._context.Pipe(duplex=False)
        capacity = _enlarge(calls_out)
        _enlarge(replies_out)
        # The child inherits every pipe end this process holds; it must close the parent ends, or a
        # worker would never read end-of-file when this process closes its pipe.
        inherited = [calls_out, replies_in] + [c for w in self._workers for c in (w.calls, w.replies)]
        process = self._context.Process(
            target=_serve,
            args=(calls_in, replies_out, inherited, self._call, self._initializer),
            name="fedge-client",
        )
        # A Ctrl-C landing inside fork() would raise in the middle of the at-fork handlers (logging's among
        # them) and leave locks held; it is delivered right after the fork instead.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        # Garbage this process holds (an ONNX Runtime session in a reference cycle, say) must never be
        # collected in a forked worker: its destructor would wait for threads that exist only here (seen:
        # a worker hung in pthread_cond_destroy). Frozen objects are never collected in the child; here they
        # are unfrozen right after the fork. (A gc.collect() first would cost 0.2 s per worker.)
        gc.freeze()
        try:
            process.start()
        finally:
            gc.unfreeze()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        calls_in.close()
        replies_out.close()
        worker = _Worker(process, replies_in, calls_out, capacity)
        self._workers.append(worker)
        return worker

    def _bury(self, worker: _Worker, cause: str = "") -> None:
        """A worker died: fail the call it was running and queue again, first, the calls it had not begun;
        a new worker starts on the next dispatch."""
        worker.process.join(timeout=5)
        worker.calls.close()
        worker.replies.close()
        self._workers.remove(worker)
        if not worker.jobs:
            return
        running = worker.jobs.popleft()
        self._queue.extendleft(reversed(worker.jobs))
        if running.future.cancelled():
            return
        code = worker.process.exitcode
        if not cause:
            cause = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        running.future.set_exception(WorkerDied(f"the ClientApp's worker process died ({cause})"))


def _frames_bytes(worker: _Worker, job: _Job) -> int:
    """Bytes :func:`_send` would write for ``job`` to ``worker``."""
    blob = len(job.shared[1]) if job.shared is not None and job.shared[0] != worker.shared_key else 0
    return len(job.payload) + len(job.context) + blob + _FRAME_OVERHEAD


def _enlarge(conn: Connection) -> int:
    """Grow a pipe's buffer to :data:`_PIPE_BYTES` where the OS allows (Linux); the bytes it now holds."""
    set_size, get_size = (getattr(fcntl, n, None) for n in ("F_SETPIPE_SZ", "F_GETPIPE_SZ"))
    if set_size is None or get_size is None:
        return 4096  # POSIX promises little; small enough that prefetching only sends small calls
    try:
        return fcntl.fcntl(conn.fileno(), set_size, _PIPE_BYTES)
    except OSError:  # over the user's pipe allowance (pipe-user-pages-soft): keep the default size
        return fcntl.fcntl(conn.fileno(), get_size)


def _send(worker: _Worker, job: _Job) -> None:
    """A call's frames: what the shared blob is (and the blob, if the worker lacks it), payload, context."""
    if job.shared is None:
        worker.calls.send_bytes(_NO_SHARED)
    elif worker.shared_key == job.shared[0]:
        worker.calls.send_bytes(_SAME_SHARED)
    else:
        worker.shared_key = _NOTHING  # until the blob is wholly sent
        worker.calls.send_bytes(_NEW_SHARED)
        worker.calls.send_bytes(job.shared[1])
        worker.shared_key = job.shared[0]
    worker.calls.send_bytes(job.payload)
    worker.calls.send_bytes(job.context)


def _write_reply(fd: int, frames: Sequence[Any], context: bytes, seconds: float) -> None:
    """A reply as :func:`_read_reply` reads it, in one ``writev`` where the pipe takes it all (one wake-up of
    the reading process per reply rather than one per frame)."""
    parts = [memoryview(frame).cast("B") for frame in (*frames, context)]
    header = _HEAD.pack(len(frames), seconds) + b"".join(_LENGTH.pack(part.nbytes) for part in parts)
    pending = [memoryview(header), *(part for part in parts if part.nbytes)]
    while pending:
        written = os.writev(fd, pending)
        while pending and written >= pending[0].nbytes:  # drop what went out whole, trim what went in part
            written -= pending.pop(0).nbytes
        if pending and written:
            pending[0] = pending[0][written:]


def _read_reply(fd: int) -> CallResult:
    """A worker's reply frames, new context and the call's seconds, read from its pipe (see the module
    docstring)."""
    count, seconds = _HEAD.unpack(_read_exactly(fd, _HEAD.size))
    lengths = struct.unpack(f"!{count + 1}Q", _read_exactly(fd, _LENGTH.size * (count + 1)))
    parts = [_read_exactly(fd, length) for length in lengths]
    return CallResult(tuple(parts[:-1]), parts[-1], seconds)


def _read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``: one read into a new object when the writer is ahead (as it nearly
    always is), pieced together otherwise; EOFError if the pipe closes first."""
    data = os.read(fd, size) if size else b""
    if len(data) == size:
        return data
    pieces = bytearray(data)
    while len(pieces) < size:
        if not data:
            raise EOFError("the worker's pipe closed mid-reply")
        data = os.read(fd, size - len(pieces))
        pieces += data
    return bytes(pieces)


def _close_pipes(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.calls.close()
        worker.replies.close()


def _serve(
    calls: Connection,
    replies: Connection,
    inherited: list[Connection],
    call: Call,
    initializer: Callable[[], None] | None,
) -> None:
    """A worker's life: read a call's frames, run it, write its two byte strings, until the pipe closes."""
    for other in inherited:
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinating process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (a command's clean stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked around the fork by the parent
    if initializer is not None:
        initializer()
    held: bytes | None = None
    while True:
        try:
            kind = calls.recv_bytes()
            if kind == _NEW_SHARED:
                held = calls.recv_bytes()
            payload, context = calls.recv_bytes(), calls.recv_bytes()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        frames, new_context = call(payload, context, None if kind == _NO_SHARED else held)
        seconds = time.perf_counter() - start
        try:
            _write_reply(replies.fileno(), frames, new_context, seconds)
        except OSError:  # the pool closed its end: it no longer wants this reply
            return
