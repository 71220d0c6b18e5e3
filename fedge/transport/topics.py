"""The fedge topic tree: one subtree per node so broker ACLs can isolate nodes.

::

    fedge/<fleet>/node/<node_id>/in        coordinator -> node   DATA, PROBE
    fedge/<fleet>/node/<node_id>/in/ack    node -> coordinator   ACK for inbox transfers
    fedge/<fleet>/node/<node_id>/out       node -> coordinator   DATA, PROBE
    fedge/<fleet>/node/<node_id>/out/ack   coordinator -> node   ACK for outbox transfers
    fedge/<fleet>/presence/<node_id>       node (and its will)   PRESENCE, retained

The ACK topic of a data topic is always the data topic plus ``/ack``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedge.protocol.fleet import is_valid_name, validate_name

__all__ = ["Topics", "ack_topic"]


def ack_topic(data_topic: str) -> str:
    """The topic on which the receiver of ``data_topic`` acknowledges."""
    return data_topic + "/ack"


@dataclass(frozen=True)
class Topics:
    """Topic names of one fleet.

    Parameters
    ----------
    fleet : str
        Name of the fleet (one coordinator and its nodes); one topic level.
    """

    fleet: str

    def __post_init__(self) -> None:
        validate_name(self.fleet, "fleet")

    @property
    def _root(self) -> str:
        return f"fedge/{self.fleet}"

    def inbox(self, node_id: str) -> str:
        """Data to ``node_id``."""
        return f"{self._root}/node/{validate_name(node_id, 'node id')}/in"

    def outbox(self, node_id: str) -> str:
        """Data from ``node_id``."""
        return f"{self._root}/node/{validate_name(node_id, 'node id')}/out"

    def presence(self, node_id: str) -> str:
        """Retained status of ``node_id``."""
        return f"{self._root}/presence/{validate_name(node_id, 'node id')}"

    @property
    def all_outboxes(self) -> str:
        """Subscription filter for every node's outbox."""
        return f"{self._root}/node/+/out"

    @property
    def all_inbox_acks(self) -> str:
        """Subscription filter for every node's acknowledgements of inbox transfers."""
        return f"{self._root}/node/+/in/ack"

    @property
    def all_presence(self) -> str:
        """Subscription filter for every node's status."""
        return f"{self._root}/presence/+"

    def artifact(self, name: str) -> str:
        """Retained, signed header of the newest version of artifact ``name``."""
        return f"{self._root}/artifact/{validate_name(name, 'artifact name')}"

    def artifact_chunk(self, name: str, version: str, index: int) -> str:
        """Retained chunk ``index`` of one artifact version."""
        return f"{self.artifact(name)}/{validate_name(version, 'artifact version')}/{int(index)}"

    def artifact_chunks(self, name: str, version: str) -> str:
        """Subscription filter for every chunk of one artifact version."""
        return f"{self.artifact(name)}/{validate_name(version, 'artifact version')}/+"

    def infer_request(self, node_id: str) -> str:
        """Inference requests to ``node_id`` (MQTT 5 response topic and correlation data)."""
        return f"{self._root}/infer/{validate_name(node_id, 'node id')}/request"

    def infer_status(self, node_id: str) -> str:
        """Retained serving status of ``node_id``: model version and latency percentiles."""
        return f"{self._root}/infer/{validate_name(node_id, 'node id')}/status"

    @property
    def all_infer_status(self) -> str:
        """Subscription filter for every node's serving status."""
        return f"{self._root}/infer/+/status"

    def infer_reply(self, requester: str, node_id: str | None = None) -> str:
        """Where ``node_id`` answers the inference requests of ``requester`` (their response topic); without
        ``node_id``, the level under which every device's answers to ``requester`` go.

        ``requester`` is the requester's broker username (its client id on a broker without users): the
        device's id ends the topic so that the broker's ACL lets only that device write it, and only that
        user read it (:meth:`mosquitto_acl`; a client id would not do, since any user may claim one).
        """
        base = f"{self._root}/infer-reply/{validate_name(requester, 'requester (username or client id)')}"
        return base if node_id is None else f"{base}/{validate_name(node_id, 'node id')}"

    def is_infer_reply(self, topic: str, node_id: str) -> bool:
        """Whether ``topic`` is one of :meth:`infer_reply`'s for ``node_id``: where a device may answer. A
        request names its response topic, and a device that answered on any topic it was given published on
        the fleet's artifact, status and other devices' request topics for whoever asked (inference sweep;
        without the deploy ACL nothing else stops it)."""
        prefix = f"{self._root}/infer-reply/"
        requester, _, node = topic.removeprefix(prefix).partition("/")
        return topic.startswith(prefix) and node == node_id and bool(requester) and "/" not in requester

    def mosquitto_acl(self, coordinator_user: str = "coordinator") -> str:
        """A Mosquitto ACL file that confines each node (username == node id) to its own topics.

        The coordinator reads outboxes, inbox acknowledgements and presence, and writes inboxes and outbox
        acknowledgements: it cannot speak as a node (``deploy/mosquitto/acl`` is the same, for any fleet).
        """
        root = self._root
        return "\n".join(
            [
                f"user {coordinator_user}",
                f"topic read {self.all_outboxes}",
                f"topic read {self.all_inbox_acks}",
                f"topic read {self.all_presence}",
                f"topic write {root}/node/+/in",
                f"topic write {root}/node/+/out/ack",
                f"topic write {root}/artifact/#",
                f"topic read {root}/infer/+/status/#",
                f"topic write {root}/infer/+/request",
                "",
                f"pattern read {root}/node/%u/in",
                f"pattern write {root}/node/%u/in/ack",
                f"pattern write {root}/node/%u/out",
                f"pattern read {root}/node/%u/out/ack",
                f"pattern readwrite {root}/presence/%u",
                f"pattern read {root}/infer/%u/request",
                f"pattern write {root}/infer/%u/status/#",
                f"pattern read {root}/artifact/#",
                # answers: a requester reads its own (by username); a device writes only as itself
                f"pattern read {root}/infer-reply/%u/#",
                f"pattern write {root}/infer-reply/+/%u",
                "",
            ]
        )

    def node_of(self, topic: str) -> str | None:
        """The node id in a node or presence topic of this fleet, or None if the topic is not one."""
        parts = topic.split("/")
        if len(parts) < 4 or parts[0] != "fedge" or parts[1] != self.fleet:
            return None
        if (parts[2] == "node" and len(parts) in (5, 6)) or (parts[2] == "presence" and len(parts) == 4):
            return parts[3] if is_valid_name(parts[3]) else None
        return None
