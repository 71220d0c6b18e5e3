"""Run an asyncio service on its own event loop in a daemon thread (embedded broker, lossy-link proxy)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop"]

T = TypeVar("T")
Serve = Callable[[asyncio.Event, threading.Event], Awaitable[None]]


class BackgroundLoop:
    """One service coroutine ``serve(stop, ready)`` on a private event loop in a daemon thread.

    The coroutine sets ``ready`` once it accepts work and returns after ``stop`` is set.

    Parameters
    ----------
    name : str
        Name of the thread (shows in logs and debuggers).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    def start(self, serve: Serve, timeout_s: float = 10.0) -> None:
        """Start the thread and wait until ``serve`` is ready; raise RuntimeError if it fails or times out."""
        loop, ready, errors = asyncio.new_event_loop(), threading.Event(), []

        async def main() -> None:
            self._stop = asyncio.Event()
            await serve(self._stop, ready)

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(main())
            except BaseException as err:  # reported by start()
                errors.append(err)
                ready.set()
            # Libraries (amqtt) may leave tasks cancelled but not awaited: finish them before the loop closes.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

        self._loop, self._thread = loop, threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or errors:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {errors[0] if errors else 'timed out'}")

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 5.0) -> T:
        """Run ``coroutine`` on the loop from another thread and return its result."""
        if self._loop is None:
            raise RuntimeError(f"{self.name} is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Set ``stop``, wait for the thread and close the loop (a no-op when not running)."""
        if self._loop is None or self._thread is None:
            return
        if self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
        self._loop = self._thread = self._stop = None
