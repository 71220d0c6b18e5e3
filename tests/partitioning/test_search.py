"""The fast planner's pieces: window extremes, subset unions, and the pruned searches against references."""

import itertools
import math

import numpy as np
import pytest

from fedge.partitioning import CostModel, brute_force, plan
from fedge.partitioning.bottleneck import coarse_start, min_bottleneck, reachable
from fedge.partitioning.latency import latency_dp
from fedge.partitioning.stagecosts import StageArrays
from fedge.partitioning.subsets import Subsets
from fedge.partitioning.synthetic import random_fleet, random_graph
from fedge.partitioning.windows import RangeTable, window_extreme


@pytest.mark.parametrize("dtype", [np.float64, np.int16])
def test_window_extreme_matches_naive(dtype):
    rng = np.random.default_rng(0)
    for _ in range(60):
        w, r, q = int(rng.integers(1, 900)), int(rng.integers(1, 4)), int(rng.integers(1, 200))
        values = rng.integers(-1000, 1000, (w, r)).astype(dtype)
        lo, hi = rng.integers(0, w + 1, q), rng.integers(0, w + 1, q)
        for op, fn in (("min", np.min), ("max", np.max)):
            out = window_extreme(values, lo, hi, op)
            for k in range(q):
                if hi[k] > lo[k]:
                    assert np.array_equal(out[k], fn(values[lo[k] : hi[k]], axis=0))
                else:
                    empty = window_extreme(values[:1], [0], [0], op)[0]
                    assert np.array_equal(out[k], empty)


def test_range_table_still_answers():
    values = np.arange(10.0)[::-1]
    assert RangeTable(values, "min").query(np.array([2]), np.array([7]))[0] == 3.0
    assert math.isinf(RangeTable(values, "max").query(np.array([4]), np.array([4]))[0])


def test_union_closure_and_completable():
    rng = np.random.default_rng(1)
    sub = Subsets(4)
    table = rng.random((5, 16)) < 0.15
    for max_size in (None, 1, 2):
        out = sub.union_closure(table, max_size)
        for j, v in itertools.product(range(5), range(16)):
            want = any(
                table[j, u]
                for u in range(16)
                if u & v == u and (max_size is None or u.bit_count() <= max_size)
            )
            assert out[j, v] == want
    for limit in (2, 4):
        done = sub.completable(table, limit)
        for j, s in itertools.product(range(5), range(16)):
            want = any(
                table[j, u] for u in range(16) if u & s == 0 and s.bit_count() + u.bit_count() <= limit
            )
            assert done[j, s] == want


def _reference_bottleneck(st: StageArrays, limit: int) -> float:
    """The exact min-max DP written plainly: g[S][j] = min over d in S, i of max(g[S-d][i], cost)."""
    num, m = st.a.shape
    g = np.full((1 << num, m), math.inf)
    g[0, 0] = -math.inf
    for s in sorted(range(1, 1 << num), key=int.bit_count):
        if s.bit_count() > limit:
            continue
        for d in range(num):
            if not s >> d & 1:
                continue
            for j in range(1, m):
                for i in range(st.lo[d, j], j):
                    g[s, j] = min(g[s, j], max(g[s ^ (1 << d), i], st.a[d, j] - st.b[d, i]))
    return float(g[1:, m - 1].min())


def _arrays(cost: CostModel) -> StageArrays:
    return StageArrays(cost.a, cost.b, cost.min_start)


@pytest.mark.parametrize("seed", range(3))
def test_pruned_bottleneck_matches_plain_dp_on_medium_graphs(seed):
    """Graphs too long for brute force (30-40 nodes): the pruned bisection equals a plain min-max DP."""
    rng = np.random.default_rng(100 + seed)
    g = random_graph(int(rng.integers(30, 41)), rng)
    fleet = random_fleet(3 + seed % 2, rng, memory_bytes=(5e6, 4e7) if seed != 1 else None)
    cost = CostModel(g, fleet, batch=2)
    st = _arrays(cost)
    limit = len(fleet.devices)
    p = plan(cost, "throughput")
    want = _reference_bottleneck(st, limit)
    assert p.feasible == math.isfinite(want)
    if p.feasible:
        assert p.period_s == pytest.approx(want, rel=1e-9)


def test_latency_dp_on_mirrored_problem_is_the_same_optimum():
    """The mirrored arrays (used for backward pruning) describe the same stages: same latency optimum."""
    rng = np.random.default_rng(7)
    for _ in range(10):
        g = random_graph(int(rng.integers(5, 30)), rng)
        cost = CostModel(g, random_fleet(3, rng, memory_bytes=(3e6, 3e7)), batch=3)
        st = _arrays(cost)
        mirror = st.reversed()
        assert mirror is not None  # memory windows only move right
        fwd, bwd = latency_dp(st, 3), latency_dp(mirror, 3)
        assert (fwd is None) == (bwd is None)
        if fwd is not None:
            total = sum(st.a[d, j] - st.b[d, i] for d, i, j in fwd)
            total_m = sum(mirror.a[d, j] - mirror.b[d, i] for d, i, j in bwd)
            assert total == pytest.approx(total_m, rel=1e-12)


def test_reachable_restricted_to_alive_keeps_every_plan_below_bound():
    rng = np.random.default_rng(3)
    g = random_graph(40, rng)
    cost = CostModel(g, random_fleet(3, rng), batch=2)
    st, sub = _arrays(cost), Subsets(3)
    best = plan(cost, "throughput").period_s
    full = reachable(st, sub, 3, best * 1.05)
    restricted = reachable(st, sub, 3, best * 1.05, full.copy())  # the reachable states themselves
    assert np.array_equal(full, restricted)
    blocked = full.copy()
    blocked[-1] = False  # no state may end the graph
    assert not reachable(st, sub, 3, best * 1.05, blocked)[-1].any()
    assert restricted[-1, 1:].any() and not reachable(st, sub, 3, best * 0.99)[-1, 1:].any()


def test_coarse_start_is_a_valid_plan_and_search_improves_it():
    rng = np.random.default_rng(11)
    g = random_graph(600, rng, tied_weights=2)
    fleet = random_fleet(4, rng, memory_bytes=(2e8, 8e8))
    cost = CostModel(g, fleet, batch=2)
    st = _arrays(cost)
    start = coarse_start(st, 4)
    assert start is not None and start[0][1] == 0 and start[-1][2] == len(g)
    assert all(a[2] == b[1] for a, b in itertools.pairwise(start))
    best = min_bottleneck(st, 4, start, 0.0)
    assert st.cost(best) <= st.cost(start)
    seed = latency_dp(st, 4)
    assert st.cost(min_bottleneck(st, 4, seed, 0.0)) == pytest.approx(st.cost(best), rel=1e-9)


@pytest.mark.parametrize("seed", range(2))
def test_max_stages_and_device_subsets_match_brute_force(seed):
    rng = np.random.default_rng(50 + seed)
    for _ in range(15):
        g = random_graph(int(rng.integers(3, 8)), rng)
        cost = CostModel(g, random_fleet(4, rng, memory_bytes=(3e6, 3e7)), batch=2)
        for objective in ("latency", "throughput"):
            p, bf = plan(cost, objective, max_stages=2), brute_force(cost, objective, max_stages=2)
            assert p.feasible == bf.feasible
            if p.feasible:
                assert p.value == pytest.approx(bf.value, rel=1e-9) and len(p.stages) <= 2
