"""The inference agent: a torch-free device process that serves the fleet's model over MQTT.

It does three things, each on its own thread:

* **answers requests** (paho's network thread): an ``.npy`` batch (or an ``.npz`` of named inputs, answered
  with every output by name: a pipeline stage) on ``fedge/<fleet>/infer/<node>/request``
  with an MQTT 5 response topic and correlation data gets its outputs as ``.npy`` on the response topic, with
  the same correlation data and user properties ``status`` (``ok`` / ``error``), ``version`` and, on error,
  ``error``. A bad request is answered with an error and counted; it never stops the agent;
* **receives models** (:class:`~fedge.transport.artifact_channel.ArtifactSubscriber`'s worker): each new
  signed version is checked, built and warmed beside the serving session and swapped in by reference
  (:class:`~fedge.inference.serving.ModelServer`); a refused model leaves the old one serving. Accepted
  models are written to ``model_dir`` so a restart serves the last model at once;
* **reports** (a timer): a retained JSON status on ``fedge/<fleet>/infer/<node>/status`` with the serving
  version, p50/p95/p99 latency, request and swap counters and the recent swap log; the broker publishes an
  offline status (the last will) if the agent dies.

Nothing here imports torch or Flower: ``pip install 'fedge[infer]'`` is enough (onnxruntime, numpy,
paho-mqtt and typer; signed model headers are checked without ``cryptography``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError
from fedge.inference.agent_config import InferenceAgentConfig, read_canary
from fedge.inference.delta_receiver import DeltaReceiver
from fedge.inference.distribution import DELTA, Choice, VariantCollector, choose_variant, variant_artifact
from fedge.inference.feeds import manifest_dtype, zeros_input
from fedge.inference.io import InputError, decode_array, decode_arrays, encode_array, encode_arrays, is_npz
from fedge.inference.manifest import Manifest, write_manifest
from fedge.inference.priority import start_at_lower_priority
from fedge.inference.replicas import ReplicaGroup
from fedge.inference.serving import ModelServer
from fedge.transport.artifact_channel import ArtifactSubscriber
from fedge.transport.artifacts import ArtifactHeader
from fedge.transport.connection import MessageProperties, MqttConnection, Will
from fedge.transport.message_chunks import (
    CHUNK_PROPERTY,
    ChunkError,
    MessageAssembler,
    parse_chunk,
    split_message,
)
from fedge.transport.signing import InstructionVerifier
from fedge.transport.topics import Topics

__all__ = ["InferenceAgent", "InferenceAgentConfig"]

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
_VARIANTS_WAIT_S = 5.0  # how long a fetch turn waits for the rest of its version's variants


class InferenceAgent:
    """Serve the fleet's model on this device; see the module docstring.

    Parameters
    ----------
    config : InferenceAgentConfig
        The device's settings.
    replica : int, default 0
        Which of the device's ``config.replicas`` serving processes this is.
    """

    def __init__(self, config: InferenceAgentConfig, replica: int = 0) -> None:
        if not 0 <= replica < config.replicas:
            raise ConfigError(f"replica {replica} is not one of the {config.replicas} replicas configured")
        self.config = config
        self.replica = replica
        self._replica_tag = ("replica", str(replica))
        self.topics = Topics(config.mqtt.fleet)
        self.server = ModelServer(config.session)
        self.canary = read_canary(config.canary_file, config.canary_min_accuracy)
        self.requests = 0
        self.failed_requests: dict[str, int] = {}
        self.swap_log: deque[dict[str, Any]] = deque(maxlen=64)
        # Large requests arrive in chunks; partial ones are held per requester under its own budget.
        self._partial = MessageAssembler(config.max_request_bytes, max_open=4, expiry_s=60.0)
        self._stop = threading.Event()
        self._status_thread: threading.Thread | None = None
        suffix = f"-{replica}" if replica else ""
        self.connection = MqttConnection(config.mqtt, f"{config.node_id}-infer{suffix}", will=self._will)
        self.group = ReplicaGroup(
            self.connection,
            self.topics,
            config.node_id,
            replica,
            config.replicas,
            config.model_dir,
            stale_after_s=3 * config.status_every_s + 1,
        )
        # Pure Python: a model version is verified now and then, and cryptography would cost 8 MB resident.
        keys = config.instruction_keys
        verifier = InstructionVerifier(keys, pure_python=True) if keys else None
        self.collector = VariantCollector(config.variants)
        self.choice: Choice | None = None
        # Models arrive on a connection of their own: reassembling and checking chunks on paho's thread of
        # the request connection would hold up requests.
        self.models_connection = MqttConnection(config.mqtt, f"{config.node_id}-models{suffix}")
        self.subscribers = {
            variant: ArtifactSubscriber(
                self.models_connection,
                self.topics,
                variant_artifact(config.artifact, variant),
                functools.partial(self._on_variant, variant),
                on_failed=functools.partial(self._on_failed_variant, variant),
                verifier=verifier,
                max_size=config.max_model_bytes,
                max_chunk_size=config.mqtt.transfer.max_chunk_size,
                fetch_turn=self._fetch_turn if self.group.shared else None,
            )
            for variant in config.variants
        }
        # fp32 weights as a delta of the version this device holds, when the coordinator sends one
        self.deltas: DeltaReceiver | None = None
        if config.accept_deltas:
            full = self.subscribers["fp32"]
            served = Path(config.model_dir) / MODEL_FILE
            self.deltas = DeltaReceiver(served, config.max_model_bytes, full, self._add_fp32)
            self.subscribers[DELTA] = ArtifactSubscriber(
                self.models_connection,
                self.topics,
                variant_artifact(config.artifact, DELTA),
                self.deltas.on_delta,
                on_failed=self.deltas.on_failed,
                verifier=verifier,
                max_size=config.max_model_bytes,
                max_chunk_size=config.mqtt.transfer.max_chunk_size,
                fetch_turn=self._fetch_turn if self.group.shared else None,
                on_header=self.deltas.on_header,
            )
        self._fp32_added: deque[str] = deque(maxlen=16)  # versions whose fp32 reached the collector
        self._install_lock = threading.Lock()
        self._turn_taken_at: dict[str, float] = {}  # version -> when this replica asked for its turn
        self.model_work_lowered = False  # whether the model threads run at model_work_nice (set by start)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the kept model (if any), connect, and start answering, receiving and reporting."""
        kept = Path(self.config.model_dir) / MODEL_FILE
        if kept.is_file():
            result = self.server.load(kept, canary=self.canary)
            if result.ok:
                for subscriber in self.subscribers.values():
                    subscriber.current_version = result.version
                log.info("serving kept model %s", result.version)
            else:
                log.warning("kept model %s refused: %s", kept, result.message)
        self.group.serve_requests(self._on_request)
        self.connection.start()
        # With a peer replica serving, this replica's model work (chunks, checks, session builds) runs on
        # threads started at a lower priority, so the peer's requests get the CPU first. In one process the
        # request thread shares the GIL with that work, and a lowered thread preempted while it holds the
        # GIL delays requests instead (measured: no gain), so there it keeps the requests' priority.
        nice = self.config.model_work_nice if self.config.replicas > 1 else 0
        self.model_work_lowered = start_at_lower_priority(nice, self._start_model_work, name="infer-models")
        if not self.connection.is_v5:
            log.warning(
                "broker speaks MQTT 3.1.1: requests need MQTT 5 response topics and will go unanswered"
            )
        self._status_thread = threading.Thread(target=self._report_loop, name="infer-status", daemon=True)
        self._status_thread.start()

    def _start_model_work(self) -> None:
        """Start the threads that receive and install models (they inherit the caller's priority)."""
        for subscriber in self.subscribers.values():
            subscriber.start()
        self.models_connection.start()

    def stop(self) -> None:
        """Publish a last (offline) status and disconnect."""
        self._stop.set()
        if self._status_thread is not None:
            self._status_thread.join(timeout=10)
        for subscriber in self.subscribers.values():
            subscriber.stop()
        if self.deltas is not None:
            self.deltas.close()
        self.connection.publish(self.group.status_topic(), self._status(online=False), retain=True)
        self.models_connection.close()
        self.connection.close()

    def run_forever(self, stop: threading.Event) -> None:
        """Start, then serve until ``stop`` is set."""
        self.start()
        try:
            stop.wait()
        finally:
            self.stop()

    def __enter__(self) -> InferenceAgent:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- requests (paho's thread) ----------------------------------------------------------------------
    def _on_request(self, _topic: str, payload: bytes, props: MessageProperties) -> None:
        if not props.response_topic:
            self.requests += 1
            self._count_failure("no-response-topic")
            return  # nowhere to answer; counted and logged once per kind
        fields = dict(props.user_properties)
        if CHUNK_PROPERTY in fields:  # one chunk of a large request: answer once it is whole
            try:
                index, count = parse_chunk(fields[CHUNK_PROPERTY], max_chunks=4096)
                key = props.correlation_data or b""
                whole = self._partial.add(props.response_topic, key, index, count, payload, time.monotonic())
            except ChunkError as err:
                self.requests += 1
                self._count_failure("bad-chunk")
                self._answer(props, b"", (("status", "error"), ("error", str(err)), ("version", "")))
                return
            if whole is None:
                return
            payload = whole
        self.requests += 1
        caps = {"max_bytes": self.config.max_request_bytes, "max_rows": self.config.max_batch}
        try:
            if is_npz(payload):  # named inputs: every output comes back by name
                named, version = self.server.run_named(decode_arrays(payload, **caps))
                answer = encode_arrays(named)
            else:
                outputs, version = self.server.predict_versioned(decode_array(payload, **caps))
                answer = encode_array(outputs)
            extra = (("status", "ok"), ("version", version), self._replica_tag)
        except InputError as err:
            answer, extra = b"", (("status", "error"), ("error", str(err)), ("version", ""))
            self._count_failure("bad-request")
        except Exception as err:  # ORT's shape/type errors, no model loaded yet
            message = f"{type(err).__name__}: {err}"[:500]
            answer, extra = b"", (("status", "error"), ("error", message), ("version", ""))
            self._count_failure("inference")
        self._answer(props, answer, extra)

    def _answer(self, props: MessageProperties, answer: bytes, extra: tuple[tuple[str, str], ...]) -> None:
        """Publish an answer on the request's response topic; a large one in chunks at QoS 1."""
        chunks = split_message(answer, self.config.chunk_bytes)
        for index, chunk in enumerate(chunks):
            tag = ((CHUNK_PROPERTY, f"{index}/{len(chunks)}"),) if len(chunks) > 1 else ()
            reply = MessageProperties(correlation_data=props.correlation_data, user_properties=(*extra, *tag))
            assert props.response_topic is not None
            self.connection.publish(
                props.response_topic, chunk, qos=1 if tag else 0, message_properties=reply
            )

    def _count_failure(self, reason: str) -> None:
        first = reason not in self.failed_requests
        self.failed_requests[reason] = self.failed_requests.get(reason, 0) + 1
        if first:
            log.warning("inference request failed (%s); further ones are counted in the status", reason)

    # -- models (the subscriber's worker) --------------------------------------------------------------
    def _on_variant(self, variant: str, header: ArtifactHeader, data: bytes, received_at: float) -> None:
        """One variant of a version arrived (a subscriber's worker thread); install the version once whole."""
        try:
            manifest = Manifest.from_dict(header.meta)
        except (KeyError, TypeError, ValueError) as err:
            self._log_swap(
                header.version, variant, False, "manifest", f"malformed manifest: {err}", received_at
            )
            return
        # The fleet knows the model by the artifact's version.
        self._add_variant(variant, header.version, manifest.with_(version=header.version), data, received_at)

    def _add_fp32(self, version: str, manifest: Manifest, data: bytes, received_at: float) -> None:
        """The fp32 file rebuilt from a delta (the delta subscriber's worker)."""
        self._add_variant("fp32", version, manifest, data, received_at)

    def _add_variant(
        self, variant: str, version: str, manifest: Manifest, data: bytes, received_at: float
    ) -> None:
        if variant == "fp32":  # from its delta or in full, whichever came first
            if version in self._fp32_added:
                return
            self._fp32_added.append(version)
        candidates = self.collector.add(variant, version, data, manifest)
        if candidates is not None:
            with self._install_lock:  # one version at a time, whichever subscriber completed it
                self._install(version, candidates, received_at)

    def _on_failed_variant(self, variant: str, version: str) -> None:
        """A variant failed its checksum: install the version from the variants that did arrive."""
        self._log_swap(version, variant, False, "checksum", "bytes do not match the signed header")
        candidates = self.collector.fail(variant, version)
        if candidates is not None:
            with self._install_lock:
                self._install(version, candidates, time.time())

    @contextlib.contextmanager
    def _fetch_turn(self, header: ArtifactHeader) -> Iterator[bool]:
        """With replicas, a version's variants are fetched in this replica's turn, out of the group."""
        if len(self._turn_taken_at) >= 16:  # versions never installed (a variant lost) are forgotten
            self._turn_taken_at.pop(next(iter(self._turn_taken_at)))
        self._turn_taken_at.setdefault(header.version, time.time())
        with self.group.out_of_group(swap=False) as left:
            yield left
            # The version's other variants are on their way (they are published back to back): keep the
            # turn for them, so the replica leaves and rejoins the request group once per version.
            self.collector.wait_for_rest(header.version, _VARIANTS_WAIT_S)

    def _install(self, version: str, candidates: dict, received_at: float) -> None:
        """Choose among the candidates by measuring them here, then swap the chosen one in."""
        now = time.time()
        # With replicas the swap began when this replica asked for its turn to fetch the version.
        times = {"received_at": received_at, "install_at": min(now, self._turn_taken_at.pop(version, now))}
        with self.group.out_of_group() as left:  # with a live peer replica, no request waits for this work
            times["swap_started_at"] = time.time()
            try:
                choice = choose_variant(
                    candidates,
                    self._sample(candidates["fp32"][1]),
                    batch=self.config.serve_batch,
                    max_drop_pp=self.config.max_accuracy_drop_pp,
                    config=self.config.session,
                )
            except Exception as err:  # a variant ORT cannot build: fp32 is the reference and the fallback
                choice = Choice("fp32", f"measuring the variants failed ({type(err).__name__}: {err}); fp32")
            data, manifest = candidates[choice.variant]
            result = self.server.swap(data, manifest, version=version, canary=self.canary)
            times["built_at"] = time.time()
        if result.ok:
            self.choice = choice
            self._keep(data, manifest)
        self._log_swap(
            version, choice.variant, result.ok, result.reason, result.message, out_of_group=left, **times
        )
        self._publish_status()
        if result.ok and self.deltas is not None and choice.variant != "fp32":  # the next delta's base
            self.deltas.keep_base(*candidates["fp32"])

    def _sample(self, manifest: Manifest) -> np.ndarray | dict[str, np.ndarray]:
        """Inputs to measure variants on: the canary's, or zeros of each input's shape and type."""
        if self.canary is not None and len(manifest.inputs) == 1:
            return self.canary.inputs
        zeros = {spec.name: zeros_input(spec.shape, manifest_dtype(spec.dtype)) for spec in manifest.inputs}
        return zeros if len(zeros) > 1 else next(iter(zeros.values()))

    def _log_swap(
        self, version: str, variant: str, ok: bool, reason: str, message: str, **facts: Any
    ) -> None:
        """Record a swap (or a refusal) in the status's swap log; ``facts`` are its timestamps and flags."""
        now = time.time()
        facts.setdefault("received_at", now)
        entry = {"version": version, "variant": variant, "ok": ok, "reason": reason, "message": message}
        self.swap_log.append({**entry, **facts, "swapped_at": now})
        if not ok:
            log.warning("model %s (%s) refused: %s", version, variant, message)

    def _keep(self, data: bytes, manifest: Manifest | None) -> None:
        """Write the accepted model where a restart finds it (atomically: never half a model)."""
        path = Path(self.config.model_dir) / MODEL_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, data)
            if manifest is not None:
                write_manifest(path, manifest)
        except OSError as err:
            log.warning("cannot keep model in %s: %s", path.parent, err)

    # -- status ----------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The serving status (what the retained status message carries)."""
        stats = self.server.stats()
        choice = self.choice
        return {
            "node_id": self.config.node_id,
            "replica": self.replica,
            "online": True,
            "version": stats.version,
            "latency_ms": {
                "p50": stats.p50_ms,
                "p95": stats.p95_ms,
                "p99": stats.p99_ms,
                "count": stats.count,
            },
            "requests": self.requests,
            "failed_requests": dict(self.failed_requests),
            "swaps": stats.swaps,
            "model_work_nice": self.config.model_work_nice if self.model_work_lowered else 0,
            "failed_swaps": stats.failed_swaps,
            "variant": choice.variant if choice else "",
            "variant_reason": choice.reason if choice else "",
            "variant_latency_ms": {
                m.variant: m.latency_ms[self.config.serve_batch][0] for m in choice.measurements
            }
            if choice
            else {},
            "models": {v: dataclasses.asdict(sub.stats) for v, sub in self.subscribers.items()},
            "deltas": dataclasses.asdict(self.deltas.stats) if self.deltas is not None else {},
            "swap_log": list(self.swap_log),
            "updated_at": time.time(),
        }

    def _status(self, *, online: bool = True) -> bytes:
        status = self.status() if online else {"node_id": self.config.node_id, "online": False}
        return json.dumps(status).encode()

    def _publish_status(self) -> None:
        self.connection.publish(self.group.status_topic(), self._status(), retain=True)

    def _report_loop(self) -> None:
        self._publish_status()
        while not self._stop.wait(self.config.status_every_s):
            self._publish_status()

    def _will(self) -> Will:
        return Will(self.group.status_topic(), self._status(online=False))
