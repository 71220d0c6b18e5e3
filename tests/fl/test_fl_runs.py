"""Real runs on the local Grid: digits, the reference ClientApp, real codecs, Flower strategies."""

from __future__ import annotations

import itertools
import logging
import re
import zlib

import numpy as np
import pytest
from fl_helpers import reference_app, run
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg, FedMedian

from fedge.client import CompressionMod
from fedge.client.compression_mod import EF_STATE_KEY, REFERENCE_INFO_KEY, REFERENCE_KEY
from fedge.compression import build_codec
from fedge.protocol.records import INSTRUCTION_KEY, UPDATE_KEY, record_to_arrays
from fedge.reporting.history import RunHistory
from fedge.server import CompressionConfig, DecodingStrategy, DownlinkConfig, StreamingFedAvg
from fedge.simulation.local_grid import LocalGrid

DENSE_MODEL_BYTES = 4 * 71_754  # the digits CNN as float32


def _residuals(grid: LocalGrid) -> dict[int, np.ndarray]:
    out = {}
    for node, context in grid.contexts.items():
        if EF_STATE_KEY in context.state:
            arrays = record_to_arrays(context.state[EF_STATE_KEY])[0]
            out[node] = np.concatenate([a.ravel() for k, a in sorted(arrays.items()) if "residual" in k])
    return out


def test_compressed_round_trip_with_error_feedback_kept_in_context_state():
    grid = LocalGrid(reference_app([CompressionMod()]), 4)
    strategy = StreamingFedAvg(
        CompressionConfig("topk:0.05+int8", downlink=DownlinkConfig("topk:0.2+int8")),
        fraction_evaluate=0.0,
        min_available_nodes=4,
    )
    snapshots = []
    history = run(grid, strategy, rounds=3, listener=lambda _: snapshots.append(_residuals(grid)))
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.2
    for rnd in history.rounds:
        assert rnd.clients_replied == rnd.extra["accepted"] == 4 and rnd.extra["rejected"] == 0
        assert rnd.bytes_up < 4 * DENSE_MODEL_BYTES / 10  # serialized replies, Flower's overhead included
        assert rnd.extra["compression_ratio"] > 10
    assert history.rounds[0].extra["downloads_full"] == 4
    assert [r.extra["downloads_delta"] for r in history.rounds[1:]] == [4, 4]
    assert all(r.bytes_down < 4 * DENSE_MODEL_BYTES / 5 for r in history.rounds[1:])
    # every node keeps a residual, and it carries over: each round's differs from the last
    for before, after in itertools.pairwise(snapshots):
        assert before.keys() == after.keys() == set(grid.contexts)
        for node in before:
            assert np.linalg.norm(after[node]) > 0 and not np.array_equal(before[node], after[node])


# --- malformed and poisoned replies -------------------------------------------------------------------

ATTACKS = ("nan", "huge", "wrong_shapes", "garbage", "stale", "heavy")
EXPECTED_REASON = {
    "nan": "non_finite",
    "huge": "norm_outlier",
    "wrong_shapes": "wrong_tensors",
    "garbage": "undecodable",
    "stale": "stale",
    "heavy": "weight_outlier",
}


def _nan_payload(model: dict[str, np.ndarray]) -> bytes:
    """A well-formed fp32 payload (valid CRC) with one NaN: the encoder would refuse to write it."""
    marker = np.float32(1234.5)
    arrays = {k: np.zeros_like(v) for k, v in model.items()}
    next(iter(arrays.values())).flat[0] = marker
    payload = bytearray(build_codec("fp32").encode(arrays))
    at = payload.index(marker.tobytes())
    payload[at : at + 4] = np.float32(np.nan).tobytes()
    payload[-4:] = zlib.crc32(payload[:-4]).to_bytes(4, "little")
    return bytes(payload)


def _attack(msg: Message, context: Context, call_next) -> Message:
    """Attacker nodes (``node_config["attack"]``) reply with a crafted update instead of training."""
    kind = context.node_config.get("attack")
    if kind is None:
        return call_next(msg, context)
    version = int(msg.content[INSTRUCTION_KEY]["version"])
    model = record_to_arrays(msg.content["arrays"])[0]
    rng = np.random.default_rng(context.node_id * 1000 + version)
    codec = build_codec("topk:0.05+int8")
    payload = {
        "nan": lambda: _nan_payload(model),
        "huge": lambda: codec.encode(
            {k: 1e3 * rng.normal(size=v.shape).astype(np.float32) for k, v in model.items()}
        ),
        "wrong_shapes": lambda: codec.encode({k: np.ones(v.size, np.float32) for k, v in model.items()}),
        "garbage": lambda: rng.bytes(3000),
        "stale": lambda: codec.encode({k: np.zeros_like(v) for k, v in model.items()}),
        "heavy": lambda: codec.encode({k: np.full_like(v, 1e-4) for k, v in model.items()}),  # not unchanged
    }[kind]()
    update = ConfigRecord({"payload": payload, "base": version - 1 if kind == "stale" else version})
    content = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": 1e6 if kind == "heavy" else 100.0, "train_loss": 0.1}),
            UPDATE_KEY: update,
        }
    )
    return Message(content, reply_to=msg)


def _honest_run(attackers: bool) -> tuple[RunHistory, dict[int, str]]:
    app = reference_app([_attack, CompressionMod()])
    honest = 8
    grid = LocalGrid(app, honest + (len(ATTACKS) if attackers else 0))
    for index, context in enumerate(grid.contexts.values()):  # honest nodes: the data split eight ways
        if index < honest:
            context.node_config.update({"partition-id": index, "num-partitions": honest})
        else:
            context.node_config["attack"] = ATTACKS[index - honest]
    attacks = {n: str(c.node_config["attack"]) for n, c in grid.contexts.items() if "attack" in c.node_config}
    strategy = StreamingFedAvg(
        CompressionConfig("topk:0.05+int8"), fraction_evaluate=0.0, min_available_nodes=len(grid.contexts)
    )
    return run(grid, strategy, rounds=4), attacks


def test_malformed_and_poisoned_replies_are_rejected_counted_logged_and_harmless(caplog):
    clean, _ = _honest_run(attackers=False)
    with caplog.at_level(logging.WARNING, logger="fedge.server"):
        attacked, attacks = _honest_run(attackers=True)
    assert len(attacked.rounds) == 4
    for rnd in attacked.rounds:
        assert rnd.extra["accepted"] == 8 and rnd.extra["rejected"] == len(ATTACKS)
        for reason in EXPECTED_REASON.values():
            assert rnd.extra[f"rejected_{reason}"] == 1
    assert sorted(attacks.values()) == sorted(ATTACKS)
    for node, kind in attacks.items():
        assert f"rejected the reply of node {node}: {EXPECTED_REASON[kind]}" in caplog.text
    assert abs(attacked.rounds[-1].accuracy - clean.rounds[-1].accuracy) <= 0.01
    assert clean.rounds[-1].accuracy > clean.initial_accuracy + 0.2


# --- composition with Flower's clipping mod and DP wrapper ---------------------------------------------


class _UpdateNorms(FedAvg):
    """Flower's FedAvg that also records the norm of every (decoded) update it aggregates."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.norms: list[float] = []
        self._sent: dict[str, np.ndarray] = {}

    def configure_train(self, server_round, arrays, config, grid):
        self._sent = record_to_arrays(arrays)[0]
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        for reply in replies:
            weights = record_to_arrays(reply.content["arrays"])[0]
            squares = sum(float(np.sum((weights[k] - self._sent[k]) ** 2)) for k in weights)
            self.norms.append(squares**0.5)
        return super().aggregate_train(server_round, replies)


def test_compression_mod_composes_with_flowers_clipping_mod_and_dp_wrapper():
    clip = 0.05
    inner = _UpdateNorms(fraction_evaluate=0.0, min_available_nodes=4, min_train_nodes=4)
    dp = DifferentialPrivacyClientSideFixedClipping(
        inner, noise_multiplier=0.0, clipping_norm=clip, num_sampled_clients=4
    )
    strategy = DecodingStrategy(dp, CompressionConfig("fp32"))
    grid = LocalGrid(reference_app([CompressionMod(), fixedclipping_mod]), 4)
    history = run(grid, strategy, rounds=2)
    assert [r.extra["accepted"] for r in history.rounds] == [4, 4]
    assert len(inner.norms) == 8
    assert max(inner.norms) <= clip * (1 + 1e-4)  # clipped on the device, before encoding
    assert (
        min(inner.norms) >= clip * 0.99
    )  # one epoch moves the model far more than the clip: all were clipped


# --- compressed downloads and model versions -------------------------------------------------------------


def _client_models(grid: LocalGrid) -> dict[int, tuple[int, dict[str, np.ndarray]]]:
    out = {}
    for node, context in grid.contexts.items():
        if REFERENCE_KEY in context.state:
            out[node] = (
                int(context.state[REFERENCE_INFO_KEY]["version"]),
                record_to_arrays(context.state[REFERENCE_KEY])[0],
            )
    return out


def test_clients_rebuild_the_coordinators_model_exactly_and_missed_rounds_get_the_full_model():
    grid = LocalGrid(reference_app([CompressionMod()]), 6)
    strategy = StreamingFedAvg(
        CompressionConfig("topk:0.05+int8", downlink=DownlinkConfig("topk:0.1+int8", full_model="fp16")),
        fraction_train=0.5,
        fraction_evaluate=0.0,
        min_train_nodes=3,
        min_available_nodes=6,
    )
    held: list[dict[int, int]] = []

    def check(metrics) -> None:
        models = _client_models(grid)
        server = strategy.channel.broadcast
        trained = {node for node, (version, _) in models.items() if version == metrics.round}
        assert len(trained) == 3
        for node in trained:
            for name, values in models[node][1].items():
                assert np.array_equal(values, server.reference[name])  # bit for bit
        before = held[-1] if held else {}
        expected_delta = sum(1 for node in trained if before.get(node) == metrics.round - 1)
        assert metrics.extra["downloads_delta"] == expected_delta
        assert metrics.extra["downloads_full"] == 3 - expected_delta
        held.append({node: version for node, (version, _) in models.items()})

    history = run(grid, strategy, rounds=5, listener=check)
    assert len(held) == 5
    later = history.rounds[1:]
    assert (
        sum(r.extra["downloads_delta"] for r in later) > 0
        and sum(r.extra["downloads_full"] for r in later) > 0
    )
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.2


def test_a_client_that_lost_its_model_is_refused_the_delta_and_gets_the_full_model_next():
    grid = LocalGrid(reference_app([CompressionMod()]), 3)
    strategy = StreamingFedAvg(
        CompressionConfig("topk:0.1+int8", downlink=DownlinkConfig()),
        fraction_evaluate=0.0,
        min_available_nodes=3,
    )

    def forget(metrics) -> None:
        if metrics.round == 1:  # one node restarts without its state
            next(iter(grid.contexts.values())).state = RecordDict()

    history = run(grid, strategy, rounds=3, listener=forget)
    second, third = history.rounds[1], history.rounds[2]
    assert second.clients_replied == 2 and second.extra["downloads_delta"] == 3
    assert (
        third.clients_replied == 3
        and third.extra["downloads_full"] == 1
        and third.extra["downloads_delta"] == 2
    )


# --- any Flower strategy -------------------------------------------------------------------------------


def test_fedmedian_consumes_compressed_replies_through_the_decoding_wrapper():
    inner = FedMedian(fraction_evaluate=0.0, min_available_nodes=4, min_train_nodes=4)
    strategy = DecodingStrategy(inner, CompressionConfig("topk:0.1+int8", downlink=DownlinkConfig()))
    grid = LocalGrid(reference_app([CompressionMod()]), 4)
    history = run(grid, strategy, rounds=3)
    assert [r.extra["accepted"] for r in history.rounds] == [4, 4, 4]
    assert all(r.bytes_up < 4 * DENSE_MODEL_BYTES / 5 for r in history.rounds)
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.2


def test_an_approximate_int8_full_model_is_never_the_base_of_a_delta():
    grid = LocalGrid(reference_app([CompressionMod()]), 3)
    downlink = DownlinkConfig("topk:0.1+int8", full_model="int8")
    strategy = StreamingFedAvg(
        CompressionConfig("topk:0.1+int8", downlink=downlink), fraction_evaluate=0.0, min_available_nodes=3
    )
    history = run(grid, strategy, rounds=2)
    assert [(r.extra["downloads_full"], r.extra["downloads_delta"]) for r in history.rounds] == [
        (3, 0),
        (3, 0),
    ]
    assert all(r.clients_replied == 3 and r.extra["rejected"] == 0 for r in history.rounds)
    # int8 is smaller than the fp16 full model
    assert history.rounds[0].extra["download_payload_bytes"] < 3 * 2 * 71_754 * 0.6


def test_evaluate_messages_carry_the_compressed_broadcast_and_train_then_needs_no_model():
    grid = LocalGrid(reference_app([CompressionMod()]), 4)
    strategy = StreamingFedAvg(
        CompressionConfig("topk:0.05+int8", downlink=DownlinkConfig("topk:0.1+int8", full_model="fp16")),
        fraction_evaluate=1.0,
        min_evaluate_nodes=4,
        min_available_nodes=4,
    )
    dense_model_bytes = 4 * 71754  # the digits CNN in float32

    def check(metrics) -> None:
        models = _client_models(grid)
        server = strategy.channel.broadcast
        # Every node evaluated the model round r + 1 trains from, rebuilt bit for bit.
        assert {version for version, _ in models.values()} == {metrics.round + 1}
        for _, arrays in models.values():
            for name, values in arrays.items():
                assert np.array_equal(values, server.reference[name])
        if metrics.round > 1:  # train got empty deltas, evaluate a top-k delta: far below 8 dense models
            assert metrics.extra["downloads_full"] == 0
            assert metrics.bytes_down < 0.15 * 8 * dense_model_bytes

    history = run(grid, strategy, rounds=3, listener=check)
    assert history.rounds[-1].accuracy > history.initial_accuracy + 0.2
    assert all(r.clients_replied == 4 for r in history.rounds)


def test_federated_evaluation_works_for_a_task_that_returns_only_what_the_docs_ask(tmp_path):
    """Flower's FedAvg evaluates on the clients by default and weighs by ``num-examples``: a task's evaluate
    that returns accuracy and loss (here as 0-d tensors, which the docs allow) crashed the run with Flower's
    InconsistentMessageReplies, or failed every evaluate call (library sweep)."""
    from fedge.app.config import AppConfig
    from fedge.app.server_app import run_federated
    from fedge.flower.compat import set_task_identity

    (tmp_path / "bare.py").write_text(
        "import torch\n"
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Bare(DigitsTask):\n"
        "    def evaluate(self, model, data):\n"
        "        result = super().evaluate(model, data)\n"
        "        return {k: torch.tensor(result[k]) for k in ('accuracy', 'loss')}\n"
    )
    grid = LocalGrid(reference_app([]), 3)
    set_task_identity(run_id=1)
    config = AppConfig(rounds=2, local_epochs=1, min_nodes=3, task=f"{tmp_path / 'bare.py'}:Bare")
    evaluated = []

    class Evaluating(FedAvg):
        def aggregate_evaluate(self, server_round, replies):
            replies = list(replies)
            evaluated.append(
                sorted(r.content["metrics"]["num-examples"] for r in replies if not r.has_error())
            )
            return super().aggregate_evaluate(server_round, replies)

    try:
        history = run_federated(grid, config, [], strategy=Evaluating(min_available_nodes=3))
    finally:
        grid.shutdown()
    assert len(history.rounds) == 2 and len(evaluated) == 2
    assert all(len(sizes) == 3 and all(size > 0 for size in sizes) for sizes in evaluated)


def test_a_tasks_train_errors_and_non_numbers_are_named_in_the_reply(tmp_path):
    """A client's error named neither the user's train() nor, for a metric that is not a number, its key
    (Flower's MetricRecord message; library sweep)."""
    from fedge.app.config import AppConfig
    from fedge.app.server_app import run_federated
    from fedge.flower.compat import set_task_identity
    from fedge.server.runner import RunFailed

    (tmp_path / "odd.py").write_text(
        "from fedge.app.task import DigitsTask\n\n\n"
        "class Odd(DigitsTask):\n"
        "    def train(self, model, data, config):\n"
        "        return {**super().train(model, data, config), 'note': 'fine'}\n\n\n"
        "class Raising(DigitsTask):\n"
        "    def train(self, model, data, config):\n"
        "        raise ValueError('labels out of range')\n"
    )
    for name, needle in [
        ("Odd", "train() returned 'note' = 'fine', not a number"),
        ("Raising", "train() raised"),
    ]:
        grid = LocalGrid(reference_app([]), 2)
        set_task_identity(run_id=1)
        config = AppConfig(rounds=1, local_epochs=1, min_nodes=2, task=f"{tmp_path / 'odd.py'}:{name}")
        try:
            with pytest.raises(RunFailed, match=re.escape(needle)):
                run_federated(grid, config, [], strategy=FedAvg(fraction_evaluate=0.0, min_available_nodes=2))
        finally:
            grid.shutdown()


_RAY_REASON = (
    "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException ClientAppException occurred. "
    "Message: task t: train() raised RuntimeError: boom'>"
)


@pytest.mark.parametrize(
    ("reason", "summary"),
    [
        # the local engine: fedge's own reply, the partition first and the traceback after
        (
            "partition 1: Traceback (most recent call last):\n  File x\nValueError: bad",
            "partition 1: ValueError: bad",
        ),
        # a deployment SuperNode: Flower's "<class ...>:<'...'>"
        (
            "<class 'fedge.app.task_checks.TaskContractError'>:<'task t: train() raised RuntimeError: boom'>",
            "TaskContractError: task t: train() raised RuntimeError: boom",
        ),
        # Ray's actors: a ClientAppException around the task's message (it ended in a stray "'>")
        (_RAY_REASON, "task t: train() raised RuntimeError: boom"),
    ],
)
def test_a_client_errors_summary_reads_every_engines_reason(reason, summary):
    from fedge.server.run_failures import error_summary

    assert error_summary(reason) == summary


def test_a_round_without_an_accepted_reply_reports_no_compression_ratio():
    """It reported 0.0, which reads as infinitely worse than dense in any plot or average."""
    from fedge.server.report import RoundReport

    empty = RoundReport().to_metrics()
    assert "compression_ratio" not in empty and "payload_compression_ratio" not in empty
    full = RoundReport(accepted=1, wire_bytes=10, dense_wire_bytes=100, payload_bytes=5, dense_bytes=40)
    assert (full.to_metrics()["compression_ratio"], full.to_metrics()["payload_compression_ratio"]) == (10, 8)


def test_a_run_that_gets_worse_is_warned_about_once(caplog):
    """The strong preset on four clients went 79 % → 18 % and the run said nothing (chaos sweep)."""
    from fedge.reporting.history import RoundMetrics
    from fedge.server.run_failures import FailureWatch

    watch = FailureWatch(limit=3)
    caplog.set_level(logging.WARNING, logger="fedge.server.runner")
    for server_round, accuracy in enumerate([0.5, 0.79, 0.6, float("nan"), 0.3, 0.2, 0.1], start=1):
        metrics = RoundMetrics(server_round, accuracy, 1.0, 4, 4, 1, 1, 0.1, extra={"accepted": 4})
        watch.check(metrics, "")
    warnings = [r.getMessage() for r in caplog.records if "getting worse" in r.getMessage()]
    assert warnings == [
        "round 5: accuracy 30.0 % is 49 points below round 2's 79.0 %: the model is getting worse (a server "
        "step too large for this fleet? a lower server_lr, or the light preset; attackers? a robust strategy)"
    ]


def test_a_run_that_learns_nothing_is_warned_about(caplog):
    """fedavg under scaling attackers ended at chance, exit 0, and nothing said so (attack sweep)."""
    from fedge.reporting.history import RoundMetrics, RunHistory
    from fedge.server.run_failures import FailureWatch

    caplog.set_level(logging.WARNING, logger="fedge.server.runner")
    for accuracies, warned in [([0.1, 0.09, 0.105], True), ([0.1, 0.5, 0.1], False), ([0.1, 0.1], False)]:
        caplog.clear()
        history = RunHistory(config={}, initial_accuracy=0.1)
        for server_round, accuracy in enumerate(accuracies, start=1):
            metrics = RoundMetrics(server_round, accuracy, 1.0, 4, 4, 1, 1, 0.1, extra={"accepted": 4})
            history.rounds.append(metrics)
        FailureWatch(limit=3).check_run(history)
        assert ("did better than the untrained one" in caplog.text) is warned, accuracies


def test_a_round_whose_replies_the_transport_dropped_says_so():
    """It said "no client replied in time" while every reply had been dropped on arrival (resource sweep)."""
    from fedge.reporting.history import RoundMetrics
    from fedge.server.run_failures import FailureWatch, RunFailed

    extra = {"accepted": 0, "transport_dropped_partials": 6.0, "transport_dropped_size": 1.0}
    metrics = RoundMetrics(1, 0.1, 2.3, 3, 0, 1, 0, 60.0, extra=extra)
    with pytest.raises(RunFailed, match=r"the transport dropped messages on arrival \(partials 6, size 1\)"):
        FailureWatch(limit=1).check(metrics, "")
