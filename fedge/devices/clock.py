"""The simulated clock: how long each client's round takes on its device and link, computed, never slept.

A client's round runs download -> decode -> compute -> encode -> upload, back to back from ``start_s``. Each
phase is a number from the client's :class:`~fedge.devices.fleet.ClientProfile` and the round's real sizes
(the engine passes the wire bytes it sent and received and the FLOPs torch counted). Disconnects are drawn
from a generator seeded by the caller, so the same seed gives the same times on every machine.

Then two round-level helpers, pure as well: :func:`select_replies` (synchronous rounds with a deadline and/or
over-selection) and :func:`buffered_schedule` (FedBuff: aggregate every K arrivals, with staleness).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fedge.config import ConfigError
from fedge.devices.fleet import MB, ClientProfile, LinkProfile

__all__ = [
    "PHASES",
    "BufferSchedule",
    "ClientTiming",
    "Flush",
    "RoundOutcome",
    "Update",
    "buffered_schedule",
    "bytes_moved",
    "draw_disconnects",
    "select_replies",
    "staleness_weight",
    "time_client",
    "transfer",
]

PHASES = ("download", "decode", "compute", "encode", "upload")


def transfer(
    nbytes: float,
    bytes_per_s: float,
    *,
    latency_s: float = 0.0,
    disconnects: int = 0,
    resend_window_bytes: int = 16 * 256 * 1024,
    reconnect_s: float = 0.0,
) -> tuple[float, int]:
    """Seconds to move ``nbytes`` over a resumable transfer, and the bytes it re-sent.

    Each disconnect re-sends only the chunks in flight, ``min(resend_window_bytes, nbytes)``, and waits
    ``reconnect_s``; fedge's transport resumes a message after a reconnect rather than restarting it.

    Parameters
    ----------
    nbytes : float
        Payload bytes on the wire.
    bytes_per_s : float
        Link goodput in this direction, bytes/s.
    latency_s : float (default: 0.0)
        One-way latency, seconds, charged once.
    disconnects : int (default: 0)
        Connection losses during the transfer.
    resend_window_bytes : int (default: 4 MiB)
        Bytes in flight that a disconnect forces to be sent again.
    reconnect_s : float (default: 0.0)
        Seconds each reconnect costs.

    Returns
    -------
    seconds : float
        ``latency_s + (nbytes + resent) / bytes_per_s + disconnects * reconnect_s``; 0 when ``nbytes`` is 0.
    resent : int
        ``disconnects * min(resend_window_bytes, nbytes)`` bytes.
    """
    if nbytes <= 0:
        return 0.0, 0
    resent = int(disconnects * min(resend_window_bytes, nbytes))
    return latency_s + (nbytes + resent) / bytes_per_s + disconnects * reconnect_s, resent


def draw_disconnects(link: LinkProfile, nbytes: float, bytes_per_s: float, rng: np.random.Generator) -> int:
    """Disconnects during one transfer: Poisson with mean ``disconnects_per_s * nbytes / bytes_per_s +
    disconnects_per_mb * nbytes / 1e6`` (first order: the re-sent bytes do not add exposure).

    Parameters
    ----------
    link : LinkProfile
        Supplies the two rates.
    nbytes : float
        Payload bytes of the transfer.
    bytes_per_s : float
        The direction's rate, bytes/s.
    rng : numpy.random.Generator
        Drawn from exactly once (also when the mean is 0), so later draws do not shift with the rates.
    """
    mean = link.disconnects_per_s * nbytes / bytes_per_s + link.disconnects_per_mb * nbytes / MB
    return int(rng.poisson(max(mean, 0.0)))


@dataclass(frozen=True)
class ClientTiming:
    """One client's round on the simulated clock (seconds are absolute virtual times or durations).

    Attributes
    ----------
    start_s : float
        When the instruction was sent.
    download_s, decode_s, compute_s, encode_s, upload_s : float
        Duration of each phase, seconds (transfers include latency, re-sends and reconnects).
    arrival_s : float
        When the reply would be complete at the coordinator: start plus every phase.
    cut_off : bool
        True when the client goes away (``away_s``) before ``arrival_s``: its work is lost.
    cut_off_phase : str
        The phase it was in when it went away (one of :data:`PHASES`), "" when not cut off.
    away_s : float
        When its availability ends (``inf``: it stays).
    resent_bytes : int
        Bytes re-sent after disconnects, download and upload together.
    disconnects : int
        Disconnects during the download and the upload.
    """

    start_s: float
    download_s: float
    decode_s: float
    compute_s: float
    encode_s: float
    upload_s: float
    arrival_s: float
    cut_off: bool
    cut_off_phase: str
    away_s: float
    resent_bytes: int
    disconnects: int


def time_client(
    profile: ClientProfile,
    *,
    start_s: float,
    download_bytes: float,
    train_flops: float,
    upload_bytes: float,
    model_bytes: float = 0.0,
    decode_s: float | None = None,
    encode_s: float | None = None,
    away_s: float = math.inf,
    seed: int | Sequence[int] = 0,
) -> ClientTiming:
    """Time one client's round.

    Parameters
    ----------
    profile : ClientProfile
        The client's device and link.
    start_s : float
        Virtual time the instruction leaves the coordinator, seconds.
    download_bytes : float
        Wire bytes of the instruction (the global model or its compressed delta).
    train_flops : float
        FLOPs of the round's local training (forward + backward, all epochs), as torch counts them.
    upload_bytes : float
        Wire bytes of the reply.
    model_bytes : float (default: 0.0)
        Dense fp32 bytes of the model: what decoding writes and encoding reads (see
        :class:`~fedge.devices.fleet.ComputeProfile`). 0 charges no codec time.
    decode_s, encode_s : float, optional
        Measured codec seconds to use instead of ``model_bytes`` over the profile's codec speeds.
    away_s : float (default: inf)
        When the client's availability ends, e.g. ``trace.available_until(client, start_s)``.
    seed : int or sequence of int (default: 0)
        Seeds the disconnect draws; pass e.g. ``(run_seed, round, client_index)`` so each client's draw is
        independent of the order clients are timed in.

    Returns
    -------
    ClientTiming
    """
    if min(download_bytes, train_flops, upload_bytes, model_bytes) < 0:
        raise ConfigError("byte and FLOP counts must be >= 0")
    compute, link = profile.compute, profile.link
    rng = np.random.default_rng(seed)
    down_n = draw_disconnects(link, download_bytes, link.downlink_bytes_per_s, rng)
    up_n = draw_disconnects(link, upload_bytes, link.uplink_bytes_per_s, rng)
    common = {"latency_s": link.latency_s, "resend_window_bytes": link.resend_window_bytes}
    download_s, down_resent = transfer(
        download_bytes, link.downlink_bytes_per_s, disconnects=down_n, reconnect_s=link.reconnect_s, **common
    )
    upload_s, up_resent = transfer(
        upload_bytes, link.uplink_bytes_per_s, disconnects=up_n, reconnect_s=link.reconnect_s, **common
    )
    if decode_s is None:
        decode_s = model_bytes / compute.decode_bytes_per_s
    if encode_s is None:
        encode_s = model_bytes / compute.encode_bytes_per_s
    phases = (download_s, decode_s, train_flops / compute.flops_per_s, encode_s, upload_s)
    ends = start_s + np.cumsum(phases)
    arrival = float(ends[-1])
    cut_off = away_s < arrival
    phase = PHASES[int(np.searchsorted(ends, away_s, side="right"))] if cut_off else ""
    return ClientTiming(
        start_s, download_s, decode_s, phases[2], encode_s, upload_s, arrival, cut_off, phase, away_s,
        down_resent + up_resent, down_n + up_n,
    )  # fmt: skip


@dataclass(frozen=True)
class RoundOutcome:
    """Which replies a synchronous round aggregates.

    Attributes
    ----------
    accepted : tuple
        Clients whose replies are aggregated, by arrival time.
    late : tuple
        Clients that replied after the deadline or after the first ``keep`` (their work is wasted).
    cut_off : tuple
        Clients that went away before replying.
    end_s : float
        When the round ends, seconds (virtual).
    """

    accepted: tuple[Hashable, ...]
    late: tuple[Hashable, ...]
    cut_off: tuple[Hashable, ...]
    end_s: float


def bytes_moved(timing: ClientTiming, download_bytes: int, upload_bytes: int) -> tuple[int, int]:
    """The bytes a client's round moved down and up: all of them, unless it went away first; then the
    share of the transfer it was in that its time covered (none of a transfer it never began).

    A client that was never there moved nothing; the meter had charged the whole round for it.
    """
    if not timing.cut_off:
        return download_bytes, upload_bytes
    upload_start = timing.start_s + timing.download_s + timing.decode_s + timing.compute_s + timing.encode_s

    def share(begin: float, duration: float) -> float:
        if timing.away_s <= begin:
            return 0.0
        return 1.0 if duration <= 0 else min(1.0, (timing.away_s - begin) / duration)

    return (
        int(download_bytes * share(timing.start_s, timing.download_s)),
        int(upload_bytes * share(upload_start, timing.upload_s)),
    )


def select_replies(
    timings: Mapping[Hashable, ClientTiming | float],
    *,
    round_start_s: float,
    deadline_s: float | None = None,
    keep: int | None = None,
) -> RoundOutcome:
    """The replies a round aggregates, and when it ends.

    Parameters
    ----------
    timings : mapping of client to ClientTiming or float
        Each selected client's timing, or just its arrival time (seconds; ``inf`` for a reply that never
        comes). A cut-off client never counts.
    round_start_s : float
        When the round's instructions went out, seconds.
    deadline_s : float, optional
        Seconds after ``round_start_s`` after which replies are dropped.
    keep : int, optional
        Over-selection: aggregate the first ``keep`` replies of the M selected (FedScale's
        ``overcommitment``) and end the round at the ``keep``-th.

    Returns
    -------
    RoundOutcome
        The round ends at the ``keep``-th accepted arrival; otherwise at the last arrival when every selected
        client replied in time; otherwise at the deadline. Without a deadline it ends at the last accepted
        arrival: like FedScale, the simulation knows who dropped out (a real server waits for its timeout);
        with none accepted, when the last cut-off client went away (a round where everyone left took the
        time they trained for before leaving, not none: the clock stood still and the run repeated it).
        Ties in arrival keep the mapping's order.
    """
    if keep is not None and keep < 1:
        raise ConfigError(f"keep must be >= 1, got {keep}")
    limit = math.inf if deadline_s is None else round_start_s + deadline_s
    arrived, cut = [], []
    for client, timing in timings.items():
        if isinstance(timing, ClientTiming):
            arrival, lost = timing.arrival_s, timing.cut_off
        else:
            arrival, lost = float(timing), False
        lost = lost or not math.isfinite(arrival)  # a reply at t = inf (or NaN) never comes
        (cut if lost else arrived).append((arrival, client))
    arrived.sort(key=lambda pair: pair[0])  # stable: ties keep the mapping's order
    in_time = [(a, c) for a, c in arrived if a <= limit]
    accepted = in_time[:keep] if keep is not None else in_time
    if keep is not None and len(accepted) == keep:
        end = accepted[-1][0]
    elif len(in_time) == len(timings):
        end = in_time[-1][0] if in_time else round_start_s
    elif deadline_s is not None:
        end = limit
    elif accepted:
        end = accepted[-1][0]
    else:
        gone = [t.away_s for t in timings.values() if isinstance(t, ClientTiming) and t.cut_off]
        end = max([round_start_s, *(a for a in gone if math.isfinite(a))])
    late = tuple(c for _, c in arrived[len(accepted) :])  # in_time, hence accepted, is a prefix of arrived
    return RoundOutcome(tuple(c for _, c in accepted), late, tuple(c for _, c in cut), float(end))


class Update(NamedTuple):
    """One asynchronous update: ``client`` started training at ``start_s`` and its reply arrived at
    ``arrival_s`` (seconds)."""

    client: Hashable
    start_s: float
    arrival_s: float


@dataclass(frozen=True)
class Flush:
    """One FedBuff aggregation.

    Attributes
    ----------
    time_s : float
        When it happens: the arrival of the buffer's last update, seconds.
    version : int
        The model version it produces (it is applied to ``version - 1``).
    updates : tuple of Update
        The buffered updates, by arrival.
    staleness : tuple of int
        Per update, versions between the model it trained on and the one it is applied to (0: fresh).
    """

    time_s: float
    version: int
    updates: tuple[Update, ...]
    staleness: tuple[int, ...]


@dataclass(frozen=True)
class BufferSchedule:
    """:func:`buffered_schedule`'s answer: the flushes, and the updates still buffered at the end."""

    flushes: tuple[Flush, ...]
    pending: tuple[Update, ...]


def buffered_schedule(
    updates: Sequence[Update | tuple[Hashable, float, float]], buffer_size: int, *, initial_version: int = 0
) -> BufferSchedule:
    """FedBuff's event clock: aggregate every ``buffer_size`` arrivals; report each update's staleness.

    Parameters
    ----------
    updates : sequence of Update or (client, start_s, arrival_s)
        Every reply that arrives (leave out cut-off clients). A client may appear more than once.
    buffer_size : int
        K: updates per aggregation.
    initial_version : int (default: 0)
        Version of the model before the first flush.

    Returns
    -------
    BufferSchedule
        An update trained on the newest version flushed at or before its ``start_s``; its staleness is the
        version it is applied to minus that one. Ties in arrival keep the input order.
    """
    if buffer_size < 1:
        raise ConfigError(f"buffer_size must be >= 1, got {buffer_size}")
    ordered = sorted((Update(*u) for u in updates), key=lambda u: u.arrival_s)
    groups = [ordered[i : i + buffer_size] for i in range(0, len(ordered) - buffer_size + 1, buffer_size)]
    times = np.array([g[-1].arrival_s for g in groups])
    flushes = []
    for j, group in enumerate(groups):
        applied_to = initial_version + j
        trained_on = initial_version + np.searchsorted(times, [u.start_s for u in group], side="right")
        staleness = tuple(int(s) for s in applied_to - trained_on)
        flushes.append(Flush(float(times[j]), applied_to + 1, tuple(group), staleness))
    return BufferSchedule(tuple(flushes), tuple(ordered[len(groups) * buffer_size :]))


def staleness_weight(staleness: int | np.ndarray, exponent: float = 0.5) -> float | np.ndarray:
    """FedBuff's down-weighting of a stale update: ``(1 + staleness) ** -exponent`` (the paper uses 0.5)."""
    weight = np.power(1.0 + np.asarray(staleness, dtype=np.float64), -exponent)
    return float(weight) if weight.ndim == 0 else weight
