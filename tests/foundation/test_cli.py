"""`fedge` command line: help, a real small run, and bad input that ends in one line, not a traceback."""

import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from fedge.cli import app

runner = CliRunner()


def test_help_lists_subcommands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("simulate", "bench"):
        assert command in result.output


def test_simulate_small_run_writes_metrics(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["simulate", "--clients", "3", "--rounds", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["rounds"]) == 2
    assert "fedge simulate (local)" in result.output  # the summary table


def test_config_file_and_flags_combine(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('clients = 3\nrounds = 1\nalpha = 2.0\nlocal_epochs = 1\nengine = "local"\n')
    out = tmp_path / "run"
    args = ["simulate", "--config", str(config), "--rounds", "2", "--workers", "1", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["alpha"] == 2.0 and len(metrics["rounds"]) == 2
    assert "workers 1," in result.output


def test_the_config_files_out_dir_is_where_the_run_writes_unless_out_is_given(tmp_path):
    """--out's default had overridden the file's out_dir: the run wrote runs/latest (over an earlier run)."""
    config = tmp_path / "run.toml"
    config.write_text(f'clients = 3\nrounds = 1\nlocal_epochs = 1\nout_dir = "{tmp_path / "from_file"}"\n')
    result = runner.invoke(app, ["simulate", "--config", str(config), "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "from_file" / "metrics.json").is_file()
    flag = tmp_path / "from_flag"
    result = runner.invoke(app, ["simulate", "--config", str(config), "--workers", "1", "--out", str(flag)])
    assert result.exit_code == 0 and (flag / "metrics.json").is_file(), result.output


@pytest.mark.parametrize(
    ("args", "toml", "needle"),
    [
        (["--engine", "quantum"], None, "unknown engine 'quantum'"),
        (["--task", "nowhere.module:Task"], None, "does not import"),
        (["--clients", "0"], None, "clients must be"),
        (["--workers", "0"], None, "workers must be"),
        (["--alpha", "0"], None, "alpha must be > 0"),
        (["--rounds", "0"], None, "rounds must be >= 1"),
        (["--clients", "3"], "min_nodes = 5\n", "min_nodes (5) exceeds clients (3)"),
        ([], "clients = 4\nroundz = 3\n", "unknown key 'roundz'"),
        ([], "alpha = -1.0\n", "alpha must be > 0"),
        ([], "clients = 'many'\n", "clients must be int"),
        ([], "this is not toml", "not valid TOML"),
        ([], "learning_rate = inf\n", "learning_rate must be > 0 and finite"),
        ([], 'codec = "fp32"\nserver_lr = inf\n', "server_lr must be > 0 and finite"),
        (["--codec", "fp32", "--server-lr", "inf"], None, "server_lr must be > 0 and finite"),
        # it said "downlink_codec needs codec": the preset had set that
        (["--compress", "max", "--codec", ""], None, "codec is empty, and compress 'max' sets downlink"),
        ([], "alpha = nan\n", "alpha must be a number, got nan"),
        ([], "round_timeout_s = 0\n", "round_timeout_s must be > 0 and finite"),
        (["--alpha", "inf"], None, "alpha must be > 0 and finite"),
        (["--broker", "mqtt://127.0.0.1:1"], None, "broker is for the mqtt engine"),
        (["--out", "pyproject.toml"], None, "--out pyproject.toml is a file, not a directory"),
        (
            ["--out", "pyproject.toml/sub"],
            None,
            "--out pyproject.toml/sub: cannot write there (Not a directory)",
        ),
        (
            [],
            'strategy = "fedbuff"\n[fleet]\nmix = { pi4_wifi = 1.0 }\n[schedule]\ndeadline_s = 2.0\n',
            "a deadline or over_select does not apply to strategy fedbuff",
        ),
        # a 401-digit integer had raised OverflowError in the config's coercion, or the fleet's mix
        ([], "learning_rate = 1" + "0" * 400 + "\n", "learning_rate is too large a number"),
        (
            [],
            "[fleet]\nmix = { pi4_wifi = 1" + "0" * 400 + " }\n",
            "mix.pi4_wifi must be a finite number >= 0, got 1000",
        ),
        (
            [],
            'codec = "topk:0.1+int8"\n[upload_budget]\ndeadline_s = 30.0\n',
            "an [upload_budget] needs a [fleet] on the local and ray engines",
        ),
        (["--split", "--engine", "mqtt"], None, "engine 'mqtt' does not run split training"),
        (["--split", "--workers", "3"], None, "workers does not apply to --split"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, toml, needle):
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        args = [*args, "--config", str(path)]
    result = runner.invoke(app, ["simulate", *args])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error:") and needle in result.output
    assert len(result.output.strip().splitlines()) == 1 and len(result.output) < 1000


def test_missing_config_file_and_unknown_bench(tmp_path):
    result = runner.invoke(app, ["simulate", "--config", str(tmp_path / "absent.toml")])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = runner.invoke(app, ["bench", "no-such-bench"])
    assert result.exit_code == 2 and "unknown bench" in result.output


def test_bad_input_in_a_real_process_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "fedge", "simulate", "--engine", "quantum"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip() == "error: unknown engine 'quantum'; choose one of: local, ray, mqtt"


def test_a_run_that_fails_because_it_was_interrupted_ends_as_interrupted(tmp_path, monkeypatch):
    """Ray's actors die with an interrupted run, and the ServerApp's failure (RunFailed) reached the CLI in
    place of the interrupt once in a full suite: exit 1 with "error: ...", not 130 with the summary."""
    from fedge.server.runner import RunFailed
    from fedge.simulation import engines

    def interrupted_then_failed(config, listeners=()):
        try:
            signal.raise_signal(signal.SIGINT)  # its handler runs before raise_signal returns
        except KeyboardInterrupt:
            raise RunFailed("aggregation failed: ActorDiedError: the actor died") from None
        raise AssertionError("SIGINT did not interrupt the run")

    monkeypatch.setattr(engines, "run_simulation", interrupted_then_failed)
    result = runner.invoke(app, ["simulate", "--clients", "4", "--rounds", "2", "--out", str(tmp_path / "r")])
    assert result.exit_code == 130, result.output
    assert "interrupted after 0 of 2 rounds" in result.output and "error:" not in result.output


@pytest.mark.parametrize(
    ("engine", "signum", "code"),
    [
        ("local", signal.SIGINT, 130),
        ("local", signal.SIGTERM, 143),
        # Ray: Ctrl-C left the ServerApp thread waiting and the process never exited; SIGTERM aborted it
        # (exit 134) with no plots and no summary
        ("ray", signal.SIGINT, 130),
        ("ray", signal.SIGTERM, 143),
    ],
)
def test_ctrl_c_or_kill_keeps_and_shows_the_completed_rounds(tmp_path, engine, signum, code):
    out = tmp_path / "run"
    clients = "3" if engine == "ray" else "10"  # Ray: an actor per client on 2 cores
    command = [sys.executable, "-m", "fedge", "simulate", "--engine", engine, "--clients", clients]
    command += ["--rounds", "500", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.json"
    deadline = time.monotonic() + 300
    while not metrics.exists():  # written after every round: interrupt once one has completed
        assert time.monotonic() < deadline, "no round completed"
        with contextlib.suppress(subprocess.TimeoutExpired):  # wakes at once if the process ends
            process.wait(timeout=0.1)
            raise AssertionError(f"fedge simulate ended before a round completed: {process.returncode}")
    process.send_signal(signum)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == code, output[-2000:]
    assert f"fedge simulate ({engine}), interrupted" in output  # the summary table
    completed = int(re.search(r"interrupted after (\d+) of 500 rounds", output).group(1))  # type: ignore[union-attr]
    assert completed >= 1, output[-2000:]
    assert len(json.loads((out / "metrics.json").read_text())["rounds"]) == completed
    assert (out / "accuracy.png").is_file()
    # Flower's Ray backend logs the traceback of a message its actor was processing when the engine stopped
    # (vce_api's worker); fedge's own output has none
    fedge_lines = [line for line in output.splitlines() if "flwr" not in line and "vce_api" not in line]
    assert engine == "ray" or "Traceback" not in output
    assert engine == "local" or not any(line.startswith("Traceback") for line in fedge_lines)


BROKEN_TASK = """
from fedge.app.task import DigitsTask


class Broken(DigitsTask):
    def load_partition(self, partition_id, num_partitions, *, alpha, seed):
        raise ValueError(f"broken data in partition {partition_id}")
"""


def test_a_run_that_trains_nothing_stops_with_one_line_and_a_non_zero_status(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN_TASK)
    out = tmp_path / "run"
    args = ["simulate", "--task", f"{tmp_path / 'broken.py'}:Broken", "--clients", "2", "--rounds", "10"]
    result = runner.invoke(app, [*args, "--workers", "1", "--out", str(out)])
    assert result.exit_code == 1, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "no client update was accepted in 3 consecutive rounds" in error[0]
    assert "ValueError: broken data in partition" in error[0] and "partition " in error[0]
    assert error[0].endswith("(-v shows the whole client traceback)")  # the client raised: its traceback
    assert len(json.loads((out / "metrics.json").read_text())["rounds"]) == 3  # kept, and no more


def test_more_clients_than_the_data_can_split_is_one_line(tmp_path):
    env = {**__import__("os").environ, "FEDGE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedge",
            "simulate",
            "--clients",
            "1000",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: cannot split the 1,438 digits training images among 1000 clients")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("command", "toml", "needle"),
    [
        (
            "coordinator",
            'state_dir = "{tmp}/s"\nwait_for_nodes_s = nan\n',
            "wait_for_nodes_s must be a number",
        ),
        ("coordinator", 'state_dir = "{tmp}/s"\nmqtt = 5\n', "mqtt must be a table, got 5"),
        ("agent", 'node_id = "n1"\nstate_dir = "/proc/none/s"\n', "cannot create the state directory"),
        ("agent", 'node_id = "coordinator"\nstate_dir = "{tmp}/s"\n', "is reserved for the coordinator"),
        (
            "coordinator",
            'state_dir = "{tmp}/s"\n[schedule]\ndeadline_s = 5.0\n[app]\nstrategy = "fedbuff"\n',
            "a deadline or over_select does not apply to strategy fedbuff",
        ),
        (
            "agent",
            'node_id = "n1"\nstate_dir = "{tmp}/s"\n'
            '[node_config]\n"partition-id" = 5\n"num-partitions" = 2\n',
            "partition-id must be in 0..1, got 5",
        ),
        (
            "agent",
            'node_id = "n1"\nstate_dir = "{tmp}/s"\n[node_config]\n"partition-id" = 1.5\n',
            "partition-id must be an integer",
        ),
    ],
)
def test_bad_service_configs_are_one_line(tmp_path, command, toml, needle):
    path = tmp_path / "bad.toml"
    path.write_text(toml.format(tmp=tmp_path))
    result = runner.invoke(app, [command, "--config", str(path)])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("log", "needle"),
    [(None, "no audit log"), ("not json\n{]\n", "holds no audit events"), ("dir", "no audit log")],
)
def test_status_audit_of_a_missing_or_damaged_log_is_one_line(tmp_path, log, needle):
    state = tmp_path / "s"
    state.mkdir()
    if log == "dir":
        (state / "audit.jsonl").mkdir()
    elif log is not None:
        (state / "audit.jsonl").write_text(log)
    path = tmp_path / "c.toml"
    path.write_text(f'state_dir = "{state}"\n')
    result = runner.invoke(app, ["status", "--config", str(path), "--audit"])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_status_audit_says_so_when_no_update_has_counted_yet(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    (state / "audit.jsonl").write_text('{"event": "run-start", "time": 1.0}\n')
    path = tmp_path / "c.toml"
    path.write_text(f'state_dir = "{state}"\n')
    result = runner.invoke(app, ["status", "--config", str(path), "--audit"])
    assert result.exit_code == 0 and result.output == "no node's update has counted in any round yet\n"


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"round": 1}', "it lacks 'rounds', 'online_nodes', 'updated_at', 'pid'"),
        ("[1, 2]", "it holds a JSON list, not an object"),
        ('{"round": 1, "rounds": 2, "online_nodes": 3, "updated_at": 1, "pid": 1}', "online_nodes is 3"),
    ],
)
def test_status_of_a_file_that_is_not_a_coordinators_is_one_line(tmp_path, as_json, text, why):
    """--json printed a damaged file and exited 0 (CLI sweep); the error names what is missing."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "status.json").write_text(text)
    path = tmp_path / "c.toml"
    path.write_text(f'state_dir = "{tmp_path}/s"\n')
    result = runner.invoke(app, ["status", "--config", str(path), *(["--json"] if as_json else [])])
    assert result.exit_code == 2 and f"is not a coordinator's status: {why}" in result.output


@pytest.mark.parametrize(
    ("field", "value"), [("updated_at", "-Infinity"), ("updated_at", '"noon"'), ("ended_at", "NaN")]
)
def test_status_with_a_damaged_time_is_refused_in_one_line(tmp_path, field, value):
    """A damaged status.json had been shown as it was ("updated -inf s ago")."""
    status = {"round": 1, "rounds": 3, "online_nodes": [], "updated_at": 1.0, "pid": 1, "state": "done"}
    text = json.dumps(status).replace(f'"{field}": 1.0', f'"{field}": {value}')
    if field not in status:
        text = text[:-1] + f', "{field}": {value}}}'
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "status.json").write_text(text)
    path = tmp_path / "c.toml"
    path.write_text(f'state_dir = "{tmp_path}/s"\n')
    result = runner.invoke(app, ["status", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert f"is not a coordinator's status: {field} is" in result.output
    assert "inf s ago" not in result.output and "nan s ago" not in result.output


def test_the_summary_table_shows_rejected_replies_beside_the_replies():
    from rich.console import Console

    from fedge.reporting.display import summary_table
    from fedge.reporting.history import RoundMetrics, RunHistory

    history = RunHistory(config={})
    history.rounds = [
        RoundMetrics(1, 0.5, 1.0, 5, 5, 0, 0, 0.1, extra={"accepted": 1, "rejected": 4}),
        RoundMetrics(2, 0.6, 0.9, 5, 5, 0, 0, 0.1, extra={"accepted": 5, "rejected": 0}),
        RoundMetrics(3, 0.1, 8.956569106516e11, 5, 5, 0, 0, 0.1),  # a diverging run's loss
    ]
    console = Console(width=200, record=True)
    console.print(summary_table(history))
    text = console.export_text()
    assert "5/5 (4 rejected)" in text and text.count("rejected") == 1
    assert "8.957e+11" in text  # it was cut off in its column as 895656910651…


def test_a_task_whose_prepare_raises_is_one_line(tmp_path):
    """Task.prepare() runs user code (a download, a cache): its exception was a 46-line traceback."""
    (tmp_path / "broken.py").write_text(
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Broken(DigitsTask):\n"
        "    def prepare(self, num_partitions, *, alpha, seed):\n"
        "        raise FileNotFoundError('cache dir /data/x missing')\n"
    )
    result = runner.invoke(app, ["simulate", "--task", f"{tmp_path / 'broken.py'}:Broken", "--rounds", "1"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "prepare() raised FileNotFoundError: cache dir /data/x missing" in result.output


def test_a_bfloat16_model_is_one_line(tmp_path):
    (tmp_path / "bf16.py").write_text(
        "import torch\n"
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Bf16(DigitsTask):\n"
        "    def model(self):\n"
        "        return super().model().to(torch.bfloat16)\n"
    )
    result = runner.invoke(app, ["simulate", "--task", f"{tmp_path / 'bf16.py'}:Bf16", "--rounds", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output  # after the run's header: one line
    assert "numpy cannot carry: bfloat16 (e.g. 'features.0.weight')" in result.output.replace("\n", "")


NO_WEIGHT_TASK = """
from fedge.app.task import DigitsTask


class NoWeight(DigitsTask):
    def train(self, model, data, config):
        result = super().train(model, data, config)
        del result["num-examples"]
        return result
"""


def test_a_run_whose_replies_screening_rejects_says_what_the_reason_means(tmp_path):
    """It said 'rejected by screening: bad_weight x2' and no more."""
    (tmp_path / "no_weight.py").write_text(NO_WEIGHT_TASK)
    args = ["simulate", "--task", f"{tmp_path / 'no_weight.py'}:NoWeight", "--clients", "2", "--rounds", "4"]
    result = runner.invoke(app, [*args, "--workers", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "rejected by screening: bad_weight x2 (bad_weight: num-examples missing" in error


HANGING_TASK = """
import threading

from fedge.app.task import DigitsTask


class Hangs(DigitsTask):
    def train(self, model, data, config):
        threading.Event().wait()  # never returns
"""


def test_a_hanging_train_fails_the_run_after_round_timeout_s(tmp_path):
    """Each round waited an hour for it, and no setting of fedge simulate could change that."""
    (tmp_path / "hangs.py").write_text(HANGING_TASK)
    (tmp_path / "run.toml").write_text("round_timeout_s = 1.0\n")
    args = ["simulate", "--config", str(tmp_path / "run.toml"), "--task", f"{tmp_path / 'hangs.py'}:Hangs"]
    result = runner.invoke(app, [*args, "--clients", "2", "--rounds", "5", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    assert (
        "no client update was accepted in 3 consecutive rounds; first: no client replied in time"
        in result.output
    )


def test_a_text_log_record_cannot_pass_for_another():
    """A node's words inside a record (its error reason) had put a forged record on a line of its own."""
    import logging

    from fedge.cli.common import _TextLines

    record = logging.LogRecord(
        "fedge.transport.grid", logging.WARNING, __file__, 1, "node %s: %s", ("n2", ""), None
    )
    record.args = ("n2", "boom\n2099-01-01 00:00:00,000 INFO fedge.server.service: run finished OK\r\x1b[2J")
    lines = _TextLines("%(levelname)s %(name)s: %(message)s").format(record).split("\n")
    assert lines[0] == "WARNING fedge.transport.grid: node n2: boom"
    assert lines[1] == "    2099-01-01 00:00:00,000 INFO fedge.server.service: run finished OK\\r\\x1b[2J"
