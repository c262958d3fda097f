"""Our loss head alone, forward + backward, at the protocol heads: for A/B runs of two source trees in one call.

Imports ``chronicals`` from PYTHONPATH (so `PYTHONPATH=src` and `PYTHONPATH=<old tree>/src` time two versions on
the same machine), checks ours against fp32-GEMM logits with the bf16 materialized path's error as the yardstick
(``bench_linear_cross_entropy.check``), then times reduction "mean" at the 0.5B head with both gradients and with a
frozen weight (the LoRA case), and at the 8B head. Rows: ms (do_bench median), x the 3-GEMM floor at the bf16
peak measured in the same process, extra peak GiB.

    PYTHONPATH=src python3 benchmarks/ab_lce_heads.py --tag new [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear_cross_entropy import HEADS, check, inputs, measure  # noqa: E402
from common import markdown_table, matmul_peak_tflops, require_cuda, write_results  # noqa: E402

import chronicals  # noqa: E402
from chronicals.ops.cross_entropy import linear_cross_entropy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)
    peak = matmul_peak_tflops()
    rows = []
    chk, ok = check(*HEADS["0.5b"])
    print(f"[{args.tag}] chronicals from {Path(chronicals.__file__).parent}; check {'ok' if ok else 'FAILED'}: {chk}")

    def ours(a, b, c):
        return linear_cross_entropy(a, b, c, impl="triton")

    for head, frozen in (("0.5b", False), ("0.5b", True), ("8b", False)):
        n, h, v = HEADS[head]
        x, w, y = inputs(n, h, v)
        if frozen:
            w.requires_grad_(False)
        floor_ms = (2 if frozen else 3) * 2 * n * h * v / peak / 1e9  # no dW GEMM for a frozen weight
        r = {"tag": args.tag, "head": head + (" frozen W" if frozen else ""),
             **measure("chronicals", ours, x, w, y, floor_ms, wrt=[x] if frozen else None)}
        print(r, flush=True)
        rows.append(r)
        del x, w, y
        torch.cuda.empty_cache()
    md = (f"[{args.tag}] bf16 peak {peak:.0f} TFLOP/s, check {'ok' if ok else 'FAILED'}\n\n"
          + markdown_table(rows, ["tag", "head", "ms", "x floor", "extra GiB", "error"]))
    print(md)
    write_results(f"ab_lce_heads_{args.tag}", {"peak_tflops": peak, "check": chk, "check_ok": ok, "rows": rows}, md,
                  out_dir=args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
