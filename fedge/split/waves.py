"""The split clients' exchanges of a round, wave after wave (see :mod:`fedge.split.coordinator`).

SplitFed (``parallel=True``): every online split client gets one request per wave. Sequential split
learning (``parallel=False``): one client at a time, in partition order; each starts from the front (and
head) the previous one handed in, which the coordinator passes on: the round's start plus what the previous
clients' updates brought (dense, or decoded from their ``update_codec`` payloads). A client offline before
its turn is passed over; one offline in the middle of its turn is waited for, as in SplitFed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedge.split.engine_config import SplitAppConfig
from fedge.split.messages import RunSettings
from fedge.split.session import SplitSession
from fedge.split.tally import local_delta
from fedge.split.updates import UpdateRejected

__all__ = ["WaveRunner"]

log = logging.getLogger(__name__)


@dataclass
class WaveRunner:
    """Runs a round's waves on ``grid``.

    Parameters
    ----------
    grid : Grid
        Where the split clients are.
    config : SplitAppConfig
        Timeouts, attempts, and ``split.parallel``.
    settings : RunSettings
        What every request's ``"config"`` record carries.
    session : str
        The coordinator's session id.
    message : callable(content, node, server_round) -> Message
        Addresses a ``train.split_step`` request.
    wake : threading.Event
        Waited on (never set by this class) while every client left is offline.
    on_wave : callable(round, wave), optional
        Called after every wave's replies are handled.
    """

    grid: Grid
    config: SplitAppConfig
    settings: RunSettings
    session: str
    message: Callable[[RecordDict, int, int], Message]
    wake: threading.Event
    on_wave: Callable[[int, int], None] | None = None

    def run(
        self, server_round: int, sessions: list[SplitSession], start: dict[str, torch.Tensor], deadline: float
    ) -> int:
        """Exchange with the split clients until every one has handed in its front (or the deadline);
        return the requests asked again."""
        parallel = self.config.split.parallel
        running = dict(start)  # the front (and head) a client starting its turn gets, by model key
        wave = retries = 0
        while active := [s for s in sessions if not s.done]:
            if time.monotonic() > deadline:
                log.warning("round %d: %d split clients did not finish in time", server_round, len(active))
                for s in active:  # the gradient each is owed will never be applied: counted as lost
                    s.cut_off()
                break
            online = set(self.grid.get_node_ids())
            ready = [s for s in active if s.node in online]
            if not parallel:
                turn = [s for s in active if s.started or s.server_steps or s.attempts]
                ready = [s for s in (turn or ready)[:1] if s.node in online]
            if not ready:
                self.wake.wait(0.1)  # everyone left (or whose turn it is) is offline: wait for one
                continue
            retries += sum(s.attempts > 0 for s in ready)
            messages = []
            for s in ready:
                if s.base is None:  # its turn starts: what it gets is what its update is relative to
                    s.base = {k: running[k] for k in [*s.keys[0].values(), *s.keys[2].values()]}
                front = {k: running[v] for k, v in s.keys[0].items()}
                head = {k: running[v] for k, v in s.keys[2].items()} if s.u_shaped else None
                request = s.request(server_round, self.session, front, head)
                messages.append(self.message(request.content(self.settings), s.node, server_round))
            replies = {
                m.metadata.src_node_id: m
                for m in self.grid.send_and_receive(messages, timeout=self.config.step_timeout_s)
            }
            for s in ready:
                s.settle(replies.get(s.node), server_round, self.session, self.config.max_attempts)
                if not parallel and s.done:
                    self._hand_over(s, start, running)
            wave += 1
            if self.on_wave is not None:
                self.on_wave(server_round, wave)
        return retries

    @staticmethod
    def _hand_over(s: SplitSession, start: dict[str, torch.Tensor], running: dict[str, torch.Tensor]) -> None:
        """Sequential: the next client starts from what this one handed in."""
        if s.front is None and not s.update:
            return  # it never handed its front in: the next one starts from the previous one's
        if s.front is not None:  # dense: exactly what it trained (start + delta would round)
            running.update({s.keys[0][k]: v for k, v in s.front.items()})
            running.update({s.keys[2][k]: v for k, v in (s.head or {}).items()})
            return
        try:
            delta = local_delta(s, start)
        except UpdateRejected as err:
            log.warning("split client %d: update left out: %s", s.partition, err)
            return
        running.update({k: start[k] + d.reshape(start[k].shape) for k, d in delta.items()})
