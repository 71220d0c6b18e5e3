"""The reference ClientApp: train and evaluate the task's model on this node's partition.

Everything a client needs arrives in the instruction (task path, split, hyper-parameters) or in the node's
config (``partition-id``, ``num-partitions``), so the same ClientApp runs unchanged under every engine.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedge.app.task import Task, TensorData, TrainConfig, load_task
from fedge.client.compression_mod import CompressionMod

__all__ = ["app", "local_seed"]

# The mod compresses replies only when the coordinator's train message asks for it; otherwise it is inert.
app = ClientApp(mods=[CompressionMod()])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global model, train on the local partition, reply with the new weights."""
    config = msg.content["config"]
    task, model = _received_model(msg)
    partition_id = int(context.node_config["partition-id"])
    train_config = TrainConfig(
        epochs=int(config["local-epochs"]),
        learning_rate=float(config["learning-rate"]),
        batch_size=int(config["batch-size"]),
        seed=local_seed(int(config["seed"]), partition_id, int(config.get("server-round", 0))),
    )
    metrics = task.train(model, _partition(config, context), train_config)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local partition."""
    config = msg.content["config"]
    task, model = _received_model(msg)
    metrics = task.evaluate(model, _partition(config, context))
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def local_seed(seed: int, partition_id: int, server_round: int) -> int:
    """A stable per-client, per-round seed (Python's ``hash`` of strings changes between processes)."""
    return zlib.crc32(f"{seed}/{partition_id}/{server_round}".encode())


@lru_cache(maxsize=4)
def _task(path: str) -> Task:
    return load_task(path)


def _received_model(msg: Message) -> tuple[Task, nn.Module]:
    """The instruction's task and its model, loaded with the weights that came with it."""
    task = _task(str(msg.content["config"]["task"]))
    model = task.model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return task, model


def _partition(config: ConfigRecord, context: Context) -> TensorData:
    task = _task(str(config["task"]))
    return task.load_partition(
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        alpha=float(config["alpha"]),
        seed=int(config["seed"]),
    )
