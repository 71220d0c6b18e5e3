"""A Grid whose waits end when the caller is interrupted: the ServerApp thread of Flower's Ray engine.

Flower's simulation runs the ServerApp in a thread of its own (not a daemon) and the engine in the main
thread. Ctrl-C (or SIGTERM) stops the engine, but the ServerApp thread went on waiting for replies no
client would send, up to the round's timeout, and the process never exited. Over this Grid, a wait
checks ``stop`` between polls and raises :class:`RunStopped`: the run ends as an interrupted one does
(its completed rounds written, with their plots), and the thread with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

from fedge.flower.grid import WrappingGrid

__all__ = ["RunStopped", "StoppableGrid"]

_POLL_S = 0.05


class RunStopped(Exception):
    """The run was interrupted while the ServerApp waited for its clients."""


class StoppableGrid(WrappingGrid):
    """``inner``, with every wait for replies ended by ``stop`` (:class:`RunStopped` is raised, by any call
    once ``stop`` is set)."""

    def __init__(self, inner: Grid, stop: threading.Event) -> None:
        super().__init__(inner)
        self._stop = stop

    def get_node_ids(self) -> Iterable[int]:
        self._check()
        return self._inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self._check()
        return self._inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._check()  # a Grid over this one that polls for replies itself stops here
        return self._inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull until every reply is in, ``timeout`` passes or the run is stopped."""
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            self._check()
            for reply in self.pull_messages(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            self._stop.wait(_POLL_S)
        return replies

    def _check(self) -> None:
        if self._stop.is_set():
            raise RunStopped("the simulation was interrupted")
