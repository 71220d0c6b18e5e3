"""The generated 1,000-client task (fedge.app.synthetic): deterministic, well split, learnable."""

import json

import numpy as np
import torch
from recurrent_model import Recurrent
from torch import nn
from typer.testing import CliRunner

from fedge.app.synthetic import NUM_CLASSES, NUM_FEATURES, SyntheticTask, sample
from fedge.app.task import TrainConfig, load_task
from fedge.cli import app
from fedge.server.model_export import read_latest
from fedge.simulation.fleet import training_flops_per_example

PATH = "fedge.app.synthetic:SyntheticTask"


def test_same_seed_same_data_other_seed_other_data():
    first, again = SyntheticTask(), SyntheticTask()
    a = first.load_partition(7, 1000, alpha=0.5, seed=0)
    b = again.load_partition(7, 1000, alpha=0.5, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other = first.load_partition(7, 1000, alpha=0.5, seed=1)
    assert not torch.equal(a[0], other[0])
    # A client's data does not depend on how many clients there are, nor on which process asks.
    assert torch.equal(a[0], first.load_partition(7, 20, alpha=0.5, seed=0)[0])
    test_a, test_b = first.test_set(1000, alpha=0.5, seed=0), again.test_set(10, alpha=1.0, seed=3)
    assert torch.equal(test_a[0], test_b[0]) and torch.equal(test_a[1], test_b[1])


def test_partitions_are_disjoint_cover_the_training_set_and_are_non_iid():
    task = SyntheticTask(examples_per_client=100)
    clients = 50
    parts = [task.load_partition(i, clients, alpha=0.5, seed=0) for i in range(clients)]
    features, labels = task.train_set(clients, alpha=0.5, seed=0)
    # Cover: the training set is the partitions, in client order, every client with its full share.
    assert features.shape == (clients * 100, NUM_FEATURES) and labels.dtype == torch.int64
    assert torch.equal(features, torch.cat([p[0] for p in parts]))
    assert all(len(p[1]) == 100 for p in parts)
    # Disjoint: no example is in two partitions (nor twice in one).
    assert len({row.tobytes() for row in features.numpy()}) == len(features)
    # Disjoint from the test set too.
    test = {row.tobytes() for row in task.test_set(clients, alpha=0.5, seed=0)[0].numpy()}
    assert test.isdisjoint(row.tobytes() for row in features.numpy())
    # Non-IID: a typical client holds mostly a few classes; pooled, every class is there.
    top_share = [np.bincount(p[1].numpy(), minlength=NUM_CLASSES).max() / 100 for p in parts]
    assert np.median(top_share) > 0.3
    assert set(labels.tolist()) == set(range(NUM_CLASSES))
    # Larger alpha: closer to IID.
    iid = [sample(i, 100, alpha=100.0, seed=0)[1] for i in range(clients)]
    assert np.median([np.bincount(y, minlength=NUM_CLASSES).max() / 100 for y in iid]) < 0.25


def test_lean_training_matches_the_default_sgd():
    task = SyntheticTask()
    data = task.load_partition(3, 1000, alpha=0.5, seed=0)
    config = TrainConfig(epochs=2, batch_size=16, seed=5)
    torch.manual_seed(0)
    lean = task.model()
    torch.manual_seed(0)
    default = task.model()
    ours = task.train(lean, data, config)
    reference = super(SyntheticTask, task).train(default, data, config)
    for a, b in zip(lean.parameters(), default.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert abs(ours["train_loss"] - reference["train_loss"]) < 1e-5
    assert ours["num-examples"] == reference["num-examples"] == 128.0


def test_flops_and_export_inputs_work_as_for_digits():
    task = load_task(PATH, {"hidden": 32})
    test = task.test_set(10, alpha=0.5, seed=0)
    flops = training_flops_per_example(task.model(), test[0][0])
    # Forward 2·(48·32 + 32·32 + 32·10) multiply-adds, backward about twice that.
    assert 2 * 2 * (48 * 32 + 32 * 32 + 32 * 10) <= flops <= 4 * 2 * (48 * 32 + 32 * 32 + 32 * 10)
    inputs = task.export_inputs(test)
    assert inputs is not None and inputs.example.shape == (2, NUM_FEATURES)
    assert inputs.example.dtype == np.float32 and len(inputs.labelled[1]) == len(test[1])


def test_a_few_rounds_of_fedge_simulate_learn_above_chance_and_export(tmp_path):
    out, config = tmp_path / "run", tmp_path / "run.toml"
    config.write_text(f"export_every = 3\n\n[task]\npath = {json.dumps(PATH)}\nexamples_per_client = 64\n")
    run = ["simulate", "--clients", "20", "--rounds", "3", "--workers", "1", "--config", str(config)]
    result = CliRunner().invoke(app, [*run, "--out", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["clients_replied"] for r in metrics["rounds"]] == [20, 20, 20]
    # The global model was exported to ONNX after round 3 and verified against torch.
    assert read_latest(out).server_round == 3
    assert metrics["rounds"][-1]["export_failures"] == 0
    # Measured (seed 0): 0.09 before training, 0.17, 0.25, 0.29 after rounds 1-3; chance is 0.10.
    accuracies = [r["accuracy"] for r in metrics["rounds"]]
    assert accuracies[-1] > 0.2 and accuracies[-1] > metrics["initial_accuracy"] + 0.15


def test_flops_of_a_model_with_batchnorm1d_are_counted_not_refused():
    """BatchNorm1d in training mode refuses a batch of one; the count is per example all the same."""
    from fedge.split.timing import stage_flops

    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    normed = torch.nn.Sequential(plain[0], torch.nn.BatchNorm1d(16), *plain[1:])
    example = torch.randn(8)
    linear = training_flops_per_example(plain, example)
    assert linear == 3 * 2 * (8 * 16 + 16 * 3) - 2 * 8 * 16  # forward, weight and input gradients
    assert training_flops_per_example(normed, example) >= linear
    flops = stage_flops(normed, example)
    assert flops.forward == 2 * (8 * 16 + 16 * 3)


def test_recurrent_layers_are_counted_as_their_products():
    # a step's products: 2 FLOPs per weight of the input and hidden matrices; backward twice the forward
    example = torch.randn(64, 16)
    for kind, gates in ((nn.LSTM, 4), (nn.GRU, 3)):
        products = 2 * 64 * gates * 128 * (16 + 128)
        flops = training_flops_per_example(Recurrent(kind), example)
        assert 2.5 * products <= flops <= 3.5 * products, (kind.__name__, flops, products)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.a(x), "value": self.b(x)}


def test_a_model_of_several_outputs_is_counted_through_all_of_them():
    # forward 2 * 8 * (3 + 1) and the weights' gradients as much again (the input needs none): both heads
    assert training_flops_per_example(_TwoHeads(), torch.randn(8)) == 2 * 2 * 8 * 4
