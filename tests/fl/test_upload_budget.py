"""Per-client upload budgets: each client's codec from its link, mixed codecs in one aggregation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fl_helpers import configured_train
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.app.client_app import app as client_app
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.app.task import prepare_task
from fedge.compression import CodecConfigError, Schema, bind, build_codec, decode
from fedge.devices.budget import upload_budget_bytes
from fedge.devices.fleet import CATALOGUE, ClientProfile, FleetConfig, LinkProfile, mbit_per_s
from fedge.flower.compat import set_task_identity
from fedge.protocol.records import INSTRUCTION_KEY, UPDATE_KEY, record_to_arrays
from fedge.server import CompressionConfig, StreamingFedAvg
from fedge.server.budget import UploadBudget
from fedge.server.metered_grid import MeteredGrid
from fedge.simulation.clock_grid import Schedule
from fedge.simulation.config import SimulationConfig
from fedge.simulation.fleet import clocked_grid
from fedge.simulation.local_grid import LocalGrid

RNG = np.random.default_rng(7)
MODEL = {
    "a.weight": RNG.normal(size=(30, 20)).astype(np.float32),
    "a.bias": RNG.normal(size=7).astype(np.float32),
}
FAST, SLOW = LinkProfile(mbit_per_s(8), mbit_per_s(30), 0.025), LinkProfile(2000.0, mbit_per_s(1), 0.5)


def test_a_slower_link_gets_a_lower_density_within_the_bounds():
    budget = UploadBudget(deadline_s=10.0, min_density=0.001, max_density=0.2)
    n = 1_000_000
    slow, slower = LinkProfile(20_000.0, 1e6), LinkProfile(5_000.0, 1e6)
    assert budget.choose(slow, n)[0] > budget.choose(slower, n)[0] > budget.min_density
    # 5 s of 20 kB/s, less the framing: the density's payload fits that and one more entry does not.
    density, _ = budget.choose(slow, n)
    bits = 8 * budget.budget_bytes(slow)
    assert budget.budget_bytes(slow) == pytest.approx(5 * 20_000 - 512, abs=2)
    entry = 8.125 - np.log2(density) + 1.5  # H(p)/p <= log2(1/p) + 1/ln 2 bits of position
    assert density * n * (8.125 - np.log2(density)) <= bits < (density * n + 1) * entry
    assert budget.choose(FAST, n) == (0.2, 8)  # clipped above
    hopeless = LinkProfile(10.0, 1e6, latency_s=4.9)
    assert budget.choose(hopeless, n) == (0.001, 8)  # clipped below: the deadline will drop it
    assert budget.codec(slow, n).startswith(f"topk:{density:.3g},min_count=256+int8;min=0,patterns=")


def test_a_narrower_bit_width_below_the_threshold_and_unknown_links_get_the_default():
    budget = UploadBudget(
        deadline_s=10.0, bit_widths=(4, 8), narrow_below=0.01, default_codec="topk:0.01+int8"
    )
    n = 1_000_000
    wide, narrow = LinkProfile(200_000.0, 1e6), LinkProfile(3_000.0, 1e6)
    assert budget.choose(wide, n)[1] == 8 and budget.choose(narrow, n)[1] == 4
    assert "+int4" in budget.codec(narrow, n)
    assert UploadBudget(deadline_s=10.0).choose(narrow, n)[0] < budget.choose(narrow, n)[0]
    codecs = budget.codecs({1: wide, 2: None, 3: narrow}, n)
    assert codecs[2] == "topk:0.01+int8" and codecs[1] != codecs[3]
    assert 2 not in UploadBudget(deadline_s=10.0).codecs({1: wide, 2: None}, n)
    for spec in codecs.values():
        build_codec(spec)
    with pytest.raises(CodecConfigError):
        UploadBudget(deadline_s=10.0, bit_widths=(3,))
    with pytest.raises(CodecConfigError):
        UploadBudget(deadline_s=0.0)
    for endless in (math.inf, 1e308):  # passed, then round 1 died converting infinite bytes to an int
        with pytest.raises(CodecConfigError, match=r"deadline_s must be in \(0, 1e\+07\] seconds"):
            UploadBudget(deadline_s=endless)
    assert upload_budget_bytes(FAST, math.inf) > 0  # the byte count itself survives an endless time


class _LinkedGrid(LocalGrid):
    """A local Grid that knows its nodes' links (node order: FAST, SLOW)."""

    def node_links(self) -> dict[int, LinkProfile]:
        return dict(zip(sorted(self.get_node_ids()), (FAST, SLOW), strict=True))


def test_two_codecs_to_two_nodes_screened_and_summed_in_one_aggregation():
    budget = UploadBudget(deadline_s=1.0, min_density=0.01, max_density=0.5)
    strategy = StreamingFedAvg(CompressionConfig(codec="fp32", budget=budget), min_available_nodes=2)
    grid = _LinkedGrid(ClientApp(), 2)
    links = grid.node_links()
    messages = configured_train(strategy, MODEL, grid)
    size = sum(v.size for v in MODEL.values())
    specs = {m.metadata.dst_node_id: m.content[INSTRUCTION_KEY]["codec"] for m in messages}
    assert specs == {node: budget.codec(link, size) for node, link in links.items()}
    assert len(set(specs.values())) == 2  # the fast link at max_density, the slow one below it
    assert budget.choose(FAST, size)[0] == 0.5 and budget.choose(SLOW, size)[0] < 0.5

    deltas, weights, replies = [], [10.0, 30.0], []
    for message, examples in zip(messages, weights, strict=True):
        codec = build_codec(specs[message.metadata.dst_node_id])
        schema = Schema.of(codec, MODEL, {})
        assert message.content[INSTRUCTION_KEY]["schema"] == schema.digest
        delta = {k: (0.1 * RNG.normal(size=v.shape)).astype(np.float32) for k, v in MODEL.items()}
        payload = codec.encode(delta)
        deltas.append(decode(payload))
        bound = bind(payload, schema)
        assert bound is not None and len(bound) < len(payload)
        content = RecordDict(
            {
                "metrics": MetricRecord({"num-examples": examples, "loss": 1.0}),
                UPDATE_KEY: ConfigRecord({"payload": bound, "base": 1}),
            }
        )
        replies.append(Message(content, reply_to=message))
    # The same round on a second, identical strategy, each reply answering the other node's message:
    # bound to the other codec's schema, both are refused, as each node is screened against its own.
    twin = StreamingFedAvg(CompressionConfig(codec="fp32", budget=budget), min_available_nodes=2)
    twin_messages = configured_train(twin, MODEL, _LinkedGrid(ClientApp(), 2))
    by_node = {m.metadata.dst_node_id: m for m in twin_messages}
    swapped = [
        Message(r.content, reply_to=by_node[m.metadata.dst_node_id])
        for r, m in zip(replies, reversed(messages), strict=True)
    ]
    assert twin.aggregate_train(1, swapped) == (None, None)
    assert twin.round_metrics(1)["rejected_undecodable"] == 2

    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["fedge.accepted"] == 2 and metrics["fedge.rejected"] == 0
    got = record_to_arrays(arrays)[0]
    for name, values in MODEL.items():
        expected = values + (10 * deltas[0][name] + 30 * deltas[1][name]) / 40
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6)


def test_metered_grid_forwards_the_links_and_knows_none_without_them():
    grid = _LinkedGrid(ClientApp(), 2)
    plain = LocalGrid(ClientApp(), 2)
    try:
        assert MeteredGrid(grid).node_links() == grid.node_links()
        assert MeteredGrid(plain).node_links() == {}
    finally:
        grid.shutdown()
        plain.shutdown()


# A link that is slow up and fast down (an LTE-M modem on a good downlink): the model downloads in
# milliseconds, but 10 % top-k of the 71,754-entry digits CNN (~11.5 kB) takes ~11 s up.
SLOW_UP = ClientProfile(CATALOGUE["pi4_wifi"].compute, LinkProfile(1000.0, mbit_per_s(40), 0.05), "slow_up")
FLEET = FleetConfig(mix={"pi4_wifi": 0.5, "slow_up": 0.5}, classes={"slow_up": SLOW_UP}, seed=1)
FIXED = "topk:0.1,min_count=256+int8;min=0,patterns=*running_mean*|*running_var*|*num_batches*"
DEADLINE_S = 8.0


def _clocked_run(budget: UploadBudget | None):
    app = AppConfig(rounds=2, local_epochs=1, seed=0, fraction_train=1.0, min_nodes=1)
    config = SimulationConfig(
        clients=4, workers=1, app=app, fleet=FLEET, schedule=Schedule(deadline_s=DEADLINE_S)
    )
    task = prepare_task(app.task, app.task_args_json, config.clients, alpha=app.alpha, seed=app.seed)
    strategy = StreamingFedAvg(
        CompressionConfig(codec=FIXED, budget=budget),
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=1,
    )
    set_task_identity(run_id=1)
    grid = LocalGrid(client_app, config.clients, run_id=1, workers=1)
    client_of = {node: int(context.node_config["partition-id"]) for node, context in grid.contexts.items()}
    try:
        clocked = clocked_grid(grid, config, task, client_of)
        return run_federated(clocked, app, strategy=strategy, num_partitions=config.clients).rounds
    finally:
        grid.shutdown()


def test_a_budget_gets_a_slow_uplink_reply_in_before_the_deadline_the_fixed_codec_misses():
    fixed = _clocked_run(None)
    budgeted = _clocked_run(UploadBudget(deadline_s=DEADLINE_S, fraction=0.5, max_density=0.1))
    for rounds in (fixed, budgeted):
        assert len(rounds) == 2 and all(r.extra["sim_time_s"] <= DEADLINE_S + 1e-9 for r in rounds)
    status = {(r.round, t["device"], t["status"]) for rs in (fixed,) for r in rs for t in r.timeline}
    assert {s for _, d, s in status if d == "slow_up"} == {"late"}
    assert {s for _, d, s in status if d == "pi4_wifi"} == {"accepted"}
    rows = [t for r in budgeted for t in r.timeline]
    assert {t["status"] for t in rows} == {"accepted"} and len(rows) == 8
    slow = [t for t in rows if t["device"] == "slow_up"]
    assert slow and all(t["arrival_s"] - t["start_s"] <= DEADLINE_S for t in slow)
    assert all(t["upload_s"] <= 0.5 * DEADLINE_S for t in slow)  # within the budget's share
    assert all(r.clients_replied == 4 for r in budgeted)
    assert all(r.clients_replied == 2 for r in fixed)
