"""Two serving processes on one device, so a model swap never pauses a request.

ONNX Runtime builds a session while holding Python's GIL (about 1-2 ms for the digits CNN, more for larger
models; ``docs/inference.md``), so in one process a request that arrives during a swap waits for it. With
``replicas = 2`` a device runs two agent processes that answer one MQTT *shared* subscription
(``$share/<node>/.../request``): the broker hands each request to one of them. A replica about to swap
first takes the device's swap turn (a file lock, so the two never swap at once), leaves the shared
subscription and waits for the broker's UNSUBACK (requests it already received are answered first, since
paho handles packets in order), fetches the new version's chunks, builds and swaps with no request in
sight, rejoins, waits for the SUBACK and hands the turn on. Meanwhile the other replica answers every
request, and fetches nothing: a replica that received chunks while serving answered late (its paho
threads share one GIL), so each replica fetches a version only in its turn. The price is a second process's
memory, and a moment (one UNSUBACK round trip) in which the two replicas answer with different versions;
each answer names its version.

A replica leaves the group only when its peer's retained status says it is online and serving; otherwise
it swaps in place, as a single process does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fedge.transport.connection import MqttConnection, PropertiesHandler
from fedge.transport.topics import Topics

__all__ = ["ReplicaGroup"]

log = logging.getLogger(__name__)

_ACK_WAIT_S = 5.0
_TURN_WAIT_S = 120.0


class ReplicaGroup:
    """One replica's view of its device's serving group.

    Parameters
    ----------
    connection : MqttConnection
        This replica's connection.
    topics : Topics
        The fleet's topics.
    node_id : str
        The device; also the shared subscription's group name.
    replica : int
        This replica's index (0 for a single process).
    replicas : int
        How many replicas serve the device.
    lock_dir : str
        Directory for the swap-turn lock file (the device's model directory, shared by its replicas).
    stale_after_s : float
        A peer whose status is older than this is not counted on to serve.
    """

    def __init__(
        self,
        connection: MqttConnection,
        topics: Topics,
        node_id: str,
        replica: int,
        replicas: int,
        lock_dir: str,
        stale_after_s: float,
    ) -> None:
        self.connection = connection
        self.topics = topics
        self.node_id = node_id
        self.replica = replica
        self.replicas = replicas
        self.lock_path = Path(lock_dir) / ".swap.lock"
        self.stale_after_s = stale_after_s
        self.swaps_out_of_group = 0
        self.swaps_in_place = 0
        self.turns = 0  # swap turns taken (with a peer serving, each one leave and rejoin of the group)
        self._peers: dict[int, dict] = {}
        self._handler: PropertiesHandler | None = None
        self._lock = threading.Lock()
        # This process's holders of the turn (the fetch of each variant, then the install): the first takes
        # the turn and leaves the group, the last rejoins and hands it on.
        self._turn_mutex = threading.Lock()
        self._holders = 0
        self._turn_fd: int | None = None
        self._left = False
        self._swapped_in_turn = False

    @property
    def shared(self) -> bool:
        """Whether requests come through a shared subscription (more than one replica)."""
        return self.replicas > 1

    def status_topic(self, replica: int | None = None) -> str:
        """Replica 0 reports on the device's status topic, replica ``i`` on ``<status>/<i>``."""
        replica = self.replica if replica is None else replica
        base = self.topics.infer_status(self.node_id)
        return base if replica == 0 else f"{base}/{replica}"

    def serve_requests(self, handler: PropertiesHandler) -> None:
        """Subscribe to the device's requests (shared when there are replicas) and follow the peers."""
        self._handler = handler
        group = self.node_id if self.shared else None
        self.connection.route_with_properties(
            self.topics.infer_request(self.node_id), handler, shared_group=group
        )
        for peer in range(self.replicas):
            if peer != self.replica:
                self.connection.route(
                    self.status_topic(peer), lambda _t, p, peer=peer: self._on_peer(peer, p)
                )

    @contextlib.contextmanager
    def out_of_group(self, *, swap: bool = True) -> Iterator[bool]:
        """Take the device's swap turn and leave the request group for the block, if a peer serves.

        Threads of this process may hold it together (they share one turn). ``swap`` says whether the
        block swaps a model (counted in :attr:`swaps_out_of_group` or :attr:`swaps_in_place`) or only
        fetches one. Yields whether this replica left (False: a single process, or no live peer: in place).
        """
        if not self.shared:
            self.swaps_in_place += int(swap)
            yield False
            return
        with self._turn_mutex:
            if self._holders == 0:
                self._turn_fd = self._take_turn()
                self.turns += 1
                self._left = self._peer_serving() and self._leave()
                if not self._left:
                    log.warning("no live replica of %s serves: working in place", self.node_id)
            self._holders += 1
            self._swapped_in_turn |= swap
            left = self._left
        try:
            yield left
        finally:
            with self._turn_mutex:
                self._holders -= 1
                if self._holders == 0:
                    if self._left:
                        self._join()
                        self.swaps_out_of_group += int(self._swapped_in_turn)
                    else:
                        self.swaps_in_place += int(self._swapped_in_turn)
                    self._swapped_in_turn = False
                    assert self._turn_fd is not None
                    os.close(self._turn_fd)  # closing releases the lock
                    self._turn_fd = None

    def _leave(self) -> bool:
        topic = self.topics.infer_request(self.node_id)
        if self.connection.unroute(topic, shared_group=self.node_id, wait_s=_ACK_WAIT_S):
            return True
        log.warning("no UNSUBACK from the broker; rejoining and swapping in place")
        self._join()
        return False

    def _join(self) -> None:
        assert self._handler is not None
        topic = self.topics.infer_request(self.node_id)
        if not self.connection.route_with_properties(
            topic, self._handler, shared_group=self.node_id, wait_s=_ACK_WAIT_S
        ):
            log.warning("no SUBACK within %.0f s on rejoining the request group", _ACK_WAIT_S)

    def _peer_serving(self) -> bool:
        now = time.time()
        with self._lock:
            peers = list(self._peers.values())
        return any(
            p.get("online") and p.get("version") and now - float(p.get("updated_at", 0)) < self.stale_after_s
            for p in peers
        )

    def _on_peer(self, peer: int, payload: bytes) -> None:
        try:
            status = json.loads(payload) if payload else {}
        except ValueError:
            return
        if isinstance(status, dict):
            with self._lock:
                self._peers[peer] = status

    def _take_turn(self) -> int:
        """An exclusive lock on the device's swap-turn file (waits for the peer's turn to end)."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + _TURN_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"{self.lock_path} stayed locked for {_TURN_WAIT_S:.0f} s") from None
                time.sleep(0.005)  # the peer's turn takes milliseconds to seconds
