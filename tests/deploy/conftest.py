"""Fixtures for the deploy/ tests: generated secrets, a Mosquitto on the shipped config, connected clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from deploy_broker import NODES, Broker, Probe, Secrets, run_script, start_broker


@pytest.fixture(scope="session")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    """Passwords for the coordinator and :data:`NODES`, a CA, the server's and node A's certificates."""
    root = tmp_path_factory.mktemp("secrets")
    for script, args in [
        ("make-passwords.sh", ["-d", str(root), *NODES]),
        ("make-test-ca.sh", ["-d", str(root / "tls"), NODES[0]]),
    ]:
        result = run_script(script, *args)
        assert result.returncode == 0, f"{script} failed: {result.stderr}"
    return Secrets(root)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, secrets: Secrets) -> Iterator[Broker]:
    running = start_broker(tmp_path_factory.mktemp("broker"), secrets)
    yield running
    running.stop()


@pytest.fixture
def connect(broker: Broker, secrets: Secrets) -> Iterator[Callable[..., Probe]]:
    """``connect(user, **probe_options)``: a :class:`Probe` on the plain listener, closed afterwards."""
    probes: list[Probe] = []

    def _connect(user: str, **options) -> Probe:
        probe = Probe(broker.plain_port, user, secrets.password(user), **options)
        probes.append(probe)
        code = probe.connect()
        assert not code.is_failure, f"{user} refused: {code}"
        return probe

    yield _connect
    for probe in probes:
        probe.close()
