"""Probe (dev): ``ops.lowrank.lowrank_update_`` (y += alpha x @ w, small K) against cuBLAS's ``y.addmm_`` at the LoRA
step's shapes, over tile configs, with the time y's bytes take at the measured copy bandwidth; and the largest
difference between the two results (both round one fp32 sum of the same bf16 products).

    PYTHONPATH=src python benchmarks/probe_lowrank_update.py [OUT.json]
"""
import json
import sys

import torch

from common import copy_bandwidth_gbs, do_bench, require_cuda

require_cuda(__file__)
from chronicals.ops.lowrank import _launch  # noqa: E402

dev, bf = "cuda", torch.bfloat16
CONFIGS = [(bm, bn, w) for bm, bn in ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128), (64, 256)) for w in (4, 8)]
# (name, M, N, K, y strided): y += x @ w where the LoRA code accumulates a rank term
SHAPES = [("0.5b o_proj / down fwd", 16384, 896, 32, False), ("0.5b down fwd (rows view)", 16384, 896, 32, True),
          ("0.5b q/k/v group dx", 16384, 896, 96, True), ("0.5b gate/up group dx", 16384, 896, 64, True),
          ("8b o_proj fwd / dx", 8192, 4096, 32, False), ("8b q/k/v group dx", 8192, 4096, 96, True),
          ("8b gate/up group dx", 8192, 4096, 64, True)]


def us(fn):
    return round(do_bench(fn, warmup_ms=25, rep_ms=150) * 1e3, 1)


def main():
    gbs = copy_bandwidth_gbs()
    rows = []
    for name, m, n, k, strided in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        y = torch.randn(m, n + k, device=dev, dtype=bf, generator=g)[:, :n] if strided else \
            torch.randn(m, n, device=dev, dtype=bf, generator=g)
        x = torch.randn(m, k, device=dev, dtype=bf, generator=g)
        w = torch.randn(n, k, device=dev, dtype=bf, generator=g).t()  # B^T as LoRA passes it: a transposed view
        row = {"case": name, "m": m, "n": n, "k": k, "strided": strided,
               "floor_us": round(2 * m * n * 2 / gbs / 1e3, 1), "cublas_us": us(lambda: y.addmm_(x, w, alpha=0.5))}
        for bm, bn, nw in CONFIGS:
            row[f"{bm}x{bn}w{nw}"] = us(lambda: _launch(y, x, w, 0.5, bm, bn, nw))
        a, b = y.clone(), y.clone()
        a.addmm_(x, w, alpha=0.5)
        _launch(b, x, w, 0.5)
        row["max_abs_diff"] = float((a.float() - b.float()).abs().max())
        row["bitwise_equal_frac"] = float((a == b).float().mean())
        rows.append(row)
        best = min(CONFIGS, key=lambda c: row[f"{c[0]}x{c[1]}w{c[2]}"])
        print(f"{name:28s} floor {row['floor_us']:6.1f}  cublas {row['cublas_us']:6.1f}  best {best} "
              f"{row[f'{best[0]}x{best[1]}w{best[2]}']:6.1f}  default {row['64x128w4']:6.1f}  "
              f"max|diff| {row['max_abs_diff']:.3g} equal {row['bitwise_equal_frac']:.4f}", flush=True)
    print("us per config (rows: shapes):")
    print(" ".join(f"{bm}x{bn}w{nw}" for bm, bn, nw in CONFIGS))
    for row in rows:
        print(" ".join(f"{row[f'{bm}x{bn}w{nw}']:.1f}" for bm, bn, nw in CONFIGS))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": gbs,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
