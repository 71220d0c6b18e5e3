"""Connections the broker closes right after accepting them: the sign of a client-id fight (pure).

Two live clients with one client id take the session from each other: the broker accepts the newcomer
and closes the other, which reconnects at once and closes the newcomer in turn. paho resets its back-off
on every accepted connection, so the two fight several times a second for as long as both run (seen:
two agents started with one node id; a broker with ``use_username_as_clientid`` and two connections of
one user). :class:`FlapGuard` counts connections that end within :data:`SHORT_LIVED_S` of being accepted;
after :data:`FLAPS_TO_REPORT` in a row it says so once, naming the likely causes, and the reconnect delay
it gives doubles with each further one (up to the configured maximum), so neither side floods the broker.
A connection that lasts resets it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FLAPS_TO_REPORT", "SESSION_TAKEN_OVER", "SHORT_LIVED_S", "FlapGuard"]

SHORT_LIVED_S = 2.0
"""A connection closed sooner than this after the broker accepted it counts as a flap."""

FLAPS_TO_REPORT = 3
"""Flaps in a row before the guard reports them."""

SESSION_TAKEN_OVER = 0x8E
"""MQTT 5's DISCONNECT reason: another client connected with this client id."""


@dataclass
class FlapGuard:
    """Counts short-lived connections and sizes the delay before the next attempt.

    Parameters
    ----------
    min_delay_s, max_delay_s : float
        The transport's reconnect back-off bounds.
    """

    min_delay_s: float
    max_delay_s: float
    flaps: int = 0
    _connected_at: float | None = None

    def connected(self, now: float) -> None:
        """The broker accepted a connection at ``now`` (monotonic seconds)."""
        self._connected_at = now

    def disconnected(self, now: float, taken_over: bool = False) -> bool:
        """The connection ended at ``now``; whether this is the moment to report the fight (once a streak).

        ``taken_over``: the broker said another client took the session (MQTT 5 reason 0x8E), which counts
        as a flap however long the connection lasted.
        """
        lasted = None if self._connected_at is None else now - self._connected_at
        self._connected_at = None
        if taken_over or (lasted is not None and lasted < SHORT_LIVED_S):
            self.flaps += 1
        else:
            self.flaps = 0
        return self.flaps == FLAPS_TO_REPORT

    def reconnect_delay_s(self) -> float:
        """The least delay before the next connection attempt: the minimum until the streak is reported,
        then doubling with each flap."""
        if self.flaps < FLAPS_TO_REPORT:
            return self.min_delay_s
        return min(self.max_delay_s, self.min_delay_s * 2 ** (self.flaps - FLAPS_TO_REPORT + 1))
