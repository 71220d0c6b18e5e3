"""When a run is not training: rounds without an accepted update, counted, explained and stopped.

A run that trains nothing must not pass for a success. :class:`FailureWatch` counts the rounds in a row
whose updates were all rejected, lost or rolled back, logs the first cause in one line (a client's exception,
screening's reasons, the simulated clock's cut-offs), and raises :class:`RunFailed` after the limit, or at
the end of a run that never trained.
"""

from __future__ import annotations

import logging
import math
import re

from fedge.reporting.history import RoundMetrics, RunHistory
from fedge.server.screening import REJECTION_MEANINGS

__all__ = ["FailureWatch", "RunFailed", "error_summary", "trained"]

_FLOWER_REASON = re.compile(r"^<class '([\w.]+)'>:<'(.*)'>$", re.DOTALL)
_CLIENT_APP_EXCEPTION = re.compile(r"^\s*Exception \w+ occurred\. Message: ")

log = logging.getLogger("fedge.server.runner")  # the runner's lines, as they were

_ROLLED_BACK = "the aggregated model's loss was not finite, or blew up: the previous model was kept"


class RunFailed(RuntimeError):
    """The run stopped because it was not training: no client update was accepted for too long.

    ``client_traceback`` says whether the first cause is a client's exception (whose whole traceback the
    logs hold), rather than a deadline, an availability trace or screening.
    """

    def __init__(self, message: str, *, client_traceback: bool = False) -> None:
        super().__init__(message)
        self.client_traceback = client_traceback


def trained(metrics: RoundMetrics) -> bool:
    """Whether the round accepted an update (so the global model moved), and kept it."""
    if metrics.extra.get("rolled_back") or metrics.extra.get("aggregation_failed"):
        return False
    return bool(metrics.extra.get("accepted", metrics.clients_replied))


DIVERGENCE_PP = 20.0
"""Accuracy this many points below the run's best round: the model is falling apart, not noisy."""


class FailureWatch:
    """Counts rounds in which no update was accepted; says why, and stops a run that is not training. Warns
    once, too, when the model falls :data:`DIVERGENCE_PP` points below its best round: a run that trains,
    and gets worse (the ``strong`` preset's server step on four clients went 79 % → 18 % without a word)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row, self.first_error = limit, 0, ""
        self._reported = ""  # the last client failure warned about: the same one again is logged at INFO
        self._best: tuple[int, float] | None = None  # the round of the best accuracy so far, and it
        self._diverged = False

    def check(self, metrics: RoundMetrics, first_error: str, failed: int = 0) -> None:
        self._check_divergence(metrics)
        if trained(metrics):
            self.in_a_row = 0
            if failed:  # the round trained, without some clients: say who failed and why
                cause = error_summary(first_error)
                level = logging.INFO if cause == self._reported else logging.WARNING
                self._reported = cause
                log.log(
                    level,
                    "round %d: %d of %d sampled clients failed; first: %s",
                    metrics.round,
                    failed,
                    metrics.clients_sampled,
                    cause,
                )
            return
        self.in_a_row += 1
        rolled_back = _ROLLED_BACK if metrics.extra.get("rolled_back") else ""
        self.first_error = (
            self.first_error or rolled_back or first_error or _rejections(metrics) or _clock_cause(metrics)
        )
        cause = (
            rolled_back
            or error_summary(first_error)
            or _rejections(metrics)
            or _clock_cause(metrics)
            or _transport_cause(metrics)
            or "no client replied in time"
        )
        log.warning(
            "round %d: none of the %d sampled clients' updates was accepted; first: %s",
            metrics.round,
            metrics.clients_sampled,
            cause,
        )
        if first_error:
            log.info("round %d: the first client error in full:\n%s", metrics.round, first_error)
        if self.limit and self.in_a_row >= self.limit:
            raise RunFailed(
                f"no client update was accepted in {self.in_a_row} consecutive rounds; first: {cause}",
                client_traceback="Traceback" in first_error,
            )

    def _check_divergence(self, metrics: RoundMetrics) -> None:
        accuracy = metrics.accuracy
        if not math.isfinite(accuracy):
            return
        if self._best is None or accuracy > self._best[1]:
            self._best = (metrics.round, accuracy)
        elif not self._diverged and 100 * (self._best[1] - accuracy) >= DIVERGENCE_PP:
            self._diverged = True
            log.warning(
                "round %d: accuracy %.1f %% is %.0f points below round %d's %.1f %%: the model is getting "
                "worse (a server step too large for this fleet? a lower server_lr, or the light preset; "
                "attackers? a robust strategy)",
                metrics.round,
                100 * accuracy,
                100 * (self._best[1] - accuracy),
                self._best[0],
                100 * self._best[1],
            )

    def check_run(self, history: RunHistory) -> None:
        accuracies = [r.accuracy for r in history.rounds if math.isfinite(r.accuracy)]
        initial = history.initial_accuracy
        if len(accuracies) >= 3 and initial is not None and max(accuracies) <= initial + 0.01:
            log.warning(
                "no round's model did better than the untrained one (%.1f %%, best round %.1f %%): the run "
                "trained, and learned nothing (attackers? a codec or strategy that starves the model?)",
                100 * initial,
                100 * max(accuracies),
            )
        if history.rounds and not any(map(trained, history.rounds)):
            cause = error_summary(self.first_error) or "no client replied in time"
            raise RunFailed(
                f"no client update was accepted in any round; first: {cause}",
                client_traceback="Traceback" in self.first_error,
            )


def _clock_cause(metrics: RoundMetrics) -> str:
    """Why a simulated clock's round got no reply, from its timeline (clients cut off by their availability,
    replies after the deadline), or "" without one."""
    statuses = [row.get("status") for row in metrics.timeline]
    n = len(statuses)
    causes = [
        f"{statuses.count('cut_off')} of {n} clients went away (their availability) before replying",
        f"{statuses.count('late')} of {n} replies came after the deadline",
    ]
    return "; ".join(cause for cause in causes if not cause.startswith("0 of"))


def _transport_cause(metrics: RoundMetrics) -> str:
    """What the MQTT transport dropped in the round (its ``transport_dropped_<reason>`` figures), or "": a
    round whose replies were dropped on arrival had been reported as one no client replied to."""
    drops = _counts(metrics, "transport_dropped_")
    if not drops:
        return ""
    listed = ", ".join(f"{reason} {count}" for reason, count in sorted(drops.items(), key=lambda kv: -kv[1]))
    return f"no reply got through; the transport dropped messages on arrival ({listed})"


def _rejections(metrics: RoundMetrics) -> str:
    """The round's rejected replies by reason ("rejected by screening: bad_weight x4"), or "" if none."""
    counts = _counts(metrics, "rejected_")
    if not counts:
        return ""
    first = max(sorted(counts), key=counts.__getitem__)  # the commonest reason, explained
    meaning = f" ({first}: {REJECTION_MEANINGS[first]})" if first in REJECTION_MEANINGS else ""
    listed = ", ".join(f"{reason} x{n}" for reason, n in sorted(counts.items()))
    return f"rejected by screening: {listed}{meaning}"


def _counts(metrics: RoundMetrics, prefix: str) -> dict[str, int]:
    """The round's nonzero ``<prefix><reason>`` figures, by reason."""
    return {
        key.removeprefix(prefix): int(value)
        for key, value in metrics.extra.items()
        if key.startswith(prefix) and value
    }


def error_summary(text: str) -> str:
    """The line of a traceback people need first: its last, with the partition named in its first.

    A reason Flower wrote (Ray's and the deployment engine's SuperNodes catch the ClientApp's exception
    themselves) is ``<class 'module.Error'>:<'message'>``, the message of a ``ClientAppException``
    prefixed with "Exception ClientAppException occurred. Message: ": it is read as ``Error: message``.
    """
    wrapped = _FLOWER_REASON.match(text.strip())
    if wrapped is not None:
        name, message = wrapped.group(1).rsplit(".", 1)[-1], wrapped.group(2).strip()
        message = _CLIENT_APP_EXCEPTION.sub("", message).strip()
        text = message if name == "ClientAppException" else f"{name}: {message}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    head = lines[0].split(":", 1)[0] if lines[0].startswith(("partition ", "node ")) else ""
    return f"{head}: {lines[-1]}" if head and len(lines) > 1 else lines[-1]
