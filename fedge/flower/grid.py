"""What every fedge Grid shares: its run, Flower's deprecated ``create_message`` and a wire-size report."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedge.flower.compat import Run

__all__ = ["RunGrid", "WrappingGrid"]


class RunGrid(Grid):
    """A Flower ``Grid`` that holds its ``Run``; subclasses implement the node and message methods.

    fedge's Grids serialize every message they carry anyway, so they report its size through
    :attr:`on_wire` (``callback(message, nbytes)``) instead of making a meter serialize it again.

    Parameters
    ----------
    run_id : int (default: 0)
        The run until :meth:`set_run` names another.
    """

    def __init__(self, run_id: int = 0) -> None:
        self._run = Run.create_empty(run_id)
        self.on_wire: Callable[[Message, int], None] | None = None

    def _report_wire(self, message: Message, data: bytes | bytearray | int) -> None:
        """Tell :attr:`on_wire` how many bytes ``message`` took on the wire (``data`` or its length)."""
        if self.on_wire is not None:
            self.on_wire(message, data if isinstance(data, int) else len(data))

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Deprecated in Flower (still abstract there): build the ``Message`` directly instead."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


class WrappingGrid(RunGrid):
    """A Grid over another (``inner``), whose run is the inner Grid's; subclasses change what they wrap it
    for (the order of its nodes, a wait for them) and pass the rest on."""

    def __init__(self, inner: Grid) -> None:
        super().__init__()
        self._inner = inner

    def set_run(self, run: Run) -> None:
        self._inner.set_run(run)

    @property
    def run(self) -> Run:
        return self._inner.run

    def get_node_ids(self) -> Iterable[int]:
        return self._inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self._inner.send_and_receive(messages, timeout=timeout)
