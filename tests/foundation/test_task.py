"""The reference task and task loading."""

import threading

import numpy as np
import pytest
import torch

from fedge.app.task import DigitsTask, PreparedTask, TaskLoadError, TrainConfig, load_task


def test_partitions_are_disjoint_and_cover_the_training_split():
    task = DigitsTask()
    parts = [task.load_partition(i, 10, alpha=0.5, seed=0) for i in range(10)]
    total = sum(len(labels) for _, labels in parts)
    train_features, _ = task.load_partition(0, 1, alpha=0.5, seed=0)
    assert total == len(train_features)
    rows = {tuple(x.flatten().tolist()) for features, _ in parts for x in features}
    assert len(rows) > 0.95 * total  # digits has a few duplicate images; partitions do not repeat rows


def test_small_alpha_gives_skewed_label_mixes():
    task = DigitsTask()

    def skew(alpha: float) -> float:
        shares = []
        for i in range(10):
            _, labels = task.load_partition(i, 10, alpha=alpha, seed=1)
            counts = np.bincount(labels.numpy(), minlength=10)
            shares.append(counts.max() / max(counts.sum(), 1))
        return float(np.mean(shares))

    assert skew(0.1) > skew(100.0) + 0.2


def test_test_set_is_fixed_and_separate():
    task = DigitsTask()
    features, labels = task.test_set(1, alpha=0.5, seed=0)
    assert len(labels) == 359 and features.shape[1:] == (1, 8, 8)  # 20% of each class, rounded per class
    assert torch.equal(task.test_set(1, alpha=0.5, seed=0)[1], labels)


def test_training_improves_accuracy_and_is_reproducible():
    task = DigitsTask()
    data = task.load_partition(0, 1, alpha=0.5, seed=0)
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        model = task.model()
        before = task.evaluate(model, task.test_set(1, alpha=0.5, seed=0))["accuracy"]
        metrics = task.train(model, data, TrainConfig(epochs=2, seed=4))
        results.append(
            (task.evaluate(model, task.test_set(1, alpha=0.5, seed=0))["accuracy"], metrics["train_loss"])
        )
    assert results[0] == results[1]
    assert results[0][0] > before + 0.5
    assert metrics["num-examples"] == len(data[1])


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon_here", "not of the form"),
        ("fedge.no_such_module:Task", "does not import"),
        ("fedge.app.task:NoSuchClass", "does not name"),
        ("fedge.app.task:TrainConfig", "does not name"),
    ],
)
def test_bad_task_paths_name_the_problem(path, message):
    with pytest.raises(TaskLoadError, match=message):
        load_task(path)


def test_prepared_partitions_load_without_the_partitioner(tmp_path):
    """Client processes read the cached split instead of importing flwr-datasets and recomputing it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FEDGE_CACHE_DIR": str(tmp_path)}
    expected = DigitsTask().load_partition(3, 7, alpha=0.3, seed=11)[1]  # computed in this process
    probe = (
        "import sys; from fedge.app.task import DigitsTask; "
        "labels = DigitsTask().load_partition(3, 7, alpha=0.3, seed=11)[1]; "
        "print('datasets' in sys.modules, labels.tolist())"
    )
    code = f"from fedge.app.task import DigitsTask; DigitsTask().prepare(7, alpha=0.3, seed=11); {probe}"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert first.stdout.startswith("True") and second.stdout.startswith("False")
    assert second.stdout.split(" ", 1)[1].strip() == str(expected.tolist())
    assert len(list(tmp_path.glob("digits-dirichlet-*.npz"))) == 1


def _trained(model: torch.nn.Module, weights: dict, data, seed: int) -> dict:
    model.load_state_dict(weights)
    DigitsTask().train(model, data, TrainConfig(epochs=1, learning_rate=0.1, batch_size=8, seed=seed))
    return {name: t.clone() for name, t in model.state_dict().items()}


def test_a_reused_client_model_trains_exactly_as_a_fresh_one_and_is_per_thread():
    prepared = PreparedTask(DigitsTask(), 4, alpha=0.5, seed=0)
    reused = prepared.client_model()
    assert prepared.client_model() is reused
    torch.manual_seed(1)
    first, second = DigitsTask().model().state_dict(), DigitsTask().model().state_dict()
    _trained(reused, first, prepared.partition(0), seed=1)  # leaves weights and gradients behind
    again = _trained(prepared.client_model(), second, prepared.partition(1), seed=2)
    fresh = _trained(DigitsTask().model(), second, prepared.partition(1), seed=2)
    assert all(torch.equal(again[name], fresh[name]) for name in fresh)
    assert any(p.grad is not None for p in reused.parameters())  # what a next call must not inherit
    assert all(p.grad is None for p in prepared.client_model().parameters())
    other: list[torch.nn.Module] = []
    thread = threading.Thread(target=lambda: other.append(prepared.client_model()))
    thread.start()
    thread.join()
    assert other[0] is not reused


def test_a_task_that_opts_out_of_reuse_gets_a_fresh_model_each_call():
    class Stateful(DigitsTask):
        reuse_model = False

    prepared = PreparedTask(Stateful(), 4, alpha=0.5, seed=0)
    assert prepared.client_model() is not prepared.client_model()


def test_a_task_gets_a_fresh_model_each_call_unless_it_said_its_own_methods_allow_reuse():
    """Reuse carried hooks and requires_grad changes from one client's train to the next (library sweep):
    a task must say it leaves nothing on the module, and a subclass that overrides train has not said so."""

    class Hooked(DigitsTask):
        def train(self, model, data, config):
            model.register_forward_hook(lambda module, inputs, output: output * 0)
            return super().train(model, data, config)

    class Declared(Hooked):
        reuse_model = True  # its author vouches for its train

    for task, reused in [(Hooked(), False), (Declared(), True), (DigitsTask(), True)]:
        prepared = PreparedTask(task, 4, alpha=0.5, seed=0)
        assert (prepared.client_model() is prepared.client_model()) is reused, type(task).__name__


def test_fedprox_mu_keeps_the_local_model_near_the_global_one():
    """Flower's FedProx sends proximal-mu; the default train ignored it, so FedProx was FedAvg (library
    sweep). With a large mu the update is far smaller than without."""
    prepared = PreparedTask(DigitsTask(), 4, alpha=0.5, seed=0)
    torch.manual_seed(0)
    start = DigitsTask().model().state_dict()
    norms = {}
    for mu in (0.0, 10.0):
        model = DigitsTask().model()
        model.load_state_dict(start)
        DigitsTask().train(model, prepared.partition(0), TrainConfig(epochs=1, seed=3, proximal_mu=mu))
        norms[mu] = sum(float(((model.state_dict()[k] - start[k]).float() ** 2).sum()) for k in start) ** 0.5
    assert norms[10.0] < 0.5 * norms[0.0]


def test_the_reference_client_hands_fedprox_mu_and_the_instructions_config_to_train(tmp_path):
    from flwr.serverapp.strategy import FedProx

    from fedge.app.config import AppConfig
    from fedge.app.server_app import run_federated
    from fedge.flower.compat import set_task_identity
    from fedge.simulation.local_grid import LocalGrid

    (tmp_path / "seen.py").write_text(
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Seen(DigitsTask):\n"
        "    def train(self, model, data, config):\n"
        "        round_ = float(config.options['server-round'])\n"
        "        return {**super().train(model, data, config), 'mu': config.proximal_mu, 'round': round_}\n"
    )
    from fedge.app.client_app import app

    grid = LocalGrid(app, 2)
    set_task_identity(run_id=1)
    config = AppConfig(rounds=1, local_epochs=1, min_nodes=2, task=f"{tmp_path / 'seen.py'}:Seen")
    try:
        strategy = FedProx(proximal_mu=0.25, fraction_evaluate=0.0, min_available_nodes=2)
        (only,) = run_federated(grid, config, [], strategy=strategy).rounds
    finally:
        grid.shutdown()
    assert only.extra["train_mu"] == 0.25 and only.extra["train_round"] == 1.0


@pytest.mark.parametrize(
    ("clients", "alpha", "advice"),
    [
        (1000, 0.5, "use fewer clients (about 143 or less) or a larger alpha"),
        (40, 0.2, "use a larger alpha, or another seed"),  # 60 clients split; fewer clients would not help
    ],
)
def test_a_split_the_digits_cannot_hold_gives_advice_that_helps(
    tmp_path, monkeypatch, clients, alpha, advice
):
    from fedge.app import digits
    from fedge.config import ConfigError

    monkeypatch.setenv("FEDGE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=f"among {clients} clients") as info:
        digits.dirichlet_partitions.__wrapped__(clients, alpha, 0)
    assert advice in str(info.value)


def test_a_batchnorm_model_trains_on_a_partition_whose_last_batch_would_be_one_row():
    # 17 rows in batches of 16: the last batch of one made BatchNorm1d raise, and every client fail
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    features, labels = torch.randn(17, 4), torch.randint(0, 3, (17,))
    result = DigitsTask().train(model, (features, labels), TrainConfig(2, 0.05, 16, seed=0))
    assert result["num-examples"] == 17 and np.isfinite(result["train_loss"])
    assert model[1].num_batches_tracked.item() == 2  # one batch of 17 an epoch


@pytest.mark.parametrize("targets", [torch.zeros(6, 1), torch.zeros(6), torch.full((6, 3), 1 / 3)])
def test_the_default_train_and_evaluate_refuse_float_labels_in_one_line(targets):
    """A regressor's (N, 1) float targets under the default cross-entropy train() gave a loss and a
    gradient of 0 (a softmax over one output is 1): a whole run trained nothing, said nothing, exited 0."""
    from fedge.app.task_checks import TaskContractError

    task = DigitsTask()
    model = torch.nn.Linear(4, targets.shape[1] if targets.ndim > 1 else 3)
    data = (torch.randn(6, 4), targets)
    with pytest.raises(TaskContractError, match=r"default Task.train\(\) takes integer class labels"):
        task.train(model, data, TrainConfig(epochs=1, learning_rate=0.1, batch_size=4, seed=0))
    with pytest.raises(TaskContractError, match=r"default Task.evaluate\(\) takes integer class labels"):
        task.evaluate(model, data)
    classes = torch.tensor([0, 1, 2, 0, 1, 2])  # integer labels train as before
    trained = task.train(torch.nn.Linear(4, 3), (data[0], classes), TrainConfig(1, 0.1, 4, seed=0))
    assert trained["num-examples"] == 6
