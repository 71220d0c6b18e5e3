"""Fitting the calibrated cost model to measured stage times (pure numpy, no ONNX Runtime).

A stage's measured time is modelled as::

    t(stage) = overhead + sum_c  coef_c * profiled_c(stage) + per_byte * io_bytes(stage)

with ``profiled_c`` the profiler's kernel seconds of the stage's nodes of op class ``c`` (compute-bound
GEMM/convolution kernels, and everything else: element-wise and data-movement kernels, which scale
differently when a stage runs alone), the per-run overhead of a session (feeding, fetching, scheduling),
and the copying of the stage's boundary tensors. All coefficients are non-negative (a cost cannot help),
so the fit is non-negative least squares on relative errors: a 1 ms stage matters as much as a 100 ms one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["COMPUTE_OPS", "StageFit", "fit_stage_model", "nnls", "op_classes"]

COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "MatMulInteger", "ConvInteger", "Einsum"})
"""Op types whose kernels are compute-bound; the rest form the second class."""


def op_classes(op_types: Sequence[str]) -> np.ndarray:
    """Class index per node: 0 for :data:`COMPUTE_OPS`, 1 for the rest."""
    return np.array([0 if op in COMPUTE_OPS else 1 for op in op_types], dtype=np.int64)


def nnls(a: np.ndarray, y: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, ``min ||a x - y||`` subject to ``x >= 0`` (Lawson and Hanson).

    Parameters
    ----------
    a : ndarray, shape (m, k)
        Design matrix.
    y : ndarray, shape (m,)
        Targets.
    max_iter : int or None (default: None)
        Outer iterations (default ``3 k``).
    """
    k = a.shape[1]
    x = np.zeros(k)
    passive = np.zeros(k, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0)))
    for _ in range(max_iter or 3 * k):
        grad = a.T @ (y - a @ x)
        free = ~passive & (grad > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(free, grad, -np.inf))] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back towards the old point until a coefficient hits zero, and drop it.
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass(frozen=True)
class StageFit:
    """Fitted coefficients of the stage-time model.

    Parameters
    ----------
    class_scales : tuple of float
        Multiplier of the profiled kernel seconds per op class (:func:`op_classes`).
    overhead_s : float
        Seconds per session run.
    per_byte_s : float
        Seconds per byte of the stage's input and output tensors.
    """

    class_scales: tuple[float, ...]
    overhead_s: float
    per_byte_s: float

    def predict(self, profiled: np.ndarray, io_bytes: np.ndarray) -> np.ndarray:
        """Stage seconds from per-class profiled seconds (stages × classes) and boundary bytes."""
        return profiled @ np.asarray(self.class_scales) + self.overhead_s + self.per_byte_s * io_bytes


def fit_stage_model(
    profiled: np.ndarray, io_bytes: np.ndarray, measured: np.ndarray, prior_weight: float = 0.3
) -> StageFit:
    """Fit :class:`StageFit` to measured stage times by non-negative least squares on relative error.

    The class scales are pulled towards 1 (the profiler's own kernel times) with ``prior_weight``: the
    classes' times grow together with a stage's size, so a dozen noisy stage timings alone cannot tell
    them apart and an unpulled fit trades one class for the other (a ridge towards the prior).

    Parameters
    ----------
    profiled : ndarray, shape (stages, classes)
        Profiled kernel seconds of each stage's nodes, per op class.
    io_bytes : ndarray, shape (stages,)
        Bytes of each stage's input and output tensors.
    measured : ndarray, shape (stages,)
        Measured seconds per stage run.
    prior_weight : float (default: 0.3)
        Weight of each class's ``scale = 1`` pseudo-observation, in units of one stage's relative error.
    """
    profiled = np.atleast_2d(np.asarray(profiled, dtype=np.float64))
    measured = np.asarray(measured, dtype=np.float64)
    classes = profiled.shape[1]
    # Columns scaled to comparable magnitudes so the solver's tolerance means the same for each.
    cols = np.column_stack([profiled, np.ones(len(measured)), np.asarray(io_bytes, dtype=np.float64)])
    norm = np.abs(cols).max(axis=0)
    norm[norm == 0] = 1.0
    w = 1.0 / measured
    design, target = cols * w[:, None], measured * w
    if prior_weight > 0:
        prior = np.zeros((classes, cols.shape[1]))
        prior[np.arange(classes), np.arange(classes)] = prior_weight
        design, target = np.vstack([design, prior]), np.concatenate([target, np.full(classes, prior_weight)])
    coef = nnls(design / norm, target) / norm
    empty = profiled.sum(axis=0) == 0
    # A class absent from every fitted stage keeps the profiler's own time (scale 1).
    scales = tuple(1.0 if empty[c] else float(coef[c]) for c in range(classes))
    return StageFit(scales, float(coef[classes]), float(coef[classes + 1]))
