"""Pluggable tasks: what is learned, from which data, and how.

A :class:`Task` bundles the model factory, a client's data partition, local training, evaluation and the
server's held-out test set. The reference task, :class:`DigitsTask`, learns the handwritten digits that ship
with scikit-learn (1,797 8×8 images) with a small CNN; clients get non-IID partitions from a Dirichlet split
over labels made by flwr-datasets' ``DirichletPartitioner`` (its data side is :mod:`fedge.app.digits`).
Users plug their own task by import path, ``package.module:TaskClass`` or ``path/to/file.py:TaskClass``,
with keyword arguments for its constructor (see :func:`load_task` and ``docs/tasks.md``).

In every process, a run's task is one instance, prepared once for the run's split (:func:`prepare_task`):
what :meth:`Task.prepare` caches on ``self`` is there for :meth:`Task.load_partition` and
:meth:`Task.test_set`, and a client's partition is loaded once, not every round.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.optim
from torch import nn

from fedge.app.digits import digits_split, dirichlet_partitions
from fedge.app.features import forward, rows, to_numpy
from fedge.app.task_checks import (
    TaskContractError,
    check_class_labels,
    checked_data,
    checked_evaluation,
    task_errors,
)
from fedge.importing import import_attribute

if TYPE_CHECKING:
    from fedge.server.model_export import ExportInputs

__all__ = [
    "DigitsTask",
    "PreparedTask",
    "Task",
    "TaskContractError",
    "TaskLoadError",
    "TensorData",
    "TrainConfig",
    "checked_evaluation",
    "load_task",
    "prepare_task",
    "task_errors",
    "warm_up_torch",
]

TensorData = tuple[Any, torch.Tensor]
"""Features and integer labels of one data split; features are a tensor, or a tuple or dict of tensors for
a model of several inputs (:mod:`fedge.app.features`)."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one local training call.

    Parameters
    ----------
    epochs : int (default: 1)
        Passes over the local data.
    learning_rate : float (default: 0.05)
        SGD step size.
    batch_size : int (default: 32)
        Examples per SGD step.
    momentum : float (default: 0.9)
        SGD momentum; the optimizer is created afresh each call, so momentum does not cross rounds.
    seed : int (default: 0)
        Seeds the shuffling, so the same seed gives the same update.
    proximal_mu : float (default: 0.0)
        FedProx's ``μ`` (Flower's ``FedProx`` sends it as ``proximal-mu``): the default :meth:`Task.train`
        adds ``μ/2 · ‖w − w_global‖²`` to every batch's loss, ``w_global`` being the weights the call began
        with, which keeps a client's model near the global one on skewed data.
    options : mapping of str to value (default: empty)
        The instruction's other config values (a custom strategy's settings, ``server-round``, ...), for a
        task's own ``train``.
    """

    epochs: int = 1
    learning_rate: float = 0.05
    batch_size: int = 32
    momentum: float = 0.9
    seed: int = 0
    proximal_mu: float = 0.0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class TaskLoadError(ValueError):
    """A ``module:Class`` task path that does not import or does not name a :class:`Task`."""


class Task(ABC):
    """A federated learning task: model, data, training and evaluation.

    Subclasses implement :meth:`model`, :meth:`load_partition` and :meth:`test_set`. The default
    :meth:`train` and :meth:`evaluate` fit classification with cross-entropy on :data:`TensorData`.
    A task may take keyword arguments in ``__init__`` (a ``[task]`` table, ``--task-arg key=value``); they
    must be plain values (strings, numbers, booleans, lists, tables): they travel to clients as JSON.

    **Export to ONNX.** When export is on (``export_every``; the coordinator service exports every round by
    default), the coordinator exports the global model after rounds
    (:mod:`fedge.server.model_export`): the module exported is :meth:`model` with the round's global weights
    loaded, in eval mode, called as ``module(x)`` on one tensor batch (a tuple or dict of them for a model
    of several inputs: :mod:`fedge.server.model_inputs`; floating inputs as float32, integer and boolean
    ones such as token ids and masks in their own type), returning a tensor, or a tuple, list or dict of
    tensors (exported as outputs ``logits``, ``logits_1``, ...; every one verified), whose axis 0 is the
    batch. :meth:`export_inputs` supplies the example input, the held-out inputs the file is verified on
    (ONNX Runtime within 1e-4 of torch at batch 1 and 8), int8 calibration inputs and labelled data for the
    manifest's accuracy; by default it slices :meth:`test_set`. A model the exporter cannot handle (a
    forward that leaves torch, say) fails each export: a warning in the log, ``export_failures`` in the
    round's metrics, and the run goes on. A task whose model is not
    meant to be exported returns None from :meth:`export_inputs`: nothing is exported and the log says so.
    """

    reuse_model: bool = False
    """Whether a client process may build :meth:`model` once and load each call's weights into it.

    Building a model costs more than loading weights into one (0.5-0.9 ms against 0.1 ms for the digits
    CNN, on every ClientApp call). A reused model gets every entry of its ``state_dict`` replaced (strictly)
    and its gradients cleared on each call, so nothing of an earlier call's weights survives; but whatever
    else a call leaves on the module (hooks, ``requires_grad`` changes, pruning, its mode, attributes,
    non-persistent buffers) would reach the next call, of another client. So it is off unless a task says
    its :meth:`train` and :meth:`evaluate` leave nothing of the kind (fedge's own tasks do)."""

    @abstractmethod
    def model(self) -> nn.Module:
        """A freshly initialised model (seed torch beforehand for reproducible weights)."""

    @abstractmethod
    def load_partition(
        self, partition_id: int, num_partitions: int, *, alpha: float, seed: int
    ) -> TensorData:
        """The training data of client ``partition_id`` out of ``num_partitions``.

        Parameters
        ----------
        partition_id : int
            Which client, ``0 <= partition_id < num_partitions``.
        num_partitions : int
            How many clients share the training data.
        alpha : float
            Concentration of the Dirichlet split over labels: small is non-IID, large approaches IID.
        seed : int
            Seeds the split, so every process computes the same partitions.
        """

    @abstractmethod
    def test_set(self, num_partitions: int, *, alpha: float, seed: int) -> TensorData:
        """The held-out test split the server evaluates the global model on.

        It gets the run's split (as :meth:`load_partition` does), so a test set pooled from held-out
        client data can be built without hard-coding them.
        """

    def prepare(self, num_partitions: int, *, alpha: float, seed: int) -> None:  # noqa: B027 (optional hook)
        """One-time work for a run's split (partitioning, caching), before any other call on this instance.

        Called once per process on the very instance that then serves :meth:`load_partition` and
        :meth:`test_set`, so caching on ``self`` works. The local engine prepares before it forks its
        workers, so they inherit what was prepared. The default does nothing.
        """

    def train(self, model: nn.Module, data: TensorData, config: TrainConfig) -> dict[str, float]:
        """Train ``model`` in place on ``data`` (cross-entropy on integer class labels); return ``train_loss``
        and ``num-examples``."""
        features, labels = data
        check_class_labels(labels, "train")
        generator = torch.Generator().manual_seed(config.seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum)
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        anchor = [p.detach().clone() for p in model.parameters()] if config.proximal_mu > 0 else []
        total, seen = 0.0, 0
        # BatchNorm in training mode refuses a batch of one: a last batch of one row joins the one before
        batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        for _ in range(config.epochs):
            order = torch.randperm(len(labels), generator=generator)
            bounds = [*range(0, len(order), config.batch_size), len(order)]
            if batch_norm and len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
                del bounds[-2]
            for start, stop in itertools.pairwise(bounds):
                batch = order[start:stop]
                optimizer.zero_grad()
                loss = loss_fn(forward(model, rows(features, batch)), labels[batch])
                total += loss.item() * len(batch)
                if anchor:  # FedProx: the proximal term, outside the reported loss
                    drift = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
                    loss = loss + config.proximal_mu / 2 * drift
                loss.backward()
                optimizer.step()
                seen += len(batch)
        return {"train_loss": total / max(seen, 1), "num-examples": float(len(labels))}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TensorData) -> dict[str, float]:
        """Return ``loss``, ``accuracy`` and ``num-examples`` of ``model`` on ``data`` (class labels)."""
        features, labels = data
        check_class_labels(labels, "evaluate")
        model.eval()
        logits = forward(model, features)
        loss = nn.functional.cross_entropy(logits, labels).item() if len(labels) else 0.0
        correct = (logits.argmax(dim=1) == labels).sum().item()
        return {"loss": loss, "accuracy": correct / max(len(labels), 1), "num-examples": float(len(labels))}

    def export_inputs(self, test_set: TensorData) -> ExportInputs | None:
        """What the coordinator exports the global model to ONNX with; None: the model is not exported.

        Called once per run on the coordinator, with the run's :meth:`test_set`, and only when export is on.
        The default takes the test features (floating ones as float32; integer ones, such as token ids, as
        they are): ``example`` the first 2 rows, ``held_out`` the first 8 (verification at batch 1 and 8),
        ``calibration`` the first 256 (the int8-static variant's activation ranges), ``labelled`` the whole
        test set (each variant's accuracy, measured with ONNX Runtime, in its manifest). Override it to
        calibrate on other data, to bound the cost of the accuracy measurement on a large test set, or to
        return None for a model that must not be exported.
        """
        from fedge.server.model_export import ExportInputs

        features, labels = to_numpy(test_set[0]), test_set[1].detach().cpu().numpy()
        return ExportInputs(
            example=rows(features, slice(0, 2)),
            held_out=rows(features, slice(0, 8)),
            calibration=rows(features, slice(0, 256)),
            labelled=(features, labels),
        )


def load_task(path: str, args: Mapping[str, Any] | None = None) -> Task:
    """Instantiate a task from ``"package.module:TaskClass"`` (or ``"file.py:TaskClass"``) with ``args``.

    Raises
    ------
    TaskLoadError
        If the path does not import, does not name a :class:`Task` subclass, or its constructor refuses
        ``args`` (the message names the task and the problem).
    """
    cls = import_attribute(path, "task", TaskLoadError)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskLoadError(f"{path!r} does not name a fedge.app.task.Task subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TaskLoadError(f"task {path!r} is abstract: it lacks {missing}")
    args = dict(args or {})
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as err:  # a name the constructor has no parameter for, or one it needs and lacks
        raise TaskLoadError(f"task {path!r} does not take these arguments: {err}") from None
    except ValueError:  # no signature to read (a C-level constructor): the call below tells
        pass
    try:
        return cls(**args)
    except Exception as err:  # the task's own checks of its arguments, or a value of the wrong type
        detail = f"{type(err).__name__}: {err}" if isinstance(err, TypeError) else str(err)
        raise TaskLoadError(f"task {path!r} refused its arguments: {detail}") from None


class PreparedTask:
    """A task instance prepared for one run's split, its clients' partitions cached.

    Parameters
    ----------
    task : Task
        The instance; :meth:`Task.prepare` is called on it here.
    num_partitions : int
        Clients sharing the training data.
    alpha : float
        Dirichlet concentration of the split.
    seed : int
        The run's seed.
    cached_partitions : int (default: 128)
        Partitions kept in memory (a worker process of the local engine serves many clients).
    """

    def __init__(
        self, task: Task, num_partitions: int, *, alpha: float, seed: int, cached_partitions: int = 128
    ) -> None:
        self.task = task
        self.num_partitions, self.alpha, self.seed = num_partitions, alpha, seed
        self._cache_size = cached_partitions
        self._partitions: OrderedDict[int, TensorData] = OrderedDict()
        self._lock = threading.Lock()  # the thread-pool engine shares one instance between clients
        self._models = threading.local()  # ... so each of its threads reuses a model of its own
        task.prepare(num_partitions, alpha=alpha, seed=seed)

    def client_model(self) -> nn.Module:
        """A model for a client call to load its weights into: this thread's, built once and reused when
        the task allows it (:attr:`Task.reuse_model`), else a fresh one."""
        if not _may_reuse(self.task):
            return self.task.model()
        model = getattr(self._models, "model", None)
        if model is None:
            model = self._models.model = self.task.model()
        model.zero_grad(set_to_none=True)  # a training loop that steps before zeroing must not see old ones
        return model

    def partition(self, partition_id: int) -> TensorData:
        """Client ``partition_id``'s training data, loaded once while it stays in the cache."""
        with self._lock:
            if partition_id in self._partitions:
                self._partitions.move_to_end(partition_id)
                return self._partitions[partition_id]
        data = self.task.load_partition(partition_id, self.num_partitions, alpha=self.alpha, seed=self.seed)
        data = checked_data(data, f"load_partition({partition_id}, ...)")
        with self._lock:
            self._partitions[partition_id] = data
            while len(self._partitions) > self._cache_size:
                self._partitions.popitem(last=False)
        return data

    def test_set(self) -> TensorData:
        """The task's held-out test split for this run (at least one row)."""
        features, labels = checked_data(
            self.task.test_set(self.num_partitions, alpha=self.alpha, seed=self.seed), "test_set()"
        )
        if len(labels) == 0:  # every round would report 0 % and a loss of 0.0: figures of nothing
            raise TaskContractError("test_set() returned no rows: there is nothing to measure the model on")
        return features, labels


def _may_reuse(task: Task) -> bool:
    """Whether ``task`` said its model may be reused (:attr:`Task.reuse_model`), for the ``model``,
    ``train`` and ``evaluate`` it has: a subclass that overrides one of them has not said it of its own."""
    cls = type(task)
    owner = next(c for c in cls.__mro__ if "reuse_model" in vars(c))
    methods = ("model", "train", "evaluate")
    return bool(owner.reuse_model) and all(getattr(cls, name) is getattr(owner, name) for name in methods)


def prepare_task(path: str, args_json: str, num_partitions: int, *, alpha: float, seed: int) -> PreparedTask:
    """This process's prepared instance of a run's task (one per task, arguments and split).

    ``args_json`` is the constructor's keyword arguments as JSON (hashable, and how they travel).
    """
    return _prepared(path, args_json, num_partitions, float(alpha), int(seed))


@lru_cache(maxsize=8)
def _prepared(path: str, args_json: str, num_partitions: int, alpha: float, seed: int) -> PreparedTask:
    try:
        args = json.loads(args_json or "{}")
    except ValueError as err:
        raise TaskLoadError(f"task arguments are not JSON: {err}") from None
    if not isinstance(args, dict):
        raise TaskLoadError("task arguments must be a JSON object")
    task = load_task(path, args)
    with task_errors(path, "prepare()"):
        return PreparedTask(task, num_partitions, alpha=alpha, seed=seed)


def warm_up_torch() -> None:
    """Build one optimizer, so this process pays TorchDynamo's import now rather than in a client call.

    ``torch.optim`` imports TorchDynamo the first time an optimizer is built: about 1.4 s. The local engine's
    parent does it before forking its workers, and an agent or a Ray actor once when it loads the ClientApp.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions, one pooling, two dense layers: ~72k parameters for 8×8 digits."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DigitsTask(Task):
    """scikit-learn's handwritten digits, a small CNN, Dirichlet non-IID clients.

    The test split (20%, stratified, fixed seed) never changes with the run's seed, so accuracies of
    different runs are comparable.
    """

    reuse_model = True  # train and evaluate leave nothing on the module but its weights

    def model(self) -> nn.Module:
        return DigitsCNN()

    def load_partition(
        self, partition_id: int, num_partitions: int, *, alpha: float, seed: int
    ) -> TensorData:
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition_id {partition_id} is outside 0..{num_partitions - 1}")
        indices = dirichlet_partitions(num_partitions, alpha, seed)[partition_id]
        features, labels = digits_split("train")
        return features[indices], labels[indices]

    def test_set(self, num_partitions: int, *, alpha: float, seed: int) -> TensorData:
        return digits_split("test")

    def prepare(self, num_partitions: int, *, alpha: float, seed: int) -> None:
        # Loaded before the engine starts its clients, so forked client processes inherit their data.
        dirichlet_partitions(num_partitions, alpha, seed)
        digits_split("train")

    def export_inputs(self, test_set: TensorData) -> ExportInputs | None:
        """The default's, but int8-static calibrates on training images (the test set stays unseen)."""
        inputs = super().export_inputs(test_set)
        train_features = digits_split("train")[0][:256].numpy()
        return dataclasses.replace(inputs, calibration=train_features) if inputs is not None else None
