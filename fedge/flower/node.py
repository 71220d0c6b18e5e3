"""Running a ClientApp for one node, as a SuperNode does: its Context, and failures as error replies.

The local engine's worker processes and the device agent both run a Flower ClientApp for one node at a
time; they share this code so that a node's Context is built the same way and an exception in user code
becomes the same error reply (never a crash of the worker or the agent).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

__all__ = ["call_client_app", "cap_reason", "describe_node", "error_reply", "make_context"]

log = logging.getLogger(__name__)

_MAX_REASON_CHARS = 4000  # an error reply carries the traceback's tail, not megabytes of it
_MAX_REASON_LINES = 60  # a deep traceback's frames; not 50,000 lines a node sent to flood the log


def make_context(run_id: int, node_id: int, node_config: Mapping[str, Any]) -> Context:
    """A node's fresh Context: its config, empty state, no run config (as a SuperNode starts it)."""
    return Context(
        run_id=run_id, node_id=node_id, node_config=dict(node_config), state=RecordDict(), run_config={}
    )


def describe_node(context: Context) -> str:
    """How people know the node: its partition (what a task author chose) or else its name or id."""
    config = context.node_config
    if "partition-id" in config:
        return f"partition {config['partition-id']}"
    if "node-name" in config:
        return f"node {config['node-name']}"
    return f"node {context.node_id}"


def error_reply(message: Message, code: int, reason: str) -> Message:
    """An error reply to ``message`` (Flower's way of saying the ClientApp did not produce content), its
    reason capped by :func:`cap_reason`."""
    return Message(Error(code=code, reason=cap_reason(reason)), reply_to=message)


def cap_reason(reason: str) -> str:
    """A long error reason's head (who failed) and tail (the exception), within a few kB and 60 lines.

    A coordinator caps the reasons nodes send it too: they reach its log and its audit.
    """
    lines = reason.splitlines()
    if len(lines) > _MAX_REASON_LINES:
        head = _MAX_REASON_LINES // 6
        reason = "\n".join([*lines[:head], "...", *lines[head - _MAX_REASON_LINES + 1 :]])
    if len(reason) > _MAX_REASON_CHARS:
        half = _MAX_REASON_CHARS // 2
        reason = f"{reason[:half]}\n...\n{reason[-half:]}"
    return reason


def call_client_app(client_app: ClientApp, message: Message, context: Context) -> Message:
    """``client_app(message, context)``; an exception becomes an error reply naming the node (its partition,
    as people know it) and carrying the traceback.

    The Context keeps whatever the app changed before it raised, as a SuperNode's would.
    """
    try:
        return client_app(message, context)
    except Exception as err:  # a failing client must not stop the round, the worker or the agent
        node = describe_node(context)
        log.info("ClientApp on %s raised: %r", node, err)  # the round's summary warns, once
        return error_reply(
            message, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{node}: {traceback.format_exc()}"
        )
