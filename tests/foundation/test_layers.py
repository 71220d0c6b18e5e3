"""The dependency rules of fedge's packages, read from every module's imports (function-level ones too).

compression → protocol → {server, client} → app → simulation → cli; server and client never import each
other; transport never imports server, client, app or cli; compression and partitioning know nothing of
Flower, MQTT or the app; Flower's private internals are touched only in ``fedge/flower/compat.py``; and no
two fedge modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "fedge"

BASE = {"base"}
# What each component may import from fedge (always itself too). "base" is fedge.config, fedge.atomic,
# fedge.lazy, fedge.importing, fedge.torch_quiet and the package itself: leaves every layer may use.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "compression": set(),
    "protocol": BASE | {"compression", "flower"},
    "flower": BASE,
    "devices": BASE | {"protocol"},
    "reporting": BASE,
    "localnet": BASE,
    "transport": BASE | {"protocol", "devices", "flower"},
    "partitioning": BASE | {"compression", "devices"},
    # inference decodes weight deltas with the codecs (the pure leaf under protocol)
    "inference": BASE | {"compression", "protocol", "devices", "transport"},
    "server": BASE | {"compression", "protocol", "flower", "devices", "reporting", "transport", "inference"},
    "client": BASE | {"compression", "protocol", "flower", "devices", "transport", "inference"},
    "app": BASE
    | {
        "compression",
        "protocol",
        "flower",
        "devices",
        "reporting",
        "transport",
        "inference",
        "server",
        "client",
    },
}
ALLOWED["split"] = ALLOWED["app"] | {"app", "partitioning"}
ALLOWED["simulation"] = ALLOWED["app"] | {"app", "localnet", "split"}
ALLOWED["bench"] = ALLOWED["simulation"] | {"simulation", "partitioning"}
ALLOWED["cli"] = ALLOWED["bench"] | {"bench"}

# Third-party packages a component must not import.
FORBIDDEN_THIRD_PARTY = {
    "compression": {"flwr", "paho", "torch", "onnx", "onnxruntime"},
    "partitioning": {"flwr", "paho"},
    "inference": {"flwr", "torch"},
    "protocol.fleet": {"flwr", "torch"},
    "devices": {"flwr", "paho", "torch"},
    "localnet": {"flwr", "torch"},
}
TRANSPORT_WITHOUT_FLOWER = {"fedge.transport." + m for m in ("frames", "sender", "receiver", "presence")}
FLOWER_PRIVATE = ("flwr.common.serde", "flwr.supercore", "flwr.proto")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# Edge adapters: modules of a component that may reach further than the component (the planner and the
# exporter know nothing of MQTT; the runner that puts stages on MQTT agents is the adapter at the edge).
EDGE_ADAPTERS = {"fedge.partitioning.mqtt_runtime": "partitioning.mqtt"}
ALLOWED["partitioning.mqtt"] = ALLOWED["partitioning"] | {
    "partitioning",
    "protocol",
    "transport",
    "inference",
}
ALLOWED["bench"] |= {"partitioning.mqtt"}
ALLOWED["cli"] |= {"partitioning.mqtt"}


def _component(module: str) -> str:
    if module in EDGE_ADAPTERS:
        return EDGE_ADAPTERS[module]
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("config", "atomic", "importing", "lazy", "torch_quiet"):
        return "base"
    if parts[1] == "__main__":
        return "cli"
    return parts[1]


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, executed) for every import in ``module``; names that are submodules count
    as imports of the submodule. ``executed`` is False under ``if TYPE_CHECKING``."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, executed: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for grandchild in child.body:
                    visit_node(grandchild, False)
                for grandchild in child.orelse:
                    visit_node(grandchild, executed)
                continue
            visit_node(child, executed)

    def visit_node(node: ast.AST, executed: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, executed) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((candidate if candidate in MODULES else base, node.lineno, executed))
        visit(node, executed)

    visit(tree, True)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_follow_the_layers(module: str) -> None:
    component = _component(module)
    allowed = ALLOWED[component] | {component}
    for target, line, _ in IMPORTS[module]:
        where = f"{module}:{line}"
        if target == "fedge" or target.startswith("fedge."):
            assert _component(target) in allowed, f"{where}: {component} may not import {target}"
            continue
        top = target.split(".")[0]
        for key, banned in FORBIDDEN_THIRD_PARTY.items():
            if module == f"fedge.{key}" or module.startswith(f"fedge.{key}."):
                assert top not in banned, f"{where}: {module} may not import {target}"
        if module in TRANSPORT_WITHOUT_FLOWER:
            assert top != "flwr", f"{where}: the transport core may not import Flower"
        if target.startswith(FLOWER_PRIVATE):
            assert module == "fedge.flower.compat", f"{where}: Flower internals only in fedge.flower.compat"


def test_no_import_cycles() -> None:
    """Executed imports between fedge modules form no cycle (a package's own submodules excepted)."""
    graph = {
        module: {
            target
            for target, _, executed in IMPORTS[module]
            if executed and target in MODULES and target != module and not module.startswith(target + ".")
        }
        for module in MODULES
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_rules_catch_a_forbidden_arrow(tmp_path: Path) -> None:
    """The checker itself: a server module importing the client side is reported."""
    source = "def f():\n    from fedge.client.agent import DeviceAgent\n"
    MODULES["fedge.server._probe"] = tmp_path / "_probe.py"
    MODULES["fedge.server._probe"].write_text(source)
    try:
        with pytest.raises(AssertionError, match=r"server may not import fedge\.client\.agent"):
            IMPORTS["fedge.server._probe"] = _imports("fedge.server._probe")
            test_module_imports_follow_the_layers("fedge.server._probe")
    finally:
        del MODULES["fedge.server._probe"]
        IMPORTS.pop("fedge.server._probe", None)
