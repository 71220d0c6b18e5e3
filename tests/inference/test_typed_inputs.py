"""Models beyond float images: token-id inputs (int64) and several outputs, from export to serving.

Real exports (torch's exporter), real int8 quantization and real ONNX Runtime sessions throughout.
"""

import json

import numpy as np
import pytest
import torch
import typer
from torch import nn
from typer.testing import CliRunner

from fedge.app.task import load_task
from fedge.cli.predict import predict
from fedge.inference import InputError, ModelServer, make_session
from fedge.inference.feeds import as_input, manifest_dtype, onnx_dtype
from fedge.inference.io import decode_array, encode_array
from fedge.inference.select import measure_variants
from fedge.server.export import ExportError, export_onnx, export_variants

VOCAB, LENGTH, CLASSES = 50, 12, 4


class _TokenClassifier(nn.Module):
    """Token ids in, class logits out: an embedding, a GRU and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.gru = nn.GRU(16, 24, batch_first=True)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(tokens))
        return self.head(hidden[:, -1])


class _TwoHeads(nn.Module):
    """Two outputs: class logits and the features before the head (a dict when ``as_dict``)."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.body, self.head, self.as_dict = nn.Linear(6, 5), nn.Linear(5, 3), as_dict

    def forward(self, x: torch.Tensor):
        features = torch.relu(self.body(x))
        logits = self.head(features)
        return {"logits": logits, "features": features} if self.as_dict else (logits, features)


class _NoisySecondOutput(nn.Module):
    """Its second output is fresh noise: an export cannot reproduce it, so verification must fail on it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor):
        return self.linear(x), torch.rand(x.shape[0], 2)


@pytest.fixture(scope="module")
def token_model():
    torch.manual_seed(0)
    return _TokenClassifier().eval()


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (64, LENGTH), dtype=np.int64)


@pytest.fixture(scope="module")
def token_variants(token_model, tokens, tmp_path_factory):
    labels = np.random.default_rng(1).integers(0, CLASSES, len(tokens))
    return export_variants(
        token_model,
        tokens[:1],
        tmp_path_factory.mktemp("tokens"),
        calibration=tokens,
        labelled=(tokens, labels),
        variants=("fp32", "int8-static", "int8-dynamic"),
        version="t1",
    )


def _torch(model: nn.Module, rows: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(rows)).numpy()


def test_as_input_converts_only_what_fits_exactly():
    int64 = np.dtype(np.int64)
    assert as_input(np.array([[1.0, 2.0]]), int64).dtype == int64  # a CSV's whole floats become ids
    assert as_input(np.array([[1, 2]], np.int32), np.dtype(np.float32)).dtype == np.float32
    assert as_input(np.array([[0, 1]]), np.dtype(bool)).tolist() == [[False, True]]
    same = np.zeros((2, 3), np.int64)
    assert as_input(same, int64) is same  # no copy when it already fits
    for bad, dtype, message in [
        (np.array([[1.5]]), int64, "not all whole numbers"),
        (np.array([[np.nan]]), int64, "not all whole numbers"),
        (np.array([[300]]), np.dtype(np.uint8), "do not fit"),
        (np.array([[-1]]), np.dtype(np.uint8), "do not fit"),
        (np.array([[2]]), np.dtype(bool), "not all 0 or 1"),
        (np.array([["a"]]), np.dtype(np.float32), "the model takes float32"),
    ]:
        with pytest.raises(InputError, match=message):
            as_input(bad, dtype)


def test_dtype_names_map_to_numpy_and_unknown_ones_to_float32():
    assert onnx_dtype("tensor(int64)") == np.int64 and onnx_dtype("tensor(bool)") == np.bool_
    assert onnx_dtype("tensor(string)") == np.float32
    assert manifest_dtype("float32") == np.float32 and manifest_dtype("int32") == np.int32
    assert manifest_dtype("object") == np.float32  # a manifest never makes the device build objects


def test_requests_keep_their_integer_type_on_the_wire():
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    decoded = decode_array(encode_array(ids), max_bytes=1 << 16, max_rows=8)
    assert decoded.dtype == np.int64 and (decoded == ids).all()


def test_a_token_id_model_exports_quantizes_and_serves(token_model, tokens, token_variants):
    fp32_path, fp32 = token_variants["fp32"]
    assert fp32.inputs[0].dtype == "int64" and fp32.inputs[0].shape[1:] == (LENGTH,)
    assert fp32.extra["max_abs_diff"] <= 1e-4
    for variant in ("int8-static", "int8-dynamic"):
        path, manifest = token_variants[variant]
        assert manifest.inputs[0].dtype == "int64" and manifest.accuracy is not None
        assert "max_abs_diff" not in manifest.extra  # fp32's verification is not the variant's
        logits = make_session(path).run(None, {"input": tokens[:8]})[0]
        assert logits.shape == (8, CLASSES) and np.isfinite(logits).all()

    server = ModelServer(warmup_runs=1)
    assert server.load(fp32_path).ok
    expected = _torch(token_model, tokens[:5])
    assert np.abs(server.predict(tokens[:5]) - expected).max() <= 1e-4
    # the same ids written as floats (a CSV's) are fed as int64; fractional ones are refused, not truncated
    assert np.abs(server.predict(tokens[:5].astype(np.float64)) - expected).max() <= 1e-4
    with pytest.raises(InputError, match="whole numbers"):
        server.predict(tokens[:5] + 0.5)

    measured = measure_variants({v: p for v, (p, _) in token_variants.items()}, tokens[:4], runs=6, warmup=1)
    assert {m.variant for m in measured} == set(token_variants)
    assert all(m.latency_ms[1][0] > 0 and m.latency_ms[32][0] > 0 for m in measured)


def test_a_negative_token_id_is_refused_as_torch_refuses_it(token_model, tokens, token_variants):
    """ONNX's Gather reads -1 as the last row: the export served row VOCAB-1's answer for id -1, where torch's
    embedding raises (task sweep). The manifest names the inputs that are indices; a device refuses negative
    values for them, in every variant."""
    for variant, (path, manifest) in token_variants.items():
        assert manifest.extra["index_inputs"] == ["input"], variant
        server = ModelServer(warmup_runs=1)
        assert server.load(path).ok
        negative = tokens[:2].copy()
        negative[1, 3] = -1
        with pytest.raises(InputError, match="indices \\(token ids\\); -1 is negative"):
            server.predict(negative)
        assert server.predict(tokens[:2]).shape == (2, CLASSES)  # ids >= 0 are served as before
    with pytest.raises(IndexError):
        token_model(torch.from_numpy(negative))


class _Picked(nn.Module):
    """Token ids that reach the embedding through a slice, a column pick, a concatenation or arithmetic."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed, self.how = nn.Embedding(VOCAB, 4), how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        picked = {
            "slice": lambda: ids[:, 1:],
            "column": lambda: ids[:, 0],
            "concat": lambda: torch.cat([ids, ids.flip(1)], dim=1),
            "shifted": lambda: ids + 1,  # -1 is a valid id here: torch reads row 0
        }[self.how]()
        return self.embed(picked).flatten(1).sum(1, keepdim=True)


@pytest.mark.parametrize(
    ("how", "indices"), [("slice", True), ("column", True), ("concat", True), ("shifted", False)]
)
def test_token_ids_that_reach_the_embedding_through_a_selection_are_indices(how, indices, tokens, tmp_path):
    """``emb(ids[:, 1:])`` was not recorded, so -1 read the last row (inference sweep); arithmetic is not
    followed, since it may make a negative input valid."""
    from fedge.server.export import export_onnx

    torch.manual_seed(0)
    manifest = export_onnx(_Picked(how).eval(), tokens[:2], tmp_path / "m.onnx")
    assert ("index_inputs" in manifest.extra) is indices


def test_a_canary_of_token_ids_guards_a_token_model(token_variants, tokens):
    from fedge.inference import Canary

    server = ModelServer(warmup_runs=1)
    path = token_variants["fp32"][0]
    assert server.load(path, canary=Canary(tokens[:16].astype(np.float32))).ok  # whole floats fit
    refused = server.load(path, canary=Canary(tokens[:16] + 0.25))
    assert not refused.ok and refused.reason == "canary" and "whole numbers" in refused.message


def test_predict_cli_reads_token_ids_from_csv(token_model, token_variants, tokens, tmp_path):
    app = typer.Typer()
    app.command()(predict)
    app.command("other")(lambda: None)
    inputs = tmp_path / "ids.csv"
    np.savetxt(inputs, tokens[:6], delimiter=",", fmt="%d")
    result = CliRunner().invoke(
        app, ["predict", "--model", str(token_variants["fp32"][0]), "--input", str(inputs), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["predictions"] == _torch(token_model, tokens[:6]).argmax(axis=1).tolist()


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_every_output_of_a_two_headed_model_is_exported_and_verified(as_dict, tmp_path):
    torch.manual_seed(0)
    model = _TwoHeads(as_dict).eval()
    rows = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    manifest = export_onnx(model, rows[:2], tmp_path / "two.onnx")
    assert [o.name for o in manifest.outputs] == ["logits", "logits_1"]
    got = make_session(tmp_path / "two.onnx").run(None, {"input": rows})
    with torch.no_grad():
        out = model(torch.from_numpy(rows))
    expected = list(out.values()) if as_dict else list(out)
    assert len(got) == 2
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == tuple(theirs.shape) and np.abs(ours - theirs.numpy()).max() <= 1e-4
    server = ModelServer(warmup_runs=1)
    assert server.load(tmp_path / "two.onnx").ok
    named, _ = server.run_named({"input": rows})
    assert set(named) == {"logits", "logits_1"}


def test_verification_checks_outputs_after_the_first(tmp_path):
    with pytest.raises(ExportError, match="output 1: max abs diff") as info:
        export_onnx(_NoisySecondOutput().eval(), np.ones((2, 6), np.float32), tmp_path / "noisy.onnx")
    assert info.value.stage == "verify" and not (tmp_path / "noisy.onnx").exists()


def test_inputs_that_are_not_numbers_are_an_export_error(tmp_path):
    with pytest.raises(ExportError, match="not numbers"):
        export_onnx(_TwoHeads(), np.array([["a"] * 6]), tmp_path / "x.onnx")


TOKEN_TASK = '''
import numpy as np
import torch
from torch import nn
from fedge.app.task import Task

VOCAB, LENGTH = 50, 12


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))


def _data(seed, rows):
    """Token sequences; the label says whether any of the tokens 0-4 occurs."""
    tokens = np.random.default_rng(seed).integers(5, VOCAB, (rows, LENGTH))
    labels = np.arange(rows) % 2
    tokens[labels == 1, 3] = np.arange(rows)[labels == 1] % 5
    return torch.from_numpy(tokens), torch.from_numpy(labels)


class TokenTask(Task):
    def model(self):
        return TokenNet()

    def load_partition(self, partition_id, num_partitions, *, alpha, seed):
        return _data(1000 * seed + partition_id, 256)

    def test_set(self, num_partitions, *, alpha, seed):
        return _data(7, 256)
'''


def _simulate(tmp_path, source: str, task: str, settings: str) -> tuple:
    """``fedge simulate`` of the task class ``task`` defined by ``source``: two clients, two rounds, an
    export every round, plus ``settings`` (TOML); the run's directory and its rounds' metrics."""
    from fedge.cli import app as cli

    (tmp_path / "task.py").write_text(source)
    (tmp_path / "run.toml").write_text(
        f'task = "{tmp_path / "task.py"}:{task}"\nclients = 2\nrounds = 2\nlocal-epochs = 2\n'
        f"learning-rate = 0.5\nexport-every = 1\n{settings}"
    )
    out = tmp_path / "run"
    args = ["simulate", "--config", str(tmp_path / "run.toml"), "--workers", "2", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "metrics.json").read_text())["rounds"]


def test_a_token_task_trains_federated_and_every_round_exports_an_int64_model(tmp_path):
    """The whole path with a task fedge has not seen: a simulation exports every round, with int8."""
    variants = 'export-variants = ["fp32", "int8-dynamic", "int8-static"]\n'
    out, rows = _simulate(tmp_path, TOKEN_TASK, "TokenTask", variants)
    assert [r["export_version"] for r in rows] == ["r0001", "r0002"]
    assert all(r["export_failures"] == 0 for r in rows) and rows[-1]["accuracy"] > 0.9
    latest = json.loads((out / "models" / "latest.json").read_text())
    assert set(latest["files"]) == {"fp32", "int8-dynamic", "int8-static"}
    tokens, labels = (
        t.numpy() for t in load_task(f"{tmp_path / 'task.py'}:TokenTask").test_set(2, alpha=1, seed=0)
    )
    server = ModelServer(warmup_runs=1)
    for variant, name in latest["files"].items():
        manifest = json.loads((out / "models" / f"{name}.json").read_text())
        assert manifest["inputs"][0]["dtype"] == "int64", variant
        assert server.load(out / "models" / name).ok, variant
        served = (server.classify(tokens) == labels).mean()  # ORT on the device, int64 ids in
        assert served > 0.9 and abs(served - manifest["accuracy"]) < 1e-9, variant


def test_a_device_answers_token_id_requests_over_mqtt_and_fedge_infer_prints_them(
    mqtt, token_model, token_variants, tokens, tmp_path
):
    """int64 ids cross a real broker in their own type; ``fedge infer`` reads them from CSV."""
    import uuid

    from waiting import wait_until

    from fedge.cli import app as cli
    from fedge.inference.agent import InferenceAgent, InferenceAgentConfig
    from fedge.inference.distribution import publish_model
    from fedge.inference.remote import InferenceClient, InferenceError
    from fedge.transport.artifact_channel import ArtifactPublisher
    from fedge.transport.connection import MqttConnection
    from fedge.transport.topics import Topics

    config = mqtt()
    path, manifest = token_variants["fp32"]
    coordinator = MqttConnection(config, f"coord-{uuid.uuid4().hex[:6]}")
    coordinator.start()
    try:
        publish_model(
            ArtifactPublisher(coordinator, Topics(config.fleet)),
            "t1",
            {"fp32": (path.read_bytes(), manifest)},
        )
        agent_config = InferenceAgentConfig(node_id="dev-t", mqtt=mqtt(), model_dir=str(tmp_path / "dev"))
        with InferenceAgent(agent_config) as agent, InferenceClient(mqtt()) as client:
            wait_until(lambda: agent.server.serving_version == "t1")
            answer = client.predict("dev-t", tokens[:4])
            np.testing.assert_allclose(answer.outputs, _torch(token_model, tokens[:4]), atol=1e-4)
            with pytest.raises(InferenceError, match="whole numbers"):
                client.predict("dev-t", tokens[:2] + 0.5)
            np.savetxt(tmp_path / "ids.csv", tokens[:3], delimiter=",", fmt="%d")
            args = ["infer", "--broker", config.broker_url, "--fleet", config.fleet, "--node", "dev-t"]
            result = CliRunner().invoke(cli, [*args, "--input", str(tmp_path / "ids.csv"), "--json"])
            assert result.exit_code == 0, result.output
            report = json.loads(result.stdout.strip().splitlines()[-1])
            assert report["version"] == "t1"
            assert report["predictions"] == _torch(token_model, tokens[:3]).argmax(axis=1).tolist()
            assert agent.failed_requests == {"bad-request": 1}
    finally:
        coordinator.close()


def test_a_regressor_gets_no_classification_accuracy_in_its_manifests(tmp_path):
    """An argmax over one output column scores 0 whatever the model: no accuracy is better than that."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)).eval()
    x = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    y = x.sum(axis=1)  # float targets
    results = export_variants(model, x[:2], tmp_path, labelled=(x, y), variants=("fp32", "int8-dynamic"))
    assert [manifest.accuracy for _, manifest in results.values()] == [None, None]
    classes = export_variants(
        nn.Linear(6, 3).eval(),
        x[:2],
        tmp_path / "c",
        labelled=(x, (y > 0).astype(np.int64)),
        variants=("fp32",),
    )
    assert classes["fp32"][1].accuracy is not None  # a classifier's is still measured


class _MaskedTokens(nn.Module):
    """Two inputs: token ids and a 0/1 mask of the ones that count (a mean over the unmasked tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.float().unsqueeze(-1)
        pooled = (self.embed(tokens) * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.head(pooled)


class _ByKeyword(_MaskedTokens):
    """Called by keyword: its inputs arrive as a dict in another order than its signature's."""


@pytest.mark.parametrize("keyword", [False, True], ids=["tuple", "dict"])
def test_a_model_of_two_inputs_exports_quantizes_and_serves_by_name(keyword, tokens, tmp_path):
    torch.manual_seed(0)
    model = (_ByKeyword() if keyword else _MaskedTokens()).eval()
    mask = (np.random.default_rng(2).random(tokens.shape) < 0.7).astype(np.int64)
    names = ("tokens", "mask") if keyword else ("input", "input_1")
    structure = (lambda t, m: {"mask": m, "tokens": t}) if keyword else (lambda t, m: (t, m))
    labels = np.random.default_rng(3).integers(0, CLASSES, len(tokens))
    results = export_variants(
        model,
        structure(tokens[:2], mask[:2]),
        tmp_path,
        calibration=structure(tokens, mask),
        labelled=(structure(tokens, mask), labels),
        variants=("fp32", "int8-static", "int8-dynamic"),
    )
    fp32_path, fp32 = results["fp32"]
    assert [spec.name for spec in fp32.inputs] == list(names)
    assert [spec.dtype for spec in fp32.inputs] == ["int64", "int64"]
    assert all(manifest.accuracy is not None for _, manifest in results.values())
    with torch.no_grad():
        expected = (
            model(**dict(zip(names, map(torch.from_numpy, (tokens, mask)), strict=True)))
            if keyword
            else (model(torch.from_numpy(tokens), torch.from_numpy(mask)))
        )
    server = ModelServer(warmup_runs=1)
    assert server.load(fp32_path).ok
    named, _ = server.run_named(dict(zip(names, (tokens, mask), strict=True)))
    assert np.abs(named["logits"] - expected.numpy()).max() <= 1e-4
    sample = dict(zip(names, (tokens[:4], mask[:4]), strict=True))
    measured = measure_variants({v: p for v, (p, _) in results.items()}, sample, runs=6, warmup=1)
    assert len(measured) == 3 and all(m.latency_ms[32][0] > 0 for m in measured)
    # in order, as the export takes them (numpy's traceback; inference sweep), with labels too
    files = {v: p for v, (p, _) in results.items() if v == "fp32"}
    (again,) = measure_variants(files, (tokens[:4], mask[:4]), labelled=((tokens, mask), labels), runs=2)
    assert again.accuracy == fp32.accuracy
    with pytest.raises(ValueError, match="1 arrays given for a model of 2 inputs"):
        measure_variants(files, (tokens[:4],), runs=2)


def test_a_token_model_travels_as_a_weights_delta(token_model, tokens, tmp_path):
    """The coordinator checks a delta on inputs of the graph's own types (int64 ids here)."""
    import copy

    from fedge.server.model_delta import DeltaPlanner

    first = export_onnx(token_model, tokens[:2], tmp_path / "v1.onnx", version="v1")
    moved = copy.deepcopy(token_model)
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(0.01 * torch.randn_like(param))
    second = export_onnx(moved, tokens[:2], tmp_path / "v2.onnx", version="v2")
    planner = DeltaPlanner()
    planner.plan("v1", (tmp_path / "v1.onnx").read_bytes(), first)
    planned = planner.plan("v2", (tmp_path / "v2.onnx").read_bytes(), second)
    assert planned.delta is not None and planned.delta.base == "v1"
    rebuilt = make_session(planned.model).run(None, {"input": tokens[:16]})[0]
    assert np.abs(rebuilt - _torch(moved, tokens[:16])).max() <= 1e-2  # fp16 weights


def test_a_canary_of_one_input_refuses_a_model_of_two_and_says_why(tokens, tmp_path):
    from fedge.inference import Canary

    torch.manual_seed(0)
    mask = np.ones_like(tokens)
    export_onnx(_MaskedTokens().eval(), (tokens[:2], mask[:2]), tmp_path / "two.onnx")
    refused = ModelServer(warmup_runs=1).load(tmp_path / "two.onnx", canary=Canary(tokens[:8]))
    assert not refused.ok and refused.reason == "canary"
    assert "feeds one input; this model takes input, input_1" in refused.message
    assert ModelServer(warmup_runs=1).load(tmp_path / "two.onnx").ok  # warmed on zeros of both inputs


def test_fedge_predict_reads_a_model_of_two_inputs_from_npz(tokens, tmp_path):
    torch.manual_seed(0)
    model = _MaskedTokens().eval()
    mask = (np.random.default_rng(4).random(tokens.shape) < 0.7).astype(np.int64)
    export_onnx(model, (tokens[:2], mask[:2]), tmp_path / "two.onnx")
    np.savez(tmp_path / "x.npz", input=tokens[:5], input_1=mask[:5])
    app = typer.Typer()
    app.command()(predict)
    app.command("other")(lambda: None)
    args = ["predict", "--model", str(tmp_path / "two.onnx"), "--input", str(tmp_path / "x.npz"), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        expected = model(torch.from_numpy(tokens[:5]), torch.from_numpy(mask[:5])).argmax(1).tolist()
    assert json.loads(result.stdout.strip().splitlines()[-1])["predictions"] == expected
    np.savez(tmp_path / "uneven.npz", input=tokens[:5], input_1=mask[:4])
    args[4] = str(tmp_path / "uneven.npz")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "different numbers of rows: input 5, input_1 4" in result.output


MASKED_TASK = '''
import numpy as np
import torch
from torch import nn
from fedge.app.task import Task

VOCAB, LENGTH = 50, 12


class MaskedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, tokens, mask):
        weights = mask.float().unsqueeze(-1)
        return self.head((self.embed(tokens) * weights).sum(1) / weights.sum(1).clamp(min=1.0))


def _data(seed, rows, keyword):
    """Token sequences with a mask; the label says whether a marker token (0-4) occurs unmasked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, VOCAB, (rows, LENGTH))
    labels = np.arange(rows) % 2
    tokens[labels == 1, 3] = np.arange(rows)[labels == 1] % 5
    mask = (rng.random((rows, LENGTH)) < 0.8).astype(np.int64)
    mask[:, 3] = 1
    parts = (torch.from_numpy(tokens), torch.from_numpy(mask))
    features = {"tokens": parts[0], "mask": parts[1]} if keyword else parts
    return features, torch.from_numpy(labels)


class MaskedTask(Task):
    """Two inputs and nothing but data: the default train, evaluate and export_inputs do the rest."""

    def __init__(self, keyword: bool = False):
        self.keyword = keyword

    def model(self):
        return MaskedNet()

    def load_partition(self, partition_id, num_partitions, *, alpha, seed):
        return _data(1000 * seed + partition_id, 256, self.keyword)

    def test_set(self, num_partitions, *, alpha, seed):
        return _data(7, 256, self.keyword)
'''


@pytest.mark.parametrize("keyword", [False, True], ids=["tuple", "dict"])
def test_a_task_of_two_inputs_needs_no_code_beyond_its_data(keyword, tmp_path):
    """Default training, evaluation, FLOP counting (a fleet) and export, for features of two tensors."""
    settings = (
        f'export-variants = ["fp32", "int8-dynamic"]\ntask_args = {{keyword = {str(keyword).lower()}}}\n'
        "[fleet]\nmix = {pi4_wifi = 1.0}\n"
    )
    out, rows = _simulate(tmp_path, MASKED_TASK, "MaskedTask", settings)
    assert rows[-1]["accuracy"] > 0.9 and all(r["export_failures"] == 0 for r in rows)
    assert all(r["sim_time_s"] > 0 for r in rows)  # the clock counted the two-input model's FLOPs
    manifest = json.loads((out / "models" / "r0002" / "model.onnx.json").read_text())
    names = ["tokens", "mask"] if keyword else ["input", "input_1"]
    assert [spec["name"] for spec in manifest["inputs"]] == names
    assert manifest["accuracy"] == pytest.approx(rows[-1]["accuracy"], abs=1e-9)  # ORT on both inputs


def test_only_flat_rows_are_reshaped_to_the_models_input():
    """A channels-last (32, 2) row for a (2, 32) input was reshaped and its values scrambled (exit 0;
    inference sweep): rows with a shape must have the model's."""
    from fedge.inference.io import fit_to_shape

    shape = ["batch", 2, 32]
    flat = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    assert fit_to_shape(flat, shape).shape == (3, 2, 32)  # a CSV's rows
    assert fit_to_shape(flat.reshape(3, 2, 32), shape).shape == (3, 2, 32)
    with pytest.raises(InputError, match=r"shape \[32, 2\] but the model takes \[2, 32\]"):
        fit_to_shape(flat.reshape(3, 32, 2), shape)


def test_an_array_request_to_a_two_headed_model_says_which_outputs_it_left_out(mqtt, tmp_path):
    """``fedge infer`` with an ``.npy`` showed the first head only, without a word (inference sweep)."""
    import uuid

    from waiting import wait_until

    from fedge.cli import app as cli
    from fedge.inference.agent import InferenceAgent, InferenceAgentConfig
    from fedge.inference.distribution import publish_model
    from fedge.inference.remote import InferenceClient
    from fedge.transport.artifact_channel import ArtifactPublisher
    from fedge.transport.connection import MqttConnection
    from fedge.transport.topics import Topics

    torch.manual_seed(0)
    rows = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    manifest = export_onnx(_TwoHeads(False).eval(), rows[:2], tmp_path / "two.onnx")
    config = mqtt()
    coordinator = MqttConnection(config, f"coord-{uuid.uuid4().hex[:6]}")
    coordinator.start()
    try:
        artifacts = {"fp32": ((tmp_path / "two.onnx").read_bytes(), manifest)}
        publish_model(ArtifactPublisher(coordinator, Topics(config.fleet)), "h1", artifacts)
        agent_config = InferenceAgentConfig(node_id="dev-h", mqtt=mqtt(), model_dir=str(tmp_path / "dev"))
        with InferenceAgent(agent_config) as agent, InferenceClient(mqtt()) as client:
            wait_until(lambda: agent.server.serving_version == "h1")
            assert client.predict("dev-h", rows[:3]).other_outputs == ("logits_1",)
            assert client.predict("dev-h", {"input": rows[:3]}).other_outputs == ()  # every output, by name
            np.save(tmp_path / "rows.npy", rows[:3])
            args = ["infer", "--broker", config.broker_url, "--fleet", config.fleet, "--node", "dev-h"]
            result = CliRunner().invoke(cli, [*args, "--input", str(tmp_path / "rows.npy")])
            assert result.exit_code == 0, result.output
            assert "warning: the model's other outputs (logits_1) are not in the answer" in result.output
    finally:
        coordinator.close()
