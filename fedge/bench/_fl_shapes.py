"""The shapes check of ``fedge bench fl-compression``: does every preset stay below dense on every model?

For each model (a tiny linear model, a 30-32-2 MLP whose biases are a few elements long, a CNN with
BatchNorm and its 0-d ``num_batches_tracked``, the digits CNN) and each preset, one round is played
through the real protocol code, without training: the coordinator's :class:`CompressedChannel` builds the
train instructions (a full model in round 1, a delta in round 2), a client update of typical size goes
through error feedback, the codec and :func:`fedge.compression.bind` into a reply, and every message is
measured as fedge's MQTT transport sends it (:func:`fedge.protocol.envelope.wire_size`). Dense is
Flower's FedAvg messages of the same model. Also measured: the bytes of one top-k reply beyond its codec
payload (values and positions), ``reply_overhead_bytes``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from fedge.app.presets import PRESETS
from fedge.compression import ErrorFeedback, Schema, bind, build_codec, inspect_payload
from fedge.flower.compat import set_message_id, set_task_identity
from fedge.protocol.envelope import wire_size
from fedge.protocol.records import UPDATE_KEY, arrays_to_record, record_to_arrays
from fedge.server import CompressedChannel, CompressionConfig, DownlinkConfig

__all__ = ["reply_overhead", "shapes_check"]

NODE = 1234567890123
METRICS = {"num-examples": 88, "train_loss": 0.7312}


def _models() -> dict[str, nn.Module]:
    from fedge.app.task import DigitsCNN

    torch.manual_seed(0)
    return {
        "linear 64-10": nn.Linear(64, 10),
        "mlp 30-32-2": nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2)),
        "cnn+batchnorm": nn.Sequential(
            nn.Conv2d(1, 8, 3, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 6 * 6, 10),
        ),
        "digits cnn": DigitsCNN(),
    }


def shapes_check() -> dict[str, Any]:
    """Per model and preset: upload and download message bytes against dense; ``never_inflates``."""
    set_task_identity(run_id=1)
    rows = []
    for model_name, module in _models().items():
        arrays, dtypes = record_to_arrays(ArrayRecord(module.state_dict()))
        dense_down, dense_up = _dense_sizes(arrays, dtypes)
        for preset, settings in PRESETS.items():
            down_full, down_delta, up = _compressed_sizes(settings, arrays, dtypes)
            rows.append(
                {
                    "model": model_name,
                    "preset": preset,
                    "parameters": int(sum(a.size for a in arrays.values())),
                    "dense_down": dense_down,
                    "down_full": down_full,
                    "down_delta": down_delta,
                    "dense_up": dense_up,
                    "up": up,
                    "ok": max(down_full, down_delta) <= dense_down and up <= dense_up,
                }
            )
    return {"never_inflates": all(row["ok"] for row in rows), "rows": rows}


def reply_overhead(spec: str = "topk:0.01+int8;min=0,patterns=") -> dict[str, int]:
    """Wire bytes of one top-k reply of the digits CNN beyond its codec payload's values and positions."""
    from fedge.app.task import DigitsCNN

    set_task_identity(run_id=1)
    torch.manual_seed(0)
    arrays, dtypes = record_to_arrays(ArrayRecord(DigitsCNN().state_dict()))
    codec = build_codec(spec)
    payload = codec.encode(_update(arrays), seed=1, dtypes=dtypes)
    bound = bind(payload, Schema.of(codec, arrays, dtypes))
    wire = wire_size(_reply(_instruction(arrays, dtypes), bound))
    body = sum(t.position_bytes + t.value_bytes for t in inspect_payload(payload).tensors)
    return {"reply_wire_bytes": wire, "payload_body_bytes": body, "reply_overhead_bytes": wire - body}


def _update(arrays: dict[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """A client update of typical size: 1 % of each weight's magnitude, random signs."""
    rng = np.random.default_rng(seed)
    return {
        name: (0.01 * (np.abs(a) + 1e-3) * rng.standard_normal(a.shape)).astype(np.float32)
        for name, a in arrays.items()
    }


def _instruction(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> Message:
    from fedge.app.config import AppConfig
    from fedge.app.server_app import train_config_record

    config = train_config_record(AppConfig())
    content = RecordDict({"arrays": arrays_to_record(arrays, dtypes), "config": config})
    message = Message(content, dst_node_id=NODE, message_type=MessageType.TRAIN)
    set_message_id(message, "0" * 32)
    return message


def _reply(instruction: Message, payload: bytes | None, trained: RecordDict | None = None) -> Message:
    content = RecordDict({"metrics": MetricRecord(METRICS)})
    if payload is not None:
        content[UPDATE_KEY] = ConfigRecord({"payload": payload, "base": 2})
    for key, value in (trained or {}).items():
        content[key] = value
    return Message(content, reply_to=instruction)


def _dense_sizes(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> tuple[int, int]:
    """Flower's FedAvg: the model and the config down, the trained model and metrics up."""
    instruction = _instruction(arrays, dtypes)
    trained = {k: v + u for (k, v), u in zip(arrays.items(), _update(arrays).values(), strict=True)}
    reply = _reply(instruction, None, RecordDict({"arrays": arrays_to_record(trained, dtypes)}))
    return wire_size(instruction), wire_size(reply)


def _compressed_sizes(
    settings: dict[str, Any], arrays: dict[str, np.ndarray], dtypes: dict[str, str]
) -> tuple[int, int, int]:
    """Round 1 (full model down), round 2 (delta down) and one reply up, through the real channel."""
    channel = CompressedChannel(
        CompressionConfig(
            codec=settings["codec"],
            ef_momentum=settings["ef_momentum"],
            downlink=DownlinkConfig(settings["downlink_codec"]),
        )
    )
    sizes = []
    model = {name: array.copy() for name, array in arrays.items()}
    for server_round in (1, 2):
        (message,) = channel.instruct(server_round, [_instruction(model, dtypes)], model, dtypes)
        sizes.append(wire_size(message))
        shapes = {name: array.shape for name, array in model.items()}
        codec = build_codec(settings["codec"])
        payload = ErrorFeedback(codec, momentum=settings["ef_momentum"]).encode(
            _update(model, server_round), {}, seed=server_round, dtypes=dtypes
        )
        bound = bind(payload, Schema.of(codec, model, dtypes)) or payload
        reply = _reply(message, bound)
        reply.content[UPDATE_KEY]["base"] = server_round
        (accepted,) = channel.receive(server_round, [reply], shapes)  # screened, and the node's model noted
        channel.count(server_round, [accepted.node_id])
        up = wire_size(reply)
        for name, update in _update(model, 7 + server_round).items():  # the global model moves
            model[name] += update
    return sizes[0], sizes[1], up
