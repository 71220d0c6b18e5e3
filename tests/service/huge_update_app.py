"""A ClientApp for the service tests: the reference app, except that in round 2 it replies its update 1,000
times over (finite, and under every norm bound a lone reply meets: 10,000 times the model's norm; the
aggregate's loss blows up, so the round is rolled back). 1e15 in every weight would be refused by the screen
itself now, as a norm outlier against the model."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.clientapp import ClientApp

from fedge.app.client_app import app as reference_app
from fedge.protocol.records import record_to_arrays

HUGE_ROUND = 2
BOOST = 1000


def _boosted_in_round_two(msg: Message, context: Context) -> Message:
    reply = reference_app(msg, context)
    config = msg.content["config"] if msg.metadata.message_type == MessageType.TRAIN else {}
    if reply.has_error() or int(config.get("server-round", 0)) != HUGE_ROUND:
        return reply
    received, _ = record_to_arrays(msg.content["arrays"])
    trained, _ = record_to_arrays(reply.content["arrays"])
    boosted = {
        n: received[n] + BOOST * (v - received[n]) if v.dtype.kind == "f" else v for n, v in trained.items()
    }
    reply.content["arrays"] = ArrayRecord({name: Array(values) for name, values in boosted.items()})
    return reply


app = ClientApp()
app.train()(_boosted_in_round_two)
