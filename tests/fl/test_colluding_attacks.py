"""Colluding attacks (ALIE, IPM) and label flipping: formulas, and attacker clients of the reference app."""

from __future__ import annotations

import logging
from statistics import NormalDist

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, RecordDict

from fedge.app.attacks import IPM_EPSILON, alie_z, attacker_ids, flip_labels, poison
from fedge.app.client_app import app as client_app
from fedge.app.client_app import local_seed
from fedge.app.config import AppConfig
from fedge.app.server_app import train_config_record
from fedge.app.task import TrainConfig, prepare_task
from fedge.app.weights import load_record, state_record
from fedge.flower.compat import set_task_identity
from fedge.protocol.records import record_to_arrays
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.local_grid import LocalGrid

CLIENTS = 10


def test_alie_shifts_the_colluders_mean_by_z_standard_deviations():
    # Baruch et al.: N = 20, m = 4 -> s = 11 - 4 = 7, z = Φ⁻¹(13/20).
    assert alie_z(20, 4) == pytest.approx(NormalDist().inv_cdf(0.65)) == pytest.approx(0.3853, abs=1e-4)
    assert alie_z(10, 1) == pytest.approx(NormalDist().inv_cdf(0.5))  # s = 5: no room to shift
    assert alie_z(10, 6) == pytest.approx(NormalDist().inv_cdf(0.999))  # a majority: the bound, not inf
    received = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
    group = [{"w": received["w"] + d} for d in (np.float32([1, 0, -1]), np.float32([3, 0, 1]))]
    updates = np.stack([g["w"] - received["w"] for g in group])
    expected = received["w"] + updates.mean(0) - alie_z(20, 2) * updates.std(0)
    np.testing.assert_allclose(poison("alie", received, group[0], group=group, num_clients=20)["w"], expected)
    ipm = poison("ipm", received, group[0], group=group)["w"]
    np.testing.assert_allclose(ipm, received["w"] - IPM_EPSILON * updates.mean(0))
    assert float(np.dot(ipm - received["w"], updates.mean(0))) < 0  # the inner product IPM turns negative


def _train_replies(app: AppConfig, model: torch.nn.Module) -> dict[int, dict[str, np.ndarray]]:
    """Every client's reply to one training instruction, by partition, from the reference ClientApp."""
    set_task_identity(run_id=1)
    grid = LocalGrid(client_app, CLIENTS, workers=1)
    try:
        partition_of = {node: int(c.node_config["partition-id"]) for node, c in grid.contexts.items()}
        messages = [
            Message(
                RecordDict({"arrays": state_record(model), "config": train_config_record(app)}),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
            )
            for node in grid.get_node_ids()
        ]
        replies = grid.send_and_receive(messages)
    finally:
        grid.shutdown()
    return {
        partition_of[reply.metadata.src_node_id]: record_to_arrays(reply.content["arrays"])[0]
        for reply in replies
    }


@pytest.mark.parametrize("attack", ["alie", "ipm"])
def test_colluders_all_send_the_attack_computed_from_their_honest_trainings(attack):
    app = AppConfig(attack=attack, attackers=0.3, seed=5)
    task = prepare_task(app.task, app.task_args_json, CLIENTS, alpha=app.alpha, seed=app.seed)
    model = task.client_model()
    received, _ = record_to_arrays(state_record(model))
    honest = _train_replies(AppConfig(seed=5), model)
    attacked = _train_replies(app, model)
    colluders = sorted(attacker_ids(CLIENTS, 0.3, seed=5))
    assert len(colluders) == 3
    floating = [name for name, value in model.state_dict().items() if value.is_floating_point()]
    # What the attack makes of the colluders' honest replies (which each attacker trained for itself).
    expected = poison(
        attack,
        {name: received[name] for name in floating},
        honest[colluders[0]],
        group=[{name: honest[p][name] for name in floating} for p in colluders],
        num_clients=CLIENTS,
    )
    for partition in range(CLIENTS):
        for name in floating:
            want = expected[name] if partition in colluders else honest[partition][name]
            np.testing.assert_allclose(attacked[partition][name], want, rtol=1e-5, atol=1e-6)


def test_a_run_under_ipm_still_learns_with_a_robust_rule(caplog):
    caplog.set_level(logging.ERROR)
    app = AppConfig(rounds=8, seed=0, strategy="sparse-trimmed-mean", attack="ipm", compress="strong")
    history = run_simulation(SimulationConfig(clients=CLIENTS, workers=2, app=app))
    assert [r.round for r in history.rounds] == list(range(1, 9))
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.3, [r.accuracy for r in history.rounds]


def test_label_flippers_train_on_flipped_labels_and_the_others_are_untouched():
    assert flip_labels(torch.tensor([0, 3, 9]), 10).tolist() == [9, 6, 0]
    assert flip_labels(np.array([1, 0]), 2).tolist() == [0, 1]
    with pytest.raises(ValueError, match="integer class labels"):
        flip_labels(torch.tensor([0.5]), 2)
    app = AppConfig(attack="label-flip", attackers=0.3, seed=5)
    task = prepare_task(app.task, app.task_args_json, CLIENTS, alpha=app.alpha, seed=app.seed)
    model = task.client_model()
    initial = state_record(model)
    honest = _train_replies(AppConfig(seed=5), model)
    attacked = _train_replies(app, model)
    flippers = attacker_ids(CLIENTS, 0.3, seed=5)
    for partition in range(CLIENTS):
        same = all(np.array_equal(honest[partition][n], attacked[partition][n]) for n in honest[partition])
        assert same == (partition not in flippers), partition
    # A flipper's reply is exactly an honest training on its partition with every label y -> 9 - y.
    flipper = min(flippers)
    features, labels = task.partition(flipper)
    trained = load_record(task.task.model(), initial)
    config = TrainConfig(
        epochs=app.local_epochs,
        learning_rate=app.learning_rate,
        batch_size=app.batch_size,
        seed=local_seed(5, flipper, 0),
    )
    task.task.train(trained, (features, flip_labels(labels, 10)), config)
    expected = record_to_arrays(state_record(trained))[0]
    for name, value in expected.items():
        np.testing.assert_allclose(attacked[flipper][name], value, rtol=1e-5, atol=1e-6)
