"""Any Flower strategy over compressed replies: decode them into the dense replies it expects.

:class:`DecodingStrategy` wraps a message-API strategy (FedMedian, FedTrimmedAvg, Krum, Bulyan, FedProx,
the DP wrappers, ...). Its train messages get the compression instruction (and, if configured, a
compressed download); each accepted reply's payload is decoded into the model the client would have
sent, ``x + update``, and handed to the wrapped strategy as an ordinary reply with one ArrayRecord.
Screening (:mod:`fedge.server.screening`) runs first, so malformed and poisoned replies never reach it.

The wrapped strategy keeps its own memory cost: it receives every reply dense. Wrap DP strategies,
never the other way round: they clip replies, which must be dense by then::

    strategy = DecodingStrategy(DifferentialPrivacyClientSideFixedClipping(FedAvg(), 1.0, 0.5, 20))

Which updates counted (see :mod:`fedge.server.channel`): the wrapper cannot see which replies the wrapped
strategy used, so when it returns a model every reply handed to it counts, and when it returns none
(too few replies, a failure) none does. A strategy that leaves some replies out -- Krum, Bulyan and the
trimmed mean keep only part of them, the median uses each only through its order -- therefore has the
clients of the unused ones believe they were delivered: their error feedback forgets them, as it did for
every reply before the protocol tracked delivery. Replies rejected by screening, late or dropped never
count, whatever the wrapped strategy is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedge.compression import decode_add
from fedge.protocol.records import UPDATE_KEY, arrays_to_record, record_to_arrays
from fedge.server.channel import CompressedChannel, CompressionConfig
from fedge.server.dense_screening import conform_replies

__all__ = ["DecodingStrategy"]

log = logging.getLogger(__name__)


class DecodingStrategy(Strategy):
    """Let ``strategy`` consume compressed replies.

    The wrapped strategy must send every node the same global model it was given (all of Flower's
    built-in strategies do).

    Parameters
    ----------
    strategy : Strategy
        The Flower strategy that aggregates the decoded replies.
    compression : CompressionConfig or None (default: None)
        Uplink codec, error-feedback momentum, compressed downloads, reply screening.
    weighted_by_key : str (default: "num-examples")
        MetricRecord key of each reply's weight (used by screening; the wrapped strategy weighs as it likes).
    """

    def __init__(
        self,
        strategy: Strategy,
        compression: CompressionConfig | None = None,
        weighted_by_key: str = "num-examples",
    ) -> None:
        self.strategy = strategy
        self.weighted_by_key = weighted_by_key
        self.compression = compression or CompressionConfig()
        self.channel = CompressedChannel(self.compression, weighted_by_key)
        self._model: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, str] = {}
        self._arrays_key = "arrays"

    def __repr__(self) -> str:
        return f"DecodingStrategy({self.strategy!r}, codec={self.compression.codec!r})"

    def summary(self) -> None:
        """Log the wrapper's and the wrapped strategy's configuration."""
        log.info(
            "DecodingStrategy: uplink %s around %s", self.compression.codec, type(self.strategy).__name__
        )
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's train messages, with the instruction and possibly compressed models."""
        self._model, self._dtypes = record_to_arrays(arrays)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if messages:
            keys = [k for k, v in messages[0].content.items() if isinstance(v, ArrayRecord)]
            self._arrays_key = keys[0] if len(keys) == 1 else self._arrays_key
        return self.channel.instruct(server_round, messages, self._model, self._dtypes)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen and decode the replies; the wrapped strategy aggregates the dense ones."""
        replies = list(replies)
        shapes = {name: array.shape for name, array in self._model.items()}
        accepted = {r.node_id: r for r in self.channel.receive(server_round, replies, shapes)}
        dense: list[Message] = []
        for reply in replies:
            if reply.has_error():
                dense.append(reply)  # the wrapped strategy logs (or refuses) failures its own way
                continue
            screened = accepted.get(reply.metadata.src_node_id)
            if screened is None:
                continue
            weights = {name: array.copy() for name, array in self._model.items()}
            decode_add(screened.payload, weights, max_elements=sum(a.size for a in weights.values()))
            # the decoded update is the reply's one ArrayRecord: any other array record it sent is dropped
            content = RecordDict(
                {k: v for k, v in reply.content.items() if k != UPDATE_KEY and not isinstance(v, ArrayRecord)}
            )
            content[self._arrays_key] = arrays_to_record(weights, self._dtypes)
            reply.content = content
            dense.append(reply)
        if not any(not reply.has_error() for reply in dense):
            log.warning("round %d: no update to aggregate; the model stays as it is", server_round)
            return None, None
        # as Flower's rule needs them
        conform_replies([reply for reply in dense if not reply.has_error()], self.weighted_by_key)
        arrays, metrics = self.strategy.aggregate_train(server_round, dense)
        if arrays is not None:  # the wrapped strategy's choice among the replies is not visible: all count
            self.channel.count(server_round, [r.metadata.src_node_id for r in dense if not r.has_error()])
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluate messages, the model as compressed downloads (if configured)."""
        messages = self.strategy.configure_evaluate(server_round, arrays, config, grid)
        if self.channel.broadcast is None:
            return messages
        model, dtypes = record_to_arrays(arrays)
        return self.channel.instruct_evaluate(server_round, messages, model, dtypes)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Delegated; the replies also tell which nodes now hold the evaluated model."""
        replies = list(replies)
        self.channel.receive_evaluate(replies)
        return self.strategy.aggregate_evaluate(server_round, replies)

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """Bytes, compression ratio and rejections of ``server_round``."""
        return self.channel.round_metrics(server_round)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Which update of each node counted, as two int64 arrays (the coordinator checkpoints it).

        The wrapped strategy's own state, if it has any, is not included.
        """
        return self.channel.state_dict()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` after a coordinator restart."""
        self.channel.load_state_dict(state)
