"""A real Mosquitto per module and a fleet per test for the coordinator/agent tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from fedge.localnet import MosquittoBroker
from fedge.transport import MqttConfig


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
