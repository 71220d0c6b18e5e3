"""Device profiles of the split-training tests: a Raspberry Pi that trains the digits CNN, and a
microcontroller-class board (1 MiB for training) that cannot."""

from __future__ import annotations

from fedge.devices.fleet import CATALOGUE, ClientProfile, ComputeProfile, LinkProfile, mbit_per_s

PI = CATALOGUE["pi4_wifi"]
MCU = ClientProfile(
    ComputeProfile(flops_per_s=0.2e9, memory_bytes=2**20, encode_bytes_per_s=20e6, decode_bytes_per_s=80e6),
    LinkProfile(mbit_per_s(2), mbit_per_s(4), latency_s=0.01),
    "mcu_wifi",
)
