"""Scale on one machine: 1,000 virtual clients, 100 per round, on the local engine's default workers.

:func:`measure_scale` runs the simulation in a child process (``python -m fedge.bench._scale``), so that
what is measured is that run alone: its wall seconds (:func:`run_simulation` as the child times it, from
preparing the task to the last round's evaluation; the child's whole life, imports included, is reported
apart) and its memory, sampled from outside every 0.2 s (PSS every 2 s) over the child's process tree
(the coordinating process and the local engine's forked workers) with psutil:

* ``peak_rss_mb``: the sum, over the processes of the tree, of each one's peak resident set size. Pages a
  forked worker shares with its parent (torch's libraries, the heap at fork time) count in both, so this
  overstates what the machine needs; it is the conservative figure.
* ``peak_pss_mb``: the peak of the tree's summed proportional set size (shared pages split among their
  sharers), sampled every 2 s: about what the run really occupies.
* ``main_peak_rss_mb`` and ``worker_peak_rss_mb`` (the largest worker) break the first figure down.

The task is :class:`fedge.app.synthetic.SyntheticTask` (128 examples a client; digits has too few images
for 1,000 clients) with the app's default local training (2 epochs, batches of 16), dense FedAvg.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

__all__ = ["SCALE_TASK", "measure_scale", "run_scale"]

SCALE_TASK = "fedge.app.synthetic:SyntheticTask"
_SAMPLE_S = 0.2
_PSS_EVERY = 10
_MB = 1024 * 1024


def run_scale(clients: int, rounds: int, fraction: float, workers: int | None = None) -> dict[str, Any]:
    """Run the scale simulation in this process; wall seconds, rounds run and the final accuracy."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

    from fedge.app.config import AppConfig
    from fedge.simulation.config import SimulationConfig
    from fedge.simulation.engines import run_simulation

    logging.getLogger("flwr").setLevel(logging.ERROR)
    app = AppConfig(rounds=rounds, fraction_train=fraction, seed=0, task=SCALE_TASK, max_failed_rounds=0)
    # The default workers: one per usable CPU (2 here).
    config = SimulationConfig(clients=clients, app=app, **({"workers": workers} if workers else {}))
    before = _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    history = run_simulation(config)
    wall = time.perf_counter() - start
    # The workers have exited and been reaped by now (the engine joins them), so RUSAGE_CHILDREN has them.
    main_cpu = _cpu_s(resource.RUSAGE_SELF) - before[0]
    workers_cpu = _cpu_s(resource.RUSAGE_CHILDREN) - before[1]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    last = history.rounds[-1]
    return {
        "wall_s": wall,
        "rounds_run": len(history.rounds),
        "workers": config.workers,
        "clients_per_round": last.clients_sampled,
        "final_accuracy": last.accuracy,
        "client_calls": sum(r.clients_replied for r in history.rounds),
        "accuracy_by_round": [round(r.accuracy, 4) for r in history.rounds],
        "main_cpu_s": main_cpu,
        "workers_cpu_s": workers_cpu,
        # What the run would take with the machine's CPUs to itself and never idle: a floor for wall_s
        # that other work on the machine does not move (wall_s does, a lot, on a shared machine).
        "cpu_floor_s": (main_cpu + workers_cpu) / cpus,
    }


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class _TreeSampler:
    """Samples RSS and PSS of a process and its descendants on a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self._root = psutil.Process(pid)
        self.peak_rss: dict[int, int] = {}  # pid -> peak RSS bytes
        self.peak_pss_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fedge-rss-sampler", daemon=True)

    def __enter__(self) -> _TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        samples = 0
        while not self._stop.is_set():
            try:
                processes = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:  # the child has exited
                return
            # RSS is one read of /proc/PID/statm; PSS walks every mapping (smaps), a few ms of CPU taken
            # from the run for a torch process, so it is read every _PSS_EVERY-th sample only.
            with_pss, pss = samples % _PSS_EVERY == 0, 0
            for process in processes:
                try:
                    info = process.memory_full_info() if with_pss else process.memory_info()
                except psutil.Error:
                    continue  # exited between listing and reading
                self.peak_rss[process.pid] = max(self.peak_rss.get(process.pid, 0), info.rss)
                pss += getattr(info, "pss", info.rss)
            if with_pss:
                self.peak_pss_sum = max(self.peak_pss_sum, pss)
            samples += 1
            self._stop.wait(_SAMPLE_S)


def measure_scale(clients: int = 1000, rounds: int = 100, fraction: float = 0.1) -> dict[str, Any]:
    """Run :func:`run_scale` in a child process; its result plus the tree's peak memory and the load.

    Returns
    -------
    dict
        ``wall_s``, ``rounds_run``, ``final_accuracy``, ``main_cpu_s``, ``workers_cpu_s``, ``cpu_floor_s``
        (the CPU seconds over the usable CPUs; from the child), ``process_wall_s`` (the child's
        whole life, imports included), ``peak_rss_mb``, ``peak_pss_mb``, ``main_peak_rss_mb``,
        ``worker_peak_rss_mb``, ``processes`` (how many were seen) and ``load_avg_1m`` before and after
        (other work on the machine slows the run).
    """
    command = [sys.executable, "-m", "fedge.bench._scale", "--clients", str(clients), "--rounds", str(rounds)]
    command += ["--fraction", str(fraction)]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    with _TreeSampler(child.pid) as sampler:
        out, _ = child.communicate()
    process_wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"the scale run failed (exit code {child.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    main_peak = sampler.peak_rss.get(child.pid, 0)
    workers = [rss for pid, rss in sampler.peak_rss.items() if pid != child.pid]
    return {
        "clients": clients,
        "rounds": rounds,
        "fraction": fraction,
        **result,
        "process_wall_s": process_wall,
        "peak_rss_mb": sum(sampler.peak_rss.values()) / _MB,
        "peak_pss_mb": sampler.peak_pss_sum / _MB,
        "main_peak_rss_mb": main_peak / _MB,
        "worker_peak_rss_mb": max(workers, default=0) / _MB,
        "processes": len(sampler.peak_rss),
        "load_avg_1m": [load_before, os.getloadavg()[0]],
    }


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The scale run (fedge bench heterogeneity runs it).")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    print(json.dumps(run_scale(args.clients, args.rounds, args.fraction, args.workers)), flush=True)


if __name__ == "__main__":
    _main()
