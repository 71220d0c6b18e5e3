"""Who trains split is decided from device memory; a device too small for the model still learns."""

from __future__ import annotations

import copy
import dataclasses

import torch
from split_helpers import MCU, PI
from torch import nn

from fedge.devices.budget import can_train
from fedge.split import (
    BackStage,
    ClientPlan,
    CutLink,
    FrontStage,
    MemoryConfig,
    SplitFedConfig,
    SplitFedRun,
    as_chain,
    plan_fleet,
    split_chain,
)


def test_plans_follow_device_memory(model, digits) -> None:
    tiny = dataclasses.replace(MCU, compute=dataclasses.replace(MCU.compute, memory_bytes=20_000))
    plans, memory = plan_fleet(model, digits[0][0], [PI, MCU, tiny])
    assert [p.mode for p in plans] == ["full", "split", "none"]
    assert plans[1].cut == 2  # shallowest block cut: conv + ReLU
    assert plans[2].required_bytes == memory["front@2"].total_bytes > plans[2].device_bytes  # what it lacks
    assert not can_train(MCU.compute, memory["full"].total_bytes)
    assert can_train(MCU.compute, memory["front@2"].total_bytes)
    assert memory["front@2"].total_bytes / memory["full"].total_bytes <= 0.25
    # The deeper the front stage, the more memory it needs; the full model needs the most.
    fronts = [memory[f"front@{c}"].total_bytes for c in (2, 5, 8)]
    assert fronts == sorted(fronts) and fronts[-1] <= memory["full"].total_bytes


def test_least_traffic_policy_picks_the_smallest_cut_that_fits(model, digits) -> None:
    roomy = dataclasses.replace(MCU, compute=dataclasses.replace(MCU.compute, memory_bytes=2_000_000))
    config = MemoryConfig(cut_policy="least_traffic")
    plans, memory = plan_fleet(model, digits[0][0], [roomy], config)
    assert plans[0].mode == "split" and plans[0].cut == 5  # 512 values per sample; cut 8 does not fit
    assert memory["front@5"].output_values_per_sample < memory["front@2"].output_values_per_sample


def test_a_front_stage_trained_by_split_steps_lowers_the_loss(model, clients) -> None:
    """A model trained briefly, its first block then re-initialised: split steps alone (the coordinator's
    side frozen, so any gain is the front's own) bring the loss back down."""
    features, labels = clients[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(10):
        for start in range(0, len(labels), 16):
            optimizer.zero_grad()
            nn.functional.cross_entropy(
                model(features[start : start + 16]), labels[start : start + 16]
            ).backward()
            optimizer.step()
    front, back = split_chain(as_chain(model), 2)
    torch.manual_seed(1)
    front[0].reset_parameters()
    for p in back.parameters():
        p.requires_grad_(False)
    before = copy.deepcopy(front)
    link = CutLink()
    client = FrontStage(front, torch.optim.SGD(front.parameters(), lr=0.05, momentum=0.9), link)
    server = BackStage(back, None, mask_gradient=True)

    def loss_with(stage: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(back(stage(features)), labels))

    for epoch in range(5):
        for start in range(0, len(labels), 16):
            x, y = features[start : start + 16], labels[start : start + 16]
            grad, _ = server.step(client.forward(x, seed=epoch), client.label_payload(y), link)
            client.backward(grad)
    assert loss_with(front) < 0.7 * loss_with(before)
    assert link.up_bytes > 0 and link.down_bytes > 0


def test_a_client_below_full_model_memory_takes_part_in_the_fleet(model, clients) -> None:
    profiles = [PI, MCU, PI, MCU]
    plans, _ = plan_fleet(model, clients[0][0][0], profiles)
    assert [p.mode for p in plans] == ["full", "split", "full", "split"]
    test = (torch.cat([c[0] for c in clients]), torch.cat([c[1] for c in clients]))
    start = copy.deepcopy(model)
    run = SplitFedRun(model, clients, test, plans, profiles, SplitFedConfig(rounds=3, batch_size=16))
    history = run.run()
    assert all(r.cut_bytes > 0 and r.split_steps == 2 * 8 for r in history.rounds)  # 2 clients x 120/16
    assert history.rounds[-1].loss < history.rounds[0].loss
    assert not torch.equal(model.features[0].weight, start.features[0].weight)
    assert history.rounds[-1].clock_s > history.rounds[0].clock_s > 0


def test_a_chain_with_batchnorm1d_trains_split() -> None:
    """Counting a cut's FLOPs ran a batch of one through a BatchNorm1d in training mode, which refuses it:
    the run died before its first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    data = [(torch.randn(32, 6), torch.randint(0, 3, (32,))) for _ in range(2)]
    test = (torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data]))
    plans = [ClientPlan("full", None, 0, 0), ClientPlan("split", 3, 0, 0)]
    run = SplitFedRun(model, data, test, plans, [PI, PI], SplitFedConfig(rounds=2, batch_size=8))
    history = run.run()
    assert [r.split_steps for r in history.rounds] == [4, 4]
    front, middle, _ = run.flops(3)
    assert front.forward > 0 and middle.forward > 0
