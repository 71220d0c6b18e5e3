"""A reply whose update is zero (the model sent back untrained) is rejected as ``unchanged``: a free-rider
claims its examples for no work, and under a median its zeros drag the aggregate towards no step."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedge.app.config import AppConfig
from fedge.compression import Schema, build_codec
from fedge.protocol.records import UPDATE_KEY, arrays_to_record
from fedge.server.screening import Rejected, screen_dense_reply, screen_reply
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation

MODEL = {
    "w": np.random.default_rng(0).normal(size=(30, 20)).astype(np.float32),
    "running_var": np.ones(20, np.float32),
}
CODEC = "topk:0.1+int8"


def _compressed(update: dict[str, np.ndarray]):
    schema = Schema.of(build_codec(CODEC), MODEL)
    content = RecordDict(
        {
            UPDATE_KEY: ConfigRecord({"payload": build_codec(CODEC).encode(update), "base": 1}),
            "metrics": MetricRecord({"num-examples": 10}),
        }
    )
    shapes = {name: array.shape for name, array in MODEL.items()}
    return screen_reply(
        3,
        content,
        version=1,
        weighted_by_key="num-examples",
        shapes=shapes,
        schema=schema,
        statistics=frozenset({"running_var"}),
    )


def _dense(weights: dict[str, np.ndarray], measure_norm: bool = True):
    content = RecordDict(
        {"arrays": arrays_to_record(weights, {}), "metrics": MetricRecord({"num-examples": 10})}
    )
    return screen_dense_reply(
        content,
        model=MODEL,
        weighted_by_key="num-examples",
        measure_norm=measure_norm,
        statistics=frozenset({"running_var"}),
    )


def test_a_compressed_update_of_zero_is_rejected_as_unchanged():
    zero = {name: np.zeros_like(array) for name, array in MODEL.items()}
    with pytest.raises(Rejected, match="the model came back as it was sent") as info:
        _compressed(zero)
    assert info.value.reason == "unchanged"
    # statistics alone do not count as training: they move by what the client's data says
    with pytest.raises(Rejected, match="update is zero"):
        _compressed({**zero, "running_var": np.full(20, 0.5, np.float32)})
    moved = {**zero, "w": np.full((30, 20), 1e-3, np.float32)}
    assert _compressed(moved).norm > 0


def test_a_dense_reply_of_the_global_model_is_rejected_as_unchanged():
    with pytest.raises(Rejected) as info:
        _dense({name: array.copy() for name, array in MODEL.items()})
    assert info.value.reason == "unchanged"
    assert _dense({**MODEL, "w": MODEL["w"] + 0.01}).norm > 0
    # without the norm (max_norm_ratio = inf) nothing is measured, so nothing can be called unchanged
    assert _dense(dict(MODEL), measure_norm=False).norm == 0.0


def _run(**settings):
    app = AppConfig(rounds=3, alpha=0.5, seed=0, attack="free-ride", attackers=0.3, **settings)
    return run_simulation(SimulationConfig(clients=10, engine="local", workers=2, app=app))


@pytest.mark.parametrize(
    "settings", [{"strategy": "median"}, {"strategy": "sparse-median", "codec": "topk:0.1+int8"}]
)
def test_free_riders_are_rejected_every_round_and_the_others_aggregated(settings, caplog):
    caplog.set_level(logging.WARNING)
    history = _run(**settings).rounds
    assert [r.extra["rejected_unchanged"] for r in history] == [3, 3, 3]
    assert all(r.extra["accepted"] == 7 for r in history)
    assert "unchanged" in caplog.text
    assert history[-1].accuracy > history[0].accuracy
