"""fedge's wheel, installed (not editable) in a fresh virtualenv, runs ``fedge simulate`` and ``fedge bench``.

This catches what the editable install hides: modules or package data left out of the wheel, and code that
finds files through the repository instead of the installed package.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}\n"
        f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    )
    return result


def _build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """The wheel of a copy of the sources: building in the repository would write ``build/`` there, and a
    stale ``build/lib`` can put modules deleted from the sources into the wheel."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO / "fedge", src / "fedge", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    # Offline: the dev venv's setuptools builds the wheel itself (no separate ``wheel`` package needed).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            dist,
            src,
        ],
        tmp_path,
        env,
        timeout=120,
    )
    (wheel,) = dist.glob("fedge-*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_in_fresh_venv_runs_simulate_and_bench(tmp_path):
    """Build fedge's wheel, install it into a new virtualenv and run the CLI from outside the repository.

    The new venv is ``python -m venv --without-pip`` of the dev venv's base interpreter. The wheel is
    installed into it by the dev venv's pip with ``--python NEW/bin/python`` (so the ``fedge`` console script
    points at the new interpreter), offline and without dependencies. The third-party packages (torch,
    Flower, ...) come from the dev venv through a ``.pth`` file naming its site-packages: a directory added by
    a .pth line has its own .pth files ignored, so the dev venv's editable hook for fedge is not loaded, and
    the new venv's site-packages (with the wheel's fedge) comes first on sys.path.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(FLWR_TELEMETRY_ENABLED="0", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    work = tmp_path / "work"  # outside the repository: the repository's fedge/ must not be importable
    work.mkdir()

    wheel = _build_wheel(tmp_path, env)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"fedge/cli/__init__.py", "fedge/bench/__init__.py", "fedge/bench/compression.py"} <= names

    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run([base_python, "-m", "venv", "--without-pip", venv], work, env, timeout=60)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        work,
        env,
        timeout=120,
    )
    new_site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, env, 30
        ).stdout.strip()
    )
    dev_site = sysconfig.get_paths()["purelib"]
    (new_site / "_fedge_dev_deps.pth").write_text(dev_site + "\n")

    probe = (
        "import json, sys, fedge, fedge.cli, fedge.bench, torch, flwr\n"
        "print(json.dumps({'files': [fedge.__file__, fedge.cli.__file__, fedge.bench.__file__],"
        " 'path': sys.path, 'editable': [m for m in sys.modules if 'editable' in m]"
        " + [repr(f) for f in sys.meta_path if 'editable' in repr(f).lower()]}))"
    )
    found = json.loads(_run([python, "-c", probe], work, env, timeout=120).stdout.strip().splitlines()[-1])
    for file in found["files"]:
        assert Path(file).resolve().is_relative_to(venv.resolve()), found
        assert not Path(file).resolve().is_relative_to(REPO), found
    assert dev_site in found["path"]
    assert found["path"].index(str(new_site)) < found["path"].index(dev_site)
    assert found["editable"] == [], "the dev venv's editable hook for fedge was loaded"

    fedge = venv / "bin" / "fedge"
    assert fedge.exists(), "the wheel's console script was not installed"
    assert fedge.read_text().startswith(f"#!{python}"), fedge.read_text().splitlines()[0]

    out = tmp_path / "run"
    _run([fedge, "simulate", "--clients", 3, "--rounds", 2, "--workers", 1, "--out", out], work, env, 120)
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["rounds"]) == 2

    bench = _run([fedge, "bench", "compression", "--quick", "--json"], work, env, timeout=150)
    result = json.loads(bench.stdout.strip().splitlines()[-1])
    assert "headline" in result
