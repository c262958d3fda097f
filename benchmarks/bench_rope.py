"""QK-RoPE forward / backward / both: chronicals Triton vs torch eager, torch.compile and Liger-Kernel (bf16).

    PYTHONPATH=src python benchmarks/bench_rope.py --out DIR

Shapes: Qwen2.5-0.5B (16 x 1024 tokens, 14 query / 2 key heads of 64) and Llama-3-8B (8 x 1024 tokens,
32 / 8 heads of 128); q (B, S, Hq, D) and k (B, S, Hk, D) as the projections produce them, cos/sin
(B, S, D) from per-token positions (packed rows: positions restart every 256 tokens).
Bytes that must move (bf16): q and k read once and written once, in each direction: 2 x N x (Hq + Hk) x D x 2;
cos/sin (another N x D x 2 x 2) are not counted. Liger takes q/k as (B, H, S, D): we pass transposed views
of the same tensors, which is what Hugging Face models hand it.
"""

from __future__ import annotations

import argparse

import torch

from bench_rms_norm import GRAPH_NOTE, check_close, finish, liger, require_cuda, run_table
from common import copy_bandwidth_gbs

SHAPES = {"qwen2.5-0.5b": (16, 1024, 14, 2, 64), "llama-3-8b": (8, 1024, 32, 8, 128)}  # (B, S, Hq, Hk, D)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    args = ap.parse_args()
    require_cuda()
    from chronicals.ops import rope_cos_sin, rope_qk, rope_qk_ref

    liger_fn, note = liger("liger_kernel.ops.rope.LigerRopeFunction")
    notes = [note] if note else []
    copy_gbs = copy_bandwidth_gbs()
    compiled = torch.compile(rope_qk_ref, dynamic=False)
    cases = []
    for shape, (b, s, hq, hk, d) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, s, hk, d, device="cuda", generator=g).bfloat16()
        dq = torch.randn(b, s, hq, d, device="cuda", generator=g).bfloat16()
        dk = torch.randn(b, s, hk, d, device="cuda", generator=g).bfloat16()
        pos = (torch.arange(s, device="cuda") % 256).repeat(b, 1)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
        cos, sin = rope_cos_sin(pos, inv_freq, dtype=torch.bfloat16)

        # cos/sin are bound as default arguments: the closures run after this loop ends (in run_table), and
        # late-bound names would hand the last shape's (8, 1024, 128) cos to the 0.5B q of batch 16
        def ours(q_, k_, cos=cos, sin=sin):
            return rope_qk(q_, k_, cos, sin, impl="triton")

        def ref(q_, k_, cos=cos, sin=sin):
            return rope_qk_ref(q_, k_, cos.to(q_.dtype), sin.to(q_.dtype))

        def torch_compiled(q_, k_, cos=cos, sin=sin):
            return compiled(q_, k_, cos, sin)

        check_close(f"rope_qk {shape}", ours, ref, [q, k], [dq, dk])
        fns = {"chronicals": ours, "torch": ref, "torch.compile": torch_compiled}
        if liger_fn is not None:
            def liger_rope(q_, k_, cos=cos, sin=sin):
                qo, ko = liger_fn.apply(q_.transpose(1, 2), k_.transpose(1, 2), cos, sin)
                return qo.transpose(1, 2), ko.transpose(1, 2)
            fns["liger"] = liger_rope
        nb = 2 * b * s * (hq + hk) * d * 2
        cases.append((shape, "rope_qk", fns, [q, k], [dq, dk], {"fwd": nb, "bwd": nb, "both": 2 * nb}))
    rows = run_table(cases, copy_gbs)
    notes.append("bytes: q and k read + written once per direction (bf16); cos/sin not counted")
    notes.append(GRAPH_NOTE)
    finish("bench_rope", rows, copy_gbs, notes, args.out)


if __name__ == "__main__":
    main()
