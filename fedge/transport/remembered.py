"""What a receiver remembers having finished, per sender, in bounded memory with a fair share each. Pure.

A receiver remembers the messages it delivered so that a late copy (a chunk re-sent after its ACK was lost,
a transfer restarted under the same message id) is never delivered twice. The memory is bounded, so keys
are forgotten, oldest first; if they were forgotten in one order over all senders, one node completing a
flood of tiny messages would push every other node's keys out, and their late copies would be delivered
again. :class:`Remembered` bounds the keys of all senders together, but when it is full the sender holding
the most forgets its own oldest: a sender can crowd out only itself, and the others each keep at least an
equal share.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["Remembered"]


class Remembered:
    """Keys remembered per sender, at most ``capacity`` of them in all.

    Parameters
    ----------
    capacity : int
        Keys of all senders together; when a new one would exceed it, the sender remembering the most keys
        forgets its oldest.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._keys: dict[str, OrderedDict[Hashable, None]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def holds(self, sender: str, key: Hashable) -> bool:
        """Whether ``sender``'s ``key`` is remembered."""
        keys = self._keys.get(sender)
        return keys is not None and key in keys

    def held_by(self, sender: str) -> int:
        """How many keys ``sender`` has remembered."""
        return len(self._keys.get(sender, ()))

    def add(self, sender: str, key: Hashable) -> None:
        """Remember ``sender``'s ``key`` (as the newest), forgetting others' oldest if memory is full."""
        keys = self._keys.setdefault(sender, OrderedDict())
        if key in keys:
            keys.move_to_end(key)
            return
        keys[key] = None
        self._count += 1
        while self._count > self.capacity:
            self._forget_oldest(sender)

    def discard(self, sender: str, key: Hashable) -> None:
        """Forget ``sender``'s ``key`` if it is remembered."""
        keys = self._keys.get(sender)
        if keys is None or key not in keys:
            return
        del keys[key]
        self._count -= 1
        if not keys:
            del self._keys[sender]

    def _forget_oldest(self, newest: str) -> None:
        # The sender that just added is usually the one over its share (a flood): checked first, so the
        # search over every sender happens only when someone else holds more.
        keys = self._keys[newest]
        victim = newest if len(keys) * len(self._keys) >= self._count else self._largest()
        held = self._keys[victim]
        held.popitem(last=False)
        self._count -= 1
        if not held:
            del self._keys[victim]

    def _largest(self) -> str:
        return max(self._keys, key=lambda sender: len(self._keys[sender]))
