"""The messages of split training over a Flower Grid: what the coordinator asks, what a client answers.

Three message types, each routed by Flower's ``<category>.<action>`` names to one handler of
:data:`fedge.split.client_app.client_app`:

``query.split_hello``
    Who are you: the node's ``partition-id``, its examples and its memory for training (``memory-bytes`` in
    its node config, else what the machine has available), from which the coordinator plans its part.
``train``
    A full-model client trains the global model (``arrays``) for the round, as the in-process driver does.
``train.split_step``
    One exchange of a split client's round. It may carry the gradient at the cut for the client's previous
    batch (``grad-step``, with the front's ``grad-version`` it was computed against), asks for the
    activations of batch ``step`` (or ``-1``: none) and, with ``collect``, for the trained front stage. The
    first one of a round also carries the round's front stage (``front``), and the coordinator's
    ``session`` (a fresh one per coordinator process, so a restarted coordinator's round starts afresh).

Every request carries a ``"config"`` ConfigRecord with the run's task (the key a device agent checks
against its allow-list), the round (``server-round``) and the training settings, so a client needs nothing
but the message and its Context. Batches are named by ``(server-round, step)``; the client recomputes a
batch's indices and its forward from them, so no graph needs to outlive a message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedge.split.config import SplitFedConfig
from fedge.split.cut import CutConfig

__all__ = [
    "FULL_TRAIN",
    "HELLO",
    "SPLIT_STEP",
    "Hello",
    "RunSettings",
    "StepReply",
    "StepRequest",
]

HELLO = "query.split_hello"
FULL_TRAIN = "train"
SPLIT_STEP = "train.split_step"


@dataclass(frozen=True)
class RunSettings:
    """What every client needs to train its part: the task and the training settings.

    Parameters
    ----------
    task : str
        Task import path (``package.module:TaskClass``); an agent runs only tasks on its allow-list.
    task_args : str
        The task's keyword arguments as JSON.
    alpha : float
        Dirichlet concentration of the data split.
    split : SplitFedConfig
        Batch size, epochs, learning rate, momentum, seed, the cut's codecs, the U-shaped head and the
        update codec.
    run : int (default: 0)
        The coordinator's run (random for a fresh start, kept by a resume): a client drops the update
        error feedback of another run (:func:`fedge.split.updates.load_residual`). 0: not told.
    """

    task: str
    task_args: str
    alpha: float
    split: SplitFedConfig
    run: int = 0

    def record(self, server_round: int, **more: int | float | str | bool) -> ConfigRecord:
        """The ``"config"`` record of a request in ``server_round``, with ``more`` fields."""
        s = self.split
        return ConfigRecord(
            {
                "task": self.task,
                "task-args": self.task_args,
                "alpha": float(self.alpha),
                "seed": int(s.seed),
                "server-round": int(server_round),
                "batch-size": int(s.batch_size),
                "local-epochs": int(s.local_epochs),
                "learning-rate": float(s.learning_rate),
                "momentum": float(s.momentum),
                "activation-codec": s.cut.activation_codec,
                "activation-feedback": bool(s.cut.activation_feedback),
                "gradient-codec": s.cut.gradient_codec,
                "gradient-feedback": bool(s.cut.gradient_feedback),
                "head-layers": int(s.head_layers) if s.u_shaped else 0,
                "update-codec": s.update_codec or "",
                "run": int(self.run),
                **more,
            }
        )

    @staticmethod
    def split_config(record: ConfigRecord) -> SplitFedConfig:
        """The training settings a request carries (enough for :func:`fedge.split.rounds.batch_order`)."""
        return SplitFedConfig(
            seed=int(record["seed"]),
            batch_size=int(record["batch-size"]),
            local_epochs=int(record["local-epochs"]),
            learning_rate=float(record["learning-rate"]),
            momentum=float(record["momentum"]),
        )

    @staticmethod
    def cut_config(record: ConfigRecord) -> CutConfig:
        """The codecs of the client's half of the cut (activations up; U-shaped, gradients up too)."""
        return CutConfig(
            activation_codec=str(record["activation-codec"]),
            gradient_codec=str(record.get("gradient-codec", "fp32")),
            activation_feedback=bool(record["activation-feedback"]),
            gradient_feedback=bool(record.get("gradient-feedback", False)),
        )

    @staticmethod
    def head_layers(record: ConfigRecord) -> int:
        """Layers of the U-shaped head the client runs (0: not U-shaped)."""
        return int(record.get("head-layers", 0))

    @staticmethod
    def update_codec(record: ConfigRecord) -> str | None:
        """The codec spec of client updates (None: dense)."""
        return str(record.get("update-codec", "")) or None


@dataclass(frozen=True)
class Hello:
    """A node's answer to ``query.split_hello``."""

    partition_id: int
    num_examples: int
    memory_bytes: int

    def content(self) -> RecordDict:
        return RecordDict(
            {
                "hello": ConfigRecord(
                    {
                        "partition-id": self.partition_id,
                        "num-examples": self.num_examples,
                        "memory-bytes": self.memory_bytes,
                    }
                )
            }
        )

    @classmethod
    def from_message(cls, message: Message) -> Hello:
        record = message.content["hello"]
        return cls(int(record["partition-id"]), int(record["num-examples"]), int(record["memory-bytes"]))


@dataclass(frozen=True)
class StepRequest:
    """One ``train.split_step`` request, as the client reads it.

    Attributes
    ----------
    server_round, session : int, str
        The round, and the coordinator process that runs it.
    cut : int
        Layers ``[0, cut)`` of the task's model are this client's front stage.
    step : int
        Batch whose activations are wanted, or -1.
    grad_step, grad_version : int
        The batch the carried gradient belongs to (-1: no gradient) and the front's version (its steps taken
        this round) the activations were computed with; a gradient for another version is stale.
    gradient : bytes
        The gradient payload at the cut (empty when ``grad_step`` is -1).
    collect : bool
        Reply with the trained front stage (and head), or its encoded update.
    front : dict of str to tensor or None
        The round's front stage (state-dict keys of the stage), sent until the client has started the round.
    head_step, head_version : int
        U-shaped: the batch ``middle`` belongs to (-1: none) and the front's version its activations were
        computed with; the client runs its head on it once (a repeat gets the same answer again).
    middle : bytes
        U-shaped: the server stage's output payload for ``head_step``.
    head : dict of str to tensor or None
        U-shaped: the round's head (its own state-dict keys), sent with ``front``.
    """

    server_round: int
    session: str
    cut: int
    step: int = -1
    grad_step: int = -1
    grad_version: int = -1
    gradient: bytes = b""
    collect: bool = False
    front: dict[str, torch.Tensor] | None = None
    head_step: int = -1
    head_version: int = -1
    middle: bytes = b""
    head: dict[str, torch.Tensor] | None = None

    def content(self, settings: RunSettings) -> RecordDict:
        record = settings.record(
            self.server_round,
            session=self.session,
            cut=self.cut,
            step=self.step,
            **{
                "grad-step": self.grad_step,
                "grad-version": self.grad_version,
                "collect": self.collect,
                "head-step": self.head_step,
                "head-version": self.head_version,
            },
        )
        cut = ConfigRecord({"gradient": self.gradient, "middle": self.middle})
        content = RecordDict({"config": record, "cut": cut})
        if self.front is not None:
            content["front"] = ArrayRecord(self.front)
        if self.head is not None:
            content["head"] = ArrayRecord(self.head)
        return content

    @classmethod
    def from_message(cls, message: Message) -> StepRequest:
        config = message.content["config"]
        front = message.content.array_records.get("front")
        head = message.content.array_records.get("head")
        cut = message.content["cut"]
        return cls(
            server_round=int(config["server-round"]),
            session=str(config["session"]),
            cut=int(config["cut"]),
            step=int(config["step"]),
            grad_step=int(config["grad-step"]),
            grad_version=int(config["grad-version"]),
            gradient=bytes(cut["gradient"]),
            collect=bool(config["collect"]),
            front=None if front is None else dict(front.to_torch_state_dict()),
            head_step=int(config.get("head-step", -1)),
            head_version=int(config.get("head-version", -1)),
            middle=bytes(cut.get("middle", b"")),
            head=None if head is None else dict(head.to_torch_state_dict()),
        )


@dataclass(frozen=True)
class StepReply:
    """A split client's answer.

    Attributes
    ----------
    server_round, session : int, str
        The round and session the client is in (after this request).
    version : int
        The front's version now: the activations (if any) were computed with it.
    applied : bool
        The carried gradient was applied by this request (False: none came, or it was stale or a duplicate).
    step : int
        The batch of ``activation`` and ``labels`` (-1: none).
    activation, labels : bytes
        The activation payload and the labels (int64 bytes).
    front : dict of str to tensor or None
        The trained front stage (``collect`` with dense updates).
    num_examples : int
        The client's training examples (the weight of its front in the average).
    samples : int
        Samples in batch ``step`` (or, U-shaped, in batch ``head_step``).
    head_step : int
        U-shaped: the batch of ``head_gradient`` and ``loss`` (-1: none).
    head_gradient : bytes
        U-shaped: the gradient payload at the server stage's output.
    loss : float
        U-shaped: the head's loss on batch ``head_step`` (the labels never left the client).
    head : dict of str to tensor or None
        U-shaped: the trained head (``collect`` with dense updates).
    update : bytes
        ``collect`` with an update codec: the front's (and head's) update since the round's start, encoded
        with the client's error feedback and keyed by the model's names, instead of ``front`` and ``head``.
    """

    server_round: int
    session: str
    version: int
    applied: bool
    step: int = -1
    activation: bytes = b""
    labels: bytes = b""
    front: dict[str, torch.Tensor] | None = None
    num_examples: int = 0
    samples: int = 0
    head_step: int = -1
    head_gradient: bytes = b""
    loss: float = 0.0
    head: dict[str, torch.Tensor] | None = None
    update: bytes = b""

    def content(self) -> RecordDict:
        record = ConfigRecord(
            {
                "server-round": self.server_round,
                "session": self.session,
                "version": self.version,
                "applied": self.applied,
                "step": self.step,
                "activation": self.activation,
                "labels": self.labels,
                "samples": self.samples,
                "head-step": self.head_step,
                "head-gradient": self.head_gradient,
                "loss": float(self.loss),
                "update": self.update,
            }
        )
        content = RecordDict(
            {"split": record, "metrics": MetricRecord({"num-examples": float(self.num_examples)})}
        )
        if self.front is not None:
            content["front"] = ArrayRecord(self.front)
        if self.head is not None:
            content["head"] = ArrayRecord(self.head)
        return content

    @classmethod
    def from_message(cls, message: Message) -> StepReply:
        record = message.content["split"]
        front = message.content.array_records.get("front")
        head = message.content.array_records.get("head")
        return cls(
            server_round=int(record["server-round"]),
            session=str(record["session"]),
            version=int(record["version"]),
            applied=bool(record["applied"]),
            step=int(record["step"]),
            activation=bytes(record["activation"]),
            labels=bytes(record["labels"]),
            front=None if front is None else dict(front.to_torch_state_dict()),
            num_examples=int(message.content["metrics"]["num-examples"]),
            samples=int(record.get("samples", 0)),
            head_step=int(record.get("head-step", -1)),
            head_gradient=bytes(record.get("head-gradient", b"")),
            loss=float(record.get("loss", 0.0)),
            head=None if head is None else dict(head.to_torch_state_dict()),
            update=bytes(record.get("update", b"")),
        )
