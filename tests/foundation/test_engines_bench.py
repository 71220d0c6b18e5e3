"""``fedge bench engines``: its training floor is the engines' own client training, run without an engine."""

import pytest

from fedge.app.config import AppConfig
from fedge.bench.engines import _floor_run, _overhead_ratio
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation


@pytest.mark.parametrize("fraction_train", [1.0, 0.5])
def test_the_floors_run_makes_every_train_call_the_local_engine_makes_and_ends_where_it_ends(fraction_train):
    """The floor times the reference ClientApp's train calls of the same run: as many as the engine makes
    (the clients sampled, every round) and the same work, so the same final model to the bit."""
    app = AppConfig(rounds=2, local_epochs=1, fraction_train=fraction_train, seed=5)
    floor = _floor_run(app, clients=4, workers=2)
    engine = run_simulation(SimulationConfig(clients=4, workers=2, app=app))
    assert (
        floor["train_calls"] == sum(r.clients_sampled for r in engine.rounds) == round(4 * fraction_train) * 2
    )
    assert floor["final_accuracy"] == engine.rounds[-1].accuracy
    assert floor["floor_s"] > 0


def test_the_overhead_ratio_compares_each_engines_time_above_the_floor():
    assert _overhead_ratio(ray_s=21.0, local_s=2.0, floor_s=1.0) == pytest.approx(20.0)
    assert _overhead_ratio(ray_s=5.0, local_s=1.0, floor_s=1.0) > 1e6  # a local engine at the floor
