"""Sparsifiers: choose which entries of a flattened tensor travel.

Each returns sorted ``int64`` positions into the flattened tensor.

* :class:`TopK` keeps the ``k = ceil(density · n)`` entries of largest magnitude. ``mode="exact"`` runs
  ``np.argpartition`` over the whole tensor. ``mode="fast"`` follows Deep Gradient Compression: estimate
  the threshold from a random sample, collect the (slightly more than ``k``) candidates above it in one
  cache-friendly pass, then correct the count to exactly ``k`` on the small candidate set. Both modes
  return the same set (up to ties); fast is several times quicker on large tensors.
* :class:`RandomK` keeps ``k`` positions drawn from a seed that travels in the payload instead of the
  positions; values are scaled by ``n / k`` so the estimate is unbiased (turn that off with error
  feedback).
* :class:`Threshold` keeps every entry with ``|x| ≥ threshold``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from fedge.compression.errors import CodecConfigError, NonFiniteValueError

__all__ = ["RandomK", "Threshold", "TopK", "check_finite", "random_positions"]

_CHUNK = 1 << 18  # elements per pass of the candidate scan: 1 MiB of float32 stays in cache
_SAMPLE_HITS = 1000  # expected sampled entries above the threshold: ±3 % relative error on the count
_MIN_SAMPLE = 65536
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _count(density: float, n: int) -> int:
    return min(n, math.ceil(density * n))


def _check_density(name: str, density: float) -> None:
    if not 0.0 < density <= 1.0:
        raise CodecConfigError(f"{name}: density must be in (0, 1], got {density}")


@dataclass(frozen=True)
class TopK:
    """Keep the ``ceil(density · n)`` largest-magnitude entries.

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1].
    mode : str, default "fast"
        ``"fast"`` (sampled threshold, then exact count correction) or ``"exact"`` (full argpartition).
    min_count : int, default 0
        Floor on the entries one payload keeps over all the tensors it sparsifies: on a model of ``N``
        such elements the density is raised to ``min_count / N`` when that is larger. A density that suits
        a large model leaves a small one a handful of values per round, which error feedback then holds
        back for many rounds; the floor costs a few hundred bytes and keeps small models training.
    """

    density: float
    mode: str = "fast"
    min_count: int = 0
    name: ClassVar[str] = "topk"
    omitted_at_default: ClassVar[tuple[str, ...]] = ("min_count",)  # specs written before it existed

    def __post_init__(self) -> None:
        _check_density(self.name, self.density)
        if self.mode not in ("fast", "exact"):
            raise CodecConfigError(f"topk: mode must be 'fast' or 'exact', got {self.mode!r}")
        if self.min_count < 0:
            raise CodecConfigError(f"topk: min_count must be >= 0, got {self.min_count}")

    def floored(self, sparsified_elements: int) -> TopK:
        """This sparsifier with the density ``min_count`` asks for on ``sparsified_elements``."""
        if not self.min_count or not sparsified_elements:
            return self
        density = min(1.0, max(self.density, self.min_count / sparsified_elements))
        return self if density == self.density else replace(self, density=density)

    def count(self, n: int) -> int:
        """Number of positions kept out of ``n``."""
        return _count(self.density, n)

    def select(self, flat: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Sorted positions of the top ``k`` entries of ``flat`` (float32, 1-D)."""
        k = _count(self.density, flat.size)
        if k == flat.size:
            check_finite(flat)
            return np.arange(flat.size, dtype=np.int64)
        if self.mode == "exact":
            return _topk_exact(flat, k)
        return _topk_fast(flat, k, rng)


@dataclass(frozen=True)
class RandomK:
    """Keep ``ceil(density · n)`` positions drawn from a seed; only the seed travels.

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1].
    unbiased : bool, default True
        Scale kept values by ``n / k`` so the decoded tensor is an unbiased estimate of the input. Use
        ``False`` under error feedback, where the residual already carries what was not sent.
    """

    density: float
    unbiased: bool = True
    name: ClassVar[str] = "randk"

    def __post_init__(self) -> None:
        _check_density(self.name, self.density)

    def count(self, n: int) -> int:
        """Number of positions kept out of ``n``."""
        return _count(self.density, n)


@dataclass(frozen=True)
class Threshold:
    """Keep every entry with ``|x| ≥ threshold``.

    Parameters
    ----------
    threshold : float
        Magnitude threshold, finite and ≥ 0.
    """

    threshold: float
    name: ClassVar[str] = "threshold"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise CodecConfigError(f"threshold: must be finite and >= 0, got {self.threshold}")

    def select(self, flat: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Sorted positions of the entries of ``flat`` at or above the threshold."""
        return _at_least(flat, np.float32(self.threshold))


def check_finite(values: np.ndarray) -> None:
    """Raise :class:`NonFiniteValueError` if ``values`` holds NaN or infinity."""
    if values.size and not np.isfinite(values).all():
        raise NonFiniteValueError("input holds NaN or infinity")


def _at_least(flat: np.ndarray, threshold: np.float32) -> np.ndarray:
    """Positions with ``|x| ≥ threshold``, scanning in cache-sized chunks; also rejects NaN/Inf."""
    parts = [np.zeros(0, dtype=np.int64)]
    scratch = np.empty(min(flat.size, _CHUNK), dtype=np.float32)
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start : start + _CHUNK]
        magnitude = np.abs(chunk, out=scratch[: chunk.size])
        if not np.isfinite(magnitude.max()):
            raise NonFiniteValueError("input holds NaN or infinity")
        found = np.flatnonzero(magnitude >= threshold)
        found += start
        parts.append(found)
    return np.concatenate(parts)


def _topk_exact(flat: np.ndarray, k: int) -> np.ndarray:
    magnitude = np.abs(flat)
    check_finite(magnitude)
    positions = np.argpartition(magnitude, flat.size - k)[flat.size - k :]
    positions.sort()
    return positions.astype(np.int64, copy=False)


def _topk_fast(flat: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    n = flat.size
    sample_size = max(_MIN_SAMPLE, math.ceil(_SAMPLE_HITS * n / k))
    if sample_size >= n // 4:  # too small for sampling to pay off
        return _topk_exact(flat, k)
    sample = np.abs(flat[rng.integers(0, n, sample_size)])
    expected_hits = sample_size * k / n
    for margin in (4.0, 8.0):  # standard deviations of slack so the candidates cover k
        above = min(sample_size, math.ceil(expected_hits + margin * math.sqrt(expected_hits)))
        threshold = np.partition(sample, sample_size - above)[sample_size - above]
        candidates = _at_least(flat, threshold)
        if candidates.size >= k:
            return _keep_largest(flat, candidates, k)
    return _topk_exact(flat, k)


def _keep_largest(flat: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest-magnitude of the sorted ``candidates``, still sorted (ties: earliest first)."""
    if candidates.size == k:
        return candidates
    magnitude = np.abs(flat[candidates])
    kth = np.partition(magnitude, candidates.size - k)[candidates.size - k]
    keep = magnitude > kth
    ties = np.flatnonzero(magnitude == kth)[: k - int(keep.sum())]
    keep[ties] = True
    return candidates[keep]


def _splitmix64(seed: int, start: int, count: int) -> np.ndarray:
    """Outputs ``start … start+count-1`` of the SplitMix64 stream for ``seed`` (wire-format defined)."""
    z = np.arange(start + 1, start + count + 1, dtype=np.uint64) * _GAMMA
    z += np.uint64(seed)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def random_positions(n: int, k: int, seed: int) -> np.ndarray:
    """``k`` distinct positions in ``[0, n)``, uniformly at random from ``seed``, sorted.

    The draw is part of the wire format, so a decoder in any language can regenerate it: take
    SplitMix64 outputs ``z_1, z_2, …`` for ``seed``, map each to ``z_i mod n``, keep the first ``k``
    distinct values. For ``k > n/2`` the complement of ``n − k`` such positions is returned.
    """
    if k * 2 > n:
        mask = np.ones(n, dtype=bool)
        mask[random_positions(n, n - k, seed)] = False
        return np.flatnonzero(mask)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    stream = np.zeros(0, dtype=np.int64)
    # Expected draws for k distinct values out of n is about -n·ln(1 - k/n).
    batch = math.ceil(-n * math.log1p(-k / n) * 1.02) + 64
    while True:
        draws = (_splitmix64(seed, stream.size, batch) % np.uint64(n)).astype(np.int64)
        stream = np.concatenate([stream, draws])
        _, first = np.unique(stream, return_index=True)
        if first.size >= k:
            first.sort()
            positions = stream[first[:k]]
            positions.sort()
            return positions
        missing = k - first.size
        batch = math.ceil(missing * n / (n - first.size) * 1.5) + 64
