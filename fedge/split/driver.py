"""The in-process driver of a mixed fleet: full-model clients and split clients, one global model.

Each round, every client starts from the global model. A ``"full"`` client trains it locally (as
``fedge.app.task.Task.train`` does) and sends its update. A ``"split"`` client holds the front stage of
its cut and trains it in lockstep with the coordinator's server-side stage (:mod:`fedge.split.step`),
every tensor crossing the cut as a fedge payload, then sends the front's update. The coordinator then
averages, key by key, every copy trained of each parameter, weighted by examples: the full clients'
models, the split clients' fronts and the server-side stages (one per split client in SplitFed V1, the
shared one weighted by the examples that trained it in V2). With lossless cuts and V1 this is exactly
FedAvg: a split client's step is the same step its full-model twin would take.

The simulated clock charges every exchange: full clients download the model, compute, upload; split
clients download their front stage, run their chain of split steps against the shared coordinator
(:func:`fedge.split.timing.simulate_split_round`) and upload the front. The round lasts as long as its
slowest client.

The seam to engines: clients and the coordinator exchange only bytes (activation, label, gradient and
update payloads) through :class:`~fedge.split.step.FrontStage` and :class:`~fedge.split.step.BackStage`;
a message-passing engine carries the same payloads instead of calling the two sides directly.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from fedge.app.seeding import seeded
from fedge.compression import CodecError, ErrorFeedback, build_codec, decode
from fedge.devices.fleet import CATALOGUE, ClientProfile
from fedge.split.config import RoundRecord, SplitFedConfig, SplitHistory
from fedge.split.cut import CutLink
from fedge.split.memory import ClientPlan
from fedge.split.model import as_chain, ends_in_relu, segment
from fedge.split.rounds import (
    Delta,
    TensorData,
    average_deltas,
    batch_order,
    blown_up,
    client_round_seed,
    evaluate,
    stage_delta,
    stage_keys,
    step_seed,
)
from fedge.split.step import ActivationScales, BackStage, BatchRejected, FrontStage
from fedge.split.timing import (
    SplitFlops,
    StageFlops,
    StepCost,
    send_s,
    simulate_split_round,
)
from fedge.split.updates import UpdateRejected, check_delta

__all__ = ["SplitFedRun", "evaluate"]

log = logging.getLogger(__name__)


class SplitFedRun:
    """A split federated run over a planned fleet.

    Parameters
    ----------
    model : nn.Module
        The global model (a chain, see :func:`fedge.split.model.as_chain`); trained in place.
    data : sequence of (features, labels)
        Each client's training data.
    test : (features, labels)
        The held-out set the global model is evaluated on after every round.
    plans : sequence of ClientPlan
        From :func:`fedge.split.memory.plan_fleet`: who trains full, who split at which cut.
    profiles : sequence of ClientProfile
        Each client's device and link (the clock).
    config : SplitFedConfig
        The run.
    server : ClientProfile (default: CATALOGUE["server"])
        The coordinator's compute (its link is not charged: the clients' links are the bottleneck).
    """

    def __init__(
        self,
        model: nn.Module,
        data: Sequence[TensorData],
        test: TensorData,
        plans: Sequence[ClientPlan],
        profiles: Sequence[ClientProfile],
        config: SplitFedConfig,
        *,
        server: ClientProfile = CATALOGUE["server"],
    ) -> None:
        if not len(data) == len(plans) == len(profiles):
            raise ValueError("data, plans and profiles need one entry per client")
        self.model, self.data, self.test, self.config = model, list(data), test, config
        self.plans, self.profiles, self.server = list(plans), list(profiles), server
        self.chain = as_chain(model)
        self.end = len(self.chain) - (config.head_layers if config.u_shaped else 0)
        self._flop_count = SplitFlops(model, data[0][0][0], self.end)
        self.full_flops = self._flop_count.full
        self.links = {i: CutLink(config.cut) for i, p in enumerate(plans) if p.mode == "split"}
        self.feedback = {i: {} for i in range(len(plans))}  # error-feedback state of each client's updates
        self.scales = ActivationScales()  # what the server stages step on, by cut
        self.model_bytes = 4 * sum(p.numel() for p in model.parameters())
        self.history = SplitHistory()
        self.clock_s = 0.0
        cuts = {p.cut for p in plans if p.mode == "split"}
        for cut in cuts:
            if cut is not None and not 1 <= cut < self.end:
                raise ValueError(f"cut {cut} leaves no server-side layers (chain of {len(self.chain)})")
        if not config.parallel and len(cuts) > 1:  # vanilla SL hands one front stage from client to client
            raise ValueError(
                f"sequential split learning needs one cut for all split clients, not {sorted(cuts)}"
            )

    def flops(self, cut: int) -> tuple[StageFlops, StageFlops, StageFlops]:
        """Per-sample FLOPs of the front, the server-side stage and the (U-shaped) head at ``cut``."""
        return self._flop_count.at(cut)

    def run(self) -> SplitHistory:
        """Run every round; return the history (also kept in :attr:`history`)."""
        for round_ in range(1, self.config.rounds + 1):
            self.history.rounds.append(self.round(round_))
        return self.history

    # ---------------------------------------------------------------------------------------- a round
    def round(self, round_: int) -> RoundRecord:
        """One round: local and split training, averaging, evaluation, the clock."""
        start = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        contributions: list[tuple[Delta, float]] = []
        durations: list[float] = []
        losses: list[tuple[float, float]] = []
        update_bytes = down_bytes = 0
        left_out: list[int] = []
        before = {
            i: (link.tensor_bytes, link.dense_bytes, link.label_bytes) for i, link in self.links.items()
        }
        for i, plan in enumerate(self.plans):
            if plan.mode != "full":
                continue
            delta, loss = self._train_full(i, round_, start)
            try:
                sent, nbytes = self._upload(i, round_, delta)
                check_delta(sent, {k: v.shape for k, v in delta.items()})
            except (CodecError, UpdateRejected) as err:  # NaN weights: the device's update reaches no one
                log.warning("round %d: full client %d's update is left out: %s", round_, i, err)
                left_out.append(i)
                continue
            contributions.append((sent, float(len(self.data[i][1]))))
            losses.append((loss, len(self.data[i][1])))
            link, device = self.profiles[i].link, self.profiles[i].compute
            steps = self.full_flops.total * len(self.data[i][1]) * self.config.local_epochs
            durations.append(
                send_s(self.model_bytes, link, up=False)
                + steps / device.flops_per_s
                + send_s(nbytes, link, up=True)
            )
            update_bytes += nbytes
            down_bytes += self.model_bytes
        split_ids = [i for i, p in enumerate(self.plans) if p.mode == "split"]
        if split_ids:
            split = self._train_split(round_, split_ids, start)
            contributions.extend(split["contributions"])
            losses.extend(split["losses"])
            durations.extend(split["finish"])
            update_bytes += split["update_bytes"]
            down_bytes += split["down_bytes"]
            left_out.extend(split["left_out"])
        self._apply(start, contributions)
        loss, accuracy = evaluate(self.model, self.test)
        if blown_up(loss, self.history.rounds[-1].loss if self.history.rounds else math.inf):
            log.warning("round %d: the averaged model's loss is %s: the round's start is kept", round_, loss)
            self.model.load_state_dict(start)
            loss, accuracy = evaluate(self.model, self.test)
        round_s = max(durations, default=0.0)
        self.clock_s += round_s
        after = {i: (link.tensor_bytes, link.dense_bytes, link.label_bytes) for i, link in self.links.items()}
        diff = [sum(after[i][k] - before[i][k] for i in self.links) for k in range(3)]
        weight = sum(n for _, n in losses) or 1
        record = RoundRecord(
            round=round_,
            accuracy=accuracy,
            loss=loss,
            train_loss=sum(value * n for value, n in losses) / weight,
            round_s=round_s,
            clock_s=self.clock_s,
            cut_bytes=diff[0],
            cut_dense_bytes=diff[1],
            label_bytes=diff[2],
            update_bytes=update_bytes,
            model_bytes_down=down_bytes,
            split_steps=split["steps"] if split_ids else 0,
            left_out=tuple(sorted(left_out)),
        )
        log.info("round %d: accuracy %.4f, %.1f simulated s", round_, accuracy, round_s)
        return record

    def _optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.config.learning_rate, momentum=self.config.momentum)

    def _train_full(self, client: int, round_: int, start: dict[str, torch.Tensor]) -> tuple[Delta, float]:
        local = copy.deepcopy(self.model)
        local.train()
        optimizer = self._optimizer(list(local.parameters()))
        features, labels = self.data[client]
        total = 0.0
        batches = batch_order(len(labels), self.config, round_, client)
        with seeded(client_round_seed(self.config, round_, client)):  # dropout draws as an engine's client
            for batch in batches:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(local(features[batch]), labels[batch])
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(batch)
        state = local.state_dict()
        seen = max(1, sum(len(b) for b in batches))
        return {k: state[k] - start[k] for k in start if start[k].is_floating_point()}, total / seen

    def _upload(self, client: int, round_: int, delta: Delta) -> tuple[Delta, int]:
        """What the coordinator receives of a client's update, and its bytes."""
        if self.config.update_codec is None:
            return delta, 4 * sum(t.numel() for t in delta.values())
        arrays = {k: t.detach().numpy() for k, t in delta.items()}
        codec = ErrorFeedback(build_codec(self.config.update_codec))
        payload = codec.encode(arrays, self.feedback[client], seed=round_)
        return {k: torch.from_numpy(v.copy()) for k, v in decode(payload).items()}, len(payload)

    def _apply(self, start: dict[str, torch.Tensor], contributions: list[tuple[Delta, float]]) -> None:
        """Global model = start + per-key example-weighted mean of the deltas that name the key."""
        self.model.load_state_dict(average_deltas(start, contributions))

    # ---------------------------------------------------------------------------------------- split
    def _train_split(self, round_: int, ids: list[int], start: dict[str, torch.Tensor]) -> dict:
        cfg = self.config
        shared_v2 = cfg.variant == "v2" or not cfg.parallel
        server_model = copy.deepcopy(self.model)
        server_chain = as_chain(server_model)
        shared_optimizer = self._optimizer(list(server_model.parameters()))
        fronts: dict[int, FrontStage] = {}
        backs: dict[int, BackStage] = {}
        keys: dict[int, tuple[dict[str, str], dict[str, str], dict[str, str]]] = {}
        for i in ids:
            cut = self.plans[i].cut
            chain = as_chain(copy.deepcopy(self.model))
            front = segment(chain, 0, cut)
            head = segment(chain, self.end) if cfg.u_shaped else None
            params = list(front.parameters()) + (list(head.parameters()) if head is not None else [])
            fronts[i] = FrontStage(front, self._optimizer(params), self.links[i], head=head)
            mask = cfg.cut.mask_gradient and ends_in_relu(front)
            self.scales.expect(copy.deepcopy(front), self.test[0][: cfg.batch_size])
            if shared_v2:
                backs[i] = BackStage(
                    segment(server_chain, cut, self.end),
                    shared_optimizer,
                    mask_gradient=mask,
                    scales=self.scales,
                )
            else:
                middle = segment(chain, cut, self.end)
                optimizer = self._optimizer(list(middle.parameters()))
                backs[i] = BackStage(middle, optimizer, mask_gradient=mask, scales=self.scales)
            keys[i] = stage_keys(self.model, cut, self.end)
        orders = {i: batch_order(len(self.data[i][1]), cfg, round_, i) for i in ids}
        chains: dict[int, list[StepCost]] = {i: [] for i in ids}
        losses = {i: [0.0, 0] for i in ids}
        rejected = {i: 0 for i in ids}  # batches lost to a step that failed
        if cfg.parallel:
            schedule = [
                (i, k) for k in range(max(len(o) for o in orders.values())) for i in ids if k < len(orders[i])
            ]
        else:
            schedule = [(i, k) for i in ids for k in range(len(orders[i]))]
        previous: int | None = None
        for i, k in schedule:
            if not cfg.parallel and k == 0 and previous is not None:  # vanilla SL: hand the front over
                fronts[i].front.load_state_dict(fronts[previous].front.state_dict())
                if fronts[i].head is not None:
                    fronts[i].head.load_state_dict(fronts[previous].head.state_dict())
            previous = i
            try:
                cost, loss = self._split_step(i, fronts[i], backs[i], orders[i][k], seed=step_seed(round_, k))
            except (BatchRejected, CodecError) as err:  # NaN activations (the device's own encoder refuses)
                fronts[i].discard()
                if not rejected[i]:
                    log.warning("round %d: split client %d: batch %d lost: %s", round_, i, k, err)
                rejected[i] += 1
                continue
            chains[i].append(cost)
            losses[i][0] += loss * len(orders[i][k])
            losses[i][1] += len(orders[i][k])
        contributions: list[tuple[Delta, float]] = []
        update_bytes = 0
        up_s, down_s = [], []
        left_out: list[int] = []
        last = ids[-1]
        for i in ids:
            n = float(len(self.data[i][1]))
            front_keys, middle_keys, head_keys = keys[i]
            source = fronts[i] if cfg.parallel else fronts[last]
            local = _stage_delta(source.front, front_keys, start)
            if source.head is not None:
                local.update(_stage_delta(source.head, head_keys, start))
            link = self.profiles[i].link
            down_s.append(send_s(4 * sum(t.numel() for t in local.values()), link, up=False))
            if not chains[i] and cfg.parallel:  # no step: its stages only pull the model back to the start
                log.warning("round %d: split client %d stepped no batch; it is left out", round_, i)
                up_s.append(0.0)
                left_out.append(i)
                continue
            sent, nbytes = self._upload(i, round_, local)
            contributions.append((sent, n))
            server_source = backs[i].back
            contributions.append((_stage_delta(server_source, middle_keys, start), n))
            update_bytes += nbytes
            up_s.append(send_s(nbytes, link, up=True))
        finish = simulate_split_round(
            [chains[i] for i in ids],
            start_s=down_s,
            end_s=up_s,
            parallel=cfg.parallel,
            server_workers=cfg.server_workers,
        )
        down_bytes = sum(4 * sum(start[v].numel() for v in keys[i][0].values()) for i in ids)
        return {
            "contributions": contributions,
            "losses": [(losses[i][0] / max(1, losses[i][1]), losses[i][1]) for i in ids],
            "finish": finish,
            "update_bytes": update_bytes,
            "down_bytes": down_bytes,
            "steps": len(schedule),
            "left_out": left_out,
        }

    def _split_step(
        self, client: int, front: FrontStage, back: BackStage, batch: torch.Tensor, *, seed: int
    ) -> tuple[StepCost, float]:
        """One split step of ``client`` on ``batch``; its cost on the clock and its loss.

        U-shaped, the coordinator's part of the chain also covers the exchange with the head (its output
        down, the head's work, the head's gradient up): it holds the request open meanwhile, which charges
        the shared coordinator pessimistically.
        """
        features, labels = self.data[client]
        x, y = features[batch], labels[batch]
        link, profile = self.links[client], self.profiles[client].link
        f_front, f_middle, f_head = self.flops(self.plans[client].cut)
        device, server, n = (
            self.profiles[client].compute.flops_per_s,
            self.server.compute.flops_per_s,
            len(batch),
        )
        up0 = link.up_bytes
        activations = front.forward(x, seed=seed)
        server_s = f_middle.total * n / server
        if front.head is None:
            labels_payload = front.label_payload(y)
            up_bytes = link.up_bytes - up0
            grad, loss = back.step(activations, labels_payload, link, seed=seed)
        else:  # U-shaped: the server's output comes down, the head's gradient goes up
            up_bytes = link.up_bytes - up0
            middle = back.forward(activations, link, client=client, seed=seed)
            head_up0 = link.up_bytes
            head_grad, loss = front.head_step(middle, y, seed=seed)
            server_s += (
                send_s(len(middle), profile, up=False)
                + f_head.total * n / device
                + send_s(link.up_bytes - head_up0, profile, up=True)
            )
            grad = back.backward(head_grad, link, client=client, seed=seed)
        front.backward(grad)
        cost = StepCost(
            forward_s=f_front.forward * n / device,
            up_s=send_s(up_bytes, profile, up=True),
            server_s=server_s,
            down_s=send_s(len(grad), profile, up=False),
            backward_s=f_front.backward * n / device,
        )
        return cost, loss


def _stage_delta(stage: nn.Module, keys: dict[str, str], start: dict[str, torch.Tensor]) -> Delta:
    """The stage's trained values minus the round's start, by model key (floating tensors only)."""
    return stage_delta(stage.state_dict(), keys, start)
