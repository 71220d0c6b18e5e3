"""Running Flower's command-line tools against fedge's app, and cleaning up every process they leave.

Flower's ``flwr run`` both reads and writes the app directory: with a ``[tool.flwr.federations]`` table in
pyproject.toml, Flower 1.42 migrates it into ``$FLWR_HOME/config.toml`` and comments the table out in place.
So the tests run a copy of the app (pyproject.toml and the fedge package) and never touch the checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
FLWR = [str(VENV_BIN / "flwr")]


def copy_app(dest: Path) -> Path:
    """A copy of the Flower app as ``flwr run .`` in the repository root sees it."""
    dest.mkdir(parents=True)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(REPO / "fedge", dest / "fedge", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower's processes: private FLWR_HOME, no telemetry, nothing installed at run time."""
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        # The SuperLink would otherwise `uv sync` the app's dependencies (torch, ...) into a new environment.
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        # SuperExec looks for new work every second by default; rounds are short here.
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.2",
        # Flower starts flower-superexec, flwr-serverapp, flwr-clientapp and flwr-simulation by name.
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def run_flwr(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    """``flwr <args>``; on timeout the command is killed and its output kept for the failure message."""
    try:
        return subprocess.run(
            [*FLWR, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
        message = f"flwr {' '.join(args)} still running after {timeout_s:g} s:\n{output[-4000:]}"
        raise AssertionError(message) from None


def start(command: list[str], *, env: dict[str, str], log: Path) -> psutil.Popen:
    """Start a Flower service with its output in ``log``."""
    with log.open("wb") as out:
        return psutil.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(port: int, process: psutil.Popen, log: Path, timeout_s: float = 60.0) -> None:
    """Wait until a SuperLink answers on ``/health`` (``flwr`` fails fast if it is not up yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"{process.args[0]} exited with {process.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"SuperLink not healthy after {timeout_s:g} s:\n{log.read_text()[-3000:]}")


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Running processes with ``text`` in their command line (e.g. a SuperLink ``flwr`` started detached)."""
    return [p for p in psutil.process_iter(["cmdline"]) if text in " ".join(p.info["cmdline"] or ())]


def stop_trees(roots: list[psutil.Process], timeout_s: float = 15.0) -> list[psutil.Process]:
    """Stop ``roots`` gracefully, then whatever they started (Flower detaches some); return the survivors.

    Descendants are collected before their root goes: once it is gone they are re-parented to init and can
    no longer be found from it.
    """
    tree: list[psutil.Process] = []
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [root, *root.children(recursive=True)]
            root.terminate()
    psutil.wait_procs([p for p in roots if _alive(p)], timeout=timeout_s)
    remaining = [p for p in tree if _alive(p)]
    for process in remaining:
        _signal(process, psutil.Process.terminate)
    _, alive = psutil.wait_procs(remaining, timeout=5)
    for process in alive:
        _signal(process, psutil.Process.kill)
    psutil.wait_procs(alive, timeout=5)
    return [p for p in tree if _alive(p)]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(process: psutil.Process, send: Any) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        send(process)


def read_metrics(out_dir: Path) -> dict[str, Any]:
    """The ServerApp's ``metrics.json``: proof that a run really happened, round by round."""
    path = out_dir / "metrics.json"
    assert path.is_file(), f"no {path}: the ServerApp did not finish"
    return json.loads(path.read_text())
