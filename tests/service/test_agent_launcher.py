"""The MQTT engine's agent launcher: agents forked from one process that imported them, over a real broker."""

from __future__ import annotations

import psutil
from waiting import wait_until

from fedge.simulation.agent_processes import PRELOAD, AgentLauncher
from fedge.simulation.mqtt_engine import write_agent_config
from fedge.transport import MqttConfig
from fedge.transport.grid import MqttGrid


def test_forked_agents_join_the_fleet_and_leave_when_stopped(broker, tmp_path):
    with MqttGrid(MqttConfig(broker_url=broker.url, fleet="sim")) as grid:
        # A module that cannot be imported is skipped, not fatal to the launcher.
        launcher = AgentLauncher(preload=(*PRELOAD, "fedge.no_such_module"))
        try:
            for i in range(3):
                launcher.spawn(write_agent_config(tmp_path, i, 3, broker.url), tmp_path / f"agent-{i}.log")
            assert grid.wait_for_nodes(3, timeout=60)
            pids = launcher.pids
            # Each agent is a process of its own, forked by the launcher (not by this process).
            assert len(set(pids)) == 3 and launcher.launcher_pid not in pids
            assert all(psutil.Process(pid).ppid() == launcher.launcher_pid for pid in pids)
            assert all("fedge" in " ".join(psutil.Process(pid).cmdline()) for pid in pids)
        finally:
            launcher.stop()
        # SIGTERM made each agent leave the fleet cleanly (its LEFT status), and nothing is left running.
        wait_until(lambda: not list(grid.get_node_ids()), 30, what="agents left the fleet")
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert launcher.pids == []


def test_an_agent_with_a_bad_config_exits_with_its_error_and_the_launcher_goes_on(broker, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('node_id = "x"\n[mqtt]\nbroker_url = 42\n')
    with MqttGrid(MqttConfig(broker_url=broker.url, fleet="sim")) as grid, AgentLauncher() as launcher:
        launcher.spawn(bad, tmp_path / "bad.log")
        bad_pid = launcher.pids[0]
        wait_until(lambda: not psutil.pid_exists(bad_pid), 30, what="the misconfigured agent exited")
        error = (tmp_path / "bad.log").read_text().strip().splitlines()
        assert len(error) == 1 and "broker_url" in error[0], error
        # The launcher still forks working agents after one failed.
        launcher.spawn(write_agent_config(tmp_path, 0, 1, broker.url), tmp_path / "agent-0.log")
        assert grid.wait_for_nodes(1, timeout=60)


def test_stop_kills_an_agent_that_does_not_exit_on_sigterm(tmp_path):
    # An agent whose broker never answers spends ~9 s in its connect attempts and only then sees SIGTERM's
    # stop; stop() must not wait for it beyond its timeout.
    with AgentLauncher() as launcher:
        launcher.spawn(write_agent_config(tmp_path, 0, 1, "mqtt://192.0.2.1:1883"), tmp_path / "agent-0.log")
        pid = launcher.pids[0]
        # Its state directory exists once the command has read its config: it is connecting now.
        wait_until((tmp_path / "agent-0" / "inbox").is_dir, 30, what="the agent started")
        launcher.stop(timeout_s=1.0)
        assert not psutil.pid_exists(pid)
    # Killed in its connect attempts: it never got to report that it could not connect.
    assert "cannot connect" not in (tmp_path / "agent-0.log").read_text()
