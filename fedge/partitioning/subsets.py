"""Device subsets as bitmasks: the planner's state is (cut, set of devices used so far) (pure numpy).

Every table of the planner has one column per subset of the (at most a dozen or so) devices, indexed by
its bitmask, and one row per cut. These helpers group subsets by size, so a transition "add device d"
runs for all subsets of one size at once, and take unions over subsets, so a forward state can be
matched with any backward state that uses only the devices it left free.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["Subsets"]


@dataclass(frozen=True)
class Subsets:
    """The subsets of ``num`` devices.

    Parameters
    ----------
    num : int
        Devices (bits).
    """

    num: int

    @property
    def full(self) -> int:
        """The mask of all devices."""
        return (1 << self.num) - 1

    @cached_property
    def sizes(self) -> np.ndarray:
        """Shape (2**num,): the number of devices in each subset."""
        return np.array([s.bit_count() for s in range(1 << self.num)], dtype=np.int64)

    @cached_property
    def _without(self) -> dict[tuple[int, int], np.ndarray]:
        out = {}
        for size in range(self.num + 1):
            s = np.flatnonzero(self.sizes == size)
            for device in range(self.num):
                out[size, device] = s[(s >> device) & 1 == 0]
        return out

    def without(self, size: int, device: int) -> np.ndarray:
        """The subsets of ``size`` devices that do not contain ``device`` (ascending masks)."""
        return self._without[size, device]

    def union_closure(self, table: np.ndarray, max_size: int | None = None) -> np.ndarray:
        """``out[:, V] = any(table[:, U] for U subset of V with |U| <= max_size)`` (a subset-sum transform
        with OR; ``max_size=None``: any size).

        Parameters
        ----------
        table : ndarray of bool, shape (m, 2**num)
            One column per subset.
        max_size : int or None (default: None)
            Only subsets of at most this many devices count.
        """
        out = np.ascontiguousarray(table.T)  # one row per subset: the ORs below move whole rows
        if max_size is not None:
            out[self.sizes > max_size] = False
        m = out.shape[1]
        for d in range(self.num):
            # Subsets with bit d set, beside their partners without it, as views (no gathers).
            view = out.reshape(-1, 2, 1 << d, m)
            view[:, 1] |= view[:, 0]
        return out.T

    def completable(self, backward: np.ndarray, limit: int) -> np.ndarray:
        """``out[:, S]``: some subset ``U`` of the devices outside ``S``, with ``|S| + |U| <= limit``, has
        ``backward[:, U]`` (the rest of the graph can be finished without reusing a device).

        Parameters
        ----------
        backward : ndarray of bool, shape (m, 2**num)
            Whether the suffix from each cut can be covered with exactly the devices ``U``.
        limit : int
            At most this many stages in all.
        """
        masks = np.arange(1 << self.num)
        complement = self.full ^ masks
        if limit >= self.num:  # disjointness already bounds the total
            return self.union_closure(backward)[:, complement]
        out = np.zeros_like(backward)
        for used in range(limit + 1):
            cols = np.flatnonzero(self.sizes == used)
            closure = self.union_closure(backward, limit - used)
            out[:, cols] = closure[:, complement[cols]]
        return out
