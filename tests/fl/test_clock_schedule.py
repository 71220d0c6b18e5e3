"""The schedule on the simulated clock (``ClockGrid``), with the reference app really training."""

from __future__ import annotations

import pytest

from fedge.app.config import AppConfig
from fedge.devices.fleet import FleetConfig
from fedge.simulation.clock_grid import Schedule
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation

MIXED = FleetConfig(mix={"jetson_nano_eth": 0.5, "nbiot_gateway": 0.5}, seed=1)


def test_an_adaptive_deadline_grows_until_the_slow_gateways_are_in():
    """Gateways cut off by the first deadline count at the round's length, so the deadline grows x1.5 a
    round until their replies make it (it used to follow only the replies it let in: the Jetsons')."""
    schedule = Schedule(deadline_s=1.0, adaptive_deadline=True, deadline_quantile=1.0, deadline_slack=1.5)
    app = AppConfig(rounds=16, local_epochs=1, seed=0, codec="topk:0.1+int8", max_failed_rounds=0)
    history = run_simulation(SimulationConfig(clients=4, workers=1, app=app, fleet=MIXED, schedule=schedule))
    gateway = [{t["status"] for t in r.timeline if t["device"] == "nbiot_gateway"} for r in history.rounds]
    assert gateway[0] == {"late"}  # the first deadline, 1 s, is far below a gateway's round
    first_in = next(i for i, statuses in enumerate(gateway) if "accepted" in statuses)
    lengths = [r.extra["sim_time_s"] for r in history.rounds[:first_in]]
    assert lengths[:3] == pytest.approx([1.0, 1.5, 2.25], rel=1e-3)  # the deadline, x1.5 a round
    assert "accepted" in gateway[-1]  # and the gateways stay in
