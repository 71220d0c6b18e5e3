"""Fixtures for Flower's command-line paths: a private FLWR_HOME, a copy of the app, and process hygiene."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from flower_processes import copy_app, flower_env, processes_mentioning, stop_trees


@pytest.fixture
def flwr_home(tmp_path: Path) -> Path:
    home = tmp_path / "flwr-home"
    home.mkdir()
    return home


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    return copy_app(tmp_path / "app")


@pytest.fixture
def env(flwr_home: Path) -> dict[str, str]:
    return flower_env(flwr_home)


@pytest.fixture
def cleanup(flwr_home: Path) -> Iterator[Callable[[psutil.Process], None]]:
    """``cleanup(process)``: stop it and everything it started when the test ends; fail if any survive.

    Processes Flower started detached with this test's FLWR_HOME on their command line (the local SuperLink
    ``flwr run`` starts for simulations) are stopped too.
    """
    roots: list[psutil.Process] = []
    yield roots.append
    survivors = stop_trees(roots + processes_mentioning(str(flwr_home)))
    assert not survivors, f"processes survived the test: {[(p.pid, p.name()) for p in survivors]}"
