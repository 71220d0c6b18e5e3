"""Screening uncompressed replies: one bad node is rejected and counted, the round goes on without it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedMedian

from fedge.app.config import AppConfig
from fedge.app.task import DigitsTask
from fedge.flower.compat import set_task_identity
from fedge.server import DenseFedAvg, ReplyScreen, ScreenedStrategy
from fedge.server.counted import COUNTED_NODES_KEY
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation

MODEL = {"w": np.zeros((2, 3), np.float32), "count": np.array(4, np.int64)}


class _Grid:
    """What a strategy's configure_train asks of a Grid: the connected nodes."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def _reply(node: int, arrays: dict | None = None, metrics: dict | None = None, **records) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node, message_type="train")
    content = RecordDict(records)
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)
    reply = Message(content, reply_to=instruction)
    reply.metadata.__dict__["_src_node_id"] = node  # as the node that answered
    return reply


def _honest(node: int, value: float, examples: float = 10.0, **extra_metrics) -> Message:
    weights = {"w": np.full((2, 3), value, np.float32), "count": np.array(5, np.int64)}
    return _reply(node, weights, {"num-examples": examples, "train_loss": 0.5, **extra_metrics})


def _strategy(inner=None, **screen) -> ScreenedStrategy:
    set_task_identity(run_id=1)
    strategy = ScreenedStrategy(inner or DenseFedAvg(fraction_evaluate=0.0), ReplyScreen(**screen))
    model = ArrayRecord({k: Array(v) for k, v in MODEL.items()})
    strategy.configure_train(1, model, ConfigRecord(), _Grid(list(range(1, 12))))
    return strategy


def test_bad_replies_are_rejected_by_reason_and_the_honest_ones_aggregated():
    strategy = _strategy(max_norm_ratio=5.0, max_weight_ratio=100.0)
    nan = np.full((2, 3), np.nan, np.float32)
    replies = [
        _honest(1, 1.0),
        _honest(2, 1.0),
        _honest(3, 1.0),
        _honest(4, 1.0, extra_metric=7.0),  # a metric the others lack: kept, the metric is not aggregated
        _reply(5, {"w": nan, "count": np.array(5)}, {"num-examples": 10.0}),
        _reply(6, {"w": np.ones((3, 2), np.float32), "count": np.array(5)}, {"num-examples": 10.0}),
        _reply(7, {**MODEL, "extra": np.ones(2)}, {"num-examples": 10.0}),
        _reply(8, None, {"num-examples": 10.0}),
        _reply(9, MODEL, {"num-examples": float("nan")}),
        _honest(10, 1.0, examples=1e15),
        _reply(11, {"w": np.full((2, 3), 100.0, np.float32), "count": np.array(5)}, {"num-examples": 10.0}),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), np.ones((2, 3)))  # only the four honest replies
    assert metrics["train_loss"] == pytest.approx(0.5) and "extra_metric" not in metrics
    figures = strategy.round_metrics(1)
    assert figures["accepted"] == 4 and figures["rejected"] == 7
    assert {k: v for k, v in figures.items() if k.startswith("rejected_") and v} == {
        "rejected_non_finite": 1,
        "rejected_wrong_tensors": 2,
        "rejected_no_update": 1,
        "rejected_bad_weight": 1,
        "rejected_weight_outlier": 1,
        "rejected_norm_outlier": 1,
    }
    assert set(strategy.state_dict()[COUNTED_NODES_KEY]) == {1, 2, 3, 4}


def test_integers_where_the_model_has_floats_are_wrong_tensors_and_counters_may_be_any_number():
    """A float tensor sent as integers was never checked nor measured: 2**62 as int64 set the average alone
    (a hostile node's reply, at the default screen). A counter may come back as an integer or a float."""
    strategy = _strategy()  # the default screen; the norm test is not needed for this
    huge = {"w": np.full((2, 3), 2**62, np.int64), "count": np.array(5)}
    replies = [
        _honest(1, 1.0),
        _honest(2, 3.0),
        _reply(3, huge, {"num-examples": 10.0}),
        _reply(4, {"w": np.full((2, 3), 2.0, np.float32), "count": np.array(5.0)}, {"num-examples": 10.0}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 2.0))
    figures = strategy.round_metrics(1)
    assert figures["accepted"] == 3 and figures["rejected_wrong_tensors"] == 1


def test_records_under_other_names_and_a_median_rule_still_aggregate():
    strategy = _strategy(FedMedian(fraction_evaluate=0.0))
    odd = _reply(3, None, None)  # the same model and metrics, under other record names
    odd.content = RecordDict(
        {
            "weights": ArrayRecord({k: Array(np.full_like(v, 3)) for k, v in MODEL.items()}),
            "m": MetricRecord({"num-examples": 5.0, "train_loss": 0.1}),
            "cfg": ConfigRecord({"note": "kept"}),
        }
    )
    arrays, _ = strategy.aggregate_train(1, [_honest(1, 1.0), _honest(2, 2.0), odd])
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 2.0))  # the median of 1, 2, 3


def test_a_round_with_nothing_acceptable_keeps_the_model():
    strategy = _strategy()
    assert strategy.aggregate_train(1, [_reply(1, MODEL, {"loss": 1.0})]) == (None, None)
    assert (
        strategy.round_metrics(1)["rejected_bad_weight"] == 1 and strategy.round_metrics(1)["accepted"] == 0
    )
    assert strategy.round_metrics(2) == {}


class DivergingDigits(DigitsTask):
    """Digits where client 0's features are scaled by 10^30: its training ends in NaN weights."""

    def load_partition(self, partition_id, num_partitions, *, alpha, seed):
        features, labels = super().load_partition(partition_id, num_partitions, alpha=alpha, seed=seed)
        return (features * 1e30 if partition_id == 0 else features), labels


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_a_client_whose_training_diverges_is_rejected_and_the_run_trains_on(strategy):
    # Before screening, FedAvg averaged client 0's NaN weights in: the model stayed NaN for good.
    task = f"{Path(__file__).resolve()}:DivergingDigits"
    buffered = {"buffer_size": 2, "concurrency": 4} if strategy == "fedbuff" else {}
    app = AppConfig(rounds=3, task=task, seed=0, strategy=strategy, **buffered)
    history = run_simulation(SimulationConfig(clients=4, workers=2, app=app))
    assert sum(r.extra["rejected_non_finite"] for r in history.rounds) >= 1
    assert all(r.extra["rejected"] == r.extra["rejected_non_finite"] for r in history.rounds)
    # it trains on: which replies share a FedBuff buffer with client 0's (real time, two workers) decides
    # how many updates each aggregation keeps, so the bar is progress, not a level
    assert math.isfinite(history.rounds[-1].loss)
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.1


def test_records_under_each_others_names_do_not_fail_the_round():
    strategy = _strategy()
    swapped = _reply(2, None, None)
    swapped.content = RecordDict(
        {
            "metrics": ArrayRecord({k: Array(np.full_like(v, 3)) for k, v in MODEL.items()}),
            "arrays": MetricRecord({"num-examples": 10.0, "train_loss": 0.5}),
        }
    )
    arrays, _ = strategy.aggregate_train(1, [_honest(1, 1.0), swapped])
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 2.0))


@pytest.mark.parametrize("strategy", ["fedavg", "median"])  # FedMedian still averages them to float64
def test_a_model_with_integer_buffers_of_any_name_trains_every_round(tmp_path, strategy):
    """An integer buffer not named like a statistic (position ids, a mask): averaged to float64, it made
    screening reject every client's int64 copy from round 2 on (library sweep); it now stays an integer."""
    (tmp_path / "ids.py").write_text(
        "import torch\n"
        "from fedge.app.task import DigitsTask\n\n\n"
        "class WithIds(DigitsTask):\n"
        "    def model(self):\n"
        "        model = super().model()\n"
        "        model.register_buffer('position_ids', torch.arange(8))\n"
        "        model.register_buffer('mask', torch.tensor([True, False]))\n"
        "        return model\n"
    )
    app = AppConfig(rounds=3, local_epochs=1, strategy=strategy, task=f"{tmp_path / 'ids.py'}:WithIds")
    history = run_simulation(SimulationConfig(clients=3, app=app))
    assert [r.extra["accepted"] for r in history.rounds] == [3, 3, 3]


def test_update_norms_are_taken_without_blas(monkeypatch):
    """OpenBLAS's threads spin after a dot: measuring every dense reply's norm with np.dot took the cores the
    local engine's workers train on (coordinator CPU 0.45 -> 1.0 s, local_efficiency 0.73 -> 0.65 in
    fedge bench engines). The norms, the model's norm and a client's residual norm use einsum."""
    from fedge.compression.feedback import _global_norm as residual_norm
    from fedge.server.screening import model_norm, screen_dense_reply

    def no_blas(*args, **kwargs):
        raise AssertionError("np.dot called")

    monkeypatch.setattr(np, "dot", no_blas)
    model = {"w": np.ones(5000, np.float32), "b": np.zeros(3, np.float32)}
    reply = RecordDict(
        {
            "arrays": ArrayRecord({n: Array(v + 1) for n, v in model.items()}),
            "metrics": MetricRecord({"num-examples": 4.0}),
        }
    )
    checked = screen_dense_reply(reply, model=model, weighted_by_key="num-examples")
    assert checked.norm == pytest.approx(math.sqrt(5003))
    assert model_norm(model) == pytest.approx(math.sqrt(5000))
    assert residual_norm({"w": np.full(4, 2.0, np.float32)}) == pytest.approx(4.0)


def test_an_update_norm_spans_tensors_of_every_float_dtype_and_leaves_statistics_out():
    """The norm is taken over all of a reply's measured tensors at once (one vector, in the widest of their
    dtypes): half, single and double precision tensors each count, a statistic does not, and an update too
    large for float32 is refused as non-finite."""
    from fedge.server.screening import Rejected, screen_dense_reply

    model = {
        "half": np.zeros(3, np.float16),
        "single": np.ones((2, 2), np.float32),
        "double": np.zeros(2, np.float64),
        "running_var": np.ones(4, np.float32),
    }
    sent = {"half": np.full(3, 2, np.float16), "single": np.full((2, 2), 3, np.float32)}
    sent |= {"double": np.array([1e-3, 0.0]), "running_var": np.full(4, 1e6, np.float32)}

    def reply(values):
        return RecordDict(
            {
                "arrays": ArrayRecord({n: Array(v) for n, v in values.items()}),
                "metrics": MetricRecord({"num-examples": 4.0}),
            }
        )

    checked = screen_dense_reply(
        reply(sent), model=model, weighted_by_key="num-examples", statistics=frozenset({"running_var"})
    )
    assert checked.norm == pytest.approx(math.sqrt(3 * 4 + 4 * 4 + 1e-6), rel=1e-12)
    huge = sent | {"single": np.full((2, 2), 3e38, np.float32), "double": np.zeros(2, np.float32)}
    with pytest.raises(Rejected) as rejected:
        screen_dense_reply(
            reply(huge), model=model | {"double": np.zeros(2, np.float32)}, weighted_by_key="num-examples"
        )
    assert rejected.value.reason == "non_finite"


@pytest.mark.parametrize("nodes", [2, 5])
def test_a_weight_no_count_of_examples_could_be_is_rejected_before_the_sum_overflows(nodes):
    """Every node claiming 1e308 examples passed each test (finite, positive, no outlier among equals) and
    made the weights' sum infinite: a model of NaN or zeros, and a run that exited 0 (attack sweep)."""
    strategy = _strategy()
    replies = [_honest(node, 1.0, examples=1e308) for node in range(1, nodes + 1)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is None and strategy.round_metrics(1)["rejected_bad_weight"] == nodes
    exact = [_honest(node, 1.0, examples=float(2**53)) for node in range(1, nodes + 1)]
    arrays, _ = strategy.aggregate_train(2, exact)  # the largest count a float holds exactly still counts
    np.testing.assert_allclose(arrays["w"].numpy(), np.ones((2, 3)))
