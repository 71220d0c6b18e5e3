"""A device's profile: what the coordinator may use to schedule it, measured on an agent or declared.

An agent measures its own profile (:func:`measure_device`) and reports it when it connects; a simulation
declares one per virtual client. Both are the same :class:`DeviceProfile`, so a real fleet and a simulated
one are described alike. On the wire a profile is a small JSON object (message id
:data:`fedge.protocol.fleet.PROFILE_PREFIX` + session epoch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from fedge.config import ConfigError, from_table

__all__ = ["MAX_PROFILE_BYTES", "DeviceProfile", "measure_device"]

MAX_PROFILE_BYTES = 16 * 1024
"""Profiles larger than this are refused before they are parsed."""


@dataclass(frozen=True)
class DeviceProfile:
    """What one device offers.

    Parameters
    ----------
    cpus : int (default: 1)
        CPUs the device's processes may use.
    memory_total_mb, memory_available_mb : int (default: 0)
        Physical memory, and what was free when measured (0: unknown).
    platform, machine, python : str (default: "")
        Operating system, CPU architecture and Python version, as :mod:`platform` reports them.
    uplink_mbit_s, downlink_mbit_s : float (default: 0.0)
        The device's link each way, Mbit/s, as its operator declared it (an agent's ``[link]`` table;
        measuring it would cost the link what it measures); 0: unknown.
    latency_ms : float (default: 0.0)
        One-way latency of that link, milliseconds.
    """

    cpus: int = 1
    memory_total_mb: int = 0
    memory_available_mb: int = 0
    platform: str = ""
    machine: str = ""
    python: str = ""
    uplink_mbit_s: float = 0.0
    downlink_mbit_s: float = 0.0
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.cpus < 1:
            raise ConfigError(f"cpus must be >= 1, got {self.cpus}")
        if self.memory_total_mb < 0 or self.memory_available_mb < 0:
            raise ConfigError("memory figures must be >= 0")
        for name in ("uplink_mbit_s", "downlink_mbit_s", "latency_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e9):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> DeviceProfile:
        """Parse a reported profile; raise :class:`ConfigError` naming what is wrong.

        Keys this version does not know are ignored, so newer agents can report more.
        """
        if len(data) > MAX_PROFILE_BYTES:
            raise ConfigError(f"profile of {len(data)} bytes exceeds {MAX_PROFILE_BYTES}")
        try:
            table = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # [[[[... nests past the stack
            raise ConfigError(f"profile is not JSON: {type(err).__name__}: {err}"[:200]) from None
        if not isinstance(table, Mapping):
            raise ConfigError("profile is not a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        return from_table(cls, {k: v for k, v in table.items() if k in known}, where="profile")


def measure_device() -> DeviceProfile:
    """This machine's profile."""
    memory = psutil.virtual_memory()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return DeviceProfile(
        cpus=cpus,
        memory_total_mb=memory.total // 2**20,
        memory_available_mb=memory.available // 2**20,
        platform=platform.platform(),
        machine=platform.machine(),
        python=platform.python_version(),
    )
