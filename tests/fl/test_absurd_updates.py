"""The strategies that trust their clients still refuse absurd updates, at their default settings.

With no norm test at all, one node replying 1e15 in every weight, every round, made each round's aggregate
compute NaN: every round was rolled back, and the run failed after ``max_failed_rounds`` with nothing
trained, although every other node was honest. The default bound for ``fedavg`` and ``fedbuff``
(:data:`fedge.server.screening.TRUSTED_MAX_NORM_RATIO`) rejects such a reply and the round goes on.
"""

from __future__ import annotations

import numpy as np
import pytest
from fl_helpers import reference_app, run
from flwr.app import Array, ArrayRecord, Context, Message, MessageType

from fedge.app.config import AppConfig
from fedge.app.server_app import build_strategy
from fedge.client import CompressionMod
from fedge.protocol.records import record_to_arrays
from fedge.server.run_failures import RunFailed
from fedge.server.screening import TRUSTED_MAX_NORM_RATIO
from fedge.simulation.local_grid import LocalGrid

NODES = 5
ROUNDS = 3


def _replying(value: float):
    """A mod: partition 0 replies ``value`` in every floating weight, every round (finite, and so is its
    norm)."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or msg.metadata.message_type != MessageType.TRAIN:
            return reply
        if context.node_config["partition-id"] != 0:
            return reply
        arrays, _ = record_to_arrays(reply.content["arrays"])
        replaced = {n: np.full_like(v, value) if v.dtype.kind == "f" else v for n, v in arrays.items()}
        reply.content["arrays"] = ArrayRecord({name: Array(values) for name, values in replaced.items()})
        return reply

    return mod


_huge = _replying(1e15)


@pytest.mark.parametrize("settings", [{}, {"codec": "topk:0.1+int8"}], ids=["dense", "compressed"])
def test_default_fedavg_rejects_a_node_sending_absurd_weights_and_trains_on(settings):
    config = AppConfig(rounds=ROUNDS, local_epochs=1, min_nodes=NODES, **settings)
    assert config.max_norm_ratio == TRUSTED_MAX_NORM_RATIO
    # the attacker's mod sits inside the compression mod, where a device's own training code would be
    mods = [CompressionMod(), _huge] if config.codec else [_huge]
    history = run(LocalGrid(reference_app(mods), NODES), build_strategy(config), rounds=ROUNDS)
    rounds = history.rounds
    assert [r.extra.get("rolled_back", 0) for r in rounds] == [0] * ROUNDS
    assert [r.extra.get("rejected_norm_outlier", 0) for r in rounds] == [1] * ROUNDS
    assert [r.extra.get("accepted") for r in rounds] == [NODES - 1] * ROUNDS
    assert rounds[-1].accuracy > history.initial_accuracy + 0.2


def test_without_the_bound_the_same_node_spoils_every_round():
    """The control: the bound switched off (``max_norm_ratio = 0``), the same node's replies are
    aggregated, every round is rolled back, and the run fails having trained nothing."""
    config = AppConfig(rounds=2, local_epochs=1, min_nodes=NODES, max_norm_ratio=0.0)
    with pytest.raises(RunFailed, match="aggregated model's loss was not finite, or blew up"):
        run(LocalGrid(reference_app([_huge]), NODES), build_strategy(config), rounds=2)


@pytest.mark.parametrize(
    "settings",
    [{}, {"codec": "topk:0.1+int8"}, {"strategy": "fedbuff", "buffer_size": 1, "concurrency": 2}],
    ids=["dense", "compressed", "fedbuff-of-one"],
)
def test_with_too_few_replies_for_a_median_an_absurd_update_is_measured_against_the_model(settings):
    """Two nodes (or a FedBuff buffer of one): no median to compare with, and the 1e15 node's update was
    aggregated every round (attack sweep). It is measured against the model's own norm instead."""
    config = AppConfig(rounds=ROUNDS, local_epochs=1, min_nodes=2, **settings)
    mods = [CompressionMod(), _huge] if config.codec else [_huge]
    history = run(LocalGrid(reference_app(mods), 2, workers=1), build_strategy(config), rounds=ROUNDS)
    rounds = history.rounds
    assert all(r.extra.get("rolled_back", 0) == 0 for r in rounds)
    assert sum(r.extra.get("rejected_norm_outlier", 0) for r in rounds) >= 1
    assert all(r.extra.get("accepted", 0) <= 1 for r in rounds)  # the honest node alone
    assert rounds[-1].accuracy > history.initial_accuracy + 0.1


# 7.0 in every weight: about 1,000 times the round's median update, under the loose bound of 10,000, and
# enough to blow the aggregate up
_constant = _replying(7.0)


@pytest.mark.parametrize("settings", [{}, {"codec": "topk:0.1+int8"}], ids=["dense", "compressed"])
def test_after_a_blown_up_round_the_norm_test_rejects_what_got_through(settings):
    """The 7.0 node passed the loose bound every round, each aggregate was dropped, and after three rounds
    the run failed with every other node honest (attack sweep). One round is lost now, not the run."""
    rounds_run = 4
    config = AppConfig(rounds=rounds_run, local_epochs=1, min_nodes=NODES, **settings)
    mods = [CompressionMod(), _constant] if config.codec else [_constant]
    history = run(LocalGrid(reference_app(mods), NODES), build_strategy(config), rounds=rounds_run)
    rounds = history.rounds
    assert [r.extra.get("rolled_back", 0) for r in rounds] == [1, 0, 0, 0]
    assert [r.extra.get("rejected_norm_outlier", 0) for r in rounds[1:]] == [1, 1, 1]
    assert rounds[-1].accuracy > history.initial_accuracy + 0.2
