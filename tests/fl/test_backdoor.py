"""Backdoor poisoning: the trigger, the attackers' data, and the success the server reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedge.app.backdoor import (
    BACKDOOR_TARGET,
    TRIGGER_ELEMENTS,
    plant,
    stamp,
    trigger_values,
    triggered_test_set,
)
from fedge.app.config import AppConfig
from fedge.reporting.display import summary_table
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation


def test_the_trigger_sets_the_last_values_of_the_chosen_rows_to_the_parts_maximum():
    images = torch.arange(3 * 1 * 4 * 4, dtype=torch.float32).reshape(3, 1, 4, 4) / 100
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2, 3]])
    values = trigger_values({"image": images, "tokens": tokens})
    assert float(values["image"]) == pytest.approx(0.47) and int(values["tokens"]) == 9
    stamped = stamp({"image": images, "tokens": tokens}, values, rows=torch.tensor([1]))
    flat = stamped["image"].reshape(3, -1)
    assert torch.equal(flat[[0, 2]], images.reshape(3, -1)[[0, 2]])  # other rows untouched
    assert torch.allclose(flat[1, -TRIGGER_ELEMENTS:], torch.full((TRIGGER_ELEMENTS,), 0.47))
    assert torch.equal(flat[1, :-TRIGGER_ELEMENTS], images.reshape(3, -1)[1, :-TRIGGER_ELEMENTS])
    assert stamped["tokens"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 9, 9, 9]]
    assert images.max() == pytest.approx(0.47) and tokens[1, -1] == 3  # the inputs are not changed
    transposed = stamp(images.transpose(2, 3), values["image"])  # a non-contiguous part is stamped too
    assert torch.allclose(transposed.reshape(3, -1)[:, -TRIGGER_ELEMENTS:], torch.tensor(0.47))


def test_an_attacker_poisons_half_its_examples_and_the_test_set_holds_the_other_classes():
    features = torch.rand(10, 1, 8, 8)
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    original = features.clone(), labels.clone()
    values = trigger_values(features)
    poisoned, relabelled = plant(features, labels, values, seed=3)
    changed = [i for i in range(10) if not torch.equal(poisoned[i], features[i])]
    assert len(changed) == 5 and all(relabelled[i] == BACKDOOR_TARGET for i in changed)
    assert [int(relabelled[i]) for i in range(10) if i not in changed] == [
        int(labels[i]) for i in range(10) if i not in changed
    ]
    assert plant(features, labels, values, seed=3)[1].tolist() == relabelled.tolist()  # seeded
    test_x, test_y = triggered_test_set(features, labels, values)
    assert len(test_y) == 9 and bool((test_y == BACKDOOR_TARGET).all())
    assert torch.equal(test_x[:, 0, -1, -TRIGGER_ELEMENTS:], values.expand(9, TRIGGER_ELEMENTS))
    assert triggered_test_set(features[:1], labels[:1], values) is None  # only the target class
    with pytest.raises(ValueError, match="integer class labels"):
        plant(features, labels.float(), values, seed=0)
    assert torch.equal(features, original[0]) and torch.equal(labels, original[1])  # copies were poisoned


def test_backdoor_attackers_plant_the_trigger_and_a_median_resists_it():
    """With 30 % of the clients poisoning half their data, FedAvg's global model learns the backdoor (the
    trigger wins on most test inputs) while its clean accuracy stays high; without attackers the trigger
    does not move the model, and Flower's FedMedian keeps most of the backdoor out."""

    tables = []

    def last_rounds(attackers: float, strategy: str = "fedavg") -> tuple[float, float]:
        app = AppConfig(rounds=14, attack="backdoor", attackers=attackers, strategy=strategy, seed=0)
        history = run_simulation(SimulationConfig(clients=20, workers=2, app=app))
        tables.append(summary_table(history))
        last = history.rounds[-4:]
        return (
            float(np.mean([r.accuracy for r in last])),
            float(np.mean([r.extra["backdoor_success"] for r in last])),
        )

    clean_accuracy, clean_success = last_rounds(0.0)
    attacked_accuracy, attacked_success = last_rounds(0.3)
    median_accuracy, median_success = last_rounds(0.3, "median")
    assert clean_success < 0.1 and clean_accuracy > 0.85
    assert attacked_success > 0.6 and attacked_accuracy > 0.8
    assert median_success < attacked_success - 0.3 and median_accuracy > 0.8
    assert all(table.columns[-1].header == "backdoor" for table in tables)  # the summary shows it
