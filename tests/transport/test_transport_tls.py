"""TLS: ``mqtts://`` with a CA file and a client certificate, against a Mosquitto that requires one."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from fedge.localnet import MosquittoBroker
from fedge.transport import CoordinatorEndpoint, MqttConfig, NodeEndpoint

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode, reason="openssl"
)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all on P-256 keys (fast to make)."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=fedge-ca",
        cwd=directory,
    )
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl(
            "req",
            *key,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=directory,
        )
        sign = ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"]
        _openssl(*sign, "-out", f"{name}.crt", "-days", "2", *extra, cwd=directory)


def test_tls_with_client_certificate_round_trip(
    own_mosquitto: Callable[..., MosquittoBroker], make_config: Callable[..., MqttConfig], tmp_path: Path
) -> None:
    _certificates(tmp_path)
    tls_lines = [f"cafile {tmp_path / 'ca.crt'}", f"certfile {tmp_path / 'server.crt'}"]
    tls_lines += [f"keyfile {tmp_path / 'server.key'}", "require_certificate true"]
    broker = own_mosquitto(extra_config=tls_lines)
    config = replace(
        make_config(f"mqtts://127.0.0.1:{broker.port}"),
        ca_file=str(tmp_path / "ca.crt"),
        cert_file=str(tmp_path / "client.crt"),
        key_file=str(tmp_path / "client.key"),
        connect_timeout_s=5,
    )
    with CoordinatorEndpoint(config) as coordinator, NodeEndpoint(config, "n1") as node:
        assert coordinator.send("n1", b"over TLS" * 10_000).wait(10)
        assert node.receive(5).payload == b"over TLS" * 10_000  # type: ignore[union-attr]
    # Without our CA the broker's certificate is not trusted; without a client certificate the broker refuses.
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        NodeEndpoint(replace(config, ca_file=None), "n1").start()
    with pytest.raises(ConnectionError, match="cannot connect"):
        NodeEndpoint(replace(config, cert_file=None, key_file=None, connect_timeout_s=1), "n1").start()
