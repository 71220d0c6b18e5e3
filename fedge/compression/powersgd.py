"""PowerSGD low-rank approximation (Vogels et al., 2019) with a warm-started power iteration.

A tensor of two or more dimensions is viewed as a matrix ``M`` of ``shape[0]`` rows. One step of
subspace iteration from the previous round's right factor ``Q`` gives

    P = orth(M Q),   Q' = Mᵀ P,   M ≈ P Q'ᵀ,

and both factors travel: ``r · (rows + cols)`` values instead of ``rows · cols``. ``Q'`` is kept per
tensor as the next round's starting point ("warm start"), which makes repeated single steps converge to
the best rank-``r`` approximation of slowly changing updates. Pair it with error feedback, as the paper
does: the approximation error is then carried to the next round instead of lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedge.compression.errors import CodecConfigError

__all__ = ["PowerSGD", "matrix_shape"]

_MAX_RANK = 1024


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix view of a tensor: ``shape[0]`` rows by the product of the other dimensions."""
    rows = shape[0]
    return rows, (int(np.prod(shape[1:], dtype=np.int64)) if rows else 0)


@dataclass(frozen=True)
class PowerSGD:
    """Rank-``r`` approximation by one warm-started power iteration per round.

    Parameters
    ----------
    rank : int, default 2
        Rank of the approximation, 1 to 1024; capped at ``min(rows, cols)`` per tensor.
    """

    rank: int = 2
    name: ClassVar[str] = "powersgd"

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= _MAX_RANK:
            raise CodecConfigError(f"powersgd: rank must be in [1, {_MAX_RANK}], got {self.rank}")

    def rank_for(self, rows: int, cols: int) -> int:
        """The rank used for a ``rows × cols`` matrix, or 0 when low rank would not be smaller."""
        rank = min(self.rank, rows, cols)
        return rank if rank * (rows + cols) < rows * cols else 0

    @staticmethod
    def state_key(name: str) -> str:
        """Key of a tensor's warm-start factor in the codec state dict."""
        return f"powersgd/q/{name}"

    def factorize(
        self, matrix: np.ndarray, rank: int, warm: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(P, Q)`` with ``matrix ≈ P @ Q.T``; ``Q`` is the next warm start.

        Parameters
        ----------
        matrix : np.ndarray
            float32, ``rows × cols``.
        rank : int
            Columns of the factors (from :meth:`rank_for`).
        warm : np.ndarray or None
            The previous ``Q`` (``cols × rank``); a fresh Gaussian start is drawn from ``rng`` when it is
            missing or has another shape.
        rng : np.random.Generator
            Source of the fresh start.
        """
        cols = matrix.shape[1]
        if warm is None or warm.shape != (cols, rank):
            warm = rng.standard_normal((cols, rank), dtype=np.float32)
        left, _ = np.linalg.qr(matrix @ warm.astype(np.float32, copy=False))
        right = matrix.T @ left
        return left.astype(np.float32, copy=False), right.astype(np.float32, copy=False)
