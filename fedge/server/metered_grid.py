"""A Grid wrapper that counts what crosses the wire, per round, on any engine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from fedge.devices.fleet import LinkProfile
from fedge.flower.compat import Run
from fedge.flower.grid import RunGrid
from fedge.protocol.envelope import wire_size

__all__ = ["MeteredGrid", "RoundTraffic"]


@dataclass
class RoundTraffic:
    """Messages and bytes of one round.

    Counts are of training messages; bytes are the size of every message of the round (train and evaluate)
    as fedge's MQTT transport puts it on the wire (:func:`fedge.protocol.envelope.wire_size`), whichever
    engine carried it, so figures mean the same everywhere.
    """

    sampled: int = 0
    replied: int = 0
    failed: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    first_error: str = ""  # the reason of the round's first error reply (a client traceback, usually)
    clock: dict[str, Any] = field(default_factory=dict)  # a simulated clock's account of the round, if any


class MeteredGrid(RunGrid):
    """Delegate to ``grid`` and count its traffic until :meth:`take` hands the count over.

    Flower's strategies leave ``group_id`` empty, so rounds are delimited by the caller: the ServerApp
    calls :meth:`take` from its per-round evaluation hook.

    Parameters
    ----------
    grid : Grid
        The Grid of the engine in use (fedge's local or MQTT Grid, Flower's in-memory or gRPC Grid).
    """

    def __init__(self, grid: Grid) -> None:
        super().__init__()
        self._grid = grid
        self._traffic = RoundTraffic()
        # fedge's own Grids report the bytes they put on the wire; others' messages are serialized here.
        self._grid_reports_bytes = isinstance(grid, RunGrid)
        if self._grid_reports_bytes:
            grid.on_wire = self._count_bytes

    def take(self) -> RoundTraffic:
        """The traffic since the previous call; the count starts again from zero."""
        traffic, self._traffic = self._traffic, RoundTraffic()
        take_round = getattr(self._grid, "take_round", None)  # a Grid with a simulated clock
        if callable(take_round):
            traffic.clock = take_round()
        return traffic

    def node_links(self) -> dict[int, LinkProfile]:
        """The inner Grid's node links (:meth:`fedge.simulation.clock_grid.ClockGrid.node_links`); empty
        when it knows none (real fleets over MQTT)."""
        node_links = getattr(self._grid, "node_links", None)
        return dict(node_links()) if callable(node_links) else {}

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self._count_sent(messages)
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self._grid.pull_messages(message_ids))
        self._count_received(replies)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        self._count_sent(messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self._count_received(replies)
        return replies

    def _count_sent(self, messages: list[Message]) -> None:
        for message in messages:
            self._traffic.sampled += message.metadata.message_type == MessageType.TRAIN
            if not self._grid_reports_bytes:
                self._count_bytes(message, wire_size(message))

    def _count_received(self, replies: list[Message]) -> None:
        for reply in replies:
            if not self._grid_reports_bytes:
                self._count_bytes(reply, wire_size(reply))
            if reply.metadata.message_type != MessageType.TRAIN:
                continue
            if reply.has_error():
                self._traffic.failed += 1
                self._traffic.first_error = self._traffic.first_error or reply.error.reason
            else:
                self._traffic.replied += 1

    def _count_bytes(self, message: Message, nbytes: int) -> None:
        """Instructions go down, replies (which answer a message) come up."""
        if message.metadata.reply_to_message_id:
            self._traffic.bytes_up += nbytes
        else:
            self._traffic.bytes_down += nbytes
