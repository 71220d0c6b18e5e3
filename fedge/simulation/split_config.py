"""The settings of ``fedge simulate --split``: the ``[split]`` table and what a split run refuses.

:class:`SplitSettings` is the ``[split]`` table; :func:`load_split_simulation` reads it with ``fedge
simulate``'s own settings (a fleet always included: half ``pi4_wifi``, half :data:`MCU_WIFI` by default)
and refuses, naming the key, what the in-process driver does not implement. The run itself is
:mod:`fedge.simulation.split_run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedge.app.config import AppConfig
from fedge.app.task import Task, load_task
from fedge.config import ConfigError, check_types, from_table, read_toml
from fedge.devices.fleet import (
    ClientProfile,
    ComputeProfile,
    FleetConfig,
    LinkProfile,
    mbit_per_s,
)
from fedge.simulation.config import SimulationConfig
from fedge.split import (
    CutConfig,
    MemoryConfig,
    SplitFedConfig,
)

__all__ = ["MCU_WIFI", "SplitSettings", "SplitSimulation", "load_split_simulation"]

MCU_WIFI = ClientProfile(
    ComputeProfile(flops_per_s=0.2e9, memory_bytes=2**20, encode_bytes_per_s=20e6, decode_bytes_per_s=80e6),
    LinkProfile(mbit_per_s(2), mbit_per_s(4), latency_s=0.01),
    "mcu_wifi",
)
"""A microcontroller-class board on Wi-Fi (1 MiB for training, 0.2 GFLOP/s, 2/4 Mbit/s): the small device
of ``fedge bench split``, known to split runs by name."""

_DEFAULT_MIX = {"pi4_wifi": 0.5, "mcu_wifi": 0.5}

# AppConfig fields the split driver uses; every other one must keep its default in a split run.
_USED_APP_FIELDS = {
    "rounds",
    "local_epochs",
    "learning_rate",
    "batch_size",
    "alpha",
    "seed",
    "task",
    "task_args",
    "out_dir",
}
_HINTS = {
    "codec": "compress the cut with [split] activation_codec / gradient_codec, updates with update_codec",
    "compress": "compress the cut with [split] activation_codec / gradient_codec, updates with update_codec",
}


@dataclass(frozen=True)
class SplitSettings:
    """The ``[split]`` table of ``fedge simulate --split``.

    Parameters
    ----------
    variant : {"v1", "v2"} (default: "v2")
        SplitFed V1 (one server-side model per split client) or V2 (one shared).
    u_shaped : bool (default: False)
        Labels stay on the device: the last ``head_layers`` layers run there too.
    head_layers : int (default: 1)
        Layers of the U-shaped head.
    parallel : bool (default: True)
        SplitFed (split clients step at once) or vanilla split learning (they take turns, handing the front
        stage on; needs every split client at the same cut).
    activation_codec, gradient_codec : str (default: "fp32")
        Codec specs for the activations (up) and gradients (down) at the cut, e.g.
        ``"threshold:1e-30+int8"`` (only the nonzeros, int8).
    activation_feedback, gradient_feedback : bool (default: False)
        Error feedback for the cut tensors, per client link and direction.
    mask_gradient : bool (default: True)
        Zero the cut gradient where the ReLU activation is zero (lossless; sparse codecs then send less).
    update_codec : str (default: "")
        Codec spec for the client updates at the end of a round (with error feedback); empty: dense fp32.
    momentum : float (default: 0.9)
        SGD momentum, on the devices and the coordinator.
    server_workers : int (default: 1)
        Split steps the coordinator serves at once (the simulated clock's queue).
    cut_policy : {"shallowest", "least_traffic"} (default: "shallowest")
        Which of the cuts whose front stage fits a device it gets.
    cuts : list of int (default: [], the block cuts)
        Candidate cuts (layer indices of the model's chain).
    usable_fraction : float (default: 0.9)
        Share of a device's memory training may fill.
    optimizer : {"sgd", "momentum", "adam"} (default: "momentum")
        Optimizer state counted in the training memory.
    extra_model_copies : int (default: 2)
        Model copies counted beside the trained one.
    memory_batch_size : int (default: 0, the run's batch_size)
        Batch size the training memory is measured at.
    """

    variant: Literal["v1", "v2"] = "v2"
    u_shaped: bool = False
    head_layers: int = 1
    parallel: bool = True
    activation_codec: str = "fp32"
    gradient_codec: str = "fp32"
    activation_feedback: bool = False
    gradient_feedback: bool = False
    mask_gradient: bool = True
    update_codec: str = ""
    momentum: float = 0.9
    server_workers: int = 1
    cut_policy: Literal["shallowest", "least_traffic"] = "shallowest"
    cuts: tuple[int, ...] = ()
    usable_fraction: float = 0.9
    optimizer: Literal["sgd", "momentum", "adam"] = "momentum"
    extra_model_copies: int = 2
    memory_batch_size: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        checks = (
            (0 < self.usable_fraction <= 1, "usable_fraction must be in (0, 1]"),
            (self.extra_model_copies >= 0, "extra_model_copies must be >= 0"),
            (self.memory_batch_size >= 0, "memory_batch_size must be >= 0 (0: the run's batch_size)"),
            (all(c >= 1 for c in self.cuts), "cuts must be layer indices >= 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        # Codec specs and the driver's own ranges are checked by the objects that use them.
        self.cut_config()
        SplitFedConfig(**self._driver_fields())

    def cut_config(self) -> CutConfig:
        """How the cut tensors travel."""
        return CutConfig(
            self.activation_codec,
            self.gradient_codec,
            self.activation_feedback,
            self.gradient_feedback,
            self.mask_gradient,
        )

    def _driver_fields(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "variant": self.variant,
            "u_shaped": self.u_shaped,
            "head_layers": self.head_layers,
            "parallel": self.parallel,
            "update_codec": self.update_codec or None,
            "server_workers": self.server_workers,
        }

    def driver_config(self, app: AppConfig) -> SplitFedConfig:
        """The driver's configuration: these settings with the run's rounds, epochs, batch, step and seed."""
        return SplitFedConfig(
            rounds=app.rounds,
            local_epochs=app.local_epochs,
            batch_size=app.batch_size,
            learning_rate=app.learning_rate,
            seed=app.seed,
            cut=self.cut_config(),
            **self._driver_fields(),
        )

    def memory_config(self, app: AppConfig) -> MemoryConfig:
        """How :func:`fedge.split.plan_fleet` counts training memory."""
        return MemoryConfig(
            batch_size=self.memory_batch_size or app.batch_size,
            optimizer=self.optimizer,
            extra_model_copies=self.extra_model_copies,
            usable_fraction=self.usable_fraction,
            cut_policy=self.cut_policy,
        )


@dataclass(frozen=True)
class SplitSimulation:
    """A split simulation: ``fedge simulate``'s settings (with a fleet) and the ``[split]`` table."""

    sim: SimulationConfig
    split: SplitSettings = field(default_factory=SplitSettings)

    @property
    def fleet(self) -> FleetConfig:
        """The run's fleet (always set: :func:`load_split_simulation` gives a default one)."""
        assert self.sim.fleet is not None
        return self.sim.fleet

    def to_json(self) -> dict[str, Any]:
        return {
            **self.sim.to_json(),
            "fleet": {"mix": self.fleet.mix, "seed": self.fleet.seed},
            "split": dataclasses.asdict(self.split),
        }


def load_split_simulation(
    path: str | Path | None, overrides: Mapping[str, Any] | None = None
) -> SplitSimulation:
    """Read a split simulation from a TOML file (or none) and flags.

    Parameters
    ----------
    path : str, Path or None
        The ``fedge simulate`` TOML file, with an optional ``[split]`` table.
    overrides : mapping, optional
        Flags, which win over the file (``clients``, ``rounds``, ``out_dir``, ...).

    Raises
    ------
    ConfigError
        For an unknown key or a bad value (named), or a setting split runs do not implement.
    """
    values = read_toml(path) if path is not None else {}
    table = values.pop("split", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"split must be a table, got {table!r}")
    values = {**values, **(overrides or {})}
    engine = values.get("engine", "local")
    if engine != "local":  # before the fleet's own check, whose message names engines split does not run on
        raise ConfigError(
            f"engine {engine!r} does not run split training: split runs use the in-process driver "
            "(leave engine unset)"
        )
    if "workers" in values:
        raise ConfigError("workers does not apply to --split (the driver trains its clients in this process)")
    fleet = values.get("fleet")
    if fleet is None:
        values["fleet"] = {"mix": dict(_DEFAULT_MIX), "classes": {"mcu_wifi": MCU_WIFI}}
    elif isinstance(fleet, Mapping) and isinstance(fleet.get("classes", {}), Mapping):
        values["fleet"] = {**fleet, "classes": {"mcu_wifi": MCU_WIFI, **fleet.get("classes", {})}}
    sim = SimulationConfig.from_mapping(values)
    _check_supported(sim)
    return SplitSimulation(sim, from_table(SplitSettings, table, where="split"))


def _check_supported(sim: SimulationConfig) -> None:
    """Refuse what the split driver does not do, naming the key."""
    if sim.engine != "local":
        raise ConfigError(
            f"engine {sim.engine!r} does not run split training: split runs use the in-process driver "
            "(leave engine unset)"
        )
    if sim.availability:
        raise ConfigError("availability is not supported with --split (every client takes part every round)")
    if sim.schedule != type(sim.schedule)():
        raise ConfigError("a [schedule] table is not supported with --split")
    defaults = AppConfig()
    # the strategy first: choosing one also sets others' defaults (median turns the norm screen on)
    for f in sorted(dataclasses.fields(AppConfig), key=lambda f: f.name != "strategy"):
        if f.name not in _USED_APP_FIELDS and getattr(sim.app, f.name) != getattr(defaults, f.name):
            hint = _HINTS.get(f.name, "split runs do not implement it")
            raise ConfigError(f"{f.name} is not used by split training (--split): {hint}")
    task = load_task(sim.app.task, sim.app.task_args)
    custom = [name for name in ("train", "evaluate") if getattr(type(task), name) is not getattr(Task, name)]
    if custom:
        calls = " and ".join(f"{name}()" for name in custom)
        raise ConfigError(
            f"task {sim.app.task} has its own {calls}; split training runs its own cross-entropy training "
            "and accuracy over the stages, which would ignore it (run it without --split)"
        )
