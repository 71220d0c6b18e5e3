"""FedBuff: the staleness-weighted buffer by hand, FedAvg as its synchronous case, asynchronous runs on a
simulated fleet (fast clients count more often, reproducible, a client cut off loses its work)."""

from __future__ import annotations

import functools
import random
import threading
from collections import Counter

import numpy as np
import pytest

from fedge.app.client_app import app as client_app
from fedge.app.config import AppConfig
from fedge.app.server_app import build_strategy, run_federated
from fedge.config import ConfigError
from fedge.devices.fleet import FleetConfig, assign_fleet
from fedge.devices.traces import AvailabilityTrace
from fedge.flower.compat import set_task_identity
from fedge.flower.grid import WrappingGrid
from fedge.server import FedBuff, ServerOptimizer
from fedge.simulation.clock_grid import ClockGrid, Schedule
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.local_grid import LocalGrid

MIXED = FleetConfig(mix={"jetson_nano_eth": 0.5, "nbiot_gateway": 0.5}, seed=1)


def _fedbuff_app(**settings) -> AppConfig:
    values = {"rounds": 8, "local_epochs": 1, "seed": 0, "strategy": "fedbuff", "buffer_size": 2}
    return AppConfig(**{**values, "concurrency": 4, **settings})


def _accepted_by_device(history) -> Counter:
    return Counter(t["device"] for r in history.rounds for t in r.timeline if t["status"] == "accepted")


def test_staleness_weights_and_the_buffer_by_hand():
    state = FedBuff({"w": np.zeros(2)}, buffer_size=2, concurrency=3, staleness_exponent=1.0)
    assert not state.add({"w": np.array([2.0, 0.0])}, base_version=0, num_examples=1)
    assert state.add({"w": np.array([0.0, 4.0])}, base_version=0, num_examples=3)  # K = 2: full
    # Fresh updates: (1·[2, 0] + 3·[0, 4]) / 4.
    np.testing.assert_allclose(state.flush()["w"], [0.5, 3.0])
    assert state.version == 1 and state.last_staleness == [0, 0]
    assert state.weight(0) == 0.5  # τ = 1, (1 + 1)^-1
    state.add({"w": np.array([4.0, 4.0])}, base_version=0)  # stale: counts half
    state.add({"w": np.array([2.0, 2.0])}, base_version=1)
    # (0.5·[4, 4] + 1·[2, 2]) / (1 + 1): normalised by the examples, so staleness shrinks the step.
    np.testing.assert_allclose(state.flush()["w"], [2.5, 5.0])
    assert state.last_staleness == [1, 0]
    with pytest.raises(ValueError):
        state.add({"w": np.zeros(2)}, base_version=3)  # from a version not reached yet


def test_the_paper_weight_server_learning_rate_statistics_and_an_empty_flush():
    model = {"w": np.ones(2), "bn.running_mean": np.zeros(2)}
    state = FedBuff(model, buffer_size=1, concurrency=1, server_lr=0.5, averaged={"bn.running_mean"})
    state.flush()  # nothing buffered: the model stays, the version counts the aggregation
    assert state.version == 1 and state.weight(0) == pytest.approx(2**-0.5)
    state.add({"w": np.full(2, 4.0), "bn.running_mean": np.full(2, 4.0)}, base_version=0)
    flushed = state.flush()  # τ = 1: 4 · 2^-0.5, times η = 0.5 for parameters
    np.testing.assert_allclose(flushed["w"], 1 + 0.5 * 4 * 2**-0.5, rtol=1e-6)
    # a statistic is the client's value (version 0's zeros + 4), averaged with no step size or shrinkage
    np.testing.assert_allclose(flushed["bn.running_mean"], 4.0, rtol=1e-6)
    momentum = FedBuff({"w": np.zeros(1)}, buffer_size=1, concurrency=1, optimizer=ServerOptimizer("avgm"))
    momentum.add({"w": np.ones(1)}, 0)
    momentum.flush()  # v = 1, x = 1
    momentum.add({"w": np.ones(1)}, 1)
    np.testing.assert_allclose(momentum.flush()["w"], [1 + 1.9])  # v = 0.9·1 + 1


def test_stale_batchnorm_statistics_are_averaged_as_values_and_stay_valid():
    """A stale client's variance delta was measured from an old value: added to the current one it would
    drive the running variance negative (a NaN model); averaged as the client's own value, it cannot."""
    var = "bn.running_var"
    state = FedBuff({"w": np.zeros(1), var: np.ones(2)}, buffer_size=1, concurrency=2, averaged={var})
    state.add({"w": np.ones(1), var: np.array([-0.9, -0.5])}, base_version=0)  # its variance: [0.1, 0.5]
    np.testing.assert_allclose(state.flush()[var], [0.1, 0.5], rtol=1e-6)
    # a client sent version 0 (variance 1) reports 0.2: its delta is -0.8, from version 0's value
    state.add({"w": np.ones(1), var: np.array([-0.8, -0.8])}, base_version=0)
    fresh = {"w": np.ones(1), var: np.array([0.1, 0.1])}  # version 1's client: [0.2, 0.6]
    state.add(fresh, base_version=1)
    flushed = state.flush()  # weights 2^-0.5 and 1
    expected = (2**-0.5 * np.array([0.2, 0.2]) + np.array([0.2, 0.6])) / (2**-0.5 + 1)
    np.testing.assert_allclose(flushed[var], expected, rtol=1e-6)
    assert (flushed[var] > 0).all()
    # an update older than the versions kept (2C) adds its parameters but not its statistics
    for _ in range(2, 8):
        state.flush()
    variance, w = state.model[var].copy(), float(state.model["w"][0])
    state.add({"w": np.ones(1), var: np.full(2, 5.0)}, base_version=0)
    after = state.flush()
    np.testing.assert_array_equal(after[var], variance)
    assert after["w"][0] == pytest.approx(w + 9**-0.5)  # τ = 8: the parameters take the stale step


def test_without_staleness_a_full_buffer_is_fedavgs_weighted_average():
    rng = np.random.default_rng(0)
    model = {"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4)}
    clients = [{k: v + rng.normal(size=v.shape) for k, v in model.items()} for _ in range(3)]
    examples = [5, 1, 2]
    state = FedBuff(model, buffer_size=3, concurrency=3)
    for client, n in zip(clients, examples, strict=True):
        state.add({k: client[k] - model[k] for k in model}, base_version=0, num_examples=n)
    flushed = state.flush()
    for name in model:
        average = sum(n * c[name] for c, n in zip(clients, examples, strict=True)) / sum(examples)
        np.testing.assert_allclose(flushed[name], average, rtol=1e-5, atol=1e-6)


def test_with_k_equal_to_c_equal_to_the_clients_a_run_is_fedavg():
    runs = {}
    for strategy, settings in (("fedavg", {}), ("fedbuff", {"buffer_size": 4, "concurrency": 4})):
        app = AppConfig(rounds=2, local_epochs=1, seed=0, strategy=strategy, **settings)
        runs[strategy] = run_simulation(SimulationConfig(clients=4, workers=1, app=app)).rounds
    assert [r.accuracy for r in runs["fedbuff"]] == [r.accuracy for r in runs["fedavg"]]
    np.testing.assert_allclose([r.loss for r in runs["fedbuff"]], [r.loss for r in runs["fedavg"]], rtol=1e-5)
    assert [r.extra["staleness_max"] for r in runs["fedbuff"]] == [0, 0]
    assert all(r.clients_replied == r.extra["accepted"] == 4 for r in runs["fedbuff"])
    # the clients' train figures, averaged by examples as Flower's FedAvg does (FedBuff recorded none)
    train_loss = {name: [r.extra["train_loss"] for r in rounds] for name, rounds in runs.items()}
    np.testing.assert_allclose(train_loss["fedbuff"], train_loss["fedavg"], rtol=1e-6)


class _WholeBuffers(WrappingGrid):
    """Hands over a round's replies only once all of its calls have finished, all at once, in the order
    ``arrange`` puts them: what real time may do to the replies of one buffer."""

    def __init__(self, inner, arrange) -> None:
        super().__init__(inner)
        self._arrange, self._held = arrange, {}

    def pull_messages(self, message_ids):
        message_ids = list(message_ids)
        self._held.update({r.metadata.reply_to_message_id: r for r in self._inner.pull_messages(message_ids)})
        if any(i not in self._held for i in message_ids):
            return []
        return self._arrange([self._held.pop(i) for i in message_ids])


def test_the_order_a_buffers_replies_arrive_in_changes_no_bit_of_the_model():
    """The replies of one buffer, handed over in node order or reversed, give the same model to the last
    bit: in real time their order is the timing's, and a run resumed from its checkpoint had parted from
    the uninterrupted one (0.35 % of the loss, one run in ten)."""
    app = AppConfig(
        rounds=2, local_epochs=1, seed=0, strategy="fedbuff", buffer_size=4, concurrency=4, min_nodes=4
    )
    finals = []
    for reverse in (False, True):
        set_task_identity(run_id=1)
        strategy = build_strategy(app)
        order = functools.partial(sorted, key=lambda r: r.metadata.src_node_id, reverse=reverse)
        grid = LocalGrid(client_app, 4, workers=1)
        try:
            run_federated(_WholeBuffers(grid, order), app, strategy=strategy)
        finally:
            grid.shutdown()
        finals.append(strategy.state.model)
    assert finals[0].keys() == finals[1].keys()
    assert all(np.array_equal(finals[0][name], finals[1][name]) for name in finals[0])


def test_with_fewer_clients_than_k_the_buffer_is_aggregated_once_every_client_is_in_it(caplog):
    app = AppConfig(rounds=2, local_epochs=1, seed=0, strategy="fedbuff", buffer_size=4, concurrency=4)
    with caplog.at_level("WARNING", logger="fedge"):
        rounds = run_simulation(SimulationConfig(clients=3, workers=1, app=app)).rounds  # real time
    assert [(r.extra["accepted"], r.clients_sampled) for r in rounds] == [(3, 3), (3, 3)]
    # said once, not silently (the run is then FedAvg weighted by staleness)
    assert [r.message for r in caplog.records].count(
        "FedBuff: K=4 but 3 nodes are connected: each aggregation waits until none is left training and "
        "takes the replies it has (set buffer_size to at most the nodes)"
    ) == 1


def test_on_a_mixed_fleet_fast_clients_count_more_often_and_the_model_improves():
    history = run_simulation(SimulationConfig(clients=6, workers=1, app=_fedbuff_app(), fleet=MIXED))
    counts = _accepted_by_device(history)
    assert counts["jetson_nano_eth"] >= 2 * counts["nbiot_gateway"] > 0  # 3 clients of each
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.2
    clock = [r.extra["sim_clock_s"] for r in history.rounds]
    assert clock == sorted(clock) and all(r.extra["sim_time_s"] >= 0 for r in history.rounds)
    assert all(r.extra["accepted"] == 2 for r in history.rounds)  # K replies per aggregation
    assert max(r.extra["staleness_max"] for r in history.rounds) > 0  # C > K: some updates are stale


def test_identical_seeds_give_identical_metrics_and_simulated_times_compressed():
    app = _fedbuff_app(rounds=5, codec="topk:0.1+int8", downlink_codec="topk:0.1+int8")
    config = SimulationConfig(
        clients=8,
        workers=1,
        app=app,
        fleet=MIXED,
        availability="random",
        schedule=Schedule(availability_aware=True),
    )
    first, second = run_simulation(config), run_simulation(config)

    def figures(history):
        return [
            (r.accuracy, r.loss, r.extra["sim_time_s"], r.extra["sim_clock_s"], r.timeline)
            for r in history.rounds
        ]

    assert figures(first) == figures(second)
    assert first.rounds[-1].extra["sim_clock_s"] > 0 and first.rounds[-1].accuracy > first.initial_accuracy
    assert all(r.extra["accepted"] == 2 and r.extra["compression_ratio"] > 1 for r in first.rounds)
    assert all(r.extra["train_loss"] > 0 for r in first.rounds)


def test_which_nodes_train_does_not_depend_on_other_threads_drawing_from_random():
    """FedBuff picks idle nodes from a stream of its own, seeded when the run starts: a thread of another
    library drawing from Python's global ``random`` meanwhile (a reconnect's jitter) changes no choice."""
    config = SimulationConfig(clients=8, workers=1, app=_fedbuff_app(rounds=3, concurrency=2), fleet=MIXED)

    def trained(history) -> list[list[int]]:
        return [sorted(t["client"] for t in r.timeline) for r in history.rounds]

    first = run_simulation(config)
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            random.random()
            stop.wait(0.0001)

    drawer = threading.Thread(target=draw, daemon=True)
    drawer.start()
    try:
        second = run_simulation(config)
    finally:
        stop.set()
        drawer.join()
    assert trained(first) == trained(second)
    assert len({c for r in trained(first) for c in r}) > 2  # a choice among more nodes than train at once


def test_a_client_cut_off_by_its_availability_loses_its_work():
    """Client 0 is there for the first 0.1 ms only: it is cut off mid-download, its slot goes to another."""
    clients = 4
    grid = LocalGrid(client_app, clients, workers=1)
    client_of = {node: int(c.node_config["partition-id"]) for node, c in grid.contexts.items()}
    period = 1e7
    trace = AvailabilityTrace({0: [(0.0, 1e-4)], **{i: [(0.0, period)] for i in range(1, clients)}}, period)
    profiles = assign_fleet(FleetConfig(mix={"jetson_nano_eth": 1.0}), clients)
    clock = ClockGrid(grid, profiles, client_of, lambda i, r: 1e9, 4 * 300_000, trace=trace)
    try:
        history = run_federated(
            clock, _fedbuff_app(rounds=3, concurrency=4, buffer_size=2), num_partitions=clients
        )
    finally:
        grid.shutdown()
    rows = [t for r in history.rounds for t in r.timeline]
    assert [(t["client"], t["status"]) for t in rows if t["client"] == 0] == [(0, "cut_off")]
    assert rows[0]["client"] == 0 and rows[0]["arrival_s"] > rows[0]["away_s"] == 1e-4
    assert all(r.extra["accepted"] == 2 for r in history.rounds)
    # C = 4; the lost client rests until the aggregation, and no other is idle to take its slot
    assert history.rounds[0].clients_sampled == 4


def test_a_client_the_trace_never_has_is_never_offered_and_fedbuff_trains_the_others():
    """Client 0 has no interval at all. With concurrency above the clients still idle, the runner refilled
    every freed slot with it at once, each loss at the same instant: the clock never reached the real
    replies, and the run failed at t = 0 after 20 x C losses in a row."""
    clients = 4
    grid = LocalGrid(client_app, clients, workers=1)
    client_of = {node: int(c.node_config["partition-id"]) for node, c in grid.contexts.items()}
    period = 1e7
    trace = AvailabilityTrace({0: [], **{i: [(0.0, period)] for i in range(1, clients)}}, period)
    profiles = assign_fleet(FleetConfig(mix={"jetson_nano_eth": 1.0}), clients)
    clock = ClockGrid(grid, profiles, client_of, lambda i, r: 1e9, 4 * 300_000, trace=trace)
    try:
        assert sorted(client_of[n] for n in clock.get_node_ids()) == [1, 2, 3]
        history = run_federated(
            clock, _fedbuff_app(rounds=3, concurrency=4, buffer_size=2), num_partitions=clients
        )
    finally:
        grid.shutdown()
    assert all(r.extra["accepted"] == 2 for r in history.rounds)
    assert {t["client"] for r in history.rounds for t in r.timeline} <= {1, 2, 3}


def test_a_trace_without_any_client_available_is_refused_in_one_line():
    grid = LocalGrid(client_app, 2, workers=1)
    client_of = {node: int(c.node_config["partition-id"]) for node, c in grid.contexts.items()}
    profiles = assign_fleet(FleetConfig(mix={"jetson_nano_eth": 1.0}), 2)
    try:
        with pytest.raises(ConfigError, match=r"none of the run.s 2 clients is ever available"):
            ClockGrid(
                grid, profiles, client_of, lambda i, r: 1e9, 1, trace=AvailabilityTrace({0: [], 1: []}, 10.0)
            )
    finally:
        grid.shutdown()


def test_fedbuff_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="need strategy 'fedbuff'"):
        AppConfig(buffer_size=5)
    with pytest.raises(ConfigError, match="concurrency >= buffer_size"):
        AppConfig(strategy="fedbuff", buffer_size=10, concurrency=5)
    for exponent in (-1.0, 1e308):  # 1e308 weighed every stale update at zero
        with pytest.raises(ConfigError, match=r"staleness_exponent must be in \[0, 10\]"):
            AppConfig(strategy="fedbuff", staleness_exponent=exponent)
    assert AppConfig(strategy="fedbuff", server_lr=0.5).server_lr == 0.5  # dense FedBuff steps too


@pytest.mark.parametrize("compress", ["", "strong"])
def test_a_resumed_run_goes_on_from_its_checkpoint_as_the_uninterrupted_run_did(tmp_path, compress):
    """A coordinator restarted from round 2's checkpoint: versions go on from 2, the server optimizer's
    momentum is restored, and (K = C, every client each round) rounds 3 and 4 are the uninterrupted run's."""
    from fedge.app.server_app import build_strategy
    from fedge.flower.compat import set_task_identity
    from fedge.server.checkpoint import load_checkpoint, save_checkpoint

    app = AppConfig(
        rounds=4,
        local_epochs=1,
        seed=0,
        strategy="fedbuff",
        buffer_size=4,
        concurrency=4,
        server_optimizer="avgm",
        min_nodes=4,
        compress=compress,
    )
    set_task_identity(run_id=1)

    def run(strategy, resume=None, on_round_end=None):
        grid = LocalGrid(client_app, 4, workers=1)
        try:
            return run_federated(grid, app, strategy=strategy, resume=resume, on_round_end=on_round_end)
        finally:
            grid.shutdown()

    uninterrupted = build_strategy(app)

    def checkpoint(server_round, arrays, history):
        if server_round == 2:
            save_checkpoint(tmp_path, server_round, arrays, history, uninterrupted.state_dict())

    whole = run(uninterrupted, on_round_end=checkpoint).rounds
    point = load_checkpoint(tmp_path)
    assert int(point.strategy_state["steps"]) == 2
    restarted = build_strategy(app)
    restarted.load_state_dict(point.strategy_state)
    resumed = run(restarted, resume=point).rounds
    assert [r.round for r in resumed] == [1, 2, 3, 4]
    assert [r.extra["version"] for r in resumed[2:]] == [3, 4]
    assert all(r.extra["accepted"] == 4 for r in resumed[2:])
    assert int(restarted.state_dict()["steps"]) == 4
    if not compress:  # dense: the same updates in another order, so equal up to float rounding
        np.testing.assert_allclose([r.loss for r in resumed[2:]], [r.loss for r in whole[2:]], rtol=1e-4)
    else:  # the restart sends full models (no client's version is trusted), so the runs part a little
        assert resumed[-1].accuracy > 0.5 and abs(resumed[-1].accuracy - whole[-1].accuracy) < 0.05


def test_a_run_resumed_after_its_last_aggregation_sends_no_work():
    from fedge.app.server_app import build_strategy, federated_run
    from fedge.flower.compat import set_task_identity
    from fedge.server.runner import ResumePoint

    app = AppConfig(
        rounds=2, local_epochs=1, seed=0, strategy="fedbuff", buffer_size=2, concurrency=2, min_nodes=2
    )
    set_task_identity(run_id=1)
    grid = LocalGrid(client_app, 2, workers=1)
    try:
        whole = run_federated(grid, app)
        pushed = []
        push = grid.push_messages
        grid.push_messages = lambda messages: push(pushed.extend(messages) or messages)
        point = ResumePoint(2, federated_run(app, num_partitions=2).initial_arrays, whole)
        resumed = run_federated(grid, app, strategy=build_strategy(app), resume=point)
    finally:
        grid.shutdown()
    assert pushed == [] and [r.round for r in resumed.rounds] == [1, 2]


def test_a_run_where_every_client_fails_ends_in_one_line_and_leaves_metrics_json(tmp_path):
    from fedge.server.runner import RunFailed

    (tmp_path / "broken.py").write_text(
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Broken(DigitsTask):\n"
        "    def train(self, model, data, config):\n"
        "        raise RuntimeError('boom in train')\n"
    )
    out = tmp_path / "out"
    app = _fedbuff_app(rounds=2, concurrency=2, task=f"{tmp_path / 'broken.py'}:Broken", out_dir=str(out))
    with pytest.raises(RunFailed) as failed:
        run_simulation(SimulationConfig(clients=2, workers=1, app=app))
    message = str(failed.value)
    assert "lost their work; first: partition" in message and message.endswith("RuntimeError: boom in train")
    assert "Traceback" not in message and "\n" not in message
    assert (out / "metrics.json").exists()  # nothing aggregated: its config, still


def test_a_fleet_never_available_is_refused_before_the_run_naming_its_availability(tmp_path):
    """FedBuff's failure said "first: no reply"; a trace without any client available is now refused before
    the run starts, in one line naming the availability."""
    import pickle

    trace = tmp_path / "never.pkl"  # FedScale's format: nobody is ever active
    empty = {"duration": 100.0, "active": [], "inactive": [], "finish_time": 100.0}
    trace.write_bytes(pickle.dumps({i: dict(empty) for i in range(4)}))
    config = SimulationConfig(
        clients=4, workers=1, app=_fedbuff_app(rounds=2), fleet=MIXED, availability=str(trace)
    )
    with pytest.raises(
        ConfigError, match=r"availability: none of the run.s [0-9]* clients is ever available"
    ):
        run_simulation(config)


def _node_zero(mod):
    """A ClientApp whose partition 0 runs ``mod(reply, msg)`` on its train replies (the others honest)."""
    from fl_helpers import reference_app

    def wrapper(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == "train" and context.node_config["partition-id"] == 0:
            return mod(reply, msg)
        return reply

    return reference_app([wrapper])


def test_a_dense_reply_claiming_a_huge_weight_is_rejected_from_its_buffer():
    """Dense FedBuff weighed each update by its claimed examples, untested: a claim of 1e30 set the model."""
    from flwr.app import MetricRecord

    def inflated(reply, msg):
        next(r for r in reply.content.values() if isinstance(r, MetricRecord))["num-examples"] = 1e15
        return reply

    grid = LocalGrid(_node_zero(inflated), 4, workers=1)
    try:
        history = run_federated(grid, _fedbuff_app(rounds=3, concurrency=4, buffer_size=4))
    finally:
        grid.shutdown()
    assert all(r.extra["rejected_weight_outlier"] == 1 and r.extra["accepted"] == 3 for r in history.rounds)
    assert history.rounds[-1].accuracy > 0.5


def test_a_node_that_fails_at_once_rests_until_the_next_aggregation():
    """Re-sent work at once, a node failing at once kept a slot busy for good: with fewer honest nodes than
    K, the buffer never filled, and the run ended after 20 x C losses."""
    from fedge.flower.node import error_reply

    grid = LocalGrid(_node_zero(lambda reply, msg: error_reply(msg, 0, "broken install")), 4, workers=1)
    try:
        history = run_federated(grid, _fedbuff_app(rounds=3, concurrency=4, buffer_size=4))
    finally:
        grid.shutdown()
    assert [r.extra["accepted"] for r in history.rounds] == [3, 3, 3]
    assert history.rounds[-1].accuracy > 0.5


def test_a_dispatch_given_up_on_is_counted_and_named(caplog):
    """Two killed agents' lost dispatches were an INFO line naming Flower's integer id, and nowhere in
    metrics.json (FedBuff sweep)."""
    import logging
    import time

    from fedge.protocol.fleet import flower_node_id
    from fedge.server.async_runner import _Dispatch

    strategy = build_strategy(_fedbuff_app())
    caplog.set_level(logging.WARNING, logger="fedge.server.async_runner")
    strategy._in_flight["m1"] = _Dispatch(flower_node_id("fb-1"), 3, time.monotonic() - 30.0)
    strategy._in_flight["m2"] = _Dispatch(flower_node_id("fb-2"), 3, time.monotonic())
    assert strategy._expire(20.0) and list(strategy._in_flight) == ["m2"]
    assert strategy._timed_out == 1
    assert "node fb-1 (" in caplog.text and "did not reply within 20 s" in caplog.text
