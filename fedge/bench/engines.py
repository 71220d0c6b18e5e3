"""fedge bench engines: the same run on fedge's local engine and on Flower's Ray engine.

Both engines must run the same client training, so neither can be faster than that training spread over the
worker processes: the *training floor*. The bench measures it as every engine runs it, the reference
ClientApp's train calls (receiving the global model into the task's model, the task's ``train()``, the reply's
weights), for a whole run: the same run on a Grid that calls the ClientApp in this process, one call at a
time, each timed on its own (``training_floor_s``: their sum over the workers). What an engine adds above it
is its own: messages crossing to its workers and back, process management, idle cores at a round's end and
between rounds, the coordinator's decoding, the ServerApp's aggregation and central evaluation between
rounds. Each engine, and the floor, is timed as the fastest of five whole runs (one with ``--quick``): other
work on the machine only ever adds time, and its speed was seen to move by 15 % between runs. The floor's
runs are interleaved with the local engine's, so that a machine that slows down mid-bench slows both; every
run's wall time is in the JSON (``wall_s_runs``, ``training_floor_s_runs``).

* ``overhead_ratio``: Ray's seconds above the floor over the local engine's (goal >= 20);
* ``local_efficiency``: the floor over the local engine's wall seconds (goal >= 0.8);
* ``local_speedup_vs_ray`` (Ray wall / local wall) as context, with the ``speedup_ceiling`` the floor sets
  (Ray wall / floor), and the final accuracy of both engines and of the floor's run, which should agree
  closely (the floor's run and the local engine give the same node ids, so they agree exactly; different
  node ids make Ray sample and seed differently).

The task's ``train()`` alone is a lower floor still (``train_loop_floor_s``: every client's first-round
training once, in this process, the fastest of three passes, times the rounds, over the workers), so the
ClientApp's own work per call is ``training_floor_s - train_loop_floor_s`` (over the workers), and both goals
against it are reported as ``local_efficiency_vs_train_loop`` and ``overhead_ratio_vs_train_loop``: what the
local engine costs if the reference ClientApp's model loading and reply building are charged to it too.

Where the local engine's time goes: the CPU seconds its worker processes and this process spent
(``local_worker_cpu_s``, ``local_coordinator_cpu_s``). No schedule of that work on the workers' cores can end
sooner than their sum over the cores, so ``local_efficiency_cpu_bound`` (the floor over that) is the most
``local_efficiency`` could be without doing less work: the part of the gap that idle cores explain is the
difference between the two.

Both floors divide one process's training by the workers, as if training on both cores at once cost what it
costs on one. ``train_loop_floor_parallel_s`` measures that instead: the task's training in ``workers`` forked
processes at once (each its share of the clients, passes started together, a pass's time the mean of its
processes' times; the fastest of three), so the cores' shared caches, memory bandwidth and the host's
other guests are in it, as they are in every engine's run. ``parallel_scaling`` (train-loop floor / its
parallel measure; 1.0 is perfect) says how far the machine is from that assumption.
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
from flwr.app import Context, Message, MessageType
from flwr.clientapp import ClientApp

from fedge.app.client_app import app as client_app
from fedge.app.client_app import local_seed
from fedge.app.config import AppConfig
from fedge.app.server_app import run_federated
from fedge.app.task import TrainConfig, prepare_task
from fedge.bench._common import emit, parse_args, timed
from fedge.flower.compat import set_task_identity
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.local_grid import LocalGrid

_FLOOR_RUN_ID = 1  # the local engine's: the floor's run is the same run


def _train_loop_floor_s(app: AppConfig, clients: int, workers: int, repeats: int = 3) -> float:
    """The task's ``train()`` alone at best: one round of it (the fastest of ``repeats``), times the rounds,
    over the workers."""
    # the fastest of a few: other work on the machine only ever adds time
    one_round = min(_training_passes(app, clients, range(clients), repeats))
    return one_round * app.rounds * app.fraction_train / _busy_cores(workers)


class _TimedClientApp:
    """A ClientApp whose train calls are timed, each on its own (the floor's run)."""

    def __init__(self, client_app: ClientApp) -> None:
        self.client_app, self.train_s, self.train_calls = client_app, 0.0, 0

    def __call__(self, message: Message, context: Context) -> Message:
        start = time.perf_counter()
        reply = self.client_app(message, context)
        if message.metadata.message_type == MessageType.TRAIN:
            self.train_s += time.perf_counter() - start
            self.train_calls += 1
        return reply


def _floor_run(app: AppConfig, clients: int, workers: int) -> dict:
    """The whole run on a Grid that calls the reference ClientApp in this process, one call at a time on one
    intra-op thread (as in a worker process): its train calls' seconds over the workers, and its final
    accuracy (the local engine's, to the bit: same node ids, same seeds)."""
    timed_app = _TimedClientApp(client_app)
    set_task_identity(run_id=_FLOOR_RUN_ID)
    grid = LocalGrid(timed_app, clients, run_id=_FLOOR_RUN_ID, workers=1, processes=False)  # type: ignore[arg-type]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        history = run_federated(grid, app, [], num_partitions=clients)
    finally:
        torch.set_num_threads(threads)
        grid.shutdown()
    return {
        "floor_s": timed_app.train_s / _busy_cores(workers),
        "train_calls": timed_app.train_calls,
        "final_accuracy": history.rounds[-1].accuracy,
    }


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


def _train_loop_floor_parallel_s(app: AppConfig, clients: int, workers: int, repeats: int = 3) -> float:
    """The run's ``train()`` calls in ``workers`` forked processes at once (see the module docstring)."""
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
    """One process of :func:`_train_loop_floor_parallel_s`: its clients' training, ``repeats`` passes, each
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
    repeats = 1 if args.quick else 5
    logging.getLogger("flwr").setLevel(logging.ERROR)
    app = AppConfig(rounds=rounds)
    # Prepare once before timing: the on-disk split cache is then warm for both engines alike.
    prepare_task(app.task, app.task_args_json, clients, alpha=app.alpha, seed=app.seed)
    workers = SimulationConfig().workers
    loop_floor_s = _train_loop_floor_s(app, clients, workers)
    loop_parallel_s = _train_loop_floor_parallel_s(app, clients, workers)
    configs = {
        e: SimulationConfig(clients=clients, engine=e, workers=workers, app=app) for e in ("local", "ray")
    }
    floor_runs, local_runs = [], []
    for _ in range(repeats):  # interleaved: a machine that slows down mid-bench slows both alike
        floor_runs.append(_floor_run(app, clients, workers))
        local_runs.append(_timed_run(configs["local"]))
    floor = min(floor_runs, key=lambda run: run["floor_s"])
    floor_s = floor["floor_s"]
    rows, results = [], {}
    for engine in ("local", "ray"):
        runs = local_runs if engine == "local" else [_timed_run(configs[engine]) for _ in range(repeats)]
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
        "training_floor_s_runs": [run["floor_s"] for run in floor_runs],
        "floor_train_calls": floor["train_calls"],
        "train_loop_floor_s": loop_floor_s,
        "train_loop_floor_parallel_s": loop_parallel_s,
        "headline": {
            "local_speedup_vs_ray": ray["wall_s"] / local["wall_s"],
            "local_final_accuracy": local["final_accuracy"],
            "ray_final_accuracy": ray["final_accuracy"],
            "floor_final_accuracy": floor["final_accuracy"],
            "speedup_ceiling": ray["wall_s"] / floor_s,
            "overhead_ratio": _overhead_ratio(ray["wall_s"], local["wall_s"], floor_s),
            "local_efficiency": floor_s / local["wall_s"],
            "local_worker_cpu_s": local["worker_cpu_s"],
            "local_coordinator_cpu_s": local["coordinator_cpu_s"],
            "local_efficiency_cpu_bound": floor_s
            / ((local["worker_cpu_s"] + local["coordinator_cpu_s"]) / _busy_cores(workers)),
            "local_efficiency_vs_train_loop": loop_floor_s / local["wall_s"],
            "overhead_ratio_vs_train_loop": _overhead_ratio(ray["wall_s"], local["wall_s"], loop_floor_s),
            "parallel_scaling": loop_floor_s / loop_parallel_s,
        },
    }
    emit(result, as_json=args.json, title="local engine vs Flower's Ray engine", rows=rows)


def _overhead_ratio(ray_s: float, local_s: float, floor_s: float) -> float:
    """Ray's seconds above ``floor_s`` over the local engine's."""
    return (ray_s - floor_s) / max(local_s - floor_s, 1e-9)


if __name__ == "__main__":
    main()
