"""Suite-wide settings (no telemetry, offline dataset libraries, a fresh partition cache) and the real
Mosquitto fixtures: one broker per module, a fleet of its own per test."""

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest

from fedge.localnet import MosquittoBroker
from fedge.transport import MqttConfig

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Partition caches of this run only (agent subprocesses inherit it).
os.environ.setdefault("FEDGE_CACHE_DIR", tempfile.mkdtemp(prefix="fedge-test-cache-"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    with MosquittoBroker(tmp_path_factory.mktemp("mosquitto")) as running:
        yield running


@pytest.fixture
def mqtt(broker: MosquittoBroker) -> Callable[..., MqttConfig]:
    """``mqtt(**fields)``: a config for this test's own fleet on the module's broker."""
    fleet = f"f{uuid.uuid4().hex[:8]}"

    def make(**fields: object) -> MqttConfig:
        return MqttConfig(broker_url=broker.url, fleet=fleet, reconnect_max_s=0.5, **fields)  # type: ignore[arg-type]

    return make
