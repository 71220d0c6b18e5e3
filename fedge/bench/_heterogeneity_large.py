"""The heterogeneity comparison at fleet scale: 1,000 clients of a generated task, on the simulated clock.

The digits task cannot feed 1,000 clients (1,437 training images), so this part of ``fedge bench
heterogeneity`` runs :class:`fedge.app.synthetic.SyntheticTask` (128 examples a client, 10 classes,
Dirichlet(0.5) label mixes, an MLP) on the same fleet mix and the same random availability trace (70 % of
the time away), with the digits part's run settings (its ``_runs``: the same fractions of the clients,
10 % a round, the same codecs and schedules; at 1,000 clients 10 % is 100 a round):

* ``dense`` runs every round; the target is 95 % of its final accuracy (the mean of its last 5 rounds, as
  one round's accuracy wobbles with the clients it happened to sample);
* ``topk`` and ``fedge`` run until they reach that target (or the same number of rounds).

Time to the target is simulated time, as in the digits part; a baseline that never reaches the target
counts its whole simulated time and the speedup is marked a lower bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedge.app.config import AppConfig
from fedge.bench._common import timed
from fedge.devices.fleet import FleetConfig
from fedge.simulation.clock_grid import Schedule
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation
from fedge.simulation.fleet import availability_trace

__all__ = ["LARGE_CLIENTS", "LARGE_TASK", "compare_large"]

LARGE_TASK = "fedge.app.synthetic:SyntheticTask"
LARGE_CLIENTS = 1000
TARGET_OF_DENSE = 0.95
_FINAL_ROUNDS = 5  # dense's final accuracy: the mean over its last rounds

RunSettings = Mapping[str, tuple[dict[str, Any], Schedule]]
"""Run name -> (AppConfig fields, Schedule), as the digits part's ``_runs`` gives them."""


def _time_to(rounds: list[Any], target: float) -> float:
    """Simulated seconds until the global model first reaches ``target`` (inf if it never does)."""
    return next((r.extra["sim_clock_s"] for r in rounds if r.accuracy >= target), math.inf)


def _run(
    settings: tuple[dict[str, Any], Schedule], fleet: FleetConfig, rounds: int, target: float
) -> dict[str, Any]:
    """One run on the fleet; ``target`` > 0 ends it there (time to accuracy is what is compared)."""
    app_settings, schedule = settings
    # 128 examples a client: the app's 2 local epochs in batches of 16 are 16 steps, about what the digits
    # part's 5 epochs of batches of 8 over ~14 images are.
    app = AppConfig(
        rounds=rounds,
        local_epochs=2,
        batch_size=16,
        seed=0,
        task=LARGE_TASK,
        max_failed_rounds=0,
        target_accuracy=target,
        **app_settings,
    )
    config = SimulationConfig(
        clients=LARGE_CLIENTS, app=app, fleet=fleet, availability="random", schedule=schedule
    )
    with timed() as t:
        history = run_simulation(config)
    last = history.rounds[-1]
    return {
        "rounds_run": len(history.rounds),
        "final_accuracy": last.accuracy,
        "sim_time_s": last.extra["sim_clock_s"],
        "upload_bytes": sum(r.bytes_up for r in history.rounds),
        "wall_s": t["wall_s"],
        "history": history.rounds,
    }


def compare_large(
    runs_for: Callable[[float], RunSettings], mix: Mapping[str, float], rounds: int = 120
) -> dict[str, Any]:
    """Dense, fixed top-k and fedge's schedule on 1,000 clients of the synthetic task.

    Parameters
    ----------
    runs_for : callable(float) -> mapping
        The run settings for the trace's mean fraction of clients available (the digits part's ``_runs``;
        its fractions are fractions of the clients, so they carry over to 1,000).
    mix : mapping of str to float
        The fleet's device classes and shares.
    rounds : int (default: 120)
        Rounds of the dense run, and at most of the others.

    Returns
    -------
    dict
        ``runs`` (each run's figures), ``target_accuracy`` and a ``headline``: ``large_tta_speedup_vs_dense``,
        ``large_tta_speedup_vs_fixed_topk``, their ``*_is_lower_bound`` flags, ``large_clients``, the target
        and the final accuracies.
    """
    fleet = FleetConfig(mix=dict(mix), seed=0)
    trace = availability_trace("random", LARGE_CLIENTS, seed=0)
    moments = np.linspace(0, 7 * 24 * 3600, 2000)
    available = float(np.mean([trace.fraction_available(float(t)) for t in moments]))
    settings = runs_for(available)
    dense = _run(settings["dense"], fleet, rounds, target=0.0)
    final = float(np.mean([r.accuracy for r in dense["history"][-_FINAL_ROUNDS:]]))
    target = TARGET_OF_DENSE * final
    results = {"dense": dense}
    for name in ("topk", "fedge"):
        results[name] = _run(settings[name], fleet, rounds, target=target)
    for result in results.values():
        result["tta_s"] = _time_to(result.pop("history"), target)
    best = results["fedge"]

    def speedup(baseline: dict[str, Any]) -> tuple[float, bool]:
        """Baseline TTA over fedge's; a baseline that never got there gives a lower bound (its whole run)."""
        reached = math.isfinite(baseline["tta_s"])
        return (baseline["tta_s"] if reached else baseline["sim_time_s"]) / best["tta_s"], not reached

    vs_dense, dense_bound = speedup(dense)
    vs_topk, topk_bound = speedup(results["topk"])
    return {
        "clients": LARGE_CLIENTS,
        "task": LARGE_TASK,
        "rounds": rounds,
        "target_accuracy": target,
        "runs": results,
        "headline": {
            "large_tta_speedup_vs_dense": vs_dense,
            "large_tta_speedup_vs_fixed_topk": vs_topk,
            "large_vs_dense_is_lower_bound": dense_bound,
            "large_vs_topk_is_lower_bound": topk_bound,
            "large_clients": LARGE_CLIENTS,
            "large_target_accuracy": target,
            "large_dense_final_accuracy": final,
            "large_fedge_reached_target": math.isfinite(best["tta_s"]),
        },
    }
