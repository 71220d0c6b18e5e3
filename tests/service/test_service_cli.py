"""`fedge coordinator`, `agent` and `status`: bad configuration ends in one line, not a traceback."""

from __future__ import annotations

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
        ("coordinator", 'state_dir = "s"\n[mqtt]\nhost = "x"\n', "unknown [mqtt] key 'host'"),
        ("coordinator", 'state_dir = "s"\n[app]\nalpha = 0\n', "alpha must be > 0"),
        ("coordinator", 'state_dir = "s"\nnode_keys_dir = "/nonexistent"\n', "holds no <node>.key files"),
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
