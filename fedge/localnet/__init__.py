"""Networks on one machine: MQTT brokers and a lossy-link proxy, for simulation, tests and benchmarks.

:class:`EmbeddedBroker` (amqtt, pure Python) is the one-machine default broker of ``fedge broker`` and the
``mqtt`` engine; :class:`MosquittoBroker` runs a real Mosquitto on a free port with its own config;
:class:`LossyLinkProxy` puts latency, rate limits, resets and black holes between a client and a broker.
"""

from fedge.localnet.broker import EmbeddedBroker, MosquittoBroker, free_port, wait_for_port
from fedge.localnet.netem import LinkProfile, LossyLinkProxy, ProxyStats

__all__ = [
    "EmbeddedBroker",
    "LinkProfile",
    "LossyLinkProxy",
    "MosquittoBroker",
    "ProxyStats",
    "free_port",
    "wait_for_port",
]
