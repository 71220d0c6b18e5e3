"""Client availability over time: FedScale's trace files (read safely) and seeded synthetic traces.

A trace gives each client intervals ``[start, end)`` (seconds) in which it is available within a period;
like FedScale, the trace loops modulo each client's period (its ``finish_time``). Synthetic traces
are in :mod:`fedge.devices.synthetic`. Queries are vectorised over
every client at once, so asking a 100k-client trace "who is here at t?" is one ``searchsorted``.

FedScale's files are pickles, and unpickling runs code named in the file. :func:`read_availability` and
:func:`read_capacity` therefore use :class:`RestrictedUnpickler`, which resolves no global at all except the
builtins ``dict``, ``list``, ``int``, ``float`` and ``str``: a file naming ``os.system`` (or numpy, or any
class) is refused with :class:`TraceError` before anything runs.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fedge.config import ConfigError, shown
from fedge.devices.fleet import ClientProfile

__all__ = [
    "MAX_TRACE_BYTES",
    "MAX_TRACE_INTERVALS",
    "AvailabilityTrace",
    "Capacity",
    "RestrictedUnpickler",
    "TraceError",
    "read_availability",
    "read_capacity",
    "safe_unpickle",
]

log = logging.getLogger(__name__)

MAX_TRACE_BYTES = 1 << 30
"""Trace files larger than this (bytes) are refused before they are read."""
MAX_TRACE_INTERVALS = 10_000_000
"""Availability intervals a trace may hold, all clients together (about 2 GB while read). A pickle stores an
object once however often it is referred to: a 460 kB file whose 20,000 clients all named one list of 20,000
intervals stood for 400 million of them (tens of GB); each use counts."""


class TraceError(ConfigError):
    """A trace file that cannot be used; the message says why."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only plain data: dicts, lists, tuples, ints, floats, strings, bools, None.

    Those are pickled as opcodes, never as globals; the only globals resolved are the builtins
    ``dict``/``list``/``int``/``float``/``str`` (older protocols name them). Anything else -- ``os.system``,
    ``builtins.eval``, a numpy array, any class -- raises :class:`TraceError`.
    """

    ALLOWED = frozenset({("builtins", n) for n in ("dict", "list", "int", "float", "str")})

    def find_class(self, module: str, name: str) -> type:
        if (module, name) in self.ALLOWED:
            return getattr(__import__("builtins"), name)
        raise TraceError(
            f"trace pickle names {module}.{name}; only plain dicts, lists and numbers are allowed"
        )


def safe_unpickle(data: bytes) -> object:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`; any failure is a :class:`TraceError`."""
    try:
        return RestrictedUnpickler(io.BytesIO(data)).load()
    except TraceError:
        raise
    except Exception as err:  # a corrupt pickle raises almost anything; report one error type
        raise TraceError(f"trace is not a valid pickle: {err}") from None


def _read(path: str | Path, max_bytes: int) -> object:
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise TraceError(f"trace {path} is {size} bytes, more than {max_bytes}")
        data = path.read_bytes()
    except OSError as err:
        raise TraceError(f"trace {path} cannot be read: {err}") from None
    # A pickle of protocol 2 or later starts with PROTO (0x80); one of protocol 0 or 1 ends with STOP ('.').
    # Anything else (a TOML file given by mistake) would fail on whatever its bytes spell as opcodes.
    if not (data.startswith(b"\x80") or data.endswith(b".")):
        raise TraceError(f"{path} is not a pickle (FedScale's traces are pickled dicts)")
    try:
        return safe_unpickle(data)
    except TraceError as err:
        raise TraceError(f"{path}: {err}") from None


def _number(value: object, what: str) -> float:
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)  # an int beyond float's range overflows here
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise TraceError(f"{what} must be a finite number, got {shown(value)}")


@dataclass(frozen=True)
class Capacity:
    """One client's entry in FedScale's capacity trace.

    Parameters
    ----------
    computation_ms : float
        Milliseconds per sample (FedScale charges 3x this per trained sample: forward plus backward).
    communication_kbit_per_s : float
        Bandwidth in kbit/s, the same both ways.
    """

    computation_ms: float
    communication_kbit_per_s: float

    def to_profile(self, base: ClientProfile, *, reference_forward_flops: float) -> ClientProfile:
        """``base`` with this entry's compute speed and (symmetric) bandwidth.

        Parameters
        ----------
        base : ClientProfile
            Supplies memory, codec speeds, latency and disconnects, which FedScale's trace lacks.
        reference_forward_flops : float
            Forward FLOPs per sample of the model the trace's milliseconds stand for (FedScale does not say;
            an assumption of the run). Then
            ``flops_per_s = reference_forward_flops / (computation_ms / 1000)``,
            so a model with those FLOPs trains in FedScale's 3 x ms per sample.
        """
        compute = replace(base.compute, flops_per_s=reference_forward_flops * 1000.0 / self.computation_ms)
        rate = self.communication_kbit_per_s * 1000.0 / 8
        link = replace(base.link, uplink_bytes_per_s=rate, downlink_bytes_per_s=rate)
        return replace(base, compute=compute, link=link)


def read_capacity(path: str | Path, *, max_bytes: int = MAX_TRACE_BYTES) -> dict[Hashable, Capacity]:
    """Read FedScale's capacity pickle: ``client_id -> {"computation": ms, "communication": kbit/s}``."""
    table = _read(path, max_bytes)
    if not isinstance(table, dict):
        raise TraceError(f"{path}: capacity trace must be a dict, got {type(table).__name__}")
    out = {}
    for client, entry in table.items():
        if not isinstance(entry, dict):
            raise TraceError(f"{path}: client {shown(client)} must map to a dict")
        try:
            comp = _number(entry["computation"], f"client {shown(client)} computation")
            comm = _number(entry["communication"], f"client {shown(client)} communication")
        except KeyError as err:
            raise TraceError(f"{path}: client {shown(client)} lacks {err}") from None
        if comp <= 0 or comm <= 0:
            raise TraceError(f"{path}: client {shown(client)} has a non-positive speed")
        out[client] = Capacity(comp, comm)
    return out


def read_availability(path: str | Path, *, max_bytes: int = MAX_TRACE_BYTES) -> AvailabilityTrace:
    """Read FedScale's availability pickle into an :class:`AvailabilityTrace`.

    The file maps ``client_id -> {"duration", "active": [...], "inactive": [...], "finish_time"}``: client
    becomes available at ``active[i]`` and goes away at ``inactive[i]`` (seconds); the trace loops modulo
    ``finish_time`` (``duration`` when ``finish_time`` is missing or 0).
    """
    table = _read(path, max_bytes)
    if not isinstance(table, dict):
        raise TraceError(f"{path}: availability trace must be a dict, got {type(table).__name__}")
    if not table:
        raise TraceError(f"{path}: availability trace has no clients")
    # counted before any is built: a shared entry's intervals are cheap to count, dear to build
    total = sum(
        len(e["active"]) for e in table.values() if isinstance(e, dict) and isinstance(e.get("active"), list)
    )
    if total > MAX_TRACE_INTERVALS:
        raise TraceError(
            f"{path}: the trace holds {total:,} availability intervals, more than {MAX_TRACE_INTERVALS:,} "
            "(its clients' together, an entry counted for every client that names it)"
        )
    intervals, periods, past = {}, {}, []
    for client, entry in table.items():
        named = f"{path}: client {shown(client)}"
        if not isinstance(entry, dict):
            raise TraceError(f"{named} must map to a dict")
        active, inactive = entry.get("active"), entry.get("inactive")
        if not isinstance(active, list) or not isinstance(inactive, list) or len(active) != len(inactive):
            raise TraceError(f"{named} needs 'active' and 'inactive' lists of equal length")
        starts_named, ends_named = f"{named} active", f"{named} inactive"
        starts = [_number(v, starts_named) for v in active]
        ends = [_number(v, ends_named) for v in inactive]
        for start, end in zip(starts, ends, strict=True):  # a reversed or empty interval is a broken trace
            if not 0 <= start < end:
                raise TraceError(
                    f"{named} has the interval [{start:g}, {end:g}): want 0 <= active < inactive"
                )
        period = _number(entry.get("finish_time") or entry.get("duration") or 0, f"{named} finish_time")
        if period < 0:
            raise TraceError(f"{named} has a negative finish_time or duration")
        if period == 0:
            period = max(ends, default=0.0)
        if period <= 0:
            raise TraceError(f"{named} has no positive finish_time or duration")
        if starts and min(starts) >= period:  # the trace loops before any of them: the client never comes
            past.append(client)
        intervals[client], periods[client] = list(zip(starts, ends, strict=True)), period
    if past:
        log.warning(
            "%s: %d of %d clients (first %s) are available only after their finish_time, where the trace "
            "loops: they are never available",
            path,
            len(past),
            len(table),
            shown(past[0]),
        )
    return AvailabilityTrace(intervals, periods)


_LINE_LIMIT_S = float(2**52)  # seconds the clients' periods may add up to (float64 still resolves 1 s there)


class AvailabilityTrace:
    """Per-client availability intervals, looping with a per-client period.

    Parameters
    ----------
    intervals : mapping of client to sequence of (start_s, end_s)
        When each client is available within its period, in seconds. Overlapping or touching intervals are
        merged; parts outside ``[0, period)`` are clipped.
    period_s : float or mapping of client to float
        Each client's loop length, seconds (FedScale's ``finish_time``).
    """

    def __init__(
        self, intervals: Mapping[Hashable, Sequence[tuple[float, float]]], period_s: float | Mapping
    ) -> None:
        self.clients: tuple[Hashable, ...] = tuple(intervals)
        self._index = {c: i for i, c in enumerate(self.clients)}
        periods = np.array(
            [period_s[c] if isinstance(period_s, Mapping) else period_s for c in self.clients],
            dtype=np.float64,
        )
        if len(periods) and not np.all(periods > 0):
            raise TraceError("every period must be > 0")
        # The line below must tell apart seconds (the 1 s gap between clients, say): float64 does up to 2**52.
        if len(periods) and float(np.sum(periods + 1.0)) >= _LINE_LIMIT_S:
            raise TraceError(
                f"the clients' periods add up to {float(np.sum(periods)):.3g} s, over {_LINE_LIMIT_S:.3g} s "
                f"(for {len(periods)} clients, periods of at most {_LINE_LIMIT_S / len(periods):.3g} s)"
            )
        # Lay the clients end to end on one line, client i owning [offset[i], offset[i] + period[i]): one
        # searchsorted then answers a query for every client at once.
        self._period = periods
        self._offset = np.concatenate([[0.0], np.cumsum(periods + 1.0)])[:-1]
        pairs = [np.asarray(intervals[c], dtype=np.float64).reshape(-1, 2) for c in self.clients]
        rows = np.repeat(np.arange(len(pairs)), [len(p) for p in pairs])
        flat = np.concatenate(pairs) if pairs else np.empty((0, 2))
        merged = _merge(flat, rows, periods, self._offset)
        self._starts, self._ends, self._owner, self._local_starts, self._local_ends = merged
        self._first = np.searchsorted(self._owner, np.arange(len(self.clients)))  # client's first interval
        self._count = np.bincount(self._owner, minlength=len(self.clients))

    def __len__(self) -> int:
        return len(self.clients)

    def _rows(self, client: Hashable | None) -> np.ndarray:
        if client is None:
            return np.arange(len(self.clients))
        try:
            return np.array([self._index[client]])
        except KeyError:
            raise KeyError(f"client {shown(client)} is not in the trace") from None

    def _locate(self, rows: np.ndarray, t_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per row: loop base (s), position on the line, last interval starting <= it, available."""
        base = np.floor(t_s / self._period[rows]) * self._period[rows]
        pos = self._offset[rows] + (t_s - base)
        j = np.searchsorted(self._starts, pos, side="right") - 1
        jc = np.clip(j, 0, max(len(self._starts) - 1, 0))
        ok = (j >= 0) & (self._owner[jc] == rows) & (pos < self._ends[jc]) if len(self._starts) else j < -1
        return base, pos, j, ok

    def available(self, t_s: float) -> np.ndarray:
        """Whether each client (in :attr:`clients` order) is available at time ``t_s`` (seconds): bools."""
        return self._locate(self._rows(None), t_s)[3]

    def is_available(self, client: Hashable, t_s: float) -> bool:
        """Whether ``client`` is available at time ``t_s`` (seconds)."""
        return bool(self._locate(self._rows(client), t_s)[3][0])

    def fraction_available(self, t_s: float) -> float:
        """The fraction of the trace's clients available at time ``t_s`` (seconds)."""
        return float(self.available(t_s).mean()) if self.clients else 0.0

    def available_until(self, client: Hashable, t_s: float) -> float:
        """When ``client``'s current available interval ends (seconds); ``t_s`` if it is away now, and
        ``inf`` if it is always available."""
        rows = self._rows(client)
        base, _, j, ok = self._locate(rows, t_s)
        if not ok[0]:
            return t_s
        first, period = self._first[rows[0]], self._period[rows[0]]
        # within the client's own loop (the shared line's offset subtracted back is off by a rounding: an
        # interval ending at a period of 1000.1 s ended at 1000.0999999999999, and its client left each loop)
        end = self._local_ends[j[0]]
        if end < period:
            return float(base[0] + end)
        # The interval runs to the end of the loop: it continues if the loop starts available.
        first_start, first_end = self._local_starts[first], self._local_ends[first]
        if first_start > 0:
            return float(base[0] + period)
        if first_end >= period:  # available for the whole loop
            return math.inf
        return float(base[0] + period + first_end)

    def next_available(self, client: Hashable, t_s: float) -> float:
        """When ``client`` is next available (seconds): ``t_s`` if it is now, ``inf`` if never."""
        rows = self._rows(client)
        base, _, j, ok = self._locate(rows, t_s)
        if ok[0]:
            return t_s
        i = rows[0]
        if self._count[i] == 0:
            return math.inf
        nxt = j[0] + 1
        if nxt < len(self._starts) and self._owner[nxt] == i:
            return float(base[0] + self._local_starts[nxt])
        return float(base[0] + self._period[i] + self._local_starts[self._first[i]])

    def remap(self, n_clients: int, *, seed: int = 0) -> AvailabilityTrace:
        """A trace for clients ``0..n_clients-1``, each given a distinct trace client chosen by ``seed``
        (with repetition only when the trace has fewer clients than ``n_clients``)."""
        rng = np.random.default_rng(seed)
        if n_clients > len(self.clients):  # the docs promise distinct clients: say when they cannot be
            log.warning(
                "the availability trace holds %d clients for %d run clients: some run clients share a trace "
                "client's availability",
                len(self.clients),
                n_clients,
            )
        picks = rng.choice(len(self.clients), n_clients, replace=n_clients > len(self.clients))
        intervals, periods = {}, {}
        for new, row in enumerate(picks):
            lo = self._first[row]
            sl = slice(lo, lo + self._count[row])
            intervals[new] = list(zip(self._local_starts[sl], self._local_ends[sl], strict=True))
            periods[new] = float(self._period[row])
        return AvailabilityTrace(intervals, periods)


def _merge(
    flat: np.ndarray, rows: np.ndarray, periods: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Clip each client's intervals to its period, move them onto the shared line, and merge overlapping or
    touching ones: sorted starts, ends and owning rows on the line, and the same starts and ends within
    each client's own loop (exact, unlike the line's minus the offset). Vectorised, as FedScale traces hold
    millions."""
    local_lo = np.maximum(flat[:, 0], 0.0)
    local_hi = np.minimum(flat[:, 1], periods[rows])
    keep = local_hi > local_lo
    local_lo, local_hi, rows = local_lo[keep], local_hi[keep], rows[keep]
    # Clients sit >= 1 s apart on the line, so intervals of different clients never merge.
    lo, hi = local_lo + offsets[rows], local_hi + offsets[rows]
    order = np.argsort(lo, kind="stable")
    lo, hi, rows, local_lo, local_hi = lo[order], hi[order], rows[order], local_lo[order], local_hi[order]
    if not len(lo):
        return lo, hi, rows.astype(np.int64), local_lo, local_hi
    reach = np.maximum.accumulate(hi)
    new = np.ones(len(lo), dtype=bool)
    new[1:] = lo[1:] > reach[:-1]
    heads = np.flatnonzero(new)
    return (
        lo[heads],
        np.maximum.reduceat(hi, heads),
        rows[heads].astype(np.int64),
        local_lo[heads],
        np.maximum.reduceat(local_hi, heads),
    )
