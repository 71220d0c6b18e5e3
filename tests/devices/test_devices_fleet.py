"""Device classes, the catalogue, and the seeded assignment of a TOML mix to N clients."""

from __future__ import annotations

import math
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from fedge.config import ConfigError, from_table
from fedge.devices import (
    CATALOGUE,
    ClientProfile,
    ComputeProfile,
    DeviceProfile,
    FleetConfig,
    LinkProfile,
    assign_fleet,
    fleet_counts,
    mbit_per_s,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "devices.md"

MIX = """
[fleet]
mix = {pi4_wifi = 0.4, phone_lte = 0.4, nbiot_gateway = 0.2}
seed = 3
"""


def fleet(text: str = MIX) -> FleetConfig:
    return from_table(FleetConfig, tomllib.loads(text)["fleet"], where="fleet")


def test_catalogue_has_the_classes_and_sane_values():
    assert set(CATALOGUE) == {
        "pi4_wifi", "pizero2_wifi", "phone_lte", "jetson_nano_eth", "ltem_gateway", "nbiot_gateway", "server",
    }  # fmt: skip
    for name, c in CATALOGUE.items():
        assert c.name == name
        assert 1e8 <= c.compute.flops_per_s <= 1e12
        assert c.compute.encode_bytes_per_s < c.compute.decode_bytes_per_s
        assert c.link.uplink_bytes_per_s <= c.link.downlink_bytes_per_s
    up = {name: c.link.uplink_bytes_per_s for name, c in CATALOGUE.items()}
    assert up["nbiot_gateway"] < up["ltem_gateway"] < up["phone_lte"] < up["pi4_wifi"] < up["jetson_nano_eth"]
    assert up["nbiot_gateway"] <= mbit_per_s(0.25)  # below NB-IoT's peak
    assert mbit_per_s(5) <= up["phone_lte"] <= mbit_per_s(10)  # typical LTE uplink
    # Sustained training is far below the Pi 4's ~13.5 GFLOPS fp32 peak; the Zero 2 W has 512 MB in total.
    assert CATALOGUE["pi4_wifi"].compute.flops_per_s < 13.5e9 / 4
    assert CATALOGUE["pizero2_wifi"].compute.memory_bytes < 512 * 2**20
    assert CATALOGUE["nbiot_gateway"].link.latency_s >= CATALOGUE["phone_lte"].link.latency_s


def test_every_class_is_sourced_in_the_docs():
    text = DOC.read_text()
    for name in CATALOGUE:
        assert f"`{name}`" in text, name
    assert text.count("estimate") >= len(CATALOGUE)


def test_toml_mix_is_proportional_and_deterministic():
    config = fleet()
    profiles = assign_fleet(config, 1000)
    assert Counter(p.name for p in profiles) == {"pi4_wifi": 400, "phone_lte": 400, "nbiot_gateway": 200}
    assert assign_fleet(config, 1000) == profiles
    other = assign_fleet(config, 1000, seed=4)
    assert other != profiles and Counter(p.name for p in other) == Counter(p.name for p in profiles)
    assert profiles[0] is CATALOGUE[profiles[0].name]


def test_counts_round_by_largest_remainder():
    assert fleet_counts({"a": 0.4, "b": 0.4, "c": 0.2}, 7) == {"a": 3, "b": 3, "c": 1}
    assert fleet_counts({"a": 2, "b": 1}, 3) == {"a": 2, "b": 1}  # shares are normalised
    assert fleet_counts({"a": 1, "b": 1}, 1) == {"a": 1, "b": 0}  # a tie goes to the first named
    for n in range(50):
        counts = fleet_counts({"a": 0.45, "b": 0.35, "c": 0.2}, n)
        assert sum(counts.values()) == n
        assert all(abs(counts[k] - n * s) < 1 for k, s in {"a": 0.45, "b": 0.35, "c": 0.2}.items())


def test_custom_classes_from_toml():
    config = fleet("""
[fleet]
mix = {my_board = 1}
[fleet.classes.my_board]
compute = {flops_per_s = 1e9, memory_bytes = 1000000, encode_bytes_per_s = 1e8, decode_bytes_per_s = 2e8}
link = {uplink_bytes_per_s = 1000, downlink_bytes_per_s = 2000, latency_s = 0.5}
""")
    (profile,) = assign_fleet(config, 1)
    assert profile.name == "my_board" and profile.link.latency_s == 0.5
    assert profile.compute == ComputeProfile(1e9, 1_000_000, 1e8, 2e8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[fleet]\nmix = {pi5 = 1.0}", "mix.pi5 is not a known class"),
        ("[fleet]\nmix = {pi4_wifi = -1}", "mix.pi4_wifi must be a finite number >= 0"),
        ("[fleet]\nmix = {pi4_wifi = inf}", "mix.pi4_wifi must be a finite number >= 0"),
        ("[fleet]\nmix = {pi4_wifi = 1}\nseed = -5", "seed must be >= 0"),
        ("[fleet]\nmix = {pi4_wifi = 0}", "must not all be 0"),
        ("[fleet]\nmix = {pi4_wifi = 1}\nsede = 3", "unknown key 'fleet.sede'"),
        ("[fleet]\nseed = 3", "missing key 'fleet.mix'"),
        ("[fleet]\nmix = {x = 1}\nclasses = {x = 3}", "classes.x must be a table"),
        (
            "[fleet]\nmix = {x = 1}\n[fleet.classes.x]\nlink = {uplink_bytes_per_s = 1}",
            "classes.x.link.downlink_bytes_per_s",
        ),
    ],
)
def test_bad_fleet_tables_name_the_key(text, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        fleet(text)


def test_profiles_refuse_impossible_values():
    with pytest.raises(ConfigError, match="uplink_bytes_per_s"):
        LinkProfile(0, 1)
    with pytest.raises(ConfigError, match="latency_s"):
        LinkProfile(1, 1, latency_s=-1)
    with pytest.raises(ConfigError, match="flops_per_s"):
        ComputeProfile(0, 1, 1, 1)
    with pytest.raises(ConfigError):
        ClientProfile(compute="fast", link=LinkProfile(1, 1))  # type: ignore[arg-type]
    # finite and physical: these put replies at t = inf, rounds at 1e305 s, or overflowed the Poisson draw
    for bad in ({"latency_s": math.inf}, {"reconnect_s": math.inf}, {"disconnects_per_s": 1e30}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            LinkProfile(1, 1, **bad)
    with pytest.raises(ConfigError, match="uplink_bytes_per_s must be >= 1 and finite"):
        LinkProfile(1e-300, 1)
    with pytest.raises(ConfigError, match="flops_per_s must be >= 1 and finite"):
        ComputeProfile(math.inf, 1, 1, 1)


def test_compute_profile_from_a_measured_device():
    device = DeviceProfile(cpus=4, memory_total_mb=4096, memory_available_mb=3000)
    compute = ComputeProfile.from_device(
        device, flops_per_s=2e9, encode_bytes_per_s=1e8, decode_bytes_per_s=4e8
    )
    assert compute.memory_bytes == 3000 * 2**20


def test_a_reported_link_becomes_a_link_profile_and_bad_ones_are_refused(tmp_path):
    from fedge.client.agent import AgentConfig
    from fedge.config import ConfigError
    from fedge.devices.profile import DeviceProfile

    reported = DeviceProfile(cpus=2, uplink_mbit_s=2, downlink_mbit_s=8.0, latency_ms=40.0)
    again = DeviceProfile.from_bytes(reported.to_bytes())
    assert again == reported
    assert LinkProfile.from_device(again) == LinkProfile(mbit_per_s(2), mbit_per_s(8), 0.04)
    assert LinkProfile.from_device(DeviceProfile(uplink_mbit_s=2)) is None  # one direction is not a link
    with pytest.raises(ConfigError, match="uplink_mbit_s must be a number >= 0"):
        DeviceProfile.from_bytes(b'{"uplink_mbit_s": -1}')
    toml = tmp_path / "agent.toml"
    toml.write_text('node_id = "n1"\nstate_dir = "s"\n[link]\nuplink_mbit_s = 1\ndownlink = 3\n')
    with pytest.raises(ConfigError, match=r"\[link\] has unknown keys \['downlink'\]"):
        AgentConfig.from_toml(toml)
