"""An in-process Flower Grid: virtual nodes run the ClientApp on a worker pool.

Flower's own simulation engine starts Ray, an actor per worker and a SuperLink state machine: seconds of
overhead per run that dominate small experiments. :class:`LocalGrid` keeps only what the semantics need:
one ``Context`` per virtual node that persists across rounds (so client state such as error-feedback
residuals survives), messages that cross a serialization boundary (so the server and the clients never
share arrays, and what is counted is what would travel) and a thread pool (torch releases the GIL in its
kernels). Replies come back in the order the messages were pushed, so equal seeds give equal runs.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedge.compat import SUPERLINK_NODE_ID, message_from_bytes, message_to_bytes, set_message_id
from fedge.grid_base import RunGrid

__all__ = ["LocalGrid"]

log = logging.getLogger(__name__)


class LocalGrid(RunGrid):
    """Run ``client_app`` for ``num_nodes`` virtual nodes in this process.

    Parameters
    ----------
    client_app : ClientApp
        The Flower ClientApp every node runs.
    num_nodes : int
        Virtual nodes; node ``i`` gets ``node_config = {"partition-id": i, "num-partitions": num_nodes}``.
    run_id : int (default: 1)
        The run the node contexts belong to.
    workers : int (default: 2)
        Threads running ClientApps at once.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1, workers: int = 2) -> None:
        if num_nodes < 1:
            raise ValueError("num_nodes must be >= 1")
        super().__init__(run_id)
        self._client_app = client_app
        # Node ids follow the SuperLink's own id, which Flower reserves.
        self.contexts: dict[int, Context] = {
            SUPERLINK_NODE_ID + 1 + i: Context(
                run_id=run_id,
                node_id=SUPERLINK_NODE_ID + 1 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedge-client")
        self._pending: dict[str, Future[bytes]] = {}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"no node {message.metadata.dst_node_id} in this grid")
            message_id = uuid.uuid4().hex
            set_message_id(message, message_id)
            self._pending[message_id] = self._pool.submit(self._handle, message_to_bytes(message))
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for message_id in message_ids:
            future = self._pending.get(message_id)
            if future is not None and future.done():
                del self._pending[message_id]
                replies.append(message_from_bytes(future.result()))
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        for message_id in ids:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._pending[message_id].result(timeout=remaining)
            except TimeoutError:
                log.warning("message %s got no reply within %.1f s", message_id, timeout)
                continue
            replies.extend(self.pull_messages([message_id]))
        return replies

    def shutdown(self) -> None:
        """Stop the worker pool (pending ClientApp calls finish first)."""
        self._pool.shutdown(wait=True)

    def _handle(self, payload: bytes) -> bytes:
        """One ClientApp call, as a SuperNode would make it: bytes in, reply bytes out."""
        message = message_from_bytes(payload)
        context = self.contexts[message.metadata.dst_node_id]
        try:
            reply = self._client_app(message, context)
        except Exception as err:  # a failing client must not stop the round
            log.warning("ClientApp on node %s raised: %r", context.node_id, err)
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)), reply_to=message
            )
        set_message_id(reply, uuid.uuid4().hex)
        return message_to_bytes(reply)
