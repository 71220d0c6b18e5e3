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

import collections
import contextlib
import copy
import statistics
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fedge.app.seeding import seeded
from fedge.compression import CodecError
from fedge.split.cut import CutLink, decode_labels, decode_tensor, encode_labels, sparse_gradient

__all__ = ["ActivationScales", "BackStage", "BatchRejected", "FrontStage", "LossFn"]

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


class BatchRejected(ValueError):
    """A device's batch the coordinator's stage will not step on: damaged or mis-shaped activations, labels
    that do not match them, or values that make the loss or a gradient NaN or infinite. Nothing was
    stepped; the batch is lost, and only the device that sent it loses it."""


def _received(payload: bytes) -> torch.Tensor:
    """A device's tensor, as a leaf whose gradient is sent back; :class:`BatchRejected` if it is damaged or
    holds NaN or infinity."""
    try:
        tensor = decode_tensor(payload)
    except CodecError as err:
        raise BatchRejected(f"undecodable: {err}") from None
    if not torch.isfinite(tensor).all():
        raise BatchRejected("its values hold NaN or infinity")
    return tensor.requires_grad_(True)


def _checked_backward(
    value: torch.Tensor, gradient: torch.Tensor | None, module: nn.Module, received: torch.Tensor
) -> None:
    """``value.backward(gradient)``; :class:`BatchRejected`, with every gradient it left cleared, if a
    gradient comes out NaN or infinite (finite activations of 1e30 give an infinite loss's gradient)."""
    value.backward(gradient)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if received.grad is not None:
        grads.append(received.grad)
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        for parameter in module.parameters():
            parameter.grad = None
        raise BatchRejected("its gradients came out NaN or infinite")


class ActivationScales:
    """The scale (root mean square) of the activations recently stepped on, per cut; a batch far above
    them is :class:`BatchRejected`.

    Every client of a cut sends activations of one layer's output, so honest batches' scales agree within
    a few times. A device that scales its activations up (by 100, say) takes the server stage's steps far
    off, and with a shared stage (SplitFed V2) every other client's model with it: that had left the
    global model computing NaN. One object is shared by every server stage of a run.

    Parameters
    ----------
    max_ratio : float (default: 10.0)
        Reject a batch whose scale is over this many times the median of the cut's recent ones.
    min_history : int (default: 8)
        Batches of a cut stepped on before the test applies.
    history : int (default: 64)
        The recent batches the median is over.
    """

    def __init__(self, max_ratio: float = 10.0, min_history: int = 8, history: int = 64) -> None:
        self.max_ratio, self.min_history, self.history = max_ratio, min_history, history
        self._recent: dict[tuple[int, ...], collections.deque[float]] = {}

    def check(self, activation: torch.Tensor) -> float:
        """The batch's scale; :class:`BatchRejected` if it is far above the cut's recent ones."""
        scale = float(activation.detach().pow(2).mean().sqrt()) if activation.numel() else 0.0
        recent = self._recent.get(tuple(activation.shape[1:]))
        if recent is not None and len(recent) >= self.min_history:
            typical = statistics.median(recent)
            if typical > 0 and scale > self.max_ratio * typical:
                raise BatchRejected(f"activations of scale {scale:.3g}, the cut's recent ones {typical:.3g}")
        return scale

    def expect(self, front: nn.Module, features: torch.Tensor) -> None:
        """Start the cut's history from the scale of ``front``'s output on ``features`` (the coordinator's
        own data, through the round's global front): a device's scaled batches are then rejected from the
        first, before their steps could throw the stage off and, through its gradients, the fronts of
        every other device (a shared stage).

        ``front`` runs in training mode, as on the devices (BatchNorm normalising by the batch: in eval mode,
        its initial running statistics would pass small inputs through small, and honest batches would look
        far larger), so give it a copy; torch's random state is left as it was (dropout draws)."""
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            activation = front.train()(features)
        recent = self._recent.setdefault(tuple(activation.shape[1:]), collections.deque(maxlen=self.history))
        recent.extend([float(activation.pow(2).mean().sqrt())] * self.min_history)

    def stepped(self, activation: torch.Tensor, scale: float) -> None:
        """Count a batch the stage stepped on."""
        key = tuple(activation.shape[1:])
        self._recent.setdefault(key, collections.deque(maxlen=self.history)).append(scale)


@contextlib.contextmanager
def _guarded(what: str) -> Iterator[None]:
    """Torch's own errors on a batch that does not fit the stage (shape, batch size, label range) as
    :class:`BatchRejected`."""
    try:
        yield
    except BatchRejected:
        raise
    except (RuntimeError, ValueError, IndexError) as err:
        raise BatchRejected(f"{what}: {type(err).__name__}: {err}") from None


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
    scales : ActivationScales or None (default: None)
        Reject batches whose activations are far above the cut's recent ones (shared by a run's stages).
    """

    def __init__(
        self,
        back: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        mask_gradient: bool = False,
        loss_fn: LossFn = nn.functional.cross_entropy,
        snapshot: bool = False,
        scales: ActivationScales | None = None,
    ) -> None:
        self.back, self.optimizer, self.mask_gradient, self.loss_fn = back, optimizer, mask_gradient, loss_fn
        self.snapshot, self.scales = snapshot, scales
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, nn.Module]] = {}

    def _cut_gradient(self, activation: torch.Tensor) -> torch.Tensor:
        grad = activation.grad
        return sparse_gradient(grad, activation.detach()) if self.mask_gradient else grad

    def step(self, payload: bytes, labels: bytes, link: CutLink, *, seed: int = 0) -> tuple[bytes, float]:
        """Activations and labels in; forward, loss, backward, step; the gradient payload at the cut out.

        Raises
        ------
        BatchRejected
            The batch is damaged, does not fit this stage or its labels, or gives a NaN or infinite loss
            or gradient: nothing was stepped.
        """
        self.back.train()
        activation = _received(payload)
        scale = self.scales.check(activation) if self.scales is not None else 0.0
        with _guarded("the stage cannot take these activations and labels"):
            targets = decode_labels(labels)
            if len(targets) != activation.shape[0]:
                raise BatchRejected(f"{len(targets)} labels for a batch of {activation.shape[0]} rows")
            with seeded(seed, _BACK):
                loss = self.loss_fn(self.back(_fed(activation)), targets)
        if not torch.isfinite(loss):
            raise BatchRejected(f"its loss is {float(loss.detach())}")
        _checked_backward(loss, None, self.back, activation)
        _step(self.optimizer)
        if self.scales is not None:
            self.scales.stepped(activation, scale)
        return link.gradient_down.encode(self._cut_gradient(activation), seed=seed), float(loss.detach())

    def forward(self, payload: bytes, link: CutLink, *, client: int = 0, seed: int = 0) -> bytes:
        """U-shaped, first half: activations in, this stage's output payload out (graph kept per client);
        :class:`BatchRejected` as :meth:`step`."""
        self.back.train()
        activation = _received(payload)
        scale = self.scales.check(activation) if self.scales is not None else 0.0
        used = copy.deepcopy(self.back) if self.snapshot else self.back
        with _guarded("the stage cannot take these activations"), seeded(seed, _BACK):
            output = used(_fed(activation))
        if not torch.isfinite(output).all():
            raise BatchRejected("the stage's output holds NaN or infinity")
        self._pending[client] = (activation, output, used)
        if self.scales is not None:
            self.scales.stepped(activation, scale)
        return link.activation_down.encode(output, seed=seed)

    def backward(self, payload: bytes, link: CutLink, *, client: int = 0, seed: int = 0) -> bytes:
        """U-shaped, second half: the gradient at this stage's output in; step; the cut gradient out.
        :class:`BatchRejected` (the pending forward dropped, nothing stepped) if the head's gradient is
        damaged, mis-shaped or not finite."""
        activation, output, used = self._pending.pop(client)
        gradient = _received(payload).detach()
        with _guarded("the head's gradient does not fit the stage's output"):
            gradient = gradient.reshape(output.shape)
        _checked_backward(output, gradient, used, activation)
        if used is not self.back:  # the snapshot's gradient, onto the live weights
            for live, copied in zip(self.back.parameters(), used.parameters(), strict=True):
                live.grad = copied.grad
        _step(self.optimizer)
        return link.gradient_down.encode(self._cut_gradient(activation), seed=seed)

    def discard(self, client: int = 0) -> None:
        """U-shaped: forget ``client``'s pending forward (its head never answered: the batch is lost)."""
        self._pending.pop(client, None)
