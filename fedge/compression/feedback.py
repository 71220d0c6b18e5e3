"""Error feedback: remember what compression left out and send it later.

With input ``g_t``, residual ``e_t`` and compressor ``C``, one round computes::

    a_t = g_t + e_{t-1}          (with DGC momentum correction: u_t = m·u_{t-1} + g_t,  a_t = u_t + e_{t-1})
    s_t = C(a_t)                 what the payload carries
    e_t = a_t − s_t

so ``Σ s_t + e_T = Σ g_t`` (or ``Σ u_t``): nothing is lost, only delayed. This is what makes biased
compressors (top-k, sign, PowerSGD) converge like uncompressed SGD. With momentum, entries that were
sent also have their momentum cleared ("momentum factor masking" in Deep Gradient Compression), so
stale momentum does not push them again.

The identity holds only if every ``s_t`` arrives. A payload that never counted (a dropped or rejected
reply) is handed back with :meth:`ErrorFeedback.restore`, ``e ← e + s_t``, which makes the round as if
nothing had been sent: then ``Σ_{counted} s_t + e_T = Σ g_t``. (Momentum is not rewound: its masking
only changes how fast later rounds send, not what the sum owes.)

Capped residuals. The identity assumes the residual is still worth sending when it goes out. A client
that trains one round in twenty (partial participation, devices that come and go) carries updates computed
against a model twenty rounds old, and lost payloads handed back make the residual grow further: on a
churning fleet, top-k with plain error feedback was seen to swing between 50 and 90 % accuracy and end at
50 % where dense FedAvg converged to 96 % (``fedge bench heterogeneity``; capped, it converged like dense).
With ``residual_cap = c`` the residual added to an update is scaled down so that ``‖e‖ ≤ c‖g_t‖`` (global
L2 norms over all tensors): ``a_t = g_t + λe_{t-1}``, ``λ = min(1, c‖g_t‖ / ‖e_{t-1}‖)``. What the
scaling drops is given up for good, so the identity becomes ``Σ s_t + e_T ≈ Σ g_t`` with the error bounded
by the cap, and stale residual can never outweigh fresh work.

The state is a plain ``dict[str, np.ndarray]`` (residuals under ``"ef/residual/<name>"``, momentum
under ``"ef/momentum/<name>"``, codec memory such as PowerSGD's warm start under its own keys), so a
Flower ``Context`` can persist it between rounds and a client that skips rounds keeps its residual.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

from fedge.compression.codec import Codec
from fedge.compression.errors import CodecConfigError
from fedge.compression.statistics import is_statistic
from fedge.compression.wire import DEFAULT_MAX_ELEMENTS, decode, decode_add, inspect_payload

__all__ = ["ErrorFeedback"]

logger = logging.getLogger(__name__)

RESIDUAL_PREFIX = "ef/residual/"
MOMENTUM_PREFIX = "ef/momentum/"


@dataclass(frozen=True)
class ErrorFeedback:
    """Residual memory (and optional DGC momentum correction) around a :class:`Codec`.

    Parameters
    ----------
    codec : Codec
        The compressor whose error is fed back.
    momentum : float, default 0.0
        DGC momentum ``m`` in [0, 1); 0 disables momentum correction.
    residual_cap : float or None, default None
        Scale the stored residual down to at most this multiple of the update's norm before adding it
        (``c`` above, > 0); None keeps every residual whole.
    """

    codec: Codec
    momentum: float = 0.0
    residual_cap: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise CodecConfigError(f"error feedback: momentum must be in [0, 1), got {self.momentum}")
        if self.residual_cap is not None and not self.residual_cap > 0:
            raise CodecConfigError(f"error feedback: residual_cap must be > 0, got {self.residual_cap}")

    @overload
    def encode(
        self,
        update: Mapping[str, np.ndarray],
        state: dict[str, np.ndarray],
        *,
        seed: int = ...,
        return_sent: Literal[False] = ...,
        dtypes: Mapping[str, str] | None = ...,
    ) -> bytes: ...

    @overload
    def encode(
        self,
        update: Mapping[str, np.ndarray],
        state: dict[str, np.ndarray],
        *,
        seed: int = ...,
        return_sent: Literal[True],
        dtypes: Mapping[str, str] | None = ...,
    ) -> tuple[bytes, dict[str, np.ndarray]]: ...

    def encode(
        self,
        update: Mapping[str, np.ndarray],
        state: dict[str, np.ndarray],
        *,
        seed: int = 0,
        return_sent: bool = False,
        dtypes: Mapping[str, str] | None = None,
    ) -> bytes | tuple[bytes, dict[str, np.ndarray]]:
        """Encode ``update`` plus the stored residual, and store the new residual in ``state``.

        Parameters
        ----------
        update : Mapping[str, np.ndarray]
            This round's update (e.g. new weights minus received weights).
        state : dict[str, np.ndarray]
            Residuals, momentum and codec memory; read and replaced (arrays in it are not mutated).
        seed : int, default 0
            Passed to :meth:`Codec.encode`.
        return_sent : bool, default False
            Also return the float32 arrays the payload decodes to.
        dtypes : Mapping[str, str] or None, default None
            The tensors' own dtypes, passed to :meth:`Codec.encode` (integer tensors travel exactly).

        Returns
        -------
        bytes or (bytes, dict)
            The payload, and with ``return_sent`` what it carries.
        """
        accumulated: dict[str, np.ndarray] = {}
        fresh: dict[str, np.ndarray] = {}
        residuals: dict[str, np.ndarray] = {}
        for name, array in update.items():
            values = np.asarray(array, dtype=np.float32)
            if self.momentum:
                velocity = self._load(state, MOMENTUM_PREFIX + name, values.shape)
                # np.add(..., out=) keeps 0-d tensors arrays: `a + b` of two 0-d arrays is a numpy scalar,
                # which decode_add cannot write into.
                values = np.add(values, np.float32(self.momentum) * velocity, out=np.empty_like(values))
                state[MOMENTUM_PREFIX + name] = values
            residuals[name] = self._load(state, RESIDUAL_PREFIX + name, values.shape)
            fresh[name] = values
        scale = self._residual_scale(fresh, residuals)
        for name, values in fresh.items():
            residual = residuals[name] if scale == 1.0 else residuals[name] * np.float32(scale)
            accumulated[name] = np.add(values, residual, out=np.empty(values.shape, dtype=np.float32))
        payload = self.codec.encode(accumulated, state=state, seed=seed, dtypes=dtypes)
        limit = max(1, sum(a.size for a in accumulated.values()))
        sent = decode(payload, max_elements=limit) if return_sent or self.momentum else None
        for name, residual in accumulated.items():
            if sent is not None:
                residual -= sent[name]
                if self.momentum:
                    velocity = state[MOMENTUM_PREFIX + name].copy()
                    velocity[sent[name] != 0] = 0  # momentum factor masking
                    state[MOMENTUM_PREFIX + name] = velocity
            state[RESIDUAL_PREFIX + name] = residual
        if sent is None:
            decode_add(payload, accumulated, -1.0, max_elements=limit)  # residual -= sent, sparsely
        return (payload, sent) if return_sent else payload

    def _residual_scale(self, fresh: Mapping[str, np.ndarray], residuals: Mapping[str, np.ndarray]) -> float:
        """``λ``: what the stored residual is multiplied by before it joins this update (1: kept whole)."""
        if self.residual_cap is None:
            return 1.0
        held = _global_norm(residuals)
        limit = self.residual_cap * _global_norm(fresh)
        return 1.0 if held <= limit else limit / held

    @staticmethod
    def _load(state: Mapping[str, np.ndarray], key: str, shape: tuple[int, ...]) -> np.ndarray:
        stored = state.get(key)
        if stored is None:
            return np.zeros(shape, dtype=np.float32)
        if stored.shape != shape:
            logger.warning("dropping %s: stored shape %s, update shape %s", key, stored.shape, shape)
            return np.zeros(shape, dtype=np.float32)
        return np.asarray(stored, dtype=np.float32)

    @staticmethod
    def restore(
        payload: bytes, state: dict[str, np.ndarray], *, max_elements: int = DEFAULT_MAX_ELEMENTS
    ) -> None:
        """Take back a payload that never counted: add what it carries to the residuals in ``state``.

        Statistics (:func:`fedge.compression.statistics.is_statistic`: BatchNorm's running estimates,
        integer counters) are not taken back: their deltas hold only against the model they were taken
        from, and the next update carries fresh ones. Folded back, a lost ``running_var`` delta was added
        again to a model that had already moved: a client back after missing rounds pushed the variance
        below zero and the aggregate computed NaN.

        Parameters
        ----------
        payload : bytes
            A payload :meth:`encode` returned with this ``state``.
        state : dict[str, np.ndarray]
            Residuals, momentum and codec memory; residual entries are replaced (arrays are not mutated).
            A residual that is missing or of another shape than the payload's tensor starts from zero.
        max_elements : int, default 2**28
            Cap on the elements the payload may claim.

        Raises
        ------
        CodecError
            If ``payload`` does not decode; ``state`` is left as it was.
        """
        info = inspect_payload(payload, max_elements=max_elements)
        residuals: dict[str, np.ndarray] = {}
        dropped: dict[str, np.ndarray] = {}  # statistics: decoded (decode_add wants every tensor) and let go
        for tensor in info.tensors:
            if is_statistic(tensor.name, tensor.dtype):
                dropped[tensor.name] = np.zeros(tensor.shape, dtype=np.float32)
                continue
            stored = state.get(RESIDUAL_PREFIX + tensor.name)
            if stored is not None and stored.shape != tensor.shape:
                logger.warning(
                    "restoring %s: stored residual shape %s, payload shape %s; starting from zero",
                    tensor.name,
                    stored.shape,
                    tensor.shape,
                )
                stored = None
            residuals[tensor.name] = (
                np.zeros(tensor.shape, dtype=np.float32)
                if stored is None
                else np.array(stored, dtype=np.float32, order="C", copy=True)  # decode_add writes in place
            )
        decode_add(payload, residuals | dropped, 1.0, max_elements=max_elements)
        state.update({RESIDUAL_PREFIX + name: residual for name, residual in residuals.items()})

    @staticmethod
    def residual(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The residuals held in ``state``, by tensor name."""
        return {k[len(RESIDUAL_PREFIX) :]: v for k, v in state.items() if k.startswith(RESIDUAL_PREFIX)}


def _global_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """L2 norm over every entry of ``arrays``, accumulated in float64."""
    # einsum, not np.dot: OpenBLAS's threads spin after a dot and take the cores other clients train on
    return float(np.sqrt(sum(float(np.einsum("i,i->", a.ravel(), a.ravel())) for a in arrays.values())))
