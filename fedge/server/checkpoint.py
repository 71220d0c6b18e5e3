"""The coordinator's checkpoint: global model, last completed round, run history and strategy state.

One ``.npz`` file (no pickles: it is read back with ``allow_pickle=False``), replaced atomically after
each round, so a coordinator killed at any moment restarts from the last completed round.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import time
import zipfile
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError
from fedge.protocol.records import as_number
from fedge.reporting.history import RoundMetrics, RunHistory
from fedge.server.runner import ResumePoint

__all__ = ["CHECKPOINT_FILE", "load_checkpoint", "save_checkpoint", "set_aside_checkpoint"]

CHECKPOINT_FILE = "checkpoint.npz"

log = logging.getLogger(__name__)


def save_checkpoint(
    state_dir: str | Path,
    server_round: int,
    arrays: ArrayRecord,
    history: RunHistory,
    strategy_state: dict[str, np.ndarray] | None = None,
) -> None:
    """Global model, history and strategy state after ``server_round``; replaces the last one atomically."""
    buffer = io.BytesIO()
    strategy_state = strategy_state or {}
    meta = {
        "round": server_round,
        "history": history.to_json(),
        "names": list(arrays.keys()),
        "strategy_names": list(strategy_state),
    }
    tensors = {f"a{i}": arrays[name].numpy() for i, name in enumerate(arrays.keys())}
    tensors.update({f"s{i}": np.asarray(value) for i, value in enumerate(strategy_state.values())})
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **tensors)
    write_bytes_atomic(Path(state_dir) / CHECKPOINT_FILE, buffer.getvalue())


def load_checkpoint(state_dir: str | Path) -> ResumePoint | None:
    """The last completed round in ``state_dir``, or None if nothing was checkpointed."""
    path = Path(state_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes())
            arrays = ArrayRecord(
                {name: Array(np.array(data[f"a{i}"])) for i, name in enumerate(meta["names"])}
            )
            names = meta.get("strategy_names", [])
            strategy_state = {name: np.array(data[f"s{i}"]) for i, name in enumerate(names)}
        saved = meta["history"]
        history = RunHistory(config=saved["config"], initial_accuracy=saved["initial_accuracy"])
        known = {f.name for f in dataclasses.fields(RoundMetrics)} - {"extra", "timeline"}
        for row in saved["rounds"]:
            history.rounds.append(
                RoundMetrics(
                    **{k: row[k] for k in known},
                    extra={k: v for k, v in row.items() if k not in known and k != "timeline"},
                    timeline=row.get("timeline", []),
                )
            )
        completed = meta["round"]
        _check_resumable(completed, arrays, history)
        return ResumePoint(completed, arrays, history, strategy_state)
    except _Unusable as err:
        raise ConfigError(f"checkpoint {path} cannot be resumed: {err}") from None
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        # numpy's own words for a damaged file mislead ("pickled data ... load it unsafely")
        raise ConfigError(
            f"checkpoint {path} is damaged (truncated or not a checkpoint): {type(err).__name__}"
        ) from None


class _Unusable(ValueError):
    """A checkpoint that reads but holds what no run could have written."""


def _check_resumable(completed: object, arrays: ArrayRecord, history: RunHistory) -> None:
    """Refuse (``_Unusable``, saying what) a checkpoint a run could not have written: its round not a
    count of rounds, its history's figures not numbers, its model not finite (every update from it would
    be rejected, and the resumed run would train nothing)."""
    if not _is_int(completed) or not 1 <= completed < 10**9:  # type: ignore[operator]
        raise _Unusable(f"its round is {completed!r}, not a number of completed rounds")
    initial = history.initial_accuracy
    if not isinstance(history.config, dict) or not (initial is None or as_number(initial) is not None):
        raise _Unusable("its history's config or initial accuracy is not what a run writes")
    for row in history.rounds:
        counts = (row.round, row.clients_sampled, row.clients_replied, row.bytes_down, row.bytes_up)
        figures = (row.accuracy, row.loss, row.wall_s)
        if not all(map(_is_int, counts)) or any(as_number(figure) is None for figure in figures):
            raise _Unusable(f"its history's round {row.round!r} holds a figure that is not a number")
    if history.rounds and history.rounds[-1].round != completed:
        raise _Unusable(f"its round is {completed} but its history ends at round {history.rounds[-1].round}")
    for name, array in arrays.items():
        values = array.numpy()
        if values.dtype.kind in "fc" and not np.isfinite(values).all():
            raise _Unusable(f"its model's {name!r} holds NaN or infinity")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def set_aside_checkpoint(state_dir: str | Path, name: str = CHECKPOINT_FILE) -> str | None:
    """Rename the checkpoint ``name`` in ``state_dir``, if any, to one of its own (a fresh run would
    overwrite it at the end of its first round), and say so in the log; the new name, or None if there was
    none."""
    path = Path(state_dir) / name
    if not path.exists():
        return None
    kept = path.with_name(f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}{path.suffix}")
    try:
        path.rename(kept)
    except OSError as err:
        raise ConfigError(f"cannot keep the earlier checkpoint {path}: {err.strerror or err}") from None
    log.warning(
        "%s held an earlier run's checkpoint (--resume continues it): kept as %s", state_dir, kept.name
    )
    return kept.name
