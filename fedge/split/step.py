"""One split training step, both sides, pure torch: bytes in, bytes out.

The client's :class:`FrontStage` and the coordinator's :class:`BackStage` exchange only payloads (fedge
codec bytes), so the same objects serve the in-process driver and an engine that carries the payloads in
messages. A plain step::

    client: a = front(x)            --activations, labels-->   server: loss = L(back(a), y); backward
    client: a.backward(g); step     <--gradient at the cut--   server: step

The U-shaped variant keeps the labels at home: the client also holds the head (the last layers), the
server returns its stage's output, the client computes the loss and sends the gradient at the head's input
back, and the server returns the gradient at the first cut. With ``optimizer=None`` a stage only
accumulates gradients (what :func:`split_gradients` compares with unsplit autograd).

A client that lost its pending forward (a new process, a restart between the two messages) recomputes it
from the batch: :meth:`FrontStage.backward` takes ``features`` (and the step's seed) for that. Every forward
draws from random streams seeded by its step's seed (:func:`fedge.app.seeding.seeded`), so the recomputed
forward is the one that produced the activations, dropout masks included, and the engine computes what
the in-process driver computes; a recompute leaves the front's buffers (BatchNorm's running statistics) as
the first forward left them, so they move once per batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from fedge.app.seeding import seeded
from fedge.split.cut import CutLink, decode_labels, decode_tensor, encode_labels, sparse_gradient

__all__ = ["BackStage", "FrontStage", "LossFn"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# the random streams of one step's parts (a front and a back with dropout must not share masks)
_FRONT, _HEAD, _BACK = 1, 2, 3


def _buffer_values(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``module``'s buffers and a copy of their values, for :func:`_restore`."""
    return [(buffer, buffer.detach().clone()) for buffer in module.buffers()]


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in saved:
            buffer.copy_(value)


def _fed(received: torch.Tensor) -> torch.Tensor:
    """What a stage's layers are fed of a received tensor (a leaf whose ``.grad`` is sent back): a copy, since
    a first layer that works in place (``ReLU(inplace=True)``) may not modify a leaf that requires grad."""
    return received.clone()


def _step(optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class FrontStage:
    """The client's part: the front layers (and, U-shaped, the head), its optimizer and its link.

    Parameters
    ----------
    front : nn.Module
        Layers before the cut.
    optimizer : torch.optim.Optimizer or None
        Steps the front (and head); None leaves gradients accumulated in ``.grad``.
    link : CutLink
        This client's encoders.
    head : nn.Module or None (default: None)
        The last layers, for the U-shaped variant (labels never leave the client).
    loss_fn : callable (default: cross-entropy)
        Loss of the head's output (U-shaped only).
    """

    def __init__(
        self,
        front: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        link: CutLink,
        *,
        head: nn.Module | None = None,
        loss_fn: LossFn = nn.functional.cross_entropy,
    ) -> None:
        self.front, self.head, self.optimizer, self.link, self.loss_fn = front, head, optimizer, link, loss_fn
        self._activation: torch.Tensor | None = None

    def forward(self, features: torch.Tensor, *, seed: int = 0) -> bytes:
        """Run the front on a batch; return the activation payload (the labels travel with
        :meth:`label_payload`). The graph is kept for :meth:`backward`."""
        self.front.train()
        with seeded(seed, _FRONT):
            self._activation = self.front(features)
        return self.link.activation_up.encode(self._activation, seed=seed)

    def label_payload(self, labels: torch.Tensor) -> bytes:
        """The labels' payload (not used U-shaped), counted on the link."""
        payload = encode_labels(labels)
        self.link.label_bytes += len(payload)
        return payload

    def head_step(self, payload: bytes, labels: torch.Tensor, *, seed: int = 0) -> tuple[bytes, float]:
        """U-shaped: the server stage's output in, loss at home, the gradient at the head's input out."""
        if self.head is None:
            raise RuntimeError("head_step needs a head (U-shaped variant)")
        self.head.train()
        middle = decode_tensor(payload).requires_grad_(True)
        with seeded(seed, _HEAD):
            loss = self.loss_fn(self.head(_fed(middle)), labels)
        loss.backward()
        return self.link.gradient_up.encode(middle.grad, seed=seed), float(loss.detach())

    def backward(self, payload: bytes, *, features: torch.Tensor | None = None, seed: int = 0) -> None:
        """Apply the gradient at the cut, then step (front and head).

        Parameters
        ----------
        payload : bytes
            The gradient payload from the coordinator.
        features : torch.Tensor or None (default: None)
            The batch, to recompute the forward when it is no longer held (e.g. after a restart).
        seed : int (default: 0)
            The seed the batch's :meth:`forward` was given (a recompute draws what it drew).
        """
        saved = None
        if self._activation is None:
            if features is None:
                raise RuntimeError("no pending forward: pass the batch's features to recompute it")
            self.front.train()
            saved = _buffer_values(self.front)  # the first forward moved them already
            with seeded(seed, _FRONT):
                self._activation = self.front(features)
        activation, self._activation = self._activation, None
        activation.backward(decode_tensor(payload).reshape(activation.shape))
        if saved is not None:  # after the backward: autograd checks the buffers it saw are unchanged
            _restore(saved)
        _step(self.optimizer)

    def discard(self) -> None:
        """Forget a pending forward (the coordinator never answered: the batch is lost, nothing else)."""
        self._activation = None


class BackStage:
    """The coordinator's part for one client (SplitFed V1) or shared by all (V2).

    Parameters
    ----------
    back : nn.Module
        Layers after the cut (U-shaped: the middle layers, up to the client's head).
    optimizer : torch.optim.Optimizer or None
        Steps the back; None leaves gradients accumulated.
    mask_gradient : bool (default: False)
        Zero the cut gradient where the activation is zero (set it when the front ends in a ReLU).
    loss_fn : callable (default: cross-entropy)
        Loss of the back's output against the labels.
    snapshot : bool (default: False)
        U-shaped: run each :meth:`forward` on a copy of the weights and apply its gradient to the live ones
        at :meth:`backward`. Set it when other clients step the same parameters between a client's forward
        and its backward (a message engine's shared V2 stage): the kept graph stays valid and the gradient
        is the one of the weights that produced the output (applied one step late, as asynchronous SGD).
    """

    def __init__(
        self,
        back: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        mask_gradient: bool = False,
        loss_fn: LossFn = nn.functional.cross_entropy,
        snapshot: bool = False,
    ) -> None:
        self.back, self.optimizer, self.mask_gradient, self.loss_fn = back, optimizer, mask_gradient, loss_fn
        self.snapshot = snapshot
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, nn.Module]] = {}

    def _cut_gradient(self, activation: torch.Tensor) -> torch.Tensor:
        grad = activation.grad
        return sparse_gradient(grad, activation.detach()) if self.mask_gradient else grad

    def step(self, payload: bytes, labels: bytes, link: CutLink, *, seed: int = 0) -> tuple[bytes, float]:
        """Activations and labels in; forward, loss, backward, step; the gradient payload at the cut out."""
        self.back.train()
        activation = decode_tensor(payload).requires_grad_(True)
        with seeded(seed, _BACK):
            loss = self.loss_fn(self.back(_fed(activation)), decode_labels(labels))
        loss.backward()
        _step(self.optimizer)
        return link.gradient_down.encode(self._cut_gradient(activation), seed=seed), float(loss.detach())

    def forward(self, payload: bytes, link: CutLink, *, client: int = 0, seed: int = 0) -> bytes:
        """U-shaped, first half: activations in, this stage's output payload out (graph kept per client)."""
        self.back.train()
        activation = decode_tensor(payload).requires_grad_(True)
        used = copy.deepcopy(self.back) if self.snapshot else self.back
        with seeded(seed, _BACK):
            output = used(_fed(activation))
        self._pending[client] = (activation, output, used)
        return link.activation_down.encode(output, seed=seed)

    def backward(self, payload: bytes, link: CutLink, *, client: int = 0, seed: int = 0) -> bytes:
        """U-shaped, second half: the gradient at this stage's output in; step; the cut gradient out."""
        activation, output, used = self._pending.pop(client)
        output.backward(decode_tensor(payload).reshape(output.shape))
        if used is not self.back:  # the snapshot's gradient, onto the live weights
            for live, copied in zip(self.back.parameters(), used.parameters(), strict=True):
                live.grad = copied.grad
        _step(self.optimizer)
        return link.gradient_down.encode(self._cut_gradient(activation), seed=seed)

    def discard(self, client: int = 0) -> None:
        """U-shaped: forget ``client``'s pending forward (its head never answered: the batch is lost)."""
        self._pending.pop(client, None)
