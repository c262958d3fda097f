"""Probe (dev): quack-kernels' MLP (CuTe DSL GEMMs with the SwiGLU in the epilogue) against our MLP path.

The question (benchmarks/NOTES.md, "Next"): every remaining 0.5B target needs the MLP's SwiGLU passes inside
the GEMMs, and Triton GEMMs lose their speed once an epilogue is added (probe_gemm_tma.py). quack
(Dao-AILab, `quack-kernels`, built on nvidia-cutlass-dsl) ships exactly those GEMMs for sm90:
- forward ``gemm_gated``: gu = x @ [Wg; Wu]^T with act = silu(g) * u in the epilogue (gu kept for backward);
- backward ``gemm_dgated``: d_act = dy @ W_down with the SwiGLU backward in the epilogue (writes d_gu and act).
If its MLP block is much faster than ours, adopting it is a dependency question for the team; this measures
how much it would buy. Not on any training path.

Variants, each forward + backward of out = down(swiglu(x @ [Wg; Wu]^T)) on (N, H) bf16 tokens:
- "ours": cuBLAS GEMMs (F.linear) + our Triton SwiGLU kernels (``ops.swiglu_gate_up``), act kept: the model's
  MLP with ``recompute=[]`` (the default recompute path adds a second product write in backward);
- "quack": ``quack.mlp.mlp_func(..., "swiglu", concat_layout=True)`` (same [Wg; Wu] weight layout), untuned
  (its default tile config) and tuned (its autotuner);
- each with trainable weights (full fine-tuning: dx, dWgu, dWd) and frozen ones (a LoRA base: dx only).
Checks first: out and every gradient against fp32 (no TF32), relative error max|diff| / max|ref|.

    PYTHONPATH=src python benchmarks/probe_mlp_quack.py OUT.json [--shapes 0.5b,8b] [--tuned]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from chronicals.ops.swiglu import swiglu_gate_up
from common import do_bench, environment, matmul_peak_tflops, quack_with_shim

SHAPES = {"0.5b": (16384, 896, 4864), "8b": (8192, 4096, 14336)}  # (tokens N, hidden H, intermediate I)


def ours(x, wgu, wd):
    return F.linear(swiglu_gate_up(F.linear(x, wgu), impl="triton"), wd)


def quack_fn(tuned: bool):
    from quack.mlp import mlp_func

    return lambda x, wgu, wd: mlp_func(x, wgu, wd, "swiglu", tuned=tuned, concat_layout=True)


def reference(x, wgu, wd):
    g, u = F.linear(x, wgu).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, wd)


def inputs(n, h, i, train_w: bool, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    wgu = (torch.randn(2 * i, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_(train_w)
    wd = (torch.randn(h, i, device="cuda", generator=g) * i ** -0.5).bfloat16().requires_grad_(train_w)
    dy = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    return x, wgu, wd, dy


def run(fn, x, wgu, wd, dy):
    """out and the gradients of every input that requires one."""
    for t in (x, wgu, wd):
        t.grad = None
    out = fn(x, wgu, wd)
    out.backward(dy)
    return [out.detach()] + [t.grad for t in (x, wgu, wd) if t.requires_grad]


def rel_errs(got, ref) -> list[float]:
    return [float((a.double() - b.double()).abs().max() / b.double().abs().max()) for a, b in zip(got, ref)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", default="0.5b,8b")
    ap.add_argument("--tuned", action="store_true", help="also quack's autotuned configs (compiles many kernels)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_mlp_quack: needs a CUDA GPU (sm90)", file=sys.stderr)
        return 2
    res = {"env": environment(), "peak_tflops": matmul_peak_tflops(), "rows": []}
    try:
        quack = quack_with_shim()
        if quack is None:
            raise ImportError("quack-kernels is not installed")
        res["env"]["quack"] = getattr(quack, "__version__", "?")
    except Exception as e:
        res["import_error"] = f"{type(e).__name__}: {e}"
    fns = {"ours": ours}
    if "import_error" not in res:
        fns["quack untuned"] = quack_fn(False)
        if args.tuned:
            fns["quack tuned"] = quack_fn(True)

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    torch.backends.cuda.matmul.allow_tf32 = False
    for shape in args.shapes.split(","):
        n, h, i = SHAPES[shape]
        for train_w in (True, False):
            x, wgu, wd, dy = inputs(n, h, i, train_w)
            xr, wgur, wdr = (t.detach().float().requires_grad_(t.requires_grad) for t in (x, wgu, wd))
            ref = run(reference, xr, wgur, wdr, dy.float())
            del xr, wgur, wdr
            flops = 2 * n * h * 2 * i + 2 * n * i * h  # forward: gate/up and down GEMMs
            flops *= 3 if train_w else 2  # backward: dx (and dW) per GEMM
            for name, fn in fns.items():
                row = {"shape": shape, "weights": "trainable" if train_w else "frozen", "impl": name}
                try:
                    t0 = time.perf_counter()
                    got = run(fn, x, wgu, wd, dy)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t0, 1)
                    row["rel_err"] = dict(zip(["out", "dx", "dWgu", "dWd"], rel_errs(got, ref)))
                    del got
                    ms = do_bench(lambda: run(fn, x, wgu, wd, dy))
                    row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
                except Exception as e:  # one failing variant must not hide the others
                    row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
                print(row, flush=True)
                res["rows"].append(row)
                save()
            del x, wgu, wd, dy, ref
            torch.cuda.empty_cache()
    print(f"{'shape':6} {'weights':9} {'impl':14} {'ms':>8} {'TFLOP/s':>8}")
    for r in res["rows"]:
        print(f"{r['shape']:6} {r['weights']:9} {r['impl']:14} {r.get('ms', '-'):>8} {r.get('tflops', '-'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
