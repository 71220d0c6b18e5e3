"""Shared fixtures of the split-training tests: the digits CNN and real digits batches."""

from __future__ import annotations

import pytest
import torch

from fedge.app.digits import digits_split
from fedge.app.task import DigitsCNN


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def model() -> DigitsCNN:
    torch.manual_seed(0)
    return DigitsCNN()


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    return digits_split("train")


@pytest.fixture(scope="session")
def clients(digits):
    """Four clients of 120 consecutive training images each."""
    features, labels = digits
    return [(features[i * 120 : (i + 1) * 120], labels[i * 120 : (i + 1) * 120]) for i in range(4)]
