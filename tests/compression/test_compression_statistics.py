"""Statistical properties: unbiased quantizers and sparsifiers, error feedback, PowerSGD, position cost."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.compression import ErrorFeedback, build_codec, decode, inspect_payload, position_bound_bits
from fedge.compression.bits import Reader
from fedge.compression.errors import CodecConfigError
from fedge.compression.rice import decode_positions, encode_positions

DRAWS = 2000


def _mean_of_draws(spec: str, x: np.ndarray, draws: int = DRAWS) -> np.ndarray:
    codec = build_codec(spec)
    total = np.zeros(x.shape, dtype=np.float64)
    for seed in range(draws):
        total += decode(codec.encode({"x": x}, seed=seed))["x"]
    return total / draws


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_qsgd_is_unbiased(bits: int) -> None:
    rng = np.random.default_rng(bits)
    x = (rng.standard_t(3, 256) * rng.choice([1e-3, 1.0], 256)).astype(np.float32)
    bucket = 64
    mean = _mean_of_draws(f"qsgd:{bits},bucket={bucket};min=0", x)
    # A value between two levels Δ = 2s/(L-1) apart has variance f(1-f)Δ² <= (s/(L-1))² per draw.
    scale = np.repeat(np.abs(x).reshape(-1, bucket).max(axis=1), bucket)
    sigma = scale / ((1 << bits) - 1) / np.sqrt(DRAWS)
    assert np.all(np.abs(mean - x) <= 5 * sigma + 1e-7)
    # The test has power: a single draw is far from x, and rounding to the nearest level fails it.
    single = decode(build_codec(f"qsgd:{bits},bucket={bucket};min=0").encode({"x": x}))["x"]
    assert np.abs(single - x).max() > 5 * sigma.max()
    step = 2 * scale / ((1 << bits) - 1)
    nearest = np.round((x + scale) / step) * step - scale
    assert not np.all(np.abs(nearest - x) <= 5 * sigma + 1e-7)


def test_random_k_is_unbiased_with_exactly_k_uniform_positions() -> None:
    x = np.random.default_rng(7).standard_normal(200).astype(np.float32)
    codec = build_codec("randk:0.1;min=0")
    total = np.zeros(200)
    hits = np.zeros(200)
    for seed in range(DRAWS):
        out = decode(codec.encode({"x": x}, seed=seed))["x"]
        assert np.count_nonzero(out) == 20
        total += out
        hits += out != 0
    p = 20 / 200
    sigma = np.abs(x) * np.sqrt((1 / p - 1) / DRAWS)
    assert np.all(np.abs(total / DRAWS - x) <= 5 * sigma + 1e-6)
    assert np.all(np.abs(hits / DRAWS - p) <= 5 * np.sqrt(p * (1 - p) / DRAWS))
    biased = decode(build_codec("randk:0.1,unbiased=false;min=0").encode({"x": x}))["x"]
    assert np.abs(biased).sum() < np.abs(out).sum()  # unscaled values are n/k times smaller


@pytest.mark.parametrize("spec", ["topk:0.05+int8;min=0", "stc:0.02;min=0", "sign;min=0", "powersgd:1;min=0"])
def test_error_feedback_conserves_the_sum_of_inputs(spec: str) -> None:
    rng = np.random.default_rng(8)
    shapes = {"a": (30, 40), "b": (500,)}
    feedback = ErrorFeedback(build_codec(spec))
    state: dict[str, np.ndarray] = {}
    inputs = {name: np.zeros(shape) for name, shape in shapes.items()}
    sent_total = {name: np.zeros(shape) for name, shape in shapes.items()}
    for step in range(8):
        update = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
        payload, sent = feedback.encode(update, state, seed=step, return_sent=True)
        for name in shapes:
            np.testing.assert_array_equal(sent[name], decode(payload)[name])
            inputs[name] += update[name]
            sent_total[name] += sent[name]
            residual = state[f"ef/residual/{name}"]
            np.testing.assert_allclose(sent_total[name] + residual, inputs[name], atol=1e-4)
    assert np.abs(state["ef/residual/a"]).max() > 0.1  # the 2-D tensor is compressed: something was held back


def test_error_feedback_without_return_sent_keeps_the_same_residual() -> None:
    rng = np.random.default_rng(9)
    codec = build_codec("topk:0.1+int8;min=0")
    sparse_state: dict[str, np.ndarray] = {}
    dense_state: dict[str, np.ndarray] = {}
    for step in range(4):
        update = {"w": rng.standard_normal((20, 20)).astype(np.float32)}
        ErrorFeedback(codec).encode(update, sparse_state, seed=step)
        ErrorFeedback(codec).encode(update, dense_state, seed=step, return_sent=True)
        np.testing.assert_array_equal(sparse_state["ef/residual/w"], dense_state["ef/residual/w"])


def test_error_feedback_with_momentum_correction_and_masking() -> None:
    rng = np.random.default_rng(10)
    feedback = ErrorFeedback(build_codec("topk:0.1;min=0"), momentum=0.9)
    state: dict[str, np.ndarray] = {}
    velocity_total = np.zeros(300)
    sent_total = np.zeros(300)
    previous = np.zeros(300, dtype=np.float32)
    for step in range(6):
        update = rng.standard_normal(300).astype(np.float32)
        velocity = np.float32(0.9) * previous + update
        _, sent = feedback.encode({"w": update}, state, seed=step, return_sent=True)
        velocity_total += velocity
        sent_total += sent["w"]
        masked = state["ef/momentum/w"]
        np.testing.assert_allclose(masked, np.where(sent["w"] != 0, 0, velocity), atol=1e-6)
        np.testing.assert_allclose(sent_total + state["ef/residual/w"], velocity_total, atol=1e-4)
        previous = masked


def test_powersgd_warm_start_converges_and_lives_in_state() -> None:
    rng = np.random.default_rng(11)
    matrix = (rng.standard_normal((60, 2)) @ rng.standard_normal((2, 80))).astype(np.float32)
    codec = build_codec("powersgd:2;min=0")
    state: dict[str, np.ndarray] = {}
    errors = []
    for step in range(3):
        out = decode(codec.encode({"m": matrix}, state=state, seed=step))["m"]
        errors.append(np.linalg.norm(out - matrix) / np.linalg.norm(matrix))
    assert state["powersgd/q/m"].shape == (80, 2)
    assert errors[-1] < 1e-4  # a rank-2 matrix is recovered once the subspace has settled
    noisy = matrix + 0.3 * rng.standard_normal(matrix.shape).astype(np.float32)
    cold = [decode(codec.encode({"m": noisy}, seed=s))["m"] for s in range(3)]
    warm_state: dict[str, np.ndarray] = {}
    warm = [decode(codec.encode({"m": noisy}, state=warm_state, seed=s))["m"] for s in range(3)]
    assert np.linalg.norm(warm[-1] - noisy) < np.linalg.norm(cold[-1] - noisy)


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_rice_positions_stay_within_5_percent_of_the_entropy_bound(density: float) -> None:
    n = 2_000_000
    x = np.random.default_rng(12).standard_normal(n).astype(np.float32)
    info = inspect_payload(build_codec(f"topk:{density}").encode({"w": x})).tensors[0]
    bits_per_position = 8 * info.position_bytes / info.nnz
    assert bits_per_position / position_bound_bits(info.nnz, n) <= 1.05


def test_rice_round_trips_clustered_and_extreme_positions() -> None:
    rng = np.random.default_rng(13)
    n = 1 << 20
    cases = [
        np.arange(1000),  # all gaps zero
        np.array([n - 1]),  # one huge gap
        np.sort(rng.choice(n, 5000, replace=False)),
        np.unique(np.concatenate([np.arange(100, 900), rng.choice(n, 300)])),  # a dense cluster + scatter
    ]
    for positions in cases:
        out = bytearray()
        encode_positions(positions.astype(np.int64), out)
        reader = Reader(memoryview(bytes(out)))
        np.testing.assert_array_equal(decode_positions(reader, positions.size, n), positions)
        assert reader.remaining == 0


def _norm(arrays: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays.values())))


def test_error_feedback_residual_cap_bounds_the_residual_a_client_adds() -> None:
    """A rarely-training client's residual is scaled to at most ``cap`` times its fresh update's norm."""
    rng = np.random.default_rng(11)
    codec = build_codec("topk:0.05;min=0")
    capped, uncapped = ErrorFeedback(codec, residual_cap=1.0), ErrorFeedback(codec)
    capped_state: dict[str, np.ndarray] = {}
    uncapped_state: dict[str, np.ndarray] = {}
    scales = []
    for step in range(6):  # top-k 5 % holds back most of each update: the residual outgrows one update
        update = {name: rng.standard_normal(n).astype(np.float32) for name, n in (("w", 400), ("b", 20))}
        held = {k[len("ef/residual/") :]: v for k, v in capped_state.items()}
        _, sent = capped.encode(update, capped_state, seed=step, return_sent=True)
        # what went into the encoder: the update plus the residual, scaled down only if it was too large
        scales.append(min(1.0, _norm(update) / _norm(held)) if held else 1.0)
        for name in update:
            added = held.get(name, np.zeros_like(update[name])) * scales[-1]
            np.testing.assert_allclose(
                sent[name] + capped_state[f"ef/residual/{name}"], update[name] + added, atol=1e-4
            )
        uncapped.encode(update, uncapped_state, seed=step)
    assert _norm(uncapped_state) > 1.5 * _norm(update)  # uncapped, the residual kept growing
    assert min(scales) < 1.0  # and the cap did act


def test_error_feedback_residual_cap_must_be_positive() -> None:
    with pytest.raises(CodecConfigError, match="residual_cap"):
        ErrorFeedback(build_codec("topk:0.1"), residual_cap=0.0)
