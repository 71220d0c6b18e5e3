"""The split engine's U-shaped variant, compressed updates and simulated clock, on fedge's local engine,
held to the in-process driver.

Tolerance of the driver comparisons: 1e-5 (as in ``test_split_engines``). The two compute every step with
the same seeds, batches, values and arithmetic (on this machine the models come out bit for bit equal), but
the engine's clients run in worker threads whose torch kernels may use another thread count than the test's
(a different reduction order, so different rounding), and two rounds of momentum SGD amplify rounding by a few
orders of magnitude. A wrong step is far larger: a front handed on as ``start + delta`` instead of itself
(one ulp per weight) moved the weights by 8e-4 in two rounds, and a U-shaped head stepped twice fails too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from split_helpers import MCU, PI

from fedge.app.task import DigitsTask
from fedge.compression import build_codec
from fedge.simulation.local_grid import LocalGrid
from fedge.split import SPARSE_NONZERO, CutConfig, SplitFedConfig, SplitFedRun, plan_fleet
from fedge.split.app import client_app
from fedge.split.config import SplitHistory
from fedge.split.coordinator import SplitCoordinator
from fedge.split.engine_config import EngineRound, SplitAppConfig
from fedge.split.updates import UPDATE_EF_KEY, UpdateRejected, decode_update

PROFILES = (PI, MCU, PI, MCU)  # two full-model clients, two that the planner splits after the first block
TOLERANCE = 1e-5


def _driver(split: SplitFedConfig) -> tuple[dict[str, torch.Tensor], SplitHistory]:
    """The in-process driver's global model and history for the same fleet, data and seeds."""
    task = DigitsTask()
    task.prepare(4, alpha=0.5, seed=split.seed)
    data = [task.load_partition(i, 4, alpha=0.5, seed=split.seed) for i in range(4)]
    torch.manual_seed(0)
    model = task.model()
    plans, _ = plan_fleet(model, data[0][0][0], list(PROFILES))
    history = SplitFedRun(
        model, data, task.test_set(4, alpha=0.5, seed=0), plans, list(PROFILES), split
    ).run()
    return model.state_dict(), history


def _engine(grid, split: SplitFedConfig, **settings) -> tuple[SplitCoordinator, list[EngineRound]]:
    coordinator = SplitCoordinator(
        grid, SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4, **settings)
    )
    return coordinator, coordinator.run()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture
def grid():
    local = LocalGrid(client_app, 4, workers=2)
    yield local
    local.shutdown()


class _LossyGrid:
    """The local Grid, but at the given split exchanges the first split client's request never arrives
    or its reply (after the client acted on the request) is lost."""

    def __init__(self, grid: LocalGrid, drops: dict[int, str]) -> None:
        self.grid, self.drops, self.calls = grid, dict(drops), 0

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        split = [m for m in messages if m.metadata.message_type == "train.split_step"]
        drop = self.drops.pop(self.calls, None) if split else None
        self.calls += bool(split)
        victim = split[0].metadata.dst_node_id if drop else None
        sent = [m for m in messages if not (drop == "request" and m.metadata.dst_node_id == victim)]
        replies = list(self.grid.send_and_receive(sent, timeout=timeout))
        return [r for r in replies if not (drop == "reply" and r.metadata.src_node_id == victim)]


# ------------------------------------------------------------------------------------------ U-shaped
def test_u_shaped_rounds_train_as_the_driver_does_and_keep_the_labels_home(grid) -> None:
    split = SplitFedConfig(rounds=2, batch_size=16, variant="v1", u_shaped=True)
    coordinator, rounds = _engine(grid, split)
    state, history = _driver(split)
    assert all(r.trained == [0, 1, 2, 3] and r.lost_batches == 0 and r.split_steps > 0 for r in rounds)
    assert all(r.label_bytes == 0 for r in rounds)  # the labels never left the devices
    assert rounds[1].loss < rounds[0].loss
    assert _max_diff(coordinator.model.state_dict(), state) <= TOLERANCE
    # The same payloads crossed the cut (activations up, the server's output down, both gradients) and
    # the clock charged them as the driver does.
    for engine, driver in zip(rounds, history.rounds, strict=True):
        assert (engine.cut_bytes, engine.cut_dense_bytes) == (driver.cut_bytes, driver.cut_dense_bytes)
        assert engine.update_bytes == driver.update_bytes
        assert engine.round_s == pytest.approx(driver.round_s, rel=1e-9)
    assert rounds[1].clock_s == pytest.approx(history.rounds[1].clock_s, rel=1e-9)


def test_u_shaped_drops_cost_no_batch_and_no_step_is_applied_twice(grid) -> None:
    """Lost head requests and replies (the client stepped its head, the coordinator never heard) and lost
    activation replies: asked again, the client answers from its Context without stepping again, so the
    run ends where the undisturbed driver does."""
    split = SplitFedConfig(rounds=1, batch_size=16, variant="v1", u_shaped=True)
    # Exchanges 0, 1: batch 0's activations, then its head. 1 and 7 lose a head's reply, 4 and 10 a head's
    # request, 12 an activation reply (the gradient before it was applied).
    lossy = _LossyGrid(grid, {1: "reply", 4: "request", 7: "reply", 10: "request", 12: "reply"})
    config = SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4, step_timeout_s=30.0)
    coordinator = SplitCoordinator(lossy, config)  # type: ignore[arg-type]
    rounds = coordinator.run()
    assert not lossy.drops and rounds[0].retries == 5 and rounds[0].lost_batches == 0
    assert _max_diff(coordinator.model.state_dict(), _driver(split)[0]) <= TOLERANCE


def test_a_u_shaped_head_that_cannot_answer_costs_its_batch(grid) -> None:
    """A head request the client never gets, ``max_attempts`` times: the batch is given up, the round goes
    on and the client still hands in its front and head."""
    split = SplitFedConfig(rounds=1, batch_size=16, variant="v2", u_shaped=True)
    lossy = _LossyGrid(grid, {1: "request", 2: "request"})
    config = SplitAppConfig(split=split, profiles=PROFILES, min_nodes=4, max_attempts=2)
    coordinator = SplitCoordinator(lossy, config)  # type: ignore[arg-type]
    rounds = coordinator.run()
    assert rounds[0].lost_batches == 1 and rounds[0].trained == [0, 1, 2, 3]
    batches = {str(n.partition): -(-n.examples // 16) for n in coordinator.nodes.values()}
    assert rounds[0].steps_by_partition == {"1": batches["1"] - 1, "3": batches["3"]}


# ---------------------------------------------------------------------------------------- update codec
def test_a_lossless_update_codec_changes_nothing_but_the_wire(grid) -> None:
    """fp32 through the codec path (encode with error feedback at home, decode with caps): the driver's
    model, with the driver's update bytes and clock."""
    split = SplitFedConfig(rounds=2, batch_size=16, variant="v1", update_codec="fp32")
    coordinator, rounds = _engine(grid, split)
    state, history = _driver(split)
    assert all(r.trained == [0, 1, 2, 3] for r in rounds)
    assert _max_diff(coordinator.model.state_dict(), state) <= TOLERANCE
    for engine, driver in zip(rounds, history.rounds, strict=True):
        assert engine.update_bytes == driver.update_bytes
        assert engine.round_s == pytest.approx(driver.round_s, rel=1e-9)


def test_a_compressed_update_codec_sends_fewer_bytes_and_the_model_still_learns(grid) -> None:
    split = SplitFedConfig(rounds=3, batch_size=16, variant="v2")
    _, dense = _engine(grid, split)
    packed_split = SplitFedConfig(rounds=3, batch_size=16, variant="v2", update_codec="topk:0.1+int8")
    coordinator, packed = _engine(grid, packed_split)
    assert all(r.trained == [0, 1, 2, 3] for r in packed)
    for d, p in zip(dense, packed, strict=True):
        assert p.update_bytes * 10 < d.update_bytes  # a tenth of the values, a byte each
    assert packed[2].loss < packed[0].loss and packed[2].accuracy > packed[0].accuracy
    # Every node keeps its error feedback in its Context for the next round: the residual of each tensor
    # it sends (a split client: its front's; small tensors travel dense, so theirs stay zero), and what
    # top-k left out of the full models.
    for context in grid.contexts.values():
        residual = {k: v.numpy() for k, v in context.state[UPDATE_EF_KEY].items()}
        if int(context.node_config["partition-id"]) in (0, 2):
            assert len(residual) == len(coordinator.model.state_dict())
            assert any(np.abs(v).sum() > 0 for v in residual.values())
        else:
            assert set(residual) == {f"ef/residual/features.0.{k}" for k in ("weight", "bias")}


def test_update_payloads_are_decoded_with_caps() -> None:
    shapes = {"w": torch.Size([4, 3]), "b": torch.Size([4])}
    codec = build_codec("fp32")
    good = {"w": np.ones((4, 3), np.float32), "b": np.zeros(4, np.float32)}
    assert decode_update(codec.encode(good), shapes)["w"].shape == (4, 3)
    bad = {
        "an extra tensor": {**good, "x": np.ones(2, np.float32)},
        "a missing tensor": {"w": good["w"]},
        "another shape": {"w": np.ones((3, 4), np.float32), "b": good["b"]},
        "more elements than the stage holds": {"w": np.ones((40, 30), np.float32), "b": good["b"]},
    }
    for arrays in bad.values():
        with pytest.raises(UpdateRejected):
            decode_update(codec.encode(arrays), shapes)
    with pytest.raises(UpdateRejected):
        decode_update(b"\x00garbage", shapes)


# --------------------------------------------------------------------------------------------- clock
def test_the_clock_charges_the_bytes_each_exchange_carried(grid) -> None:
    """A compressed cut carries fewer bytes over the same links: less simulated time; the run's clock is
    the sum of its rounds."""
    dense_split = SplitFedConfig(rounds=2, batch_size=16, variant="v2")
    _, dense = _engine(grid, dense_split)
    packed_split = SplitFedConfig(
        rounds=2, batch_size=16, variant="v2", cut=CutConfig(SPARSE_NONZERO, SPARSE_NONZERO)
    )
    _, packed = _engine(grid, packed_split)
    for d, p in zip(dense, packed, strict=True):
        assert d.cut_dense_bytes == p.cut_dense_bytes and p.cut_bytes * 3 < d.cut_bytes
        assert 0 < p.round_s < d.round_s
    assert dense[1].clock_s == pytest.approx(dense[0].round_s + dense[1].round_s)


# ------------------------------------------------------------------------------------------ sequential
@pytest.mark.parametrize("u_shaped", [False, True], ids=["plain", "u-shaped"])
def test_sequential_split_learning_hands_the_front_on_as_the_driver_does(grid, u_shaped) -> None:
    """One split client at a time, each starting from the front the previous one handed in, one shared
    server-side model: the driver's model, and its clock (the turns add up)."""
    split = SplitFedConfig(rounds=2, batch_size=16, variant="v1", parallel=False, u_shaped=u_shaped)
    coordinator, rounds = _engine(grid, split)
    state, history = _driver(split)
    assert all(r.trained == [0, 1, 2, 3] and r.lost_batches == 0 for r in rounds)
    assert _max_diff(coordinator.model.state_dict(), state) <= TOLERANCE
    for engine, driver in zip(rounds, history.rounds, strict=True):
        assert engine.round_s == pytest.approx(driver.round_s, rel=1e-9)
    parallel = SplitCoordinator(
        grid, SplitAppConfig(split=SplitFedConfig(rounds=1, batch_size=16, variant="v2"), profiles=PROFILES)
    ).run()
    assert rounds[0].round_s > parallel[0].round_s  # the turns add up


def test_sequential_updates_through_the_codec_are_relative_to_the_front_handed_on(grid) -> None:
    """With ``update_codec`` each client encodes its update from the front it was given (the previous
    client's), and the coordinator adds it back onto that: one round (no amplification) ends at the driver's
    model to float rounding."""
    split = SplitFedConfig(rounds=1, batch_size=16, variant="v1", parallel=False, update_codec="fp32")
    coordinator, rounds = _engine(grid, split)
    assert rounds[0].trained == [0, 1, 2, 3]
    assert _max_diff(coordinator.model.state_dict(), _driver(split)[0]) <= TOLERANCE
