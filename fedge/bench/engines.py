"""fedge bench engines: the same run on fedge's local engine and on Flower's Ray engine.

Both engines must do the same client training, so neither can be faster than that training spread over the
worker processes. The bench measures it (every client's training once, in this process, the fastest of three
such passes, times the rounds, over the workers) as ``training_floor_s``, and judges the engine by what it
adds above it. Each engine is timed the same way as the floor: the fastest of three whole runs (one with
``--quick``), since other work on the machine only ever adds time; every run's wall time is in the JSON
(``wall_s_runs``).

* ``overhead_ratio``: Ray's seconds above the floor over the local engine's (goal >= 20);
* ``local_efficiency``: the floor over the local engine's wall seconds (goal >= 0.8);
* ``local_speedup_vs_ray`` (Ray wall / local wall) as context, with the ``speedup_ceiling`` the floor sets
  (Ray wall / floor), and the final accuracy of both, which should agree closely (different node ids make
  Ray sample and seed differently).

Where the local engine's time goes: the CPU seconds its worker processes and this process spent
(``local_worker_cpu_s``, ``local_coordinator_cpu_s``). No schedule of that work on the workers' cores can end
sooner than their sum over the cores, so ``local_efficiency_cpu_bound`` (the floor over that) is the most
``local_efficiency`` could be without doing less work: the part of the gap that idle cores explain is the
difference between the two.

The floor divides one process's training by the workers, as if training on both cores at once cost what it
costs on one. ``training_floor_parallel_s`` measures that instead: the same training in ``workers`` forked
processes at once (each its share of the clients, passes started together, a pass's time the mean of its
processes' times; the fastest of three), so the cores' shared caches, memory bandwidth and the host's
other guests are in it, as they are in every engine's run. ``parallel_scaling`` (floor / parallel floor;
1.0 is perfect) says how far the machine is from the first floor's assumption, and
``local_efficiency_vs_parallel_floor`` and ``overhead_ratio_vs_parallel_floor`` are the two goals' figures
against what the training costs on the shared cores: context for the note, the goals keep the first floor.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.queues
import os
import resource
import threading
import time
from collections.abc import Callable

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch

from fedge.app.client_app import local_seed
from fedge.app.config import AppConfig
from fedge.app.task import TrainConfig, prepare_task
from fedge.bench._common import emit, parse_args, timed
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation


def _training_floor_s(app: AppConfig, clients: int, workers: int, repeats: int = 3) -> float:
    """The run's client training at best: one round of it (the fastest of ``repeats``), times the rounds,
    over the workers."""
    # the fastest of a few: other work on the machine only ever adds time
    one_round = min(_training_passes(app, clients, range(clients), repeats))
    return one_round * app.rounds * app.fraction_train / _busy_cores(workers)


def _training_passes(
    app: AppConfig,
    clients: int,
    trained: range,
    repeats: int,
    before_pass: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of ``repeats`` passes of the ``trained`` clients' first-round training, on one
    intra-op thread as in a worker process, each client from the same initial model."""
    prepared = prepare_task(app.task, app.task_args_json, clients, alpha=app.alpha, seed=app.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = prepared.task.model()
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    times = []
    for _ in range(repeats):
        if before_pass is not None:
            before_pass()
        start = time.perf_counter()
        for client in trained:
            model.load_state_dict(initial)
            seed = local_seed(app.seed, client, 1)
            train = TrainConfig(app.local_epochs, app.learning_rate, app.batch_size, seed=seed)
            prepared.task.train(model, prepared.partition(client), train)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return times


def _training_floor_parallel_s(app: AppConfig, clients: int, workers: int, repeats: int = 3) -> float:
    """The run's client training in ``workers`` forked processes at once (see the module docstring)."""
    busy = _busy_cores(workers)
    context = multiprocessing.get_context("fork")  # as the local engine starts its workers
    barrier, results = context.Barrier(busy), context.Queue()
    processes = [
        context.Process(target=_train_share, args=(app, clients, w, busy, repeats, barrier, results))
        for w in range(busy)
    ]
    for process in processes:
        process.start()
    passes = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    # the mean over the processes, not the slowest: the engine balances its queue, a fixed split of the
    # clients does not, and the floor must not charge the engine for that split's imbalance
    one_round = min(sum(share[i] for share in passes) / busy for i in range(repeats))
    return one_round * app.rounds * app.fraction_train


def _train_share(
    app: AppConfig,
    clients: int,
    index: int,
    shares: int,
    repeats: int,
    barrier: threading.Barrier,
    results: multiprocessing.queues.Queue,
) -> None:
    """One process of :func:`_training_floor_parallel_s`: its clients' training, ``repeats`` passes, each
    started with the other processes'."""
    results.put(_training_passes(app, clients, range(index, clients, shares), repeats, barrier.wait))


def _busy_cores(workers: int) -> int:
    """Cores the local engine's workers keep busy at once."""
    return min(workers, os.cpu_count() or 1)


def _cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its reaped children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _timed_run(config: SimulationConfig) -> dict:
    """One whole run: its wall seconds, final accuracy and (local engine) where its CPU time went."""
    before = _cpu_s()
    with timed() as t:
        history = run_simulation(config)
    after = _cpu_s()
    return {
        "wall_s": t["wall_s"],
        "final_accuracy": history.rounds[-1].accuracy,
        # the local engine's workers are this process's children, reaped when the run ends
        "worker_cpu_s": after[1] - before[1],
        "coordinator_cpu_s": after[0] - before[0],
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    clients, rounds = (10, 3) if args.quick else (50, 10)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    app = AppConfig(rounds=rounds)
    # Prepare once before timing: the on-disk split cache is then warm for both engines alike.
    prepare_task(app.task, app.task_args_json, clients, alpha=app.alpha, seed=app.seed)
    workers = SimulationConfig().workers
    floor_s = _training_floor_s(app, clients, workers)
    parallel_floor_s = _training_floor_parallel_s(app, clients, workers)
    rows, results = [], {}
    for engine in ("local", "ray"):
        config = SimulationConfig(clients=clients, engine=engine, workers=workers, app=app)
        runs = [_timed_run(config) for _ in range(1 if args.quick else 3)]
        best = min(runs, key=lambda run: run["wall_s"])
        results[engine] = {**best, "overhead_s": best["wall_s"] - floor_s}
        results[engine]["wall_s_runs"] = [run["wall_s"] for run in runs]
        if engine != "local":  # only the local engine's workers are this process's children
            del results[engine]["worker_cpu_s"], results[engine]["coordinator_cpu_s"]
        rows.append({"engine": engine, "clients": clients, "rounds": rounds, **results[engine]})
    local, ray = results["local"], results["ray"]
    result = {
        "clients": clients,
        "rounds": rounds,
        "workers": workers,
        "engines": results,
        "training_floor_s": floor_s,
        "training_floor_parallel_s": parallel_floor_s,
        "headline": {
            "local_speedup_vs_ray": ray["wall_s"] / local["wall_s"],
            "local_final_accuracy": local["final_accuracy"],
            "ray_final_accuracy": ray["final_accuracy"],
            "speedup_ceiling": ray["wall_s"] / floor_s,
            "overhead_ratio": ray["overhead_s"] / max(local["overhead_s"], 1e-9),
            "local_efficiency": floor_s / local["wall_s"],
            "local_worker_cpu_s": local["worker_cpu_s"],
            "local_coordinator_cpu_s": local["coordinator_cpu_s"],
            "parallel_scaling": floor_s / parallel_floor_s,
            "local_efficiency_vs_parallel_floor": parallel_floor_s / local["wall_s"],
            "overhead_ratio_vs_parallel_floor": (ray["wall_s"] - parallel_floor_s)
            / max(local["wall_s"] - parallel_floor_s, 1e-9),
            "local_efficiency_cpu_bound": floor_s
            / ((local["worker_cpu_s"] + local["coordinator_cpu_s"]) / _busy_cores(workers)),
        },
    }
    emit(result, as_json=args.json, title="local engine vs Flower's Ray engine", rows=rows)


if __name__ == "__main__":
    main()
