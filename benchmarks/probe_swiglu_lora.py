"""Probe (GPU): the rank-fused SwiGLU kernels (ops.swiglu_lora) against the SwiGLU kernel + cuBLAS GEMM they replace.

    python benchmarks/probe_swiglu_lora.py OUT_DIR

At the 0.5B LoRA protocol (16,384 x 4,864) and the 8B shape (8,192 x 14,336), r = 32, bf16:
- forward: swiglu_gate_up_forward + mm(act, A^T)  vs  swiglu_gate_up_xa (autotuned);
- backward: in-place swiglu_gate_up_backward_ (writes act) + mm(dyb^T, act)  vs  swiglu_gate_up_backward_da
  at several fixed launch shapes (BLOCK_R, BLOCK_C, warps), out of place and in place.
Median of CUDA-event timings over 30 runs after 5 warm-ups. Writes a JSON and prints a table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from chronicals.ops.swiglu import swiglu_gate_up_backward_, swiglu_gate_up_forward
from chronicals.ops.swiglu_lora import swiglu_gate_up_backward_da, swiglu_gate_up_xa

SHAPES = {"0.5b": (16384, 4864), "8b": (8192, 14336)}
BLOCKS = [(64, 64, 4), (32, 64, 4), (64, 128, 8), (32, 128, 4), (128, 64, 8), (64, 32, 4), (16, 128, 4)]


def timed(fn, reps=30, warm=5) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (n, i) in SHAPES.items():
        r = 32
        gen = torch.Generator(device="cuda").manual_seed(0)
        gu = torch.randn(n, 2 * i, device="cuda", generator=gen).to(torch.bfloat16)
        a = (torch.randn(r, i, device="cuda", generator=gen) / i ** 0.5).to(torch.bfloat16)
        d_act = torch.randn(n, i, device="cuda", generator=gen).to(torch.bfloat16)
        dyb = torch.randn(n, r, device="cuda", generator=gen).to(torch.bfloat16)
        act_ref = swiglu_gate_up_forward(gu)
        xa_ref = act_ref @ a.t()
        act, xa = swiglu_gate_up_xa(gu, a)
        ok_fwd = torch.equal(act, act_ref) and (xa.float() - xa_ref.float()).abs().max().item()
        rows.append({"shape": name, "what": "fwd swiglu + mm(act, A^T)",
                     "us": timed(lambda: swiglu_gate_up_forward(gu) @ a.t())})
        rows.append({"shape": name, "what": "fwd swiglu_gate_up_xa", "us": timed(lambda: swiglu_gate_up_xa(gu, a)),
                     "act_equal_and_xa_max_diff": ok_fwd})
        gu_w, d_w = gu.clone(), d_act.clone()

        def base_bwd():
            gu_w.copy_(gu)
            d_w.copy_(d_act)
            _, act_ = swiglu_gate_up_backward_(d_w, gu_w)
            return dyb.t() @ act_

        copy_us = timed(lambda: (gu_w.copy_(gu), d_w.copy_(d_act)))
        rows.append({"shape": name, "what": "copies of gu, d_act (subtracted below)", "us": copy_us})
        rows.append({"shape": name, "what": "bwd in-place swiglu (writes act) + mm(dyb^T, act)",
                     "us": timed(base_bwd) - copy_us})
        da_ref = base_bwd().float()
        for blk in BLOCKS:
            def fused_bwd(in_place, blk=blk):
                if in_place:
                    gu_w.copy_(gu)
                return swiglu_gate_up_backward_da(d_act, gu_w if in_place else gu, dyb, in_place, block=blk)

            err = (fused_bwd(False)[1].float() - da_ref).abs().max().item()
            rows.append({"shape": name, "what": f"bwd swiglu_gate_up_backward_da {blk} out of place",
                         "us": timed(lambda: fused_bwd(False)), "da_max_diff": err})
            rows.append({"shape": name, "what": f"bwd swiglu_gate_up_backward_da {blk} in place",
                         "us": timed(lambda: fused_bwd(True)) - timed(lambda: gu_w.copy_(gu))})
        del gu, d_act, gu_w, d_w, act, act_ref
        torch.cuda.empty_cache()
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in ("shape", "what", "us")}
        print(f"{row['shape']:5s} {row['us']:9.1f} us  {row['what']}  {extra if extra else ''}")
    (out / "probe_swiglu_lora.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                           indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
