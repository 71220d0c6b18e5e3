"""The planner's view of a fleet: how fast each device computes, how much memory it has, how it is linked.

This is deliberately smaller than :class:`fedge.devices.DeviceProfile` (what an agent measures): the planner
needs throughput, a memory cap and a link, nothing else. Devices reach each other through one access point
or switch (a star): a tensor sent from ``a`` to ``b`` costs ``a``'s link to upload and ``b``'s link to
download, so every transfer cost splits into a sender part and a receiver part. That split is what keeps
the planner's state small (a stage's cost depends only on its own device, not on its neighbours').

A fleet file (TOML)::

    source = "camera"          # optional: the device holding the input (others must receive it)

    [[device]]
    name = "camera"
    flops_per_s = 2.5e9
    memory_bytes = 512e6
    bandwidth_bytes_per_s = 2.5e6   # 20 Mbit/s
    latency_s = 0.002
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedge.config import ConfigError, check_types, from_table, read_toml
from fedge.devices.fleet import MAX_LINK_SECONDS

__all__ = ["Device", "Fleet", "Link", "load_fleet"]


@dataclass(frozen=True)
class Link:
    """A device's access link.

    Parameters
    ----------
    bandwidth_bytes_per_s : float (default: 2.5e6, 20 Mbit/s)
        Sustained payload rate, the same up and down.
    latency_s : float (default: 0.0)
        One-way delay added to every message on this link.
    """

    bandwidth_bytes_per_s: float = 2.5e6
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        check_types(self)
        # finite and physical: an infinite latency made every plan infeasible ("no partition fits"), 1e-300
        # bytes/s a 300-digit latency, and a finite 1.7e308 s one overflowed to infinity once summed
        if not (1.0 <= self.bandwidth_bytes_per_s < math.inf and 0 <= self.latency_s <= MAX_LINK_SECONDS):
            raise ConfigError(
                f"bandwidth_bytes_per_s must be >= 1 and finite, latency_s in [0, {MAX_LINK_SECONDS:g}] s;"
                f" got {self.bandwidth_bytes_per_s} and {self.latency_s}"
            )

    def seconds(self, nbytes: float) -> float:
        """Time for ``nbytes`` to cross this link once."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Device:
    """One device as the planner sees it.

    Parameters
    ----------
    name : str
        Unique within the fleet.
    flops_per_s : float
        Effective compute throughput. With a calibration, only its ratio to the calibration host's
        ``flops_per_s`` matters (a device at half the host's figure takes twice the host's measured time).
    memory_bytes : float (default: inf)
        What a stage on this device may use: its weights plus its peak live activations.
    bandwidth_bytes_per_s, latency_s : float (default: 2.5e6, 0.0)
        The device's access link (see :class:`Link`).
    """

    name: str
    flops_per_s: float
    memory_bytes: float = math.inf
    bandwidth_bytes_per_s: float = 2.5e6
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        check_types(self)
        if not self.name or not 1.0 <= self.flops_per_s < math.inf or not self.memory_bytes > 0:
            raise ConfigError(
                f"device {self.name!r}: needs a name, a finite flops_per_s >= 1 and memory_bytes > 0"
            )
        Link(self.bandwidth_bytes_per_s, self.latency_s)  # validates the link fields

    @property
    def link(self) -> Link:
        """The device's access link."""
        return Link(self.bandwidth_bytes_per_s, self.latency_s)


@dataclass(frozen=True)
class Fleet:
    """The devices a model may be spread over (at most one stage per device).

    Parameters
    ----------
    device : tuple of Device
        The devices, in a fixed order (it names them in a plan; it does not constrain the plan).
    source : str or None (default: None)
        The device where inputs arrive. If set, a first stage elsewhere first receives the input over
        the source's and its own link; if None, the input is free wherever the first stage runs.
    """

    device: tuple[Device, ...] = field(default_factory=tuple)
    source: str | None = None

    def __post_init__(self) -> None:
        names = [d.name for d in self.device]
        if not names:
            raise ConfigError("a fleet needs at least one [[device]]")
        if len(set(names)) != len(names):
            raise ConfigError(f"device names must be unique, got {names}")
        if self.source is not None and self.source not in names:
            raise ConfigError(f"source {self.source!r} is not a device of the fleet ({', '.join(names)})")

    @property
    def devices(self) -> tuple[Device, ...]:
        """The devices (plural alias of the TOML key ``device``)."""
        return self.device

    def index(self, name: str) -> int:
        """Position of the device called ``name``."""
        return [d.name for d in self.device].index(name)

    def with_bandwidth(self, bandwidth_bytes_per_s: float | Mapping[str, float]) -> Fleet:
        """The same fleet with new link bandwidths: one figure for all, or a mapping by device name."""
        if isinstance(bandwidth_bytes_per_s, Mapping):
            new = tuple(
                replace(
                    d, bandwidth_bytes_per_s=float(bandwidth_bytes_per_s.get(d.name, d.bandwidth_bytes_per_s))
                )
                for d in self.device
            )
        else:
            new = tuple(replace(d, bandwidth_bytes_per_s=float(bandwidth_bytes_per_s)) for d in self.device)
        return replace(self, device=new)


def load_fleet(source: str | Path | Mapping[str, Any]) -> Fleet:
    """Read a fleet from a TOML file (or an already parsed table); errors name the offending key.

    Parameters
    ----------
    source : path or mapping
        A ``devices.toml`` path, or its parsed table.
    """
    table = read_toml(source) if isinstance(source, str | Path) else source
    return from_table(Fleet, table)
