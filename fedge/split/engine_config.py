"""Configuration and per-round record of the split coordinator (:mod:`fedge.split.coordinator`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedge.config import ConfigError
from fedge.devices.fleet import ClientProfile
from fedge.split.config import SplitFedConfig
from fedge.split.memory import MemoryConfig

__all__ = ["EngineRound", "SplitAppConfig"]


@dataclass(frozen=True)
class SplitAppConfig:
    """A split federated run over a Flower Grid (fedge's local engine, MQTT agents, any Grid).

    Parameters
    ----------
    task : str (default: "fedge.app.task:DigitsTask")
        Task import path; every request names it (an agent runs only tasks on its allow-list).
    task_args : str (default: "{}")
        The task's keyword arguments, JSON.
    alpha : float (default: 0.5)
        Dirichlet concentration of the data split.
    split : SplitFedConfig (default: SplitFedConfig())
        Rounds, batches, optimizer, variant (V1/V2), the cut's codecs, ``u_shaped`` (the labels and the
        last ``head_layers`` stay on the device; a batch takes two exchanges), ``update_codec`` (clients'
        updates through a fedge codec with error feedback kept in each node's Context, decoded with caps)
        ``parallel=False`` (sequential split learning: one client at a time in partition order, each
        starting from the front the previous one handed in, one server-side model whatever ``variant``
        says) and ``server_workers`` (the clock's coordinator).
    memory : MemoryConfig (default: MemoryConfig())
        How training memory is counted and which cut a small device gets (:func:`plan_fleet`).
    profiles : tuple of ClientProfile (default: ())
        Device profiles by partition id (simulations); empty: each node's reported ``memory-bytes``. Given,
        they also run the simulated clock: each round's ``round_s`` is charged as the driver charges it,
        from the payload bytes each exchange really carried over each client's link and the stages' FLOPs
        (:mod:`fedge.split.engine_clock`).
    min_nodes : int (default: 1)
        Nodes to wait for before round 1.
    num_partitions : int or None (default: None)
        The data split the coordinator's test set is prepared for; ``min_nodes`` when None.
    wait_for_nodes_s : float (default: 120)
        How long to wait for ``min_nodes``.
    step_timeout_s : float (default: 60)
        How long one exchange (every split client's batch, in parallel) waits for replies.
    round_timeout_s : float (default: 600)
        How long a round waits for clients that are offline or behind; then it ends without them.
    max_attempts : int (default: 3)
        Exchanges a batch gets (a client that did not answer is asked again once it is online) before it
        is given up.
    state_dir : str (default: "")
        Where the checkpoint is written after every round; empty writes none.
    resume : bool (default: False)
        Continue after the checkpoint in ``state_dir`` (a fresh start if there is none).
    model_seed : int (default: 0)
        Seeds the initial global model.
    run_id : int (default: 1)
        The Flower run id stamped on messages.
    """

    task: str = "fedge.app.task:DigitsTask"
    task_args: str = "{}"
    alpha: float = 0.5
    split: SplitFedConfig = field(default_factory=SplitFedConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    profiles: tuple[ClientProfile, ...] = ()
    min_nodes: int = 1
    num_partitions: int | None = None
    wait_for_nodes_s: float = 120.0
    step_timeout_s: float = 60.0
    round_timeout_s: float = 600.0
    max_attempts: int = 3
    state_dir: str = ""
    resume: bool = False
    model_seed: int = 0
    run_id: int = 1

    def __post_init__(self) -> None:
        checks = (
            (self.min_nodes >= 1, "min_nodes must be >= 1"),
            (self.max_attempts >= 1, "max_attempts must be >= 1"),
            (self.step_timeout_s > 0 and self.round_timeout_s > 0, "timeouts must be > 0"),
            (not self.resume or bool(self.state_dir), "resume needs a state_dir"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def run_fingerprint(self) -> dict[str, object]:
        """What a resumed run must share with the checkpointed one."""
        cut = self.split.cut
        return {
            "task": self.task,
            "task_args": self.task_args,
            "variant": self.split.variant,
            "activation_codec": cut.activation_codec,
            "gradient_codec": cut.gradient_codec,
            # only when set, so checkpoints written before the engine ran U-shaped still resume
            **({"head_layers": self.split.head_layers} if self.split.u_shaped else {}),
        }


@dataclass(frozen=True)
class EngineRound:
    """One round of the split engine: the global model's test figures and what happened on the wire.

    ``split_steps`` counts batches the coordinator stepped its server side on; ``lost_batches`` those a
    client dropped (given up after ``max_attempts``, or a gradient the client never applied) and those the
    coordinator's stage would not step on (``rejected_batches``: damaged, mis-shaped, NaN); ``rolled_back``
    is 1 when the averaged model's loss was not finite or blew up and the round's start was kept;
    ``retries`` the exchanges asked again. ``steps_by_partition`` and ``trained`` (partitions whose
    update was averaged in) say who took part. Bytes are payload bytes at the cut (activations and
    gradients, U-shaped also the server stage's output and the gradient at it, and what they take as
    fp32), labels, updates up (dense, or the ``update_codec`` payloads) and models down. ``round_s`` is
    the round's simulated time and ``clock_s`` the run's so far (0 without ``profiles``).
    """

    round: int
    accuracy: float
    loss: float
    train_loss: float
    full_clients: int
    split_clients: int
    split_steps: int
    lost_batches: int
    retries: int
    cut_bytes: int
    cut_dense_bytes: int
    label_bytes: int
    update_bytes: int
    model_bytes_down: int
    wall_s: float
    trained: list[int] = field(default_factory=list)
    steps_by_partition: dict[str, int] = field(default_factory=dict)
    round_s: float = 0.0
    clock_s: float = 0.0
    rejected_batches: int = 0
    rolled_back: int = 0
