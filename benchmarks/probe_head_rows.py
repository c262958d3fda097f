"""The loss head's chunk size inside a whole training step, on the GPU: does a longer chunk pay, and what peak.

With a weight gradient (full fine-tuning) the head runs in chunks of C = H rows (896 at Qwen2.5-0.5B): each
chunk's dW GEMM (K = C) adds into an fp32 (V, H) accumulator, 19 read-modify-writes of 544 MB a step. In the
graphed full profile that `badd` GEMM runs 9.65 ms a step for 6.4 ms of math (21ced11). C = 2H halves the
accumulator traffic for C x V x 2 B more workspace (+0.25 GiB, and dW no longer lives in the workspace: +0.25
GiB more), which only shows in the step's peak if the step peaks in the head. Without a weight gradient (LoRA)
the workspace is 256 MB (862 rows): its two GEMMs already run at the measured peak, so a larger one is timed to
confirm that, not expected to gain.

Runs one bench contender row in this process with the head's chunk rule replaced:

    PYTHONPATH=src python3 benchmarks/probe_head_rows.py --contender chronicals-full-graphs --dw-rows-mult 2
    PYTHONPATH=src python3 benchmarks/probe_head_rows.py --contender chronicals-lora-graphs --workspace-mb 512
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from chronicals.bench.protocol import RunSpec
from chronicals.bench.shapes import get_shape
from chronicals.bench.worker import run_contender
from chronicals.ops import cross_entropy as ce


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contender", required=True)
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--dw-rows-mult", type=float, default=1.0, help="C = mult x H with a weight gradient")
    ap.add_argument("--workspace-mb", type=int, default=ce.WORKSPACE_BYTES >> 20, help="without a weight gradient")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    seen = []

    def rows(n, h, v, need_dw, elt_bytes, vocab_parts=1):
        r = int(h * args.dw_rows_mult) if need_dw else (args.workspace_mb << 20) // (v * elt_bytes)
        r = max(1, min(n, max(ce.MIN_CHUNK_ROWS, r - r % 8)))
        seen.append((n, need_dw, r))
        return r

    ce.default_chunk_rows = rows  # read through the module global by linear_cross_entropy_triton
    sh = get_shape(args.shape)  # its own rows x seq, not RunSpec's 0.5B defaults (a bench walk)
    row = run_contender(RunSpec(args.contender, shape=args.shape, warmup=args.warmup, steps=args.steps,
                                 device=args.device, rows=sh.rows, seq=sh.seq))
    row.update(dw_rows_mult=args.dw_rows_mult, workspace_mb=args.workspace_mb, head_chunks=sorted(set(seen)))
    keep = ("contender", "status", "reason", "tokens_per_s", "step_ms", "peak_gib", "graph_pool_gib",
            "min_grad_norm", "dw_rows_mult", "workspace_mb", "head_chunks")
    losses = row.get("losses") or [None]
    print(json.dumps({**{k: row.get(k) for k in keep}, "loss_first": losses[0], "loss_last": losses[-1]}), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(row, indent=1, default=str))
    return 0 if row.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
