"""``fedge split-coordinator``: split training over MQTT from the command line, with real agents, a real
broker, a checkpoint it resumes from, and one-line errors for bad configuration."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from split_helpers import split_agent

from fedge.config import ConfigError
from fedge.localnet import MosquittoBroker
from fedge.split.service import SplitServiceConfig

AGENTS = 2  # partition 0 trains the full model, partition 1 (1 MiB) a front stage


def _write_config(root: Path, broker_url: str, rounds: int) -> Path:
    path = root / "split.toml"
    path.write_text(
        f'state_dir = "{root / "state"}"\nout_dir = "{root / "out"}"\n'
        f'[mqtt]\nbroker_url = "{broker_url}"\nfleet = "splitcli"\nreconnect_max_s = 0.5\n'
        f"[run]\nmin_nodes = {AGENTS}\nstep_timeout_s = 30.0\nwait_for_nodes_s = 120.0\n"
        f'[run.split]\nrounds = {rounds}\nbatch_size = 128\nvariant = "v2"\n'
    )
    return path


def _coordinator(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fedge", "split-coordinator", "--config", str(config), "--log-json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_split_coordinator_trains_a_mixed_fleet_and_resumes_from_its_checkpoint(tmp_path):
    with MosquittoBroker(tmp_path / "broker") as broker:
        agents = [split_agent(tmp_path, i, AGENTS, broker.url, "splitcli") for i in range(AGENTS)]
        try:
            first = _coordinator(_write_config(tmp_path, broker.url, rounds=1))
            assert first.returncode == 0, first.stderr[-3000:]
            # the same run, two rounds now: the restarted coordinator runs round 2 only
            second = _coordinator(_write_config(tmp_path, broker.url, rounds=2), "--resume")
            assert second.returncode == 0, second.stderr[-3000:]
        finally:
            for agent in agents:
                agent.kill()
                agent.wait(10)
        # every round done: resuming again waits for no agent (there is none) and reports the run
        third = _coordinator(tmp_path / "split.toml", "--resume")
        assert third.returncode == 0 and "fedge split-coordinator" in third.stdout, third.stderr[-2000:]
    records = [json.loads(line) for line in second.stderr.splitlines() if line.startswith("{")]
    assert any(r["message"] == "resuming after round 1" for r in records)
    assert "fedge split-coordinator" in second.stdout and "round 2/2" in second.stderr
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    rounds = metrics["rounds"]
    assert [r["round"] for r in rounds] == [1, 2] and metrics["config"]["rounds"] == 2
    assert all(r["full_clients"] == 1 and r["split_clients"] == 1 for r in rounds)
    assert all(r["trained"] == [0, 1] and r["split_steps"] > 0 for r in rounds)
    assert rounds[1]["accuracy"] > 0.1
    assert (tmp_path / "out" / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "an [mqtt] table is required"),
        ('[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n[run]\nprofiles = []\n', "run.profiles is not set here"),
        ('[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n[run.split]\nrounds = "ten"\n', "run.split.rounds"),
        ('state = "x"\n[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n', "unknown key 'state'"),
        ('[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n[run]\nmin-nodes = 0\n', "min_nodes must be >= 1"),
    ],
)
def test_bad_configuration_is_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "split.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        SplitServiceConfig.from_toml(path)


def test_an_unknown_run_key_lists_only_the_keys_run_may_set(tmp_path):
    """It offered profiles, resume and state_dir, which [run] refuses."""
    path = tmp_path / "split.toml"
    path.write_text('[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n[run]\nroundz = 3\n')
    with pytest.raises(ConfigError, match=r"unknown key 'run\.roundz'; known keys: ") as raised:
        SplitServiceConfig.from_toml(path)
    known = set(str(raised.value).partition("known keys: ")[2].split(", "))
    assert "min_nodes" in known and not {"profiles", "resume", "state_dir"} & known


def test_resume_without_a_state_dir_fails_in_one_line(tmp_path):
    path = tmp_path / "split.toml"
    path.write_text('[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n')
    result = _coordinator(path, "--resume")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --resume needs state_dir: the checkpoint it continues from"


@pytest.mark.parametrize("key", ["state_dir", "out_dir"])
def test_a_file_where_a_directory_goes_is_one_line_before_the_broker_is_tried(tmp_path, key):
    """It was a traceback after the first round had trained (writing its checkpoint or metrics)."""
    (tmp_path / "taken").write_text("a file")
    path = tmp_path / "split.toml"
    path.write_text(f'{key} = "{tmp_path / "taken"}"\n[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n')
    result = _coordinator(path)
    assert result.returncode == 2
    what = "the state directory" if key == "state_dir" else "out_dir"
    assert result.stderr.strip() == f"error: cannot create {what} {tmp_path / 'taken'}: File exists"


def test_too_few_agents_is_one_line_saying_how_many_came(tmp_path):
    with MosquittoBroker(tmp_path / "broker") as broker:
        path = tmp_path / "split.toml"
        path.write_text(
            f'[mqtt]\nbroker_url = "{broker.url}"\nfleet = "empty"\n'
            "[run]\nmin_nodes = 2\nwait_for_nodes_s = 1.0\n"
        )
        result = _coordinator(path)
    assert result.returncode == 1  # a run that failed, as the coordinator's (a config error is 2)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: 0 of the 2 nodes the run needs (min_nodes) came online within 1 s"
    )


@pytest.mark.parametrize("content", [b"garbage\n", b""])
def test_a_damaged_split_checkpoint_is_named_without_numpys_advice_to_unpickle_it(tmp_path, content):
    """numpy's error told the user how to load a pickle the file did not hold (CLI sweep)."""
    from fedge.split.server_state import SPLIT_CHECKPOINT_FILE, load_split_checkpoint

    (tmp_path / SPLIT_CHECKPOINT_FILE).write_bytes(content)
    with pytest.raises(ConfigError, match="is damaged \\(truncated or not a checkpoint\\)") as raised:
        load_split_checkpoint(tmp_path)
    assert "pickle" not in str(raised.value)
