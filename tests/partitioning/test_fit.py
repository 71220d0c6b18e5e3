"""The calibration fit: NNLS is correct, known coefficients are recovered, noise is tolerated."""

import numpy as np
import pytest

from fedge.partitioning import CostModel, Device, Fleet
from fedge.partitioning.costs import Calibration
from fedge.partitioning.fit import fit_stage_model, nnls, op_classes
from fedge.partitioning.synthetic import random_graph


def _kkt_holds(a, y, x, tol=1e-8):
    grad = a.T @ (a @ x - y)
    scale = max(1.0, float(np.abs(a.T @ y).max()))
    return (x >= 0).all() and (grad >= -tol * scale).all() and (np.abs(grad[x > 0]) <= tol * scale).all()


def test_nnls_satisfies_optimality_conditions():
    rng = np.random.default_rng(0)
    for _ in range(200):
        m, k = int(rng.integers(3, 15)), int(rng.integers(1, 6))
        a, y = rng.normal(size=(m, k)), rng.normal(size=m)
        assert _kkt_holds(a, y, nnls(a, y))


def test_fit_recovers_known_coefficients_without_prior():
    rng = np.random.default_rng(1)
    profiled = rng.uniform(1e-3, 2e-2, (14, 2))
    io = rng.uniform(1e4, 3e6, 14)
    truth = ((1.3, 0.7), 2e-4, 1e-9)
    measured = profiled @ np.array(truth[0]) + truth[1] + truth[2] * io
    fit = fit_stage_model(profiled, io, measured, prior_weight=0.0)
    assert fit.class_scales == pytest.approx(truth[0], rel=1e-6)
    assert fit.overhead_s == pytest.approx(truth[1], rel=1e-6)
    assert fit.per_byte_s == pytest.approx(truth[2], rel=1e-6)
    assert np.allclose(fit.predict(profiled, io), measured, rtol=1e-9)


def test_fit_with_noise_predicts_within_noise_and_stays_non_negative():
    rng = np.random.default_rng(2)
    profiled = rng.uniform(1e-3, 2e-2, (20, 2))
    io = rng.uniform(1e4, 3e6, 20)
    clean = profiled @ np.array([1.1, 0.9]) + 5e-4
    measured = clean * rng.uniform(0.95, 1.05, 20)
    fit = fit_stage_model(profiled, io, measured)
    assert min(fit.class_scales) >= 0 and fit.overhead_s >= 0 and fit.per_byte_s >= 0
    assert np.max(np.abs(fit.predict(profiled, io) - clean) / clean) < 0.1


def test_absent_class_keeps_profiler_time_and_calibration_flows_into_costs():
    profiled = np.array([[1e-3, 0.0], [2e-3, 0.0], [4e-3, 0.0]])
    fit = fit_stage_model(profiled, np.zeros(3), profiled[:, 0] * 2.0, prior_weight=0.0)
    assert fit.class_scales[0] == pytest.approx(2.0) and fit.class_scales[1] == 1.0
    assert list(op_classes(["Conv", "Relu", "MatMul", "Add"])) == [0, 1, 0, 1]
    g = random_graph(6, np.random.default_rng(3))
    cal = Calibration(tuple([1e-3] * 6), 1, 1e11, 2e-4, 1.0, 0.0, (2.0, 1.0))
    cost = CostModel(g, Fleet((Device("h", 1e11),)), calibration=cal)
    assert cost.compute_seconds(0, 3, 0) == pytest.approx(3e-3 + 2e-4)
