"""One split step computes the gradients unsplit autograd computes (``cut_gradient_max_abs_diff``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedge.split import (
    BackStage,
    CutConfig,
    CutLink,
    FrontStage,
    as_chain,
    block_cuts,
    cut_gradient_max_abs_diff,
    split_chain,
    split_gradients,
)


def test_every_block_cut_of_the_digits_cnn_matches_autograd(model, digits) -> None:
    features, labels = digits[0][:32], digits[1][:32]
    cuts = block_cuts(as_chain(model))
    assert cuts == [2, 5, 8]
    for cut in cuts:
        assert cut_gradient_max_abs_diff(model, cut, features, labels) <= 1e-5


def test_u_shaped_step_matches_autograd(model, digits) -> None:
    features, labels = digits[0][:32], digits[1][:32]
    assert cut_gradient_max_abs_diff(model, 2, features, labels, head_cut=8) <= 1e-5


def test_a_plain_sequential_mlp_matches_autograd() -> None:
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    for cut in (1, 2, 3, 4):
        assert cut_gradient_max_abs_diff(mlp, cut, x, y) <= 1e-5


def test_a_lossy_cut_changes_the_gradients_and_the_check_notices(model, digits) -> None:
    """The comparison is not vacuous: an int8 cut moves every front gradient a little."""
    features, labels = digits[0][:32], digits[1][:32]
    exact = split_gradients(model, 2, features, labels)
    lossy = split_gradients(model, 2, features, labels, config=CutConfig("int8", "int8"))
    diff = (exact["features.0.weight"] - lossy["features.0.weight"]).abs().max()
    assert 0 < float(diff) < 0.1 * float(exact["features.0.weight"].abs().max())


def test_a_model_that_is_not_a_chain_is_refused() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.layer(x)

    with pytest.raises(ValueError, match="not a chain"):
        as_chain(Residual())


def test_a_client_that_lost_its_forward_recomputes_it(model, digits) -> None:
    """A batch whose pending forward is gone (a restarted client) is recomputed from the features."""
    features, labels = digits[0][:32], digits[1][:32]
    link = CutLink()
    front, back = split_chain(as_chain(model), 2)
    client, server = FrontStage(front, None, link), BackStage(back, None)
    grad, _ = server.step(client.forward(features), client.label_payload(labels), link)
    client.discard()
    with pytest.raises(RuntimeError, match="no pending forward"):
        client.backward(grad)
    client.backward(grad, features=features)
    expected = split_gradients(model, 2, features, labels)["features.0.weight"]
    assert float((front[0].weight.grad - expected).abs().max()) <= 1e-6


def test_a_stage_beginning_with_an_in_place_layer_matches_autograd() -> None:
    """The server stage (or the U-shaped head) starting with ``inplace=True`` raised autograd's "a leaf
    Variable that requires grad is being used in an in-place operation"."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.MaxPool2d(2),
        nn.LeakyReLU(0.1, inplace=True),
        nn.Flatten(),
        nn.Linear(36, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 3),
    )
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    assert block_cuts(as_chain(model))[0] == 2
    for cut in (2, 5):
        assert cut_gradient_max_abs_diff(model, cut, x, y) <= 1e-6
    assert cut_gradient_max_abs_diff(model, 2, x, y, head_cut=5) <= 1e-6


def test_a_model_with_dropout_matches_autograd_drawn_from_the_steps_streams() -> None:
    """The check's unsplit forward drew other masks than the split step: 0.2-0.3 on a correct split."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 16), nn.Dropout(0.5))
    model.append(nn.Linear(16, 3))
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    for cut in (1, 2, 3, 4):
        assert cut_gradient_max_abs_diff(model, cut, x, y) <= 1e-6
    assert cut_gradient_max_abs_diff(model, 2, x, y, head_cut=4) <= 1e-6
