"""A Grid that gives up when a real fleet stays below the nodes a run needs.

Flower's strategies start every round with ``sample_nodes``, which polls ``get_node_ids`` once a second
until ``min_available_nodes`` are online, with no deadline (its progress line goes to a logger the
coordinator keeps quiet). A coordinator whose fleet lost a node for good therefore sat at the start of
the next round without a word, its status saying "running" (measured: twelve minutes, until the node was
restarted). :class:`NodeFloorGrid` counts how long the fleet has been short: it says so once, tells the
status file, and after ``wait_s`` raises :class:`NodesLost` (a :class:`~fedge.server.runner.RunFailed`:
the service exits non-zero and its manager may restart it), as the service's first wait for its fleet
does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from fedge.flower.grid import RunGrid, WrappingGrid
from fedge.server.runner import RunFailed

__all__ = ["NodeFloorGrid", "NodesLost"]

log = logging.getLogger(__name__)

Waiting = Callable[[dict[str, Any] | None], None]
"""Told ``{"online", "needed", "since"}`` when the fleet falls short, and None when it is whole again."""


class NodesLost(RunFailed):
    """Fewer nodes than the run needs stayed online for longer than the wait allows."""


class NodeFloorGrid(WrappingGrid):
    """Delegate to ``grid``; once fewer than ``needed`` nodes have been online for ``wait_s`` seconds,
    :meth:`get_node_ids` raises :class:`NodesLost`.

    Parameters
    ----------
    grid : RunGrid
        The fleet's Grid (fedge's MQTT Grid, possibly under a schedule).
    needed : int
        Nodes the run needs (``min_nodes``).
    wait_s : float
        How long the fleet may stay short before the run gives up.
    on_wait : callable, optional
        Told when the fleet falls short and when it is whole again (the status file).
    clock : callable (default: time.monotonic)
        Seconds, for the wait.
    """

    def __init__(
        self,
        grid: RunGrid,
        needed: int,
        wait_s: float,
        on_wait: Waiting | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(grid)
        self._needed, self._wait_s = needed, wait_s
        self._on_wait, self._clock = on_wait, clock
        self._short_since: float | None = None
        if not isinstance(grid, RunGrid):  # a meter above trusts this Grid to report what it carries
            raise TypeError(f"NodeFloorGrid needs one of fedge's Grids, got {type(grid).__name__}")
        grid.on_wire = self._report_wire  # what the inner Grid puts on the wire, passed up

    def __getattr__(self, name: str) -> Any:  # node_links, take_round, profiles, ...: the inner Grid's
        if name.startswith("__") or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def get_node_ids(self) -> Iterable[int]:
        ids = list(self._inner.get_node_ids())
        if len(ids) >= self._needed:
            if self._short_since is not None:
                log.info("%d nodes online again (the run needs %d)", len(ids), self._needed)
                self._short_since = None
                if self._on_wait is not None:
                    self._on_wait(None)
            return ids
        now = self._clock()
        if self._short_since is None:
            self._short_since = now
            log.warning(
                "%d of the %d nodes the run needs are online; waiting up to %.0f s for the others",
                len(ids),
                self._needed,
                self._wait_s,
            )
            if self._on_wait is not None:
                self._on_wait({"online": len(ids), "needed": self._needed, "since": time.time()})
        elif now - self._short_since > self._wait_s:
            raise NodesLost(
                f"only {len(ids)} of the {self._needed} nodes the run needs stayed online for "
                f"{now - self._short_since:.0f} s (wait_for_nodes_s = {self._wait_s:g}); the run stops "
                "here and '--resume' continues it"
            )
        return ids
