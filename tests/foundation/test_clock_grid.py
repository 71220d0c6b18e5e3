"""A heterogeneous fleet on the simulated clock: reproducible, deadlines hold, memory-aware sampling."""

from __future__ import annotations

import os

import pytest

from fedge.app.config import AppConfig
from fedge.config import ConfigError
from fedge.devices.fleet import FleetConfig
from fedge.reporting.display import fleet_table
from fedge.reporting.history import RunHistory
from fedge.simulation.clock_grid import Schedule
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation

FLEET = FleetConfig(mix={"pi4_wifi": 0.5, "nbiot_gateway": 0.5}, seed=1)


def _run(schedule: Schedule, availability: str = "", rounds: int = 3, seed: int = 0):
    app = AppConfig(rounds=rounds, local_epochs=1, seed=seed, fraction_train=0.5)
    config = SimulationConfig(
        clients=8, workers=1, app=app, fleet=FLEET, availability=availability, schedule=schedule
    )
    return run_simulation(config)


def test_identical_seeds_give_identical_simulated_times():
    first = _run(Schedule(availability_aware=True), availability="random")
    second = _run(Schedule(availability_aware=True), availability="random")
    times = [(r.extra["sim_time_s"], r.extra["sim_clock_s"], r.accuracy) for r in first.rounds]
    assert times == [(r.extra["sim_time_s"], r.extra["sim_clock_s"], r.accuracy) for r in second.rounds]
    assert all(r.timeline for r in first.rounds) and first.rounds[-1].extra["sim_clock_s"] > 0


def test_a_slow_client_delays_its_round_by_no_more_than_the_deadline():
    """NB-IoT clients need minutes for a dense model; with a 20 s deadline they are dropped as late."""
    waiting = _run(Schedule())
    bounded = _run(Schedule(deadline_s=20.0))
    assert max(r.extra["sim_time_s"] for r in waiting.rounds) > 100  # someone on NB-IoT was waited for
    assert all(r.extra["sim_time_s"] <= 20.0 + 1e-9 for r in bounded.rounds)
    late = [t for r in bounded.rounds for t in r.timeline if t["status"] == "late"]
    assert late and all(t["device"] == "nbiot_gateway" for t in late)
    assert all(
        r.clients_replied == sum(t["status"] == "accepted" for t in r.timeline) for r in bounded.rounds
    )


def test_a_client_whose_memory_cannot_hold_training_is_never_sampled():
    """Gateways (160 MB usable here) cannot hold a model needing 1 GB: they are never offered for training."""
    history = _run(Schedule(memory_aware=True, training_memory_bytes=1e9), rounds=3)
    devices = {t["device"] for r in history.rounds for t in r.timeline}
    assert devices == {"pi4_wifi"}
    # the class left out shows: every round's figures, and the fleet table's caption (it had no row)
    assert all(r.extra["clients_unfit"] == 4 for r in history.rounds)
    assert fleet_table(history).caption == "4 clients never offered: their memory cannot hold training"


def test_a_fleet_that_can_never_train_ends_in_one_line_not_a_wait():
    # Flower's sampling waited forever for a node the grid would never offer
    with pytest.raises(ConfigError, match="no client can hold training"):
        _run(Schedule(memory_aware=True, training_memory_bytes=1e30), rounds=1)


def test_an_availability_trace_with_nobody_ever_available_is_refused_before_the_run(tmp_path):
    import pickle

    from fedge.config import ConfigError

    trace = tmp_path / "nobody.pkl"  # FedScale's format: nobody is ever active
    empty = {"duration": 100.0, "active": [], "inactive": [], "finish_time": 100.0}
    trace.write_bytes(pickle.dumps({i: dict(empty) for i in range(8)}))
    for schedule in (Schedule(availability_aware=True), Schedule()):
        with pytest.raises(
            ConfigError, match=r"availability: none of the run.s [0-9]* clients is ever available"
        ):
            _run(schedule, availability=str(trace), rounds=1)


def test_a_round_that_finds_everyone_away_waits_until_they_are_back(tmp_path):
    """Every client is away for the first 500 s: round 1 trains nothing and ends when the first is back, so
    round 2 trains (the clock stood still at 0 s, every round found everyone away, and the run failed)."""
    import pickle

    trace = tmp_path / "late.pkl"  # FedScale's format: active from 500 s on, in a 10,000 s loop
    late = {"duration": 10_000.0, "active": [500.0], "inactive": [10_000.0], "finish_time": 10_000.0}
    trace.write_bytes(pickle.dumps({i: dict(late) for i in range(8)}))
    history = _run(Schedule(), availability=str(trace), rounds=2)
    first, second = history.rounds
    assert first.clients_replied == 0 and first.extra["sim_clock_s"] == 500.0
    assert {row["status"] for row in first.timeline} == {"cut_off"}
    assert first.bytes_down == first.bytes_up == 0  # nobody was there: nothing moved (it counted all)
    assert second.extra["accepted"] == second.clients_sampled > 0 and second.bytes_up > 0
    # the rounds' times add up to the clock, the wait included (it was left out of the round that waited)
    assert first.extra["sim_time_s"] + second.extra["sim_time_s"] == second.extra["sim_clock_s"]


def test_a_round_whose_clients_all_went_away_says_so(tmp_path):
    import pickle

    from fedge.server.runner import RunFailed

    trace = tmp_path / "brief.pkl"  # everyone is there for the first 0.01 s of every 10,000 s, then gone
    brief = {"duration": 10_000.0, "active": [0.0], "inactive": [0.01], "finish_time": 10_000.0}
    trace.write_bytes(pickle.dumps({i: dict(brief) for i in range(8)}))
    with pytest.raises(
        RunFailed, match=r"4 of 4 clients went away \(their availability\) before replying"
    ) as info:
        _run(Schedule(), availability=str(trace), rounds=1)
    assert not info.value.client_traceback  # no client raised: the CLI offers no traceback to look at


def test_an_adaptive_deadline_grows_until_the_slow_gateways_are_in():
    """Gateways cut off by the first deadline count at the round's length, so the deadline grows x1.5 a
    round until their replies make it (it used to follow only the replies it let in: the Pis')."""
    schedule = Schedule(deadline_s=1.0, adaptive_deadline=True, deadline_quantile=1.0, deadline_slack=1.5)
    app = AppConfig(rounds=16, local_epochs=1, seed=0, codec="topk:0.1+int8", max_failed_rounds=0)
    history = run_simulation(SimulationConfig(clients=4, workers=1, app=app, fleet=FLEET, schedule=schedule))
    gateway = [{t["status"] for t in r.timeline if t["device"] == "nbiot_gateway"} for r in history.rounds]
    assert gateway[0] == {"late"}  # the first deadline, 1 s, is far below a gateway's round
    first_in = next(i for i, statuses in enumerate(gateway) if "accepted" in statuses)
    lengths = [r.extra["sim_time_s"] for r in history.rounds[:first_in]]
    assert lengths[:3] == pytest.approx([1.0, 1.5, 2.25], rel=1e-3)  # the deadline, x1.5 a round
    assert "accepted" in gateway[-1]  # and the gateways stay in
    # The end-of-run table says who trained: the gateways' late rounds and their share of the updates.
    table = fleet_table(history)
    rows = {row[0]: row[1:] for row in zip(*(column.cells for column in table.columns), strict=True)}
    assert set(rows) == {"nbiot_gateway", "pi4_wifi"}
    aggregated = {device: int(cells[0]) for device, cells in rows.items()}
    assert int(rows["nbiot_gateway"][1]) >= first_in  # late in every round before they got in
    assert aggregated["pi4_wifi"] > aggregated["nbiot_gateway"] > 0
    assert fleet_table(RunHistory(config={})) is None  # no fleet, no table


def test_a_run_ends_after_the_round_that_spends_its_simulated_time_budget():
    """Schedules are compared over the same fleet time: the run stops once the clock reaches the budget."""
    app = AppConfig(rounds=30, local_epochs=1, seed=0, fraction_train=0.5, sim_time_budget_s=40.0)
    config = SimulationConfig(clients=8, workers=1, app=app, fleet=FLEET, schedule=Schedule(deadline_s=20.0))
    clocks = [r.extra["sim_clock_s"] for r in run_simulation(config).rounds]
    assert clocks[-1] >= 40.0 and all(c < 40.0 for c in clocks[:-1])
    assert len(clocks) < 30
    with pytest.raises(ConfigError, match="sim_time_budget_s"):
        AppConfig(sim_time_budget_s=-1.0)


def test_a_schedule_or_availability_without_a_fleet_is_refused():
    # they act on the simulated clock: without a fleet they were silently ignored (a 1 ns deadline let all in)
    with pytest.raises(ConfigError, match=r"a \[schedule\] needs a \[fleet\]"):
        SimulationConfig(clients=4, schedule=Schedule(deadline_s=1e-9))
    with pytest.raises(ConfigError, match=r"availability needs a \[fleet\]"):
        SimulationConfig(clients=4, availability="random")
    with pytest.raises(ConfigError, match=r"sim_time_budget_s needs a \[fleet\]"):  # all rounds ran
        SimulationConfig(clients=4, app=AppConfig(sim_time_budget_s=60.0))
    SimulationConfig(clients=4, engine="mqtt", schedule=Schedule(deadline_s=5.0))  # real time over MQTT


@pytest.mark.slow
def test_ray_samples_the_clients_the_local_engine_does_each_with_its_own_profile():
    """Flower's engine draws node ids at random: numbering clients by sorted node id paired profiles and
    availability with arbitrary partitions, and a seeded sample over its ids chose other clients than the
    local engine's, and other ones again on the next Ray run."""
    # unequal partitions (each client's compute differs), half the clients sampled each round
    app = AppConfig(rounds=2, local_epochs=1, alpha=0.3, fraction_train=0.5)
    fleet = FleetConfig(mix={"pi4_wifi": 0.5, "phone_lte": 0.5}, seed=2)
    timings, accuracies, environment = {}, {}, dict(os.environ)
    for engine in ("local", "ray"):
        history = run_simulation(SimulationConfig(clients=6, workers=2, engine=engine, app=app, fleet=fleet))
        timings[engine] = [
            sorted((row["client"], row["compute_s"]) for row in r.timeline) for r in history.rounds
        ]
        accuracies[engine] = [r.accuracy for r in history.rounds]
    assert all(len({compute for _, compute in rows}) == 3 for rows in timings["local"])  # pairing shows
    assert timings["ray"] == timings["local"] and accuracies["ray"] == accuracies["local"]
    assert dict(os.environ) == environment  # Ray's PYTHONPATH reached every later subprocess of the suite


def test_an_availability_path_that_is_missing_says_so(tmp_path):
    from fedge.config import ConfigError
    from fedge.simulation.fleet import availability_trace

    with pytest.raises(ConfigError, match=r"nor a trace file \(the path does not exist\)"):
        availability_trace(str(tmp_path / "missing.pkl"), 3, seed=0)
    with pytest.raises(ConfigError, match=r"\(the path is a directory\)"):
        availability_trace(str(tmp_path), 3, seed=0)
    with pytest.raises(ConfigError, match=r"\(the path is not a regular file\)"):
        availability_trace("/dev/null", 3, seed=0)


def test_run_clients_the_trace_never_makes_available_are_named_in_a_warning(tmp_path, caplog):
    """One trace client of twenty is ever there: a run of eight whose draw misses it is refused, naming the
    run's clients (it said the trace had none); one whose draw takes it trains on it, and says how many
    never will (it had said nothing)."""
    import pickle

    from fedge.config import ConfigError

    never = {"duration": 100.0, "active": [], "inactive": [], "finish_time": 100.0}
    trace = {i: dict(never) for i in range(19)} | {
        19: {"active": [0.0], "inactive": [100.0], "finish_time": 100.0}
    }
    (tmp_path / "one.pkl").write_bytes(pickle.dumps(trace))
    outcomes = {}
    for seed in range(6):
        try:
            _run(Schedule(), availability=str(tmp_path / "one.pkl"), rounds=1, seed=seed)
            outcomes[seed] = "ran"
        except ConfigError as err:
            assert "none of the run's 8 clients is ever available" in str(err)
            outcomes[seed] = "refused"
    assert set(outcomes.values()) == {"ran", "refused"}
    assert "availability: 7 of the run's 8 clients are never available in the trace" in caplog.text


def test_a_batchnorm_model_survives_clients_back_after_missing_rounds_with_a_codec(tmp_path):
    """Clients cut off in round 1 and away in rounds 2-3 come back in round 4 with their lost update folded
    back into the residual. Its BatchNorm statistics had come back too: a running_var delta taken against
    the untrained model, added to one that had moved, pushed the variance below zero; the aggregate was NaN,
    rolled back, and the run failed (fleet sweep). Statistics are not folded back."""
    import pickle

    # client k is there for [0, 1 + 0.8k) s, then from 30 s: on NB-IoT most are cut off in round 1
    trace = {
        k: {
            "duration": 100.0,
            "active": [0.0, 30.0],
            "inactive": [1.0 + 0.8 * k, 100.0],
            "finish_time": 100.0,
        }
        for k in range(10)
    }
    (tmp_path / "trace.pkl").write_bytes(pickle.dumps(trace))
    task = f"{os.path.dirname(__file__)}/token_batchnorm_task.py:TokenBatchNormTask"
    app = AppConfig(rounds=4, local_epochs=2, task=task, codec="topk:0.1+int8")
    config = SimulationConfig(
        clients=10,
        workers=1,
        app=app,
        fleet=FleetConfig(mix={"nbiot_gateway": 1.0}, seed=1),
        availability=str(tmp_path / "trace.pkl"),
    )
    history = run_simulation(config)
    back = history.rounds[-1]
    assert [r.clients_replied for r in history.rounds[1:3]] == [0, 0]  # everyone away
    assert back.clients_replied >= 8 and "rolled_back" not in back.extra
    assert back.extra["accepted"] == back.clients_replied and back.accuracy > history.rounds[0].accuracy


def test_availability_aware_sampling_asks_the_trace_once_for_every_client(monkeypatch):
    """Each round asked the trace client by client (a search each): 0.3 s a round at 20,000 clients, a
    third of the run (scale sweep). One vectorised query answers for all; the draws are the same."""
    from fedge.devices.traces import AvailabilityTrace

    expected = _run(Schedule(availability_aware=True), availability="random")

    def one_by_one(*args, **kwargs):
        raise AssertionError("asked client by client")

    monkeypatch.setattr(AvailabilityTrace, "is_available", one_by_one)
    again = _run(Schedule(availability_aware=True), availability="random")
    assert [r.timeline for r in again.rounds] == [r.timeline for r in expected.rounds]
