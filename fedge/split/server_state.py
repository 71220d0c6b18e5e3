"""The split coordinator's checkpoint: what it holds between rounds, written atomically after each one.

A split run's server-side state at a round boundary is: the global model (which holds the averaged
server-side stages: SplitFed averages them into it every round, V1 and V2 alike), the server-side
stages and their optimizers' momentum as the round left them (one per split client in V1, the shared
one in V2), the coordinator's half of every client's cut link (the gradient codec's error-feedback
residual, which carries over rounds), the completed round and the run's history. Like
:mod:`fedge.server.checkpoint` it is one ``.npz`` (read back with ``allow_pickle=False``) replaced
atomically (:func:`fedge.atomic.write_bytes_atomic`), so a coordinator killed at any moment restarts
from the last completed round.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError
from fedge.split.cut import CutConfig, CutLink

__all__ = [
    "SPLIT_CHECKPOINT_FILE",
    "SplitCheckpoint",
    "flatten",
    "link_arrays",
    "load_split_checkpoint",
    "momentum_buffers",
    "nest",
    "restore_links",
    "save_split_checkpoint",
]

SPLIT_CHECKPOINT_FILE = "split-checkpoint.npz"

_GROUPS = ("global_state", "server_stages", "server_optim", "links")


@dataclass
class SplitCheckpoint:
    """Everything the coordinator needs to continue after ``completed_round``.

    Attributes
    ----------
    completed_round : int
        The last round whose global model was averaged and evaluated.
    global_state : dict of str to ndarray
        The global model's state dict.
    server_stages : dict of str to ndarray
        Server-side stage weights at the end of the round: ``"p<partition>/<model key>"`` (V1) or
        ``"shared/<model key>"`` (V2).
    server_optim : dict of str to ndarray
        Their optimizers' momentum buffers: ``"p<partition>/<index>"`` or ``"shared/<index>"``.
    links : dict of str to ndarray
        The coordinator's codec state per client link: ``"p<partition>/<state key>"``.
    history : list of dict
        The rounds so far (:class:`fedge.split.coordinator.EngineRound` as dicts).
    run : dict
        What the run was (task, variant, codecs): a resumed coordinator refuses a different run.
    run_key : int (default: 0)
        The run's random identity, told to clients (0: from before it was kept).
    """

    completed_round: int
    global_state: dict[str, np.ndarray]
    server_stages: dict[str, np.ndarray] = field(default_factory=dict)
    server_optim: dict[str, np.ndarray] = field(default_factory=dict)
    links: dict[str, np.ndarray] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)
    run_key: int = 0


def save_split_checkpoint(state_dir: str | Path, checkpoint: SplitCheckpoint) -> Path:
    """Write ``checkpoint`` to ``state_dir``, replacing the previous one atomically; return its path."""
    meta: dict[str, Any] = {
        "round": checkpoint.completed_round,
        "history": checkpoint.history,
        "run": checkpoint.run,
        "run_key": checkpoint.run_key,
    }
    arrays: dict[str, np.ndarray] = {}
    for group in _GROUPS:
        values: dict[str, np.ndarray] = getattr(checkpoint, group)
        meta[group] = list(values)
        arrays.update({f"{group}{i}": np.asarray(v) for i, v in enumerate(values.values())})
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    path = Path(state_dir) / SPLIT_CHECKPOINT_FILE
    write_bytes_atomic(path, buffer.getvalue())
    return path


def load_split_checkpoint(state_dir: str | Path) -> SplitCheckpoint | None:
    """The checkpoint in ``state_dir``, or None if there is none.

    Raises
    ------
    ConfigError
        If the file is there but cannot be read.
    """
    path = Path(state_dir) / SPLIT_CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes())
            groups = {
                group: {name: np.array(data[f"{group}{i}"]) for i, name in enumerate(meta[group])}
                for group in _GROUPS
            }
        return SplitCheckpoint(
            int(meta["round"]),
            history=meta["history"],
            run=meta["run"],
            run_key=int(meta.get("run_key", 0)),
            **groups,
        )
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        # numpy's own words for a damaged file mislead ("pickled data ... load it unsafely")
        raise ConfigError(
            f"split checkpoint {path} is damaged (truncated or not a checkpoint): {type(err).__name__}"
        ) from None


def flatten(nested: dict[str, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """``{owner: {key: tensor}}`` as ``{"owner/key": array}``."""
    return {f"{o}/{k}": v.detach().numpy().copy() for o, state in nested.items() for k, v in state.items()}


def nest(flat: dict[str, np.ndarray]) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of :func:`flatten`."""
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in flat.items():
        owner, key = name.split("/", 1)
        nested.setdefault(owner, {})[key] = torch.from_numpy(value)
    return nested


def momentum_buffers(optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """An SGD optimizer's momentum buffers, by parameter index."""
    if optimizer is None:
        return {}
    return {
        str(i): s["momentum_buffer"].detach().clone()
        for i, s in optimizer.state_dict()["state"].items()
        if s.get("momentum_buffer") is not None
    }


def link_arrays(links: dict[int, CutLink]) -> dict[str, np.ndarray]:
    """Every link's codec state as ``{"p<partition>/<codec index>/<state key>": array}``."""
    return {
        f"p{p}/{i}/{k}": v
        for p, link in links.items()
        for i, codec in enumerate(link.codecs())
        for k, v in codec.state.items()
    }


def restore_links(flat: dict[str, np.ndarray], config: CutConfig) -> dict[int, CutLink]:
    """The links :func:`link_arrays` saved (byte counters start at zero)."""
    links: dict[int, CutLink] = {}
    for name, value in flat.items():
        partition, index, key = name.split("/", 2)
        link = links.setdefault(int(partition[1:]), CutLink(config))
        link.codecs()[int(index)].state[key] = value
    return links
