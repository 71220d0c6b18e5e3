"""Cutting a model into stages: the chain of layers, where blocks end, and the front and back at a cut.

Split training needs a model as a chain of layers, so a cut index ``c`` means "layers ``[0, c)`` run on the
client, ``[c, n)`` on the coordinator". :func:`as_chain` flattens nested :class:`torch.nn.Sequential`
containers (the digits CNN is ``features`` then ``classifier``) into one chain whose parameters are the
model's own tensors, so a state dict of the chain maps one to one onto the model's. A cut that follows a
non-linearity or a pooling layer ends a *block* (:func:`block_cuts`): the natural places to split.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from fedge.config import error_line

__all__ = [
    "as_chain",
    "block_cuts",
    "chain_names",
    "check_chain",
    "ends_in_relu",
    "segment",
    "split_chain",
    "stage_key_maps",
]

_BLOCK_ENDS = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.MaxPool2d, nn.AvgPool2d)


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every child in order, a module placed twice included (``named_children`` yields an instance once,
    so ``nn.Sequential(linear, act, linear2, act)`` would lose its second ``act``)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def _leaves(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    if isinstance(module, nn.Sequential):
        for name, child in _children(module):
            yield from _leaves(child, f"{prefix}{name}.")
        return
    children = _children(module)
    if children and all(isinstance(c, nn.Sequential) for _, c in children) and _forward_is_chain(module):
        for name, child in children:
            yield from _leaves(child, f"{prefix}{name}.")
        return
    yield prefix.rstrip("."), module


def _forward_is_chain(module: nn.Module) -> bool:
    """Whether a container of Sequentials runs them one after the other (declares ``split_chain = True``,
    or is the reference digits CNN, whose forward is ``classifier(features(x))``)."""
    return bool(getattr(module, "split_chain", False)) or type(module).__name__ == "DigitsCNN"


def chain_names(model: nn.Module) -> list[str]:
    """The dotted name in ``model`` of every layer of its chain (see :func:`as_chain`)."""
    return [name for name, _ in _leaves(model, "")]


def as_chain(model: nn.Module) -> nn.Sequential:
    """``model`` as one flat ``nn.Sequential`` sharing its layers (and so its parameters).

    Parameters
    ----------
    model : nn.Module
        An ``nn.Sequential`` (nested ones are flattened), or a module whose children are all
        ``nn.Sequential`` run in order: the digits CNN, or any module with ``split_chain = True``.

    Raises
    ------
    ValueError
        For a module that is not a chain of layers (its forward may do anything).
    """
    leaves = list(_leaves(model, ""))
    if len(leaves) == 1 and leaves[0][1] is model and not isinstance(model, nn.Sequential):
        raise ValueError(
            f"{type(model).__name__} is not a chain of layers: make it an nn.Sequential, or a module of "
            "nn.Sequential children run in order with split_chain = True"
        )
    return nn.Sequential(*(module for _, module in leaves))


def block_cuts(chain: nn.Sequential) -> list[int]:
    """Cut indices that end a block: after each non-linearity or pooling layer, last layer excluded.

    A run of block-ending layers (ReLU then pooling) counts once, at its end.
    """
    cuts = []
    for i, layer in enumerate(chain):
        if i + 1 >= len(chain):
            break
        if isinstance(layer, _BLOCK_ENDS) and not isinstance(chain[i + 1], _BLOCK_ENDS):
            cuts.append(i + 1)
    return cuts


def ends_in_relu(front: nn.Sequential) -> bool:
    """Whether the front's output is a ReLU's (possibly max-pooled): then a zero activation has a zero
    derivative, and the gradient at the cut may be sent only where the activation is nonzero, losslessly."""
    layers = list(front)
    while layers and isinstance(layers[-1], nn.MaxPool2d):
        layers.pop()
    return bool(layers) and isinstance(layers[-1], nn.ReLU)


def segment(chain: nn.Sequential, start: int, end: int | None = None) -> nn.Sequential:
    """Layers ``[start, end)`` of ``chain`` (shared, not copied), numbered from 0 as a stage's state dict
    is (slicing an ``nn.Sequential`` keeps the original numbers)."""
    return nn.Sequential(*list(chain)[start:end])


def check_chain(model: nn.Module, example: torch.Tensor, *, atol: float = 1e-4) -> None:
    """Raise ValueError unless ``as_chain(model)`` computes what ``model`` does on ``example`` (a batch).

    ``split_chain = True`` is the model's promise that its Sequentials run one after the other; a forward
    with a skip connection or an extra operation breaks it, and split training would then silently train
    another model than the one evaluated (0.43 apart on one such model). Forward passes keep the promise
    honest: in eval mode, and in train mode with the same random draws for both (an operation only
    training does, such as a dropout between the Sequentials, shows only there). The model's mode and its
    buffers (BatchNorm's running statistics, which a train-mode pass updates) are restored.
    """
    training = model.training
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        with torch.no_grad():
            for mode in (False, True):
                model.train(mode)
                _compare(model, example, atol, "" if not mode else " in train mode")
    finally:
        model.train(training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _compare(model: nn.Module, example: torch.Tensor, atol: float, mode: str) -> None:
    """One forward of the model and of its chain, with the same random draws; ValueError if they differ."""
    with torch.random.fork_rng(devices=[]):
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        torch.manual_seed(seed)
        try:
            whole = model(example)
        except Exception as err:
            raise ValueError(f"its forward raised {type(err).__name__}: {error_line(err)}") from None
        torch.manual_seed(seed)
        try:
            chained = as_chain(model)(example)
        except Exception as err:  # the layers do not even fit one after the other (an LSTM's tuple)
            raise ValueError(
                f"its chain of layers does not run one after the other ({type(err).__name__}: "
                f"{error_line(err)})"
            ) from None
    tensors = isinstance(whole, torch.Tensor) and isinstance(chained, torch.Tensor)
    if not tensors or whole.shape != chained.shape:
        raise ValueError(f"the model's forward does not return what its chain of layers does{mode}")
    gap = float((whole - chained).abs().max()) if whole.numel() else 0.0
    if not gap <= atol:
        raise ValueError(
            f"the model's forward differs from its chain of layers by {gap:.3g}{mode}: a forward with skips "
            "or extra operations cannot be split (set split_chain only when its Sequentials run in order)"
        )


def split_chain(
    chain: nn.Sequential, cut: int, *, copy_layers: bool = True
) -> tuple[nn.Sequential, nn.Sequential]:
    """The front ``chain[:cut]`` and the back ``chain[cut:]``.

    Parameters
    ----------
    chain : nn.Sequential
        From :func:`as_chain`.
    cut : int
        ``1 <= cut < len(chain)``.
    copy_layers : bool (default: True)
        Deep-copy the stages, so training them leaves ``chain`` alone; False shares its layers.
    """
    if not 1 <= cut < len(chain):
        raise ValueError(f"cut must be in 1..{len(chain) - 1}, got {cut}")
    front, back = segment(chain, 0, cut), segment(chain, cut)
    if copy_layers:
        front, back = copy.deepcopy(front), copy.deepcopy(back)
    return front, back


def stage_key_maps(model: nn.Module, cut: int) -> tuple[dict[str, str], dict[str, str]]:
    """How the state-dict keys of the front and back stages at ``cut`` map to ``model.state_dict()`` keys.

    Returns
    -------
    front, back : dict of str to str
        Stage key (``"0.weight"``, numbered within the stage) -> model key (``"features.0.weight"``).
    """
    front: dict[str, str] = {}
    back: dict[str, str] = {}
    for index, (name, layer) in enumerate(_leaves(model, "")):
        stage, position = (front, index) if index < cut else (back, index - cut)
        for key in layer.state_dict():
            stage[f"{position}.{key}"] = f"{name}.{key}" if name else key
    return front, back
