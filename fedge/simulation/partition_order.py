"""Flower's simulation engine with its nodes listed in partition order, as fedge's local engine lists them.

Flower's engine draws its node ids at random, and Flower's strategies sample from ``get_node_ids()`` in the
order a Grid returns them: with ``fraction_train < 1`` the same seed chose other partitions on Ray than on
the local engine (whose ids follow the partitions), and other ones again on the next Ray run. Listed by
partition id (each node asked its own, ``query.partition``), a seeded sample picks the same clients on both
engines and on every run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedge.flower.grid import WrappingGrid
from fedge.protocol.envelope import wire_size

__all__ = ["PartitionOrderedGrid", "partition_ids"]


class PartitionOrderedGrid(WrappingGrid):
    """``grid`` whose :meth:`get_node_ids` lists nodes by their partition id (nodes of unknown partition
    last, by id); everything else is ``grid``'s. It reports the wire size of what it carries (Flower's Grid
    does not), as fedge's Grids do.

    Parameters
    ----------
    grid : Grid
        Flower's Grid of the run.
    partition_of : mapping of int to int
        Each node's partition id.
    """

    def __init__(self, grid: Grid, partition_of: Mapping[int, int]) -> None:
        super().__init__(grid)
        self._partition_of = dict(partition_of)

    def get_node_ids(self) -> Iterable[int]:
        last = len(self._partition_of)  # a node of unknown partition: after the known ones, by id
        return sorted(self._inner.get_node_ids(), key=lambda n: (self._partition_of.get(n, last), n))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self._inner.push_messages(messages))
        self._measure(messages)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._measure(list(self._inner.pull_messages(message_ids)))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        replies = list(self._inner.send_and_receive(messages, timeout=timeout))
        self._measure(messages)
        return self._measure(replies)

    def _measure(self, messages: list[Message]) -> list[Message]:
        for message in messages:
            self._report_wire(message, wire_size(message))
        return messages


def partition_ids(grid: Grid, nodes: list[int]) -> dict[int, int]:
    """Each node's partition id, asked of the node itself (Flower's engine draws node ids at random, so an
    id says nothing of which client, with which data, profile and availability, a node is)."""
    queries = [Message(RecordDict(), node, "query.partition") for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=600))
    answered = {
        reply.metadata.src_node_id: int(reply.content["node"]["partition-id"])
        for reply in replies
        if not reply.has_error()
    }
    if sorted(answered) != sorted(nodes) or sorted(answered.values()) != list(range(len(nodes))):
        raise RuntimeError(f"{len(answered)} of {len(nodes)} nodes told their partition id")
    return answered
