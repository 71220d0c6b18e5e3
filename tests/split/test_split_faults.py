"""One misbehaving split device hurts only itself: the coordinator's stage refuses what it cannot step on
(damaged, mis-shaped or NaN activations, labels that do not match them, activations far above the cut's
scale), a device that stepped nothing is left out of the average, a full client's NaN update too, and an
averaged model whose loss is not finite is dropped. Before, any of these crashed the split coordinator (at
every restart) or averaged NaN into the model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from split_helpers import MCU, PI
from torch import nn

from fedge.compression import build_codec
from fedge.simulation.local_grid import LocalGrid
from fedge.split import CutConfig, SplitFedConfig
from fedge.split.app import client_app
from fedge.split.coordinator import SplitCoordinator
from fedge.split.cut import CutLink, encode_labels
from fedge.split.engine_config import SplitAppConfig
from fedge.split.step import ActivationScales, BackStage, BatchRejected
from fedge.split.updates import UpdateRejected, check_delta

FP32 = build_codec("fp32")


def _payload(array: np.ndarray) -> bytes:
    return FP32.encode({"activation": np.asarray(array, np.float32)})


def _stage() -> tuple[BackStage, nn.Module]:
    torch.manual_seed(0)
    back = nn.Sequential(nn.Linear(8, 3))
    return BackStage(back, torch.optim.SGD(back.parameters(), lr=0.1), scales=ActivationScales()), back


GOOD = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
LABELS = encode_labels(torch.tensor([0, 1, 2, 1]))


@pytest.mark.parametrize(
    ("activations", "labels", "reason"),
    [
        (b"\x00garbage", LABELS, "undecodable"),
        (b"", LABELS, "undecodable"),
        (_payload(np.zeros((4, 5))), LABELS, "cannot take these activations"),
        (_payload(np.zeros((8, 8))), LABELS, "4 labels for a batch of 8 rows"),
        (_payload(GOOD), LABELS[:-3], "not whole int64 values"),
        (_payload(GOOD), encode_labels(torch.tensor([0, 1, 2, 999])), "IndexError"),
        (_payload(np.full((4, 8), 3e38)), LABELS, "its loss is"),
    ],
)
def test_a_batch_the_stage_cannot_step_on_is_rejected_and_nothing_steps(activations, labels, reason):
    stage, back = _stage()
    before = [p.detach().clone() for p in back.parameters()]
    with pytest.raises(BatchRejected, match=reason):
        stage.step(activations, labels, CutLink(CutConfig()))
    assert all(torch.equal(a, b) for a, b in zip(before, back.parameters(), strict=True))
    stage.step(_payload(GOOD), LABELS, CutLink(CutConfig()))  # the stage goes on with the next batch
    assert not all(torch.equal(a, b) for a, b in zip(before, back.parameters(), strict=True))


def test_activations_far_above_the_cuts_scale_are_rejected_from_the_first_batch():
    stage, _ = _stage()
    stage.scales.expect(
        nn.Identity(), torch.from_numpy(GOOD)
    )  # the coordinator's own data, through the front
    with pytest.raises(BatchRejected, match="activations of scale"):
        stage.step(_payload(GOOD * 100), LABELS, CutLink(CutConfig()))
    stage.step(_payload(GOOD * 2), LABELS, CutLink(CutConfig()))  # honest batches vary a few times


def test_a_dense_update_of_nan_or_another_shape_is_rejected():
    shapes = {"w": torch.Size([2, 2])}
    assert check_delta({"w": torch.ones(2, 2)}, shapes)["w"].sum() == 4
    with pytest.raises(UpdateRejected, match="non-finite"):
        check_delta({"w": torch.full((2, 2), float("nan"))}, shapes)
    with pytest.raises(UpdateRejected, match="shape"):
        check_delta({"w": torch.ones(2)}, shapes)


@pytest.fixture
def grid():
    local = LocalGrid(client_app, 4, workers=2)
    yield local
    local.shutdown()


@pytest.mark.parametrize("mode", ["scale", "nan"])
def test_one_faulty_split_device_loses_only_its_own_batches(grid, mode, caplog):
    caplog.set_level(logging.WARNING)
    task = f"{Path(__file__).with_name('faulty_task.py')}:FaultyDigits"
    split = SplitFedConfig(rounds=2, batch_size=32, variant="v2")
    config = SplitAppConfig(
        task=task,
        task_args=json.dumps({"bad": 1, "mode": mode}),
        split=split,
        profiles=(PI, MCU, PI, MCU),
        min_nodes=4,
        max_attempts=2,
    )
    rounds = SplitCoordinator(grid, config).run()
    for record in rounds:
        assert record.trained == [0, 2, 3], record  # partition 1 stepped nothing: left out
        assert record.steps_by_partition["1"] == 0 and record.steps_by_partition["3"] > 0
        assert record.lost_batches > 0 and record.rolled_back == 0
        assert np.isfinite(record.loss)
    if mode == "scale":  # refused by the coordinator's stage; NaN by the device's own encoder
        assert all(record.rejected_batches > 0 for record in rounds)
        assert "activations of scale" in caplog.text
    assert "split client 1: no batch stepped this round; its front is left out" in caplog.text
    assert rounds[-1].accuracy > 0.2


@pytest.mark.parametrize("bad", [0, 1], ids=["split-client", "full-client"])
def test_simulate_split_leaves_out_a_device_of_nan_data_and_says_so(bad, tmp_path):
    """NaN from one device crashed ``fedge simulate --split`` (a split client) or was averaged into the
    model, which then sat at chance with exit 0 (a full client)."""
    from typer.testing import CliRunner

    from fedge.cli import app

    task = f"{Path(__file__).with_name('faulty_task.py')}:FaultyDigits"
    args = ["simulate", "--split", "--clients", "4", "--rounds", "2", "--task", task]
    args += ["--task-arg", f"bad={bad}", "--task-arg", 'mode="nan"', "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rounds = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert [r["left_out"] for r in rounds] == [[bad], [bad]]
    assert (bad in rounds[0]["full_clients"]) is (bad == 1)  # the default fleet: partition 1 trains full
    assert rounds[-1]["accuracy"] > 0.5
