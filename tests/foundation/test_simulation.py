"""The local engine: reproducible runs, persistent node contexts, failures that do not stop a round."""

import json
import logging
import os
import signal
import time

import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg

from fedge.app.client_app import train as reference_train
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.flower.compat import set_task_identity
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.local_grid import LocalGrid

SMALL = AppConfig(rounds=2, local_epochs=1)


def _metrics(seed: int) -> list[tuple]:
    config = SimulationConfig(clients=4, app=AppConfig(rounds=2, local_epochs=1, seed=seed))
    history = run_simulation(config)
    return [(r.accuracy, r.loss, r.bytes_up, r.bytes_down, r.clients_replied) for r in history.rounds]


def test_same_seed_same_metrics_other_seed_other_metrics():
    first, second, other = _metrics(3), _metrics(3), _metrics(4)
    assert first == second
    assert [m[:2] for m in first] != [m[:2] for m in other]


def test_a_clients_training_draws_the_same_numbers_whatever_the_process_drew_before():
    """A model with dropout: the local engine's workers run calls in whatever order a round's timing
    gives, so a call's random draws must come from its own seed, not from the process's generator."""
    from pathlib import Path

    import torch

    from fedge.app.client_app import app as client_app
    from fedge.app.server_app import train_config_record
    from fedge.app.weights import state_record
    from fedge.protocol.arrays import record_to_numpy

    app = AppConfig(
        rounds=1, local_epochs=1, task=f"{Path(__file__).with_name('dropout_task.py')}:DropoutTask"
    )
    set_task_identity(run_id=1)
    grid = LocalGrid(client_app, 2, workers=1)  # calls on a thread of this process: its generator is theirs
    torch.manual_seed(0)
    from dropout_task import DropoutTask

    weights = state_record(DropoutTask().model())
    replies = []
    try:
        for process_seed in (1, 2):
            torch.manual_seed(process_seed)
            before = torch.random.get_rng_state()
            content = RecordDict({"arrays": weights, "config": train_config_record(app)})
            (reply,) = grid.send_and_receive(
                [Message(content, dst_node_id=min(grid.contexts), message_type="train")]
            )
            assert torch.equal(torch.random.get_rng_state(), before)  # the process's own stream, given back
            replies.append(record_to_numpy(reply.content["arrays"]))
    finally:
        grid.shutdown()
    assert all((replies[0][k] == replies[1][k]).all() for k in replies[0])
    assert any((replies[0][k] != record_to_numpy(weights)[k]).any() for k in replies[0])  # it trained


def test_run_writes_metrics_json_and_plots(tmp_path):
    config = SimulationConfig(clients=3, app=AppConfig(rounds=2, local_epochs=1, out_dir=str(tmp_path)))
    run_simulation(config)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["num-server-rounds"] == 2
    assert [r["round"] for r in metrics["rounds"]] == [1, 2]
    keys = {
        "round",
        "accuracy",
        "loss",
        "clients_sampled",
        "clients_replied",
        "bytes_down",
        "bytes_up",
        "wall_s",
    }
    for row in metrics["rounds"]:
        assert keys <= set(row)
        assert row["clients_sampled"] == row["clients_replied"] == 3
        # 3 models of ~72k float32 parameters each way, plus message overhead
        assert 3 * 4 * 71_000 < row["bytes_up"] < 3 * 4 * 80_000
    for png in ("accuracy.png", "accuracy_vs_upload.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _counting_app(fail_on_partition: int | None = None, crash_on_partition: int | None = None) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == fail_on_partition:
            raise RuntimeError("device out of memory")
        if context.node_config["partition-id"] == crash_on_partition:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
        calls = int(context.state["count"]["calls"]) + 1 if "count" in context.state else 1
        context.state["count"] = MetricRecord({"calls": calls})
        metrics = MetricRecord({"num-examples": 1, "calls": calls})
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": metrics}), reply_to=msg)

    return app


def _send_round(grid: LocalGrid) -> list[Message]:
    set_task_identity(run_id=1)
    arrays = ArrayRecord()
    messages = [Message(RecordDict({"arrays": arrays}), node, "train") for node in grid.get_node_ids()]
    return list(grid.send_and_receive(messages))


def test_node_context_persists_across_rounds():
    grid = LocalGrid(_counting_app(), num_nodes=3)
    try:
        _send_round(grid)
        replies = _send_round(grid)
    finally:
        grid.shutdown()
    assert sorted(r.content["metrics"]["calls"] for r in replies) == [2, 2, 2]
    assert [r.metadata.src_node_id for r in replies] == list(grid.get_node_ids())


def test_calls_start_longest_first_and_replies_keep_the_push_order(monkeypatch):
    """After a node's first call, its next starts in order of how long its last took (longest first: a
    round does not end with one worker on a long call while the others wait); replies still come back in
    the order pushed. One thread runs the calls, so they start exactly in the order the grid chose; each
    call's measured seconds are set to its partition id (partition 3 the longest), so no timing is at
    the mercy of the machine's load."""
    import fedge.simulation.local_grid as local_grid

    started = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        started.append(int(context.node_config["partition-id"]))
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    timed = local_grid._timed_call

    def measured_as_partition(*args):
        frames, context, _ = timed(*args)
        return local_grid.CallResult(frames, context, float(started[-1]))

    monkeypatch.setattr(local_grid, "_timed_call", measured_as_partition)
    grid = LocalGrid(app, num_nodes=4, workers=1)
    try:
        first = _send_round(grid)
        second = _send_round(grid)
    finally:
        grid.shutdown()
    assert started == [0, 1, 2, 3, 3, 2, 1, 0]  # the first round knows nothing, so it keeps the push order
    nodes = list(grid.get_node_ids())
    assert [r.metadata.src_node_id for r in first] == [r.metadata.src_node_id for r in second] == nodes


def test_a_client_cut_off_before_it_trained_keeps_the_context_it_had():
    """The ClientApp really runs before the clock says the client went away; one that was away before it
    could train must not keep what the call left (with a codec, an update folded into its residual and
    sent a round later: work the clock had lost)."""
    from fedge.devices.fleet import CATALOGUE
    from fedge.devices.traces import AvailabilityTrace
    from fedge.simulation.clock_grid import ClockGrid

    grid = LocalGrid(_counting_app(), num_nodes=2, workers=1)
    nodes = list(grid.get_node_ids())
    away_first = AvailabilityTrace({0: [(0.0, 1e6)], 1: [(500.0, 1e6)]}, 1e6)  # client 1 comes at 500 s
    clock = ClockGrid(
        grid,
        [CATALOGUE["pi4_wifi"]] * 2,
        {node: i for i, node in enumerate(nodes)},
        train_flops=lambda instruction, reply: 1e9,
        model_bytes=1000,
        trace=away_first,
    )
    set_task_identity(run_id=1)
    try:
        train = [Message(RecordDict({"arrays": ArrayRecord()}), node, "train") for node in nodes]
        (reply,) = clock.send_and_receive(train)
    finally:
        grid.shutdown()
    assert reply.metadata.src_node_id == nodes[0]
    assert grid.contexts[nodes[0]].state["count"]["calls"] == 1
    assert "count" not in grid.contexts[nodes[1]].state  # its call ran, and is undone


@pytest.mark.parametrize("processes", [True, False])
def test_every_call_gets_its_own_copy_of_a_shared_content_and_wire_sizes_are_flowers(processes):
    """One content object goes to every node (as a strategy sends the global model): a client that changes
    what it received changes nothing another client, or the coordinator, sees."""
    import numpy as np

    from fedge.flower.compat import message_to_bytes
    from fedge.protocol.envelope import encode_message

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        weights = msg.content["arrays"]["w"].numpy()
        seen = MetricRecord(
            {"num-examples": 1, "first": float(weights[0]), "tag": msg.content["config"]["n"]}
        )
        msg.content["config"]["n"] = int(msg.content["config"]["n"]) + 1
        msg.content["arrays"]["w"] = Array(weights + 1.0)
        return Message(RecordDict({"metrics": seen}), reply_to=msg)

    grid = LocalGrid(app, num_nodes=6, workers=2, processes=processes)
    sizes: list[tuple[Message, int]] = []
    grid.on_wire = lambda message, size: sizes.append((message, size))
    set_task_identity(run_id=1)
    content = RecordDict(
        {"arrays": ArrayRecord({"w": Array(np.zeros(50_000, np.float32))}), "config": ConfigRecord({"n": 0})}
    )
    try:
        for _ in range(2):
            messages = [Message(content, node, "train") for node in grid.get_node_ids()]
            replies = list(grid.send_and_receive(messages))
            assert [(r.content["metrics"]["first"], r.content["metrics"]["tag"]) for r in replies] == [
                (0.0, 0)
            ] * 6
    finally:
        grid.shutdown()
    assert content["config"]["n"] == 0 and not content["arrays"]["w"].numpy().any()
    # what would travel: Flower's protobuf for an instruction, fedge's MQTT encoding for a reply
    assert len(sizes) == 24 and all(size == len(encode_message(m)) for m, size in sizes)
    instructions = [(m, size) for m, size in sizes if not m.metadata.reply_to_message_id]
    assert len(instructions) == 12 and all(size == len(message_to_bytes(m)) for m, size in instructions)


@pytest.mark.parametrize("processes", [True, False])
def test_reply_arrays_large_and_small_arrive_exactly(processes):
    """Large arrays cross from the workers out of band: values, dtypes, shapes and Flower's array state
    arrive as the client made them, next to small arrays, metrics and configs."""
    import numpy as np

    rng = np.random.default_rng(0)
    sent = {
        "big": rng.normal(size=(300, 257)),
        "fortran": np.asfortranarray(rng.normal(size=(200, 60)).astype(np.float32)),
        "small": np.arange(7, dtype=np.int8),
        "half": rng.normal(size=20_000).astype(np.float16),
        "empty": np.zeros((0, 3), np.float32),
    }
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = ArrayRecord({name: Array(values) for name, values in sent.items()})
        twin = ArrayRecord({"again": Array(sent["big"])})
        metrics = MetricRecord({"num-examples": 3})
        return Message(RecordDict({"arrays": arrays, "twin": twin, "metrics": metrics}), reply_to=msg)

    grid = LocalGrid(app, num_nodes=3, workers=2, processes=processes)
    set_task_identity(run_id=1)
    try:
        content = RecordDict({"arrays": ArrayRecord()})
        replies = list(grid.send_and_receive([Message(content, n, "train") for n in grid.get_node_ids()]))
    finally:
        grid.shutdown()
    for reply in replies:
        assert not reply.has_error(), reply.error if reply.has_error() else ""
        received = reply.content["arrays"]
        assert list(received) == list(sent)
        for name, values in sent.items():
            array = received[name]
            assert type(array.data) is bytes and array.shape == values.shape
            assert array.dtype == str(values.dtype) and array.stype == "numpy.ndarray"
            np.testing.assert_array_equal(array.numpy(), values)
        np.testing.assert_array_equal(reply.content["twin"]["again"].numpy(), sent["big"])
        assert reply.content["metrics"]["num-examples"] == 3


def test_pushed_messages_are_pulled_by_polling():
    grid = LocalGrid(_counting_app(), num_nodes=4, workers=2)
    set_task_identity(run_id=1)
    try:
        content = RecordDict({"arrays": ArrayRecord()})
        messages = [Message(content, node, "train") for node in grid.get_node_ids()]
        ids = list(grid.push_messages(messages))
        replies, deadline = [], time.monotonic() + 10
        while len(replies) < len(ids) and time.monotonic() < deadline:
            replies += grid.pull_messages(ids)
            time.sleep(0.01)
    finally:
        grid.shutdown()
    assert sorted(r.metadata.reply_to_message_id for r in replies) == sorted(ids)
    assert not any(r.has_error() for r in replies)


def test_replies_are_decoded_as_they_arrive_and_held_once():
    """A finished call's reply is unpickled while other calls run, and its pickle is let go (a round's
    replies are not held twice); pulling hands over the decoded replies in push order."""
    grid = LocalGrid(_counting_app(), num_nodes=4, workers=2)
    set_task_identity(run_id=1)
    try:
        content = RecordDict({"arrays": ArrayRecord()})
        ids = list(grid.push_messages([Message(content, node, "train") for node in grid.get_node_ids()]))
        futures = [grid._pending[i][1] for i in ids]
        grid._pool.wait(futures)  # run every call; nothing pulled yet
        assert sorted(grid._decoded) == sorted(ids)
        assert all(grid._pending[i][1].result() == ((), b"", 0.0) for i in ids)
        replies = list(grid.pull_messages(ids))
    finally:
        grid.shutdown()
    assert [r.metadata.reply_to_message_id for r in replies] == ids and not grid._decoded
    assert [r.content["metrics"]["calls"] for r in replies] == [1, 1, 1, 1]


def test_a_client_past_the_timeout_is_stopped_and_the_grid_goes_on():
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 1:
            time.sleep(60)  # a hung device
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    grid = LocalGrid(app, num_nodes=3, workers=2)
    set_task_identity(run_id=1)
    started = time.monotonic()
    try:
        for _ in range(2):
            messages = [Message(RecordDict(), node, "train") for node in grid.get_node_ids()]
            replies = list(grid.send_and_receive(messages, timeout=1.0))
            assert sorted(r.metadata.src_node_id for r in replies) == [
                n for i, n in enumerate(grid.get_node_ids()) if i != 1
            ]
    finally:
        grid.shutdown()
    assert time.monotonic() - started < 10


def test_a_failing_client_becomes_an_error_reply():
    grid = LocalGrid(_counting_app(fail_on_partition=1), num_nodes=3)
    try:
        replies = _send_round(grid)
    finally:
        grid.shutdown()
    errors = [r for r in replies if r.has_error()]
    assert len(replies) == 3 and len(errors) == 1
    assert "device out of memory" in errors[0].error.reason


def test_a_client_that_kills_its_worker_process_loses_only_its_own_reply():
    grid = LocalGrid(_counting_app(crash_on_partition=2), num_nodes=6, workers=2)
    try:
        rounds = [_send_round(grid), _send_round(grid)]
    finally:
        grid.shutdown()
    crashed_node = list(grid.get_node_ids())[2]
    for number, replies in enumerate(rounds, start=1):
        assert [r.metadata.src_node_id for r in replies] == list(grid.get_node_ids())
        errors = [r for r in replies if r.has_error()]
        assert [r.metadata.src_node_id for r in errors] == [crashed_node]
        assert errors[0].error.code == ErrorCode.CLIENT_APP_CRASHED
        assert "killed by signal 9" in errors[0].error.reason
        assert [r.content["metrics"]["calls"] for r in replies if not r.has_error()] == [number] * 5
    assert "count" not in grid.contexts[crashed_node].state


def test_failed_replies_are_counted_and_the_run_completes(caplog):
    caplog.set_level(logging.INFO, logger="fedge.server.runner")
    set_task_identity(run_id=1)

    def flaky(msg: Message, context: Context, call_next):
        if context.node_config["partition-id"] == 0:
            raise RuntimeError("battery low")
        return call_next(msg, context)

    app = ClientApp(mods=[flaky])
    app.train()(reference_train)
    grid = LocalGrid(app, num_nodes=3)
    try:
        strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=3)
        history = run_federated(grid, SMALL, strategy=strategy)
    finally:
        grid.shutdown()
    assert [(r.clients_sampled, r.clients_replied) for r in history.rounds] == [(3, 2), (3, 2)]
    assert [r.extra["clients_failed"] for r in history.rounds] == [1, 1]  # in metrics.json, every round
    # said once at WARNING (the same failure again at INFO), naming the client and its error
    warned = [r for r in caplog.records if "sampled clients failed" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING", "INFO"]
    assert (
        "1 of 3 sampled clients failed; first: partition 0: RuntimeError: battery low"
        in warned[0].getMessage()
    )


def test_a_run_ends_when_it_reaches_its_target_accuracy():
    config = SimulationConfig(clients=4, app=AppConfig(rounds=30, local_epochs=1, target_accuracy=0.5))
    rounds = run_simulation(config).rounds
    assert rounds[-1].accuracy >= 0.5 and all(r.accuracy < 0.5 for r in rounds[:-1])
    assert len(rounds) < 30


def test_a_tasks_other_evaluation_figures_are_recorded_with_each_round():
    """Numbers beyond accuracy and loss go into each round's metrics (test_backdoor runs it end to end)."""
    import numpy as np
    import torch

    from fedge.reporting.history import RoundMetrics
    from fedge.server.round_figures import evaluation_figures

    result = {"accuracy": 0.9, "loss": 0.3, "num-examples": 10.0, "f1": 0.8, "flag": True, "note": "x"}
    assert evaluation_figures(result) == {"f1": 0.8}
    # a round's own fields are not the task's to set, neither through evaluate() nor in metrics.json
    assert evaluation_figures({**result, "round": 99, "bytes_up": -1, "clients_replied": 1234}) == {"f1": 0.8}
    # numbers of any kind: numpy scalars, 0-d tensors and arrays (a 1-d tensor is not one number)
    typed = {"a": np.float32(0.25), "b": torch.tensor(0.5), "c": np.array(2), "d": torch.ones(3)}
    assert evaluation_figures(typed) == {"a": 0.25, "b": 0.5, "c": 2.0}
    row = RoundMetrics(3, 0.9, 0.3, 4, 4, 10, 20, 1.0, extra={"round": 99.0, "f1": 0.8}).to_json()
    assert row["round"] == 3 and row["f1"] == 0.8


def test_the_clients_train_metrics_are_recorded_with_each_round():
    from fedge.server.round_figures import train_figures

    rounds = run_simulation(SimulationConfig(clients=3, app=AppConfig(rounds=2, local_epochs=1))).rounds
    assert all(r.extra["train_loss"] > 0 for r in rounds)
    assert rounds[1].extra["train_loss"] < rounds[0].extra["train_loss"]  # training lowers it
    record = MetricRecord({"num-examples": 9.0, "f1": 0.5, "train_acc": 0.7, "fedge.version": 3.0})
    assert train_figures(record) == {"train_f1": 0.5, "train_acc": 0.7}


@pytest.mark.parametrize(
    ("figure", "warning"),
    [
        ("accuracy", "evaluate() returned accuracy nan"),
        # A NaN loss after round 0 (finite weights, NaN outputs: a negative BatchNorm variance) is rolled
        # back: tests/fl/test_rollback.py. The warning below is for strategies that cannot roll back.
    ],
)
def test_a_nan_figure_of_the_global_model_is_warned_about_once(tmp_path, caplog, figure, warning):
    (tmp_path / "nan_eval.py").write_text(  # the untrained model's figures are finite (or the run fails)
        "from fedge.app.task import DigitsTask\n\n\n"
        "class NanFigure(DigitsTask):\n"
        "    calls = 0\n\n"
        "    def evaluate(self, model, data):\n"
        "        NanFigure.calls += 1\n"
        "        result = super().evaluate(model, data)\n"
        f"        return result if NanFigure.calls == 1 else {{**result, {figure!r}: float('nan')}}\n"
    )
    app = AppConfig(rounds=2, local_epochs=1, task=f"{tmp_path / 'nan_eval.py'}:NanFigure")
    run_simulation(SimulationConfig(clients=2, app=app))
    warned = [r for r in caplog.records if warning in r.getMessage()]
    assert len(warned) == 1 and "round 1" in warned[0].getMessage()


def test_files_written_atomically_get_the_permissions_open_would_give(tmp_path):
    """mkstemp's 0o600 made metrics.json unreadable to other users who could read the plots beside it."""
    import os

    from fedge.atomic import write_json_atomic

    umask = os.umask(0o022)  # reading it means setting it: put back at once
    os.umask(umask)
    write_json_atomic(tmp_path / "m.json", {"a": 1})
    assert (tmp_path / "m.json").stat().st_mode & 0o777 == 0o666 & ~umask != 0o600


def test_metrics_json_is_strict_json_when_a_figure_is_nan(tmp_path):
    """NaN is not JSON: jq, JavaScript and strict parsers refuse Python's NaN; it is written as null."""
    import math

    from fedge.atomic import write_json_atomic

    write_json_atomic(tmp_path / "m.json", {"loss": math.nan, "rounds": [{"x": math.inf, "y": 1.5}], "n": 2})
    text = (tmp_path / "m.json").read_text()

    def refuse(name: str) -> None:
        raise ValueError(name)

    expected = {"loss": None, "rounds": [{"x": None, "y": 1.5}], "n": 2}
    assert json.loads(text, parse_constant=refuse) == expected


def test_metrics_json_holds_one_round_a_line_as_the_history_has_them(tmp_path):
    """Written after every round, so built and encoded fast (a 1,000-round history took 0.27 s a write
    with dataclasses.asdict and the indenting encoder); the same JSON, NaN as null."""
    import dataclasses
    import math

    from fedge.reporting.history import RoundMetrics, RunHistory

    history = RunHistory(config={"rounds": 2, "task": {"path": "x"}}, initial_accuracy=0.1)
    history.rounds.append(RoundMetrics(1, 0.5, math.nan, 4, 3, 10, 20, 0.2, extra={"ratio": 2.0}))
    timeline = [{"client": 0, "status": "accepted"}]
    history.rounds.append(RoundMetrics(2, 0.6, 0.4, 4, 4, 10, 20, 0.2, extra={"round": 9}, timeline=timeline))
    text = history.write(tmp_path).read_text()
    rows = [json.loads(line.rstrip(",")) for line in text.splitlines() if line.startswith('    {"round"')]
    assert json.loads(text) == {**history.to_json(), "rounds": rows}
    expected = []
    for row in history.rounds:  # what dataclasses.asdict gave: the fields, their extra figures, the timeline
        fields = dataclasses.asdict(row)
        extra, steps = fields.pop("extra"), fields.pop("timeline")
        expected.append({**extra, **fields, **({"timeline": steps} if steps else {})})
    assert rows[0]["loss"] is None and rows[1] == expected[1] and rows[0] == {**expected[0], "loss": None}


def test_a_benchs_json_line_is_strict_json(capsys):
    """A bench's ``--json`` line is read by other languages: a baseline that never reached its target
    (``tta_s`` infinite) was written as ``Infinity``, which JavaScript, Go and serde reject (heterogeneity
    sweep); NumPy's scalars are written as numbers."""
    import math

    import numpy as np

    from fedge.bench._common import emit

    def refuse(name: str) -> None:
        raise ValueError(name)

    result = {"tta_s": math.inf, "headline": {"ok": np.bool_(True), "x": np.float32(0.5)}}
    emit(result, as_json=True, title="t")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line, parse_constant=refuse) == {"tta_s": None, "headline": {"ok": True, "x": 0.5}}


def test_a_library_user_runs_rounds_on_a_local_grid_without_flowers_runtime():
    """Nothing sets Flower's task identity outside its runtime: run_federated on a LocalGrid failed with
    'TaskIdentity.run_id is not set' unless the caller used a private function (library sweep). A fresh
    process, since the suite's other tests set it."""
    import subprocess
    import sys

    script = (
        "from fedge.app.client_app import app\n"
        "from fedge.app.config import AppConfig\n"
        "from fedge.app.server_app import run_federated\n"
        "from fedge.simulation.local_grid import LocalGrid\n"
        "grid = LocalGrid(app, 2, workers=1)\n"
        "history = run_federated(grid, AppConfig(rounds=1, local_epochs=1, min_nodes=2))\n"
        "grid.shutdown()\n"
        "print('rounds', len(history.rounds), history.rounds[0].clients_replied)\n"
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "rounds 1 2"
