"""A ClientApp for the service tests: the reference app, except that in round 2 it replies 1e15 in every
floating weight (finite, and so is its norm, so it passes the screen when it is the round's only reply; its
average's loss is NaN). 1e30 would be refused by the screen itself: its norm overflows float32."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.clientapp import ClientApp

from fedge.app.client_app import app as reference_app
from fedge.protocol.records import record_to_arrays

HUGE_ROUND = 2


def _huge_in_round_two(msg: Message, context: Context) -> Message:
    reply = reference_app(msg, context)
    config = msg.content["config"] if msg.metadata.message_type == MessageType.TRAIN else {}
    if reply.has_error() or int(config.get("server-round", 0)) != HUGE_ROUND:
        return reply
    arrays, _ = record_to_arrays(reply.content["arrays"])
    huge = {n: np.full_like(v, 1e15) if v.dtype.kind == "f" else v for n, v in arrays.items()}
    reply.content["arrays"] = ArrayRecord({name: Array(values) for name, values in huge.items()})
    return reply


app = ClientApp()
app.train()(_huge_in_round_two)
