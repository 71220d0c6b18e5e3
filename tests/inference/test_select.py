"""Variant selection (fastest within the accuracy bound, never an int8 slower than fp32) and thread counts."""

import pytest

from fedge.inference import (
    SessionConfig,
    ThreadChoice,
    ThreadChooser,
    VariantMeasurement,
    available_cpus,
    choose_threads,
    make_session,
    measure_variants,
    select_variant,
)
from fedge.inference import select as select_module


def _m(variant, p50, accuracy):
    return VariantMeasurement(variant, 1000, {1: (p50, p50 * 1.2)}, accuracy)


def test_fastest_within_bound_wins():
    chosen = select_variant(
        [_m("fp32", 1.0, 0.95), _m("int8-static", 0.4, 0.945), _m("int8-dynamic", 0.3, 0.90)], 1
    )
    assert chosen.variant == "int8-static"  # dynamic is faster but 5 pp worse
    assert "int8-dynamic outside the 1 pp accuracy bound (0.9000 vs fp32's 0.9500)" in chosen.reason


def test_a_drop_of_exactly_the_bound_is_within_it():
    """3 rows of 300 are 1 pp, but 100 * (109/300 - 106/300) is 1.0000000000000009 (inference sweep)."""
    chosen = select_variant([_m("fp32", 1.0, 109 / 300), _m("int8-static", 0.5, 106 / 300)], 1)
    assert chosen.variant == "int8-static"
    worse = select_variant([_m("fp32", 1.0, 109 / 300), _m("int8-static", 0.5, 105 / 300)], 1)
    assert worse.variant == "fp32"


def test_int8_slower_than_fp32_is_never_served():
    chosen = select_variant(
        [_m("fp32", 1.0, 0.95), _m("int8-static", 1.3, 0.96), _m("int8-dynamic", 7.0, 0.95)], 1
    )
    assert chosen.variant == "fp32"
    assert "not faster than fp32" in chosen.reason


def test_a_tie_keeps_fp32():
    assert select_variant([_m("fp32", 1.0, 0.95), _m("int8-static", 0.98, 0.95)], 1).variant == "fp32"


@pytest.mark.parametrize(("fp32_accuracy", "int8_accuracy"), [(None, None), (None, 0.9), (0.9, None)])
def test_a_variant_whose_accuracy_cannot_be_bounded_is_never_served(fp32_accuracy, int8_accuracy):
    """A regressor's variants exported without labelled data carry no accuracy: an int8 variant 5.1 off
    fp32's outputs was served because it was faster (inference sweep)."""
    chosen = select_variant([_m("fp32", 1.0, fp32_accuracy), _m("int8-static", 0.2, int8_accuracy)], 1)
    assert chosen.variant == "fp32" and "no accuracy measured" in chosen.reason


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


def test_threads_are_measured_on_this_cpu(variants, digits_test):
    path, _ = variants["fp32"]
    choice = choose_threads(path, digits_test[0], batch=1, runs=9)
    most = SessionConfig().threads()
    if most == 1:
        assert choice == ThreadChoice(1, {}, "one CPU")
        return
    assert set(choice.p50_ms) == {1, most} and all(p50 > 0 for p50 in choice.p50_ms.values())
    # one thread unless the device's count is more than 5 % faster
    assert choice.threads == (most if choice.p50_ms[most] < 0.95 * choice.p50_ms[1] else 1)


def test_a_fixed_thread_count_is_kept_unmeasured(variants, digits_test):
    path, _ = variants["fp32"]
    choice = choose_threads(path, digits_test[0], config=SessionConfig(intra_op_threads=3))
    assert choice == ThreadChoice(3, {}, "fixed by the session settings")


def test_the_chooser_measures_each_layout_once_and_falls_back_on_failure(monkeypatch, variants):
    calls = []

    def measured(model, sample, *, batch, config):
        calls.append((model, batch))
        if model == b"broken":
            raise RuntimeError("ORT cannot load it")
        return ThreadChoice(1, {1: 0.1, 2: 0.2}, "one thread as fast")

    monkeypatch.setattr(select_module, "choose_threads", measured)
    device = SessionConfig(intra_op_threads=0)
    chooser = ThreadChooser(device, batch=4, max_layouts=2)
    for version in (b"v1", b"v2", b"v3"):  # versions of one architecture: measured with the first only
        config = chooser.config_for(version, "cnn", lambda: None)
        assert config.intra_op_threads == 1 and config.memory_arena == device.memory_arena
    assert calls == [(b"v1", 4)] and chooser.last.reason == "one thread as fast"
    chooser.config_for(b"w1", "mlp", lambda: None)
    chooser.config_for(b"z1", "rnn", lambda: None)  # a third layout: the oldest ("cnn") is forgotten
    chooser.config_for(b"v4", "cnn", lambda: None)
    assert [model for model, _ in calls] == [b"v1", b"w1", b"z1", b"v4"]
    assert chooser.config_for(b"broken", "new", lambda: None) is device  # the swap's checks say why
    assert ThreadChooser(device, enabled=False).config_for(b"v1", "cnn", lambda: None) is device


def test_a_session_gets_the_threads_asked_for(variants):
    path, _ = variants["fp32"]
    for threads in {1, min(2, available_cpus())}:
        session = make_session(path, SessionConfig(intra_op_threads=threads))
        assert session.get_session_options().intra_op_num_threads == threads
