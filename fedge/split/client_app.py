"""The split-training ClientApp: full-model training, and a split client's side of each batch.

Stateless across processes: everything a split client keeps between messages lives in its Flower
``Context.state`` (the front stage's weights, its optimizer's momentum, the activation codec's
error-feedback residual and where it is in the round), which a SuperNode, fedge's local engine and the
device agent all keep for it; the agent writes it to disk with every reply, so it survives a restart.
No autograd graph outlives a message: the gradient for batch ``k`` arrives with the next request, and the
client recomputes batch ``k``'s forward from its indices (:func:`fedge.split.rounds.batch_order`) before
applying it (:meth:`fedge.split.step.FrontStage.backward` with ``features``).

The front has a *version*: the steps it took this round. A reply says which version computed the
activations; the coordinator returns it with the gradient, and a gradient for any other version (stale,
or a duplicate of one applied already) is ignored. So a client that drops mid-batch loses at most that
batch: the coordinator resends what was not answered, and nothing is applied twice.

Run it on an agent with ``client_app = "fedge.split.app:client_app"`` (see ``docs/split-training.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedge.app.task import PreparedTask, prepare_task
from fedge.devices.profile import measure_device
from fedge.split.cut import CutConfig, CutLink
from fedge.split.messages import Hello, RunSettings, StepReply, StepRequest
from fedge.split.model import as_chain, segment
from fedge.split.rounds import batch_order
from fedge.split.step import FrontStage

__all__ = ["STATE_KEYS", "MomentumSGD", "client_app"]

log = logging.getLogger(__name__)

STATE_KEYS = ("split.meta", "split.front", "split.optim", "split.ef")
"""The records a split client keeps in ``Context.state``."""

client_app = ClientApp()


class MomentumSGD:
    """``torch.optim.SGD``'s step (momentum, no dampening, weight decay or Nesterov), state by index.

    Building any ``torch.optim`` optimizer imports TorchDynamo, seconds of start-up on a small device (and
    on every agent restart); a client stage needs only this. The driver-equality tests hold it to torch's.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            grad = param.grad
            if self.momentum:
                buffer = self.buffers.get(index)
                if buffer is None:
                    buffer = grad.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(grad)
                self.buffers[index] = grad = buffer
            param.add_(grad, alpha=-self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None


@client_app.query("split_hello")
def hello(msg: Message, context: Context) -> Message:
    """This node's partition, examples and training memory (node config ``memory-bytes``, else measured)."""
    config = msg.content["config"]
    partition = int(context.node_config["partition-id"])
    examples = len(_task(config, context).partition(partition)[1])
    memory = int(context.node_config.get("memory-bytes", 0)) or measure_device().memory_available_mb * 2**20
    return Message(Hello(partition, examples, memory).content(), reply_to=msg)


@client_app.train()
def train_full(msg: Message, context: Context) -> Message:
    """Train the whole received model for the round, batch for batch as the in-process driver does."""
    config = msg.content["config"]
    settings = RunSettings.split_config(config)
    partition = int(context.node_config["partition-id"])
    task = _task(config, context)
    features, labels = task.partition(partition)
    model = task.task.model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    optimizer = MomentumSGD(list(model.parameters()), settings.learning_rate, settings.momentum)
    total, seen = 0.0, 0
    for batch in batch_order(len(labels), settings, int(config["server-round"]), partition):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(features[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        total, seen = total + float(loss.detach()) * len(batch), seen + len(batch)
    metrics = MetricRecord({"num-examples": float(len(labels)), "train_loss": total / max(1, seen)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@dataclass
class _SplitState:
    """A split client's state between messages (kept in ``Context.state``)."""

    session: str = ""
    server_round: int = 0
    version: int = 0
    front: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, torch.Tensor] = field(default_factory=dict)
    ef: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def load(cls, context: Context) -> _SplitState:
        state = context.state
        if "split.meta" not in state:
            return cls()
        meta = state["split.meta"]
        return cls(
            session=str(meta["session"]),
            server_round=int(meta["server-round"]),
            version=int(meta["version"]),
            front=dict(state["split.front"].to_torch_state_dict()),
            optim=dict(state["split.optim"].to_torch_state_dict()),
            ef={k: v.numpy() for k, v in state["split.ef"].items()},
        )

    def save(self, context: Context) -> None:
        meta = {"session": self.session, "server-round": self.server_round, "version": self.version}
        context.state["split.meta"] = ConfigRecord(meta)
        context.state["split.front"] = ArrayRecord(self.front)
        context.state["split.optim"] = ArrayRecord(self.optim)
        context.state["split.ef"] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in self.ef.items()}
        )


@client_app.train("split_step")
def split_step(msg: Message, context: Context) -> Message:
    """Apply the gradient the request carries (if it is for the front's current version), then compute the
    activations it asks for, and (``collect``) return the trained front."""
    request = StepRequest.from_message(msg)
    config = msg.content["config"]
    state = _SplitState.load(context)
    partition = int(context.node_config["partition-id"])
    task = _task(config, context)
    features, labels = task.partition(partition)
    current = (state.session, state.server_round) == (request.session, request.server_round)
    if not current:
        older = state.session == request.session and request.server_round < state.server_round
        if request.front is None or older:  # stale, or cannot start the round without its front
            log.info(
                "split request for round %d ignored (at round %d)", request.server_round, state.server_round
            )
            reply = StepReply(state.server_round, state.session, state.version, applied=False)
            return Message(reply.content(), reply_to=msg)
        state = _SplitState(request.session, request.server_round, 0, dict(request.front), {}, state.ef)
    settings = RunSettings.split_config(config)
    stage, optimizer = _front_stage(task, request.cut, state, config)
    order = batch_order(len(labels), settings, request.server_round, partition)
    applied = False
    if request.grad_step >= 0 and request.grad_version == state.version:
        stage.backward(request.gradient, features=features[order[request.grad_step]])
        state.version += 1
        applied = True
    activation = label_bytes = b""
    if request.step >= 0:
        batch = order[request.step]
        activation = stage.forward(features[batch], seed=request.server_round * 100003 + request.step)
        label_bytes = stage.label_payload(labels[batch])
        stage.discard()  # the gradient comes with the next request, which recomputes the forward
    state.front = {k: v.detach().clone() for k, v in stage.front.state_dict().items()}
    state.optim = {str(i): b.clone() for i, b in optimizer.buffers.items()}
    state.ef = dict(stage.link.activation_up.state)
    state.save(context)
    reply = StepReply(
        request.server_round,
        request.session,
        state.version,
        applied,
        step=request.step,
        activation=activation,
        labels=label_bytes,
        front=state.front if request.collect else None,
        num_examples=len(labels),
    )
    return Message(reply.content(), reply_to=msg)


def _front_stage(
    task: PreparedTask, cut: int, state: _SplitState, config: ConfigRecord
) -> tuple[FrontStage, MomentumSGD]:
    """The front stage at ``cut`` with the state's weights, optimizer momentum and residuals."""
    front = segment(as_chain(task.task.model()), 0, cut)
    front.load_state_dict(state.front)
    lr, momentum = float(config["learning-rate"]), float(config["momentum"])
    optimizer = MomentumSGD(list(front.parameters()), lr, momentum)
    optimizer.buffers = {int(k): v.clone() for k, v in state.optim.items()}
    cut_config = CutConfig(
        activation_codec=str(config["activation-codec"]),
        activation_feedback=bool(config["activation-feedback"]),
    )
    link = CutLink(cut_config)
    link.activation_up.state = dict(state.ef)
    stage = FrontStage(front, optimizer, link)  # type: ignore[arg-type]  (an optimizer in all but name)
    return stage, optimizer


def _task(config: ConfigRecord, context: Context) -> PreparedTask:
    """This process's prepared instance of the request's task, for this node's split."""
    return prepare_task(
        str(config["task"]),
        str(config["task-args"]),
        int(context.node_config["num-partitions"]),
        alpha=float(config["alpha"]),
        seed=int(config["seed"]),
    )
