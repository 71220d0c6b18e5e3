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
batch: the coordinator resends what was not answered, and nothing is applied twice. U-shaped, the client
also holds the head: it runs it on the server stage's output a request carries, once per batch (a repeat gets
the gradient it kept), and steps it then; the front steps when the gradient at the cut comes.

With an ``update-codec`` a client sends its update (from the round's start, or from the front handed to it
in sequential split learning) as one codec payload, with error feedback kept in its Context
(:mod:`fedge.split.updates`); a repeated ``collect`` gets the same payload.

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

from fedge.app.seeding import seeded
from fedge.app.task import PreparedTask, prepare_task
from fedge.devices.profile import measure_device
from fedge.split.cut import CutLink
from fedge.split.messages import Hello, RunSettings, StepReply, StepRequest
from fedge.split.model import as_chain, segment
from fedge.split.rounds import StageKeys, batch_order, client_round_seed, stage_keys, step_seed
from fedge.split.step import FrontStage
from fedge.split.updates import UPDATE_EF_KEY, encode_update, load_residual, save_residual

__all__ = ["STATE_KEYS", "MomentumSGD", "client_app"]

log = logging.getLogger(__name__)

STATE_KEYS = (
    "split.meta",
    "split.front",
    "split.head",
    "split.base",
    "split.optim",
    "split.ef",
    "split.gef",
    UPDATE_EF_KEY,
)
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
    start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    model.train()
    optimizer = MomentumSGD(list(model.parameters()), settings.learning_rate, settings.momentum)
    total, seen = 0.0, 0
    server_round = int(config["server-round"])
    with seeded(client_round_seed(settings, server_round, partition)):  # dropout draws as the driver's
        for batch in batch_order(len(labels), settings, server_round, partition):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(features[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            total, seen = total + float(loss.detach()) * len(batch), seen + len(batch)
    metrics = MetricRecord({"num-examples": float(len(labels)), "train_loss": total / max(1, seen)})
    content = RecordDict({"metrics": metrics})
    spec = RunSettings.update_codec(config)
    if spec is None:
        content["arrays"] = ArrayRecord(model.state_dict())
    else:  # the update since the round's start, with this node's error feedback (kept in its Context)
        state = model.state_dict()
        residual = load_residual(context, int(config.get("run", 0)))
        delta = {k: state[k] - v for k, v in start.items()}
        payload = encode_update(delta, spec, residual, seed=int(config["server-round"]))
        save_residual(context, residual)
        content["update"] = ConfigRecord({"payload": payload})
    return Message(content=content, reply_to=msg)


@dataclass
class _SplitState:
    """A split client's state between messages (kept in ``Context.state``).

    ``head_done`` is the last batch the U-shaped head stepped on, and ``head_reply`` its answer (gradient
    payload, loss, samples), sent again if the coordinator asks again; ``update`` is the encoded update once
    collected, so a repeated collect neither encodes twice nor moves the error feedback twice.
    """

    session: str = ""
    server_round: int = 0
    version: int = 0
    front: dict[str, torch.Tensor] = field(default_factory=dict)
    head: dict[str, torch.Tensor] = field(default_factory=dict)
    base: dict[str, torch.Tensor] = field(default_factory=dict)  # the round's start, by model key
    optim: dict[str, torch.Tensor] = field(default_factory=dict)
    ef: dict[str, np.ndarray] = field(default_factory=dict)  # activations up
    gef: dict[str, np.ndarray] = field(default_factory=dict)  # U-shaped: gradients up
    head_done: int = -1
    head_reply: tuple[bytes, float, int] = (b"", 0.0, 0)
    update: bytes = b""

    @classmethod
    def load(cls, context: Context) -> _SplitState:
        state = context.state
        if "split.meta" not in state:
            return cls()
        meta = state["split.meta"]

        def tensors(key: str) -> dict[str, torch.Tensor]:
            return dict(state[key].to_torch_state_dict()) if key in state else {}

        def arrays(key: str) -> dict[str, np.ndarray]:
            return {k: v.numpy() for k, v in state[key].items()} if key in state else {}

        return cls(
            session=str(meta["session"]),
            server_round=int(meta["server-round"]),
            version=int(meta["version"]),
            front=tensors("split.front"),
            head=tensors("split.head"),
            base=tensors("split.base"),
            optim=tensors("split.optim"),
            ef=arrays("split.ef"),
            gef=arrays("split.gef"),
            head_done=int(meta.get("head-done", -1)),
            head_reply=(
                bytes(meta.get("head-gradient", b"")),
                float(meta.get("head-loss", 0.0)),
                int(meta.get("head-samples", 0)),
            ),
            update=bytes(meta.get("update", b"")),
        )

    def save(self, context: Context) -> None:
        meta = {
            "session": self.session,
            "server-round": self.server_round,
            "version": self.version,
            "head-done": self.head_done,
            "head-gradient": self.head_reply[0],
            "head-loss": self.head_reply[1],
            "head-samples": self.head_reply[2],
            "update": self.update,
        }
        context.state["split.meta"] = ConfigRecord(meta)
        for key, tensors in (
            ("split.front", self.front),
            ("split.head", self.head),
            ("split.base", self.base),
            ("split.optim", self.optim),
        ):
            context.state[key] = ArrayRecord(tensors)
        for key, values in (("split.ef", self.ef), ("split.gef", self.gef)):
            context.state[key] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in values.items()})


@client_app.train("split_step")
def split_step(msg: Message, context: Context) -> Message:
    """Apply the gradient the request carries (if it is for the front's current version), run the U-shaped
    head on the server's output it carries (once per batch), compute the activations it asks for, and
    (``collect``) return the trained front (and head) or its encoded update."""
    request = StepRequest.from_message(msg)
    config = msg.content["config"]
    state = _SplitState.load(context)
    partition = int(context.node_config["partition-id"])
    task = _task(config, context)
    features, labels = task.partition(partition)
    stage, optimizer, keys = _front_stage(task, request.cut, config)
    current = (state.session, state.server_round) == (request.session, request.server_round)
    if not current:
        older = state.session == request.session and request.server_round < state.server_round
        if request.front is None or older:  # stale, or cannot start the round without its front
            log.info(
                "split request for round %d ignored (at round %d)", request.server_round, state.server_round
            )
            reply = StepReply(state.server_round, state.session, state.version, applied=False)
            return Message(reply.content(), reply_to=msg)
        head = dict(request.head or {})
        base = _by_model_key(request.front, keys[0]) | _by_model_key(head, keys[2])
        state = _SplitState(
            request.session,
            request.server_round,
            0,
            dict(request.front),
            head,
            base,
            ef=state.ef,
            gef=state.gef,
        )
    _load(stage, optimizer, state)
    settings = RunSettings.split_config(config)
    order = batch_order(len(labels), settings, request.server_round, partition)
    applied = False
    if request.grad_step >= 0 and request.grad_version == state.version:
        seed = step_seed(request.server_round, request.grad_step)  # the seed its forward was given
        stage.backward(request.gradient, features=features[order[request.grad_step]], seed=seed)
        state.version += 1
        applied = True
    head_step, samples = -1, 0
    if request.head_step >= 0 and stage.head is not None:
        if request.head_step > state.head_done and request.head_version == state.version:
            batch = order[request.head_step]
            seed = step_seed(request.server_round, request.head_step)
            gradient, loss = stage.head_step(request.middle, labels[batch], seed=seed)
            optimizer.step()  # only the head has gradients now; the front steps with the cut gradient
            optimizer.zero_grad()
            state.head_done, state.head_reply = request.head_step, (gradient, loss, len(batch))
        if request.head_step == state.head_done:  # done now, or by a request whose reply was lost
            head_step, samples = state.head_done, state.head_reply[2]
    activation = label_bytes = b""
    if request.step >= 0:
        batch = order[request.step]
        activation = stage.forward(features[batch], seed=step_seed(request.server_round, request.step))
        label_bytes = stage.label_payload(labels[batch]) if stage.head is None else b""
        samples = len(batch)
        stage.discard()  # the gradient comes with the next request, which recomputes the forward
    state.front = {k: v.detach().clone() for k, v in stage.front.state_dict().items()}
    if stage.head is not None:
        state.head = {k: v.detach().clone() for k, v in stage.head.state_dict().items()}
    state.optim = {str(i): b.clone() for i, b in optimizer.buffers.items()}
    state.ef, state.gef = dict(stage.link.activation_up.state), dict(stage.link.gradient_up.state)
    spec = RunSettings.update_codec(config)
    dense = request.collect and spec is None
    if request.collect and spec is not None and not state.update:
        residual = load_residual(context, int(config.get("run", 0)))
        now = _by_model_key(state.front, keys[0]) | _by_model_key(state.head, keys[2])
        delta = {k: now[k] - v for k, v in state.base.items()}
        state.update = encode_update(delta, spec, residual, seed=request.server_round)
        save_residual(context, residual)
    state.save(context)
    reply = StepReply(
        request.server_round,
        request.session,
        state.version,
        applied,
        step=request.step,
        activation=activation,
        labels=label_bytes,
        front=state.front if dense else None,
        num_examples=len(labels),
        samples=samples,
        head_step=head_step,
        head_gradient=state.head_reply[0] if head_step >= 0 else b"",
        loss=state.head_reply[1] if head_step >= 0 else 0.0,
        head=state.head if dense and stage.head is not None else None,
        update=state.update if request.collect else b"",
    )
    return Message(reply.content(), reply_to=msg)


def _by_model_key(stage: dict[str, torch.Tensor], keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """A stage's floating tensors by the model's names (what an update is keyed by, as in the driver)."""
    return {keys[k]: v for k, v in stage.items() if v.is_floating_point()}


def _front_stage(
    task: PreparedTask, cut: int, config: ConfigRecord
) -> tuple[FrontStage, MomentumSGD, StageKeys]:
    """The front stage at ``cut`` (and, U-shaped, the head), untrained, and the stages' key maps."""
    model = task.task.model()
    chain = as_chain(model)
    end = len(chain) - RunSettings.head_layers(config)
    front, head = segment(chain, 0, cut), (segment(chain, end) if end < len(chain) else None)
    params = list(front.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer = MomentumSGD(params, float(config["learning-rate"]), float(config["momentum"]))
    link = CutLink(RunSettings.cut_config(config))
    stage = FrontStage(front, optimizer, link, head=head)  # type: ignore[arg-type]  (an optimizer in all but name)
    return stage, optimizer, stage_keys(model, cut, end)


def _load(stage: FrontStage, optimizer: MomentumSGD, state: _SplitState) -> None:
    """The state's weights, optimizer momentum and codec residuals into a fresh stage."""
    stage.front.load_state_dict(state.front)
    if stage.head is not None:
        stage.head.load_state_dict(state.head)
    optimizer.buffers = {int(k): v.clone() for k, v in state.optim.items()}
    stage.link.activation_up.state = dict(state.ef)
    stage.link.gradient_up.state = dict(state.gef)


def _task(config: ConfigRecord, context: Context) -> PreparedTask:
    """This process's prepared instance of the request's task, for this node's split."""
    return prepare_task(
        str(config["task"]),
        str(config["task-args"]),
        int(context.node_config["num-partitions"]),
        alpha=float(config["alpha"]),
        seed=int(config["seed"]),
    )
