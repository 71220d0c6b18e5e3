"""Buffered asynchronous training on any Grid: FedBuff driven by the order replies arrive in.

:class:`FedBuffStrategy` is a Flower strategy whose ``start`` runs asynchronously, so the round runner
(:func:`fedge.server.runner.run_rounds`) drives it like any other: every aggregation is a "round" it
evaluates, records in ``metrics.json``, checkpoints, exports and stops at the target accuracy.

The loop. ``C`` clients train at once, each sent the current model with its version. Replies are
processed in the order the Grid hands them over (``pull_messages``), one at a time; every ``K`` of them
(:class:`fedge.server.fedbuff.FedBuff`) make one server step with staleness weights, and the freed slots
are refilled with clients sent the new model. A client lost on the way (an error reply, or no reply
within ``timeout`` seconds while nothing else arrives) frees its slot at once, and the loss is refilled
with the current model. Refilling at aggregations, not at every arrival, means every new client trains on
the newest model, and with ``K = C`` the loop is synchronous FedAvg (up to float rounding; a buffer is
summed in node order, so the order its replies arrived in changes nothing). A client
whose reply waits in the buffer is not sent work again until the buffer is aggregated (its next
instruction says whether its update counted, which error feedback needs).

A restarted coordinator resumes a run (:meth:`FedBuffStrategy.resume_at`, which the round runner calls):
versions go on from the checkpoint's, the server optimizer's moments and the map of counted updates are
restored (:meth:`~FedBuffStrategy.load_state_dict`), and the clients that were in flight or buffered when
it stopped lost their work (nothing of theirs is in the checkpointed model), as a client cut off does.

What "arrival order" means is the Grid's business: on fedge's MQTT Grid or the local engine it is real
time (the loop polls ``pull_messages``); on :class:`fedge.simulation.clock_grid.ClockGrid` each pull
returns the next reply in simulated time, so a run on a simulated fleet is reproducible.

Compressed updates go through the same :class:`~fedge.server.channel.CompressedChannel` as
:class:`~fedge.server.streaming.StreamingFedAvg`: instructions carry the version ``t + 1`` of the model
``x_t`` they send (a round number, as the channel expects), replies are screened together when the
buffer is aggregated, and only updates summed into the model are told "counted"; the rest fold back into
their client's error-feedback residual. Dense replies (Flower's ClientApp returning its model) become
deltas against the model they were sent.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedge.compression import CodecError, decode_add
from fedge.protocol.fleet import node_label
from fedge.protocol.records import arrays_to_record, record_to_arrays
from fedge.server.buffered_dense import screen_buffer
from fedge.server.channel import CompressedChannel, CompressionConfig
from fedge.server.counted import CHANNEL_KEYS
from fedge.server.fedbuff import FedBuff
from fedge.server.optimizers import ServerOptimizer, statistics
from fedge.server.round_figures import average_train_metrics
from fedge.server.runner import RunFailed, error_summary
from fedge.server.screening import DENSE_MAX_WEIGHT_RATIO, REJECTION_REASONS, Rejected, ReplyScreen

__all__ = ["FedBuffStrategy"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Dispatch:
    """One train instruction on its way: to ``node``, with the model of version ``label - 1``."""

    node: int
    label: int
    sent_s: float  # time.monotonic() when it was pushed


class FedBuffStrategy(Strategy):
    """FedBuff (buffered asynchronous aggregation) as a Flower strategy; see the module docstring.

    Parameters
    ----------
    compression : CompressionConfig or None (default: None)
        Compressed updates (clients need :class:`fedge.client.CompressionMod`); None: dense replies.
    optimizer : ServerOptimizer or None (default: None)
        The server step on each aggregation's staleness-weighted mean delta; None is plain FedAvg's.
    buffer_size : int (default: 10)
        ``K``: replies per aggregation.
    concurrency : int (default: 20)
        ``C``: clients training at once, >= ``K``.
    staleness_exponent : float (default: 0.5)
        ``a`` of the staleness weight ``(1 + τ)^−a``.
    weighted_by_key : str (default: "num-examples")
        MetricRecord key weighting each reply.
    poll_s : float (default: 0.05)
        Seconds between polls of a real-time Grid with nothing to hand over.
    screen : ReplyScreen or None (default: None)
        Dense replies' outlier tests over each buffer (compressed ones: ``compression``'s screen); None:
        weights above ``DENSE_MAX_WEIGHT_RATIO`` times the buffer's median are rejected, norms untested.
    """

    def __init__(
        self,
        compression: CompressionConfig | None = None,
        optimizer: ServerOptimizer | None = None,
        *,
        buffer_size: int = 10,
        concurrency: int = 20,
        staleness_exponent: float = 0.5,
        weighted_by_key: str = "num-examples",
        poll_s: float = 0.05,
        screen: ReplyScreen | None = None,
    ) -> None:
        FedBuff({}, buffer_size=buffer_size, concurrency=concurrency, staleness_exponent=staleness_exponent)
        self.buffer_size, self.concurrency = buffer_size, concurrency
        self.staleness_exponent = staleness_exponent
        self.optimizer = optimizer or ServerOptimizer()
        self.compression = compression
        self.channel = _BufferedChannel(compression, weighted_by_key) if compression else None
        self._dense_rejected: dict[int, Counter[str]] = {}  # uncompressed replies: version -> reasons
        self.weighted_by_key, self.poll_s = weighted_by_key, poll_s
        self.screen = screen or ReplyScreen(max_norm_ratio=math.inf, max_weight_ratio=DENSE_MAX_WEIGHT_RATIO)
        self.state: FedBuff | None = None
        self._dtypes: dict[str, str] = {}
        self._record: ArrayRecord | None = None  # the current model, as sent
        self._bases: dict[int, dict[str, np.ndarray]] = {}  # dense replies: label -> the model sent
        self._in_flight: dict[str, _Dispatch] = {}  # message id -> dispatch, until its reply is pulled
        self._timed_out = 0  # dispatches given up on since the last aggregation
        self._arrived: dict[str, _Dispatch] = {}  # message id -> dispatch, while its reply is buffered
        # nodes whose work was lost since the last aggregation: not sent work again before it (re-sent at
        # once, a node failing at once kept a slot busy forever and the buffer never filled)
        self._resting: set[int] = set()
        self._metrics: dict[int, dict[str, float]] = {}
        self.train_metrics: dict[int, MetricRecord | None] = {}  # version -> counted clients' train figures
        self._first_version = 0  # the version start() begins at: a resumed run's checkpointed round
        self._rng = random.Random()  # which idle nodes train; seeded from ``random`` by start()

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "FedBuffStrategy: K=%d, C=%d, staleness (1+t)^-%s, uplink %s, server %s (lr %s)",
            self.buffer_size,
            self.concurrency,
            self.staleness_exponent,
            self.compression.codec if self.compression else "dense",
            self.optimizer.kind,
            self.optimizer.learning_rate,
        )

    # -- Flower's steps ----------------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Instructions for idle nodes, enough to have ``C`` in flight, with the current model.

        ``server_round`` is not used: the instructions carry the state's version. Nodes in flight or whose
        reply waits in the buffer are not idle. Only :meth:`start`'s loop calls it.
        """
        if self.state is None:  # Flower's synchronous loop: only start() may drive this strategy
            raise RuntimeError("FedBuffStrategy runs its own loop: call start(), not Flower's round loop")
        label = self.state.version + 1
        busy = {d.node for d in [*self._in_flight.values(), *self._arrived.values()]} | self._resting
        idle = sorted(n for n in grid.get_node_ids() if n not in busy)
        chosen = self._rng.sample(idle, max(0, min(self.concurrency - len(self._in_flight), len(idle))))
        config = ConfigRecord(dict(config))
        config["server-round"] = label
        content = RecordDict({"arrays": self._record, "config": config})
        messages = [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in chosen]
        if self.channel is None:
            self._bases.setdefault(label, {name: a.copy() for name, a in self.state.model.items()})
            return messages
        codecs = None
        if self.channel.config.budget is not None:
            node_links = getattr(grid, "node_links", None)
            links = node_links() if callable(node_links) else {}
            size = sum(a.size for a in self.state.model.values())
            codecs = self.channel.config.budget.codecs({n: links.get(n) for n in chosen}, size)
        return self.channel.instruct(label, messages, self.state.model, self._dtypes, codecs)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Buffer the replies' deltas with their staleness weights and take one server step."""
        if self.state is None:
            raise RuntimeError("aggregate_train called before configure_train")
        label = self.state.version + 1
        sent = {}
        for reply in replies:
            message_id = reply.metadata.reply_to_message_id
            dispatch = self._arrived.pop(message_id, None) or self._in_flight.pop(message_id, None)
            if dispatch is not None and not reply.has_error():
                sent[dispatch.node] = (reply, dispatch)
        # Summed in node order, not arrival order: in real time the order of a buffer's replies is the
        # timing's, and float sums in another order part a run from its own repetition (a resumed run's
        # loss had differed by 0.35 % two aggregations later, one time in ten).
        sent = dict(sorted(sent.items()))
        counted = self._add_compressed(label, sent) if self.channel else self._add_dense(label, sent)
        self.state.flush()
        self._resting.clear()
        if self.channel is not None:
            self.channel.count(label, counted)
        self._record = arrays_to_record(self.state.model, self._dtypes)
        waiting = {d.label for d in [*self._in_flight.values(), *self._arrived.values()]}
        self._bases = {k: v for k, v in self._bases.items() if k in waiting}
        staleness = self.state.last_staleness
        metrics = self.channel.round_metrics(label) if self.channel else self._dense_metrics(label)
        metrics |= {
            "accepted": len(counted),
            "version": self.state.version,
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": max(staleness, default=0),
            "in_flight": len(self._in_flight),
            "timed_out": self._timed_out,  # dispatches given up on since the last aggregation
        }
        self._timed_out = 0
        self._metrics[self.state.version] = metrics
        contents = [sent[node][0].content for node in counted]  # what the counted clients' train() said
        self.train_metrics[self.state.version] = average_train_metrics(contents, self.weighted_by_key)
        return self._record, MetricRecord({f"fedge.{k}": float(v) for k, v in metrics.items()})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the runner evaluates every aggregation centrally."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (no federated evaluation)."""
        return None

    def _dense_metrics(self, label: int) -> dict[str, float]:
        """Uncompressed replies rejected while building version ``label``, by reason."""
        rejected = self._dense_rejected.pop(label, Counter())
        return {"rejected": sum(rejected.values())} | {
            f"rejected_{r}": rejected[r] for r in REJECTION_REASONS
        }

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """The aggregation's figures: accepted updates, staleness, the version, and compression's."""
        return dict(self._metrics.get(server_round, {}))

    def state_dict(self) -> dict[str, np.ndarray]:
        """The server optimizer's state and, with compression, which update of each node counted."""
        return self.optimizer.state_dict() | (self.channel.state_dict() if self.channel else {})

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` before a resumed :meth:`start`: the server optimizer's moments go on,
        and clients whose updates the checkpointed model lacks are told so."""
        counted = CHANNEL_KEYS
        if self.channel is not None:
            self.channel.load_state_dict({k: v for k, v in state.items() if k in counted})
        self.optimizer.load_state_dict({k: v for k, v in state.items() if k not in counted})

    def resume_at(self, version: int) -> None:
        """Begin the next :meth:`start` at ``version`` (a checkpoint's round): its ``num_rounds`` are the
        aggregations still to run, and it calls ``evaluate_fn`` with 1, 2, ... for them, as the round
        runner numbers a resumed run's rounds."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._first_version = version

    # -- the asynchronous loop ---------------------------------------------------------------------------

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn=None,
    ) -> Result:
        """Run ``num_rounds`` aggregations asynchronously; ``evaluate_fn(version, arrays)`` after each.

        ``timeout`` is how long (seconds, real time) a client may take before its slot is given to
        another, checked while nothing arrives (a simulated clock always has a reply to hand over);
        ``evaluate_config`` is unused (no federated evaluation).
        """
        # The run's own stream, drawn from the seeded global one at once: a thread of any other library
        # drawing from ``random`` while the run goes on (a reconnect's jitter, say) changes nothing here.
        self._rng = random.Random(random.getrandbits(64))
        self.summary()
        train_config = train_config or ConfigRecord()
        result = Result()
        if evaluate_fn is not None and (res := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        self._begin(initial_arrays)
        self._warn_small_fleet(len(list(grid.get_node_ids())))
        last = self._first_version + num_rounds
        if num_rounds <= 0:  # e.g. resumed after the last aggregation: no client is sent work
            return result
        self._dispatch(grid, train_config)
        buffer: list[Message] = []
        losses, first_loss, idle_since = 0, "", time.monotonic()
        while self.state.version < last:
            replies = list(grid.pull_messages(list(self._in_flight))) if self._in_flight else []
            refill = False
            if not replies:  # nothing arrived (real time only: a simulated clock always hands one over)
                if not self._in_flight and not buffer:  # only failed nodes are left: they try again
                    self._resting.clear()
                if self._expire(timeout) or not self._in_flight:
                    self._dispatch(grid, train_config)
                if not self._in_flight and buffer:  # no other client can train: aggregate the buffer
                    self._aggregate(buffer, result, evaluate_fn)
                    buffer, refill = [], True
                elif not self._in_flight and time.monotonic() - idle_since > timeout:
                    raise RunFailed("no node to train: none is connected, or none can hold training")
            for reply in replies:
                message_id = reply.metadata.reply_to_message_id
                dispatch = self._in_flight.pop(message_id, None)
                if dispatch is None or self.state.version >= last:
                    continue
                if reply.has_error():  # lost: cut off, crashed or unreachable; its slot is refilled
                    losses, first_loss, refill = losses + 1, first_loss or reply.error.reason, True
                    self._resting.add(dispatch.node)
                    log.info("node %d lost its work: %s", dispatch.node, reply.error.reason)
                    if losses > 20 * self.concurrency:
                        cause = error_summary(first_loss)
                        raise RunFailed(f"{losses} dispatches in a row lost their work; first: {cause}")
                    continue
                losses, self._arrived[message_id] = 0, dispatch
                buffer.append(reply)
                if len(buffer) >= self.buffer_size:
                    self._aggregate(buffer, result, evaluate_fn)
                    buffer, refill = [], True
            if refill and self.state.version < last:
                self._dispatch(grid, train_config)
            if self._in_flight:
                idle_since = time.monotonic()
            if not replies and self.state.version < last:
                time.sleep(self.poll_s)
        return result

    def _warn_small_fleet(self, nodes: int) -> None:
        """Say so when fewer nodes than ``K`` are connected: a buffer then fills only when no node is left
        training, and every aggregation takes the replies of all of them (FedAvg weighted by staleness)."""
        if 0 < nodes < self.buffer_size:
            log.warning(
                "FedBuff: K=%d but %d nodes are connected: each aggregation waits until none is left "
                "training and takes the replies it has (set buffer_size to at most the nodes)",
                self.buffer_size,
                nodes,
            )

    def _begin(self, arrays: ArrayRecord) -> None:
        model, self._dtypes = record_to_arrays(arrays)
        self.state = FedBuff(
            model,
            buffer_size=self.buffer_size,
            concurrency=self.concurrency,
            staleness_exponent=self.staleness_exponent,
            optimizer=self.optimizer,
            averaged=statistics(self._dtypes),
        )
        self.state.version = self._first_version
        self._record = arrays_to_record(self.state.model, self._dtypes)

    def _dispatch(self, grid: Grid, config: ConfigRecord) -> None:
        """Push instructions to idle nodes until ``C`` are in flight (or no node is idle)."""
        messages = list(self.configure_train(self.state.version + 1, self._record, config, grid))
        if not messages:
            return
        now, pushed = time.monotonic(), set(grid.push_messages(messages))  # a Grid may skip offline nodes
        for message in messages:
            if message.metadata.message_id in pushed:
                label = int(message.content["config"]["server-round"])
                self._in_flight[message.metadata.message_id] = _Dispatch(
                    message.metadata.dst_node_id, label, now
                )

    def _expire(self, timeout: float) -> bool:
        """Give up on dispatches older than ``timeout``; whether any was."""
        limit = time.monotonic() - timeout
        late = [i for i, d in self._in_flight.items() if d.sent_s < limit]
        for message_id in late:
            node = node_label(self._in_flight.pop(message_id).node)
            log.warning("node %s did not reply within %.0f s; its slot goes to another node", node, timeout)
        self._timed_out += len(late)
        return bool(late)

    def keep(self, arrays: ArrayRecord) -> None:
        """Go on from ``arrays`` instead of the last aggregate (a rollback: the round runner found that
        aggregate's loss not finite, or blown up). The server optimizer's moments are as they were before
        that step, and the dispatches that follow send ``arrays``; the version still advances (versions
        count steps)."""
        model, _ = record_to_arrays(arrays)
        for name, values in model.items():
            self.state.model[name][...] = values
        self.optimizer.rewind()
        self._record = arrays_to_record(self.state.model, self._dtypes)

    def _aggregate(self, buffer: list[Message], result: Result, evaluate_fn) -> None:
        arrays, metrics = self.aggregate_train(self.state.version + 1, buffer)
        version = self.state.version
        result.arrays = arrays
        result.train_metrics_clientapp[version] = metrics
        if evaluate_fn is None:
            return
        # the caller counts this start()'s aggregations from 1, whatever version it began at
        if (res := evaluate_fn(version - self._first_version, arrays)) is not None:
            result.evaluate_metrics_serverapp[version] = res

    def _add_compressed(self, label: int, sent: Mapping[int, tuple[Message, _Dispatch]]) -> list[int]:
        """Screen the buffered replies together; add each accepted update; the nodes added."""
        shapes = {name: array.shape for name, array in self.state.model.items()}
        size = sum(array.size for array in self.state.model.values())
        added = []
        for screened in self.channel.receive(label, [reply for reply, _ in sent.values()], shapes):
            delta = {name: np.zeros_like(array) for name, array in self.state.model.items()}
            try:
                decode_add(screened.payload, delta, 1.0, max_elements=size)
            except CodecError as err:
                self.channel.reject(label, screened.node_id, Rejected("undecodable", str(err)))
                continue
            self.state.add(delta, sent[screened.node_id][1].label - 1, screened.weight)
            added.append(screened.node_id)
        return added

    def _add_dense(self, label: int, sent: Mapping[int, tuple[Message, _Dispatch]]) -> list[int]:
        """Each reply's model minus the model it was sent, weighted by its examples; the nodes added.
        Replies :func:`~fedge.server.buffered_dense.screen_buffer` rejects are logged and counted."""
        rejected = self._dense_rejected.setdefault(label, Counter())
        updates, rejections = screen_buffer(
            {node: (reply, dispatch.label) for node, (reply, dispatch) in sent.items()},
            self._bases,
            self.screen,
            self.weighted_by_key,
            self.state.averaged,  # of the model's first dtypes: a later float base says nothing of which
            # tensors are integer buffers
        )
        for node, rejection in rejections:
            log.warning("version %d: rejected the reply of node %s: %s", label, node_label(node), rejection)
            rejected[rejection.reason] += 1
        for update in updates:
            self.state.add(update.delta, update.label - 1, update.weight)
        return [update.node for update in updates]


class _BufferedChannel(CompressedChannel):
    """A channel whose instructions stay valid while later ones go out (clients of several versions are
    in flight at once), and whose report of a version counts every dispatch of it."""

    def instruct(
        self,
        server_round: int,
        messages: Iterable[Message],
        model: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
        codecs: Mapping[int, str] | None = None,
    ) -> list[Message]:
        sent, schemas, report = dict(self._sent), dict(self._node_schemas), self.reports.get(server_round)
        messages = super().instruct(server_round, messages, model, dtypes, codecs)
        self._sent, self._node_schemas = sent | self._sent, schemas | self._node_schemas
        if report is not None:  # another dispatch of the same version: keep counting its downloads
            new = self.reports[server_round]
            new.downloads_delta += report.downloads_delta
            new.downloads_full += report.downloads_full
            new.download_payload_bytes += report.download_payload_bytes
        return messages
