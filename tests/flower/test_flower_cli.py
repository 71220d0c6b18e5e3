"""The installed ``flwr`` script starts (flwr 1.42 needs typer>=0.19 for its Literal options)."""

from __future__ import annotations

import subprocess

from flower_processes import VENV_BIN


def test_flwr_script_starts():
    result = subprocess.run(
        [str(VENV_BIN / "flwr"), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Flower version: 1.42" in result.stdout
