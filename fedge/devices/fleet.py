"""Heterogeneous fleets: what each client computes and how its link behaves, a catalogue of device classes,
and a seeded assignment of classes to N clients from a TOML table.

Every figure is in SI units: FLOP/s, bytes, bytes/s, seconds. ``docs/devices.md`` gives the source of every
catalogue figure and says which are estimates::

    [fleet]
    mix = {pi4_wifi = 0.4, phone_lte = 0.4, nbiot_gateway = 0.2}
    seed = 3

    fleet = from_table(FleetConfig, read_toml(path)["fleet"], where="fleet")
    profiles = assign_fleet(fleet, 1000)      # one ClientProfile per client, same seed -> same fleet
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.config import ConfigError, check_types, from_table, shown
from fedge.devices.profile import DeviceProfile

__all__ = [
    "CATALOGUE",
    "MB",
    "ClientProfile",
    "ComputeProfile",
    "FleetConfig",
    "LinkProfile",
    "assign_fleet",
    "fleet_counts",
    "mbit_per_s",
]

MB = 1_000_000
"""Bytes in a megabyte (decimal, as link rates and ``disconnects_per_mb`` use)."""


def mbit_per_s(mbit: float) -> float:
    """A link rate in Mbit/s as bytes/s (``mbit_per_s(8) == 1e6``)."""
    return mbit * 1e6 / 8


@dataclass(frozen=True)
class ComputeProfile:
    """What a device's CPU does for fedge.

    Parameters
    ----------
    flops_per_s : float
        FLOP/s the device sustains while training (forward + backward + optimizer step), not its peak.
    memory_bytes : int
        Bytes available for training once the OS and fedge's runtime are resident.
    encode_bytes_per_s : float
        Speed of fedge's codec encoding an update, in bytes/s of the *dense* fp32 update it reads (a top-k
        encoder's work scales with the dense input, not with its small output).
    decode_bytes_per_s : float
        Speed of decoding the downloaded model, in bytes/s of the dense fp32 tensors it writes.
    """

    flops_per_s: float
    memory_bytes: int
    encode_bytes_per_s: float
    decode_bytes_per_s: float

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("flops_per_s", "encode_bytes_per_s", "decode_bytes_per_s"):
            # below 1 a second is no device (1e-300 gave 1e305-second rounds); infinite is no device either
            if not 1.0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be >= 1 and finite, got {getattr(self, name)}")
        if not 0 <= self.memory_bytes < math.inf:
            raise ConfigError(f"memory_bytes must be >= 0 and finite, got {self.memory_bytes}")

    @classmethod
    def from_device(
        cls,
        device: DeviceProfile,
        *,
        flops_per_s: float,
        encode_bytes_per_s: float,
        decode_bytes_per_s: float,
    ) -> ComputeProfile:
        """A compute profile whose memory is what an agent measured free (``memory_available_mb``).

        Parameters
        ----------
        device : DeviceProfile
            The profile an agent reported; its ``memory_available_mb`` (MiB) becomes ``memory_bytes``.
        flops_per_s, encode_bytes_per_s, decode_bytes_per_s : float
            As in the class (FLOP/s, bytes/s, bytes/s); agents do not measure them yet.
        """
        return cls(flops_per_s, device.memory_available_mb * 2**20, encode_bytes_per_s, decode_bytes_per_s)


@dataclass(frozen=True)
class LinkProfile:
    """A client's network link, each direction on its own.

    Parameters
    ----------
    uplink_bytes_per_s, downlink_bytes_per_s : float
        Sustained goodput client -> coordinator and coordinator -> client, bytes/s.
    latency_s : float (default: 0.0)
        One-way latency, seconds, charged once per transfer (the last byte arrives this long after it left).
    disconnects_per_s : float (default: 0.0)
        Connection losses per second of transfer time.
    disconnects_per_mb : float (default: 0.0)
        Connection losses per MB (10^6 bytes) transferred; adds to ``disconnects_per_s``.
    reconnect_s : float (default: 0.0)
        Seconds a reconnect costs (back-off, TCP/TLS/MQTT handshakes) before the transfer resumes.
    resend_window_bytes : int (default: 4 MiB)
        Bytes a resumable transfer re-sends after a disconnect: the unacknowledged chunks in flight, at most
        ``window * chunk_size`` (fedge's transport defaults: 16 x 256 KiB).
    """

    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    latency_s: float = 0.0
    disconnects_per_s: float = 0.0
    disconnects_per_mb: float = 0.0
    reconnect_s: float = 0.0
    resend_window_bytes: int = 16 * 256 * 1024

    @classmethod
    def from_device(cls, device: DeviceProfile) -> LinkProfile | None:
        """The link an agent reported (its ``[link]`` table), or None when it reported no bandwidths."""
        if not (device.uplink_mbit_s > 0 and device.downlink_mbit_s > 0):
            return None
        return cls(
            mbit_per_s(device.uplink_mbit_s), mbit_per_s(device.downlink_mbit_s), device.latency_ms / 1000
        )

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("uplink_bytes_per_s", "downlink_bytes_per_s"):
            if not 1.0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be >= 1 and finite, got {getattr(self, name)}")
        for name in ("latency_s", "reconnect_s"):  # an infinite one put replies at t = inf, "accepted"
            # and a finite 1e308 did too, once the clock added it to something
            if not 0 <= getattr(self, name) <= MAX_LINK_SECONDS:
                value = getattr(self, name)
                raise ConfigError(f"{name} must be in [0, {MAX_LINK_SECONDS:g}] seconds, got {value}")
        for name in ("disconnects_per_s", "disconnects_per_mb"):  # beyond, the Poisson draw overflows
            if not 0 <= getattr(self, name) <= _MAX_DISCONNECT_RATE:
                raise ConfigError(
                    f"{name} must be in [0, {_MAX_DISCONNECT_RATE:g}], got {getattr(self, name)}"
                )
        if self.resend_window_bytes < 1:
            raise ConfigError(f"resend_window_bytes must be >= 1, got {self.resend_window_bytes}")


@dataclass(frozen=True)
class ClientProfile:
    """One simulated client: a device class on a link.

    Parameters
    ----------
    compute : ComputeProfile
        The device.
    link : LinkProfile
        Its network link.
    name : str (default: "")
        The class name (a :data:`CATALOGUE` key or a ``[fleet.classes]`` key), for reports.
    """

    compute: ComputeProfile
    link: LinkProfile
    name: str = ""

    def __post_init__(self) -> None:
        check_types(self)


MAX_LINK_SECONDS = 1e6  # a link's latency or reconnect time, at most (11.6 days): sums stay finite
_FLOAT_MAX = float(np.finfo(np.float64).max)  # a share beyond it (a 400-digit integer) does not convert
_MAX_DISCONNECT_RATE = 1000.0  # per second or per MB: a link that drops a thousand times a second is down

MiB = 2**20
_MBIT = mbit_per_s(1)

# Every figure is sourced (or marked as an estimate) in docs/devices.md, row by row. Encode/decode
# speeds scale fedge's measured topk:0.01+int8 speed on an x86 server core (1.2 GB/s encode, 4.9 GB/s
# decode) by the device's estimated single-core speed relative to it.
# fmt: off
_ROWS = (
    # name             FLOP/s  MiB    enc B/s  dec B/s  up Mb/s  down   lat. s  disc./s   reconn. s  win KiB
    ("pi4_wifi",        2.0e9,  3072,  200e6,   800e6,   30,      40,    0.005,  1 / 3600, 1.0,       4096),
    ("pizero2_wifi",    0.5e9,  160,   100e6,   400e6,   15,      20,    0.010,  1 / 1800, 1.5,       4096),
    ("phone_lte",       4.0e9,  1024,  400e6,   1600e6,  8,       30,    0.025,  1 / 600,  2.0,       4096),
    ("jetson_nano_eth", 2.5e9,  2048,  170e6,   700e6,   900,     900,   0.0005, 0.0,      0.0,       4096),
    ("ltem_gateway",    0.5e9,  160,   80e6,    320e6,   0.375,   0.5,   0.1,    1 / 900,  5.0,       64),
    ("nbiot_gateway",   0.5e9,  160,   80e6,    320e6,   0.02,    0.025, 1.0,    1 / 600,  10.0,      16),
    ("server",          50e9,   16384, 1200e6,  4800e6,  9400,    9400,  0.0002, 0.0,      0.0,       4096),
)
# fmt: on
CATALOGUE: Mapping[str, ClientProfile] = {
    name: ClientProfile(
        ComputeProfile(flops, memory * MiB, encode, decode),
        LinkProfile(up * _MBIT, down * _MBIT, latency, disc, 0.0, reconnect, window * 1024),
        name,
    )
    for name, flops, memory, encode, decode, up, down, latency, disc, reconnect, window in _ROWS
}
"""The built-in device classes by name (see ``docs/devices.md`` for every figure's source)."""


@dataclass(frozen=True)
class FleetConfig:
    """A fleet: which classes, in which proportions, assigned with which seed (the ``[fleet]`` table).

    Parameters
    ----------
    mix : dict of str to float
        Class name -> share of the clients. Shares are >= 0 and normalised, so ``{a = 2, b = 1}`` is 2/3 a.
    seed : int (default: 0)
        Seeds which client gets which class.
    classes : dict of str to table (default: {})
        Classes beyond :data:`CATALOGUE` (or replacing one of its names), each a :class:`ClientProfile`
        table: ``[fleet.classes.my_board] compute = {...}``, ``link = {...}``. Stored as ClientProfiles.
    """

    mix: dict[str, float]
    seed: int = 0
    classes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self)
        classes = {}
        for name, table in self.classes.items():
            if isinstance(table, ClientProfile):
                classes[name] = dataclasses.replace(table, name=name)
            elif not isinstance(table, Mapping):
                raise ConfigError(f"classes.{name} must be a table with compute and link, got {table!r}")
            else:
                profile = from_table(ClientProfile, {"name": name, **table}, where=f"classes.{name}")
                classes[name] = profile
        object.__setattr__(self, "classes", classes)
        if not self.mix:
            raise ConfigError("mix must name at least one class")
        known = {**CATALOGUE, **classes}
        mix = {}
        for name, share in self.mix.items():
            if name not in known:
                raise ConfigError(f"mix.{name} is not a known class; known: {', '.join(sorted(known))}")
            if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < _FLOAT_MAX:
                raise ConfigError(f"mix.{name} must be a finite number >= 0, got {shown(share)}")
            mix[name] = float(share)
        if not 0 < sum(mix.values()) < math.inf:
            raise ConfigError("mix shares must not all be 0, nor sum beyond a float")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        object.__setattr__(self, "mix", mix)

    def profile(self, name: str) -> ClientProfile:
        """The class ``name``: from ``classes`` first, then :data:`CATALOGUE`."""
        return self.classes.get(name) or CATALOGUE[name]


def fleet_counts(mix: Mapping[str, float], n_clients: int) -> dict[str, int]:
    """How many of ``n_clients`` each class gets: exact proportions, rounded by largest remainder.

    Parameters
    ----------
    mix : mapping of str to float
        Class name -> share (>= 0, normalised here).
    n_clients : int
        Clients to share out.

    Returns
    -------
    dict of str to int
        Counts summing to ``n_clients``; each within 1 of ``n_clients * share``. Ties in the remainder go to
        the class named first in ``mix`` (so the counts do not depend on the seed).
    """
    if n_clients < 0:
        raise ConfigError(f"n_clients must be >= 0, got {n_clients}")
    total = sum(mix.values())
    quotas = {name: n_clients * share / total for name, share in mix.items()}
    counts = {name: int(q) for name, q in quotas.items()}
    order = sorted(mix, key=lambda name: -(quotas[name] - counts[name]))  # stable: mix order breaks ties
    for name in order[: n_clients - sum(counts.values())]:
        counts[name] += 1
    return counts


def assign_fleet(
    config: FleetConfig, n_clients: int, *, seed: int | None = None
) -> tuple[ClientProfile, ...]:
    """One profile per client: counts from :func:`fleet_counts`, positions shuffled by the seed.

    Parameters
    ----------
    config : FleetConfig
        The mix and the classes.
    n_clients : int
        Clients in the run; client ``i`` gets element ``i``.
    seed : int, optional
        Overrides ``config.seed`` (e.g. the run's seed).

    Returns
    -------
    tuple of ClientProfile
        The same for the same config, ``n_clients`` and seed, on every machine.
    """
    counts = fleet_counts(config.mix, n_clients)
    names = [name for name, count in counts.items() for _ in range(count)]
    rng = np.random.default_rng(config.seed if seed is None else seed)
    return tuple(config.profile(names[i]) for i in rng.permutation(n_clients))
