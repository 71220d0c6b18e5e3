"""The per-sender frame budget (pure): a token bucket per sender."""

from __future__ import annotations

import pytest

from fedge.transport.rate import RateBudget


def test_a_sender_gets_its_burst_then_its_rate_and_others_are_untouched():
    budget = RateBudget(rate=10.0, burst=20.0)
    assert sum(budget.allow("evil", 0.0) for _ in range(100)) == 20
    assert sum(budget.allow("evil", 1.0) for _ in range(100)) == 10  # a second refills ten
    assert all(budget.allow("honest", 1.0) for _ in range(20))
    assert sum(budget.allow("evil", 100.0) for _ in range(100)) == 20  # never more than the burst


def test_no_rate_is_no_budget_and_the_senders_remembered_are_bounded():
    assert all(RateBudget(rate=0.0, burst=1.0).allow("x", 0.0) for _ in range(10_000))
    budget = RateBudget(rate=1.0, burst=1.0, max_senders=3)
    for sender in ("a", "b", "c", "d"):
        assert budget.allow(sender, 0.0)
    assert not budget.allow("d", 0.0)
    assert budget.allow("a", 0.0)  # forgotten: a full bucket again
    with pytest.raises(ValueError):
        RateBudget(rate=-1.0, burst=1.0)
