"""The data of the reference task: scikit-learn's bundled handwritten digits, split and partitioned.

Importing scikit-learn costs about 1.5 s (it pulls in SciPy), more than a whole simulation round, and every
client process would pay it. So the bundled ``digits.csv.gz`` is read directly with NumPy, exactly as
``sklearn.datasets.load_digits`` reads it (``tests/foundation/test_digits.py`` holds the two equal), and the
held-out test split is a seeded stratified split in NumPy. Client partitions come from flwr-datasets'
``DirichletPartitioner`` and are cached on disk, so only the first process of a configuration imports it.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import warnings
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError

__all__ = ["digits_split", "dirichlet_partitions", "load_digits_arrays", "stratified_split"]

log = logging.getLogger(__name__)

TEST_FRACTION = 0.2
_SPLIT_SEED = 0


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as ``float32`` images in [0, 1] of shape (N, 1, 8, 8) and ``int64`` labels."""
    data = np.loadtxt(_bundled_digits_file(), delimiter=",")
    images = (data[:, :-1] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return images, data[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test row indices holding ``test_fraction`` of every class out for testing."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        cut = round(test_fraction * len(rows))
        test.append(rows[:cut])
        train.append(rows[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


@lru_cache(maxsize=2)
def digits_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels of the ``"train"`` or ``"test"`` split (fixed: independent of the run seed)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images, labels = _digits()
    train, test = stratified_split(labels, TEST_FRACTION, _SPLIT_SEED)
    rows = train if split == "train" else test
    return torch.from_numpy(images[rows]), torch.from_numpy(labels[rows])


@lru_cache(maxsize=8)
def dirichlet_partitions(num_partitions: int, alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    """Row indices of the training split for every client, cached on disk across processes."""
    path = _cache_dir() / f"digits-dirichlet-v2-n{num_partitions}-a{alpha!r}-s{seed}.npz"
    try:
        with np.load(path, allow_pickle=False) as cached:
            return tuple(cached[f"p{i}"] for i in range(num_partitions))
    except (OSError, KeyError, ValueError):
        pass  # not cached yet (or damaged): compute it
    try:
        parts = _compute_dirichlet_partitions(num_partitions, alpha, seed)
    except ValueError as err:  # flwr-datasets gives up after 10 draws with an empty (too small) client
        images = len(digits_split("train")[1])
        # with few enough clients for the images, it is the draw that left some with almost none: fewer
        # clients need not help (the least share asked for shrinks as clients grow), a larger alpha does
        advice = (
            f"use fewer clients (about {images // 10} or less) or a larger alpha"
            if num_partitions > images // 10
            else "use a larger alpha, or another seed"
        )
        raise ConfigError(  # the run's settings, not the task's code: passes through task_errors as it is
            f"cannot split the {images:,} digits training images among {num_partitions} clients with "
            f"alpha {alpha:g} (every client needs a few images): {advice} ({err})"
        ) from None
    buffer = io.BytesIO()
    np.savez(buffer, **{f"p{i}": part for i, part in enumerate(parts)})
    try:
        write_bytes_atomic(path, buffer.getvalue())
    except OSError as err:  # a read-only home is no reason to fail
        log.debug("partition cache %s not written: %s", path, err)
    return parts


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    return load_digits_arrays()


def _bundled_digits_file() -> Path:
    """scikit-learn's ``datasets/data/digits.csv.gz``, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-learn is not installed; the digits task reads its bundled dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(f"scikit-learn's bundled digits are not at {path}")
    return path


def _cache_dir() -> Path:
    return Path(os.environ.get("FEDGE_CACHE_DIR") or Path.home() / ".cache" / "fedge")


def _compute_dirichlet_partitions(num_partitions: int, alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    """The split itself, by flwr-datasets' Dirichlet partitioner (slow to import: hence the cache)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    _, labels = digits_split("train")
    dataset = Dataset.from_dict({"row": np.arange(len(labels)), "label": labels.numpy()})
    # Each client keeps at least a couple of examples; more than that is not always possible with
    # hundreds of clients over ~1,400 images and a skewed split.
    min_size = max(1, min(10, len(labels) // (4 * num_partitions)))
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_size,
        self_balancing=False,
        seed=seed,
    )
    partitioner.dataset = dataset
    with warnings.catch_warnings():
        # The partitioner warns on each resample it needs for min_partition_size; expected here.
        warnings.simplefilter("ignore", UserWarning)
        return tuple(
            np.asarray(partitioner.load_partition(i)["row"], dtype=np.int64) for i in range(num_partitions)
        )
