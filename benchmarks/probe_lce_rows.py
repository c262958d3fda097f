"""Launch shapes of the loss head's row kernel (``_lce_rows_kernel``) at the Qwen2.5-0.5B head, on the GPU.

The two-pass kernel reads each bf16 logit twice (online softmax, then d_logits) and writes it once: 6 B per logit
(the one-pass kernel of the training forward, 4 B, is timed in the whole head by ab_lce_heads.py).
At the 0.5B protocol it runs 19 times a step on (862, 151,936) chunks: 4.78 ms (a871e6d profile), 251 us a
call, against 185 us for 786 MB at the 4.24 TB/s copy rate measured there. Rows are 304 KB each, so how many
rows are in flight decides whether pass 2 finds its row in L2 (50 MB). This probe times the launch shapes
(rows per program, vocab tile, warps) on the same chunk, checks each against the default's output, and
prints GB/s counted at 6 B per logit.

    PYTHONPATH=src python3 benchmarks/probe_lce_rows.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbs, do_bench, require_cuda, write_results  # noqa: E402

from chronicals.ops._linear_ce_kernels import _lce_rows_kernel  # noqa: E402

VARIANTS = [  # (rows per program, vocab tile, warps); the first is the shipped one
    (1, 4096, 8), (1, 2048, 4), (1, 4096, 4), (1, 8192, 8), (1, 8192, 16), (1, 16384, 16),
    (2, 2048, 8), (2, 4096, 8), (2, 4096, 16), (4, 2048, 8), (4, 2048, 16),
]


def run(rows: int, vocab: int, hidden_std: float = 3.0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    base = (torch.randn(rows, vocab, device=dev, generator=g) * hidden_std).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    labels[::7] = -100
    scale = torch.full((1,), 1.0 / rows, device=dev)
    loss = torch.empty(rows, device=dev)
    lse = torch.empty(rows, device=dev)
    work = torch.empty_like(base)

    def launch(br, bv, nw):
        _lce_rows_kernel[(triton.cdiv(rows, br),)](
            work, work.stride(0), labels, work, scale, 0, loss, lse, lse, 0, 0, rows, vocab, vocab, -100, 1.0,
            HAS_BIAS=False, HAS_SOFTCAP=False, COMPUTE_LSE=True, WRITE_GRAD=True, ONE_PASS=False, BLOCK_R=br,
            BLOCK_V=bv, num_warps=nw)

    out = {}
    ref = None
    for br, bv, nw in VARIANTS:
        work.copy_(base)
        launch(br, bv, nw)
        got = (work.float().clone(), loss.clone())
        if ref is None:
            ref = got
        err = max(float((got[0] - ref[0]).abs().max()), float((got[1] - ref[1]).abs().max()))
        # each timed call rewrites `work` in place: d_logits of d_logits is still a full 6 B/logit pass with
        # finite values (softmax of values in [-1, 1]), so the work per call does not change
        ms = do_bench(lambda: launch(br, bv, nw))
        out[f"{br}x{bv}/w{nw}"] = {"us": ms * 1e3, "gbs": 6 * rows * vocab / ms / 1e6, "max_err_vs_default": err}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    require_cuda(__file__)
    copy = copy_bandwidth_gbs()
    res = {f"{r}x151936": run(r, 151936) for r in (862, 1024)}
    lines = [f"copy bandwidth {copy:.0f} GB/s", "", "| chunk | rows x tile / warps | us | GB/s (6 B/logit) | "
             "max err vs default |", "|---|---|---|---|---|"]
    for shape, rows in res.items():
        for k, v in rows.items():
            lines.append(f"| {shape} | {k} | {v['us']:.1f} | {v['gbs']:.0f} | {v['max_err_vs_default']:.2e} |")
    md = "\n".join(lines)
    print(md)
    sha = __import__("os").environ.get("CHRONICALS_GIT_SHA", "unknown")
    write_results(f"probe_lce_rows_{sha}", {"copy_gbs": copy, "results": res}, md, a.out)


if __name__ == "__main__":
    main()
