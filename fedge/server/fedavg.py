"""Dense FedAvg: Flower's rule, with the replies' arrays read once per distinct tensor layout.

Flower's ``aggregate_arrayrecords`` reads every tensor of every reply with ``Array.numpy()``, which parses a
``.npy`` header (``ast.literal_eval``) per tensor: for 50 digits-CNN replies, 400 parses and about 0.1 s of
every round, spent while the workers wait for the next round. :class:`DenseFedAvg` computes the same
weighted average, term by term in the same order (so floating tensors are bit-identical, which a test
checks), from arrays read with :func:`fedge.protocol.arrays.array_to_numpy`. Integer and bool tensors
(buffers such as BatchNorm's batch counter or a model's position ids) are rounded back to their own dtype:
Flower's rule returns their average as float64, which a client's ``load_state_dict`` truncates (a constant
buffer ``[7, 100]`` came back as ``[6, 99]``), and screening then saw floats where the model has integers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedge.flower.compat import check_replies
from fedge.protocol.arrays import array_to_numpy
from fedge.protocol.records import arrays_to_record

__all__ = ["DenseFedAvg", "weighted_average"]


class DenseFedAvg(FedAvg):
    """Flower's ``FedAvg`` (same parameters, sampling, screening and metrics) with a faster average."""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the valid replies' ArrayRecords (weighted by ``weighted_by_key``) and MetricRecords."""
        valid = check_replies(self, replies, train=True)
        if not valid:
            return None, None
        contents = [message.content for message in valid]
        arrays = weighted_average(contents, self.weighted_by_key)
        return arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)


def weighted_average(contents: list[RecordDict], weight_key: str) -> ArrayRecord:
    """Every ArrayRecord's arrays averaged, weighted by ``weight_key`` of each content's first MetricRecord.

    Term for term what ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords`` computes: the
    weights normalised first, then ``sum_i values_i * w_i`` accumulated in reply order.
    """
    # ``RecordDict.array_records`` builds a new typed dict per access: walk the content once instead.
    weights = [float(_first(c, MetricRecord)[weight_key]) for c in contents]  # type: ignore[arg-type]
    total = sum(weights)
    summed: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}  # each tensor's dtype in the first reply: integers are rounded back to it
    for content, weight in zip(contents, [w / total for w in weights], strict=True):
        for record in (r for r in content.values() if isinstance(r, ArrayRecord)):
            for name, array in record.items():
                values = array_to_numpy(array)
                if name not in summed:
                    summed[name] = values * weight
                    dtypes[name] = str(values.dtype)
                else:
                    summed[name] += values * weight
    return arrays_to_record(summed, dtypes)


def _first(content: RecordDict, kind: type) -> Any:
    """The first record of ``kind`` in ``content`` (Flower's checks guarantee there is one)."""
    return next(r for r in content.values() if isinstance(r, kind))
