"""The larger model of ``fedge bench split``: a chain the split module cuts exactly, and a fleet the planner
splits at two cuts by memory."""

from __future__ import annotations

import torch

from fedge.bench._split_large import MCU, MCU4, PI, LargeCNN
from fedge.split import MemoryConfig, as_chain, block_cuts, cut_gradient_max_abs_diff, plan_fleet


def test_large_cnn_is_a_chain_cut_exactly_at_every_block():
    torch.manual_seed(0)
    model = LargeCNN()
    assert sum(p.numel() for p in model.parameters()) == 590_154
    chain = as_chain(model)
    cuts = block_cuts(chain)
    assert cuts == [2, 5, 8, 10, 13]
    x, y = torch.rand(8, 1, 16, 16), torch.arange(8) % 10
    diffs = [cut_gradient_max_abs_diff(model, cut, x, y) for cut in cuts]
    diffs.append(cut_gradient_max_abs_diff(model, cuts[0], x, y, head_cut=len(chain) - 1))
    assert max(diffs) < 1e-5


def test_planner_gives_each_board_the_cut_its_memory_allows():
    torch.manual_seed(0)
    plans, memory = plan_fleet(
        LargeCNN(),
        torch.rand(1, 16, 16),
        [PI, MCU4, MCU],
        MemoryConfig(batch_size=16, cut_policy="least_traffic"),
    )
    assert [(p.mode, p.cut) for p in plans] == [("full", None), ("split", 8), ("split", 2)]
    assert memory["full"].total_bytes > 4 * 2**20 > memory["front@8"].total_bytes  # no board trains it all
    assert plans[2].required_bytes / memory["full"].total_bytes < 0.05
