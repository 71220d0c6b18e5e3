"""Sparse-aware robust aggregation (fedge.server.robust) and simulated attackers (fedge.app.attacks)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from fl_helpers import configured_train
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg

from fedge.app.attacks import SCALE_FACTOR, attacker_ids, poison
from fedge.app.config import AppConfig
from fedge.app.server_app import build_strategy, train_config_record
from fedge.compression import build_codec
from fedge.config import ConfigError
from fedge.protocol.records import UPDATE_KEY, record_to_arrays
from fedge.server import (
    CompressionConfig,
    DecodingStrategy,
    DenseFedAvg,
    ReplyScreen,
    RobustConfig,
    RobustStreamingFedAvg,
    ScreenedStrategy,
    StreamingFedAvg,
)
from fedge.server.robust import aggregate_sparse, agreement
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.local_grid import LocalGrid

RNG = np.random.default_rng(7)
MODEL = {"w": RNG.normal(size=(40, 25)).astype(np.float32), "b": RNG.normal(size=10).astype(np.float32)}
SIZE = sum(a.size for a in MODEL.values())


def _sparse(pairs: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    return np.array(list(pairs), dtype=np.int64), np.array(list(pairs.values()), dtype=np.float32)


# --- the rules on hand-made sparse updates ------------------------------------------------------------------


def test_median_over_senders_is_not_the_median_with_zeros():
    # Five clients; coordinate 0 sent by three of them, coordinate 1 by one, coordinate 2 by nobody.
    updates = [_sparse({0: 1.0}), _sparse({0: 2.0, 1: 4.0}), _sparse({0: 30.0}), _sparse({}), _sparse({})]
    robust = aggregate_sparse(updates, 3, "median")
    # over the senders: median(1, 2, 30) = 2, times the senders' share 3/5; coordinate 1: 4 × 1/5
    np.testing.assert_allclose(robust, [2.0 * 3 / 5, 4.0 / 5, 0.0], rtol=1e-6)
    dense = np.zeros((5, 3), np.float32)
    for row, (indices, values) in enumerate(updates):
        dense[row, indices] = values
    with_zeros = np.median(dense, axis=0)  # what FedMedian over decoded sparse replies computes
    np.testing.assert_array_equal(with_zeros, [1.0, 0.0, 0.0])
    assert robust[1] != with_zeros[1] and robust[0] != with_zeros[0]
    # agreeing senders give exactly the unweighted average (the FedAvg step error feedback expects)
    same = [_sparse({0: 0.5}), _sparse({0: 0.5}), _sparse({})]
    np.testing.assert_allclose(aggregate_sparse(same, 1, "median"), [np.mean([0.5, 0.5, 0.0])])


def test_trimmed_mean_drops_each_coordinates_extremes_among_its_senders():
    values = [-100.0, 1.0, 2.0, 3.0, 100.0]
    updates = [_sparse({0: v, 1: 1.0}) for v in values] + [_sparse({})] * 5
    trimmed = aggregate_sparse(updates, 2, "trimmed-mean", trim=0.2)  # ⌊0.2 × 5⌋ = 1 from each end
    np.testing.assert_allclose(trimmed, [2.0 * 5 / 10, 1.0 * 5 / 10], rtol=1e-6)
    mean = aggregate_sparse(updates, 2, "mean")
    np.testing.assert_allclose(mean, [sum(values) / 10, 0.5], rtol=1e-6)
    # unsorted hand-made indices are fine; a coordinate sent twice is not
    np.testing.assert_allclose(aggregate_sparse([(np.array([1, 0]), np.array([2.0, 1.0]))], 2), [1.0, 2.0])
    with pytest.raises(ValueError, match="twice"):
        aggregate_sparse([(np.array([1, 1]), np.array([2.0, 1.0]))], 2)
    with pytest.raises(ValueError, match="outside"):
        aggregate_sparse([_sparse({5: 1.0})], 2)


def test_agreement_is_each_updates_cosine_with_the_others_sum():
    honest = [_sparse({0: 1.0, 1: 1.0}), _sparse({0: 1.0, 2: 1.0}), _sparse({0: 1.0, 1: 1.0, 2: 1.0})]
    flipped = _sparse({0: -1.0, 1: -1.0})
    cosines = agreement([*honest, flipped], 3)
    assert all(c > 0 for c in cosines[:3]) and cosines[3] < -0.5
    others = np.array([3.0, 2.0, 2.0])  # the three honest updates summed
    np.testing.assert_allclose(cosines[3], -5.0 / (np.sqrt(2) * np.linalg.norm(others)))


def test_robust_config_refuses_bad_settings():
    for bad in ({"rule": "mode"}, {"trim": 0.5}, {"clip_ratio": 0.0}, {"memory": 1.0}):
        with pytest.raises(ValueError):
            RobustConfig(**bad)


# --- the strategy on encoded replies ------------------------------------------------------------------------


def _configured(strategy, nodes: int) -> list[Message]:
    return configured_train(strategy, MODEL, LocalGrid(ClientApp(), nodes))


def _reply(message: Message, payload: bytes, examples: float = 10.0) -> Message:
    content = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": examples}),
            UPDATE_KEY: ConfigRecord({"payload": payload, "base": 1}),
        }
    )
    return Message(content, reply_to=message)


def _honest(count: int) -> list[dict[str, np.ndarray]]:
    direction = {k: RNG.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}
    return [
        {k: (0.1 * (d + 0.3 * RNG.normal(size=d.shape))).astype(np.float32) for k, d in direction.items()}
        for _ in range(count)
    ]


def _moved(arrays) -> np.ndarray:
    got = record_to_arrays(arrays)[0]
    return np.concatenate([(got[k] - MODEL[k]).ravel() for k in MODEL])


def test_clipping_bounds_a_scaled_attackers_influence():
    codec = build_codec("topk:0.2+int8;min=0,patterns=")
    screen = ReplyScreen(max_norm_ratio=float("inf"))  # let the attacker past screening: clipping alone
    compression = CompressionConfig(codec.spec, screen=screen)
    robust = RobustConfig(clip_ratio=1.0, min_agreement=-1.0)  # clipping alone
    deltas = _honest(6)
    attacker = {k: 1000.0 * v for k, v in deltas[0].items()}
    honest_only, attacked = {}, {}
    for label, updates in (("honest", deltas), ("attacked", [*deltas[1:], attacker])):
        for name, strategy in (
            ("mean", StreamingFedAvg(compression, min_available_nodes=6)),
            ("robust", RobustStreamingFedAvg(compression, robust=robust, min_available_nodes=6)),
        ):
            messages = _configured(strategy, 6)
            replies = [_reply(m, codec.encode(d)) for m, d in zip(messages, updates, strict=True)]
            arrays, _ = strategy.aggregate_train(1, replies)
            (honest_only if label == "honest" else attacked)[name] = np.linalg.norm(_moved(arrays))
            if name == "robust" and label == "attacked":
                assert strategy.round_metrics(1)["clipped"] >= 1
    # the average lets one client move the model ~170 times as far; the robust step stays as it was
    assert attacked["mean"] > 50 * honest_only["mean"]
    assert attacked["robust"] < 1.5 * honest_only["robust"]


def test_counted_map_holds_exactly_the_aggregated_replies():
    codec = build_codec("topk:0.2+int8;min=0,patterns=")
    robust = RobustConfig(min_agreement=-0.5)  # keeps reputations, leaves nobody out here
    strategy = RobustStreamingFedAvg(CompressionConfig(codec.spec), robust=robust, min_available_nodes=6)
    messages = _configured(strategy, 6)
    deltas = _honest(4)
    replies = [_reply(m, codec.encode(d)) for m, d in zip(messages[:4], deltas, strict=True)]
    replies.append(_reply(messages[4], b"\x00" * 40))  # undecodable: lost, folds back
    replies.append(_reply(messages[5], codec.encode({k: 1000 * v for k, v in deltas[0].items()})))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["fedge.accepted"] == 4
    nodes = [m.metadata.dst_node_id for m in messages]
    assert strategy.channel.counted == {node: 1 for node in nodes[:4]}
    report = strategy.round_metrics(1)
    assert report["rejected_undecodable"] == 1 and report["rejected_norm_outlier"] == 1
    assert strategy.channel.discarded == {nodes[5]: 1}  # a poisoned update is dropped, not folded back
    # the reputation survives a restart with the counted map and the optimizer
    restored = RobustStreamingFedAvg(CompressionConfig(codec.spec))
    restored.load_state_dict(strategy.state_dict())
    assert restored.channel.counted == strategy.channel.counted
    assert restored.channel.run == strategy.channel.run  # the nodes' state stays this run's
    assert RobustStreamingFedAvg(CompressionConfig(codec.spec)).channel.run != strategy.channel.run
    assert restored.reputation == pytest.approx(strategy.reputation)
    assert set(restored.reputation) == set(nodes[:4])


def test_a_disagreeing_node_is_left_out_and_not_counted():
    codec = build_codec("fp32")
    strategy = RobustStreamingFedAvg(
        CompressionConfig(codec.spec), robust=RobustConfig(min_agreement=0.0), min_available_nodes=5
    )
    messages = _configured(strategy, 5)
    deltas = _honest(4)
    flipped = {k: -v for k, v in deltas[0].items()}
    replies = [_reply(m, codec.encode(d)) for m, d in zip(messages, [*deltas, flipped], strict=True)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    flipper = messages[4].metadata.dst_node_id
    assert strategy.round_metrics(1)["left_out"] == 1
    assert flipper not in strategy.channel.counted and len(strategy.channel.counted) == 4
    assert strategy.reputation[flipper] < 0 < min(v for k, v in strategy.reputation.items() if k != flipper)
    moved = _moved(arrays)
    direction = np.concatenate([np.mean([d[k] for d in deltas], axis=0).ravel() for k in MODEL])
    assert float(np.dot(moved, direction)) > 0.9 * np.linalg.norm(moved) * np.linalg.norm(direction)


# --- attacks and configuration ----------------------------------------------------------------------------


def test_attacks_follow_their_formulas_and_attackers_are_a_seeded_fraction():
    received = {"w": np.ones(4, np.float32)}
    trained = {"w": np.array([2.0, 1.0, 0.0, 1.5], np.float32)}
    update = trained["w"] - received["w"]
    np.testing.assert_allclose(poison("sign-flip", received, trained)["w"], received["w"] - update)
    np.testing.assert_allclose(poison("scale", received, trained)["w"], received["w"] + SCALE_FACTOR * update)
    np.testing.assert_array_equal(poison("free-ride", received, trained)["w"], received["w"])
    big = {"w": np.zeros(10_000, np.float32)}
    moved = {"w": np.full(10_000, 0.01, np.float32)}
    noise = poison("noise", big, moved, seed=3)["w"]
    assert np.linalg.norm(noise) == pytest.approx(np.linalg.norm(moved["w"]), rel=0.05)
    assert abs(float(np.dot(noise, moved["w"]))) < 0.1 * np.linalg.norm(noise) * np.linalg.norm(moved["w"])
    chosen = attacker_ids(20, 0.2, seed=0)
    assert len(chosen) == 4 and chosen == attacker_ids(20, 0.2, seed=0) != attacker_ids(20, 0.2, seed=1)
    assert len(attacker_ids(3, 0.2, 0)) == 1 and attacker_ids(20, 0.0, 0) == frozenset()


def test_strategy_and_attack_settings_are_validated_and_built():
    with pytest.raises(ConfigError, match="aggregates compressed updates: set compress"):
        AppConfig(strategy="sparse-median")
    with pytest.raises(ConfigError, match="unknown strategy 'krum'"):
        AppConfig(strategy="krum")
    with pytest.raises(ConfigError, match="unknown attack"):
        AppConfig(attack="model-replacement")
    with pytest.raises(ConfigError, match="attackers needs attack"):
        AppConfig(attackers=0.3)
    with pytest.raises(ConfigError, match=r"attackers is a fraction"):
        AppConfig(attack="noise", attackers=1.5)
    sparse = {"codec": "topk:0.01+int8"}
    # uncompressed: Flower's rules (FedAvg read faster) behind fedge's screening of dense replies
    for config, rule in [("median", FedMedian), ("trimmed-mean", FedTrimmedAvg), ("fedavg", DenseFedAvg)]:
        screened = build_strategy(AppConfig(strategy=config))
        assert isinstance(screened, ScreenedStrategy) and type(screened.strategy) is rule
    wrapped = build_strategy(AppConfig(strategy="median", **sparse))
    assert isinstance(wrapped, DecodingStrategy) and isinstance(wrapped.strategy, FedMedian)
    robust = build_strategy(AppConfig(strategy="sparse-trimmed-mean", **sparse))
    assert isinstance(robust, RobustStreamingFedAvg) and robust.robust.rule == "trimmed-mean"
    assert "attack" not in train_config_record(AppConfig())
    record = train_config_record(AppConfig(attack="sign-flip"))
    assert record["attack"] == "sign-flip" and record["attackers"] == 0.2
    flat = AppConfig(strategy="sparse-median", attack="scale", attackers=0.1, **sparse).to_run_config()
    assert AppConfig.from_run_config(flat).attackers == 0.1


# --- real runs --------------------------------------------------------------------------------------------


def _simulate(rounds: int, **settings):
    app = AppConfig(rounds=rounds, alpha=0.5, seed=0, **settings)
    return run_simulation(SimulationConfig(clients=10, engine="local", workers=2, app=app))


def test_sparse_median_trains_where_fedmedian_over_decoded_sparse_replies_does_not(caplog):
    caplog.set_level(logging.ERROR)
    sparse = {
        "codec": "topk:0.01+int8;min=0,patterns=",
        "downlink_codec": "topk:0.1+int8",
        "ef_momentum": 0.6,
        "server_lr": 2.5,
    }
    decoded = _simulate(6, strategy="median", **sparse)  # DecodingStrategy(FedMedian)
    robust = _simulate(6, strategy="sparse-median", **sparse)
    assert decoded.rounds[-1].accuracy < decoded.initial_accuracy + 0.1  # the median of zeros is zero
    assert robust.rounds[-1].accuracy > decoded.rounds[-1].accuracy + 0.3
    assert all(r.extra["accepted"] == 10 for r in robust.rounds)


def test_under_sign_flip_attackers_the_robust_rule_beats_plain_averaging(caplog):
    caplog.set_level(logging.ERROR)
    attacked = {"codec": "topk:0.1+int8;min=0,patterns=", "attack": "sign-flip", "attackers": 0.3}
    averaged = _simulate(8, **attacked)  # three of ten clients undo what the others learn
    robust = _simulate(8, strategy="sparse-median", **attacked)
    assert robust.rounds[-1].accuracy > averaged.rounds[-1].accuracy + 0.25
    assert all(r.extra["clipped"] >= 1 for r in robust.rounds)


def test_batchnorm_statistics_are_combined_apart_from_the_robust_rule():
    """Statistics (a batch counter, running variances) move by what each client's data says: counted in the
    norm, a counter's +28..+48 made honest clients look alike (duplicates) and hid a scaled attacker."""
    model = {
        "w": RNG.normal(size=(40, 25)).astype(np.float32),
        "bn.running_var": np.ones(10, np.float32),
        "bn.num_batches_tracked": np.array(100, np.int64),
    }
    codec = build_codec("topk:0.2+int8;min=0")  # the statistics go dense (default patterns)
    strategy = RobustStreamingFedAvg(CompressionConfig(codec.spec), min_available_nodes=6)
    messages = configured_train(strategy, model, LocalGrid(ClientApp(), 6))
    direction = RNG.normal(size=(40, 25)).astype(np.float32)
    deltas = [
        {
            "w": (0.05 * (direction + RNG.normal(size=direction.shape))).astype(np.float32),
            "bn.running_var": RNG.uniform(-0.5, 0.5, size=10).astype(np.float32),
            "bn.num_batches_tracked": np.array(28 + 4 * i, np.int64),
        }
        for i in range(6)
    ]
    deltas[5]["w"] = 10 * deltas[5]["w"]  # a scaled attacker, whose counter looks like everyone's
    replies = [_reply(m, codec.encode(d)) for m, d in zip(messages, deltas, strict=True)]
    arrays, _ = strategy.aggregate_train(1, replies)
    report = strategy.round_metrics(1)
    assert report["rejected_norm_outlier"] == 1 and report["duplicates"] == 0
    got = record_to_arrays(arrays)[0]
    expected_var = 1.0 + np.median([d["bn.running_var"] for d in deltas[:5]], axis=0)
    np.testing.assert_allclose(got["bn.running_var"], expected_var, atol=1e-6)  # the median (rule: median)
    assert int(got["bn.num_batches_tracked"]) == 100 + 36  # the median of 28, 32, 36, 40, 44


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "mean"])
def test_one_client_cannot_set_the_statistics_under_any_robust_rule(rule):
    """Averaged as they were, one client's running_var of -1e4 made the model NaN under every rule, and a
    counter of 3e38 wrapped round int64."""
    model = {
        "w": RNG.normal(size=(40, 25)).astype(np.float32),
        "bn.running_var": np.ones(10, np.float32),
        "bn.num_batches_tracked": np.array(100, np.int64),
    }
    codec = build_codec("topk:0.2+int8;min=0")
    robust = RobustConfig(rule=rule, trim=0.2)
    strategy = RobustStreamingFedAvg(CompressionConfig(codec.spec), robust=robust, min_available_nodes=10)
    messages = configured_train(strategy, model, LocalGrid(ClientApp(), 10))
    direction = RNG.normal(size=(40, 25)).astype(np.float32)
    deltas = [
        {
            "w": (0.05 * (direction + RNG.normal(size=direction.shape))).astype(np.float32),
            "bn.running_var": RNG.uniform(-0.1, 0.1, size=10).astype(np.float32),
            "bn.num_batches_tracked": np.array(30, np.int64),
        }
        for _ in range(10)
    ]
    deltas[3]["bn.running_var"] = np.full(10, -1e4, np.float32)
    deltas[7]["bn.num_batches_tracked"] = np.array(2**62, np.int64)
    replies = [_reply(m, codec.encode(d)) for m, d in zip(messages, deltas, strict=True)]
    arrays, _ = strategy.aggregate_train(1, replies)
    got = record_to_arrays(arrays)[0]
    assert np.all(np.abs(got["bn.running_var"] - 1.0) <= 0.1)  # within the honest clients' changes
    assert int(got["bn.num_batches_tracked"]) == 130


def test_flowers_dense_rules_over_a_sparse_codec_are_warned_about(caplog):
    """Their median of mostly zeros kept a run at chance, with exit 0 and no word (attack sweep)."""
    caplog.set_level(logging.WARNING, logger="fedge.app.server_app")
    build_strategy(AppConfig(strategy="median", codec="topk:0.05+int8"))
    assert "mostly the zeros its sparsifier left out" in caplog.text and "use sparse-median" in caplog.text
    caplog.clear()
    build_strategy(AppConfig(strategy="trimmed-mean", codec="fp16"))  # dense: every coordinate is sent
    assert "sparsifier" not in caplog.text
