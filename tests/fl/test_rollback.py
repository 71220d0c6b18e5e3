"""A round whose aggregate computes NaN is undone: the previous model is kept and training goes on.

One client's finite but huge update (3e38 in every weight, in one round) passes a finiteness test and
turns the average into a model whose loss is NaN; from it every honest update is NaN too, so before the
rollback the run never recovered.
"""

from __future__ import annotations

import math

import numpy as np
from fl_helpers import reference_app, run
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType
from flwr.serverapp.strategy import FedAvg

from fedge.client import CompressionMod
from fedge.protocol.records import arrays_to_record, record_to_arrays
from fedge.server import CompressionConfig, ServerOptimizer, StreamingFedAvg
from fedge.simulation.local_grid import LocalGrid

NODES = 4
POISONED_ROUND = 2


def _poisoned(msg: Message, context: Context, reply: Message) -> bool:
    """Whether ``reply`` is partition 0's train reply of round POISONED_ROUND (the one the mods corrupt)."""
    config = msg.content["config"] if msg.metadata.message_type == MessageType.TRAIN else {}
    chosen = int(config.get("server-round", 0)) == POISONED_ROUND and context.node_config["partition-id"] == 0
    return chosen and not reply.has_error()


def _huge_once(msg: Message, context: Context, call_next) -> Message:
    """Partition 0 replies 1e30 in every floating weight (finite, its norm too) in round POISONED_ROUND."""
    reply = call_next(msg, context)
    if not _poisoned(msg, context, reply):
        return reply
    arrays, _ = record_to_arrays(reply.content["arrays"])
    huge = {n: np.full_like(v, 1e30) if v.dtype.kind == "f" else v for n, v in arrays.items()}
    reply.content["arrays"] = ArrayRecord({name: Array(values) for name, values in huge.items()})
    return reply


def test_a_round_whose_aggregate_computes_nan_is_rolled_back_and_training_goes_on():
    history = run(LocalGrid(reference_app([_huge_once]), NODES), FedAvg(fraction_evaluate=0.0), rounds=5)
    rounds = history.rounds
    assert [r.extra.get("rolled_back", 0) for r in rounds] == [0, 1, 0, 0, 0]
    # the kept model is round 1's, evaluated as it was; the rounds after it train from it
    assert rounds[1].accuracy == rounds[0].accuracy and rounds[1].loss == rounds[0].loss
    assert all(math.isfinite(r.loss) for r in rounds)
    assert rounds[-1].accuracy > rounds[0].accuracy


def test_a_compressing_strategy_trains_from_the_model_the_loop_hands_in():
    """A rollback hands the round loop's next configure_train the kept model, not the last aggregate:
    StreamingFedAvg, which holds its model between rounds, must take it."""
    strategy = StreamingFedAvg(CompressionConfig("fp32"), ServerOptimizer("avg"), fraction_evaluate=0.0)
    grid = LocalGrid(reference_app([CompressionMod()]), 2)
    first, kept = {"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)}
    try:
        list(strategy.configure_train(1, arrays_to_record(first, {}), ConfigRecord(), grid))
        messages = list(strategy.configure_train(2, arrays_to_record(kept, {}), ConfigRecord(), grid))
    finally:
        grid.shutdown()
    assert len(messages) == 2
    # the base its next aggregate steps from (what it would send as compressed downloads, too)
    assert np.array_equal(strategy._model["w"], kept["w"])


def test_fedbuff_rolls_back_an_aggregate_that_computes_nan_and_trains_on():
    """FedBuff kept a NaN model: from it the honest nodes' updates were NaN, rejected as theirs, while the
    run reported success at chance (attack sweep). It now drops the version, as the round loop does, and
    restores its server optimizer's momentum (which held the huge step)."""
    from fedge.app.config import AppConfig
    from fedge.app.server_app import build_strategy, run_federated
    from fedge.flower.compat import set_task_identity

    app = AppConfig(
        rounds=4,
        local_epochs=1,
        seed=0,
        strategy="fedbuff",
        buffer_size=NODES,
        concurrency=NODES,
        server_optimizer="avgm",
        min_nodes=NODES,
        max_norm_ratio=0.0,  # no norm test: the aggregate itself must be caught
    )
    set_task_identity(run_id=1)
    grid = LocalGrid(reference_app([_huge_once]), NODES, workers=1)
    try:
        rounds = run_federated(grid, app, strategy=build_strategy(app)).rounds
    finally:
        grid.shutdown()
    assert [r.extra.get("rolled_back", 0) for r in rounds] == [0, 1, 0, 0]
    assert rounds[1].loss == rounds[0].loss  # the kept model, evaluated as it was
    assert [r.extra["accepted"] for r in rounds[2:]] == [NODES, NODES]  # no honest node blamed
    assert all(math.isfinite(r.loss) for r in rounds) and rounds[-1].accuracy > rounds[0].accuracy


def _boosted_once(msg: Message, context: Context, call_next) -> Message:
    """Partition 0 replies its update 1,000 times over in round POISONED_ROUND: finite, and under the default
    norm bound, but no training step lands there."""
    reply = call_next(msg, context)
    if not _poisoned(msg, context, reply):
        return reply
    received, _ = record_to_arrays(msg.content["arrays"])
    trained, _ = record_to_arrays(reply.content["arrays"])
    boosted = {
        n: received[n] + 1000 * (v - received[n]) if v.dtype.kind == "f" else v for n, v in trained.items()
    }
    reply.content["arrays"] = ArrayRecord({name: Array(values) for name, values in boosted.items()})
    return reply


def test_a_round_whose_loss_blows_up_is_rolled_back_as_one_whose_loss_is_nan():
    """A finite loss of 1e12 was kept: the run went on from it, at chance, the honest nodes' updates
    overflowed and were rejected as theirs, and the run reported success (attack sweep)."""
    from fedge.app.config import AppConfig
    from fedge.app.server_app import build_strategy
    from fedge.server.runner import LOSS_BLOW_UP

    strategy = build_strategy(AppConfig(min_nodes=NODES))  # fedavg's defaults: its norm bound lets it in
    history = run(LocalGrid(reference_app([_boosted_once]), NODES), strategy, rounds=4)
    rounds = history.rounds
    assert [r.extra.get("rolled_back", 0) for r in rounds] == [0, 1, 0, 0]
    assert rounds[1].loss == rounds[0].loss and rounds[-1].accuracy > rounds[0].accuracy
    assert all(r.loss < LOSS_BLOW_UP * 2.4 for r in rounds)
    assert [r.extra["accepted"] for r in rounds[2:]] == [NODES, NODES]  # the honest nodes still count


def test_what_a_blown_up_loss_is_measured_against():
    from fedge.server.runner import _blow_up_reference, _blown_up

    assert _blown_up(231.0, _blow_up_reference(2.3, 0.1))  # 100 times the untrained model's 2.3
    assert not _blown_up(229.0, _blow_up_reference(2.3, 0.1))
    assert _blown_up(3e6, _blow_up_reference(2.3, 2e4))  # or the last kept model's, when larger
    assert _blown_up(11.0, _blow_up_reference(-math.inf, 0.1))  # a resumed run: the kept model's alone
    # an untrained loss that is not positive (a likelihood that crosses zero) says nothing of a blow-up
    assert not _blown_up(1e9, _blow_up_reference(-5.0, 0.01))
    assert not _blown_up(1e9, _blow_up_reference(0.0, 0.01))


def test_a_rolled_back_round_leaves_no_step_in_the_server_momentum():
    """With avgm, the dropped round's huge step stayed in the velocity: the next (honest) rounds stepped by
    it again, were rolled back too, and the run failed (fleet sweep). A rollback rewinds the optimizer."""
    from fedge.app.config import AppConfig
    from fedge.app.server_app import build_strategy

    config = AppConfig(codec="fp32", server_optimizer="avgm", server_lr=1.0, min_nodes=NODES)
    strategy = build_strategy(config)
    history = run(LocalGrid(reference_app([CompressionMod(), _boosted_once]), NODES), strategy, rounds=4)
    rounds = history.rounds
    assert [r.extra.get("rolled_back", 0) for r in rounds] == [0, 1, 0, 0]
    # the dropped round's updates are not "accepted" in metrics.json
    assert rounds[1].extra["accepted"] == 0 and rounds[1].extra["rolled_back_updates"] == NODES
    assert rounds[-1].accuracy > rounds[0].accuracy
    assert strategy.optimizer.steps == 3  # rounds 1, 3 and 4
