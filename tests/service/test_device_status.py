"""What status.json keeps of inference devices' statuses: known, well-formed fields of a bounded number."""

from __future__ import annotations

import json

from fedge.server import model_publish
from fedge.server.model_publish import ModelDistributor


def _topic(name: str) -> str:
    return f"fedge/f/infer/{name}/status"


def test_only_known_well_formed_fields_of_a_bounded_number_of_devices_are_kept(monkeypatch):
    distributor = ModelDistributor(publisher=None)  # type: ignore[arg-type]  # only statuses are fed here
    good = {"online": True, "version": "r3", "latency_ms": {"p50": 0.4, "p99": 1.2}, "requests": 12}
    distributor._on_device_status(_topic("cam"), json.dumps({**good, "extra": "x" * 10_000}).encode())
    distributor._on_device_status(
        _topic("odd"),
        json.dumps({"online": "yes", "version": "v" * 10_000, "requests": -1, "swaps": 2}).encode(),
    )
    distributor._on_device_status(_topic("big"), json.dumps({"version": "x" * 70_000}).encode())
    distributor._on_device_status(_topic("bad name!"), json.dumps(good).encode())
    assert distributor.devices() == {"cam": good, "odd": {"swaps": 2}}
    monkeypatch.setattr(model_publish, "_MAX_DEVICES", 3)
    for name in ("d1", "d2"):
        distributor._on_device_status(_topic(name), json.dumps(good).encode())
    assert sorted(distributor.devices()) == ["cam", "d1", "odd"]  # a known device still updates
    distributor._on_device_status(_topic("cam"), json.dumps({"online": False}).encode())
    assert distributor.devices()["cam"] == {"online": False}


def test_logs_name_a_node_whose_id_was_made_from_its_name():
    from fedge.protocol.fleet import flower_node_id, node_label

    node_id = flower_node_id("cam-3")
    assert node_label(node_id) == f"cam-3 ({node_id})"
    assert node_label(7) == "7"  # a simulation's numbered node


def test_the_status_of_an_agent_with_a_full_swap_log_is_kept(caplog):
    """An agent's status carries its last 64 swaps (about 21 kB): at 16 KiB it was dropped from the 48th
    swap on, and status.json showed the device on an old version for good."""
    distributor = ModelDistributor(publisher=None)  # type: ignore[arg-type]
    entry = {"version": "r0070", "variant": "int8-static", "ok": True, "reason": "", "message": "x" * 200}
    status = {"online": True, "version": "r0070", "swap_log": [entry] * 64}
    assert len(json.dumps(status)) > 16 * 1024
    distributor._on_device_status(_topic("cam"), json.dumps(status).encode())
    assert distributor.devices()["cam"]["version"] == "r0070"
    for _ in range(2):  # too large: ignored, and said once
        distributor._on_device_status(_topic("cam"), json.dumps({"version": "y" * 70_000}).encode())
    assert sum("is above" in r.getMessage() for r in caplog.records) == 1
