"""Near-duplicate updates (colluders sending one vector) count once in the sparse robust rules."""

from __future__ import annotations

import numpy as np
import pytest
from fl_helpers import configured_train
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.app.config import AppConfig
from fedge.app.server_app import build_strategy
from fedge.compression import build_codec
from fedge.config import ConfigError
from fedge.protocol.records import UPDATE_KEY, record_to_arrays
from fedge.server import CompressionConfig, RobustConfig, RobustStreamingFedAvg
from fedge.server.similarity import duplicate_groups
from fedge.simulation.local_grid import LocalGrid

RNG = np.random.default_rng(11)
SIZE = 5_000
MODEL = {"w": RNG.normal(size=(50, 100)).astype(np.float32)}


def _sparse(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    indices = np.flatnonzero(dense)
    return indices.astype(np.int32), dense[indices].astype(np.float32)


def _topk(dense: np.ndarray, k: int = 200) -> np.ndarray:
    out = np.zeros_like(dense)
    chosen = np.argsort(np.abs(dense))[-k:]
    out[chosen] = dense[chosen]
    return out


def test_groups_link_near_equal_updates_and_leave_merely_similar_ones_apart():
    direction = RNG.normal(size=SIZE)
    honest = [_topk(direction + 0.3 * RNG.normal(size=SIZE)) for _ in range(5)]  # pairwise cosines ~0.9
    colluder = _topk(RNG.normal(size=SIZE))
    nudged = colluder + 0.002 * np.abs(colluder).max() * RNG.normal(size=SIZE) * (colluder != 0)
    updates = [*map(_sparse, honest), _sparse(colluder), _sparse(3.0 * colluder), _sparse(nudged)]
    updates.append((np.zeros(0, np.int32), np.zeros(0, np.float32)))  # an empty update matches nothing
    assert duplicate_groups(updates, 0.99) == [[5, 6, 7]]  # a scaled copy and a nudged one included
    assert duplicate_groups(updates, 1.5) == []  # off
    # Linking is transitive: a chain a ~ b ~ c is one group even where a and c are further apart.
    a = RNG.normal(size=SIZE)
    b = a + 0.1 * RNG.normal(size=SIZE)
    c = b + 0.1 * RNG.normal(size=SIZE)
    chain = [_sparse(x) for x in (a, b, c)]
    cos_ac = float(a @ c / np.linalg.norm(a) / np.linalg.norm(c))
    assert cos_ac < 0.993 and duplicate_groups(chain, 0.993) == [[0, 1, 2]]


def _aggregate(robust: RobustConfig, deltas: list[dict[str, np.ndarray]]):
    codec = build_codec("fp32")
    strategy = RobustStreamingFedAvg(CompressionConfig(codec.spec), robust=robust, min_available_nodes=9)
    messages = configured_train(strategy, MODEL, LocalGrid(ClientApp(), len(deltas)))
    replies = [
        Message(
            RecordDict(
                {
                    "metrics": MetricRecord({"num-examples": 10.0}),
                    UPDATE_KEY: ConfigRecord({"payload": codec.encode(delta), "base": 1}),
                }
            ),
            reply_to=message,
        )
        for message, delta in zip(messages, deltas, strict=True)
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    moved = record_to_arrays(arrays)[0]["w"] - MODEL["w"]
    return strategy, moved, [m.metadata.dst_node_id for m in messages]


def test_colluders_sending_one_update_weigh_as_one_client_and_are_all_counted():
    # Sparse uploads (top 10 %) of noisy clients: their supports differ, so a coordinate has a few
    # senders, as with top-k on a real fleet.
    direction = RNG.normal(size=SIZE)
    honest = [_topk(0.1 * (direction + 2.0 * RNG.normal(size=SIZE)), 500) for _ in range(6)]
    mean = np.mean(honest, axis=0)
    ipm = _topk(-0.5 * mean, 500)  # what three IPM colluders all send
    shape = MODEL["w"].shape
    deltas = [{"w": d.reshape(shape).astype(np.float32)} for d in [*honest, ipm, ipm, ipm]]
    screened, moved, nodes = _aggregate(RobustConfig(), deltas)
    unscreened, moved_without, _ = _aggregate(RobustConfig(max_similarity=2.0), deltas)
    assert screened.round_metrics(1)["duplicates"] == 2 and unscreened.round_metrics(1)["duplicates"] == 0
    # Every colluder was heard (counted), so all of their error-feedback states stay alike.
    assert screened.channel.counted == {node: 1 for node in nodes}
    # Three equal values among a coordinate's few senders drag its median their way; one does much less.
    progress = float(np.dot(moved.ravel(), mean))
    progress_without = float(np.dot(moved_without.ravel(), mean))
    assert progress > 1.5 * progress_without, (progress, progress_without)


def test_the_threshold_is_an_app_setting_that_reaches_the_strategy():
    settings = {"strategy": "sparse-median", "codec": "topk:0.01+int8"}
    assert build_strategy(AppConfig(**settings)).robust.max_similarity == 0.99
    off = AppConfig(**settings, max_similarity=2.0)
    assert build_strategy(off).robust.max_similarity == 2.0
    assert AppConfig.from_run_config(off.to_run_config()).max_similarity == 2.0
    with pytest.raises(ConfigError, match="max_similarity must be a number, got nan"):
        AppConfig(max_similarity=float("nan"))
