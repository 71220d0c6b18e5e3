"""Bench: robust aggregation under attackers, dense Flower rules against fedge's sparse-aware ones.

Digits, 20 clients, Dirichlet α = 0.5, local engine; 20 % of the clients attack (``fedge.app.attacks``:
sign flip, scaling ×10, Gaussian noise as long as the update, the colluding ALIE and IPM, label flipping
and a backdoor, whose success each run also reports). For each attack:

* ``dense FedMedian``, ``dense FedTrimmedAvg``: Flower's rules over uncompressed replies (the baselines);
* ``sparse FedAvg``: StreamingFedAvg over the sparse codec (what robustness is measured against);
* ``sparse-median``, ``sparse-trimmed-mean``: :class:`fedge.server.RobustStreamingFedAvg` over the same
  codec (top-k 1 % + int8 on every tensor, top-k 10 % + int8 downloads, server learning rate 2.5,
  error-feedback momentum 0.6 unless ``sparse`` says otherwise).

``robust_sparse_gap_pp`` is dense FedMedian's final accuracy minus the best sparse robust rule's, for the
worst of the attacks (accuracies averaged over the seeds). :func:`attack_runs` is what
``fedge bench fl-compression`` calls; ``fedge bench fl-attacks [--json] [--quick]`` runs it alone
(quick: sign flip only, 10 rounds).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fedge.bench._common import emit, parse_args, timed

__all__ = ["DENSE_RULES", "SPARSE", "SPARSE_RULES", "STRONG", "attack_runs"]

CLIENTS = 20
ATTACKERS = 0.2
SPARSE: dict[str, Any] = {
    "codec": "topk:0.01+int8;min=0,patterns=",
    "downlink_codec": "topk:0.1+int8",
    "server_lr": 2.5,
    "ef_momentum": 0.6,
}
STRONG: dict[str, Any] = {"compress": "strong"}
"""What the acceptance judges: the ``strong`` preset under the sparse-aware rules."""
DENSE_RULES = {"dense FedMedian": "median", "dense FedTrimmedAvg": "trimmed-mean"}
SPARSE_RULES = {"sparse-median": "sparse-median", "sparse-trimmed-mean": "sparse-trimmed-mean"}
REFERENCE = {"sparse FedAvg": "fedavg"}


def attack_runs(
    rounds: int,
    seeds: Iterable[int] = (0,),
    quick: bool = False,
    sparse: Mapping[str, Any] | None = None,
    attacks: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Run every rule under every attack; return accuracies and ``robust_sparse_gap_pp``.

    Parameters
    ----------
    rounds : int
        Federated rounds of each run.
    seeds : iterable of int (default: (0,))
        Seeds (partitions, model, attackers); accuracies are averaged over them.
    quick : bool (default: False)
        Sign flip only, and no sparse FedAvg reference run.
    sparse : mapping or None (default: None)
        AppConfig settings of the sparse runs (codec, downlink, server lr, EF momentum, ...); None is
        :data:`SPARSE`. ``{"compress": "strong"}`` judges a preset.
    attacks : iterable of str or None (default: None)
        Attacks to run; None: all of :data:`fedge.app.attacks.ATTACKS` (quick: sign flip).

    Returns
    -------
    dict
        ``robust_sparse_gap_pp`` (worst attack), ``gaps_pp`` and ``best_sparse`` per attack, and
        ``runs[attack][label]`` with ``final_accuracy`` (mean over seeds), per-seed finals, ``rejected``
        and ``wall_s`` (and, for ``backdoor``, the last round's ``backdoor_success``, mean over seeds).
    """
    from fedge.app.attacks import ATTACKS

    seeds = tuple(seeds)
    settings = dict(SPARSE if sparse is None else sparse)
    chosen = tuple(attacks) if attacks is not None else (("sign-flip",) if quick else ATTACKS)
    rules: dict[str, tuple[str, bool]] = {label: (s, False) for label, s in DENSE_RULES.items()}
    if not quick:
        rules |= {label: (s, True) for label, s in REFERENCE.items()}
    rules |= {label: (s, True) for label, s in SPARSE_RULES.items()}
    runs: dict[str, dict[str, Any]] = {}
    gaps, best = {}, {}
    for attack in chosen:
        runs[attack] = {}
        for label, (strategy, compressed) in rules.items():
            finals, backdoors, rejected, wall = [], [], 0, 0.0
            for seed in seeds:
                overrides = {"strategy": strategy, "attack": attack, "attackers": ATTACKERS}
                if label in REFERENCE:  # FedAvg screens no norms by default; the reference is measured with
                    overrides["max_norm_ratio"] = 5.0  # the screen the robust rules have
                with timed() as clock:
                    history = _simulate(rounds, seed, overrides | (settings if compressed else {}))
                wall += clock["wall_s"]
                finals.append(history.rounds[-1].accuracy)
                if "backdoor_success" in history.rounds[-1].extra:
                    backdoors.append(history.rounds[-1].extra["backdoor_success"])
                rejected += sum(int(r.extra.get("rejected", 0)) for r in history.rounds)
            runs[attack][label] = {
                "final_accuracy": sum(finals) / len(finals),
                "final_accuracy_seeds": finals,
                "rejected": rejected,
                "wall_s": wall,
            }
            if backdoors:  # accuracy hardly shows a backdoor: how often the trigger wins does
                runs[attack][label]["backdoor_success"] = sum(backdoors) / len(backdoors)
        best_label = max(SPARSE_RULES, key=lambda label: runs[attack][label]["final_accuracy"])
        best[attack] = best_label
        gaps[attack] = 100 * (
            runs[attack]["dense FedMedian"]["final_accuracy"] - runs[attack][best_label]["final_accuracy"]
        )
    return {
        "robust_sparse_gap_pp": max(gaps.values()),
        "gaps_pp": gaps,
        "best_sparse": best,
        "config": {
            "clients": CLIENTS,
            "rounds": rounds,
            "seeds": list(seeds),
            "alpha": 0.5,
            "attackers": ATTACKERS,
            "sparse": settings,
        },
        "runs": runs,
    }


def _simulate(rounds: int, seed: int, overrides: Mapping[str, Any]):
    from fedge.app.config import AppConfig
    from fedge.simulation.config import SimulationConfig
    from fedge.simulation.engines import run_simulation

    app = AppConfig(rounds=rounds, alpha=0.5, seed=seed, **overrides)
    return run_simulation(SimulationConfig(clients=CLIENTS, engine="local", app=app))


def main() -> None:
    args = parse_args("Robust aggregation under 20 % attackers: dense Flower rules vs sparse-aware ones.")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    rounds = 10 if args.quick else 30
    result = attack_runs(rounds, quick=args.quick, sparse=STRONG)
    rows = [
        {
            "attack": attack,
            "rule": label,
            "final acc %": 100 * run["final_accuracy"],
            "backdoor %": 100 * run["backdoor_success"] if "backdoor_success" in run else "",
            "s": run["wall_s"],
        }
        for attack, labels in result["runs"].items()
        for label, run in labels.items()
    ]
    result["headline"] = {"robust_sparse_gap_pp": result["robust_sparse_gap_pp"]}
    emit(
        result, as_json=args.json, title=f"fl-attacks: digits, {CLIENTS} clients, {rounds} rounds", rows=rows
    )


if __name__ == "__main__":
    main()
