"""One split client's round as the coordinator tracks it: which batch is next, which gradient is owed.

A :class:`SplitSession` writes each request (:meth:`SplitSession.request`) and reads each reply
(:meth:`SplitSession.settle`). It owes the client the gradient of its last batch until a reply shows the
client's front has moved past the version that gradient was computed against (applied now, or by an
earlier request whose reply was lost), so an unanswered request is simply asked again. After
``max_attempts`` unanswered requests the batch in flight is given up: that is all a drop can cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from flwr.app import Message

from fedge.split.cut import CutLink
from fedge.split.messages import StepReply, StepRequest
from fedge.split.rounds import StageKeys
from fedge.split.step import BackStage

__all__ = ["SplitSession"]


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
    cursor: int = 0  # the next batch whose activations are wanted
    pending: tuple[int, int, bytes] | None = None  # (batch, front version, gradient payload)
    started: bool = False  # the client confirmed it is in this round (it has the round's front)
    attempts: int = 0
    front: dict[str, torch.Tensor] | None = None  # the trained front, once collected
    done: bool = False
    server_steps: int = 0
    lost: int = 0
    loss: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sum over samples, samples

    def request(self, server_round: int, session: str, front: dict[str, torch.Tensor]) -> StepRequest:
        """The next request: the owed gradient, the next batch (or collect), the front until started."""
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
        if self.pending is not None and not reply.applied and reply.version == self.pending[1]:
            self.lost += 1  # the client's front did not move: this gradient can never apply
        self.pending = None  # applied now, or by an earlier request whose reply was lost
        if 0 <= reply.step == self.cursor:
            seed = server_round * 100003 + reply.step
            gradient, loss = self.back.step(reply.activation, reply.labels, self.link, seed=seed)
            self.link.label_bytes += len(reply.labels)
            self.pending = (reply.step, reply.version, gradient)
            self.cursor += 1
            self.server_steps += 1
            samples = len(reply.labels) // 8  # int64 labels
            self.loss[0] += loss * samples
            self.loss[1] += samples
        if reply.front is not None:
            self.front, self.done = reply.front, True

    def _unanswered(self, max_attempts: int) -> None:
        self.attempts += 1
        if self.attempts < max_attempts:
            return  # asked again, with the same gradient, once the node is online
        self.attempts = 0
        self.lost += int(self.pending is not None) + int(self.cursor < self.steps)
        self.pending = None
        if self.cursor < self.steps:
            self.cursor += 1
        else:
            self.done = True  # it never handed its front in
