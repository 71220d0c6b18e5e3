"""fedge bench inference: torch eager vs ORT fp32 / static int8 / dynamic int8, chosen by measurement.

Models: the reference CNN (``DigitsCNN``, trained briefly on the digits so accuracy means something) and a
ResNet-18 with random weights (3x224x224; 3x64x64 with ``--quick``). For each: p50/p95 latency at batch 1
and 32, model bytes, accuracy (the CNN's digits test accuracy; for the ResNet, top-1 agreement with fp32
on random inputs), and the variant :func:`fedge.inference.select_variant` serves. Then the hot-swap test
(a client at 100 requests/s while 20 swaps happen, in process) and the RSS of a torch-free serving process.

Headline: ``ort_speedup_vs_torch_batch1`` (CNN), ``int8_size_ratio`` (ResNet), ``int8_accuracy_drop_pp``
(CNN), ``served_variant_never_slower``, ``swap_failed_requests``, ``swap_pause_p99_ms``,
``infer_agent_rss_mb`` (RSS minus model bytes) and ``infer_install_mb`` (``pip download`` of the ``infer``
extra's closure; skipped with ``--quick``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedge.app.digits import digits_split
from fedge.app.task import DigitsCNN
from fedge.bench._common import emit, parse_args, timed
from fedge.inference import ModelServer, measure_variants, read_manifest, select_variant
from fedge.inference.session import available_cpus
from fedge.server.export import export_variants

INFER_EXTRA = ["onnxruntime==1.32.0", "numpy", "paho-mqtt"]


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


def _swap_test(paths: list[Path], swaps: int = 20, rate_hz: float = 100.0) -> dict:
    """A client at ``rate_hz`` while ``swaps`` swaps alternate between ``paths``; extra latency in swaps."""
    server = ModelServer()
    server.load(paths[0])
    models = [(p.read_bytes(), read_manifest(p)) for p in paths]
    sample = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
    records: list[tuple[float, float, bool]] = []
    stop = threading.Event()

    def client() -> None:
        tick = time.perf_counter()
        while not stop.is_set():
            start = time.perf_counter()
            try:
                server.predict(sample)
                ok = True
            except Exception:
                ok = False
            records.append((start, time.perf_counter() - start, ok))
            tick += 1 / rate_hz
            stop.wait(max(0.0, tick - time.perf_counter()))  # pacing the client, not waiting for a result

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    while len(records) < 100:  # one second of baseline requests
        stop.wait(0.01)
    windows, results = [], []
    for i in range(swaps):
        start = time.perf_counter()
        results.append(server.swap(*models[(i + 1) % len(models)], version=f"v{i + 1}"))
        windows.append((start, time.perf_counter()))
        stop.wait(0.05)
    count = len(records)
    while len(records) < count + 20:
        stop.wait(0.01)
    stop.set()
    thread.join()
    baseline = np.asarray([lat for s, lat, _ in records if s < windows[0][0]])
    during = np.asarray([lat for s, lat, _ in records if any(a <= s + lat and s <= b for a, b in windows)])
    extra = (during - np.median(baseline)) * 1e3 if during.size else np.zeros(1)
    return {
        "requests": len(records),
        "failed_requests": sum(not ok for *_, ok in records),
        "swaps_ok": sum(r.ok for r in results),
        "requests_during_swaps": int(during.size),
        "pause_p99_ms": float(max(0.0, np.percentile(extra, 99))),
        "baseline_p50_ms": float(np.median(baseline) * 1e3),
        "swap_build_ms_p50": float(np.median([r.build_s for r in results]) * 1e3),
        "version": server.version,
    }


_RSS_SCRIPT = """
import sys, time, json
import numpy as np
start = time.perf_counter()
from fedge.inference import ModelServer
server = ModelServer()
server.load(sys.argv[1])
x = np.zeros((1, 1, 8, 8), np.float32)
server.predict(x)
first = time.perf_counter() - start
for _ in range(200):
    server.predict(x)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
kb = lambda key: int(status[key].split()[0])
print(json.dumps({"rss_kb": kb("VmRSS"), "anon_kb": kb("RssAnon"), "file_kb": kb("RssFile"), "first_s": first,
                  "heavy": [m for m in ("torch", "flwr", "onnx") if m in sys.modules]}))
"""


def _rss_test(model_path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(model_path)], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    model_mb = model_path.stat().st_size / 1e6
    return {**data, "model_mb": model_mb, "rss_minus_model_mb": data["rss_kb"] / 1024 - model_mb}


def _install_mb() -> tuple[float | None, str]:
    """Download size of the ``infer`` extra's closure (what a torch-free device fetches)."""
    with tempfile.TemporaryDirectory(prefix="fedge-infer-dl-") as dest:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest, *INFER_EXTRA]
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
        swap = _swap_test([out_dir / "cnn" / "model-fp32.onnx", out_dir / "cnn" / "model-int8-static.onnx"])
        rss = _rss_test(out_dir / "cnn" / "model-fp32.onnx")
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
        "swap_failed_requests": swap["failed_requests"],
        "swap_pause_p99_ms": swap["pause_p99_ms"],
        "swaps_ok": swap["swaps_ok"],
        "infer_agent_rss_mb": rss["rss_minus_model_mb"],
        "infer_agent_anon_rss_mb": rss["anon_kb"] / 1024,
        "infer_agent_first_inference_s": rss["first_s"],
        "infer_agent_imports_torch": bool(rss["heavy"]),
        "infer_install_mb": install_mb,
        "resnet_input": f"3x{side}x{side}",
    }
    result = {
        "bench": "inference",
        "quick": args.quick,
        "headline": headline,
        "swap": swap,
        "rss": rss,
        "install_files": install_files,
        "models": detail,
        "cpus": available_cpus(),
    }
    emit(result, as_json=args.json, title="fedge bench inference", rows=rows)


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    main()
