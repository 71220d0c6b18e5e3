"""Streaming aggregation of compressed updates: Flower's FedAvg without holding every decoded reply.

Flower's ``FedAvg`` decodes every reply into dense arrays and sums them at the end: O(clients × model)
memory. :class:`StreamingFedAvg` keeps the replies compressed, screens them one at a time
(:mod:`fedge.server.screening`), then adds each accepted payload straight into one running weighted sum
with :func:`fedge.compression.decode_add` (sparse payloads are scattered, never densified): O(model +
one decoded reply) on top of the model. The sum is the averaged client update ``Δ``; a
:class:`fedge.server.optimizers.ServerOptimizer` applies it (FedAvg, FedAvgM or FedAdam).

The replies summed into the model are recorded as counted (:meth:`CompressedChannel.count`); every other
reply -- late, dropped, rejected -- goes back into its client's error-feedback residual. The record is
checkpointed through :meth:`StreamingFedAvg.state_dict` (why that is exact across a coordinator crash:
:mod:`fedge.server.channel`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedge.compression import CodecError, decode_add
from fedge.protocol.records import arrays_to_record, record_to_arrays
from fedge.server.channel import CompressedChannel, CompressionConfig
from fedge.server.counted import CHANNEL_KEYS
from fedge.server.metric_average import average_metric_records
from fedge.server.optimizers import ServerOptimizer, statistics
from fedge.server.screening import Rejected, ScreenedReply

__all__ = ["StreamingFedAvg"]

log = logging.getLogger(__name__)

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


class StreamingFedAvg(FedAvg):
    """FedAvg over compressed updates, summed as they are decoded.

    Clients need :class:`fedge.client.CompressionMod` in their ClientApp. The strategy owns the global
    model after the first ``configure_train``: it keeps it as float32 arrays and returns a fresh
    ArrayRecord of it from every ``aggregate_train``.

    Parameters
    ----------
    compression : CompressionConfig (default: CompressionConfig())
        Uplink codec, error-feedback momentum, compressed downloads and reply screening.
    optimizer : ServerOptimizer or None (default: None)
        How the averaged update moves the model; None is plain averaging (``ServerOptimizer("avg")``).
    fraction_train : float (default: 1.0)
        Fraction of nodes sampled for training each round.
    fraction_evaluate : float (default: 1.0)
        Fraction of nodes sampled for federated evaluation (whose messages carry the model as compressed
        downloads when ``compression.downlink`` is set, like train messages).
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled for training.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes sampled for evaluation.
    min_available_nodes : int (default: 2)
        Nodes that must be connected before sampling.
    weighted_by_key : str (default: "num-examples")
        MetricRecord key weighting each reply.
    arrayrecord_key : str (default: "arrays")
        Key of the model's ArrayRecord in train and evaluate messages.
    configrecord_key : str (default: "config")
        Key of the ConfigRecord in train and evaluate messages.
    train_metrics_aggr_fn : callable or None (default: None)
        Aggregates accepted replies' MetricRecords; None is
        :func:`~fedge.server.metric_average.average_metric_records` (Flower's weighted average of each
        figure more than half of the replies hold as a finite number, over those replies).
    evaluate_metrics_aggr_fn : callable or None (default: None)
        Aggregates evaluation MetricRecords; None is Flower's weighted average.
    """

    def __init__(
        self,
        compression: CompressionConfig | None = None,
        optimizer: ServerOptimizer | None = None,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn or average_metric_records,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        self.compression = compression or CompressionConfig()
        self.optimizer = optimizer or ServerOptimizer()
        self.channel = CompressedChannel(self.compression, weighted_by_key)
        self._model: dict[str, np.ndarray] | None = None
        self._returned: ArrayRecord | None = None  # the last aggregate handed to Flower's loop
        self._dtypes: dict[str, str] = {}

    def summary(self) -> None:
        """Log the configuration."""
        downlink = self.compression.downlink
        log.info(
            "StreamingFedAvg: uplink %s (EF momentum %s), downlink %s, server optimizer %s (lr %s)",
            self.compression.codec,
            self.compression.ef_momentum,
            f"{downlink.codec} / full {downlink.full_model}" if downlink else "dense",
            self.optimizer.kind,
            self.optimizer.learning_rate,
        )
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes as FedAvg does; send each the instruction and the model, dense or compressed.

        With ``compression.budget``, each node's uplink codec is chosen from its link, which a Grid that
        knows links reports by ``node_links()`` (the simulated clock's Grid; over MQTT the schedule's Grid,
        from the links agents declare; the metering Grid forwards it). A node whose link is unknown gets
        the budget's ``default_codec`` (or ``compression.codec``).
        """
        if self._model is None or arrays is not self._returned:  # the loop's model: a rolled-back one, say
            self._model, self._dtypes = record_to_arrays(arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        codecs = None
        if self.compression.budget is not None:
            node_links = getattr(grid, "node_links", None)
            links = node_links() if callable(node_links) else {}
            sampled = {m.metadata.dst_node_id: links.get(m.metadata.dst_node_id) for m in messages}
            size = sum(array.size for array in self._model.values())
            codecs = self.compression.budget.codecs(sampled, size)
        return self.channel.instruct(server_round, messages, self._model, self._dtypes, codecs)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen the replies, sum the accepted ones in place, take one optimizer step."""
        accepted = self._screen(server_round, replies)
        if not accepted:
            return None, None
        total = sum(reply.weight for reply in accepted)
        size = sum(array.size for array in self._model.values())
        running = {name: np.zeros_like(array) for name, array in self._model.items()}
        aggregated = []
        for reply in accepted:
            try:  # the payload was validated while screening; this guards the invariant, not the input
                decode_add(reply.payload, running, reply.weight / total, max_elements=size)
            except CodecError as err:
                self.channel.reject(server_round, reply.node_id, Rejected("undecodable", str(err)))
                continue
            aggregated.append(reply)
        self.optimizer.step(self._model, running, averaged=statistics(self._dtypes))
        del running
        self.channel.count(server_round, [reply.node_id for reply in aggregated])
        metrics = self._train_metrics(server_round, [reply.content for reply in aggregated])
        return self._global_record(), metrics

    def rolled_back(self) -> None:
        """The round runner dropped the last aggregate (its loss was not finite, or blew up): the server
        optimizer's moments go back to what they were before its step (the model comes back through the
        next :meth:`configure_train`), and the norm test is tightened (:meth:`CompressedChannel.tighten`)."""
        self.optimizer.rewind()
        self.channel.tighten()

    def _global_record(self) -> ArrayRecord:
        """The global model as an aggregate handed to Flower's loop; the next ``configure_train`` that gets
        this record back trains from ``self._model`` without decoding it again."""
        self._returned = arrays_to_record(self._model, self._dtypes)
        return self._returned

    def _screen(self, server_round: int, replies: Iterable[Message]) -> list[ScreenedReply]:
        """The round's replies that passed screening (logged when there is none)."""
        if self._model is None:
            raise RuntimeError("aggregate_train called before configure_train")
        shapes = {name: array.shape for name, array in self._model.items()}
        accepted = self.channel.receive(server_round, replies, shapes)
        if not accepted:
            log.warning("round %d: no update to aggregate; the model stays as it is", server_round)
        return accepted

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's evaluate messages, the model in them sent as compressed downloads are (if configured)."""
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        if self._model is None:
            return messages
        return self.channel.instruct_evaluate(server_round, messages, self._model, self._dtypes)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """FedAvg's weighted average; the replies also tell which nodes now hold the evaluated model."""
        replies = list(replies)
        self.channel.receive_evaluate(replies)
        return super().aggregate_evaluate(server_round, replies)

    def _train_metrics(self, server_round: int, contents: list[RecordDict]) -> MetricRecord:
        """The clients' metrics as FedAvg aggregates them, plus the round's compression figures."""
        try:
            metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except (KeyError, TypeError, ValueError) as err:  # replies whose metric keys disagree
            log.warning("round %d: client metrics not aggregated: %s", server_round, err)
            metrics = MetricRecord()
        for key, value in self.round_metrics(server_round).items():
            metrics[f"fedge.{key}"] = value
        return metrics

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """Bytes, compression ratio and rejections of ``server_round``."""
        return self.channel.round_metrics(server_round)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The server optimizer's state and which update of each node counted, as flat named arrays.

        The coordinator checkpoints it after each round, with that round's model. The counted map is two
        int64 arrays (:data:`fedge.server.channel.COUNTED_NODES_KEY`, ``COUNTED_VERSIONS_KEY``); the
        optimizer's keys are ``steps`` and ``<buffer>/<tensor>``.

        The download reference is deliberately not part of it: a coordinator that crashed may already have
        sent the next round's delta, so after a restart no client's version is trusted and the first round
        sends full models.
        """
        return self.optimizer.state_dict() | self.channel.state_dict()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` after a restart: server momentum and Adam moments continue, and clients
        whose updates the restored model lacks are told so."""
        counted = CHANNEL_KEYS
        self.channel.load_state_dict({k: v for k, v in state.items() if k in counted})
        self.optimizer.load_state_dict({k: v for k, v in state.items() if k not in counted})
