"""fedge.inference runs in an install without torch or Flower: its imports and a real serving subprocess."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import fedge.inference

ALLOWED = {"numpy", "onnxruntime", "onnx", "fedge", "paho"}
# The MQTT transport's torch-free core (connection, topics, signing, artifacts) serves the inference agent.
ALLOWED_FEDGE = (
    "fedge.inference",
    "fedge.config",
    "fedge.atomic",
    "fedge.transport",
    "fedge.protocol.fleet",
    # weights deltas: the codecs (pure numpy) and the reference step both sides compute alike
    "fedge.compression",
    "fedge.protocol.reference",
)


def test_package_imports_only_allowed_modules():
    root = Path(fedge.inference.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ALLOWED, f"{path.name} imports {name}"
                if top == "fedge":
                    assert name.startswith(ALLOWED_FEDGE), f"{path.name} imports {name}"


_SERVE = """
import json, sys
import numpy as np
from fedge.inference import ModelServer, read_inputs
server = ModelServer()
result = server.load(sys.argv[1])
out = server.classify(np.zeros((3, 1, 8, 8), np.float32))
print(json.dumps({"ok": result.ok, "n": len(out), "version": server.version,
                  "loaded": sorted(m for m in ("torch", "flwr", "onnx", "typer") if m in sys.modules)}))
"""


def test_serving_process_never_loads_torch_or_flower(variants):
    out = subprocess.run(
        [sys.executable, "-c", _SERVE, str(variants["fp32"][0])], capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"ok": True, "n": 3, "version": "r3", "loaded": []}


_VERIFY = """
import sys
import fedge.inference.agent
from fedge.transport.signing import InstructionVerifier, SignatureError, key_id
key = bytes(range(32))
try:
    InstructionVerifier([key], pure_python=True).verify("n", "m", b"FSI1" + key_id(key) + bytes(64) + b"body")
except SignatureError as err:
    print("refused:", err)
print(sorted(m for m in sys.modules if m.startswith("cryptography")))
"""


def test_agent_verifies_models_without_loading_cryptography():
    """cryptography costs a device 8 MB resident; the inference agent verifies models in pure Python."""
    out = subprocess.run([sys.executable, "-c", _VERIFY], capture_output=True, text=True, check=True)
    refused, loaded = out.stdout.strip().splitlines()[-2:]
    assert "does not match" in refused  # the forged signature was checked
    assert loaded == "[]"
