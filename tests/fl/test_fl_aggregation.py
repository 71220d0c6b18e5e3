"""Streaming aggregation, server optimizers and reply screening, on hand-made replies."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from fl_helpers import configured_train
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedge.compression import build_codec
from fedge.protocol.records import INSTRUCTION_KEY, UPDATE_KEY, arrays_to_record, record_to_arrays
from fedge.server import CompressionConfig, ReplyScreen, ServerOptimizer, StreamingFedAvg
from fedge.server.screening import ratio_outliers
from fedge.simulation.local_grid import LocalGrid

RNG = np.random.default_rng(1)
MODEL = {
    "a.weight": RNG.normal(size=(30, 20)).astype(np.float32),
    "a.bias": RNG.normal(size=7).astype(np.float32),
}


def _configured(strategy, nodes: int = 4) -> list[Message]:
    return configured_train(strategy, MODEL, LocalGrid(ClientApp(), nodes))


def _reply(message: Message, payload: bytes, examples: float = 10.0, base: int = 1) -> Message:
    content = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": examples, "loss": 1.0}),
            UPDATE_KEY: ConfigRecord({"payload": payload, "base": base}),
        }
    )
    return Message(content, reply_to=message)


def _deltas(count: int, scale: float = 0.1) -> list[dict[str, np.ndarray]]:
    return [
        {k: (scale * RNG.normal(size=v.shape)).astype(np.float32) for k, v in MODEL.items()}
        for _ in range(count)
    ]


def test_streaming_sum_equals_flowers_fedavg_on_lossless_updates():
    strategy = StreamingFedAvg(CompressionConfig(codec="fp32"), min_available_nodes=4)
    messages = _configured(strategy)
    assert all(INSTRUCTION_KEY in m.content and "arrays" in m.content for m in messages)
    deltas, examples = _deltas(4), [10.0, 30.0, 5.0, 55.0]
    codec = build_codec("fp32")
    replies = [_reply(m, codec.encode(d), n) for m, d, n in zip(messages, deltas, examples, strict=True)]
    arrays, metrics = strategy.aggregate_train(1, replies)

    dense = []
    for message, delta, n in zip(messages, deltas, examples, strict=True):
        weights = {k: MODEL[k] + delta[k] for k in MODEL}
        content = RecordDict(
            {
                "arrays": arrays_to_record(weights, {}),
                "metrics": MetricRecord({"num-examples": n, "loss": 1.0}),
            }
        )
        dense.append(Message(content, reply_to=message))
    expected, expected_metrics = FedAvg().aggregate_train(1, dense)
    got = record_to_arrays(arrays)[0]
    for name, values in record_to_arrays(expected)[0].items():
        np.testing.assert_allclose(got[name], values, rtol=1e-6, atol=1e-6)
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"])
    assert metrics["fedge.accepted"] == 4
    assert metrics["fedge.payload_compression_ratio"] == pytest.approx(1.0, rel=0.1)
    # On the wire the compact envelope leaves out what a dense Flower reply repeats (metadata, names).
    assert metrics["fedge.compression_ratio"] > metrics["fedge.payload_compression_ratio"]


def test_server_momentum_and_adam_follow_their_formulas():
    params = {"w": np.ones(3, np.float32)}
    updates = [np.array([0.1, -0.2, 0.3], np.float32), np.array([0.2, 0.0, -0.1], np.float32)]
    momentum = ServerOptimizer("avgm", learning_rate=0.5, momentum=0.9)
    for update in updates:
        momentum.step(params, {"w": update.copy()})
    velocity = 0.9 * updates[0] + updates[1]
    np.testing.assert_allclose(params["w"], 1 + 0.5 * updates[0] + 0.5 * velocity, rtol=1e-6)

    params = {"w": np.ones(3, np.float32)}
    adam = ServerOptimizer("adam", learning_rate=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)
    m = s = np.zeros(3)
    x = np.ones(3)
    for t, update in enumerate(updates, start=1):
        adam.step(params, {"w": update.copy()})
        m = 0.9 * m + 0.1 * update
        s = 0.99 * s + 0.01 * update.astype(np.float64) ** 2
        x = x + 0.01 * np.sqrt(1 - 0.99**t) / (1 - 0.9**t) * m / (np.sqrt(s) + 1e-3)
    np.testing.assert_allclose(params["w"], x, rtol=1e-5)


def test_bad_optimizer_settings_are_refused():
    with pytest.raises(ValueError, match="server optimizer"):
        ServerOptimizer("sgd")
    with pytest.raises(ValueError, match="momentum"):
        ServerOptimizer("avgm", momentum=1.0)


def test_structurally_bad_replies_are_rejected_with_reasons_and_node_ids(caplog):
    strategy = StreamingFedAvg(CompressionConfig(codec="topk:0.1+int8"), min_available_nodes=5)
    messages = _configured(strategy, nodes=5)
    codec = build_codec("topk:0.1+int8")
    good = [_reply(m, codec.encode(d)) for m, d in zip(messages[:2], _deltas(2), strict=True)]
    no_update = Message(RecordDict({"arrays": arrays_to_record(MODEL, {})}), reply_to=messages[2])
    stale = _reply(messages[3], codec.encode(_deltas(1)[0]), base=0)
    bad_weight = _reply(messages[4], codec.encode(_deltas(1)[0]), examples=float("nan"))
    with caplog.at_level(logging.WARNING, logger="fedge.server"):
        arrays, _ = strategy.aggregate_train(1, [*good, no_update, stale, bad_weight])
    assert arrays is not None
    report = strategy.round_metrics(1)
    assert report["accepted"] == 2 and report["rejected"] == 3
    assert report["rejected_no_update"] == report["rejected_stale"] == report["rejected_bad_weight"] == 1
    for message in messages[2:]:
        assert f"node {message.metadata.dst_node_id}:" in caplog.text


def test_outlier_tests_need_enough_replies_and_use_the_median():
    screen = ReplyScreen(max_norm_ratio=5.0, min_replies=3)
    few, many = [1.0, 100.0], [1.0, 1.2, 0.8, 5.9, 6.1]
    assert ratio_outliers(few, screen.max_norm_ratio, screen.min_replies) == [False, False]
    assert ratio_outliers(many, screen.max_norm_ratio, screen.min_replies) == [False] * 4 + [True]
    assert ratio_outliers(many, float("inf"), screen.min_replies) == [False] * 5
    with pytest.raises(ValueError, match="max_norm_ratio"):
        ReplyScreen(max_norm_ratio=1.0)
    with pytest.raises(ValueError, match="max_weight_ratio"):
        ReplyScreen(max_weight_ratio=0.5)


def test_all_replies_rejected_leaves_the_model_alone():
    strategy = StreamingFedAvg(CompressionConfig(codec="fp32"), min_available_nodes=2)
    messages = _configured(strategy, nodes=2)
    assert strategy.aggregate_train(1, [_reply(m, b"\x00" * 40) for m in messages]) == (None, None)
    assert strategy.round_metrics(1)["rejected_undecodable"] == 2


def test_array_record_keys_survive_compressed_downloads():
    strategy = StreamingFedAvg(
        CompressionConfig(codec="fp32"), min_available_nodes=2, arrayrecord_key="weights"
    )
    grid = LocalGrid(ClientApp(), 2)
    try:
        record = ArrayRecord({"w": arrays_to_record(MODEL, {})["a.weight"]})
        messages = list(strategy.configure_train(1, record, ConfigRecord(), grid))
    finally:
        grid.shutdown()
    assert all(m.content[INSTRUCTION_KEY]["arrays-key"] == "weights" for m in messages)


def test_statistics_take_the_plain_average_whatever_the_server_step():
    from fedge.server.optimizers import statistics

    dtypes = {
        "bn.weight": "float32",
        "bn.running_var": "float32",
        "bn.num_batches_tracked": "int64",
        "fc.weight": "float32",
    }
    assert statistics(dtypes) == {"bn.running_var", "bn.num_batches_tracked"}
    for kind in ("avg", "avgm", "adam"):
        params = {name: np.ones(2, np.float32) for name in dtypes}
        update = {name: np.full(2, -0.5, np.float32) for name in dtypes}
        ServerOptimizer(kind, learning_rate=3.0).step(params, update, averaged=statistics(dtypes))
        assert np.allclose(params["bn.running_var"], 0.5) and np.allclose(
            params["bn.num_batches_tracked"], 0.5
        )
        if kind == "avg":  # the parameters took the 3x step (and would have driven a variance negative)
            assert np.allclose(params["fc.weight"], -0.5)
