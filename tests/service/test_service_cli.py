"""`fedge coordinator`, `agent` and `status`: bad configuration ends in one line, not a traceback; a stopped
coordinator says where it stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from fedge.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("command", "toml", "needle"),
    [
        ("coordinator", None, "does not exist"),
        ("coordinator", 'state_dir = "s"\nround_timeout = 3\n', "round_timeout"),
        ("coordinator", 'state_dir = "s"\n[mqtt]\nbroker_url = "http://x"\n', "broker"),
        ("coordinator", 'state_dir = "s"\n[mqtt]\nhost = "x"\n', "unknown key 'mqtt.host'"),
        ("coordinator", 'state_dir = "s"\n[app]\nalpha = 0\n', "alpha must be > 0"),
        ("coordinator", 'state_dir = "s"\nmodel_delta_codec = "fp12"\n', "model_delta_codec"),
        ("serve", 'node_id = "n1"\nmodel_dir = "m"\nmodel_work_nice = 25\n', "model_work_nice must be in"),
        (  # it waited for a variant no coordinator publishes (CLI sweep)
            "serve",
            'node_id = "n1"\nmodel_dir = "m"\nvariants = ["fp32", "int4"]\n',
            "variants: unknown 'int4'; choose among fp32, int8-static, int8-dynamic",
        ),
        ("coordinator", 'state_dir = "s"\nnode_keys_dir = "/nonexistent"\n', "holds no <node>.key files"),
        (
            "coordinator",
            'state_dir = "service.toml"\n[mqtt]\nbroker_url = "mqtt://127.0.0.1:1"\n',
            "cannot create the state directory service.toml",  # said before the broker is tried
        ),
        ("agent", 'node_id = "a b"\nstate_dir = "s"\n', "node id"),
        ("agent", 'state_dir = "s"\n', "node_id"),
        ("agent", 'node_id = "n1"\nstate_dir = "s"\nclient_app = "nowhere:app"\n', "does not import"),
        ("agent", 'node_id = "n1"\nstate_dir = "s"\nsigning_key_file = "/nonexistent"\n', "signing key file"),
        ("status", 'state_dir = "never-ran"\n', "no coordinator status"),
    ],
)
def test_bad_service_config_is_one_line(tmp_path, monkeypatch, command, toml, needle):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "service.toml"
    if toml is not None:
        path.write_text(toml)
    result = runner.invoke(app, [command, "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and needle in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_coordinator_stops_cleanly_on_sigterm_and_ctrl_c(broker, tmp_path, signum, code):
    state = tmp_path / "state"
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'state_dir = "{state}"\nwait_for_nodes_s = 120.0\n[mqtt]\nbroker_url = "{broker.url}"\n'
        'fleet = "stop"\n[app]\nrounds = 2\nmin_nodes = 2\n'
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "fedge", "coordinator", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    while not (state / "status.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # it is up and waiting for nodes
    process.send_signal(signum)
    output, _ = process.communicate(timeout=180)  # closing the broker session is slow on a loaded machine
    assert process.returncode == code, output[-2000:]
    assert "stopped after round 0; 'fedge coordinator --resume'" in output
    assert "Traceback" not in output


def test_a_fleet_that_never_gathers_ends_the_coordinator_with_status_1(broker, tmp_path):
    """Giving up on min_nodes is a run that failed (1, as the README says), not a bad config (2)."""
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\nwait_for_nodes_s = 0.5\n[mqtt]\nbroker_url = "{broker.url}"\n'
        'fleet = "short"\n[app]\nrounds = 1\nmin_nodes = 2\n'
    )
    result = runner.invoke(app, ["coordinator", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert "0 of the 2 nodes needed came online" in result.output and "Traceback" not in result.output
