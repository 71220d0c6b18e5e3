"""fedge bench engines: the same run on fedge's local engine and on Flower's Ray engine.

Headline: ``local_speedup_vs_ray`` (Ray wall seconds / local wall seconds, goal >= 10) and the final accuracy
of both, which should agree closely (different node ids make Ray sample and seed differently).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from _common import emit, parse_args, timed

from fedge.app.config import AppConfig
from fedge.app.task import load_task
from fedge.simulation.config import SimulationConfig
from fedge.simulation.engines import run_simulation


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    clients, rounds = (10, 3) if args.quick else (50, 10)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    rows, results = [], {}
    # Partition once before timing: the on-disk split cache is then warm for both engines alike.
    defaults = AppConfig(rounds=rounds)
    load_task(defaults.task).prepare(clients, alpha=defaults.alpha, seed=defaults.seed)
    for engine in ("local", "ray"):
        config = SimulationConfig(clients=clients, engine=engine, app=defaults)
        with timed() as t:
            history = run_simulation(config)
        results[engine] = {"wall_s": t["wall_s"], "final_accuracy": history.rounds[-1].accuracy}
        rows.append({"engine": engine, "clients": clients, "rounds": rounds, **results[engine]})
    result = {
        "clients": clients,
        "rounds": rounds,
        "engines": results,
        "headline": {
            "local_speedup_vs_ray": results["ray"]["wall_s"] / results["local"]["wall_s"],
            "local_final_accuracy": results["local"]["final_accuracy"],
            "ray_final_accuracy": results["ray"]["final_accuracy"],
        },
    }
    emit(result, as_json=args.json, title="local engine vs Flower's Ray engine", rows=rows)


if __name__ == "__main__":
    main()
