"""The tensors at the cut: codec round trips within their error, the lossless mask, error feedback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedge.split import SPARSE_NONZERO, CutCodec, sparse_gradient
from fedge.split.cut import decode_labels, decode_tensor, encode_labels


@pytest.fixture
def activation() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.relu(torch.randn(32, 16, 8, 8))


@pytest.mark.parametrize(
    ("spec", "bound", "min_ratio"),
    [("fp32", 0.0, 0.99), ("fp16", 1e-3, 1.99), ("int8", 1 / 127, 3.9), (SPARSE_NONZERO, 1 / 127, 6.0)],
)
def test_cut_codecs_round_trip_within_their_error(activation, spec, bound, min_ratio) -> None:
    codec = CutCodec(spec)
    payload = codec.encode(activation)
    decoded = decode_tensor(payload).reshape(activation.shape)
    # fp16: relative error 2**-11; int8: half a step of each block's max / 127 (bounded by the global max).
    error = (decoded - activation).abs().max()
    assert float(error) <= bound * float(activation.abs().max()) + 1e-7
    assert codec.dense_bytes / codec.sent_bytes >= min_ratio
    if spec == SPARSE_NONZERO:
        assert bool((decoded[activation == 0] == 0).all())  # zeros are not sent and stay exactly zero


def test_masking_the_cut_gradient_behind_a_relu_is_lossless() -> None:
    torch.manual_seed(0)
    front = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
    x = torch.randn(8, 1, 8, 8)
    upstream = torch.randn(8, 4, 8, 8)
    grads = []
    for masked in (False, True):
        front.zero_grad()
        out = front(x)
        out.backward(sparse_gradient(upstream, out.detach()) if masked else upstream)
        grads.append(front[0].weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
    assert float((sparse_gradient(upstream, front(x).detach()) == 0).float().mean()) > 0.3


def test_error_feedback_delays_what_top_k_leaves_out() -> None:
    """Sum of what was sent plus the residual equals the sum of the inputs."""
    codec = CutCodec("topk:0.1+fp32", error_feedback=True)
    rng = np.random.default_rng(0)
    inputs = [torch.from_numpy(rng.standard_normal((8, 64)).astype(np.float32)) for _ in range(5)]
    sent = sum(decode_tensor(codec.encode(t, seed=i)).reshape(8, 64) for i, t in enumerate(inputs))
    residual = torch.from_numpy(codec.state["ef/residual/cut"])
    torch.testing.assert_close(sent + residual, sum(inputs), atol=1e-5, rtol=1e-5)
    codec.encode(torch.ones(3, 64))  # a short last batch starts its residual afresh
    assert codec.state["ef/residual/cut"].shape == (3, 64)


def test_labels_round_trip() -> None:
    labels = torch.tensor([0, 9, 3, 3, 7])
    assert torch.equal(decode_labels(encode_labels(labels)), labels)
