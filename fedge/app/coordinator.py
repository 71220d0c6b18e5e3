"""The reference app as a coordinator service: its config file, mapped onto :mod:`fedge.server.service`.

``coordinator.toml`` holds the service's keys at the top level (``state_dir``, ``round_timeout_s``, ...),
an ``[mqtt]`` table and an ``[app]`` table of :class:`AppConfig` (with an optional ``[app.task]`` table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fedge.app.config import AppConfig
from fedge.app.server_app import federated_run
from fedge.config import from_table, read_toml
from fedge.reporting.history import RoundListener, RunHistory
from fedge.server.model_export import ExportedModel
from fedge.server.schedule import check_schedule_for
from fedge.server.service import ServiceConfig, run_service
from fedge.transport.config import MqttConfig

__all__ = ["CoordinatorConfig", "run_coordinator"]


@dataclass(frozen=True)
class CoordinatorConfig:
    """A coordinator running the reference app.

    Parameters
    ----------
    service : ServiceConfig
        Broker, state directory, timeouts and signing keys.
    app : AppConfig
        Rounds, task and hyper-parameters; ``app.min_nodes`` nodes must be online before round 1.
    """

    service: ServiceConfig
    app: AppConfig = field(default_factory=AppConfig)

    def __post_init__(self) -> None:
        check_schedule_for(self.app.strategy, self.service.schedule)

    @classmethod
    def from_toml(cls, path: str | Path) -> CoordinatorConfig:
        """Read ``coordinator.toml``; any unknown key or bad value is a ConfigError naming it."""
        values = read_toml(path)
        app = AppConfig.from_table(values.pop("app", {}), where="app")
        mqtt = values.pop("mqtt", {})
        service = from_table(ServiceConfig, {**values, "mqtt": MqttConfig.from_table(mqtt)})
        return cls(service=service, app=app)


def run_coordinator(
    config: CoordinatorConfig,
    *,
    resume: bool = False,
    listeners: Iterable[RoundListener] = (),
    on_model_exported: Callable[[ExportedModel], None] | None = None,
) -> RunHistory:
    """Run the app over MQTT as a service (see :func:`fedge.server.service.run_service`).

    The service exports the global model after every round unless ``app.export_every`` says otherwise,
    into ``app.out_dir/models`` (``state_dir/models`` without an ``out_dir``); ``on_model_exported`` is told
    of each export.
    """
    run = federated_run(
        config.app,
        num_partitions=config.app.min_nodes,
        export_dir=config.app.out_dir or config.service.state_dir,
        export_every=1,
    )
    return run_service(
        config.service, run, resume=resume, listeners=listeners, on_model_exported=on_model_exported
    )
