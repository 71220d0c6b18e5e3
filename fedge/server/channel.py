"""The coordinator's side of the compressed-training protocol, shared by every strategy that speaks it.

:class:`CompressedChannel` turns a strategy's dense train messages into instructions (uplink codec,
model version, optionally a compressed download) and a round's replies into screened, still compressed
updates plus a :class:`RoundReport`. :class:`fedge.server.streaming.StreamingFedAvg` sums those
updates in place; :class:`fedge.server.decoding.DecodingStrategy` decodes them for any Flower strategy.

Which updates counted
---------------------
Clients keep their last payload until told whether it counted (:mod:`fedge.protocol.records`,
``counted``). The channel remembers, per node, the version of the last update of that node the strategy
aggregated (:meth:`CompressedChannel.count`) and sends it in the node's next instruction. Anything not
counted -- a late or dropped reply, a rejection, a round whose aggregation returned nothing -- is simply
never recorded, so the client adds it back into its residual. The map is part of the strategy's
``state_dict``, which the coordinator checkpoints with the global model.

Ordering across a coordinator crash. In round ``r`` the coordinator (1) builds the train instructions,
which carry the map as it stood after round ``r − 1``; (2) receives the replies; (3) aggregates them
into ``x_r`` and records the aggregated nodes as counted at ``r``; (4) runs federated and central
evaluation; (5) writes one checkpoint holding ``x_r`` and the map of step 3 together (atomically). The
map leaves the process only in step 1 of the next round, after that checkpoint is durable (evaluation
messages do not carry it), so no client is ever told "counted" about an update the durable model lacks.
If the coordinator dies anywhere in steps 1–5 of round ``r``, ``--resume`` restores ``x_{r−1}`` and the
map of round ``r − 1`` and runs round ``r`` again: an update aggregated into the lost ``x_r`` has
version ``r`` while the restored map says at most ``r − 1`` for its node, so the node's next instruction
settles it as not counted: in the re-run, which trains it again from the same model, the node drops it
(folded back too, it would be sent twice); in a later round, it folds it back. A node cannot be counted
at ``r`` again without first receiving a round-``r`` instruction, which settles the old payload first.
If it dies after step 5, round ``r`` is complete and the next round starts from exactly the state
clients were told. This requires a checkpoint after every round (the coordinator service writes one);
with sparser checkpoints, what clients were told counted after the last one is lost on restart.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from fedge.compression import Codec, CodecConfigError, Schema, build_codec
from fedge.protocol.envelope import wire_size
from fedge.protocol.fleet import node_label
from fedge.protocol.records import INSTRUCTION_KEY, NOT_COUNTED, UPDATE_KEY, Instruction, arrays_to_record
from fedge.server.budget import UploadBudget
from fedge.server.counted import (
    COUNTED_NODES_KEY,
    COUNTED_VERSIONS_KEY,
    RUN_KEY,
    counted_from_state,
    counted_state,
)
from fedge.server.downlink import DownlinkConfig, Download, ModelBroadcast
from fedge.server.optimizers import statistics
from fedge.server.report import RoundReport
from fedge.server.screening import (
    Rejected,
    ReplyScreen,
    ScreenedReply,
    model_norm,
    outlier_rejections,
    screen_reply,
)
from fedge.server.tightening import tightened

__all__ = [
    "COUNTED_NODES_KEY",
    "COUNTED_VERSIONS_KEY",
    "CompressedChannel",
    "CompressionConfig",
    "RoundReport",
    "counted_from_state",
    "counted_state",
]

log = logging.getLogger(__name__)

DISCARDED_REASONS = frozenset(
    {
        "norm_outlier",
        "weight_outlier",
        "non_finite",
        "wrong_tensors",
        "bad_weight",
        "wrong_codec",
        "unchanged",
    }
)
"""Rejections of the update itself: the client is told to drop it rather than fold it back. ``stale``,
``no_update`` and ``undecodable`` replies (bytes damaged on the way) are merely lost, and fold back."""


@dataclass(frozen=True)
class CompressionConfig:
    """What a compressing strategy asks of its clients and how it screens their replies.

    Parameters
    ----------
    codec : str (default: "topk:0.01+int8")
        Uplink codec spec every client encodes its update with.
    ef_momentum : float (default: 0.0)
        Deep Gradient Compression momentum correction of the clients' error feedback, in [0, 1).
    ef_residual_cap : float or None (default: None)
        Clients scale their error-feedback residual to at most this multiple of the update's norm
        (:class:`fedge.compression.ErrorFeedback`); None: uncapped. Recommended where clients train rarely.
    downlink : DownlinkConfig or None (default: None)
        Compressed downloads; None sends the global model as Flower does, a dense ArrayRecord.
    screen : ReplyScreen (default: ReplyScreen())
        Rejection of suspicious replies.
    budget : UploadBudget or None (default: None)
        Per-client codecs chosen from each client's link so its upload fits the deadline, for nodes whose
        link the Grid knows (``node_links()``, the simulated clock's Grid); the others get
        ``budget.default_codec`` or, if None, ``codec``. None: ``codec`` for everyone.
    """

    codec: str = "topk:0.01+int8"
    ef_momentum: float = 0.0
    ef_residual_cap: float | None = None
    downlink: DownlinkConfig | None = None
    screen: ReplyScreen = field(default_factory=ReplyScreen)
    budget: UploadBudget | None = None

    def __post_init__(self) -> None:
        build_codec(self.codec)
        if not 0.0 <= self.ef_momentum < 1.0:
            raise CodecConfigError(f"ef_momentum must be in [0, 1), got {self.ef_momentum}")
        if self.ef_residual_cap is not None and not self.ef_residual_cap > 0:
            raise CodecConfigError(f"ef_residual_cap must be > 0, got {self.ef_residual_cap}")


class CompressedChannel:
    """Instruct clients and screen their replies, round by round.

    Parameters
    ----------
    config : CompressionConfig
        Codec, error feedback, downloads, screening.
    weighted_by_key : str (default: "num-examples")
        MetricRecord key of each reply's aggregation weight.
    """

    def __init__(self, config: CompressionConfig, weighted_by_key: str = "num-examples") -> None:
        self.config = config
        self._accepted_norms: list[float] = []  # the last round's, for tighten
        self.weighted_by_key = weighted_by_key
        self.broadcast = ModelBroadcast(config.downlink) if config.downlink else None
        self.reports: dict[int, RoundReport] = {}
        self.counted: dict[int, int] = {}  # node -> version of its last update the strategy aggregated
        self.discarded: dict[int, int] = {}  # node -> version of its last update screening refused as bad
        # this run's identity, in every instruction (and the checkpoint): nodes drop another run's state
        self.run = secrets.randbits(62)
        self._sent: dict[int, tuple[int, Download | None]] = {}  # node -> (version, download) this round
        self._codec = build_codec(config.codec)
        # The round's payload schema: replies bound to it leave their header out.
        self._schema: Schema | None = None
        # the last instructed model (the strategy's own arrays, stepped only after replies are received):
        # what a lone reply's update is measured against
        self._model: Mapping[str, np.ndarray] = {}
        self._codecs: dict[str, Codec] = {config.codec: self._codec}  # per-node codecs, by spec
        self._node_schemas: dict[int, Schema] = {}  # node -> schema of the codec it was sent this round
        self._dtypes: dict[str, str] = {}
        self._dense_sizes: dict[int, int] = {}  # schema digest -> wire bytes of a dense reply
        self._evaluated: dict[int, tuple[int, Download]] = {}  # node -> (version, download) evaluated

    def instruct(
        self,
        server_round: int,
        messages: Iterable[Message],
        model: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
        codecs: Mapping[int, str] | None = None,
    ) -> list[Message]:
        """Add the instruction to each train message; replace its ArrayRecord by a compressed download.

        ``model`` is the global model (float32) the messages carry; ``dtypes`` its tensors' own dtypes.
        ``codecs`` gives nodes their own uplink codec spec (:class:`fedge.server.budget.UploadBudget`);
        nodes not in it, or all when None, get ``config.codec``. Each reply is screened against the
        schema of the codec its node was sent.
        """
        messages = list(messages)
        report = self.reports[server_round] = RoundReport()
        self._sent.clear()
        self._node_schemas.clear()
        self._schema = Schema.of(self._codec, model, dtypes)
        self._model = model
        schemas = {self.config.codec: self._schema}  # this round's schema of each codec spec
        self._dtypes = dict(dtypes)
        nodes = [message.metadata.dst_node_id for message in messages]
        downloads = self.broadcast.prepare(server_round, model, nodes, dtypes) if self.broadcast else {}
        # One content per distinct (original content, download, counted, codec): messages that shared one
        # still do. Most sampled nodes were counted in the previous round, so few contents are made.
        contents: dict[tuple[int, int, int, int | None, str], RecordDict] = {}
        for message, node in zip(messages, nodes, strict=True):
            download = downloads.get(node)
            counted, discarded = self.counted.get(node, NOT_COUNTED), self.discarded.get(node)
            self._sent[node] = (server_round, download)
            codec = (codecs or {}).get(node, self.config.codec)
            if codec not in schemas:
                if codec not in self._codecs:
                    self._codecs[codec] = build_codec(codec)
                schemas[codec] = Schema.of(self._codecs[codec], model, dtypes)
            self._node_schemas[node] = schemas[codec]
            key = (id(message.content), id(download), counted, discarded, codec)
            if key not in contents:
                contents[key] = self._content(
                    message.content, server_round, download, dtypes, counted, discarded, codec, schemas[codec]
                )
            message.content = contents[key]
            if download is not None:
                report.count_download(download.is_delta, len(download.payload))
        return messages

    def instruct_evaluate(
        self,
        server_round: int,
        messages: Iterable[Message],
        model: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
    ) -> list[Message]:
        """Evaluate messages get the same compressed broadcast as train messages (without compressed
        downloads configured they keep their dense ArrayRecord).

        The model evaluated after round ``r`` is the one round ``r + 1`` trains from, so it goes out as that
        version: a node that evaluated it then needs only an empty delta to train. Clients evaluate the
        reference model they hold, which differs from the coordinator's by what the delta codec has not
        sent yet (nothing, with an exact full-model download).
        """
        messages = list(messages)
        if self.broadcast is None or not messages:
            return messages
        version = server_round + 1
        report = self.reports.setdefault(server_round, RoundReport())
        nodes = [message.metadata.dst_node_id for message in messages]
        downloads = self.broadcast.prepare(version, model, nodes, dtypes)
        self._evaluated = {node: (version, downloads[node]) for node in nodes}
        contents: dict[tuple[int, int], RecordDict] = {}
        for message, node in zip(messages, nodes, strict=True):
            download = downloads[node]
            key = (id(message.content), id(download))
            if key not in contents:
                contents[key] = self._content(message.content, version, download, dtypes, counted=None)
            message.content = contents[key]
            report.count_download(download.is_delta, len(download.payload))
        return messages

    def receive_evaluate(self, replies: Iterable[Message]) -> None:
        """Note which nodes now hold the evaluated version (those that answered without an error)."""
        for reply in replies:
            node = reply.metadata.src_node_id
            if self.broadcast is not None and not reply.has_error() and node in self._evaluated:
                version, download = self._evaluated[node]
                self.broadcast.confirm(node, version, download)

    def _content(
        self,
        content: RecordDict,
        version: int,
        download: Download | None,
        dtypes: Mapping[str, str],
        counted: int | None,
        discarded: int | None = None,
        codec: str | None = None,
        schema: Schema | None = None,
    ) -> RecordDict:
        array_keys = [key for key, value in content.items() if isinstance(value, ArrayRecord)]
        if len(array_keys) != 1:
            raise ValueError(f"a train message must carry one ArrayRecord, found {len(array_keys)}")
        if codec is None:  # the common case: the strategy's codec and the round's schema
            codec, schema = self.config.codec, self._schema
        instruction = Instruction(
            codec=codec,
            version=version,
            ef_momentum=self.config.ef_momentum,
            ef_residual_cap=self.config.ef_residual_cap,
            arrays_key=array_keys[0],
            grid=self.config.downlink.grid if self.config.downlink else "fp32",
            counted=counted,
            discarded=discarded,
            schema=schema.digest if schema is not None else None,
            run=self.run,
        )
        out = RecordDict(dict(content.items()))
        if download is not None:
            del out[array_keys[0]]
            extra = (
                tuple(f"{n}={d}" for n, d in dtypes.items() if d != "float32")
                if not download.is_delta
                else ()
            )
            instruction = dataclasses.replace(
                instruction, base=download.base, model=download.payload, dtypes=extra
            )
        out[INSTRUCTION_KEY] = instruction.to_record()
        return out

    def receive(
        self, server_round: int, replies: Iterable[Message], shapes: Mapping[str, tuple[int, ...]]
    ) -> list[ScreenedReply]:
        """Screen the round's train replies against the model's ``shapes``; return those to aggregate.

        Rejections are logged with the node id and counted in ``reports[server_round]``; failed
        replies (Flower errors) only make the coordinator forget which model version the node holds.
        """
        report = self.reports.setdefault(server_round, RoundReport())
        stats = statistics(self._dtypes)  # left out of every reply's norm
        passed: list[ScreenedReply] = []
        sizes: dict[int, tuple[int, int, int]] = {}  # node -> (wire bytes, payload bytes as sent, dense wire)
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.info(
                    "round %d: node %d replied with an error: %s", server_round, node, reply.error.reason
                )
                continue
            version, download = self._sent.get(node, (server_round, None))
            try:
                screened = screen_reply(
                    node,
                    reply.content,
                    version=version,
                    weighted_by_key=self.weighted_by_key,
                    shapes=shapes,
                    schema=self._node_schemas.get(node, self._schema),
                    statistics=stats,
                )
            except Rejected as rejection:
                self.reject(server_round, node, rejection)
                continue
            if self.broadcast is not None and download is not None:
                self.broadcast.confirm(node, version, download)
            passed.append(screened)
            sent = reply.content[UPDATE_KEY]["payload"]
            sizes[node] = (wire_size(reply), len(sent), self._dense_reply_bytes(reply, shapes))
        norms, weights = [r.norm for r in passed], [r.weight for r in passed]
        dense_bytes = 4 * sum(math.prod(shape) for shape in shapes.values())
        accepted = []
        rejections = outlier_rejections(
            norms, weights, self.config.screen, lambda: [model_norm(self._model, stats)] * len(passed)
        )
        for screened, rejection in zip(passed, rejections, strict=True):
            if rejection is not None:
                self.reject(server_round, screened.node_id, rejection)
                continue
            accepted.append(screened)
            wire, payload, dense_wire = sizes[screened.node_id]
            report.wire_bytes += wire
            report.dense_wire_bytes += dense_wire
            report.payload_bytes += payload
            report.dense_bytes += dense_bytes
        report.accepted = len(accepted)
        self._accepted_norms = [r.norm for r in accepted]
        return accepted

    def tighten(self) -> None:
        """The last aggregate was dropped (its loss blew up): tighten the norm test to reject the largest
        update that round accepted (:func:`fedge.server.tightening.tightened`)."""
        screen = tightened(self.config.screen, self._accepted_norms)
        self.config = dataclasses.replace(self.config, screen=screen)

    def _dense_reply_bytes(self, reply: Message, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """Wire bytes of ``reply`` had it carried the model dense, as Flower's FedAvg clients send it (an
        ArrayRecord named ``arrays``), measured once per model schema.

        Tensor by tensor, so measuring costs the memory of the largest tensor, not of the model; the sum
        counts some length prefixes once per tensor (24 bytes too many on the 288 kB digits CNN). Keyed by
        the strategy's codec's schema whatever each node's codec: a dense reply does not depend on it.
        """
        key = self._schema.digest if self._schema is not None else -1
        if key not in self._dense_sizes:
            rest = {k: v for k, v in reply.content.items() if k != UPDATE_KEY}

            def size(arrays: ArrayRecord) -> int:
                content = RecordDict({**rest, "arrays": arrays})
                return wire_size(Message(metadata=reply.metadata, content=content))

            empty = size(ArrayRecord())
            total = empty
            for name, shape in shapes.items():
                one = arrays_to_record({name: np.zeros(shape, np.float32)}, self._dtypes)
                total += size(one) - empty
            self._dense_sizes[key] = total
        return self._dense_sizes[key]

    def count(self, server_round: int, node_ids: Iterable[int]) -> None:
        """Record that the round's updates of ``node_ids`` are in the model the strategy returns.

        Call it from ``aggregate_train`` once the model holds them, and only for those: every reply not
        counted goes back into its client's residual. The version recorded is the one the reply was
        screened against (its ``base``).
        """
        for node in node_ids:
            self.counted[node] = self._sent.get(node, (server_round, None))[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        """The counted map as two aligned int64 arrays (node ids, versions) and the run's identity, for
        the checkpoint."""
        return counted_state(self.counted) | {RUN_KEY: np.array([self.run], dtype=np.int64)}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without it leaves the map empty: nothing counted; and
        one without the run's identity, from before it was kept, makes this a new run for the nodes)."""
        self.counted = counted_from_state(state)
        if RUN_KEY in state and np.asarray(state[RUN_KEY]).size == 1:
            self.run = int(np.asarray(state[RUN_KEY]).reshape(-1)[0])

    def reject(self, server_round: int, node_id: int, rejection: Rejected) -> None:
        """Log and count a rejected reply; an update refused as bad is discarded, not sent again."""
        log.warning(
            "round %d: rejected the reply of node %s: %s", server_round, node_label(node_id), rejection
        )
        self.reports.setdefault(server_round, RoundReport()).rejected[rejection.reason] += 1
        if rejection.reason in DISCARDED_REASONS and node_id in self._sent:
            self.discarded[node_id] = self._sent[node_id][0]

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """The round's figures (empty if the round is unknown)."""
        report = self.reports.get(server_round)
        return report.to_metrics() if report else {}
