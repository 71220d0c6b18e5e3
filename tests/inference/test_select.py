"""Variant selection: fastest within the accuracy bound, never an int8 slower than fp32."""

import pytest

from fedge.inference import VariantMeasurement, measure_variants, select_variant


def _m(variant, p50, accuracy):
    return VariantMeasurement(variant, 1000, {1: (p50, p50 * 1.2)}, accuracy)


def test_fastest_within_bound_wins():
    chosen = select_variant(
        [_m("fp32", 1.0, 0.95), _m("int8-static", 0.4, 0.945), _m("int8-dynamic", 0.3, 0.90)], 1
    )
    assert chosen.variant == "int8-static"  # dynamic is faster but 5 pp worse
    assert "int8-dynamic outside" in chosen.reason


def test_int8_slower_than_fp32_is_never_served():
    chosen = select_variant(
        [_m("fp32", 1.0, 0.95), _m("int8-static", 1.3, 0.96), _m("int8-dynamic", 7.0, 0.95)], 1
    )
    assert chosen.variant == "fp32"
    assert "not faster than fp32" in chosen.reason


def test_a_tie_keeps_fp32():
    assert select_variant([_m("fp32", 1.0, 0.95), _m("int8-static", 0.98, 0.95)], 1).variant == "fp32"


def test_fp32_is_required():
    with pytest.raises(ValueError, match="fp32"):
        select_variant([_m("int8-static", 0.5, 0.9)], 1)


def test_measured_on_this_cpu(variants, digits_test):
    paths = {name: path for name, (path, _) in variants.items()}
    measured = measure_variants(paths, digits_test[0], batches=(1, 8), labelled=digits_test, runs=9, warmup=1)
    by = {m.variant: m for m in measured}
    assert set(by) == {"fp32", "int8-static", "int8-dynamic"}
    for batch in (1, 8):
        chosen = select_variant(measured, batch)
        served = by[chosen.variant].latency_ms[batch][0]
        assert served <= by["fp32"].latency_ms[batch][0]
        assert by[chosen.variant].accuracy >= by["fp32"].accuracy - 0.01
