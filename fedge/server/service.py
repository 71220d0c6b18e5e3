"""The coordinator service: rounds over MQTT, checkpointed each round, audited, resumable.

It runs any :class:`fedge.server.runner.FederatedRun` (a strategy and a model; the reference app builds
one from its config in :mod:`fedge.app.coordinator`). Files in ``state_dir``:

``checkpoint.npz``
    Global model, last completed round, run history and strategy state; replaced atomically after each round.
    A start without ``resume`` first renames an earlier run's to ``checkpoint-<time>-<pid>.npz``.
``audit.jsonl``
    One line per reply: which node's update was accepted (or rejected, and why) for which round, and a
    commit line per round written after its checkpoint (:mod:`fedge.server.audit`).
``artifacts.json``
    The model versions this fleet's broker holds retained (:class:`fedge.transport.ArtifactPublisher`'s
    ledger), kept across runs: a restarted coordinator clears the ones its predecessors left.
``status.json``
    Round, online nodes, their device profiles, dropped replies, last accuracy and the model export's state
    (latest version, failures, last error), refreshed every few seconds (what ``fedge status`` shows), and
    ``state``: ``running``, then ``finished``, ``stopped`` or ``failed`` (with ``error``) and ``ended_at``.

When the run has an exporter (:mod:`fedge.server.model_export`), every verified export is handed to
``on_model_exported`` (the transport's model publisher) after the round's checkpoint is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fedge.compression import CodecConfigError, build_codec
from fedge.config import ConfigError, make_state_dir, read_secret
from fedge.devices.fleet import LinkProfile
from fedge.devices.profile import DeviceProfile
from fedge.flower.compat import set_task_identity
from fedge.protocol.fleet import flower_node_id
from fedge.reporting.history import RoundListener, RunHistory
from fedge.server.audit import AUDIT_FILE, AuditLog, dropped_counts
from fedge.server.checkpoint import load_checkpoint, save_checkpoint, set_aside_checkpoint
from fedge.server.counted import COUNTED_NODES_KEY, COUNTED_VERSIONS_KEY
from fedge.server.model_delta import DeltaPlanner
from fedge.server.model_export import ExportedModel
from fedge.server.model_publish import ModelDistributor
from fedge.server.node_floor import NodeFloorGrid
from fedge.server.profile_store import PROFILES_FILE, load_profiles, save_profiles
from fedge.server.runner import FederatedRun, run_rounds
from fedge.server.schedule import Schedule
from fedge.server.schedule_grid import ScheduledGrid
from fedge.server.status import STATUS_FILE, StatusWriter, read_status
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.config import MqttConfig
from fedge.transport.connection import MqttConnection
from fedge.transport.grid import MqttGrid
from fedge.transport.signing import InstructionSigner
from fedge.transport.topics import Topics

__all__ = ["STATUS_FILE", "ServiceConfig", "read_status", "run_service"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceConfig:
    """Where the coordinator service connects and keeps its state.

    Parameters
    ----------
    mqtt : MqttConfig
        The coordinator's broker connection (user ``coordinator`` in the deploy configuration).
    state_dir : str
        Checkpoint, audit log and status file.
    wait_for_nodes_s : float (default: 600)
        How long to wait for the run's ``min_nodes`` before giving up: at the start, and whenever the
        fleet falls short during the run (:class:`fedge.server.node_floor.NodeFloorGrid`).
    node_stall_s : float or None (default: None)
        Also give up waiting once this long passes without another node coming online (a fleet still
        starting gets ``wait_for_nodes_s``; a stuck one is noticed sooner).
    round_timeout_s : float (default: 600)
        How long a round waits for replies; missing replies do not stop the round.
    node_keys_dir : str, optional
        Directory of ``<node_id>.key`` files; when set, every reply must carry a valid HMAC signature.
    run_id : int (default: 1)
        The Flower run id stamped on instructions.
    instruction_key_file : str, optional
        The coordinator's Ed25519 private key (PEM, ``deploy/make-passwords.sh`` makes it); when set, every
        instruction is signed, and agents holding the public key refuse instructions it did not sign.
    publish_models : bool (default: True)
        Publish every verified export to the fleet's inference devices (``fedge serve``) as retained,
        chunked artifacts, signed with ``instruction_key_file`` when it is set.
    model_delta_codec : str (default: "fp16")
        After the first, each version's fp32 weights also travel as a delta of the previous version in this
        codec (any :func:`fedge.compression.build_codec` spec; :mod:`fedge.server.model_delta`), so a device
        that holds the previous version fetches only the delta; ``""`` sends every version in full only.
    schedule : Schedule (default: Schedule())
        The ``[schedule]`` table: a training round's deadline in real seconds (fixed or adaptive),
        over-selection and memory-aware sampling (:class:`fedge.server.schedule_grid.ScheduledGrid`; the
        MQTT Grid offers only online nodes, so sampling is availability-aware anyway). The default waits for
        every sampled node up to ``round_timeout_s``.
    """

    mqtt: MqttConfig = field(default_factory=MqttConfig)
    state_dir: str = "coordinator-state"
    wait_for_nodes_s: float = 600.0
    node_stall_s: float | None = None
    round_timeout_s: float = 600.0
    node_keys_dir: str | None = None
    run_id: int = 1
    instruction_key_file: str | None = None
    publish_models: bool = True
    model_delta_codec: str = "fp16"
    schedule: Schedule = field(default_factory=Schedule)

    def __post_init__(self) -> None:
        if not self.state_dir:
            raise ConfigError("state_dir must not be empty")
        for name in ("wait_for_nodes_s", "round_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.run_id < 0:
            raise ConfigError(f"run_id must be >= 0, got {self.run_id}")
        if self.model_delta_codec:
            try:
                build_codec(self.model_delta_codec)
            except CodecConfigError as err:
                raise ConfigError(f"model_delta_codec: {err}") from None

    def node_keys(self) -> dict[str, bytes] | None:
        """Every node's signing key, read as the agent reads its own (first line, stripped)."""
        if self.node_keys_dir is None:
            return None
        keys = {
            p.stem: read_secret(p, "signing key").encode() for p in Path(self.node_keys_dir).glob("*.key")
        }
        if not keys:
            raise ConfigError(f"node_keys_dir {self.node_keys_dir} holds no <node>.key files")
        return keys


def run_service(
    config: ServiceConfig,
    run: FederatedRun,
    *,
    resume: bool = False,
    listeners: Iterable[RoundListener] = (),
    on_model_exported: Callable[[ExportedModel], None] | None = None,
) -> RunHistory:
    """Wait for ``run.min_nodes`` nodes, run the remaining rounds over MQTT, checkpoint and audit each one.

    Parameters
    ----------
    config : ServiceConfig
        Broker and state directory.
    run : FederatedRun
        Strategy, initial model and evaluation; a strategy with ``state_dict``/``load_state_dict`` has its
        state checkpointed too.
    resume : bool (default: False)
        Continue after the last completed round in ``state_dir`` (a fresh start if there is none).
    listeners : iterable of callables, optional
        Told of each completed round, after its checkpoint is written.
    on_model_exported : callable(ExportedModel), optional
        Told of each verified ONNX export of the global model (needs ``run.exporter``), e.g. to publish it
        to devices; an exception in it is logged and counted (``export_publish_failures``), never raised.
    """
    state_dir = Path(config.state_dir)
    make_state_dir(state_dir)  # before the broker: a state_dir that cannot be made is said first
    with contextlib.ExitStack() as stack:
        devices = None
        if on_model_exported is None and config.publish_models and run.exporter is not None:
            distributor = stack.enter_context(_model_distributor(config))
            on_model_exported, devices = distributor, distributor.devices
        return _run_service(config, run, resume, listeners, on_model_exported, state_dir, devices)


@contextlib.contextmanager
def _model_distributor(config: ServiceConfig) -> Iterator[ModelDistributor]:
    """A distributor on a connection of its own: the Grid's channel is per node, artifacts are fleet-wide."""
    signer = InstructionSigner.from_file(config.instruction_key_file) if config.instruction_key_file else None
    connection = MqttConnection(config.mqtt, f"fedge-models-{config.mqtt.fleet}")
    deltas = DeltaPlanner(config.model_delta_codec) if config.model_delta_codec else None
    # the versions in the broker's store, across restarts: a new process clears what earlier ones left
    # (written only at a publication, after _run_service has made state_dir)
    ledger = Path(config.state_dir) / "artifacts.json"
    publisher = ArtifactPublisher(connection, Topics(config.mqtt.fleet), signer, ledger=ledger)
    distributor = ModelDistributor(publisher, deltas=deltas)
    distributor.follow_devices()
    connection.start()
    try:
        yield distributor
    finally:
        connection.close()


def _run_service(
    config: ServiceConfig,
    run: FederatedRun,
    resume: bool,
    listeners: Iterable[RoundListener],
    on_model_exported: Callable[[ExportedModel], None] | None,
    state_dir: Path,
    devices: Callable[[], dict[str, Any]] | None = None,
) -> RunHistory:
    if on_model_exported is not None:
        if run.exporter is None:
            log.warning("on_model_exported is set but the run exports no model (export_every is 0)")
        else:
            run = dataclasses.replace(run, exporter=run.exporter.with_on_export(on_model_exported))
    make_state_dir(state_dir)
    if not resume:
        set_aside_checkpoint(state_dir)
    resume_point = load_checkpoint(state_dir) if resume else None
    if resume_point is not None and resume_point.completed_round >= run.num_rounds:
        # ended already (its outcome was reported then): a supervisor restarting it must not loop
        log.warning("the checkpoint in %s holds all %d rounds: nothing to resume", state_dir, run.num_rounds)
        return resume_point.history
    if resume_point is not None:
        log.info("resuming after round %d", resume_point.completed_round)
    elif resume:
        log.warning("--resume: no checkpoint in %s, so the run starts at round 1", state_dir)
    set_task_identity(run_id=config.run_id)
    strategy = run.strategy
    # The run's drops before this process, read before its Grid can audit any of its own: read after the
    # wait for nodes, a drop audited meanwhile counted twice, and the first round reported the run's total.
    audit_file = state_dir / AUDIT_FILE
    earlier_drops = dropped_counts(audit_file) if resume_point is not None and audit_file.is_file() else None
    with (
        AuditLog(state_dir / AUDIT_FILE) as audit,
        MqttGrid(
            config.mqtt,
            node_keys=config.node_keys(),
            audit=audit.write,
            instruction_key=config.instruction_key_file,
        ) as grid,
        StatusWriter(state_dir / STATUS_FILE, grid, run.num_rounds, resume_point, devices) as status,
    ):
        grid.dropped.update(earlier_drops or {})
        for name, profile in load_profiles(state_dir / PROFILES_FILE).items():
            grid.profiles.setdefault(name, profile)  # one that came meanwhile is newer
        # kept with each round's checkpoint, not as each arrives: written on the transport's thread, 3,000
        # profiles from invented ids had held every reply up for a minute (re-verification sweep)
        profiles_heard = threading.Event()
        grid.on_profile = profiles_heard.set
        limit = _reply_limit(run.initial_arrays)
        grid.endpoint.set_message_limit(lambda node: limit)  # no reply needs more than a dense model
        run = dataclasses.replace(run, round_extras=_DropsPerRound(grid))
        log.info("waiting for %d nodes", run.min_nodes)
        if not grid.wait_for_nodes(run.min_nodes, config.wait_for_nodes_s, stall_timeout=config.node_stall_s):
            online = sorted(grid.endpoint.online_nodes())
            names = f" ({', '.join(online[:10])}{', ...' if len(online) > 10 else ''})" if online else ""
            raise TimeoutError(
                f"{len(online)} of the {run.min_nodes} nodes needed came online{names}; gave up waiting "
                f"(are the others' broker and fleet {config.mqtt.fleet!r} those of this coordinator?)"
            )
        if resume_point is not None and hasattr(strategy, "load_state_dict"):
            strategy.load_state_dict(resume_point.strategy_state)
        if resume_point is None:
            audit.start_run()
        else:
            audit.settle(
                resume_point.completed_round,
                _counted_record(resume_point.strategy_state),
                rolled_back=_rolled_back(resume_point.history),
            )

        def checkpoint(server_round: int, arrays: ArrayRecord, history: RunHistory) -> None:
            strategy_state = strategy.state_dict() if hasattr(strategy, "state_dict") else {}
            save_checkpoint(state_dir, server_round, arrays, history, strategy_state)
            if profiles_heard.is_set():
                profiles_heard.clear()
                save_profiles(state_dir / PROFILES_FILE, grid.profiles)
            counted = _counted_record(strategy_state)  # which accepted replies the strategy aggregated
            nodes = audit.counted_names(server_round, counted) if counted is not None else None
            if server_round in _rolled_back(history):  # its aggregate was dropped: no update counted
                nodes = []
            audit.commit(server_round, nodes)  # only now do the round's accepted updates count

        # Flower's sampling waits for min_nodes without end: a fleet short for longer than the first wait
        # allowed ends the run (status.json says what it waits for meanwhile)
        scheduled = _scheduled(grid, config.schedule)
        floor = NodeFloorGrid(scheduled, run.min_nodes, config.wait_for_nodes_s, status.waiting)
        try:
            return run_rounds(
                floor,
                run,
                [*listeners, status.on_round],
                resume=resume_point,
                on_round_end=checkpoint,
                timeout=config.round_timeout_s,
            )
        finally:  # however the run ends, what it heard is kept
            if profiles_heard.is_set():
                save_profiles(state_dir / PROFILES_FILE, grid.profiles)


def _scheduled(grid: MqttGrid, schedule: Schedule) -> MqttGrid | ScheduledGrid:
    """``grid`` under ``schedule`` (the Grid itself when the schedule is the default: nothing to apply)."""
    if schedule == Schedule():
        return grid

    def profiles() -> dict[int, DeviceProfile]:
        # The agents' reported device profiles (memory), by Flower node id; copied first, as the MQTT
        # thread adds to them.
        return {flower_node_id(name): profile for name, profile in dict(grid.profiles).items()}

    def links() -> dict[int, LinkProfile]:
        # The links agents declared (``[link]``): per-client upload budgets over MQTT come from them.
        known = {node: LinkProfile.from_device(profile) for node, profile in profiles().items()}
        return {node: link for node, link in known.items() if link is not None}

    log.info("schedule: %s", schedule)
    return ScheduledGrid(grid, schedule, profiles=profiles, links=links)


def _rolled_back(history: RunHistory) -> set[int]:
    """The rounds whose aggregate the run dropped, keeping the model before them (a non-finite loss)."""
    return {metrics.round for metrics in history.rounds if metrics.extra.get("rolled_back")}


def _counted_record(strategy_state: Mapping[str, np.ndarray]) -> dict[int, int] | None:
    """A compressing strategy's record of each node's last aggregated round, from its checkpointed state."""
    if COUNTED_NODES_KEY not in strategy_state:
        return None
    nodes, rounds = strategy_state[COUNTED_NODES_KEY], strategy_state[COUNTED_VERSIONS_KEY]
    return {int(n): int(r) for n, r in zip(nodes.tolist(), rounds.tolist(), strict=True)}


def _reply_limit(arrays: ArrayRecord) -> int:
    """The largest reply a node may send: its model dense in float64 (a generous bound over any codec's
    payload and a dense fp32 reply alike), plus room for Flower's metadata and metrics."""
    return 2 * sum(array.numpy().size * 4 for array in arrays.values()) + 1024 * 1024


class _DropsPerRound:
    """What was dropped since the previous round, by reason: the transport's (``transport_dropped_<reason>``)
    and the replies the Grid dropped (``replies_dropped_<reason>``: a bad signature, late, undecodable, ...;
    a node whose reply is dropped for its signature is otherwise only a client that did not answer)."""

    def __init__(self, grid: MqttGrid) -> None:
        self._grid = grid
        self._seen = Counter(grid.endpoint.drop_totals())
        self._replies_seen = Counter(grid.dropped)

    def __call__(self) -> dict[str, float]:
        totals, replies = Counter(self._grid.endpoint.drop_totals()), Counter(self._grid.dropped)
        delta, self._seen = totals - self._seen, totals
        dropped, self._replies_seen = replies - self._replies_seen, replies
        return {
            **{f"transport_dropped_{reason}": float(count) for reason, count in sorted(delta.items())},
            **{f"replies_dropped_{reason}": float(count) for reason, count in sorted(dropped.items())},
        }
