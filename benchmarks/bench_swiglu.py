"""SwiGLU forward / backward / both: chronicals Triton vs torch eager, torch.compile and Liger-Kernel (bf16).

    PYTHONPATH=src python benchmarks/bench_swiglu.py --out DIR

Shapes: Qwen2.5-0.5B (16,384 tokens x intermediate 4864) and Llama-3-8B (8,192 tokens x 14336).
Bytes that must move (bf16): forward 3NI (read gate, up; write y), backward 5NI (read gate, up, dy; write
dgate, dup). Correctness against float64 is checked on the GPU before anything is timed.
"""

from __future__ import annotations

import argparse

import torch

from bench_rms_norm import GRAPH_NOTE, check_close, finish, liger, require_cuda, run_table
from common import copy_bandwidth_gbs

SHAPES = {"qwen2.5-0.5b": (16384, 4864), "llama-3-8b": (8192, 14336)}  # (tokens, intermediate)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    args = ap.parse_args()
    require_cuda()
    from chronicals.ops import swiglu, swiglu_ref

    liger_fn, note = liger("liger_kernel.ops.swiglu.LigerSiLUMulFunction")
    notes = [note] if note else []
    copy_gbs = copy_bandwidth_gbs()
    compiled = torch.compile(swiglu_ref, dynamic=False)
    cases = []
    for shape, (n, i) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        gate = (2 * torch.randn(n, i, device="cuda", generator=g)).bfloat16()
        up = torch.randn(n, i, device="cuda", generator=g).bfloat16()
        dy = torch.randn(n, i, device="cuda", generator=g).bfloat16()

        def ours(a, b):
            return swiglu(a, b, impl="triton")

        check_close(f"swiglu {shape}", ours, swiglu_ref, [gate, up], [dy])
        fns = {"chronicals": ours, "torch": swiglu_ref, "torch.compile": compiled}
        if liger_fn is not None:
            fns["liger"] = liger_fn.apply
        nb = n * i * 2
        cases.append((shape, "swiglu", fns, [gate, up], [dy], {"fwd": 3 * nb, "bwd": 5 * nb, "both": 8 * nb}))
    rows = run_table(cases, copy_gbs)
    notes.append("bytes: fwd 3NI, bwd 5NI (bf16)")
    notes.append(GRAPH_NOTE)
    finish("bench_swiglu", rows, copy_gbs, notes, args.out)


if __name__ == "__main__":
    main()
