"""The inference agent: a torch-free device process that serves the fleet's model over MQTT.

It does three things, each on its own thread:

* **answers requests** (paho's network thread): an ``.npy`` batch (or an ``.npz`` of named inputs, answered
  with every output by name: a pipeline stage) on ``fedge/<fleet>/infer/<node>/request``
  with an MQTT 5 response topic and correlation data gets its outputs as ``.npy`` on the response topic, with
  the same correlation data and user properties ``status`` (``ok`` / ``error``), ``version`` and, on error,
  ``error``. A bad request is answered with an error and counted; it never stops the agent;
* **receives models** (:class:`~fedge.transport.artifact_channel.ArtifactSubscriber`'s worker, driving a
  :class:`~fedge.inference.installer.ModelInstaller`): each new signed version's variant and thread count
  are chosen by measuring here, and it is checked, built and warmed beside the serving session and swapped in
  by reference (:class:`~fedge.inference.serving.ModelServer`); a refused model leaves the old one serving.
  Accepted models are written to ``model_dir`` so a restart serves the last model at once;
* **reports** (a timer): a retained JSON status on ``fedge/<fleet>/infer/<node>/status`` with the serving
  version, p50/p95/p99 latency, request and swap counters and the recent swap log; the broker publishes an
  offline status (the last will) if the agent dies.

Nothing here imports torch or Flower: fedge with the ``infer`` extra's packages is enough (onnxruntime, numpy,
paho-mqtt and typer; signed model headers are checked without ``cryptography``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from fedge.config import ConfigError
from fedge.inference.agent_config import InferenceAgentConfig, read_canary
from fedge.inference.delta_receiver import DeltaReceiver
from fedge.inference.distribution import DELTA, variant_artifact
from fedge.inference.installer import MODEL_FILE, ModelInstaller
from fedge.inference.io import InputError, decode_array, decode_arrays, encode_array, encode_arrays, is_npz
from fedge.inference.priority import start_at_lower_priority
from fedge.inference.replicas import ReplicaGroup
from fedge.inference.serving import ModelServer
from fedge.transport.artifact_channel import ArtifactSubscriber
from fedge.transport.connection import MessageProperties, MqttConnection, Will
from fedge.transport.message_chunks import (
    CHUNK_PROPERTY,
    ChunkError,
    MessageAssembler,
    parse_chunk,
    split_message,
)
from fedge.transport.mqtt_text import is_publish_topic
from fedge.transport.signing import InstructionVerifier
from fedge.transport.topics import Topics

__all__ = ["InferenceAgent", "InferenceAgentConfig"]

log = logging.getLogger(__name__)


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
        # Large requests arrive in chunks; partial ones are held per requester under its own budget.
        self._partial = MessageAssembler(config.max_request_bytes, max_open=4, expiry_s=60.0)
        self._refused: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # oversized requests answered
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
        self.installer = ModelInstaller(config, self.server, self.group, self.canary, self._publish_status)
        # Models arrive on a connection of their own: reassembling and checking chunks on paho's thread of
        # the request connection would hold up requests.
        self.models_connection = MqttConnection(config.mqtt, f"{config.node_id}-models{suffix}")
        self.subscribers = {
            variant: ArtifactSubscriber(
                self.models_connection,
                self.topics,
                variant_artifact(config.artifact, variant),
                functools.partial(self.installer.on_variant, variant),
                on_failed=functools.partial(self.installer.on_failed_variant, variant),
                verifier=verifier,
                max_size=config.max_model_bytes,
                max_chunk_size=config.mqtt.transfer.max_chunk_size,
                fetch_turn=self.installer.fetch_turn if self.group.shared else None,
            )
            for variant in config.variants
        }
        # fp32 weights as a delta of the version this device holds, when the coordinator sends one
        self.deltas: DeltaReceiver | None = None
        if config.accept_deltas:
            full = self.subscribers["fp32"]
            served = Path(config.model_dir) / MODEL_FILE
            self.deltas = DeltaReceiver(served, config.max_model_bytes, full, self.installer.add_fp32)
            self.installer.deltas = self.deltas
            self.subscribers[DELTA] = ArtifactSubscriber(
                self.models_connection,
                self.topics,
                variant_artifact(config.artifact, DELTA),
                self.deltas.on_delta,
                on_failed=self.deltas.on_failed,
                verifier=verifier,
                max_size=config.max_model_bytes,
                max_chunk_size=config.mqtt.transfer.max_chunk_size,
                fetch_turn=self.installer.fetch_turn if self.group.shared else None,
                on_header=self.deltas.on_header,
            )
        self.model_work_lowered = False  # whether the model threads run at model_work_nice (set by start)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the kept model (if any), connect, and start answering, receiving and reporting."""
        if not self.config.instruction_keys:  # the default: said once, where an operator looks
            log.warning(
                "no instruction_key_files: this device installs and serves models from anyone who may "
                "publish on the fleet's artifact topics; give it the coordinator's public key "
                "(docs/deployment.md)"
            )
        result = self.installer.load_kept()
        if result is not None and result.ok:
            for subscriber in self.subscribers.values():
                subscriber.current_version = result.version
            log.info("serving kept model %s", result.version)
        elif result is not None:
            log.warning("kept model refused: %s", result.message)
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
    def _refuse_once(self, topic: str, key: bytes) -> bool:
        """Whether an oversized request is refused now (its first chunk seen), not already answered."""
        if (topic, key) in self._refused:
            return False
        self._refused[(topic, key)] = None
        while len(self._refused) > 256:  # remembered for a while, within a bound
            self._refused.popitem(last=False)
        return True

    def _on_request(self, _topic: str, payload: bytes, props: MessageProperties) -> None:
        if not props.response_topic:
            self.requests += 1
            self._count_failure("no-response-topic")
            return  # nowhere to answer; counted and logged once per kind
        topic = props.response_topic
        if not (is_publish_topic(topic) and self.topics.is_infer_reply(topic, self.config.node_id)):
            self.requests += 1  # unpublishable, or not an answer topic of this device
            self._count_failure("bad-response-topic")
            return
        fields = dict(props.user_properties)
        if CHUNK_PROPERTY in fields:  # one chunk of a large request: answer once it is whole
            try:
                index, count = parse_chunk(fields[CHUNK_PROPERTY], max_chunks=4096)
                key = props.correlation_data or b""
                if (count - 1) * len(payload) > self.config.max_request_bytes and index < count - 1:
                    if not self._refuse_once(props.response_topic, key):
                        return  # answered at its first chunk
                    # said in the requester's terms (the assembler's budget would name its reply topic)
                    raise ChunkError(
                        f"the request holds more than {(count - 1) * len(payload)} bytes; this device accepts"
                        f" at most {self.config.max_request_bytes} (max_request_bytes)"
                    )
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
            extra = (("status", "ok"), ("version", version), self._replica_tag, *self._outputs_kind())
            if not is_npz(payload):  # an array request gets the first output: say which others there are
                extra += self._other_outputs()
        except InputError as err:
            answer, extra = b"", (("status", "error"), ("error", str(err)), ("version", ""))
            self._count_failure("bad-request")
        except Exception as err:  # ORT's shape/type errors, no model loaded yet
            message = f"{type(err).__name__}: {err}"[:500]
            answer, extra = b"", (("status", "error"), ("error", message), ("version", ""))
            # ORT's InvalidArgument: the request's rank, dimensions or type do not fit the model
            self._count_failure("bad-request" if type(err).__name__ == "InvalidArgument" else "inference")
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

    def _outputs_kind(self) -> tuple[tuple[str, str], ...]:
        """What the served model's outputs are, as its manifest says (``classes``/``values``), for the
        requester to print them right; nothing when unknown."""
        manifest = self.server.current.manifest  # a model answered the request, so one is loaded
        kind = manifest.extra.get("outputs") if manifest is not None else None
        return (("outputs", kind),) if isinstance(kind, str) else ()

    def _other_outputs(self) -> tuple[tuple[str, str], ...]:
        """The served model's outputs after the first, by name (``other_outputs``), for the requester to say
        they were left out of an array request's answer; nothing for a model of one output."""
        names = [o.name for o in self.server.current.session.get_outputs()[1:]]
        return (("other_outputs", ",".join(names)),) if names else ()

    def _count_failure(self, reason: str) -> None:
        first = reason not in self.failed_requests
        self.failed_requests[reason] = self.failed_requests.get(reason, 0) + 1
        if first:
            log.warning("inference request failed (%s); further ones are counted in the status", reason)

    @property
    def swap_log(self) -> deque[dict[str, Any]]:
        """The recent swaps and refusals (the installer's log)."""
        return self.installer.swap_log

    # -- status ----------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The serving status (what the retained status message carries)."""
        stats = self.server.stats()
        choice, threads = self.installer.choice, self.installer.threads.last
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
            "threads": stats.threads,
            "threads_reason": threads.reason if threads else "",
            "threads_latency_ms": {str(n): p50 for n, p50 in threads.p50_ms.items()} if threads else {},
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
            "swap_log": list(self.installer.swap_log),
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
