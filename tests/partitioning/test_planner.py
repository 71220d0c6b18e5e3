"""The planner is exact: equal to brute force on random small cases; costs and memory as documented."""

import math

import numpy as np
import pytest

from fedge.config import ConfigError
from fedge.partitioning import CostModel, Device, Fleet, StagePlan, brute_force, evaluate, load_fleet, plan
from fedge.partitioning.fleet import Link
from fedge.partitioning.synthetic import random_fleet, random_graph


@pytest.mark.parametrize("seed", range(4))
def test_planner_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    for case in range(30):
        g = random_graph(int(rng.integers(2, 8)), rng)
        fleet = random_fleet(
            int(rng.integers(1, 5)), rng, memory_bytes=(3e6, 3e7) if case % 2 else None, source=case % 3 == 0
        )
        cost = CostModel(g, fleet, batch=int(rng.integers(1, 5)), boundary=("fp32", "fp16", "int8")[case % 3])
        for objective in ("latency", "throughput"):
            p, bf = plan(cost, objective), brute_force(cost, objective)
            assert p.feasible == bf.feasible
            if p.feasible:
                assert p.value == pytest.approx(bf.value, rel=1e-9)
                assert evaluate(cost, p.stages, objective).value == pytest.approx(p.value, rel=1e-12)


def test_single_split_is_special_case():
    rng = np.random.default_rng(7)
    g, fleet = random_graph(7, rng), random_fleet(3, rng)
    cost = CostModel(g, fleet)
    p, bf = plan(cost, "latency", max_stages=2), brute_force(cost, "latency", max_stages=2)
    assert len(p.stages) <= 2
    assert p.value == pytest.approx(bf.value, rel=1e-9)


def test_tied_weight_counted_once_per_stage():
    rng = np.random.default_rng(3)
    g = random_graph(6, rng, tied_weights=1)
    u, v, w = g.arrays.shared_pairs[0]
    u, v = int(u), int(v)
    whole = g.segment_weight_bytes(0, 6)
    assert whole == pytest.approx(sum(g.weight_bytes.values()))
    split = g.segment_weight_bytes(0, v) + g.segment_weight_bytes(v, 6)
    assert split == pytest.approx(whole + w)  # both stages hold it


def test_replan_after_bandwidth_change_reuses_compute_costs():
    rng = np.random.default_rng(5)
    g, fleet = random_graph(50, rng), random_fleet(3, rng)
    cost = CostModel(g, fleet)
    before = plan(cost)
    slower = cost.with_fleet(fleet.with_bandwidth(1e5))
    assert slower.compute_prefix is cost.compute_prefix
    after = plan(slower)
    assert after.period_s >= before.period_s
    assert after.explain()


def test_infeasible_when_nothing_fits():
    rng = np.random.default_rng(1)
    g = random_graph(5, rng)
    fleet = Fleet((Device("tiny", 1e9, 10.0),))
    assert not plan(CostModel(g, fleet)).feasible
    assert math.isinf(evaluate(CostModel(g, fleet), [StagePlan("tiny", 0, 5)]).latency_s)


def test_fleet_toml(tmp_path):
    path = tmp_path / "devices.toml"
    path.write_text(
        'source = "a"\n[[device]]\nname = "a"\nflops_per_s = 1e9\n'
        '[[device]]\nname = "b"\nflops_per_s = 4e9\nmemory_bytes = 1e6\nbandwidth_bytes_per_s = 1e6\n'
    )
    fleet = load_fleet(path)
    assert [d.name for d in fleet.devices] == ["a", "b"] and fleet.devices[
        1
    ].link.bandwidth_bytes_per_s == 1e6
    path.write_text('[[device]]\nname = "a"\nflops = 1e9\n')
    with pytest.raises(ConfigError, match="device"):
        load_fleet(path)


def test_plan_arguments_are_checked_in_one_line():
    cost = CostModel(random_graph(6, np.random.default_rng(0)), Fleet((Device("a", 1e9), Device("b", 1e9))))
    with pytest.raises(ValueError, match="no device 'typo' in the fleet \\(it has: a, b\\)"):
        plan(cost, "latency", devices=("a", "typo"))
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_stages must be at least 1.*got {bad}"):
            plan(cost, "latency", max_stages=bad)
    assert plan(cost, "latency", devices=("b", "b")).stages[0].device == "b"  # a repeated name is one device
    with pytest.raises(ValueError, match="no device to plan over"):  # it had meant every device
        plan(cost, "latency", devices=())


def test_a_fleet_too_large_for_the_exact_planner_is_refused_before_it_allocates():
    """Its table has 2**devices x cuts entries: 30 devices on a 40-node graph asked for 328 GiB."""
    rng = np.random.default_rng(1)
    graph = random_graph(40, rng)
    cost = CostModel(graph, Fleet(tuple(Device(f"d{i}", 1e9) for i in range(30))))
    with pytest.raises(ValueError, match=r"30 devices are too many .* plan over at most 18 of them"):
        plan(cost, "throughput")
    assert plan(cost, "latency", devices=tuple(f"d{i}" for i in range(4))).feasible


def test_a_link_latency_whose_sums_would_overflow_is_refused():
    with pytest.raises(ConfigError, match="latency_s in \\[0, 1e\\+06\\] s"):
        Device("a", 1e9, link=Link(1e6, 1.7e308))
