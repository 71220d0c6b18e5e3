"""A reply whose records are odd but whose update is sound is aggregated; its odd records never end the run.

A ``MetricRecord`` may hold lists, a node may add or leave out metrics and send a second ``ArrayRecord``:
Flower's consistency checks then raised ``InconsistentMessageReplies`` and its metric average added a list
to a float, out of ``aggregate_train``, ending the coordinator's round loop (and ``--resume`` ran into it
again). The replies are now conformed first: one array record and one metric record each, holding the
metrics more than half of the replies have as a finite number (a reply without one is given the others'
mean, so one node can neither hide a figure nor poison it).
"""

from __future__ import annotations

import numpy as np
import pytest
from fl_helpers import reference_app, run
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedge.app.config import AppConfig
from fedge.app.server_app import build_strategy
from fedge.client import CompressionMod
from fedge.protocol.records import UPDATE_KEY
from fedge.server.metric_average import reported_metrics
from fedge.simulation.local_grid import LocalGrid

NODES = 3


def _odd_records(msg: Message, context: Context, call_next) -> Message:
    """Partition 0's reply: its loss as a list, a metric of its own and, beside a compressed update, an extra
    array record (beside dense weights a second array record makes the update ambiguous: it is rejected)."""
    reply = call_next(msg, context)
    odd = msg.metadata.message_type == MessageType.TRAIN and context.node_config["partition-id"] == 0
    if reply.has_error() or not odd:
        return reply
    metrics = next(r for r in reply.content.values() if isinstance(r, MetricRecord))
    metrics["train_loss"] = [0.1, 0.2]
    metrics["only_mine"] = 1.0
    if UPDATE_KEY in reply.content:
        reply.content["zz_extra"] = ArrayRecord({"x": Array(np.zeros(3, np.float32))})
    return reply


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"strategy": "median"},
        {"strategy": "trimmed-mean"},
        {"strategy": "median", "codec": "topk:0.1+int8"},
    ],
    ids=["fedavg", "median", "trimmed-mean", "codec-median"],
)
def test_a_reply_with_odd_records_is_aggregated_and_the_run_goes_on(settings):
    strategy = build_strategy(AppConfig(local_epochs=1, min_nodes=NODES, **settings))
    history = run(LocalGrid(reference_app([_odd_records, CompressionMod()]), NODES), strategy, rounds=2)
    assert len(history.rounds) == 2
    assert all(r.extra.get("accepted", NODES) == NODES for r in history.rounds)
    assert history.rounds[-1].accuracy > history.initial_accuracy


class _RaisingRule(FedAvg):
    """A rule that fails on round 2's replies, as an unforeseen reply might make any rule fail."""

    def aggregate_train(self, server_round, replies):
        if server_round == 2:
            raise TypeError("can only concatenate list (not 'float') to list")
        return super().aggregate_train(server_round, replies)


def test_a_round_whose_aggregation_raises_keeps_the_model_and_is_counted(caplog):
    """The loop went on to round 3 from round 1's model, and the failure is in the round's metrics."""
    history = run(LocalGrid(reference_app([]), NODES), _RaisingRule(fraction_evaluate=0.0), rounds=3)
    assert [r.extra.get("aggregation_failed", 0) for r in history.rounds] == [0, 1, 0]
    assert history.rounds[1].accuracy == history.rounds[0].accuracy  # the model stayed as it was
    assert "round 2: aggregation failed: TypeError: can only concatenate list" in caplog.text


def _hidden_loss(mode: str):
    """A mod: partition 0 sends its train loss as NaN (or leaves it out, or adds a figure of its own); the
    others report 2.0, so the round's weighted mean is 2.0 whatever their example counts."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or msg.metadata.message_type != MessageType.TRAIN:
            return reply
        metrics = next(r for r in reply.content.values() if isinstance(r, MetricRecord))
        if context.node_config["partition-id"] != 0:
            metrics["train_loss"] = 2.0
        elif mode == "nan":
            metrics["train_loss"] = float("nan")
        elif mode == "missing":
            del metrics["train_loss"]
        else:
            metrics["train_loss"] = 2.0
            metrics["only_mine"] = 5.0
        return reply

    return mod


@pytest.mark.parametrize("mode", ["nan", "missing", "added"])
@pytest.mark.parametrize(
    "settings",
    [{}, {"strategy": "median"}, {"codec": "topk:0.1+int8"}, {"strategy": "fedbuff", "buffer_size": 3}],
    ids=["fedavg", "median", "codec", "fedbuff"],
)
def test_one_node_cannot_hide_or_poison_the_rounds_train_loss(settings, mode):
    """Before, NaN made the round's train_loss NaN and a node leaving it out removed it from the round."""
    strategy = build_strategy(AppConfig(local_epochs=1, min_nodes=NODES, **settings))
    grid = LocalGrid(reference_app([_hidden_loss(mode), CompressionMod()]), NODES)
    history = run(grid, strategy, rounds=2)
    for metrics in history.rounds:
        assert metrics.extra["train_loss"] == pytest.approx(2.0)
        assert "train_only_mine" not in metrics.extra


def test_reported_metrics_weigh_the_replies_that_hold_a_figure():
    records = [
        {"num-examples": 1, "loss": 1.0, "acc": 0.5, "mine": 9.0},
        {"num-examples": 3, "loss": 3.0, "acc": float("nan"), "list": [1.0]},
        {"num-examples": 0, "loss": 7.0, "acc": 0.7},
    ]
    figures = reported_metrics(records, "num-examples")
    assert figures == {"loss": pytest.approx((1 + 9) / 4), "acc": pytest.approx(0.5)}
    # held by exactly half: left out; weights summing to 0: the plain mean
    assert reported_metrics(records[:2], "num-examples") == {"loss": pytest.approx(2.5)}
    assert reported_metrics([{"w": 0, "loss": 1.0}, {"w": 0, "loss": 3.0}], "w") == {"loss": 2.0}
