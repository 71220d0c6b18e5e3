"""One split client's round as the coordinator tracks it: which batch is next, which gradient is owed.

A :class:`SplitSession` writes each request (:meth:`SplitSession.request`) and reads each reply
(:meth:`SplitSession.settle`). It owes the client the gradient of its last batch until a reply shows the
client's front has moved past the version that gradient was computed against (applied now, or by an
earlier request whose reply was lost), so an unanswered request is simply asked again. After
``max_attempts`` unanswered requests the batch in flight is given up (the gradient the client never
applied, and the next batch it was asked for, which it skips): that is all a drop can cost. A client still
at work when the round's time runs out loses the gradient it is owed (:meth:`SplitSession.cut_off`).

U-shaped, a batch takes two exchanges: its activations come up and the server stage's output (kept with
the version of the front that computed them) is owed to the client until a reply carries the gradient at
it; the client runs its head on a batch once and answers a repeat with the same gradient. Every stepped
batch leaves an :class:`Exchange` (its samples and payload bytes) for the simulated clock.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch
from flwr.app import Message

from fedge.compression import CodecError, inspect_payload
from fedge.split.cut import CutCodec, CutLink
from fedge.split.messages import StepReply, StepRequest
from fedge.split.rounds import StageKeys, step_seed
from fedge.split.step import BackStage, BatchRejected

__all__ = ["Exchange", "SplitSession"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exchange:
    """One stepped batch on the wire (payload bytes): what the simulated clock charges.

    Attributes
    ----------
    samples : int
        The batch's samples.
    up, down : int
        Activations (and labels) up; the gradient at the cut down.
    middle, head_up : int
        U-shaped: the server stage's output down and the gradient at it up (0 otherwise).
    """

    samples: int
    up: int
    down: int
    middle: int = 0
    head_up: int = 0


def _count(codec: CutCodec, payload: bytes) -> None:
    """Count a payload the other side encoded on the coordinator's copy of the link."""
    codec.sent_bytes += len(payload)
    with contextlib.suppress(CodecError):  # the stage's own decode rejects it and says why
        codec.dense_bytes += 4 * sum(math.prod(t.shape) for t in inspect_payload(payload).tensors)


@dataclass
class SplitSession:
    """A split client's round.

    Attributes
    ----------
    node, partition, cut, steps, examples : int
        Who (Flower node id, data partition), where its front ends, its batches this round, its examples.
    back : BackStage
        Its server-side stage (V2: a segment of the shared copy).
    link : CutLink
        Its cut's codecs (kept across rounds by the coordinator).
    keys : StageKeys
        Front, middle and head key maps to the model's keys.
    owner : str
        Whose server-side stage this is in a checkpoint (``"p<partition>"`` or ``"shared"``).
    u_shaped : bool
        The client holds the head and the labels (two exchanges per batch).
    """

    node: int
    partition: int
    cut: int
    steps: int
    examples: int
    back: BackStage
    link: CutLink
    keys: StageKeys
    owner: str
    u_shaped: bool = False
    cursor: int = 0  # the next batch whose activations are wanted
    pending: tuple[int, int, bytes] | None = None  # (batch, front version, gradient payload)
    started: bool = False  # the client confirmed it is in this round (it has the round's front)
    attempts: int = 0
    middle: tuple[int, int, bytes, int, int] | None = None  # U: (batch, version, output, up bytes, samples)
    front: dict[str, torch.Tensor] | None = None  # the trained front, once collected (dense updates)
    head: dict[str, torch.Tensor] | None = None  # and the trained head (U-shaped)
    update: bytes = b""  # or the encoded update of both (update_codec)
    base: dict[str, torch.Tensor] | None = None  # what its turn started from, by model key (set on its turn)
    exchanges: list[Exchange] = field(default_factory=list)
    done: bool = False
    server_steps: int = 0
    lost: int = 0
    rejected: int = 0  # of the lost batches, those the stage would not step on (BatchRejected)
    loss: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sum over samples, samples

    def request(
        self,
        server_round: int,
        session: str,
        front: dict[str, torch.Tensor],
        head: dict[str, torch.Tensor] | None = None,
    ) -> StepRequest:
        """The next request: the owed server output (U-shaped), else the owed gradient and the next batch
        (or collect); the front (and head) until the client has started the round."""
        if self.middle is not None:
            batch, version, middle = self.middle[:3]
            return StepRequest(
                server_round=server_round,
                session=session,
                cut=self.cut,
                head_step=batch,
                head_version=version,
                middle=middle,
            )
        step, version, gradient = self.pending if self.pending is not None else (-1, -1, b"")
        return StepRequest(
            server_round=server_round,
            session=session,
            cut=self.cut,
            step=self.cursor if self.cursor < self.steps else -1,
            grad_step=step,
            grad_version=version,
            gradient=gradient,
            collect=self.cursor >= self.steps,
            front=None if self.started else front,
            head=None if self.started else head,
        )

    def settle(self, message: Message | None, server_round: int, session: str, max_attempts: int) -> None:
        """Handle the client's reply (None: it did not answer in time); step the server side on its batch."""
        reply = None if message is None or message.has_error() else StepReply.from_message(message)
        if reply is None or (reply.session, reply.server_round) != (session, server_round):
            if reply is not None:
                self.started = False  # not in this round (its first request was lost): send the front again
            self._unanswered(max_attempts)
            return
        self.started, self.attempts = True, 0
        if self.middle is not None:
            self._head_reply(reply, server_round)
            return
        if self.pending is not None and not reply.applied and reply.version == self.pending[1]:
            self.lost += 1  # the client's front did not move: this gradient can never apply
        self.pending = None  # applied now, or by an earlier request whose reply was lost
        if 0 <= reply.step == self.cursor:
            self._activations(reply, server_round)
        if reply.front is not None or reply.update:
            self.front, self.head, self.update, self.done = reply.front, reply.head, reply.update, True

    def _activations(self, reply: StepReply, server_round: int) -> None:
        """Batch ``cursor``'s activations came: step the server side (U-shaped: its forward only). A batch
        the stage will not step on (:class:`BatchRejected`) is lost, and only this client's."""
        seed = step_seed(server_round, reply.step)
        _count(self.link.activation_up, reply.activation)
        self.cursor += 1
        try:
            if self.u_shaped:
                middle = self.back.forward(reply.activation, self.link, client=self.partition, seed=seed)
                self.middle = (reply.step, reply.version, middle, len(reply.activation), reply.samples)
                return
            gradient, loss = self.back.step(reply.activation, reply.labels, self.link, seed=seed)
        except BatchRejected as err:
            self._rejected(reply.step, err)
            return
        self.link.label_bytes += len(reply.labels)
        self.pending = (reply.step, reply.version, gradient)
        samples = len(reply.labels) // 8  # int64 labels
        self._stepped(loss, samples)
        self.exchanges.append(Exchange(samples, len(reply.activation) + len(reply.labels), len(gradient)))

    def _head_reply(self, reply: StepReply, server_round: int) -> None:
        """U-shaped: the gradient at the server stage's output came (or the client could not give it)."""
        assert self.middle is not None
        batch, version, middle, up, samples = self.middle
        self.middle = None
        if reply.head_step != batch or not reply.head_gradient:
            self.back.discard(self.partition)  # the client is elsewhere (a restart lost its round)
            self.lost += 1
            return
        _count(self.link.gradient_up, reply.head_gradient)
        seed = step_seed(server_round, batch)
        try:
            gradient = self.back.backward(reply.head_gradient, self.link, client=self.partition, seed=seed)
        except BatchRejected as err:
            self._rejected(batch, err)
            return
        self.pending = (batch, version, gradient)
        self._stepped(reply.loss, samples)
        self.exchanges.append(Exchange(samples, up, len(gradient), len(middle), len(reply.head_gradient)))

    def _rejected(self, batch: int, err: BatchRejected) -> None:
        """The stage would not step on ``batch``: it is lost (no gradient is owed for it), counted, and the
        client's first of the round is logged."""
        self.lost += 1
        self.rejected += 1
        if self.rejected == 1:
            log.warning("split client %d: batch %d rejected: %s", self.partition, batch, err)

    def _stepped(self, loss: float, samples: int) -> None:
        self.server_steps += 1
        self.loss[0] += loss * samples
        self.loss[1] += samples

    def cut_off(self) -> None:
        """The round's time ran out before this client handed in its front: the batch it owes the
        coordinator an answer for is lost (a gradient the coordinator's side stepped on and the client never
        applied, or, U-shaped, a server-stage output its head never answered)."""
        if self.middle is not None:
            self.middle = None
            self.back.discard(self.partition)
            self.lost += 1
        elif self.pending is not None:
            self.pending = None
            self.lost += 1

    def _unanswered(self, max_attempts: int) -> None:
        self.attempts += 1
        if self.attempts < max_attempts:
            return  # asked again, with the same gradient, once the node is online
        self.attempts = 0
        head_owed = self.middle is not None  # U-shaped: the head never answered
        self.cut_off()  # the batch in flight is lost
        if head_owed:
            return
        if self.cursor < self.steps:  # and the next one, which the request asked for, is skipped
            self.lost += 1
            self.cursor += 1
        else:
            self.done = True  # it never handed its front in
