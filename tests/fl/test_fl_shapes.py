"""Compression holds on every model: 0-d and integer buffers travel, and nothing is sent bigger than dense.

Real runs (StreamingFedAvg + CompressionMod over the LocalGrid) of four models -- a tiny linear model, an
MLP with 2-element biases, a CNN with BatchNorm (int64 0-d ``num_batches_tracked``) and the digits CNN --
with five codecs. Every reply must be accepted, and upload and download payloads (and the upload messages)
must be no bigger than dense. The classes below are also the tasks the clients load (by file path).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from fedge.app.task import DigitsTask

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
CODECS = ("topk:0.01+int8", "topk:0.1+int8", "stc:0.01", "qsgd:4", "fp16")


class TinyLinear(DigitsTask):
    """Digits through one linear layer: 640 weights (under the policy's 1,024) and 10 biases."""

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


class TwoUnitMLP(DigitsTask):
    """An MLP with a 2-unit hidden layer: 2-element biases, every tensor small."""

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 2), nn.ReLU(), nn.Linear(2, 10))


MODELS = {
    "linear": f"{HERE}:TinyLinear",
    "mlp": f"{HERE}:TwoUnitMLP",
    "batchnorm": f"{ROOT / 'examples/tasks/batchnorm_cnn.py'}:BatchNormCNN",
    "digits": "fedge.app.task:DigitsTask",
}


def _model_state(task_path: str) -> dict[str, np.ndarray]:
    path, _, name = task_path.rpartition(":")
    if path.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_shapes_task_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    model = getattr(module, name)().model()
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


@functools.cache
def _dense_run(model: str) -> list[int]:
    """bytes_up per round of plain (dense) Flower FedAvg on this model."""
    from flwr.serverapp.strategy import FedAvg

    history = _run(model, FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3))
    return [r.bytes_up for r in history.rounds]


def _run(model: str, strategy, rounds: int = 2):
    from fl_helpers import reference_app

    from fedge.app.config import AppConfig
    from fedge.app.server_app import run_federated
    from fedge.client import CompressionMod
    from fedge.flower.compat import set_task_identity
    from fedge.simulation.local_grid import LocalGrid

    grid = LocalGrid(reference_app([CompressionMod()]), 3)
    set_task_identity(run_id=1)
    config = AppConfig(rounds=rounds, local_epochs=1, seed=0, min_nodes=3, task=MODELS[model])
    try:
        return run_federated(grid, config, [], strategy=strategy)
    finally:
        grid.shutdown()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_reply_is_accepted_and_no_payload_is_bigger_than_dense(model, codec):
    from fedge.compression import build_codec
    from fedge.server import CompressionConfig, DownlinkConfig, StreamingFedAvg

    state = _model_state(MODELS[model])
    dtypes = {name: str(array.dtype) for name, array in state.items()}
    rng = np.random.default_rng(0)
    noise = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in state.items()}
    dense_payload = len(build_codec("fp32").encode(noise, dtypes=dtypes))  # no zero records: the bound

    strategy = StreamingFedAvg(
        CompressionConfig(codec, downlink=DownlinkConfig(codec, full_model="fp32")),
        fraction_evaluate=0.0,
        min_available_nodes=3,
        min_train_nodes=3,
    )
    history = _run(model, strategy)
    dense_up = _dense_run(model)
    for rnd, dense_bytes_up in zip(history.rounds, dense_up, strict=True):
        extra = rnd.extra
        assert extra["accepted"] == rnd.clients_replied == 3 and extra["rejected"] == 0, extra
        assert extra["upload_payload_bytes"] <= 3 * dense_payload, (extra, dense_payload)
        downloads = extra["downloads_delta"] + extra["downloads_full"]
        assert downloads == 3
        assert extra["download_payload_bytes"] <= downloads * dense_payload, (extra, dense_payload)
        assert rnd.bytes_up <= dense_bytes_up, (rnd.bytes_up, dense_bytes_up)
    # BatchNorm's integer counter moved by the weighted average of the clients' exact batch counts (the
    # coordinator keeps it as a float, as dense FedAvg does, and rounds it in the ArrayRecord).
    if model == "batchnorm":
        counters = [v for k, v in strategy._model.items() if k.endswith("num_batches_tracked")]
        assert counters and all(float(c) > 1 for c in counters)
