"""The inference agent's model side: a version's variants in, the model this device serves out.

:class:`ModelInstaller` runs on the artifact subscribers' worker threads. It collects each version's
variants (:class:`~fedge.inference.distribution.VariantCollector`), chooses what to serve by measuring on
this CPU (the variant, :func:`~fedge.inference.distribution.choose_variant`, and the intra-op thread count,
:class:`~fedge.inference.select.ThreadChooser`), swaps it in beside the serving model
(:meth:`~fedge.inference.serving.ModelServer.swap`), keeps it in ``model_dir`` for a restart and logs every
swap or refusal. With two replicas it fetches and installs in this replica's turn, out of the request group.
One version installs at a time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedge.atomic import write_bytes_atomic
from fedge.inference.agent_config import InferenceAgentConfig
from fedge.inference.delta_receiver import DeltaReceiver
from fedge.inference.distribution import Choice, VariantCollector, choose_variant
from fedge.inference.feeds import manifest_dtype, zeros_input
from fedge.inference.manifest import Manifest, is_older, read_manifest, write_manifest
from fedge.inference.replicas import ReplicaGroup
from fedge.inference.select import ThreadChooser
from fedge.inference.serving import Canary, ModelServer, SwapResult
from fedge.inference.session import SessionConfig
from fedge.transport.artifacts import ArtifactHeader

__all__ = ["MODEL_FILE", "ModelInstaller"]

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
_VARIANTS_WAIT_S = 5.0  # how long a fetch turn waits for the rest of its version's variants


class ModelInstaller:
    """Install the versions a device receives; see the module docstring.

    Parameters
    ----------
    config : InferenceAgentConfig
        The device's settings (variants, serving batch, accuracy bound, session options, ``model_dir``).
    server : ModelServer
        The server whose model this replaces.
    group : ReplicaGroup
        The device's serving replicas (a group of one in a single process).
    canary : Canary, optional
        The check every new model passes before it serves.
    on_installed : callable
        Called after each install or refusal (the agent publishes its status).
    """

    def __init__(
        self,
        config: InferenceAgentConfig,
        server: ModelServer,
        group: ReplicaGroup,
        canary: Canary | None,
        on_installed: Callable[[], None],
    ) -> None:
        self.config, self.server, self.group, self.canary = config, server, group, canary
        self.collector = VariantCollector(config.variants)
        self.threads = ThreadChooser(config.session, config.serve_batch, enabled=config.choose_threads)
        self.choice: Choice | None = None
        self.swap_log: deque[dict[str, Any]] = deque(maxlen=64)
        self.deltas: DeltaReceiver | None = None  # the next delta's base is kept here (set by the agent)
        self._on_installed = on_installed
        self._fp32_added: deque[str] = deque(maxlen=16)  # versions whose fp32 reached the collector
        self._install_lock = threading.Lock()
        self._turn_taken_at: dict[str, float] = {}  # version -> when this replica asked for its turn

    def load_kept(self) -> SwapResult | None:
        """Serve the model kept from an earlier run, if there is one (None: there is none)."""
        kept = Path(self.config.model_dir) / MODEL_FILE
        if not kept.is_file():
            return None
        try:
            data, manifest = kept.read_bytes(), read_manifest(kept)
        except (OSError, ValueError):  # the server's load says what is wrong with the file
            return self.server.load(kept, canary=self.canary)
        config = self._session_config(data, manifest) if manifest is not None else None
        version = manifest.version if manifest else kept.stem  # as ModelServer.load names it
        return self.server.swap(data, manifest, version=version, canary=self.canary, config=config)

    def on_variant(self, variant: str, header: ArtifactHeader, data: bytes, received_at: float) -> None:
        """One variant of a version arrived (a subscriber's worker thread); install the version once whole."""
        try:
            manifest = Manifest.from_dict(header.meta)
        except ValueError as err:
            self.server.count_refusal("manifest")
            message = f"malformed manifest: {err}"
            self._log_swap(header.version, variant, False, "manifest", message, received_at=received_at)
            return
        # The fleet knows the model by the artifact's version.
        self._add_variant(variant, header.version, manifest.with_(version=header.version), data, received_at)

    def add_fp32(self, version: str, manifest: Manifest, data: bytes, received_at: float) -> None:
        """The fp32 file rebuilt from a delta (the delta subscriber's worker)."""
        self._add_variant("fp32", version, manifest, data, received_at)

    def _add_variant(
        self, variant: str, version: str, manifest: Manifest, data: bytes, received_at: float
    ) -> None:
        serving = self.server.serving_manifest
        if is_older(manifest, serving):  # a signed old version replayed (by a broker, say): no going back
            assert serving is not None
            self.server.count_refusal("rollback")
            message = f"exported before the serving {serving.version} (round {serving.round})"
            self._log_swap(version, variant, False, "rollback", message, received_at=received_at)
            return
        if variant == "fp32":  # from its delta or in full, whichever came first
            if version in self._fp32_added:
                return
            self._fp32_added.append(version)
        try:
            candidates = self.collector.add(variant, version, data, manifest)
            if candidates is not None:
                with self._install_lock:  # one version at a time, whichever subscriber completed it
                    self._install(version, candidates, received_at)
        except Exception:
            # not installed: the same version republished must be tried again, not ignored for good
            if variant == "fp32" and version in self._fp32_added:
                self._fp32_added.remove(version)
            raise

    def on_failed_variant(self, variant: str, version: str) -> None:
        """A variant failed its checksum: install the version from the variants that did arrive."""
        self._log_swap(version, variant, False, "checksum", "bytes do not match the signed header")
        candidates = self.collector.fail(variant, version)
        if candidates is not None:
            with self._install_lock:
                self._install(version, candidates, time.time())

    @contextlib.contextmanager
    def fetch_turn(self, header: ArtifactHeader) -> Iterator[bool]:
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
            session = self._session_config(*candidates["fp32"])  # threads measured on the reference
            try:
                choice = choose_variant(
                    candidates,
                    self._sample(candidates["fp32"][1]),
                    batch=self.config.serve_batch,
                    max_drop_pp=self.config.max_accuracy_drop_pp,
                    config=session,
                )
            except Exception as err:  # a variant ORT cannot build: fp32 is the reference and the fallback
                choice = Choice("fp32", f"measuring the variants failed ({type(err).__name__}: {err}); fp32")
            data, manifest = candidates[choice.variant]
            result = self.server.swap(data, manifest, version=version, canary=self.canary, config=session)
            times["swapped_at"] = time.time()  # the new session serves from here (or the old one stays)
        if result.ok:
            self.choice = choice
            # Only this version's repeats are duplicates now: an earlier one published again (a pipeline
            # going back to a placement it had, same content, same version) must be installed again; it
            # had been dropped as a duplicate for as long as the version stayed in this list.
            self._fp32_added = deque((v for v in self._fp32_added if v == version), maxlen=16)
            self._keep(data, manifest)
            times["kept_at"] = time.time()
        self._log_swap(
            version, choice.variant, result.ok, result.reason, result.message, out_of_group=left, **times
        )
        self._on_installed()
        if result.ok and self.deltas is not None and choice.variant != "fp32":  # the next delta's base
            self.deltas.keep_base(*candidates["fp32"])

    def _session_config(self, data: bytes, manifest: Manifest) -> SessionConfig:
        """The session settings for a model: the device's, with the thread count measured for its layout."""
        layout = (len(data), repr(manifest.inputs), repr(manifest.outputs))
        return self.threads.config_for(data, layout, lambda: self._sample(manifest))

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
        facts.setdefault("swapped_at", now)
        entry = {"version": version, "variant": variant, "ok": ok, "reason": reason, "message": message}
        self.swap_log.append({**entry, **facts, "logged_at": now})
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
