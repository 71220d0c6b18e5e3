"""The simulated clock of split steps: parallel clients share the coordinator, sequential ones take turns."""

from __future__ import annotations

import pytest

from fedge.split import StepCost, simulate_split_round


def test_sequential_is_the_sum_of_every_chain() -> None:
    step = StepCost(1.0, 2.0, 0.5, 2.0, 1.0)
    finish = simulate_split_round(
        [[step] * 3, [step] * 2], start_s=[1.0, 1.0], end_s=[0.5, 0.5], parallel=False
    )
    assert finish == pytest.approx([1 + 3 * 6.5 + 0.5, 1 + 3 * 6.5 + 0.5 + 1 + 2 * 6.5 + 0.5])


def test_parallel_clients_overlap_unless_the_coordinator_is_the_bottleneck() -> None:
    light = StepCost(1.0, 1.0, 0.01, 1.0, 1.0)
    finish = simulate_split_round([[light] * 4] * 5)
    assert max(finish) == pytest.approx(4 * 4.01, rel=0.02)
    heavy = StepCost(0.0, 0.0, 1.0, 0.0, 0.0)
    assert max(simulate_split_round([[heavy] * 4] * 5)) == pytest.approx(20.0)
    assert max(simulate_split_round([[heavy] * 4] * 5, server_workers=5)) == pytest.approx(4.0)
