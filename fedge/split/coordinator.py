"""The split coordinator: a mixed fleet's rounds over any Flower Grid, by messages only.

Each round: nodes not met yet say who they are (``query.split_hello``: partition, examples, memory) and
:func:`fedge.split.memory.plan_fleet` decides who trains full and who trains which front. Full-model
clients get the global model (``train``) and train on their own. Split clients exchange with the
coordinator in *waves*: every online split client gets one ``train.split_step`` request carrying the
gradient for its previous batch and asking for the activations of its next one; the coordinator runs its
server-side stage on each reply (:class:`fedge.split.step.BackStage`; one per client in SplitFed V1, one
shared in V2) and keeps the gradient for the client's next request. The last request of a client's round
carries its last gradient and collects its front. Then, as in :class:`fedge.split.driver.SplitFedRun`,
every trained copy of each parameter is averaged into the global model (:mod:`fedge.split.rounds`,
:mod:`fedge.split.tally`), which is evaluated and checkpointed (:mod:`fedge.split.server_state`).

U-shaped, a batch takes two waves (its server output down, the gradient at it up; :mod:`fedge.split.session`);
sequential split learning asks one client at a time and hands the front on (:mod:`fedge.split.waves`);
``update_codec`` updates arrive as codec payloads decoded with caps (:mod:`fedge.split.updates`); with device
profiles each round is charged on the simulated clock (:mod:`fedge.split.engine_clock`).

Drops. A request nobody answered in ``step_timeout_s`` (the client died, its reply was lost) is asked again
once the node is online, with the same gradient: the client applies it only if its front is still at the
version that computed the activations, so nothing is applied twice and the client goes on from where its
Context (on an agent: on disk) says it is. A dropped client costs at most the batch in flight and the next
(:mod:`fedge.split.session`), and only if it stays away for ``max_attempts`` exchanges; a client offline for
the rest of the round (past ``round_timeout_s``) contributes what the coordinator's side learned from it, not
its front, and the gradient it was owed counts as lost.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedge.app.task import prepare_task
from fedge.config import ConfigError
from fedge.devices.fleet import CATALOGUE, ClientProfile
from fedge.flower.compat import set_task_identity
from fedge.server.runner import error_summary
from fedge.split.cut import CutLink
from fedge.split.engine_clock import EngineClock
from fedge.split.engine_config import EngineRound, SplitAppConfig
from fedge.split.memory import ClientPlan, plan_fleet
from fedge.split.messages import FULL_TRAIN, HELLO, SPLIT_STEP, Hello, RunSettings
from fedge.split.model import as_chain, check_chain, ends_in_relu, segment
from fedge.split.rounds import average_deltas, blown_up, evaluate, stage_keys
from fedge.split.server_state import (
    SplitCheckpoint,
    flatten,
    link_arrays,
    load_split_checkpoint,
    momentum_buffers,
    nest,
    restore_links,
    save_split_checkpoint,
)
from fedge.split.session import SplitSession
from fedge.split.step import ActivationScales, BackStage
from fedge.split.tally import tally_round
from fedge.split.waves import WaveRunner

__all__ = ["SplitCoordinator"]

log = logging.getLogger(__name__)


@dataclass
class _Node:
    partition: int
    examples: int
    plan: ClientPlan


class SplitCoordinator:
    """Runs a split federated run on ``grid``.

    Parameters
    ----------
    grid : Grid
        Any Flower Grid whose nodes run :data:`fedge.split.client_app.client_app`.
    config : SplitAppConfig
        The run.
    on_wave : callable(round, wave), optional
        Called after every wave's replies are handled, before the next requests go out (tests use it to
        kill a client between its activations and its gradient).
    on_round : callable(EngineRound), optional
        Called after each round is checkpointed.
    """

    def __init__(
        self,
        grid: Grid,
        config: SplitAppConfig,
        *,
        on_wave: Callable[[int, int], None] | None = None,
        on_round: Callable[[EngineRound], None] | None = None,
    ) -> None:
        self.grid, self.config, self.on_wave, self.on_round = grid, config, on_wave, on_round
        # a fresh run's identity (a resume keeps the checkpoint's): clients drop another run's leftovers
        run = secrets.randbits(62)
        self.settings = RunSettings(config.task, config.task_args, config.alpha, config.split, run)
        self.task = prepare_task(
            config.task,
            config.task_args,
            config.num_partitions or config.min_nodes,
            alpha=config.alpha,
            seed=config.split.seed,
        )
        self.test = self.task.test_set()
        torch.manual_seed(config.model_seed)
        self.model = self.task.task.model()
        cfg = config.split
        try:  # the model's promise that it is a chain of layers, checked on the test set
            self.end = len(as_chain(self.model)) - (cfg.head_layers if cfg.u_shaped else 0)
            if len(self.test[1]):
                check_chain(self.model, self.test[0][:2])
        except ValueError as err:
            raise ConfigError(f"the task's model cannot be split: {err}") from None
        self.clock = (
            EngineClock(
                self.model,
                self.test[0][0],
                self.end,
                config.profiles,
                server_workers=cfg.server_workers,
                parallel=cfg.parallel,
            )
            if config.profiles
            else None
        )
        self.session = uuid.uuid4().hex[:12]  # a fresh one per coordinator: clients restart its rounds
        self.nodes: dict[int, _Node] = {}
        self._duplicates: set[int] = set()  # nodes that said a partition another node holds: left out
        self.links: dict[int, CutLink] = {}  # per partition, across rounds (gradient error feedback)
        self.history: list[EngineRound] = []
        self.completed_round = 0
        self.server_state: dict[str, dict[str, torch.Tensor]] = {}  # last round's server-side stages
        self.server_optim: dict[str, dict[str, torch.Tensor]] = {}  # and their optimizers' momentum
        self.scales = ActivationScales()  # what the server stages step on, by cut
        self._plans: dict[int, ClientPlan] = {}
        self._wake = threading.Event()
        if config.resume:
            self._restore()

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> list[EngineRound]:
        """Wait for ``min_nodes``, run the remaining rounds; return the history."""
        set_task_identity(run_id=self.config.run_id)
        self._wait_for_nodes()
        for server_round in range(self.completed_round + 1, self.config.split.rounds + 1):
            record = self.round(server_round)
            self.history.append(record)
            self.completed_round = server_round
            if self.config.state_dir:
                save_split_checkpoint(self.config.state_dir, self.checkpoint())
            if self.on_round is not None:
                self.on_round(record)
        return self.history

    def round(self, server_round: int) -> EngineRound:
        """One round: hello to new nodes, full training and split waves, averaging, evaluation."""
        began = time.monotonic()
        deadline = began + self.config.round_timeout_s
        self._hello()
        start = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        online = set(self.grid.get_node_ids())
        full = [n for n, node in self.nodes.items() if node.plan.mode == "full" and n in online]
        config = self.settings.record(server_round)
        arrays = ArrayRecord(self.model.state_dict())
        full_messages = [
            self._message(RecordDict({"arrays": arrays, "config": config}), n, FULL_TRAIN, server_round)
            for n in full
        ]
        full_ids = list(self.grid.push_messages(full_messages))
        sessions, server_model = self._sessions(server_round)
        waves = WaveRunner(
            self.grid,
            self.config,
            self.settings,
            self.session,
            lambda content, node, r: self._message(content, node, SPLIT_STEP, r),
            self._wake,
            self.on_wave,
        )
        retries = waves.run(server_round, sessions, start, deadline)
        full_replies = self._collect(full_ids, deadline)
        tally = tally_round(
            full_replies,
            sessions,
            start,
            lambda node: self.nodes[node].partition,
            epochs=self.config.split.local_epochs,
            clock=self.clock,
            sequential=not self.config.split.parallel,
        )
        self.model.load_state_dict(average_deltas(start, tally.contributions))
        loss, accuracy = evaluate(self.model, self.test)
        rolled_back = blown_up(loss, self.history[-1].loss if self.history else math.inf)
        if rolled_back:  # the round's start is kept, and the server stages the last good round left
            log.warning(
                "split round %d: the averaged model's loss is %s: it is dropped and the round's start kept "
                "(a client's activations or update of huge values?)",
                server_round,
                loss,
            )
            self.model.load_state_dict(start)
            loss, accuracy = evaluate(self.model, self.test)
        else:
            self.server_state, self.server_optim = self._server_stages(sessions, server_model)
        links = [s.link for s in sessions]
        losses = tally.losses
        weight = sum(n for _, n in losses) or 1.0
        record = EngineRound(
            round=server_round,
            accuracy=accuracy,
            loss=loss,
            train_loss=sum(v * n for v, n in losses) / weight,
            full_clients=len(full),
            split_clients=len(sessions),
            split_steps=sum(s.server_steps for s in sessions),
            lost_batches=sum(s.lost for s in sessions),
            rejected_batches=sum(s.rejected for s in sessions),
            rolled_back=int(rolled_back),
            retries=retries,
            cut_bytes=sum(link.tensor_bytes for link in links),
            cut_dense_bytes=sum(link.dense_bytes for link in links),
            label_bytes=sum(link.label_bytes for link in links),
            update_bytes=tally.update_bytes,
            model_bytes_down=4 * sum(v.numel() for v in start.values()) * len(full)
            + sum(
                4 * sum(start[k].numel() for k in [*s.keys[0].values(), *s.keys[2].values()])
                for s in sessions
            ),
            wall_s=time.monotonic() - began,
            trained=sorted(tally.trained),
            steps_by_partition={str(s.partition): s.server_steps for s in sessions},
            round_s=tally.round_s,
            clock_s=self.clock.clock_s if self.clock is not None else 0.0,
        )
        for link in links:  # the byte counters are per round; the codec state carries over
            for codec in link.codecs():
                codec.sent_bytes = codec.dense_bytes = 0
            link.label_bytes = 0
        log.info(
            "split round %d: accuracy %.4f, %d split steps, %d lost",
            server_round,
            accuracy,
            record.split_steps,
            record.lost_batches,
        )
        return record

    # ----------------------------------------------------------------------------------- split waves
    def _sessions(self, server_round: int) -> tuple[list[SplitSession], torch.nn.Module | None]:
        """The round's split sessions, each with its server-side stage (V2: segments of one shared copy)."""
        cfg = self.config.split
        # sequential split learning has one server-side model whatever the variant, as in the driver
        shared = copy.deepcopy(self.model) if cfg.variant == "v2" or not cfg.parallel else None
        shared_optimizer = self._optimizer(list(shared.parameters())) if shared is not None else None
        sessions, expected = [], set()
        for node_id, node in sorted(self.nodes.items(), key=lambda item: item[1].partition):
            if node.plan.mode != "split" or node.plan.cut is None:
                continue
            cut = node.plan.cut
            if not 1 <= cut < self.end:
                raise ValueError(f"cut {cut} leaves no server-side layers before the head (end {self.end})")
            chain = as_chain(copy.deepcopy(self.model))
            mask = cfg.cut.mask_gradient and ends_in_relu(segment(chain, 0, cut))
            if cut not in expected:
                self.scales.expect(copy.deepcopy(segment(chain, 0, cut)), self.test[0][: cfg.batch_size])
                expected.add(cut)
            if shared is not None:
                # U-shaped, other clients step the shared weights between a forward and its backward
                back = BackStage(
                    segment(as_chain(shared), cut, self.end),
                    shared_optimizer,
                    mask_gradient=mask,
                    snapshot=cfg.u_shaped and cfg.parallel,
                    scales=self.scales,
                )
                owner = "shared"
            else:
                middle = segment(chain, cut, self.end)
                optimizer = self._optimizer(list(middle.parameters()))
                back = BackStage(middle, optimizer, mask_gradient=mask, scales=self.scales)
                owner = f"p{node.partition}"
            steps = cfg.local_epochs * -(-node.examples // cfg.batch_size)
            self.links.setdefault(node.partition, CutLink(cfg.cut))
            keys = stage_keys(self.model, cut, self.end)
            link = self.links[node.partition]
            sessions.append(
                SplitSession(
                    node_id, node.partition, cut, steps, node.examples, back, link, keys, owner, cfg.u_shaped
                )
            )
        return sessions, shared

    # -------------------------------------------------------------------------------------- helpers
    def _message(self, content: RecordDict, node: int, message_type: str, server_round: int) -> Message:
        ttl = self.config.round_timeout_s if message_type == FULL_TRAIN else self.config.step_timeout_s
        return Message(content, node, message_type, ttl=ttl, group_id=str(server_round))

    def _optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        cfg = self.config.split
        return torch.optim.SGD(params, lr=cfg.learning_rate, momentum=cfg.momentum)

    def _wait_for_nodes(self) -> None:
        deadline = time.monotonic() + self.config.wait_for_nodes_s
        while (online := len(list(self.grid.get_node_ids()))) < self.config.min_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{online} of the {self.config.min_nodes} nodes the run needs (min_nodes) came online "
                    f"within {self.config.wait_for_nodes_s:g} s"
                )
            self._wake.wait(0.1)

    def _hello(self) -> None:
        """Ask nodes not met yet who they are, and plan their part from their memory."""
        new = [n for n in self.grid.get_node_ids() if n not in self.nodes and n not in self._duplicates]
        if not new:
            return
        config = self.settings.record(0)
        messages = [self._message(RecordDict({"config": config}), n, HELLO, 0) for n in new]
        for reply in self.grid.send_and_receive(messages, timeout=self.config.step_timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error():
                reason = reply.error.reason
                hint = (
                    ' (it does not run the split client app: client_app = "fedge.split.app:client_app")'
                    if "split_hello" in reason
                    else ""
                )
                log.warning("node %s did not say hello: %s%s", node, error_summary(reason), hint)
                continue
            hello = Hello.from_message(reply)
            holder = next(
                (n for n, known in self.nodes.items() if known.partition == hello.partition_id), None
            )
            if holder is not None:  # its data would be trained, and weighted, twice
                self._duplicates.add(node)
                log.warning(
                    "node %s says partition %d, which node %s holds: left out (check its partition-id)",
                    node,
                    hello.partition_id,
                    holder,
                )
                continue
            plan = self._plan(hello)
            self.nodes[node] = _Node(hello.partition_id, hello.num_examples, plan)
            log.info("node %s: partition %d trains %s", node, hello.partition_id, plan.mode)
            if plan.mode == "none":
                usable = self.config.memory.usable_fraction
                log.warning(
                    "node %s (partition %d) can train neither the model nor a front stage: it has %d bytes, "
                    "of which training may use %d (usable_fraction %g); the least it needs is %d",
                    node,
                    hello.partition_id,
                    plan.device_bytes,
                    int(plan.device_bytes * usable),
                    usable,
                    plan.required_bytes,
                )

    def _plan(self, hello: Hello) -> ClientPlan:
        if self.config.profiles:
            profile = self.config.profiles[hello.partition_id]
        else:
            base = CATALOGUE["pi4_wifi"]
            compute = dataclasses.replace(base.compute, memory_bytes=hello.memory_bytes)
            profile = ClientProfile(compute, base.link, f"{hello.memory_bytes} bytes")
        key = profile.compute.memory_bytes
        if key not in self._plans:
            example = self.test[0][0]
            self._plans[key] = plan_fleet(copy.deepcopy(self.model), example, [profile], self.config.memory)[
                0
            ][0]
        return self._plans[key]

    def _collect(self, ids: Iterable[str], deadline: float) -> list[Message]:
        """Replies to pushed messages, as they come, until all are in or ``deadline`` passes; what has come
        counts even when the deadline has passed (the split clients' waves may have used the whole round
        waiting for one that died, while the full-model clients' updates sat in the Grid)."""
        waiting, replies = set(ids), []
        while waiting:
            for reply in self.grid.pull_messages(list(waiting)):
                waiting.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            if not waiting or time.monotonic() >= deadline:
                break
            self._wake.wait(0.05)
        return replies

    # --------------------------------------------------------------------------------- checkpoints
    def _server_stages(
        self, sessions: list[SplitSession], shared: torch.nn.Module | None
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """The server-side stages by owner (model keys) and their optimizers' momentum (by index)."""
        stages: dict[str, dict[str, torch.Tensor]] = {}
        if shared is not None:
            stages["shared"] = {k: v.detach().clone() for k, v in shared.state_dict().items()}
        for s in sessions:
            if shared is None:
                state = s.back.back.state_dict()
                stages[s.owner] = {s.keys[1][k]: v.detach().clone() for k, v in state.items()}
        return stages, {s.owner: momentum_buffers(s.back.optimizer) for s in sessions}

    def checkpoint(self) -> SplitCheckpoint:
        """What :meth:`run` writes after each round."""
        return SplitCheckpoint(
            self.completed_round,
            {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()},
            server_stages=flatten(self.server_state),
            server_optim=flatten(self.server_optim),
            links=link_arrays(self.links),
            history=[dataclasses.asdict(r) for r in self.history],
            run=self.config.run_fingerprint(),
            run_key=self.settings.run,
        )

    def _restore(self) -> None:
        saved = load_split_checkpoint(self.config.state_dir)
        if saved is None:
            log.info("no split checkpoint in %s: starting afresh", self.config.state_dir)
            return
        if saved.run != self.config.run_fingerprint():
            raise ValueError(f"the checkpoint is of another run: {saved.run}")
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in saved.global_state.items()})
        self.links = restore_links(saved.links, self.config.split.cut)
        self.server_state, self.server_optim = nest(saved.server_stages), nest(saved.server_optim)
        self.history = [EngineRound(**r) for r in saved.history]
        if self.clock is not None and self.history:
            self.clock.clock_s = self.history[-1].clock_s
        self.completed_round = saved.completed_round
        if saved.run_key:
            self.settings = dataclasses.replace(self.settings, run=saved.run_key)
        log.info("resuming the split run after round %d", self.completed_round)
