"""A fresh virtualenv with only the ``infer`` extra serves a model through a real broker and swaps mid-stream.

The new venv gets fedge's wheel and the ``infer`` extra's dependency closure, nothing else: the closure is
resolved from the installed distributions' metadata (``Requires-Dist`` of onnxruntime, numpy, paho-mqtt,
cryptography, typer, recursively) and exposed to the new venv through a directory of links to exactly those
distributions' top-level files, so the test runs offline and torch and Flower are not importable there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from waiting import wait_until

from fedge.inference.distribution import publish_model
from fedge.inference.remote import InferenceClient, InferenceError
from fedge.localnet import MosquittoBroker
from fedge.transport import MqttConfig
from fedge.transport.artifact_channel import ArtifactPublisher
from fedge.transport.connection import MqttConnection
from fedge.transport.signing import InstructionSigner
from fedge.transport.topics import Topics

REPO = Path(__file__).resolve().parents[2]


def _infer_requirements() -> list[str]:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["infer"]
    return [re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0] for requirement in extra]


def _closure(names: list[str]) -> set[str]:
    """Distribution names needed by ``names`` on this interpreter (markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.distribution(name).requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _link_closure(names: set[str], target: Path) -> float:
    """Link every top-level file of those distributions into ``target``; returns their installed MB."""
    target.mkdir()
    size = 0
    for name in names:
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if top.startswith("..") or top == "__pycache__":
                continue
            link = target / top
            if not link.exists():
                link.symlink_to(base / top)
        size += sum(f.size or 0 for f in dist.files or [])
    return size / 1e6


@pytest.fixture(scope="module")
def infer_venv(tmp_path_factory) -> tuple[Path, float]:
    """(python of a venv with only fedge and the infer closure, installed MB of that closure)."""
    root = tmp_path_factory.mktemp("infer-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    closure = _closure(_infer_requirements())
    assert not closure & {"torch", "flwr"}, closure
    installed_mb = _link_closure(closure, root / "closure")
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "infer-closure.pth").write_text(str(root / "closure") + "\n")
    (site / "fedge-src.pth").write_text(str(REPO) + "\n")  # fedge's own sources, without its dependencies
    return python, installed_mb


def test_venv_has_no_torch_or_flower(infer_venv):
    python, installed_mb = infer_venv
    probe = (
        "import importlib.util, json\n"
        "names = ('torch', 'flwr', 'cryptography', 'onnxruntime', 'paho', 'fedge')\n"
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in names}))"
    )
    # only the venv's own paths: a PYTHONPATH of the caller's (Ray leaves one naming the full venv's
    # site-packages) would make torch importable here
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    found = json.loads(subprocess.check_output([python, "-c", probe], text=True, env=clean))
    expected = {"torch": False, "flwr": False, "cryptography": False, "onnxruntime": True, "paho": True}
    assert found == {**expected, "fedge": True}
    assert installed_mb < 400  # the full agent's venv holds about 1.9 GB


@pytest.mark.timeout(240)
def test_infer_only_venv_serves_and_swaps_mid_stream(infer_venv, variants, digits_test, tmp_path):
    python, _ = infer_venv
    fleet = f"f{uuid.uuid4().hex[:8]}"
    with MosquittoBroker(tmp_path / "mq") as broker:
        config = MqttConfig(broker_url=broker.url, fleet=fleet, reconnect_max_s=0.5)
        coordinator = MqttConnection(config, "coordinator")
        coordinator.start()
        key = Ed25519PrivateKey.generate()  # models are signed; the venv checks them in pure Python
        public_pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        (tmp_path / "coordinator.pub").write_bytes(public_pem)
        publisher = ArtifactPublisher(coordinator, Topics(fleet), InstructionSigner(key))
        fp32_path, fp32 = variants["fp32"]
        int8_path, int8 = variants["int8-static"]
        publish_model(publisher, "v1", {"fp32": (fp32_path.read_bytes(), fp32)})
        (tmp_path / "infer.toml").write_text(
            f'node_id = "dev-1"\nmodel_dir = "{tmp_path / "models"}"\nstatus_every_s = 0.5\n'
            f'instruction_key_files = ["{tmp_path / "coordinator.pub"}"]\n\n'
            f'[mqtt]\nbroker_url = "{broker.url}"\nfleet = "{fleet}"\nreconnect_max_s = 0.5\n'
        )
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        agent = subprocess.Popen(
            [python, "-m", "fedge", "serve", "--config", str(tmp_path / "infer.toml")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            with InferenceClient(config) as client:
                x = digits_test[0][:4]
                first = _first_answer(client, x, agent)
                assert first.version == "v1"
                answers: list[str] = []
                failures: list[str] = []
                stop = threading.Event()

                def stream() -> None:
                    while not stop.is_set():
                        try:
                            answers.append(client.predict("dev-1", x, timeout=10).version)
                        except (InferenceError, TimeoutError) as err:
                            failures.append(repr(err))
                        stop.wait(0.01)

                thread = threading.Thread(target=stream)
                thread.start()
                wait_until(lambda: len(answers) >= 20, 60, process=agent)
                files = {
                    "fp32": (fp32_path.read_bytes(), fp32),
                    "int8-static": (int8_path.read_bytes(), int8),
                }
                publish_model(publisher, "v2", files)
                wait_until(lambda: answers and answers[-1] == "v2", 60, process=agent)
                count = len(answers)
                wait_until(lambda: len(answers) >= count + 20, 60, process=agent)
                stop.set()
                thread.join()
            assert failures == []
            assert answers[0] == "v1" and answers[-1] == "v2" and answers == sorted(answers)
            maps = Path(f"/proc/{agent.pid}/maps").read_text()
            assert "libtorch" not in maps and "onnxruntime" in maps
        finally:
            agent.terminate()
            _, stderr = agent.communicate(timeout=30)
            coordinator.close()
        assert agent.returncode in (0, -15), stderr[-2000:]


def _first_answer(client: InferenceClient, x: np.ndarray, agent: subprocess.Popen):
    deadline = time.monotonic() + 60
    while True:  # the agent is starting: ask until it answers with the model
        try:
            answer = client.predict("dev-1", x, timeout=1)
            if answer.version:
                return answer
        except (InferenceError, TimeoutError):
            pass
        assert agent.poll() is None, agent.stderr.read()
        assert time.monotonic() < deadline, "the agent never answered"
