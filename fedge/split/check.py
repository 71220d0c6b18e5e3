"""Does a split step compute what unsplit autograd computes? (the ``cut_gradient_max_abs_diff`` check)"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedge.app.seeding import seeded
from fedge.split.cut import CutConfig, CutLink
from fedge.split.model import as_chain
from fedge.split.step import _BACK, _FRONT, _HEAD, BackStage, FrontStage  # _*: the step's random streams

__all__ = ["cut_gradient_max_abs_diff", "split_gradients"]


def split_gradients(
    model: nn.Module,
    cut: int,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    head_cut: int | None = None,
    config: CutConfig | None = None,
) -> dict[str, torch.Tensor]:
    """The parameter gradients of one split step on a copy of ``model``, by ``model``'s parameter names.

    Parameters
    ----------
    model : nn.Module
        A chain model (see :func:`fedge.split.model.as_chain`); left untouched.
    cut : int
        Layers ``[0, cut)`` on the client.
    features, labels : torch.Tensor
        One batch.
    head_cut : int or None (default: None)
        U-shaped: layers ``[head_cut, n)`` are the client's head, ``[cut, head_cut)`` the server's.
    config : CutConfig or None (default: None)
        How the cut tensors travel (fp32, lossless, when None).
    """
    twin = copy.deepcopy(model)
    chain = as_chain(twin)
    layers = list(chain)
    link = CutLink(config or CutConfig())
    front = nn.Sequential(*layers[:cut])
    end = len(layers) if head_cut is None else head_cut
    server = BackStage(nn.Sequential(*layers[cut:end]), None, mask_gradient=False)
    if head_cut is None:
        client = FrontStage(front, None, link)
        grad, _ = server.step(client.forward(features), client.label_payload(labels), link)
    else:
        client = FrontStage(front, None, link, head=nn.Sequential(*layers[head_cut:]))
        middle = server.forward(client.forward(features), link)
        grad_up, _ = client.head_step(middle, labels)
        grad = server.backward(grad_up, link)
    client.backward(grad)
    return {name: p.grad.detach().clone() for name, p in twin.named_parameters() if p.grad is not None}


def cut_gradient_max_abs_diff(
    model: nn.Module,
    cut: int,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    head_cut: int | None = None,
) -> float:
    """Largest absolute difference between any parameter gradient of a split step (fp32 cut) and of one
    unsplit cross-entropy ``loss.backward()`` on the same batch; every parameter needs a gradient both ways.

    The unsplit forward draws each part's randomness (dropout) from the stream the split step gives that
    part, so both apply the same masks and a model with dropout is held to the same bound as one without.
    """
    reference = copy.deepcopy(model)
    layers = list(as_chain(reference))
    end = len(layers) if head_cut is None else head_cut
    with seeded(0, _FRONT):  # the seed split_gradients' steps are given
        activation = nn.Sequential(*layers[:cut])(features)
    with seeded(0, _BACK):
        output = nn.Sequential(*layers[cut:end])(activation)
    if head_cut is not None:
        with seeded(0, _HEAD):
            output = nn.Sequential(*layers[head_cut:])(output)
    nn.functional.cross_entropy(output, labels).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    got = split_gradients(model, cut, features, labels, head_cut=head_cut)
    if set(got) != set(expected):
        raise AssertionError(f"parameters without a split gradient: {sorted(set(expected) - set(got))}")
    return max(float((got[name] - expected[name]).abs().max()) for name in expected)
