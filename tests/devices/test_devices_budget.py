"""Upload budgets, the top-k density that fits them, and the training memory check."""

from __future__ import annotations

import pytest

from fedge.config import ConfigError
from fedge.devices import (
    CATALOGUE,
    TOPK_INT8_BITS,
    LinkProfile,
    can_train,
    topk_bits,
    topk_density,
    training_memory_bytes,
    upload_budget_bytes,
)


def test_budget_on_a_clean_link():
    link = LinkProfile(1e6, 1e6, latency_s=0.1)
    assert upload_budget_bytes(link, 2.1) == 2_000_000
    assert upload_budget_bytes(link, 2.1, overhead_bytes=1000) == 1_999_000
    assert upload_budget_bytes(link, 0.05) == 0  # not even the latency fits
    assert upload_budget_bytes(link, -3) == 0


def test_budget_charges_expected_disconnects():
    link = LinkProfile(1e6, 1e6, latency_s=0.1, disconnects_per_s=0.5, resend_window_bytes=100_000)
    # 0.1 + n/1e6 * (1 + 0.5 * 0.1) = 2.1  ->  n = 2e6 / 1.05
    assert upload_budget_bytes(link, 2.1) == pytest.approx(2e6 / 1.05, abs=1)
    assert upload_budget_bytes(link, 2.1, expected_disconnects=False) == 2_000_000


def test_nbiot_budget_is_small():
    # 60 s left on NB-IoT at 20 kbit/s: ~147 kB (a 1 s latency and losses cost a little).
    budget = upload_budget_bytes(CATALOGUE["nbiot_gateway"].link, 60.0)
    assert 120_000 < budget < 150_000


def test_topk_density_from_budget():
    n = 1_000_000
    assert topk_density(10_000 * TOPK_INT8_BITS / 8, n) == pytest.approx(0.01)
    assert topk_density(10_000 * TOPK_INT8_BITS / 8 + 100, n, header_bytes=100) == pytest.approx(0.01)
    assert topk_density(10**9, n) == 1.0
    assert topk_density(50, n, header_bytes=100) == 0.0
    assert topk_bits(0.01) == pytest.approx(16.08, abs=0.01)  # DESIGN.md section 3: 8.08 + 8
    assert topk_bits(0.001) == pytest.approx(19.41, abs=0.01)  # 11.41 + 8
    # The entropy model: a budget sized for 1% at its exact cost gives back 1%.
    budget = n * 0.01 * topk_bits(0.01) / 8
    assert topk_density(budget, n, bits_per_entry=None) == pytest.approx(0.01, abs=1e-5)
    assert topk_density(budget / 10, n, bits_per_entry=None) < 0.001  # fewer bytes, dearer positions
    assert topk_density(n, n, bits_per_entry=None) == 1.0  # int8 dense fits
    with pytest.raises(ConfigError):
        topk_density(100, 0)


def test_training_memory_formula():
    # 4 bytes x (1e6 params x (params + grads + 2 Adam slots + 2 fedge copies) + 32 x 10k activations)
    assert training_memory_bytes(
        1_000_000, activation_values_per_sample=10_000, batch_size=32, optimizer="adam"
    ) == 4 * (6_000_000 + 320_000)
    assert training_memory_bytes(
        10, activation_values_per_sample=0, batch_size=1, extra_model_copies=0
    ) == 4 * 20  # fmt: skip
    with pytest.raises(ConfigError, match="optimizer"):
        training_memory_bytes(1, activation_values_per_sample=1, batch_size=1, optimizer="lion")


def test_memory_check_by_device():
    # ResNet-18: 11.7M parameters, ~2.3M activation values per 32x32 sample (estimate), batch 32, momentum.
    need = training_memory_bytes(
        11_700_000, activation_values_per_sample=2_300_000, batch_size=32, optimizer="momentum"
    )
    assert not can_train(CATALOGUE["pizero2_wifi"].compute, need)
    assert can_train(CATALOGUE["pi4_wifi"].compute, need)
    assert can_train(1000, 900) and not can_train(1000, 901) and can_train(1000, 1000, usable_fraction=1.0)
