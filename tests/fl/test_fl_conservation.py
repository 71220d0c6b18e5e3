"""Conservation under loss: every update a client trained is in the global model or still in its residual.

Error feedback promises ``Σ sent + residual = Σ trained`` per client, but only what the coordinator
counted is in the model. A run of six digits clients on the local Grid (real Flower messages, half the
nodes sampled each round, so nodes miss rounds) goes through a network that drops replies and corrupts
one (screening rejects it), and through two coordinator crashes, each followed by a restart from the
checkpoint with a new strategy object (``load_state_dict``), as ``fedge coordinator --resume`` does:

* round 4: the coordinator dies after aggregating, before the round's checkpoint: the replies it
  aggregated are in a model that is lost;
* round 6: it dies after the replies arrived, before aggregating them.

The test's own record of every reply (:class:`_LossyGrid`) says which ones counted: delivered, not
corrupted, and in a round whose aggregation survived. Two exact identities are checked against it:

1. the final global model is the initial one plus, round by round, the weighted average (server
   optimizer ``avg``, step 1) of the counted replies' decoded payloads -- the record matches the model;
2. per client, ``Σ_t trained_t = Σ counted payloads + residual (+ its last payload, if that did not count:
   only its next instruction can tell the client) + Σ replaced payloads`` (an uncounted update the node
   then trained again from the same model, as a resumed coordinator runs the lost round again: folded back
   as well, it would have been sent twice).

Before clients learned whether a reply counted, identity 2 failed for every client that lost a reply.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pytest
from fl_helpers import reference_app
from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.serverapp.strategy import FedAvg, Strategy

from fedge.app.config import AppConfig
from fedge.app.server_app import federated_run
from fedge.client import CompressionMod
from fedge.client.compression_mod import EF_STATE_KEY
from fedge.compression import Schema, build_codec, decode, unbind
from fedge.flower.compat import Run
from fedge.flower.grid import RunGrid
from fedge.protocol.records import INSTRUCTION_KEY, UPDATE_KEY, record_to_arrays
from fedge.reporting.history import RunHistory
from fedge.server import CompressionConfig, DecodingStrategy, ReplyScreen, ServerOptimizer, StreamingFedAvg
from fedge.server.checkpoint import load_checkpoint, save_checkpoint
from fedge.server.runner import run_rounds
from fedge.simulation.local_grid import LocalGrid

NODES = 6
ROUNDS = 7
LEDGER_KEY = "test.trained-sum"
CRASH_AFTER_AGGREGATION = 4
CRASH_BEFORE_AGGREGATION = 6
# (round, position among the round's replies); a re-run round meets the same network
DROPPED = {(2, 0), (3, 2), (4, 1), (5, 1), (7, 0)}
CORRUPTED = {(3, 0)}
# only the corrupted reply may be rejected, so the test knows exactly what counted
SCREEN = ReplyScreen(max_norm_ratio=float("inf"), max_weight_ratio=float("inf"))


class _CoordinatorCrash(Exception):
    """The coordinator process dies here."""


def _ledger(msg: Message, context: Context, call_next) -> Message:
    """Inside CompressionMod: add every trained update (new − received weights) to a float64 sum in the
    Context, computed as the mod computes it (float32 difference)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    received = record_to_arrays(msg.content["arrays"])[0]
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    trained = record_to_arrays(reply.content["arrays"])[0]
    total = {}
    if LEDGER_KEY in context.state:
        total = {name: array.numpy().copy() for name, array in context.state[LEDGER_KEY].items()}
    for name, values in trained.items():
        total[name] = total.get(name, 0.0) + (values - received[name]).astype(np.float64)
    context.state[LEDGER_KEY] = ArrayRecord({name: Array(values) for name, values in total.items()})
    return reply


@dataclass
class _Delivery:
    """One train reply as the network saw it; ``fate`` is counted, dropped, rejected or lost (its round's
    aggregation died with the coordinator)."""

    attempt: int
    server_round: int
    node: int
    sent: dict[str, np.ndarray]
    weight: float
    fate: str


class _LossyGrid(RunGrid):
    """The local Grid behind a network that drops and corrupts train replies, and a coordinator that can
    die once the replies of a round arrived."""

    def __init__(self, inner: LocalGrid, crash_before_aggregation: Iterable[int]) -> None:
        super().__init__(inner.run.run_id)
        self.inner = inner
        self.crash_before_aggregation = set(crash_before_aggregation)
        self.deliveries: list[_Delivery] = []
        self.attempt = 0  # train rounds run, re-runs included

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("Flower's strategies use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("Flower's strategies use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.inner.on_wire = self.on_wire
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
            return replies
        self.attempt += 1
        server_round = int(messages[0].content[INSTRUCTION_KEY]["version"])
        # Replies come bound to the round's schema (no names or shapes): the one the instruction announced.
        arrays, dtypes = record_to_arrays(messages[0].content["arrays"])
        schema = Schema.of(build_codec(messages[0].content[INSTRUCTION_KEY]["codec"]), arrays, dtypes)
        assert schema.digest == messages[0].content[INSTRUCTION_KEY]["schema"]
        passed = []
        for position, reply in enumerate(replies):
            assert not reply.has_error(), reply.error.reason
            update = reply.content[UPDATE_KEY]
            assert update["base"] == server_round
            fate = (
                "dropped"
                if (server_round, position) in DROPPED
                else "rejected"
                if (server_round, position) in CORRUPTED
                else "counted"
            )
            (metrics,) = reply.content.metric_records.values()
            self.deliveries.append(
                _Delivery(
                    self.attempt,
                    server_round,
                    reply.metadata.src_node_id,
                    decode(unbind(update["payload"], schema)),
                    float(metrics["num-examples"]),
                    fate,
                )
            )
            if fate == "rejected":  # one flipped byte: the CRC fails, screening says "undecodable"
                corrupted = bytearray(update["payload"])
                corrupted[len(corrupted) // 2] ^= 0xFF
                update["payload"] = bytes(corrupted)
            if fate != "dropped":
                passed.append(reply)
        if server_round in self.crash_before_aggregation:
            self.crash_before_aggregation.discard(server_round)
            self.void(self.attempt)
            raise _CoordinatorCrash(f"round {server_round}: replies received, not aggregated")
        return passed

    def void(self, attempt: int) -> None:
        """The coordinator died before checkpointing ``attempt``: what it counted there is lost."""
        for delivery in self.deliveries:
            if delivery.attempt == attempt and delivery.fate == "counted":
                delivery.fate = "lost"


def _streaming(codec: str) -> Strategy:
    return StreamingFedAvg(
        CompressionConfig(codec, screen=SCREEN),
        ServerOptimizer("avg"),
        fraction_train=0.5,
        fraction_evaluate=0.0,
        min_train_nodes=3,
        min_available_nodes=NODES,
    )


def _decoding(codec: str) -> Strategy:
    inner = FedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=NODES)
    return DecodingStrategy(inner, CompressionConfig(codec, screen=SCREEN))


def _run_with_crashes(
    tmp_path, make_strategy: Callable[[], Strategy]
) -> tuple[LocalGrid, _LossyGrid, ArrayRecord, ArrayRecord, list[RunHistory | _CoordinatorCrash]]:
    """The run, restarted from its checkpoint after each crash; the grid, the network's record, the
    initial and final global models and how each coordinator life ended (a crash, or the history)."""
    grid = LocalGrid(reference_app([CompressionMod(), _ledger]), NODES)
    lossy = _LossyGrid(grid, crash_before_aggregation={CRASH_BEFORE_AGGREGATION})
    base = federated_run(AppConfig(rounds=ROUNDS, local_epochs=1, seed=0, min_nodes=NODES))
    crash_after = {CRASH_AFTER_AGGREGATION}
    strategy: Strategy | None = None
    final: list[ArrayRecord] = []
    lives: list[RunHistory | _CoordinatorCrash] = []

    def checkpoint(server_round: int, arrays: ArrayRecord, history: RunHistory) -> None:
        if server_round in crash_after:  # aggregated and evaluated, the checkpoint not yet written
            crash_after.discard(server_round)
            lossy.void(lossy.attempt)
            raise _CoordinatorCrash(f"round {server_round}: aggregated, not checkpointed")
        state = strategy.state_dict() if hasattr(strategy, "state_dict") else {}
        save_checkpoint(tmp_path, server_round, arrays, history, state)  # as the coordinator service does
        final[:] = [arrays]

    resume = None
    try:
        for _life in range(3):  # each crash fires once: the third life completes
            strategy = make_strategy()
            if resume is not None and hasattr(strategy, "load_state_dict"):
                strategy.load_state_dict(resume.strategy_state)
            try:
                lives.append(
                    run_rounds(
                        lossy,
                        dataclasses.replace(base, strategy=strategy),
                        resume=resume,
                        on_round_end=checkpoint,
                    )
                )
                break
            except _CoordinatorCrash as crash:
                lives.append(crash)
                resume = load_checkpoint(tmp_path)  # a new process: only the checkpoint survives
    finally:
        grid.shutdown()
    return grid, lossy, base.initial_arrays, final[0], lives


def _state_arrays(context: Context, key: str, prefix: str = "") -> dict[str, np.ndarray]:
    if key not in context.state:
        return {}
    return {
        name[len(prefix) :]: np.asarray(array.numpy(), dtype=np.float64)
        for name, array in context.state[key].items()
        if name.startswith(prefix)
    }


@pytest.mark.parametrize(
    ("codec", "make_strategy"),
    [("topk:0.1+int8", _streaming), ("fp32", _decoding)],
    ids=["streaming-topk", "decoding-fedavg-fp32"],
)
def test_every_trained_update_is_in_the_model_or_in_the_residual_despite_drops_and_crashes(
    tmp_path, codec, make_strategy
):
    grid, lossy, initial, final, lives = _run_with_crashes(tmp_path, lambda: make_strategy(codec))
    deliveries = lossy.deliveries

    # the run went through what it is meant to: two restarts, drops, one rejection, missed rounds
    assert [type(life) for life in lives] == [_CoordinatorCrash, _CoordinatorCrash, RunHistory]
    assert [r.round for r in lives[-1].rounds] == list(range(1, ROUNDS + 1))
    assert lossy.attempt == ROUNDS + 2
    fates = [d.fate for d in deliveries]
    assert fates.count("rejected") == 1 and fates.count("dropped") >= 4 and fates.count("lost") >= 4
    rejected_round = next(d.server_round for d in deliveries if d.fate == "rejected")
    metrics = {r.round: r.extra for r in lives[-1].rounds}
    assert metrics[rejected_round]["rejected_undecodable"] == 1
    by_node: dict[int, list[_Delivery]] = {}
    for delivery in deliveries:
        by_node.setdefault(delivery.node, []).append(delivery)
    waited = [  # an uncounted payload kept while its node was not sampled, settled when it was again
        (a, b)
        for mine in by_node.values()
        for a, b in itertools.pairwise(mine)
        if a.fate != "counted" and b.attempt > a.attempt + 1
    ]
    assert waited

    # 1. the model moved by exactly the weighted average of the counted replies, round by round
    expected = {name: values.astype(np.float64) for name, values in record_to_arrays(initial)[0].items()}
    counted = [d for d in deliveries if d.fate == "counted"]
    for attempt in sorted({d.attempt for d in counted}):
        batch = [d for d in counted if d.attempt == attempt]
        total = sum(d.weight for d in batch)
        for delivery in batch:
            for name, values in delivery.sent.items():
                expected[name] += delivery.weight / total * values
    model = record_to_arrays(final)[0]
    for name, values in expected.items():
        np.testing.assert_allclose(model[name], values, rtol=0, atol=2e-5, err_msg=name)

    # 2. per client: everything trained is counted, still in the residual, its unsettled last payload, or
    # replaced by the same update trained again
    all_replaced: list[_Delivery] = []
    for node, context in grid.contexts.items():
        trained = _state_arrays(context, LEDGER_KEY)
        mine = by_node.get(node, [])
        assert bool(trained) == bool(mine)
        if not mine:
            continue
        owed = _state_arrays(context, EF_STATE_KEY, prefix="ef/residual/")
        # an uncounted update its node then trained again from the same model (the round a crash lost, run
        # again): dropped by the client, since folding it back as well would send that update twice
        replaced = [
            a for a, b in itertools.pairwise(mine) if a.fate != "counted" and b.server_round == a.server_round
        ]
        all_replaced.extend(replaced)
        for delivery in mine:
            if delivery.fate == "counted" or delivery is mine[-1] or delivery in replaced:
                for name, values in delivery.sent.items():
                    owed[name] = owed.get(name, 0.0) + values
        for name, values in trained.items():
            lost = [f"{d.server_round}:{d.fate}" for d in mine if d.fate != "counted"]
            np.testing.assert_allclose(
                owed[name], values, rtol=0, atol=2e-5, err_msg=f"node {node} {name}, not counted: {lost}"
            )
    assert all_replaced  # a round the crashes lost was run again with some of its nodes
