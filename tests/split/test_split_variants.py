"""SplitFed V1 (server-side model per client) and V2 (one shared), U-shaped, sequential split learning."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from split_helpers import MCU, PI

from fedge.split import SPARSE_NONZERO, CutConfig, SplitFedConfig, SplitFedRun, plan_fleet


def _run(model, clients, profiles, **settings):
    test = (torch.cat([c[0] for c in clients]), torch.cat([c[1] for c in clients]))
    plans, _ = plan_fleet(model, clients[0][0][0], profiles)
    config = SplitFedConfig(**{"rounds": 1, "batch_size": 16, **settings})
    history = SplitFedRun(model, clients, test, plans, profiles, config).run()
    return model.state_dict(), history


def _max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_v1_with_an_fp32_cut_is_fedavg(model, clients) -> None:
    """A split client's step with its own server-side model is the step of its full-model twin."""
    fedavg, _ = _run(copy.deepcopy(model), clients, [PI] * 4)
    v1, history = _run(copy.deepcopy(model), clients, [PI, MCU, PI, MCU], variant="v1")
    assert history.rounds[0].split_steps > 0
    assert _max_diff(fedavg, v1) <= 1e-5


def test_v2_shares_one_server_side_model(model, clients) -> None:
    """Shared: the server-side layers see every split client's batches in turn, so V2 departs from V1;
    with a single split client there is nothing to share and the two agree."""
    mixed = [PI, MCU, PI, MCU]
    v1, _ = _run(copy.deepcopy(model), clients, mixed, variant="v1")
    v2, _ = _run(copy.deepcopy(model), clients, mixed, variant="v2")
    assert _max_diff(v1, v2) > 1e-3
    assert _max_diff(v1, _run(copy.deepcopy(model), clients, mixed, variant="v2")[0]) > 1e-3
    one = [PI, MCU, PI, PI]
    v1_one, _ = _run(copy.deepcopy(model), clients, one, variant="v1")
    v2_one, _ = _run(copy.deepcopy(model), clients, one, variant="v2")
    assert _max_diff(v1_one, v2_one) <= 1e-5


def test_v2_runs_repeat_exactly(model, clients) -> None:
    mixed = [PI, MCU, PI, MCU]
    first, _ = _run(copy.deepcopy(model), clients, mixed, variant="v2", cut=CutConfig(SPARSE_NONZERO, "int8"))
    second, _ = _run(
        copy.deepcopy(model), clients, mixed, variant="v2", cut=CutConfig(SPARSE_NONZERO, "int8")
    )
    assert _max_diff(first, second) == 0.0


def test_u_shaped_keeps_the_labels_at_home(model, clients) -> None:
    _, plain = _run(copy.deepcopy(model), clients, [MCU] * 4)
    state, u = _run(copy.deepcopy(model), clients, [MCU] * 4, u_shaped=True)
    assert plain.rounds[0].label_bytes > 0 and u.rounds[0].label_bytes == 0
    assert u.rounds[0].cut_bytes > plain.rounds[0].cut_bytes  # the server's output and its gradient too
    assert not torch.equal(state["classifier.3.weight"], model.state_dict()["classifier.3.weight"])


def test_compressed_cut_sends_fewer_bytes(model, clients) -> None:
    _, dense = _run(copy.deepcopy(model), clients, [MCU] * 4)
    _, packed = _run(copy.deepcopy(model), clients, [MCU] * 4, cut=CutConfig(SPARSE_NONZERO, SPARSE_NONZERO))
    assert dense.rounds[0].cut_dense_bytes == packed.rounds[0].cut_dense_bytes
    assert packed.rounds[0].cut_bytes * 5 < dense.rounds[0].cut_bytes
    assert packed.rounds[0].round_s < dense.rounds[0].round_s  # the clock charges the bytes


def test_sequential_split_learning_is_slower_on_the_clock(model, clients) -> None:
    _, parallel = _run(copy.deepcopy(model), clients, [MCU] * 4, parallel=True)
    _, sequential = _run(copy.deepcopy(model), clients, [MCU] * 4, parallel=False)
    assert sequential.rounds[0].round_s > 3 * parallel.rounds[0].round_s


def test_sequential_split_learning_refuses_clients_at_different_cuts(model, clients) -> None:
    plans, _ = plan_fleet(model, clients[0][0][0], [MCU] * 4)
    mixed = [dataclasses.replace(plan, cut=plan.cut + (i % 2)) for i, plan in enumerate(plans)]
    test = clients[0]
    with pytest.raises(ValueError, match="one cut for all split clients"):
        SplitFedRun(model, clients, test, mixed, [MCU] * 4, SplitFedConfig(parallel=False))
    SplitFedRun(model, clients, test, mixed, [MCU] * 4, SplitFedConfig(parallel=True))  # parallel is fine
