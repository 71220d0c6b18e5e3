"""The reference app's run configuration: one dataclass, validated, with Flower's hyphenated keys.

Flower hands a ServerApp its configuration as ``context.run_config`` (a flat mapping with hyphenated keys,
from ``[tool.flwr.app.config]`` in pyproject.toml or from ``flwr run --run-config``). :class:`AppConfig` is
that mapping as a typed, validated object; ``fedge simulate`` builds one from flags and TOML, the
coordinator from the ``[app]`` table of its config file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fedge.app.attacks import ATTACKS
from fedge.app.presets import PRESETS
from fedge.compression import CodecConfigError, build_codec
from fedge.config import ConfigError, check_types, from_table
from fedge.server.budget import UploadBudget
from fedge.server.downlink import FULL_MODEL_CODECS
from fedge.server.model_export import check_export_settings, with_fp32
from fedge.server.optimizers import OPTIMIZERS
from fedge.server.screening import TRUSTED_MAX_NORM_RATIO

__all__ = ["STRATEGIES", "AppConfig"]

_PRESET_DEFAULTS = {"codec": "", "downlink_codec": "", "server_lr": 1.0, "ef_momentum": 0.0}
"""What the fields a preset sets hold when neither they nor ``compress`` say otherwise."""

RUN_CONFIG_UNSET = {
    "codec": "",
    "downlink_codec": "",
    "server_lr": 0.0,
    "ef_momentum": -1.0,
    "max_norm_ratio": -1.0,
    "max_weight_ratio": -1.0,
    "export_every": -1,
}
"""Flower's run config has no None, and ``flwr run`` takes only the keys the app declares (with a value):
these values mean "unset" there (``pyproject.toml`` declares them), so a ``compress`` preset still chooses
the fields it sets, the norm and weight screens keep their defaults for the strategy and codec (a declared
0.0 had turned the norm screen off under ``flwr run`` for the strategies meant for untrusted clients), and
whoever runs the app decides how often it exports."""

ADAM_SERVER_LR = 0.1
"""``server_lr`` of ``server_optimizer = "adam"`` when none is given, whatever the preset: Adam's steps
are about ``server_lr`` per coordinate whatever the update's scale, so the presets' rates (1-3, which make
up for the dilution of sparse averages) diverge. Measured on digits (6 clients, 8 rounds, int8): 0.1 reached
0.94, 0.03 0.89, 0.01 0.79 and 1.0 stayed at chance; with the strong preset 0.1 reached 0.85, 2.0 chance."""

STRATEGIES = (
    "fedavg",
    "median",
    "trimmed-mean",
    "sparse-median",
    "sparse-trimmed-mean",
    "sparse-clipped-mean",
    "fedbuff",
)
"""``AppConfig.strategy`` values; ``sparse-*`` aggregate compressed updates (:mod:`fedge.server.robust`),
``fedbuff`` trains asynchronously (:mod:`fedge.server.async_runner`)."""

UNTRUSTED_CLIENT_STRATEGIES = frozenset(
    {"median", "trimmed-mean", "sparse-median", "sparse-trimmed-mean", "sparse-clipped-mean"}
)
"""Strategies for clients that may not be honest: their replies are norm-screened by default."""


@dataclass(frozen=True)
class AppConfig:
    """What the reference ServerApp needs to run.

    Parameters
    ----------
    rounds : int (default: 30)
        Federated rounds to run (``num-server-rounds``).
    fraction_train : float (default: 1.0)
        Fraction of the connected nodes sampled for training each round, in (0, 1].
    local_epochs : int (default: 2)
        Epochs of local training per round.
    learning_rate : float (default: 0.05)
        Client SGD step size.
    batch_size : int (default: 16)
        Client batch size.
    alpha : float (default: 0.5)
        Dirichlet concentration of the non-IID label split; must be > 0.
    seed : int (default: 0)
        Seeds model initialisation, client sampling, partitioning and local shuffling.
    task : str (default: "fedge.app.task:DigitsTask")
        The :class:`fedge.app.task.Task` to learn: ``package.module:TaskClass`` or
        ``path/to/file.py:TaskClass``.
    task_args : dict (default: {})
        Keyword arguments of the task's constructor (a ``[task]`` table in TOML, ``--task-arg key=value``).
    out_dir : str (default: "")
        Where metrics.json and plots go; empty writes nothing.
    min_nodes : int (default: 1)
        Nodes that must be connected before round 1 samples (Flower samples from whoever is there).
    compress : str (default: "")
        A compression preset, ``light``, ``strong`` or ``max`` (:mod:`fedge.app.presets`): sets ``codec``,
        ``downlink_codec``, ``server_lr`` and ``ef_momentum`` together, except those given explicitly.
    codec : str or None (default: None: the preset's, else "")
        Uplink codec spec (e.g. ``"topk:0.01+int8"``): clients send compressed updates with error feedback
        and the coordinator aggregates them streaming (:class:`fedge.server.StreamingFedAvg`). Empty runs
        Flower's dense FedAvg.
    downlink_codec : str or None (default: None: the preset's, else "")
        Codec of the per-round model delta sent to clients; empty sends the dense model. Needs ``codec``.
    full_model_codec : str (default: "fp16")
        How clients without the previous model version get the whole model: fp16, fp32 or int8.
    server_optimizer : str (default: "avg")
        ``avg`` (FedAvg), ``avgm`` (server momentum) or ``adam`` (FedAdam); not ``avg`` needs ``codec``.
    server_lr : float or None (default: None: 0.1 with ``adam``, else the preset's, else 1.0)
        Server learning rate applied to the averaged update; anything but 1.0 needs ``codec``.
    server_momentum : float (default: 0.9)
        Momentum of ``avgm``.
    ef_momentum : float or None (default: None: the preset's, else 0.0)
        Deep Gradient Compression momentum correction of the clients' error feedback, in [0, 1).
    ef_residual_cap : float (default: 0.0)
        Clients scale their error-feedback residual to at most this multiple of their update's norm before
        adding it (0: uncapped). Where clients train rarely (sampling, availability), 1.0 keeps stale
        residuals from derailing training; needs ``codec``.
    max_norm_ratio : float, optional
        Replies whose update norm exceeds this multiple of the round's median are rejected (0: off).
        Unset, it is 5 for the strategies meant for untrusted clients (``median``, ``trimmed-mean``,
        ``sparse-*``) and 10,000 for ``fedavg`` and ``fedbuff``, a bound on absurd updates only: on
        non-IID clients the honest updates of the ones the model fits worst are the largest, and a tight
        test rejects exactly them, round after round (at 5, on the heterogeneity bench's fleet, 1.8 replies
        a round, and 1.4 points of final accuracy).
    max_weight_ratio : float, optional
        Replies whose ``num-examples`` exceeds this multiple of the round's median are rejected
        (``weight_outlier``; 0: off). Unset, it is 100 for uncompressed replies and 10 for compressed ones.
        Raise it for a fleet whose honest partitions differ more than that in size (a Dirichlet split at
        α = 0.01, say): the test cannot tell them from a client claiming examples it does not have.
    max_similarity : float (default: 0.99)
        ``sparse-*`` strategies: updates whose cosine reaches this are one group (colluders sending one
        vector), aggregated once (:class:`fedge.server.RobustConfig`); > 1 turns the test off.
    max_failed_rounds : int (default: 3)
        Stop the run after this many rounds in a row without one accepted update (0: never stop).
    target_accuracy : float (default: 0.0)
        End the run early once the global model reaches this accuracy (0: run every round).
    sim_time_budget_s : float (default: 0.0)
        On a simulated fleet, end the run after the round in which the simulated clock reaches this many
        seconds (0: run every round): compares schedules over the same fleet time.
    upload_budget : dict (default: {})
        Per-client uplink codecs sized so each upload fits a deadline, from the client's link where the
        Grid knows it (the simulated clock): the fields of :class:`fedge.server.budget.UploadBudget`
        (``deadline_s`` required), an ``[upload_budget]`` table in TOML. Needs ``codec``, the codec of
        clients whose link is unknown. Empty: every client gets ``codec``.
    strategy : str (default: "fedavg")
        How updates are aggregated. ``fedavg``: Flower's FedAvg, or StreamingFedAvg with ``codec``.
        ``median`` / ``trimmed-mean``: Flower's FedMedian / FedTrimmedAvg (β = 0.2), over decoded replies
        (:class:`fedge.server.DecodingStrategy`) with ``codec`` -- sparse codecs starve them.
        ``sparse-median``, ``sparse-trimmed-mean``, ``sparse-clipped-mean``: robust rules over the clients
        that sent each coordinate, with norm clipping (:class:`fedge.server.RobustStreamingFedAvg`); need
        ``codec``. ``fedbuff``: buffered asynchronous aggregation (FedBuff, :mod:`fedge.server.fedbuff`):
        ``concurrency`` clients train at once and every ``buffer_size`` replies make one server step with
        staleness weights; each step is a round (``rounds`` of them), dense or with ``codec``, with any
        ``server_optimizer``.
    buffer_size : int (default: 10)
        ``fedbuff``: replies per aggregation (K), >= 1.
    concurrency : int (default: 20)
        ``fedbuff``: clients training at once (C), >= ``buffer_size``.
    staleness_exponent : float (default: 0.5)
        ``fedbuff``: an update ``τ`` versions old weighs ``(1 + τ)^-staleness_exponent``, in [0, 10].
    attack : str (default: "")
        Simulated model poisoning by a fraction of the clients (:mod:`fedge.app.attacks`): ``sign-flip``,
        ``scale`` (×10), ``noise``, the colluding ``alie`` and ``ipm``, or the data poisoning ``label-flip``
        and ``backdoor`` (:mod:`fedge.app.backdoor`; rounds then report ``backdoor_success``); empty: every
        client is honest.
    attackers : float (default: 0.2)
        Fraction of the clients that attack, in [0, 1]; needs ``attack``.
    export_every : int or None (default: None: 1 for the coordinator service, 0 for simulations)
        Export the global model to ONNX after every ``export_every``-th round and after the last one
        (:mod:`fedge.server.model_export`): ``<out_dir>/models/r0007/model.onnx`` with its manifest, verified
        against torch, and ``models/latest.json``; 0 exports nothing. Needs ``out_dir`` (the coordinator
        service falls back to its ``state_dir``).
    export_variants : list of str (default: ["fp32"])
        Variants each export holds: fp32 always, plus ``int8-static`` (calibrated on the task's data) and
        ``int8-dynamic`` on request.
    export_keep : int (default: 3)
        Exported versions kept on disk, the newest ones (the one ``latest.json`` names is never deleted);
        0 keeps every version.
    """

    rounds: int = 30
    fraction_train: float = 1.0
    local_epochs: int = 2
    learning_rate: float = 0.05
    batch_size: int = 16
    alpha: float = 0.5
    seed: int = 0
    task: str = "fedge.app.task:DigitsTask"
    task_args: dict[str, Any] = field(default_factory=dict)
    out_dir: str = ""
    min_nodes: int = 1
    compress: str = ""
    codec: str | None = None
    downlink_codec: str | None = None
    full_model_codec: str = "fp16"
    server_optimizer: str = "avg"
    server_lr: float | None = None
    server_momentum: float = 0.9
    ef_momentum: float | None = None
    ef_residual_cap: float = 0.0
    max_norm_ratio: float | None = None
    max_weight_ratio: float | None = None
    max_similarity: float = 0.99
    max_failed_rounds: int = 3
    target_accuracy: float = 0.0
    sim_time_budget_s: float = 0.0
    upload_budget: dict[str, Any] = field(default_factory=dict)
    strategy: str = "fedavg"
    buffer_size: int = 10
    concurrency: int = 20
    staleness_exponent: float = 0.5
    attack: str = ""
    attackers: float = 0.2
    export_every: int | None = None
    export_variants: tuple[str, ...] = ("fp32",)
    export_keep: int = 3

    # Flower's key for the number of rounds differs from the field name.
    _RUN_CONFIG_KEYS: ClassVar[dict[str, str]] = {"rounds": "num-server-rounds"}

    def __post_init__(self) -> None:
        check_types(self)
        if self.compress and self.compress not in PRESETS:
            names = ", ".join(PRESETS)
            raise ConfigError(f"unknown compress preset {self.compress!r}; choose one of: {names}")
        preset = PRESETS.get(self.compress, {})
        if self.max_norm_ratio is None:
            screened = self.strategy in UNTRUSTED_CLIENT_STRATEGIES
            object.__setattr__(self, "max_norm_ratio", 5.0 if screened else TRUSTED_MAX_NORM_RATIO)
        if self.server_lr is None and self.server_optimizer == "adam":
            object.__setattr__(self, "server_lr", ADAM_SERVER_LR)
        for key, default in _PRESET_DEFAULTS.items():  # unset: the preset's value, else the default
            if getattr(self, key) is None:
                object.__setattr__(self, key, preset.get(key, default))
        checks = [
            (self.rounds >= 1, "rounds must be >= 1"),
            (self.seed >= 0, f"seed must be >= 0, got {self.seed}"),
            (0.0 < self.fraction_train <= 1.0, "fraction_train must be in (0, 1]"),
            (self.local_epochs >= 1, "local_epochs must be >= 1"),
            (0.0 < self.learning_rate < math.inf, "learning_rate must be > 0 and finite"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (0.0 < self.alpha < math.inf, "alpha must be > 0 and finite"),
            (":" in self.task, "task must be 'package.module:TaskClass' or 'path/to/file.py:TaskClass'"),
            (self.min_nodes >= 1, "min_nodes must be >= 1"),
            (self.max_failed_rounds >= 0, "max_failed_rounds must be >= 0"),
            (0.0 <= self.target_accuracy <= 1.0, "target_accuracy must be in [0, 1]"),
            (0.0 <= self.sim_time_budget_s < math.inf, "sim_time_budget_s must be >= 0 and finite"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            json.dumps(self.task_args)
        except (TypeError, ValueError):
            raise ConfigError(
                "task_args must hold only strings, numbers, booleans, lists and tables"
            ) from None
        self._check_compression()
        if self.upload_budget:
            if not self.codec:
                raise ConfigError("upload_budget needs codec (the codec of clients whose link is unknown)")
            from_table(UploadBudget, self.upload_budget, where="upload_budget")
        self._check_robustness()
        problem = check_export_settings(self.export_every or 0, self.export_variants, self.export_keep)
        if problem:
            raise ConfigError(problem)
        object.__setattr__(self, "export_variants", with_fp32(self.export_variants))

    def _check_robustness(self) -> None:
        """Strategy and attack settings."""
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.strategy.startswith("sparse-") and not self.codec:
            plain = self.strategy.removeprefix("sparse-").replace("clipped-mean", "fedavg")
            raise ConfigError(
                f"strategy {self.strategy!r} aggregates compressed updates: set compress (e.g. 'strong') "
                f"or codec, or use strategy {plain!r} for dense updates"
            )
        fedbuff = {"buffer_size": 10, "concurrency": 20, "staleness_exponent": 0.5}
        if self.strategy != "fedbuff" and any(getattr(self, k) != v for k, v in fedbuff.items()):
            raise ConfigError("buffer_size, concurrency and staleness_exponent need strategy 'fedbuff'")
        if self.buffer_size < 1 or self.concurrency < self.buffer_size:
            raise ConfigError(
                f"fedbuff needs buffer_size >= 1 and concurrency >= buffer_size; got {self.buffer_size}, "
                f"{self.concurrency}"
            )
        if not (math.isfinite(self.staleness_exponent) and 0 <= self.staleness_exponent <= 10):
            # 1e308 weighed every update one version old at exactly zero: the model stopped, every round
            # reported an accepted update (FedBuff sweep)
            raise ConfigError(f"staleness_exponent must be in [0, 10], got {self.staleness_exponent}")
        if self.attack and self.attack not in ATTACKS:
            raise ConfigError(f"unknown attack {self.attack!r}; choose one of: {', '.join(ATTACKS)}")
        if not 0.0 <= self.attackers <= 1.0:
            raise ConfigError(f"attackers is a fraction of the clients, in [0, 1]; got {self.attackers}")
        if not self.attack and self.attackers != 0.2:
            raise ConfigError(f"attackers needs attack ({', '.join(ATTACKS)})")

    def _check_compression(self) -> None:
        """Compression settings: valid specs, and none of them without an uplink codec."""
        for key in ("codec", "downlink_codec"):
            if getattr(self, key):
                try:
                    build_codec(getattr(self, key))
                except CodecConfigError as err:
                    raise ConfigError(f"{key}: {err}") from None
        dense_only = {
            "downlink_codec": self.downlink_codec != "",
            "server_optimizer": self.server_optimizer != "avg",
            "server_lr": self.server_lr != 1.0,
            "ef_momentum": self.ef_momentum != 0.0,
            "ef_residual_cap": self.ef_residual_cap != 0.0,
        }
        if self.strategy == "fedbuff":  # its server step works on dense deltas too
            dense_only.pop("server_optimizer"), dense_only.pop("server_lr")
        needing_codec = [key for key, set_ in dense_only.items() if set_]
        if needing_codec and not self.codec:
            key, preset = needing_codec[0], PRESETS.get(self.compress, {})
            if key in preset and preset[key] == getattr(self, key):  # the preset's, not the user's
                raise ConfigError(
                    f"codec is empty, and compress {self.compress!r} sets {key}, which needs one: leave codec"
                    f" unset for the preset's ({preset.get('codec')!r}), or drop compress"
                )
            raise ConfigError(f"{key} needs codec (use codec 'fp32' for uncompressed updates)")
        checks = [
            (
                self.full_model_codec in FULL_MODEL_CODECS,
                f"full_model_codec must be one of {list(FULL_MODEL_CODECS)}",
            ),
            (self.server_optimizer in OPTIMIZERS, f"server_optimizer must be one of {OPTIMIZERS}"),
            (0.0 < self.server_lr < math.inf, "server_lr must be > 0 and finite"),
            (0.0 <= self.server_momentum < 1.0, "server_momentum must be in [0, 1)"),
            (0.0 <= self.ef_momentum < 1.0, "ef_momentum must be in [0, 1)"),
            (self.ef_residual_cap >= 0.0, "ef_residual_cap must be >= 0 (0: uncapped)"),
            (self.max_norm_ratio == 0.0 or self.max_norm_ratio > 1.0, "max_norm_ratio must be > 1 (0: off)"),
            (
                self.max_weight_ratio is None or self.max_weight_ratio == 0.0 or self.max_weight_ratio > 1.0,
                "max_weight_ratio must be > 1 (0: off)",
            ),
            (self.max_similarity > 0.0, "max_similarity must be > 0 (> 1: off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def task_args_json(self) -> str:
        """``task_args`` as canonical JSON: how they travel to clients in the train config."""
        return json.dumps(self.task_args, sort_keys=True)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, where: str = "") -> AppConfig:
        """From a TOML table (or flags): ``task`` may be a string or a ``[task]`` table whose ``path`` names
        the class and whose other keys are its constructor's arguments."""
        values = dict(table)
        task = values.get("task")
        if isinstance(task, Mapping):
            task = dict(task)
            if "path" not in task:
                raise ConfigError(f"missing key {(where + '.' if where else '') + 'task.path'!r}")
            values["task"] = task.pop("path")
            values["task_args"] = {**task, **values.get("task_args", {})}
        return from_table(cls, values, where=where)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> AppConfig:
        """Build from Flower's ``context.run_config``; keys fedge does not know are left to other apps."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = cls._RUN_CONFIG_KEYS.get(f.name, f.name.replace("_", "-"))
            unset = f.name in RUN_CONFIG_UNSET and run_config.get(key) == RUN_CONFIG_UNSET[f.name]
            if key in run_config and not unset:
                values[f.name] = run_config[key]
        for name in ("task_args", "upload_budget"):  # Flower's run config is flat: tables travel as JSON
            if isinstance(values.get(name), str):
                try:
                    values[name] = json.loads(values[name] or "{}")
                except ValueError as err:
                    raise ConfigError(f"{name.replace('_', '-')} is not JSON: {err}") from None
        if isinstance(values.get("export_variants"), str):  # flat as well: "fp32,int8-static"
            values["export_variants"] = [v.strip() for v in values["export_variants"].split(",") if v.strip()]
        return cls.from_table(values)

    def to_run_config(self) -> dict[str, bool | int | float | str]:
        """Flower's flat, hyphenated form (what ``from_run_config`` reads)."""
        flat = {
            self._RUN_CONFIG_KEYS.get(f.name, f.name.replace("_", "-")): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None  # export_every unset: whoever runs the app decides
        }
        flat["task-args"] = self.task_args_json
        flat["upload-budget"] = json.dumps(self.upload_budget, sort_keys=True)
        flat["export-variants"] = ",".join(self.export_variants)
        return flat

    def resolved_export_every(self, default: int) -> int:
        """``export_every``, or ``default`` when it is unset (1 for the coordinator service, else 0)."""
        return default if self.export_every is None else self.export_every
