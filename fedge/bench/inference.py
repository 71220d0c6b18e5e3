"""fedge bench inference: torch eager vs ORT fp32 / static int8 / dynamic int8, chosen by measurement.

Models: the reference CNN (``DigitsCNN``, trained briefly on the digits so accuracy means something) and a
ResNet-18 with random weights (3x224x224; 3x64x64 with ``--quick``). For each: p50/p95 latency at batch 1
and 32, model bytes, accuracy (the CNN's digits test accuracy; for the ResNet, top-1 agreement with fp32
on random inputs), and the variant :func:`fedge.inference.select_variant` serves. Then the hot-swap test
over a real Mosquitto (a requester at 100 requests/s while the coordinator publishes 20 new versions to a
``fedge serve`` process, one and two replicas, three runs each, the middle one reported;
:mod:`fedge.bench._infer_swap`) and that agent's RSS beside the RSS of a bare ``import numpy, onnxruntime``
(the floor no Python agent can go under) and of a bare process that serves the model with ONNX Runtime
(imports, one session, a run at batch 1 and 32).

Headline: ``ort_speedup_vs_torch_batch1`` (CNN), ``int8_size_ratio`` (ResNet), ``int8_accuracy_drop_pp``
(CNN), ``served_variant_never_slower``, ``swap_failed_requests``, ``swap_pause_p99_ms``,
``infer_agent_rss_mb`` (the agent process's RSS; ``infer_agent_rss_above_runtime_mb`` is what it adds to
the runtime's floor, ``infer_agent_rss_above_serving_floor_mb`` what it adds to a bare ORT process serving
the same model, ``infer_agent_rss_bound_mb`` the model's size + 40) and ``infer_install_mb``
(``pip download`` of the ``infer`` extra's closure; skipped with ``--quick``). Also the bytes of a version
sent as a weights delta of the one before, fp16 and int8 (``delta_bytes_ratio_fp16``: the ResNet's full
fp32 file over its fp16 delta; ``delta_output_diff_fp16``: how far the rebuilt model's outputs are from the
exact ones, relative to their scale).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedge.app.digits import digits_split
from fedge.app.task import DigitsCNN
from fedge.bench._common import emit, parse_args, timed
from fedge.bench._infer_swap import runtime_floor_rss, swap_over_broker
from fedge.inference import measure_variants, select_variant
from fedge.inference.manifest import read_manifest
from fedge.inference.session import available_cpus
from fedge.inference.weights_delta import read_weights, replace_weights
from fedge.server.export import export_onnx, export_variants
from fedge.server.model_delta import DeltaPlanner


def _infer_extra() -> list[str]:
    """The ``infer`` extra's requirements, pinned to the versions installed here (constraints.txt's)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    pinned = []
    for text in metadata.requires("fedge") or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is not None and marker.evaluate({"extra": "infer"}) and not marker.evaluate({"extra": ""}):
            pinned.append(f"{requirement.name}=={metadata.version(requirement.name)}")
    return pinned


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18 as in torchvision (11.7M parameters), defined here: torchvision is not a dependency."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _train_cnn(epochs: int) -> DigitsCNN:
    torch.manual_seed(0)
    model = DigitsCNN()
    features, labels = digits_split("train")
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(epochs):
        order = torch.randperm(len(labels))
        for i in range(0, len(labels), 32):
            rows = order[i : i + 32]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(features[rows]), labels[rows]).backward()
            optimizer.step()
    return model.eval()


def _torch_latency(model: nn.Module, sample: np.ndarray, batch: int, runs: int) -> tuple[float, float]:
    rows = torch.from_numpy(np.resize(sample, (batch, *sample.shape[1:])).astype(np.float32))
    times = []
    with torch.inference_mode():
        for i in range(runs + 3):
            start = time.perf_counter()
            model(rows)
            if i >= 3:
                times.append(time.perf_counter() - start)
    p50, p95 = np.percentile(np.asarray(times) * 1e3, [50, 95])
    return float(p50), float(p95)


def _bench_model(name, model, sample, calibration, labelled, out_dir, runs, batches=(1, 32)) -> dict:
    """Export every variant, measure torch and ORT, select per batch; one result dict for the model."""
    with timed() as t:
        variants = export_variants(
            model, sample[:2], out_dir / name, calibration=calibration, labelled=labelled
        )
    paths = {v: p for v, (p, _) in variants.items()}
    accuracies = {v: m.accuracy for v, (_, m) in variants.items()}
    measured = measure_variants(paths, sample, batches=batches, accuracies=accuracies, runs=runs, warmup=2)
    torch_ms = {b: _torch_latency(model, sample, b, max(3, runs // 2)) for b in batches}
    selections = {b: select_variant(measured, b) for b in batches}
    by_name = {m.variant: m for m in measured}
    fp32 = by_name["fp32"]
    never_slower = True
    for b, sel in selections.items():
        eligible = [
            m
            for m in measured
            if fp32.accuracy is None or (m.accuracy is not None and 100 * (fp32.accuracy - m.accuracy) <= 1.0)
        ]
        served = by_name[sel.variant].latency_ms[b][0]
        # Never slower than fp32, and within 5 % (select_variant's tie margin) of the fastest eligible.
        never_slower &= served <= fp32.latency_ms[b][0] and served <= 1.05 * min(
            m.latency_ms[b][0] for m in eligible
        )
    return {
        "export_s": t["wall_s"],
        "torch_ms": torch_ms,
        "variants": measured,
        "selected": {b: s.variant for b, s in selections.items()},
        "reasons": {b: s.reason for b, s in selections.items()},
        "never_slower": never_slower,
    }


def _other_weights(model: nn.Module, sample: np.ndarray, out_dir: Path) -> Path:
    """An fp32 export of ``model`` with perturbed weights: a second model version of the same graph."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.01 * torch.randn_like(param))
    path = out_dir / "model.onnx"
    export_onnx(other, sample[:2], path, version="b")
    return path


def _delta_figures(path: Path, step: float) -> dict:
    """Bytes of a version sent as a weights delta of the one before (:mod:`fedge.server.model_delta`).

    The next version is ``path``'s model with every weight moved by ``step`` times a standard normal draw
    (a training round's change, in size), written into the file directly.
    """
    data, manifest = path.read_bytes(), read_manifest(path)
    rng = np.random.default_rng(0)
    moved = {k: w + step * rng.standard_normal(w.shape, np.float32) for k, w in read_weights(data).items()}
    following = replace_weights(data, moved)
    figures = {"full_bytes": len(data)}
    for codec in ("fp16", "int8"):
        planner = DeltaPlanner(codec, max_output_diff=1.0)  # measure, do not fall back
        planner.plan("v1", data, manifest)
        plan = planner.plan("v2", following, manifest)
        assert plan.delta is not None
        figures[codec] = {
            "delta_bytes": len(plan.delta.payload),
            "bytes_ratio": len(data) / len(plan.delta.payload),
            "output_diff": plan.manifest.extra["output_diff_vs_export"],
            "within_bound": plan.manifest.extra["output_diff_vs_export"] <= 1e-4,
        }
    return figures


def _middle_run(runs: list[dict]) -> dict:
    """The run whose swap pause is the median of ``runs`` (an odd number of them)."""
    return sorted(runs, key=lambda r: r["pause_p99_ms"])[len(runs) // 2]


def _install_mb() -> tuple[float | None, str]:
    """Download size of the ``infer`` extra's closure (what a torch-free device fetches)."""
    with tempfile.TemporaryDirectory(prefix="fedge-infer-dl-") as dest:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest, *_infer_extra()]
        try:
            subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
        except (subprocess.SubprocessError, OSError) as err:
            return None, f"pip download failed: {err}"
        files = list(Path(dest).iterdir())
        return sum(f.stat().st_size for f in files) / 1e6, ", ".join(sorted(f.name for f in files))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(available_cpus())  # torch and ORT get the same cores
    runs = 30 if args.quick else 60
    side = 64 if args.quick else 224
    out_dir = Path(tempfile.mkdtemp(prefix="fedge-bench-inference-"))
    try:
        cnn = _train_cnn(5 if args.quick else 15)
        train_x, _ = digits_split("train")
        test_x, test_y = (t.numpy() for t in digits_split("test"))
        results = {
            "cnn": _bench_model("cnn", cnn, test_x, train_x[:256].numpy(), (test_x, test_y), out_dir, runs)
        }
        rng = np.random.default_rng(0)
        resnet = ResNet18().eval()
        images = rng.standard_normal((48, 3, side, side), dtype=np.float32)
        with torch.no_grad():  # random weights: "accuracy" is top-1 agreement with the torch model
            agree = resnet(torch.from_numpy(images[32:])).argmax(1).numpy()
        results["resnet18"] = _bench_model(
            "resnet18", resnet, images[32:], images[:32], (images[32:], agree), out_dir, max(6, runs // 10)
        )
        cnn_fp32 = out_dir / "cnn" / "model-fp32.onnx"
        deltas = {
            "cnn": _delta_figures(cnn_fp32, 1e-3),
            "resnet18": _delta_figures(out_dir / "resnet18" / "model-fp32.onnx", 1e-4),
        }
        versions = [cnn_fp32, _other_weights(cnn, test_x, out_dir / "cnn-b")]
        # One run's p99 over the 15-45 requests in flight during its swaps is nearly their maximum, and one
        # stray delay moves it by milliseconds: the full bench runs the 20-swap test three times for each
        # setting and reports the run in the middle (every run's figure is in the JSON).
        repeats = 1 if args.quick else 3
        swap_runs = [swap_over_broker(versions, replicas=1) for _ in range(repeats)]
        swap2_runs = [swap_over_broker(versions, replicas=2) for _ in range(repeats)]
        swap, swap2 = _middle_run(swap_runs), _middle_run(swap2_runs)
        model_mb = cnn_fp32.stat().st_size / 1e6
        floor_mb = runtime_floor_rss()
        serving_floor_mb = runtime_floor_rss(cnn_fp32)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    install_mb, install_files = _install_mb() if not args.quick else (None, "skipped with --quick")

    rows, detail = [], {}
    for name, res in results.items():
        by = {m.variant: m for m in res["variants"]}
        for batch in (1, 32):
            rows.append(
                {
                    "model": name,
                    "runtime": "torch eager",
                    "batch": batch,
                    "p50_ms": res["torch_ms"][batch][0],
                    "p95_ms": res["torch_ms"][batch][1],
                    "MB": by["fp32"].size_bytes / 1e6,
                    "accuracy": "",
                    "served": "",
                }
            )
            for m in res["variants"]:
                rows.append(
                    {
                        "model": name,
                        "runtime": f"ORT {m.variant}",
                        "batch": batch,
                        "p50_ms": m.latency_ms[batch][0],
                        "p95_ms": m.latency_ms[batch][1],
                        "MB": m.size_bytes / 1e6,
                        "accuracy": m.accuracy,
                        "served": "yes" if res["selected"][batch] == m.variant else "",
                    }
                )
        detail[name] = {
            "selected": res["selected"],
            "reasons": res["reasons"],
            "export_s": res["export_s"],
            "variants": {
                m.variant: {"bytes": m.size_bytes, "accuracy": m.accuracy, "latency_ms": m.latency_ms}
                for m in res["variants"]
            },
            "torch_ms": res["torch_ms"],
        }
    cnn_by = {m.variant: m for m in results["cnn"]["variants"]}
    res_by = {m.variant: m for m in results["resnet18"]["variants"]}
    headline = {
        "ort_speedup_vs_torch_batch1": results["cnn"]["torch_ms"][1][0] / cnn_by["fp32"].latency_ms[1][0],
        "ort_speedup_vs_torch_batch1_resnet18": results["resnet18"]["torch_ms"][1][0]
        / res_by["fp32"].latency_ms[1][0],
        "int8_size_ratio": res_by["fp32"].size_bytes / res_by["int8-static"].size_bytes,
        "int8_speedup_resnet18_batch1": res_by["fp32"].latency_ms[1][0]
        / res_by["int8-static"].latency_ms[1][0],
        "int8_accuracy_drop_pp": 100 * (cnn_by["fp32"].accuracy - cnn_by["int8-static"].accuracy),
        "cnn_accuracy_fp32": cnn_by["fp32"].accuracy,
        "served_variant_never_slower": all(r["never_slower"] for r in results.values()),
        "served": {name: r["selected"] for name, r in results.items()},
        "swap_failed_requests": sum(r["failed_requests"] for r in swap_runs + swap2_runs),
        "swap_pause_p99_ms": swap["pause_p99_ms"],
        "swap_pause_p99_ms_two_replicas": swap2["pause_p99_ms"],
        "swap_pause_p99_ms_runs": [r["pause_p99_ms"] for r in swap_runs],
        "swap_pause_p99_ms_two_replicas_runs": [r["pause_p99_ms"] for r in swap2_runs],
        "swap_pause_null_control_ms": max(r["null_pause_p99_ms"] for r in swap_runs + swap2_runs),
        "swap_with_transfer_pause_p99_ms": swap["with_transfer_pause_p99_ms"],
        "swap_latency_p99_ms": swap["latency_p99_ms"],
        "swaps_ok": min(r["swaps_ok"] for r in swap_runs + swap2_runs),
        "swap_requests": sum(r["requests"] for r in swap_runs + swap2_runs),
        "swap_requests_during_swaps": sum(r["requests_during_swaps"] for r in swap_runs + swap2_runs),
        "infer_agent_rss_mb": swap["agent_rss_mb"],
        "infer_agent_rss_mb_two_replicas": swap2["agent_rss_mb"],
        "infer_runtime_floor_rss_mb": floor_mb,
        "infer_agent_rss_above_runtime_mb": swap["agent_rss_mb"] - floor_mb,
        "infer_serving_floor_rss_mb": serving_floor_mb,
        "infer_agent_rss_above_serving_floor_mb": swap["agent_rss_mb"] - serving_floor_mb,
        "infer_agent_rss_bound_mb": model_mb + 40,
        "infer_agent_loaded_torch": swap["agent_loaded_torch"],
        "infer_install_mb": install_mb,
        "delta_bytes_ratio_fp16": deltas["resnet18"]["fp16"]["bytes_ratio"],
        "delta_output_diff_fp16": max(d["fp16"]["output_diff"] for d in deltas.values()),
        "resnet_input": f"3x{side}x{side}",
    }
    result = {
        "bench": "inference",
        "quick": args.quick,
        "headline": headline,
        "swap": swap,
        "swap_two_replicas": swap2,
        "swap_runs": swap_runs,
        "swap_two_replicas_runs": swap2_runs,
        "install_files": install_files,
        "deltas": deltas,
        "models": detail,
        "cpus": available_cpus(),
    }
    emit(result, as_json=args.json, title="fedge bench inference", rows=rows)


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    main()
