"""``fedge simulate`` configuration: the app's settings plus where and how many clients run."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.app.config import AppConfig
from fedge.config import ConfigError, check_types, from_table, read_toml
from fedge.devices.fleet import FleetConfig
from fedge.server.schedule import check_schedule_for
from fedge.simulation.clock_grid import Schedule

__all__ = ["ENGINES", "SimulationConfig"]

ENGINES = ("local", "ray", "mqtt")


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SimulationConfig:
    """A simulation run.

    Parameters
    ----------
    clients : int (default: 20)
        Virtual clients (Flower nodes), each with its own data partition.
    engine : str (default: "local")
        ``local`` (in-process Grid, fast), ``ray`` (Flower's simulation engine) or ``mqtt`` (a broker, the
        coordinator service and one device-agent process per client).
    workers : int (default: the CPUs this process may use)
        ClientApps run at once by the local engine (Ray: concurrent actors). Client training is
        compute-bound, so more workers than CPUs only adds contention.
    broker : str (default: "")
        For the ``mqtt`` engine: an existing broker URL; empty starts fedge's embedded broker.
    app : AppConfig
        Rounds, task, data split and training hyper-parameters.
    fleet : FleetConfig or None (default: None)
        A heterogeneous fleet (the ``[fleet]`` table: a mix of device classes): every round is put on a
        simulated clock (``fedge.simulation.clock_grid``) and metrics gain simulated times. None: no clock.
    availability : str (default: "")
        With a fleet: when clients are available. ``""`` always, ``"random"`` (exponential on/off periods,
        each client away 70% of the time), ``"diurnal"`` (a day's cycle) or the path of a FedScale
        availability pickle.
    schedule : Schedule (default: Schedule())
        Deadline, over-selection, availability- and memory-aware sampling (``[schedule]``): in simulated
        seconds with a fleet, in real seconds on the ``mqtt`` engine (``fedge.server.schedule_grid``).
    round_timeout_s : float or None (default: None: 3600 on the local and ray engines, 600 on mqtt)
        Real seconds a round waits for its clients; a call still running then is stopped and counts as a
        failure (a task whose ``train()`` hangs fails its rounds, and then the run).
    """

    clients: int = 20
    engine: str = "local"
    workers: int = field(default_factory=_usable_cpus)
    broker: str = ""
    app: AppConfig = field(default_factory=AppConfig)
    fleet: FleetConfig | None = None
    availability: str = ""
    schedule: Schedule = field(default_factory=Schedule)
    round_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_types(self)
        if self.round_timeout_s is not None and not 0.0 < self.round_timeout_s < math.inf:
            raise ConfigError(f"round_timeout_s must be > 0 and finite, got {self.round_timeout_s!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; choose one of: {', '.join(ENGINES)}")
        if self.clients < 1:
            raise ConfigError(f"clients must be >= 1, got {self.clients!r}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers!r}")
        if self.app.min_nodes > self.clients:  # it was silently lowered to the clients there are
            raise ConfigError(
                f"min_nodes ({self.app.min_nodes}) exceeds clients ({self.clients}): a simulation cannot wait"
                " for clients it does not have (its rounds sample from all of them)"
            )
        check_schedule_for(self.app.strategy, self.schedule)
        if self.broker and self.engine != "mqtt":
            raise ConfigError(f"broker is for the mqtt engine; this run's engine is {self.engine}")
        if self.fleet is not None and self.engine == "mqtt":
            raise ConfigError("a simulated fleet runs on the local or ray engine (mqtt runs in real time)")
        if (
            self.fleet is None and self.engine != "mqtt"
        ):  # they act on the simulated clock, which a fleet drives
            if self.availability:
                raise ConfigError("availability needs a [fleet] (the simulated clock it applies to)")
            if self.app.sim_time_budget_s:
                raise ConfigError("sim_time_budget_s needs a [fleet] (the simulated clock it budgets)")
            if self.schedule != Schedule():
                raise ConfigError(
                    "a [schedule] needs a [fleet] on the local and ray engines (simulated time)"
                )
            if self.app.upload_budget:  # every client's link would be unknown: each sent the plain codec
                raise ConfigError(
                    "an [upload_budget] needs a [fleet] on the local and ray engines (the clients' links)"
                )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SimulationConfig:
        """Build from flat keys (``clients``, ``rounds``, ``alpha``, ..., a ``[task]`` table); unknown keys
        and wrong types are errors naming the key. Keys may be spelled with ``_`` or ``-``."""
        spelled = dict(values)
        values = {key.replace("-", "_"): value for key, value in spelled.items()}
        if len(values) < len(spelled):
            raise ConfigError("a key is given twice (with '_' and with '-')")
        own = {f.name for f in dataclasses.fields(cls)} - {"app"}
        app_keys = {f.name for f in dataclasses.fields(AppConfig)}
        unknown = sorted(set(values) - own - app_keys)
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r}; known keys: {', '.join(sorted(own | app_keys))}")
        app = AppConfig.from_table({k: v for k, v in values.items() if k in app_keys})
        return from_table(cls, {"app": app, **{k: v for k, v in values.items() if k in own}})

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> SimulationConfig:
        """Read a flat TOML file, then apply ``overrides`` (e.g. command-line flags)."""
        values = read_toml(path)
        return cls.from_mapping({**values, **(overrides or {})})

    def to_json(self) -> dict[str, Any]:
        return {
            "clients": self.clients,
            "engine": self.engine,
            "workers": self.workers,
            **dataclasses.asdict(self.app),
        }
