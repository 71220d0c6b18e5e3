"""A Flower Grid for one machine: virtual nodes run the ClientApp on a pool of worker processes.

Flower's own simulation engine starts Ray, an actor per worker and a SuperLink state machine: seconds of
overhead per run that dominate small experiments. :class:`LocalGrid` keeps only what the semantics need:
one ``Context`` per virtual node that persists across rounds (so client state such as error-feedback
residuals survives), messages that cross a serialization boundary (so the server and the clients never
share arrays) and a pool of forked worker processes (client training is Python-heavy, so threads would
queue on the GIL; :mod:`fedge.simulation.workers` keeps a dying worker from taking other nodes' calls down
with it). Replies come back in the order the messages were pushed, so equal seeds give equal runs.

Messages and contexts cross to the workers pickled: the workers are this process's own forked children and
the pipes private to them, and pickle moves a model's arrays about six times faster than Flower's protobuf
(0.02 ms against 0.13-0.17 ms each way for the digits CNN, on every call). A reply's large arrays travel
out of band (pickle protocol 5): their bytes are written to the pipe as they are and read into the very
``bytes`` objects the unpickled reply's arrays hold, never copied into or out of a pickle stream. A batch's
shared content (the global model every sampled node gets) is pickled once and reaches each worker once
(:meth:`WorkerPool.submit`'s shared blob); each call unpickles its own copy, so no two calls share arrays.
What is counted is still what would travel: each message's length on Flower's wire (or as fedge's compact
envelope), computed without encoding it.
"""

from __future__ import annotations

import functools
import io
import itertools
import logging
import math
import multiprocessing
import pickle
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from typing import Any

import torch
from flwr.app import Array, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedge.flower.compat import SUPERLINK_NODE_ID, content_proto_size, message_proto_size, set_message_id
from fedge.flower.grid import RunGrid
from fedge.flower.node import call_client_app, error_reply, make_context
from fedge.protocol.envelope import wire_size
from fedge.simulation.workers import CallResult, Frames, WorkerPool

__all__ = ["LocalGrid"]

log = logging.getLogger(__name__)


def _init_worker() -> None:
    # One intra-op thread per worker process: the pool is the parallelism (and forked OpenMP pools hang).
    torch.set_num_threads(1)


_CONTENT = "content"  # the persistent id that stands for a message's content, pickled apart from it
_DECODED: Future[CallResult] = Future()  # stands for a finished call whose reply is decoded
_DECODED.set_result(CallResult((), b"", 0.0))
_OUT_OF_BAND_BYTES = 16 * 1024  # arrays at least this large travel as frames of their own
_content_keys = itertools.count()  # keys of shared contents, unique in this process


def _call_client(
    client_app: ClientApp, payload: bytes, context_bytes: bytes, content: bytes | None = None
) -> tuple[list[bytes], bytes]:
    """One ClientApp call, as a SuperNode makes it: message and context in, reply (as frames, see
    :func:`_reply_frames`) and new context out.

    ``content``: the message's content, pickled apart from it (``payload`` then refers to it).
    """
    message, context = _MessageUnpickler(payload, content).load(), pickle.loads(context_bytes)
    reply = call_client_app(client_app, message, context)
    set_message_id(reply, uuid.uuid4().hex)
    return _reply_frames(reply), _dumps(context)


def _reply_frames(reply: Message) -> list[bytes]:
    """``reply`` pickled: the stream, then the bytes of each large array, out of band."""
    buffer, frames = io.BytesIO(), []
    _ReplyPickler(buffer, frames.append).dump(reply)
    # each out-of-band frame as the array's own bytes object: a worker's pipe writes it as it is, and a
    # thread's call hands it over as unpickled arrays want it
    return [buffer.getvalue(), *(frame.raw().obj for frame in frames)]


def _loads_reply(frames: Frames) -> Message:
    """The reply :func:`_reply_frames` pickled; its arrays hold the frames' own bytes objects."""
    return pickle.loads(frames[0], buffers=frames[1:])


class _ReplyPickler(pickle.Pickler):
    """Pickles the bytes of large ``Array``s out of band (each becomes a frame of its own)."""

    def __init__(self, file: io.BytesIO, buffer_callback: Callable[[pickle.PickleBuffer], None]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)

    def reducer_override(self, obj: object) -> object:
        if type(obj) is not Array or not isinstance(obj.data, bytes) or len(obj.data) < _OUT_OF_BAND_BYTES:
            return NotImplemented
        # the rest of the array's state as it is (set directly on unpickling, as pickle does by default)
        state = {key: value for key, value in vars(obj).items() if key != "data"}
        return _array_with_data, (pickle.PickleBuffer(obj.data),), state


def _array_with_data(data: bytes) -> Array:
    """An ``Array`` holding ``data`` (its other fields follow as pickled state)."""
    array = Array.__new__(Array)
    vars(array)["data"] = data
    return array


def _dumps(value: Message | Context | RecordDict) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _dumps_message(message: Message) -> bytes:
    """``message`` pickled without its content (which travels as the call's shared blob)."""
    if not message.has_content():
        return _dumps(message)
    buffer = io.BytesIO()
    _ContentlessPickler(buffer, message.content).dump(message)
    return buffer.getvalue()


class _ContentlessPickler(pickle.Pickler):
    """Pickles a message with one object (its content) left out, as a reference to be filled in."""

    def __init__(self, file: io.BytesIO, content: object) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._content = content

    def persistent_id(self, obj: object) -> str | None:
        return _CONTENT if obj is self._content else None


class _MessageUnpickler(pickle.Unpickler):
    """Unpickles a message, filling in its content from its own pickle (a fresh copy for every call)."""

    def __init__(self, payload: bytes, content: bytes | None) -> None:
        super().__init__(io.BytesIO(payload))
        self._content = content

    def persistent_load(self, pid: object) -> object:
        if pid != _CONTENT or self._content is None:
            raise pickle.UnpicklingError(f"no shared object {pid!r} for this message")
        return pickle.loads(self._content)


def _unpickle(future: Future[CallResult]) -> tuple[Message, Context, int, float]:
    """A finished call's reply and the node's new Context, with the reply's size on fedge's wire and the
    seconds the call ran."""
    frames, context, seconds = future.result()
    reply = _loads_reply(frames)
    return reply, pickle.loads(context), wire_size(reply), seconds


def _timed_call(client_app: ClientApp, payload: bytes, context: bytes, content: bytes | None) -> CallResult:
    """:func:`_call_client` on a thread, timed as a worker process times it."""
    start = time.perf_counter()
    frames, new_context = _call_client(client_app, payload, context, content)
    return CallResult(tuple(frames), new_context, time.perf_counter() - start)


class _ThreadPool:
    """The :class:`WorkerPool` interface over threads of this process (one worker, or no ``fork``)."""

    def __init__(self, client_app: ClientApp, workers: int) -> None:
        self._client_app = client_app
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="fedge-client")

    def submit(
        self, payload: bytes, context: bytes, shared: tuple[int, bytes] | None = None
    ) -> Future[CallResult]:
        content = shared[1] if shared is not None else None
        return self._executor.submit(_timed_call, self._client_app, payload, context, content)

    def wait(self, futures: Iterable[Future[Any]], timeout: float | None = None) -> None:
        wait_for_futures(list(futures), timeout)

    def cancel(self, futures: Iterable[Future[Any]]) -> None:
        for future in futures:
            future.cancel()  # a call already running in a thread cannot be stopped; it finishes unheard

    def shutdown(self, *, cancel: bool = False) -> None:
        self._executor.shutdown(wait=True, cancel_futures=cancel)


class LocalGrid(RunGrid):
    """Run ``client_app`` for ``num_nodes`` virtual nodes on this machine.

    Parameters
    ----------
    client_app : ClientApp
        The Flower ClientApp every node runs.
    num_nodes : int
        Virtual nodes; node ``i`` gets ``node_config = {"partition-id": i, "num-partitions": num_nodes}``.
    run_id : int (default: 1)
        The run the node contexts belong to.
    workers : int (default: 2)
        ClientApps running at once.
    processes : bool, optional
        Run them in forked worker processes (default when ``workers > 1``) or in threads of this process.
        Calls for one node never overlap within a round, so its Context is updated by one call at a time.
        A worker process that dies fails only the call it was running: that node's reply is an error
        (``CLIENT_APP_CRASHED``), its Context stays as it was, and a new worker takes the dead one's place.
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_id: int = 1,
        workers: int = 2,
        processes: bool | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError("num_nodes must be >= 1")
        super().__init__(run_id)
        # Node ids follow the SuperLink's own id, which Flower reserves. A node's Context goes to the worker
        # with each call and comes back updated, as it would to and from a SuperNode's ClientApp process.
        self.contexts: dict[int, Context] = {
            SUPERLINK_NODE_ID + 1 + i: make_context(
                run_id, SUPERLINK_NODE_ID + 1 + i, {"partition-id": i, "num-partitions": num_nodes}
            )
            for i in range(num_nodes)
        }
        if processes is None:
            processes = workers > 1 and "fork" in multiprocessing.get_all_start_methods()
        self._pool: WorkerPool | _ThreadPool
        if processes:
            self._pool = WorkerPool(functools.partial(_call_client, client_app), workers, _init_worker)
        else:
            self._pool = _ThreadPool(client_app, workers)
        self._pending: dict[str, tuple[Message, Future[CallResult]]] = {}
        # replies decoded as they arrive (reply, the node's new Context, the reply's wire size), so the end
        # of a round, when every worker waits for the next one, is not spent unpickling its replies
        self._decoded: dict[str, tuple[Message, Context, int, float]] = {}
        # seconds of each node's last completed call, by message type: what the next one is expected to take
        self._call_seconds: dict[tuple[int, str], float] = {}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = [""] * len(messages)
        # by id (the object kept, so its id stays unique): the content, its pickle as the calls' shared blob,
        # and its size on Flower's wire; a strategy sends one content to every node it samples
        contents: dict[int, tuple[RecordDict, tuple[int, bytes], int]] = {}
        for index in self._longest_first(messages):
            message = messages[index]
            node_id = message.metadata.dst_node_id
            if node_id not in self.contexts:
                raise ValueError(f"no node {node_id} in this grid")
            message_id = uuid.uuid4().hex
            set_message_id(message, message_id)
            shared, content_size = None, None
            if message.has_content():
                content = message.content
                if id(content) not in contents:
                    blob = (next(_content_keys), _dumps(content))
                    contents[id(content)] = (content, blob, content_proto_size(content))
                _, shared, content_size = contents[id(content)]
            self._report_wire(message, message_proto_size(message, content_size=content_size))
            payload, context = _dumps_message(message), _dumps(self.contexts[node_id])
            future = self._pool.submit(payload, context, shared)
            self._pending[message_id] = (message, future)
            if isinstance(self._pool, WorkerPool):  # its futures finish on this thread, inside wait()
                future.add_done_callback(functools.partial(self._decode, message_id))
            ids[index] = message_id
        return ids

    def _longest_first(self, messages: list[Message]) -> list[int]:
        """The indices of ``messages`` in the order their calls start: longest expected first (a node's
        last call of the same type; a node not yet seen before all), so that a round does not end with one
        worker still on a long call while the others wait (longest-processing-time-first scheduling).
        Replies are returned in the order pushed, so the order calls start in changes no result."""

        def expected_seconds(index: int) -> float:
            metadata = messages[index].metadata
            return self._call_seconds.get((metadata.dst_node_id, metadata.message_type), math.inf)

        return sorted(range(len(messages)), key=expected_seconds, reverse=True)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = [i for i in message_ids if i in self._pending]
        self._pool.wait([self._pending[i][1] for i in wanted], timeout=0)  # collect what has finished
        replies = []
        for message_id in wanted:
            message, future = self._pending[message_id]
            if future.done():
                del self._pending[message_id]
                replies.append(self._reply(message, future))
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        self._pool.wait([self._pending[i][1] for i in ids], timeout)
        late = [i for i in ids if not self._pending[i][1].done()]
        if late:  # the round goes on without them, so their calls are stopped rather than left running
            log.warning("%d of %d ClientApp calls ran past the %.1f s timeout", len(late), len(ids), timeout)
            self._pool.cancel([self._pending.pop(i)[1] for i in late])
        return self.pull_messages(ids)

    def shutdown(self, *, cancel: bool = False) -> None:
        """Stop the workers; pending ClientApp calls finish first, or with ``cancel`` are dropped (an
        interrupted run does not wait for a round nobody will aggregate)."""
        self._pool.shutdown(cancel=cancel)

    def _decode(self, message_id: str, future: Future[CallResult]) -> None:
        """Unpickle a finished call's reply and Context when it arrives (while other calls still run)."""
        entry = self._pending.get(message_id)
        if entry is None or future.cancelled() or future.exception() is not None:
            return  # dropped as late (nobody pulls it), or failed: _reply reports the failure
        self._decoded[message_id] = _unpickle(future)
        # The future holds the pickled reply: let it go, or a round's replies would be held twice.
        self._pending[message_id] = (entry[0], _DECODED)

    def _reply(self, message: Message, future: Future[CallResult]) -> Message:
        """The reply of a finished call; the node's Context advances only if the call completed."""
        try:
            future.result()
        except Exception as err:  # the worker process died: only this node's call is lost
            partition = self.contexts[message.metadata.dst_node_id].node_config["partition-id"]
            log.warning("partition %s: %s", partition, err)
            reply = error_reply(message, ErrorCode.CLIENT_APP_CRASHED, str(err))
            set_message_id(reply, uuid.uuid4().hex)
            return reply
        # Not decoded yet: calls on threads (a callback there would race this), or the callback failed
        # (it logged why; decoding again raises here).
        decoded = self._decoded.pop(message.metadata.message_id, None)
        reply, context, size, seconds = decoded if decoded is not None else _unpickle(future)
        self.contexts[message.metadata.dst_node_id] = context
        self._call_seconds[(message.metadata.dst_node_id, message.metadata.message_type)] = seconds
        self._report_wire(reply, size)  # what fedge's MQTT transport sends
        return reply
