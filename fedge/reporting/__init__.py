"""What a run reports: its history (``metrics.json``), plots, and the console's progress and summary."""

from fedge.reporting.history import RoundListener, RoundMetrics, RunHistory, write_run_outputs

__all__ = ["RoundListener", "RoundMetrics", "RunHistory", "write_run_outputs"]
