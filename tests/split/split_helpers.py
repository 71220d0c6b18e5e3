"""Device profiles of the split-training tests: a Raspberry Pi that trains the digits CNN, and a
microcontroller-class board (1 MiB for training) that cannot; and real split agents over MQTT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fedge.devices.fleet import CATALOGUE, ClientProfile, ComputeProfile, LinkProfile, mbit_per_s

PI = CATALOGUE["pi4_wifi"]
MCU = ClientProfile(
    ComputeProfile(flops_per_s=0.2e9, memory_bytes=2**20, encode_bytes_per_s=20e6, decode_bytes_per_s=80e6),
    LinkProfile(mbit_per_s(2), mbit_per_s(4), latency_s=0.01),
    "mcu_wifi",
)


def split_agent(root: Path, index: int, agents: int, broker_url: str, fleet: str) -> subprocess.Popen[bytes]:
    """``fedge agent`` running the split ClientApp for partition ``index`` of ``agents``: partition 0 reports
    4 GiB (it trains the full model), the others 1 MiB (the coordinator splits them)."""
    config = root / f"agent-{index}.toml"
    memory = 2**20 if index else 2**32
    config.write_text(
        f'node_id = "split-{index}"\nstate_dir = "{root / f"agent-{index}"}"\n'
        'client_app = "fedge.split.app:client_app"\ntasks = ["fedge.app.task:DigitsTask"]\n'
        f'[mqtt]\nbroker_url = "{broker_url}"\nfleet = "{fleet}"\nreconnect_max_s = 0.5\n'
        f'[node_config]\n"partition-id" = {index}\n"num-partitions" = {agents}\n"memory-bytes" = {memory}\n'
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    with (root / f"agent-{index}.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fedge", "agent", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
