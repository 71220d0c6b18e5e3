"""The serving core: predictions, latency percentiles, hot swap under load, rollback on every failure kind."""

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fedge.inference import Canary, ModelServer, SessionConfig, read_manifest, sha256_bytes
from fedge.inference.io import InputError
from fedge.inference.manifest import TensorSpec


def _model_bytes(path):
    return path.read_bytes(), read_manifest(path)


def _nan_model() -> bytes:
    """A valid model whose outputs on zeros are -inf (log 0): loads fine, fails the canary."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 64])
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["flat"]), helper.make_node("Log", ["flat"], ["logits"])],
        "nan",
        [x],
        [y],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString()


def _graph(*nodes: tuple[str, list[str], str]) -> bytes:
    """A float model of input ``x`` [batch, 4] and output ``y`` from ``(op, inputs, output)`` nodes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    made = [helper.make_node(op, inputs, [output]) for op, inputs, output in nodes]
    model = helper.make_model(
        helper.make_graph(made, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)]
    )
    model.ir_version = 9
    return model.SerializeToString()


def test_without_a_canary_a_model_nan_only_on_zeros_is_served_and_one_nan_everywhere_is_not():
    server = ModelServer(SessionConfig(intra_op_threads=1))
    # x / sum(x): a masked mean's 0 / 0 on an all-zero mask, finite on any real one
    masked = _graph(("ReduceSum", ["x"], "total"), ("Div", ["x", "total"], "y"))
    result = server.swap(masked, None, version="masked")
    assert result.ok, result.message
    assert np.allclose(server.predict(np.ones((1, 4), np.float32)), 0.25)
    broken = _graph(("Sub", ["x", "x"], "zero"), ("Div", ["zero", "zero"], "y"))  # NaN on every input
    result = server.swap(broken, None, version="broken")
    assert not result.ok and result.reason == "warm-up" and "all-one" in result.message
    assert server.version == "masked" and server.failed_swaps == {"warm-up": 1}


def test_predict_reports_version_and_percentiles(variants, digits_test):
    server = ModelServer(SessionConfig(intra_op_threads=1))
    result = server.load(variants["fp32"][0])
    assert result.ok and server.version == "r3"
    server.reset_stats()
    predictions = np.concatenate([server.classify(digits_test[0][i : i + 16]) for i in range(0, 160, 16)])
    assert (predictions == digits_test[1][:160]).mean() > 0.8
    stats = server.stats()
    assert stats.count == 10 and stats.version == "r3"
    assert 0 < stats.p50_ms <= stats.p95_ms <= stats.p99_ms


def test_session_options_for_small_devices():
    options = SessionConfig(intra_op_threads=0, memory_arena=False).options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.intra_op_num_threads >= 1 and not options.enable_cpu_mem_arena
    with pytest.raises(ValueError):
        SessionConfig(intra_op_threads=-1)


def test_hot_swap_under_concurrent_requests_loses_nothing(variants, digits_test):
    server = ModelServer()
    assert server.load(variants["fp32"][0]).ok
    models = [_model_bytes(variants[v][0]) for v in ("int8-static", "fp32")]
    errors, versions, stop = [], set(), threading.Event()
    served = threading.Semaphore(0)
    rows = digits_test[0][:4]

    def client():
        while not stop.is_set():
            try:
                assert server.predict(rows).shape == (4, 10)
                versions.add(server.version)
            except Exception as err:  # any failure is a lost request
                errors.append(err)
            served.release()

    threads = [threading.Thread(target=client) for _ in range(3)]
    for thread in threads:
        thread.start()
    for i in range(10):
        for _ in range(5):  # requests are flowing between swaps
            served.acquire()
        result = server.swap(*models[i % 2], version=f"v{i}")
        assert result.ok and result.previous_version == ("r3" if i == 0 else f"v{i - 1}")
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == [] and server.version == "v9" and server.swaps == 11
    assert len(versions) > 2  # requests really ran on several generations


def test_in_flight_request_finishes_on_the_old_session(variants, digits_test):
    server = ModelServer()
    server.load(variants["fp32"][0])
    old = server.current  # what a request in flight holds
    assert server.swap(*_model_bytes(variants["int8-static"][0])).ok
    assert server.current is not old
    assert old.session.run(None, {old.input_name: digits_test[0][:2]})[0].shape == (2, 10)  # still usable


@pytest.mark.parametrize(
    "failure", ["checksum", "opset", "load", "manifest", "canary-nonfinite", "canary-accuracy"]
)
def test_bad_model_keeps_the_old_one_and_says_why(variants, digits_test, failure):
    server = ModelServer()
    server.load(variants["fp32"][0])
    data, manifest = _model_bytes(variants["int8-static"][0])
    canary = None
    if failure == "checksum":
        data = data[:-10] + b"0123456789"
    elif failure == "opset":
        manifest = manifest.with_(opset=99)
    elif failure == "load":
        data = b"not an onnx model" * 10
        manifest = manifest.with_(sha256=sha256_bytes(data))
    elif failure == "manifest":  # the manifest of another model: its input is not this graph's
        manifest = manifest.with_(inputs=(TensorSpec("pixels", ("batch", 1, 8, 8)),))
    elif failure == "canary-nonfinite":
        data = _nan_model()
        manifest = manifest.with_(sha256=sha256_bytes(data))
        canary = Canary(np.zeros((4, 1, 8, 8), np.float32))
    else:
        wrong = (digits_test[1][:64] + 1) % 10  # labels the model must get wrong
        canary = Canary(digits_test[0][:64], wrong, min_accuracy=0.5)
    result = server.swap(data, manifest, version="bad", canary=canary)
    reason = failure.split("-")[0]
    assert not result.ok and result.reason == reason and result.message
    assert server.version == "r3" and result.version == "r3"
    assert server.failed_swaps == {reason: 1}
    assert server.predict(digits_test[0][:2]).shape == (2, 10)  # still serving


def test_good_canary_passes_and_reports_accuracy(variants, digits_test):
    server = ModelServer()
    canary = Canary(digits_test[0][:100], digits_test[1][:100], min_accuracy=0.8)
    result = server.load(variants["int8-static"][0], canary=canary)
    assert result.ok and result.canary_accuracy >= 0.8


def test_predict_before_load_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no model loaded"):
        ModelServer().predict(np.zeros((1, 1, 8, 8), np.float32))
    assert onnx  # onnx is used above only to build the NaN model


def test_a_canary_set_that_cannot_judge_a_model_is_refused_when_it_is_made(tmp_path):
    """An empty set's accuracy was NaN, which passed any bound; labels of another count (or one-hot ones)
    raised inside swap(), and an agent with such a canary never served (inference sweep)."""
    from fedge.config import ConfigError
    from fedge.inference.agent_config import read_canary

    rows = np.zeros((4, 1, 8, 8), np.float32)
    for inputs, labels, message in [
        (rows[:0], None, "holds no inputs"),
        (rows, np.arange(3), "4 inputs and 3 labels"),
        (rows, np.eye(4, dtype=np.int64), "one class number per input"),
        (rows, np.full(4, 0.5, np.float32), "one class number per input"),
    ]:
        with pytest.raises(ValueError, match=message):
            Canary(inputs, labels, 0.5)
        path = tmp_path / "canary.npz"
        np.savez(path, inputs=inputs, **({} if labels is None else {"labels": labels}))
        with pytest.raises(ConfigError, match=message):
            read_canary(str(path), 0.5)
    assert Canary(rows, np.arange(4.0), 0.5).labels is not None  # whole numbers stored as floats are classes
    np.save(tmp_path / "rows.npy", rows)  # one array named like an archive: a TypeError traceback (CLI sweep)
    (tmp_path / "rows.npy").rename(tmp_path / "rows.npz")
    with pytest.raises(ConfigError, match=r"rows\.npz cannot be read: not an \.npz archive"):
        read_canary(str(tmp_path / "rows.npz"), 0.5)
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"empty\.npz cannot be read"):
        read_canary(str(tmp_path / "empty.npz"), 0.5)


def test_a_labelled_canary_refuses_a_model_without_class_scores_and_the_old_one_serves(
    variants, digits_test, tmp_path
):
    """A regressor's (N,) output scored against class labels raised numpy's AxisError inside swap()."""
    import torch

    from fedge.server.export import export_onnx

    regressor = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 1), torch.nn.Flatten(0)).eval()
    path = tmp_path / "regressor.onnx"
    manifest = export_onnx(regressor, digits_test[0][:2], path)
    server = ModelServer(warmup_runs=1)
    assert server.load(variants["fp32"][0]).ok
    canary = Canary(digits_test[0][:16], np.asarray(digits_test[1][:16]), min_accuracy=0.5)
    result = server.swap(path.read_bytes(), manifest, version="reg", canary=canary)
    assert not result.ok and result.reason == "canary" and "not class scores" in result.message
    assert server.predict(digits_test[0][:2]).shape == (2, 10)  # the old model still serves


def test_a_version_whose_install_raised_is_tried_again_when_republished(tmp_path):
    """The installer marked a version's fp32 as received before installing it: when the install raised
    (a malformed manifest extra, then), the corrected version republished was ignored for good."""
    from fedge.inference.agent_config import InferenceAgentConfig
    from fedge.inference.installer import ModelInstaller
    from fedge.transport.config import MqttConfig

    config = InferenceAgentConfig(node_id="d", mqtt=MqttConfig(), model_dir=str(tmp_path))
    installer = ModelInstaller(config, ModelServer(), group=None, canary=None, on_installed=lambda: None)
    calls = []

    class _Collector:  # fails the first version it is given, then waits for more variants
        def add(self, variant, version, data, manifest):
            calls.append(version)
            if len(calls) == 1:
                raise TypeError("a malformed manifest")
            return None

    installer.collector = _Collector()
    with pytest.raises(TypeError):
        installer._add_variant("fp32", "v1", None, b"", 0.0)
    installer._add_variant("fp32", "v1", None, b"", 0.0)  # republished: tried again
    installer._add_variant("fp32", "v1", None, b"", 0.0)  # a duplicate of one that arrived: dropped
    assert calls == ["v1", "v1"]


def test_requests_of_no_rows_or_without_the_models_inputs_are_refused_in_one_line(variants, digits_test):
    """Over MQTT a wrong .npz key got ONNX Runtime's raw error, and a request of 0 rows was answered []
    where fedge predict refuses both (inference sweep)."""
    server = ModelServer(warmup_runs=1)
    assert server.load(variants["fp32"][0]).ok
    with pytest.raises(InputError, match=r"takes inputs \['input'\]; the request lacks \['input'\]"):
        server.run_named({"x": digits_test[0][:2]})
    with pytest.raises(InputError, match="the request holds no rows"):
        server.run_named({"input": digits_test[0][:0]})
    with pytest.raises(InputError, match="the request holds no rows"):
        server.predict(digits_test[0][:0])
    # a name the graph does not declare is left out, as session_feed leaves it
    outputs, _ = server.run_named({"input": digits_test[0][:2], "unused": np.zeros(2)})
    assert next(iter(outputs.values())).shape == (2, 10)
