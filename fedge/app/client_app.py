"""The reference ClientApp: train and evaluate the task's model on this node's partition.

Everything a client needs arrives in the instruction (task path and arguments, split, hyper-parameters) or
in the node's config (``partition-id``, ``num-partitions``), so the same ClientApp runs unchanged under
every engine.
"""

from __future__ import annotations

import zlib
from functools import lru_cache
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedge.app.attacks import AttackMod, flip_labels, is_attacker
from fedge.app.backdoor import plant, trigger_values
from fedge.app.seeding import seeded
from fedge.app.task import PreparedTask, TrainConfig, prepare_task, warm_up_torch
from fedge.app.task_checks import TaskContractError, checked_evaluation, task_errors
from fedge.app.weights import load_record, state_record
from fedge.client.compression_mod import CompressionMod
from fedge.protocol.records import as_number

__all__ = ["app", "local_seed"]

# The mod compresses replies only when the coordinator's train message asks for it; otherwise it is inert.
# AttackMod, inside it, poisons the trained weights only when the train config names an attack (simulations).
app = ClientApp(mods=[CompressionMod(), AttackMod()])

# Whoever loads the ClientApp (the local engine before it forks, an agent, a Ray actor) pays this once.
warm_up_torch()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global model, train on the local partition, reply with the new weights."""
    config = msg.content["config"]
    partition_id, seed = _call_seed(config, context)
    # The call's own random streams (the model's construction, dropout, augmentation): the same draws on
    # whichever worker runs it, and the process's generators as they were once it returns.
    with seeded(seed):
        return _train(msg, context, config, partition_id, seed)


def _train(msg: Message, context: Context, config: ConfigRecord, partition_id: int, seed: int) -> Message:
    task = _task(config, context)
    model = _received_model(task, msg)
    train_config = TrainConfig(
        epochs=int(config["local-epochs"]),
        learning_rate=float(config["learning-rate"]),
        batch_size=int(config["batch-size"]),
        seed=seed,
        proximal_mu=float(config.get("proximal-mu", 0.0)),
        options=dict(config),
    )
    features, labels = task.partition(partition_id)
    if is_attacker(config, context.node_config, "label-flip"):  # simulated data poisoning
        # classes the test set lacks may still be in this partition: never flip a label below zero
        labels = flip_labels(labels, max(_num_classes(task), int(labels.max()) + 1 if len(labels) else 0))
    if is_attacker(config, context.node_config, "backdoor"):
        features, labels = plant(features, labels, _trigger_values(task), seed=train_config.seed)
    with task_errors(str(config["task"]), "train()"):  # the reply's error then names the user's call
        result = task.task.train(model, (features, labels), train_config)
    content = RecordDict(
        {"arrays": state_record(model), "metrics": _train_metrics(result, str(config["task"]))}
    )
    return Message(content=content, reply_to=msg)


def _train_metrics(result: Any, task: str) -> MetricRecord:
    """What a task's train() returned, as numbers; one line naming the figure that is not one."""
    if not isinstance(result, dict):
        raise TaskContractError(f"task {task}: train() returned {type(result).__name__}, not a dict")
    metrics = {}
    for key, value in result.items():
        numbers = [as_number(v) for v in value] if isinstance(value, list) else None
        if numbers is not None and None not in numbers:  # a MetricRecord holds lists of numbers too
            metrics[str(key)] = numbers
            continue
        if (number := as_number(value)) is None:
            raise TaskContractError(f"task {task}: train() returned {key!r} = {value!r:.60}, not a number")
        metrics[str(key)] = number
    return MetricRecord(metrics)


@app.query("partition")
def partition(msg: Message, context: Context) -> Message:
    """This node's ``partition-id``: how a simulation's ServerApp tells which client a node id stands for
    (Flower's simulation engine draws node ids at random)."""
    metrics = MetricRecord({"partition-id": int(context.node_config["partition-id"])})
    return Message(content=RecordDict({"node": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local partition; reply with the task's numbers and, unless it
    gave one, ``num-examples`` (the partition's size), which Flower's strategies weigh evaluations by."""
    config = msg.content["config"]
    partition_id, seed = _call_seed(config, context)
    with seeded(seed, stream=1):
        task = _task(config, context)
        model = _received_model(task, msg)
        data = task.partition(partition_id)
        result = checked_evaluation(task.task.evaluate(model, data), str(config["task"]))
    metrics = {key: number for key, value in result.items() if (number := as_number(value)) is not None}
    metrics.setdefault("num-examples", float(len(data[1])))
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def _call_seed(config: ConfigRecord, context: Context) -> tuple[int, int]:
    """This node's partition id and the call's seed (its run seed, partition and round)."""
    partition_id = int(context.node_config["partition-id"])
    return partition_id, local_seed(int(config["seed"]), partition_id, int(config.get("server-round", 0)))


def local_seed(seed: int, partition_id: int, server_round: int) -> int:
    """A stable per-client, per-round seed (Python's ``hash`` of strings changes between processes)."""
    return zlib.crc32(f"{seed}/{partition_id}/{server_round}".encode())


def _task(config: ConfigRecord, context: Context) -> PreparedTask:
    """This process's prepared instance of the instruction's task, for this node's split."""
    return prepare_task(
        str(config["task"]),
        str(config.get("task-args", "{}")),
        int(context.node_config["num-partitions"]),
        alpha=float(config["alpha"]),
        seed=int(config["seed"]),
    )


@lru_cache(maxsize=8)
def _num_classes(task: PreparedTask) -> int:
    """Classes of a classification task, from its test labels (for label flipping), once per task."""
    return int(task.test_set()[1].max()) + 1


@lru_cache(maxsize=8)
def _trigger_values(task: PreparedTask) -> Any:
    """The backdoor trigger's values for a task (from its test features), once per task."""
    return trigger_values(task.test_set()[0])


def _received_model(task: PreparedTask, msg: Message) -> nn.Module:
    """The task's model (reused between calls where the task allows), loaded with the weights that came
    with the instruction."""
    return load_record(task.client_model(), msg.content["arrays"])
