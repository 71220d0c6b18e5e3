"""A partitioned model over MQTT: one stage per inference agent, activations through the broker.

The edge adapter between the planner and the fleet (the planner and the exporter know nothing of MQTT). Each
stage of a plan is published to its device as the artifact ``stage-<device>`` (signed, chunked, retained:
:mod:`fedge.inference.distribution`); the device runs ``fedge serve`` with ``artifact = "stage-<device>"``
and answers ``.npz`` requests of named tensors with every output by name. :class:`MqttPipeline` chains the
stages with the same pipelined :class:`~fedge.partitioning.runtime.LocalRunner` as the local runner, whose
executors here are requests to devices, so micro-batches overlap across devices.

A stage agent that dies is detected (its request times out and its retained status turns offline: the
broker publishes its will) and the plan is made again over the devices left, reusing the cached costs and
stage files; the batch in flight is run again on the new placement.

Activations larger than ``chunk_bytes`` travel as numbered chunks at QoS 1 on persistent sessions
(:mod:`fedge.transport.message_chunks`), so a link that drops mid-transfer costs only the chunks not yet
acknowledged; each agent reassembles a request within its per-requester budget.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from fedge.inference.distribution import publish_model
from fedge.inference.manifest import Manifest, TensorSpec, sha256_bytes
from fedge.inference.remote import InferenceClient, InferenceError
from fedge.partitioning.costs import CostModel
from fedge.partitioning.graph import ModelGraph
from fedge.partitioning.planner import Plan, plan
from fedge.partitioning.runtime import LocalRunner
from fedge.partitioning.stages import StageArtifact, export_stages
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.config import MqttConfig
from fedge.transport.connection import MqttConnection
from fedge.transport.signing import InstructionSigner
from fedge.transport.topics import Topics

__all__ = ["MqttPipeline", "RemoteStage", "StageFailed", "stage_artifact"]

log = logging.getLogger(__name__)


def stage_artifact(device: str) -> str:
    """The artifact a device's stage travels under (its agent's ``artifact`` setting)."""
    return f"stage-{device}"


class StageFailed(RuntimeError):
    """A stage's device did not answer, or answered with an error or another stage's version.

    ``refused``: the device answered this request with an error (too large for its ``max_request_bytes``,
    inputs its stage cannot take): it is alive, and the same request would be refused again.
    """

    def __init__(self, device: str, message: str, *, refused: bool = False) -> None:
        super().__init__(f"stage on {device}: {message}")
        self.device = device
        self.refused = refused


@dataclass
class RemoteStage:
    """A :class:`~fedge.partitioning.runtime.StageExecutor` that is a request to a device."""

    client: InferenceClient
    device: str
    version: str
    timeout_s: float = 10.0
    outputs: tuple[TensorSpec, ...] = ()  # the stage's outputs, as its manifest declares them

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            answer = self.client.predict(self.device, inputs, timeout=self.timeout_s)
        except TimeoutError as err:
            raise StageFailed(self.device, f"{type(err).__name__}: {err}") from None
        except InferenceError as err:
            raise StageFailed(self.device, f"{type(err).__name__}: {err}", refused=True) from None
        if answer.version != self.version or not isinstance(answer.outputs, dict):
            raise StageFailed(self.device, f"answered with {answer.version!r}, expected {self.version!r}")
        rows = len(next(iter(inputs.values()))) if inputs else None
        problem = _misfit(answer.outputs, self.outputs, rows)
        if problem:  # a device's answer is checked as any untrusted input: NaN, shapes, names
            raise StageFailed(self.device, f"answered {problem}")
        return answer.outputs


def _misfit(outputs: dict[str, np.ndarray], specs: tuple[TensorSpec, ...], rows: int | None) -> str:
    """What is wrong with a stage's ``outputs`` against its declared ``specs`` for a batch of ``rows``, or ""
    (NaN, infinity, other names, dtypes or shapes had been handed on as a result)."""
    if specs and set(outputs) != {spec.name for spec in specs}:
        return f"outputs {sorted(outputs)[:4]}, the stage's are {[spec.name for spec in specs][:4]}"
    for spec in specs:
        values = np.asarray(outputs[spec.name])
        if values.dtype.kind != np.dtype(spec.dtype).kind:
            return f"{spec.name} as {values.dtype}, the stage's is {spec.dtype}"
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            return f"NaN or infinity in {spec.name}"
        expected = [rows if i == 0 else dim for i, dim in enumerate(spec.shape)]
        if values.ndim != len(expected) or any(
            isinstance(want, int) and want != got for want, got in zip(expected, values.shape, strict=True)
        ):
            return f"{spec.name} of shape {tuple(values.shape)}, the stage's is {tuple(expected)}"
    return ""


class MqttPipeline:
    """Deploy a model's stages to inference agents and run batches through them.

    Parameters
    ----------
    onnx_model : onnx.ModelProto
        The full model (from :func:`fedge.partitioning.onnx_graph.capture`).
    graph : ModelGraph
        Its planner graph.
    cost : CostModel
        The (calibrated) costs over the fleet; its devices' names are the agents' node ids.
    mqtt : MqttConfig
        The coordinator's broker connection (writes artifacts, sends requests).
    out_dir : path
        Where stage files are written (and reused across re-plans).
    objective : str, default "throughput"
        The planner's objective.
    signer : InstructionSigner or None
        Signs the stage headers (agents that trust the key accept only these).
    timeout_s : float, default 10.0
        How long a stage request may take before its device is suspected.
    deploy_timeout_s : float, default 60.0
        How long devices may take to load a new placement.
    chunk_bytes : int, default 256 KiB
        Activations larger than this travel in chunks at QoS 1 (:mod:`fedge.transport.message_chunks`): a
        link that drops mid-transfer re-sends only the chunks not yet acknowledged.
    """

    def __init__(
        self,
        onnx_model: onnx.ModelProto,
        graph: ModelGraph,
        cost: CostModel,
        mqtt: MqttConfig,
        out_dir: str | Path,
        *,
        objective: str = "throughput",
        signer: InstructionSigner | None = None,
        timeout_s: float = 10.0,
        deploy_timeout_s: float = 60.0,
        chunk_bytes: int = 256 * 1024,
    ) -> None:
        self.model, self.graph, self.cost = onnx_model, graph, cost
        self.out_dir = Path(out_dir)
        self.objective, self.timeout_s, self.deploy_timeout_s = objective, timeout_s, deploy_timeout_s
        self.topics = Topics(mqtt.fleet)
        self.connection = MqttConnection(mqtt, f"fedge-pipeline-{mqtt.fleet}")
        self.publisher = ArtifactPublisher(self.connection, self.topics, signer)
        self.client = InferenceClient(mqtt, f"pipeline-{mqtt.fleet}", chunk_bytes=chunk_bytes)
        self.dead: set[str] = set()
        self.replans = 0
        self.plan: Plan | None = None
        self.runner: LocalRunner | None = None
        self._status: dict[str, dict] = {}
        self._changed = threading.Condition()

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect (publisher, requester) and follow the devices' serving status."""
        import json

        def on_status(topic: str, payload: bytes) -> None:
            try:
                status = json.loads(payload) if payload else {}
            except ValueError:
                return
            with self._changed:
                self._status[topic.split("/")[-2]] = status if isinstance(status, dict) else {}
                self._changed.notify_all()

        self.connection.route(self.topics.all_infer_status, on_status)
        self.connection.start()
        self.client.start()

    def close(self) -> None:
        """Disconnect."""
        self.client.close()
        self.connection.close()

    def __enter__(self) -> MqttPipeline:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- placing -----------------------------------------------------------------------------------------
    def online(self) -> set[str]:
        """Devices of the fleet whose retained status says they are online."""
        with self._changed:
            return self._online()

    def wait_online(self, names: Iterable[str] | None = None, timeout_s: float = 30.0) -> set[str]:
        """Wait until every device of ``names`` (default: the fleet's) is online, at most ``timeout_s``;
        returns the devices online then. Retained statuses arrive right after connecting."""
        wanted = set(names) if names is not None else {d.name for d in self.cost.fleet.devices}
        with self._changed:
            self._changed.wait_for(lambda: wanted <= self._online(), timeout_s)
            return self._online()

    def _online(self) -> set[str]:
        return {name for name, status in self._status.items() if status.get("online")}

    def deploy(self) -> Plan:
        """Plan over the devices not known dead, publish every stage, wait until each device serves it. A
        device given up on that is online again (its agent restarted, or back after a broker restart) is
        placed again: it had been left out for the pipeline's life."""
        with self._changed:
            self.dead -= self._online()
        names = tuple(d.name for d in self.cost.fleet.devices if d.name not in self.dead)
        if not names:  # (the planner once read no devices as all of them, and published to the dead)
            dead = ", ".join(sorted(self.dead))
            raise RuntimeError(f"no device's stage agent is online or alive (given up on: {dead})")
        result = plan(self.cost, self.objective, devices=names)
        if not result.feasible:
            raise RuntimeError(f"no placement of the model fits the devices left ({', '.join(names)})")
        artefacts, _ = export_stages(self.model, self.graph, result, self.out_dir)
        versions = {a.device: _stage_version(a) for a in artefacts}
        manifests = {}
        for artefact in artefacts:
            data = (self.out_dir / artefact.path).read_bytes()
            manifest = manifests[artefact.device] = _stage_manifest(data, versions[artefact.device])
            files = {"fp32": (data, manifest)}
            publish_model(
                self.publisher, versions[artefact.device], files, artifact=stage_artifact(artefact.device)
            )
        self._wait_serving(versions)
        executors = [
            RemoteStage(
                self.client, a.device, versions[a.device], self.timeout_s, manifests[a.device].outputs
            )
            for a in artefacts
        ]
        self.runner = LocalRunner(executors, [a.inputs for a in artefacts], [a.crossing for a in artefacts])
        self.plan = result
        log.info("deployed %d stages on %s", len(artefacts), ", ".join(versions))
        return result

    def _wait_serving(self, versions: dict[str, str]) -> None:
        def waiting() -> list[str]:
            return [d for d, v in versions.items() if self._status.get(d, {}).get("version") != v]

        with self._changed:
            if not self._changed.wait_for(lambda: not waiting(), self.deploy_timeout_s):
                raise TimeoutError(f"devices {', '.join(waiting())} did not load their stages in time")

    # -- running -----------------------------------------------------------------------------------------
    def run(
        self, feeds: dict[str, np.ndarray], micro_batch: int | None = None, *, max_replans: int = 2
    ) -> dict[str, np.ndarray]:
        """Run ``feeds`` through the stages; a device that stopped answering is re-placed and the batch run
        again. A request a device refuses (:attr:`StageFailed.refused`) fails the run at once: waiting for
        the device to go offline, then sending the same request again, ends the same way."""
        if self.runner is None:
            self.deploy()
        for attempt in range(max_replans + 1):
            assert self.runner is not None
            try:
                return self.runner.run(feeds, micro_batch)
            except StageFailed as err:
                if attempt == max_replans or err.refused:
                    raise
                self._handle_failure(err)
        raise AssertionError("unreachable")

    def _handle_failure(self, err: StageFailed) -> None:
        """Decide whether the device is gone (offline status within the timeout) and place again."""
        with self._changed:
            gone = self._changed.wait_for(lambda: err.device not in self._online(), self.timeout_s)
        if gone:
            self.dead.add(err.device)
            log.warning("%s; it is offline: re-placing its stage over %d devices", err, self._alive_count())
        else:
            log.warning("%s; it is still online: running the batch again on the same placement", err)
        self.replans += 1
        self.deploy()

    def _alive_count(self) -> int:
        return sum(d.name not in self.dead for d in self.cost.fleet.devices)


def _stage_version(artefact: StageArtifact) -> str:
    """A version naming the stage's content and position (its file name is content-addressed)."""
    return Path(artefact.path).stem.removeprefix("stage_")


def _stage_manifest(data: bytes, version: str) -> Manifest:
    """The manifest a device checks a stage file against."""
    model = onnx.load_from_string(data)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def specs(values) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(
                v.name,
                tuple(d.dim_value or d.dim_param or None for d in v.type.tensor_type.shape.dim),
                np.dtype(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)).name,
            )
            for v in values
        )

    initializers = {i.name for i in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    return Manifest(version, 0, sha256_bytes(data), opset, "fp32", specs(inputs), specs(model.graph.output))
