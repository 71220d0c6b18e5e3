"""Seeded synthetic availability traces, for runs without a FedScale trace: random on/off periods, and a
diurnal pattern (availability follows the time of day, as FedScale's charging-based trace does)."""

from __future__ import annotations

import numpy as np

from fedge.config import ConfigError
from fedge.devices.traces import AvailabilityTrace

__all__ = ["DAY_S", "diurnal_trace", "random_trace"]

DAY_S = 86_400.0
"""Seconds in a day."""


def random_trace(
    n_clients: int, *, mean_on_s: float, mean_off_s: float, period_s: float = 7 * DAY_S, seed: int = 0
) -> AvailabilityTrace:
    """Clients ``0..n_clients-1`` alternating exponentially distributed on and off periods.

    Parameters
    ----------
    n_clients : int
        Clients in the trace.
    mean_on_s, mean_off_s : float
        Mean length of an available and of an away period, seconds. A client is available a fraction
        ``mean_on_s / (mean_on_s + mean_off_s)`` of the time, and starts available with that probability.
    period_s : float (default: one week)
        The loop length, seconds.
    seed : int (default: 0)
        The same seed gives the same trace.
    """
    if not (mean_on_s > 0 and mean_off_s > 0 and period_s > 0):
        raise ConfigError("mean_on_s, mean_off_s and period_s must be > 0")
    rng = np.random.default_rng(seed)
    p_on = mean_on_s / (mean_on_s + mean_off_s)
    first_on = rng.random(n_clients) < p_on
    # Draw enough alternating periods for (almost) every client to pass period_s at once; the rare client
    # that falls short gets another block.
    cycles = period_s / (mean_on_s + mean_off_s)
    width = 2 * int(cycles + 6 * np.sqrt(cycles) + 4)
    on_cols = (np.arange(width)[None, :] % 2 == 0) == first_on[:, None]  # column k is an on period
    ends = np.zeros((n_clients, 0))
    on = np.zeros((n_clients, 0), dtype=bool)
    while not len(ends.T) or (ends[:, -1] < period_s).any():
        lengths = rng.exponential(1.0, (n_clients, width)) * np.where(on_cols, mean_on_s, mean_off_s)
        base = ends[:, -1:] if len(ends.T) else np.zeros((n_clients, 1))
        ends = np.concatenate([ends, base + np.cumsum(lengths, axis=1)], axis=1)
        on = np.concatenate([on, on_cols], axis=1)
    starts = np.concatenate([np.zeros((n_clients, 1)), ends[:, :-1]], axis=1)
    intervals = {c: np.stack([starts[c, on[c]], ends[c, on[c]]], axis=1) for c in range(n_clients)}
    return AvailabilityTrace(intervals, period_s)


def diurnal_trace(
    n_clients: int,
    *,
    mean_availability: float = 0.3,
    amplitude: float = 0.2,
    peak_hour: float = 22.0,
    timezone_spread_h: float = 0.0,
    mean_session_s: float = 3600.0,
    step_s: float = 60.0,
    days: int = 1,
    seed: int = 0,
) -> AvailabilityTrace:
    """Clients whose availability probability follows the day (charging at night, as FedScale's trace).

    Client ``c`` is available at time t with probability about
    ``p(t) = mean_availability + amplitude * cos(2 pi (t / 24 h - (peak_hour + tz_c) / 24))``, clipped to
    [0.01, 0.99]. Each client is a two-state Markov chain stepped every ``step_s``: it leaves after
    sessions of mean ``mean_session_s`` and returns at the rate that keeps ``p(t)`` its stationary
    probability.

    Parameters
    ----------
    n_clients : int
        Clients in the trace.
    mean_availability, amplitude : float
        Mean and half-swing of the availability probability over the day (fractions).
    peak_hour : float (default: 22.0)
        Hour of the day (0-24) of the highest availability.
    timezone_spread_h : float (default: 0.0)
        Each client's peak is shifted by a uniform offset in [-spread/2, spread/2] hours.
    mean_session_s : float (default: 3600.0)
        Mean length of an available session, seconds.
    step_s : float (default: 60.0)
        Time step of the chain, seconds. While it is built the trace takes about 30 bytes a client and
        step (``n_clients * days * 86400 / step_s`` steps; float64 phases, probabilities and join rates
        beside the states): 44 kB a client for a day of minutes, 0.9 GB for 20,000 clients.
    days : int (default: 1)
        The loop length in days.
    seed : int (default: 0)
        The same seed gives the same trace.
    """
    if not (0 < step_s <= mean_session_s and days >= 1):
        raise ConfigError("need 0 < step_s <= mean_session_s and days >= 1")
    rng = np.random.default_rng(seed)
    steps = round(days * DAY_S / step_s)
    tz = (rng.random(n_clients) - 0.5) * timezone_spread_h
    t = np.arange(steps) * step_s
    phase = 2 * np.pi * (t[None, :] / DAY_S - (peak_hour + tz[:, None]) / 24.0)
    p = np.clip(mean_availability + amplitude * np.cos(phase), 0.01, 0.99)
    leave = step_s / mean_session_s
    join = np.minimum(1.0, leave * p / (1 - p))
    state = np.empty((n_clients, steps), dtype=bool)
    state[:, 0] = rng.random(n_clients) < p[:, 0]
    for k in range(1, steps):
        u = rng.random(n_clients)
        state[:, k] = np.where(state[:, k - 1], u >= leave, u < join[:, k])
    edges = np.diff(np.pad(state.astype(np.int8), ((0, 0), (1, 1))), axis=1)
    intervals = {}
    for c in range(n_clients):
        ups, downs = np.flatnonzero(edges[c] == 1), np.flatnonzero(edges[c] == -1)
        intervals[c] = list(zip(ups * step_s, downs * step_s, strict=True))
    return AvailabilityTrace(intervals, steps * step_s)
