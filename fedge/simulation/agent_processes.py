"""Agent processes for the MQTT engine, forked from a launcher process that has imported the agent once.

A ``fedge agent`` process spends about 2.5 s of CPU importing torch, Flower and TorchDynamo (which the first
optimizer pulls in) and holds some 230 MB of private memory before it connects. :class:`AgentLauncher`
instead starts one process that imports them (:data:`PRELOAD`) and forks each agent from it: an agent
shares the launcher's pages copy-on-write and pays only for its own work. Measured on a 2-core machine,
50 agents on a local Mosquitto: separate interpreters were all online after 83 s and held 11.9 GB (the
sum of their proportional set sizes); forked, after 5.3 s and 1.0 GB.

An agent is still a whole process running ``fedge agent --config``, through the same command-line code
(configuration checks, signal handling, logging), with its own paho client, state directory and log file.
So the engine keeps exercising the path a device runs; only the interpreter's start-up is shared.
(multiprocessing's fork server would re-run the caller's ``__main__`` script in every agent, so the
launcher is this module's own: a line of JSON in, a pid out.) Without ``os.fork`` agents are separate
``python -m fedge agent`` processes.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["AGENT_ENVIRONMENT", "PRELOAD", "AgentLauncher", "ForkedAgent"]

log = logging.getLogger(__name__)

AGENT_ENVIRONMENT = {"FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
"""Many agents on one machine: one OpenMP thread each, and two malloc arenas instead of one per thread
(glibc's default), which keeps each agent's resident memory down."""

PRELOAD = ("fedge.cli", "fedge.client.agent", "fedge.app.client_app")
"""What the launcher imports before it forks agents: the command line, the agent and the reference
ClientApp (which builds one optimizer, so TorchDynamo is imported once too)."""


_LAUNCHER_MAIN = "from fedge.simulation.agent_processes import _serve; _serve()"


class ForkedAgent:
    """An agent forked by the launcher: signalled and awaited by pid (it is not this process's child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux ≥ 5.3, or already gone
            self._pidfd = None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the agent to exit; True if it has."""
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            return bool(ready)
        deadline = time.monotonic() + timeout
        while self._running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _running(self) -> bool:
        try:
            os.kill(self.pid, 0)  # the launcher reaps its children at once, so an exited pid is gone
        except ProcessLookupError:
            return False
        return True

    def _signal(self, number: int) -> None:
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, number)
            else:
                os.kill(self.pid, number)
        except ProcessLookupError:
            pass


class AgentLauncher:
    """Starts agents for one simulation; a context manager that stops them all on exit.

    Parameters
    ----------
    preload : sequence of str (default: :data:`PRELOAD`)
        Modules the launcher imports before forking (one that fails to import is logged and skipped).
    task : mapping, optional
        Keyword arguments of :func:`fedge.app.task.prepare_task` for the run's task, split among the
        agents: the launcher prepares it once (data, partitions) and every agent finds it prepared, as the
        local engine's forked workers do. Otherwise fifty agents would each load the data and compute the
        same split at once.
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD, task: Mapping[str, Any] | None = None) -> None:
        self._agents: list[ForkedAgent | subprocess.Popen[bytes]] = []
        self._launcher: subprocess.Popen[str] | None = None
        if hasattr(os, "fork"):
            self._launcher = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER_MAIN, json.dumps({"preload": preload, "task": task})],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, **AGENT_ENVIRONMENT},
                text=True,
            )

    @property
    def pids(self) -> list[int]:
        """The agents' process ids, in the order they were spawned (until :meth:`stop`)."""
        return [agent.pid for agent in self._agents]

    @property
    def launcher_pid(self) -> int | None:
        """The launcher process's id (the agents' parent); None where agents are whole interpreters."""
        return None if self._launcher is None else self._launcher.pid

    def spawn(self, config: Path, log_path: Path) -> None:
        """Start ``fedge agent --config config``, its output appended to ``log_path``."""
        if self._launcher is None:
            with log_path.open("ab") as log_file:
                agent = subprocess.Popen(
                    [sys.executable, "-m", "fedge", "agent", "--config", str(config)],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **AGENT_ENVIRONMENT},
                )
            self._agents.append(agent)
            return
        assert self._launcher.stdin is not None and self._launcher.stdout is not None
        try:
            self._launcher.stdin.write(json.dumps({"config": str(config), "log": str(log_path)}) + "\n")
            self._launcher.stdin.flush()
            answer = self._launcher.stdout.readline()
        except BrokenPipeError:
            answer = ""
        if not answer.strip().isdigit():
            raise RuntimeError(
                f"the agent launcher exited (code {self._launcher.poll()}) before forking {config}"
            )
        self._agents.append(ForkedAgent(int(answer)))

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every agent (each leaves the fleet cleanly); kill any still running after ``timeout_s``."""
        for agent in self._agents:
            agent.terminate()
        deadline = time.monotonic() + timeout_s
        for agent in self._agents:
            remaining = max(0.0, deadline - time.monotonic())
            if isinstance(agent, ForkedAgent):
                if not agent.wait(remaining):
                    agent.kill()
                    agent.wait(timeout_s)
                agent.close()
                continue
            try:
                agent.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        self._agents.clear()
        if self._launcher is not None:
            self._launcher.communicate()  # end of input: the launcher exits
            self._launcher = None

    def __enter__(self) -> AgentLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve() -> None:
    """The launcher: import and prepare what ``sys.argv[1]`` names, then fork an agent per line of stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the agents; the launcher ends with its input
    setup = json.loads(sys.argv[1])
    for name in setup["preload"]:
        try:
            importlib.import_module(name)
        except Exception as err:  # agents import it themselves, and say why it fails
            log.warning("the agent launcher could not preload %s: %s", name, err)
    if setup["task"] is not None:
        try:
            from fedge.app.task import prepare_task

            prepare_task(**setup["task"])
        except Exception as err:  # each agent prepares it and reports the error in its reply
            log.warning("the agent launcher could not prepare the task: %s", err)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited agents: no zombies
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_agent(request["config"], request["log"])  # never returns
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


def _run_agent(config: str, log_path: str) -> None:
    """In a forked agent: output to the log, then ``fedge agent --config config``; exit with its code."""
    code: object = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for target, source in ((0, null), (1, log_fd), (2, log_fd)):
            os.dup2(source, target)
        os.close(null)
        os.close(log_fd)
        # `python -m fedge agent --config config`, run in this process (the command, not the cli's insides).
        sys.argv = ["fedge", "agent", "--config", config]
        runpy.run_module("fedge", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # the agent's process ends here whatever happens
        logging.getLogger(__name__).exception("agent %s failed", config)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
