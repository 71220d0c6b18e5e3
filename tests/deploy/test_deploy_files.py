"""The deploy/ files fit together: scripts, service configs, compose file, systemd units and Dockerfile.

Docker is not runnable here, so the compose file is checked for what breaks a deployment silently: a mounted
file the scripts do not make, a config naming a path that is not mounted, configs fedge cannot load.
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from deploy_broker import DEPLOY, run_script

from fedge.app.coordinator import CoordinatorConfig
from fedge.client.agent import AgentConfig
from fedge.transport.signing import InstructionSigner, InstructionVerifier, SignatureError, load_public_key

COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
FEDGE_SERVICES = {name: s for name, s in COMPOSE["services"].items() if name != "mosquitto"}
AGENTS = sorted(name for name in FEDGE_SERVICES if name.startswith("agent-"))
FEDGE = str(Path(sys.executable).with_name("fedge"))


@pytest.fixture(scope="module")
def compose_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/secrets as the compose file's instructions make it."""
    root = tmp_path_factory.mktemp("compose-secrets")
    for script, args in [
        ("make-passwords.sh", ["-d", str(root), "-n", str(len(AGENTS))]),
        ("make-test-ca.sh", ["-d", str(root / "tls"), "-s", "DNS:mosquitto"]),
    ]:
        result = run_script(script, *args)
        assert result.returncode == 0, result.stderr
    return root


def mounts(service: dict, secrets: Path, state: Path) -> dict[str, Path]:
    """Container path -> file on this machine, for a service's volumes (named volumes become ``state``)."""
    table = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if not source.startswith("./"):
            table[target] = state
            continue
        relative = source.removeprefix("./")
        host = (
            secrets / relative.removeprefix("secrets/")
            if relative.startswith("secrets/")
            else DEPLOY / relative
        )
        table[target] = host
    return table


def localize(config: Path, table: dict[str, Path], dest: Path) -> Path:
    """A copy of a TOML config with each quoted absolute path mapped through ``table``; unmapped ones fail."""

    def replace(match: re.Match) -> str:
        path = match.group(1)
        for container, host in sorted(table.items(), key=lambda item: -len(item[0])):
            if path == container or path.startswith(container + "/"):
                return f'"{host}{path[len(container) :]}"'
        raise AssertionError(f"{config.name} names {path}, which nothing mounts")

    dest.write_text(re.sub(r'"(/[^"]*)"', replace, config.read_text()))
    return dest


def test_every_mounted_file_exists_after_running_the_scripts(compose_secrets, tmp_path):
    for name, service in COMPOSE["services"].items():
        for container, host in mounts(service, compose_secrets, tmp_path).items():
            assert host.exists(), f"{name} mounts {host} at {container}, but it does not exist"


def test_compose_configs_load_with_what_is_mounted(compose_secrets, tmp_path):
    loaded = {}
    for name, service in FEDGE_SERVICES.items():
        table = mounts(service, compose_secrets, tmp_path / name)
        config_path = service["command"][service["command"].index("--config") + 1]
        local = localize(table[config_path], table, tmp_path / f"{name}.toml")
        loaded[name] = (CoordinatorConfig if name == "coordinator" else AgentConfig).from_toml(local)
    coordinator = loaded.pop("coordinator")
    assert coordinator.service.mqtt.username == "coordinator"
    assert coordinator.service.node_keys_dir is not None
    signer = InstructionSigner.from_file(coordinator.service.instruction_key_file)
    assert coordinator.app.min_nodes == len(AGENTS)
    partitions = sorted(agent.node_config["partition-id"] for agent in loaded.values())
    assert partitions == list(range(len(AGENTS)))
    for agent in loaded.values():
        assert agent.node_config["num-partitions"] == len(AGENTS)
        assert agent.mqtt.username == agent.node_id, "the ACL isolates nodes by username == node id"
        assert agent.mqtt.fleet == coordinator.service.mqtt.fleet
        assert (
            agent.signing_key == (compose_secrets / "node-keys" / f"{agent.node_id}.key").read_bytes().strip()
        )
        assert agent.mqtt.address.tls and agent.mqtt.address.host == "mosquitto"
        # Agents run only what the coordinator signed, and only the coordinator's task.
        signed = signer.sign(agent.node_id, "m1", b"instruction")
        assert (
            InstructionVerifier(agent.instruction_keys).verify(agent.node_id, "m1", signed) == b"instruction"
        )
        assert coordinator.app.task in agent.tasks


@pytest.mark.parametrize("name", ["coordinator", "agent"])
def test_example_configs_load(compose_secrets, tmp_path, name):
    table = {
        "/etc/fedge/credentials": compose_secrets / "credentials",
        "/etc/fedge/node-keys": compose_secrets / "node-keys",
        "/etc/fedge/node-key": compose_secrets / "node-keys" / "node-1.key",
        "/etc/fedge/instruction-keys": compose_secrets / "instruction-keys",
        "/etc/fedge/tls": compose_secrets / "tls",
        "/var/lib/fedge": tmp_path / "state",
    }
    local = localize(DEPLOY / f"{name}.example.toml", table, tmp_path / f"{name}.toml")
    if name == "coordinator":
        service = CoordinatorConfig.from_toml(local).service
        mqtt = service.mqtt
        assert InstructionSigner.from_file(service.instruction_key_file)
    else:
        agent = AgentConfig.from_toml(local)
        mqtt = agent.mqtt
        assert agent.instruction_keys and agent.tasks == ("fedge.app.task:DigitsTask",)
    assert mqtt.address.tls and mqtt.ca_file is not None


def test_broker_server_certificate_names_the_compose_host(compose_secrets):
    result = subprocess.run(
        [
            "openssl",
            "x509",
            "-in",
            str(compose_secrets / "tls" / "server.crt"),
            "-noout",
            "-ext",
            "subjectAltName",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "DNS:mosquitto" in result.stdout and "IP Address:127.0.0.1" in result.stdout


@pytest.mark.parametrize("unit", ["fedge-coordinator", "fedge-agent"])
def test_systemd_unit_runs_the_compose_command_hardened(unit):
    text = (DEPLOY / "systemd" / f"{unit}.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    command = settings["ExecStart"].split()
    assert command[0] == "/opt/fedge/bin/fedge"
    services = ["coordinator"] if unit == "fedge-coordinator" else AGENTS
    assert all(["fedge", *command[1:]] == FEDGE_SERVICES[name]["command"] for name in services)
    example = tomllib.loads((DEPLOY / f"{unit.removeprefix('fedge-')}.example.toml").read_text())
    assert settings["ReadWritePaths"] == example["state_dir"] == "/var/lib/" + settings["StateDirectory"]
    for key, value in {
        "Restart": "on-failure",
        "User": "fedge",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert settings.get(key) == value, f"{unit}: {key}={settings.get(key)!r}, expected {value!r}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", ["fedge-coordinator", "fedge-agent"])
def test_systemd_unit_passes_systemd_analyze_verify(tmp_path, unit):
    # The unit as installed, but running this checkout's fedge (verify insists the binary exists).
    copy = tmp_path / f"{unit}.service"
    copy.write_text(
        (DEPLOY / "systemd" / f"{unit}.service").read_text().replace("/opt/fedge/bin/fedge", FEDGE)
    )
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_dockerfile_copies_only_what_its_ignore_file_lets_through():
    copied = [
        source
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for source in line.split()[1:-1]
    ]
    allowed = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert copied and all(f"!{source}" in allowed for source in copied), (copied, allowed)
    assert all((DEPLOY.parent / source).exists() for source in copied)


def test_make_passwords_writes_private_random_secrets(tmp_path):
    assert run_script("make-passwords.sh", "-d", str(tmp_path), "n1", "n2").returncode == 0
    files = [*(tmp_path / "credentials").iterdir(), *(tmp_path / "node-keys").iterdir()]
    assert sorted(p.name for p in files) == [
        "coordinator.password",
        "n1.key",
        "n1.password",
        "n2.key",
        "n2.password",
    ]
    secrets = [p.read_text().strip() for p in files]
    assert len(set(secrets)) == len(secrets) and min(map(len, secrets)) >= 43
    for path in [*files, tmp_path / "mosquitto" / "passwd"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    passwd = (tmp_path / "mosquitto" / "passwd").read_text()
    assert [line.split(":")[0] for line in passwd.splitlines()] == ["coordinator", "n1", "n2"]
    assert not any(secret in passwd for secret in secrets), "the broker's file must hold hashes only"

    # A re-run keeps the secrets of the users it names, makes new ones and drops the rest; -r rotates all.
    before = {p.name: p.read_text() for p in [*files, *(tmp_path / "instruction-keys").iterdir()]}
    assert run_script("make-passwords.sh", "-d", str(tmp_path), "n1", "n3").returncode == 0
    after = {p.name: p.read_text() for p in tmp_path.glob("*/*") if p.parent.name != "mosquitto"}
    assert sorted(after) == [
        "coordinator.key",
        "coordinator.password",
        "coordinator.pub",
        "n1.key",
        "n1.password",
        "n3.key",
        "n3.password",
    ]
    kept = ["coordinator.key", "coordinator.password", "coordinator.pub", "n1.key", "n1.password"]
    assert all(after[name] == before[name] for name in kept)
    assert run_script("make-passwords.sh", "-d", str(tmp_path), "-r", "n1", "n3").returncode == 0
    rotated = {p.name: p.read_text() for p in tmp_path.glob("*/*") if p.parent.name != "mosquitto"}
    assert sorted(rotated) == sorted(after) and not set(rotated.values()) & set(after.values())


def test_make_passwords_makes_and_rotates_the_coordinators_instruction_key(tmp_path):
    keys = tmp_path / "instruction-keys"
    assert run_script("make-passwords.sh", "-d", str(tmp_path), "n1").returncode == 0
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.iterdir())
    old = InstructionSigner.from_file(keys / "coordinator.key")
    old_public = load_public_key(keys / "coordinator.pub")
    assert InstructionVerifier([old_public]).verify("n1", "m1", old.sign("n1", "m1", b"x")) == b"x"
    passwords = {p.name: p.read_text() for p in (tmp_path / "credentials").iterdir()}

    # -i: a new pair; the old public key stays as previous.pub, so agents can trust both while they change
    # over; nothing else changes.
    assert run_script("make-passwords.sh", "-d", str(tmp_path), "-i", "n1").returncode == 0
    assert sorted(p.name for p in keys.iterdir()) == ["coordinator.key", "coordinator.pub", "previous.pub"]
    assert load_public_key(keys / "previous.pub") == old_public
    new = InstructionSigner.from_file(keys / "coordinator.key")
    changeover = InstructionVerifier([load_public_key(keys / "coordinator.pub"), old_public])
    for signer in (old, new):
        assert changeover.verify("n1", "m1", signer.sign("n1", "m1", b"x")) == b"x"
    with pytest.raises(SignatureError):
        InstructionVerifier([load_public_key(keys / "coordinator.pub")]).verify(
            "n1", "m1", old.sign("n1", "m1", b"x")
        )
    assert passwords == {p.name: p.read_text() for p in (tmp_path / "credentials").iterdir()}
    assert run_script("make-passwords.sh", "-d", str(tmp_path), "-r", "-i", "n1").returncode == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["coordinator"], "reserved"),
        (["a:b"], "'a:b' must be"),
        (["a/b"], "'a/b' must be"),
        (["+"], "'+' must be"),
        (["n1", "n1"], "given twice"),
        (["-r", "-i", "n1"], "not both"),
        (["-n", "0"], "-n needs a count"),
        ([], "-n COUNT"),  # no nodes: the usage
    ],
)
def test_make_passwords_refuses_bad_input(tmp_path, args, needle):
    result = run_script("make-passwords.sh", "-d", str(tmp_path), *args)
    assert result.returncode == 2 and needle in result.stderr
    assert not (tmp_path / "mosquitto" / "passwd").exists()


@pytest.mark.parametrize("anonymous", [False, True])
def test_the_brokers_healthcheck_passes_only_when_it_refuses_an_anonymous_client(tmp_path, anonymous):
    """It grepped 'Connection Refused', which the broker also says for a client without an id (refused by
    allow_zero_length_clientid false before any password check): an open broker passed too."""
    from fedge.localnet import MosquittoBroker

    passwords = tmp_path / "passwd"
    args = ["mosquitto_passwd", "-b", "-c", str(passwords), "u", "p"]
    subprocess.run(args, check=True, capture_output=True)
    options = ["allow_zero_length_clientid false", f"allow_anonymous {str(anonymous).lower()}"]
    options += [] if anonymous else [f"password_file {passwords}"]
    command = COMPOSE["services"]["mosquitto"]["healthcheck"]["test"][1]
    with MosquittoBroker(tmp_path / "mq", extra_config=options) as broker:
        check = command.replace("-p 1883", f"-p {broker.port}")
        result = subprocess.run(["sh", "-c", check], capture_output=True, timeout=30)
    assert (result.returncode == 0) is not anonymous
