"""Compressed downloads: the global model as a compressed delta against a reference every client shares.

The coordinator keeps one reference model ``M`` (what up-to-date clients hold) and the global model
``x``. Each round it encodes ``x − M`` with the delta codec and advances ``M`` by exactly what the
payload decodes to (:func:`fedge.protocol.reference.advance_reference`); clients that hold ``M`` apply the
same payload and get the same ``M``. What the codec left out stays in ``x − M`` and travels in a later
round: that difference *is* the server-side error-feedback residual, so it needs no memory of its own.

A version may be prepared twice: evaluate messages of round ``r`` carry the model train messages of round
``r + 1`` start from, so both use version ``r + 1``. The second time nothing advances: a node that already
holds the version gets an empty delta (one byte per tensor), one that holds the version before gets the
same delta again, the others the full model.

A client that missed a round, joins late or lost its state gets the full ``M`` instead (fp16, fp32 or
blockwise int8). ``M`` is kept on the fp16 grid when full models go as fp16, so that download is exact
and the client rejoins the delta stream; an int8 full model is approximate, marked so, and the client
gets full models until it holds an exact one. Which node holds which version is known only from its
replies: a node that did not answer is assumed to hold nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fedge.compression import Codec, build_codec
from fedge.compression.wire import DTYPES
from fedge.protocol.records import APPROXIMATE, FULL
from fedge.protocol.reference import advance_reference, beyond_fp16, exact_tensors, snap_to_grid

__all__ = ["FULL_MODEL_CODECS", "DownlinkConfig", "Download", "ModelBroadcast"]

log = logging.getLogger(__name__)

# full-model codec -> (codec spec, reference grid, exact)
FULL_MODEL_CODECS: dict[str, tuple[str, str, bool]] = {
    "fp32": ("fp32", "fp32", True),
    "fp16": ("fp16;dense=fp16", "fp16", True),
    "int8": ("int8;dense=fp16", "fp16", False),
}


@dataclass(frozen=True)
class DownlinkConfig:
    """How the coordinator compresses downloads.

    Parameters
    ----------
    codec : str (default: "topk:0.1+int8")
        Codec of the per-round delta, any :func:`fedge.compression.build_codec` spec.
    full_model : str (default: "fp16")
        Codec of full models for clients without the previous version: ``"fp16"`` (exact, the
        reference stays on the fp16 grid), ``"fp32"`` (exact) or ``"int8"`` (blockwise, approximate).
    """

    codec: str = "topk:0.1+int8"
    full_model: str = "fp16"

    def __post_init__(self) -> None:
        if self.full_model not in FULL_MODEL_CODECS:
            raise ValueError(
                f"full-model codec must be one of {', '.join(FULL_MODEL_CODECS)}, got {self.full_model!r}"
            )
        build_codec(self.codec)  # a bad spec fails here, naming the problem

    @property
    def grid(self) -> str:
        """The grid the reference model is kept on."""
        return FULL_MODEL_CODECS[self.full_model][1]


@dataclass(frozen=True)
class Download:
    """What one node is sent: a payload and the version it applies to (``FULL``/``APPROXIMATE``: none)."""

    base: int
    payload: bytes

    @property
    def is_delta(self) -> bool:
        return self.base >= 0


class ModelBroadcast:
    """The coordinator's side of compressed downloads: the reference model and who holds which version.

    Parameters
    ----------
    config : DownlinkConfig
        Delta and full-model codecs.
    """

    def __init__(self, config: DownlinkConfig) -> None:
        self.config = config
        self.reference: dict[str, np.ndarray] | None = None
        self.version: int | None = None
        self._delta_codec: Codec = build_codec(config.codec)
        spec, _, self._exact = FULL_MODEL_CODECS[config.full_model]
        self._full_codec: Codec = build_codec(spec)
        self._holders: dict[int, int] = {}
        self._delta: Download | None = None  # the delta that made this version, from the one before
        self._empty: Download | None = None  # an all-zero delta from this version to itself
        self._full: Download | None = None  # the full model of this version
        self._previous_holders: dict[int, int] = {}  # who held the version before this one
        self._saturated: set[str] = set()  # tensors already warned of (beyond fp16's range)

    def prepare(
        self,
        version: int,
        model: Mapping[str, np.ndarray],
        node_ids: Iterable[int],
        dtypes: Mapping[str, str] | None = None,
    ) -> dict[int, Download]:
        """Advance the reference to ``version`` towards ``model`` and return each node's download.

        Nodes known to hold the previous version get the delta; the others the full reference.
        ``dtypes`` (the tensors' own dtypes) makes integer buffers travel exactly in both. Preparing the
        current version again (same ``model``) advances nothing: see the module docstring.
        """
        dtypes = {name: dtype for name, dtype in (dtypes or {}).items() if dtype in DTYPES}
        node_ids = list(node_ids)
        if version == self.version and self.reference is not None:
            return self._again(node_ids, dtypes)
        exact = exact_tensors(dtypes)  # integers: exact in every payload, so never on the fp16 grid
        self._warn_saturated(model, exact)  # once a version (a pass over the model), not once a prepare
        previous = self.version
        up_to_date = {n for n in node_ids if previous is not None and self._holders.get(n) == previous}
        delta = None
        if up_to_date:
            difference = {name: model[name] - self.reference[name] for name in self.reference}
            delta = Download(previous, self._delta_codec.encode(difference, seed=version, dtypes=dtypes))
            del difference
            self.reference = advance_reference(
                self.reference,
                delta.payload,
                full=False,
                grid=self.config.grid,
                max_elements=_size(model),
                exact=exact,
            )
        else:  # nobody holds the old reference: restart it from the model itself, residual cleared
            self.reference = {
                name: np.array(array, dtype=np.float32, copy=True) for name, array in model.items()
            }
            snap_to_grid(self.reference, self.config.grid, exact)
        self.version = version
        self._previous_holders = {n: v for n, v in self._holders.items() if v == previous}
        self._holders.clear()  # from now on only replies to this round's messages tell who holds what
        self._delta, self._empty, self._full = delta, None, None
        full = None
        if len(up_to_date) < len(node_ids):
            full = self._full_download(dtypes)
        return {node: delta if node in up_to_date else full for node in node_ids}

    def _warn_saturated(self, model: Mapping[str, np.ndarray], exact: frozenset[str]) -> None:
        """Say once per tensor that the fp16 grid saturates it: clients then hold ±65504 where the
        coordinator holds more (a normalising constant of 1e5, say); an fp32 full model keeps it whole."""
        if self.config.grid != "fp16":
            return
        for name in beyond_fp16(model, exact | self._saturated):
            self._saturated.add(name)
            log.warning(
                "tensor %s holds values beyond fp16's range: compressed downloads saturate it at ±65504 on"
                " the clients (set the downlink's full_model_codec to fp32 to send it whole)",
                name,
            )

    def _again(self, node_ids: list[int], dtypes: Mapping[str, str]) -> dict[int, Download]:
        """Downloads of the current version for nodes that may already hold it, or the one before."""
        downloads = {}
        for node in node_ids:
            if self._holders.get(node) == self.version:
                if self._empty is None:
                    zeros = {name: np.zeros_like(array) for name, array in self.reference.items()}
                    self._empty = Download(self.version, self._delta_codec.encode(zeros, dtypes=dtypes))
                downloads[node] = self._empty
            elif self._delta is not None and self._previous_holders.get(node) == self._delta.base:
                downloads[node] = self._delta
            else:
                downloads[node] = self._full_download(dtypes)
        return downloads

    def _full_download(self, dtypes: Mapping[str, str]) -> Download:
        if self._full is None:
            payload = self._full_codec.encode(self.reference, dtypes=dtypes)
            self._full = Download(FULL if self._exact else APPROXIMATE, payload)
        return self._full

    def confirm(self, node_id: int, version: int, download: Download) -> None:
        """Record that ``node_id`` trained from (or evaluated) ``version`` after receiving ``download``."""
        if version == self.version and download.base != APPROXIMATE:
            self._holders[node_id] = version


def _size(arrays: Mapping[str, np.ndarray]) -> int:
    return sum(int(array.size) for array in arrays.values())
