"""Bench: every fedge.compression codec on a heavy-tailed 25M vector and on real model deltas.

For each codec: payload bytes, ratio vs dense fp32, bits per nonzero spent on positions vs the entropy
bound H(p)/p, encode / decode / decode_add throughput (MB/s of dense float32 input) and relative error
‖x − x̂‖/‖x‖. The baseline, timed in the same run, is the common top-k: ``torch.topk`` on |x|, sent as
int32 indices plus fp32 values. Timings are the best of several interleaved repeats (shared machine).

Run: ``fedge bench compression [--json] [--quick]`` (quick: a 4M vector, fewer repeats).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fedge.bench._common import emit, parse_args, peak_rss_bytes
from fedge.compression import (
    build_codec,
    decode,
    decode_add,
    dense_nbytes,
    inspect_payload,
    position_bound_bits,
)

HEADLINE_SPEC = "topk:0.01+int8"
SYNTHETIC_SPECS = [
    "dense",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "qsgd:8",
    "qsgd:4",
    "qsgd:2",
    "qsgd:1",
    "sign",
    "topk:0.01",
    HEADLINE_SPEC,
    "topk:0.01,mode=exact+int8",
    "topk:0.001+int8",
    "stc:0.01",
    "randk:0.01+int8",
    "threshold:{t}+int8",  # t: the 99th percentile of |x|, so about 1 % survives
    "powersgd:4",
]
DELTA_SPECS = ["fp16", "int8", "qsgd:4", "sign", "topk:0.01+int8", "topk:0.1+int8", "stc:0.01", "powersgd:2"]


def _best(repeats: int, *steps: Callable[[], Any]) -> list[float]:
    """Best wall time of each step over ``repeats`` rounds, steps interleaved within a round."""
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            step()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _relative_error(original: dict[str, np.ndarray], decoded: dict[str, np.ndarray]) -> float:
    num = sum(float(np.sum((decoded[k].astype(np.float64) - original[k]) ** 2)) for k in original)
    den = sum(float(np.sum(original[k].astype(np.float64) ** 2)) for k in original)
    return (num / den) ** 0.5


def _measure(spec: str, tensors: dict[str, np.ndarray], repeats: int) -> dict[str, Any]:
    codec = build_codec(spec)
    payload = codec.encode(tensors, seed=1)
    dense = dense_nbytes(tensors)
    sums = {name: np.zeros(np.shape(array), dtype=np.float32) for name, array in tensors.items()}
    encode_s, decode_s, add_s = _best(
        repeats,
        lambda: codec.encode(tensors, seed=1),
        lambda: decode(payload),
        lambda: decode_add(payload, sums),
    )
    info = inspect_payload(payload)
    nnz = sum(t.nnz for t in info.tensors if t.kind == "sparse")
    sparse_n = sum(int(np.prod(t.shape)) for t in info.tensors if t.kind == "sparse")
    position_bits = 8 * sum(t.position_bytes for t in info.tensors if t.kind == "sparse") / max(nnz, 1)
    bound = position_bound_bits(nnz, sparse_n) if nnz else 0.0
    mb = dense / 1e6
    return {
        "codec": spec,
        "bytes": len(payload),
        "ratio": dense / len(payload),
        "pos_bits": position_bits if nnz else None,
        "bound": bound if nnz else None,
        "over_bound": position_bits / bound if nnz and bound else None,
        "enc_MBps": mb / encode_s,
        "dec_MBps": mb / decode_s,
        "add_MBps": mb / add_s,
        "encode_ms": 1e3 * encode_s,
        "decode_ms": 1e3 * decode_s,
        "add_ms": 1e3 * add_s,
        "rel_err": _relative_error(tensors, decode(payload)),
    }


def _torch_topk_baseline(x: np.ndarray, density: float, repeats: int) -> dict[str, Any]:
    """The common implementation: torch.topk on |x|, int32 indices + fp32 values as raw bytes."""
    import torch

    flat = torch.from_numpy(x.reshape(-1))
    k = int(np.ceil(density * flat.numel()))

    def encode() -> bytes:
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return indices.to(torch.int32).numpy().tobytes() + flat[indices].numpy().tobytes()

    payload = encode()
    (encode_s,) = _best(repeats, encode)
    return {
        "codec": f"torch.topk:{density} int32+fp32",
        "bytes": len(payload),
        "encode_ms": 1e3 * encode_s,
        "ratio": 4 * x.size / len(payload),
        "enc_MBps": 4 * x.size / 1e6 / encode_s,
    }


def _digits_delta() -> dict[str, np.ndarray]:
    """One local epoch of the reference task on one client's non-IID partition: new minus old weights."""
    import torch

    from fedge.app.task import DigitsTask, TrainConfig

    task = DigitsTask()
    torch.manual_seed(0)
    model = task.model()
    before = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    task.train(model, task.load_partition(0, 4, alpha=0.5, seed=0), TrainConfig(epochs=1))
    return {k: v.detach().numpy() - before[k] for k, v in model.state_dict().items()}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n = 4_000_000 if args.quick else 25_000_000
    side = int(np.sqrt(n))
    repeats, headline_repeats = (2, 5) if args.quick else (2, 9)
    os.environ.setdefault("COLUMNS", "160")  # the table is wide; rich falls back to 80 columns off a TTY
    x = np.random.default_rng(0).standard_t(3, n).astype(np.float32)
    synthetic = {"w": x.reshape(side, n // side)}
    threshold = float(np.quantile(np.abs(x[:: max(1, n // 1_000_000)]), 0.99))

    rows = []
    for spec in SYNTHETIC_SPECS:
        spec = spec.format(t=f"{threshold:.4f}")
        row = _measure(
            spec, synthetic, headline_repeats if spec in (HEADLINE_SPEC, "topk:0.001+int8") else repeats
        )
        rows.append({"data": f"student-t {n / 1e6:g}M", **row})
    baseline = _torch_topk_baseline(x, 0.01, headline_repeats)
    rows.append({"data": f"student-t {n / 1e6:g}M", **baseline})

    delta = _digits_delta()
    for spec in DELTA_SPECS:
        rows.append({"data": "digits delta", **_measure(spec, delta, repeats)})

    by_codec = {row["codec"]: row for row in rows if row["data"] != "digits delta"}
    ours = by_codec[HEADLINE_SPEC]
    headline = {
        "position_bits_over_bound_1pct": ours["over_bound"],
        "position_bits_over_bound_0_1pct": by_codec["topk:0.001+int8"]["over_bound"],
        "topk_1pct_int8_ratio": ours["ratio"],
        "encode_speedup_vs_torch_topk": baseline["encode_ms"] / ours["encode_ms"],
        "decode_speed_over_encode": ours["encode_ms"] / ours["decode_ms"],
        "decode_add_speed_over_encode": ours["encode_ms"] / ours["add_ms"],
        "torch_topk_ratio": baseline["ratio"],
        "stc_1pct_ratio": by_codec["stc:0.01"]["ratio"],
        "vector_elements": n,
    }
    result = {
        "headline": headline,
        "rows": rows,
        "digits_delta_elements": sum(v.size for v in delta.values()),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    columns = [
        "data",
        "codec",
        "bytes",
        "ratio",
        "pos_bits",
        "over_bound",
        "enc_MBps",
        "dec_MBps",
        "add_MBps",
        "rel_err",
    ]
    table = [{key: row.get(key) for key in columns} for row in rows]
    emit(result, as_json=args.json, title="fedge.compression", rows=table)


if __name__ == "__main__":
    main()
