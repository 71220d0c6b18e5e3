"""What the coordinator, the device agent and ``fedge status`` import is installed by ``pip install fedge``.

onnx and onnxruntime were only in an extra while the coordinator imported onnxruntime at start (its
config) and onnx at its first export (every round by default): the documented install (``pip install -c
constraints.txt .``, the Dockerfile) gave a coordinator that crashed at start.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SERVICES = "import fedge.server.service, fedge.app.client_app, fedge.cli.service, fedge.server.status"


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` need, transitively (markers for extras left out)."""
    seen: set[str] = set()
    todo = [_name(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def test_the_services_import_only_what_the_base_dependencies_install():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    allowed = _closure(project["dependencies"])
    script = f"{_SERVICES}; import sys, json; print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={"FLWR_TELEMETRY_ENABLED": "0"},
        ).stdout
    )
    providers = metadata.packages_distributions()
    needed = {
        dist.lower().replace("_", "-")
        for top in {m.split(".")[0] for m in modules}
        if top != "fedge" and top not in sys.stdlib_module_names
        for dist in providers.get(top, [])
    }
    assert "onnxruntime" in needed  # the point of the test: it is imported at start
    assert needed <= allowed, (
        f"imported but not in the base dependencies' closure: {sorted(needed - allowed)}"
    )
    assert "onnx" in allowed  # imported when the coordinator exports its first round (every round by default)
