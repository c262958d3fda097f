"""The loss head on the GPU: linear + cross-entropy, forward + backward, every contender in one run.

Heads: Qwen2.5-0.5B (N 16,384, H 896, V 151,936) and Llama-3-8B (N 8,192, H 4,096, V 128,256), bf16, every
token a loss token, reduction "mean", gradients of hidden and weight. Contenders: materialized fp32 logits
(what transformers does), the same under torch.compile, Liger's fused linear CE and Apple's cut-cross-entropy
(default = gradient filtering, and exact = filter_eps=None) and quack-kernels' chunked linear CE (its sm90
scaled-exp pipeline and its base one) when importable, and ours (reduction "mean":
3 GEMMs; "none": the 4-GEMM recompute backward, for reference).

Checks first: our loss and gradients against a materialized fp32 reference (fp32 GEMMs, no TF32), with
the bf16 materialized path's error as the yardstick. Then times each contender (do_bench median) and
measures extra peak memory = max_memory_allocated during one step minus the inputs; "beyond grads"
subtracts the two gradients (N x H + V x H in bf16) that every contender returns. The matmul floor is
3 GEMMs of N x H x V at the bf16 peak measured in the same run. About two minutes on an H200.

    PYTHONPATH=src python benchmarks/bench_linear_cross_entropy.py [--out DIR] [--heads 0.5b,8b]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys

import torch
import torch.nn.functional as F

from chronicals.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_triton
from common import do_bench, markdown_table, matmul_peak_tflops, quack_with_shim, write_results

HEADS = {"0.5b": (16384, 896, 151936), "8b": (8192, 4096, 128256)}
GIB = 1 << 30
DEV = "cuda"


def materialized(h, w, y):
    """What transformers does: bf16 logits upcast to fp32, then cross-entropy."""
    return F.cross_entropy(F.linear(h, w).float(), y)


def contenders() -> tuple[dict, list[str]]:
    fns, notes = {}, []
    fns["materialized fp32 logits"] = materialized
    fns["torch.compile materialized"] = torch.compile(materialized, dynamic=False)
    if importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="mean")

        def liger_fn(h, w, y):
            out = liger(w, h, y)  # (lin_weight, input, target); some versions return (loss, z_loss)
            if isinstance(out, torch.Tensor):
                return out
            return out.loss if hasattr(out, "loss") else out[0]

        fns["Liger fused linear CE"] = liger_fn
    else:
        notes.append("liger-kernel not importable: Liger row skipped (carry its wheel, see shared/GPU.md)")
    if importlib.util.find_spec("cut_cross_entropy") is not None:
        from cut_cross_entropy import linear_cross_entropy as cce

        fns["CCE default (filtered grads)"] = lambda h, w, y: cce(h, w, y, reduction="mean")
        fns["CCE exact (filter_eps=None)"] = lambda h, w, y: cce(h, w, y, reduction="mean", filter_eps=None)
    else:
        notes.append("cut-cross-entropy not importable: CCE rows skipped (carry its wheel, see shared/GPU.md)")
    if quack_with_shim() is not None:  # quack-kernels (CuTe DSL GEMM epilogues), sm90
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as qlce

        fns["quack chunked LCE (auto: scaled-exp on sm90)"] = lambda h, w, y: qlce(h, w, y, reduction="mean")
        fns["quack chunked LCE (base)"] = lambda h, w, y: qlce(h, w, y, reduction="mean", use_scaled_exp=False)
    else:
        notes.append("quack-kernels not importable: quack rows skipped")
    fns["chronicals (mean, grads in forward)"] = lambda h, w, y: linear_cross_entropy(h, w, y, impl="triton")
    # chunks of H rows (the default until 2026-12, now max(H, 1,792)): the workspace is exactly dW's size
    # (-C x V x 2 bytes at 0.5B), the dW GEMM's K half as long (twice the fp32 accumulator traffic per FLOP)
    fns["chronicals (mean, chunk H)"] = \
        lambda h, w, y: linear_cross_entropy_triton(h, w, y, chunk_rows=h.shape[1])
    # vocab_parts: no fp32 dW accumulator beyond dW itself, a second pass over (k-1)/k of the vocabulary
    for k in (2, 4):
        fns[f"chronicals (mean, vocab_parts {k})"] = \
            (lambda k_: lambda h, w, y: linear_cross_entropy(h, w, y, impl="triton", vocab_parts=k_))(k)
    fns["chronicals (none, recompute backward)"] = \
        lambda h, w, y: linear_cross_entropy(h, w, y, reduction="none", impl="triton").sum() / y.numel()
    return fns, notes


def inputs(n, h, v, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, h, device=DEV, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device=DEV, generator=g) * h ** -0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    return x, w, y


def step(fn, x, w, y, wrt=None):
    """loss and its gradients for ``wrt`` (default: x and w)."""
    loss = fn(x, w, y)
    return (loss,) + torch.autograd.grad(loss, [x, w] if wrt is None else wrt)


def check(n, h, v) -> tuple[dict, bool]:
    """Ours (one vocabulary part, and two), the bf16 materialized path and quack (when importable) vs fp32 GEMM
    logits; relative max errors. Pass / fail covers ours only."""
    x, w, y = inputs(n, h, v, seed=1)
    torch.backends.cuda.matmul.allow_tf32 = False
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = [t.detach().double() for t in step(lambda a, b, c: F.cross_entropy(F.linear(a, b), c), xr, wr, y)]
    del xr, wr
    row, ok = {}, True
    ours = {"chronicals": 1, "chronicals vocab_parts 2": 2}
    fns = {"bf16 materialized": materialized}
    for name, k in ours.items():
        fns[name] = (lambda k_: lambda a, b, c: linear_cross_entropy(a, b, c, impl="triton", vocab_parts=k_))(k)
    if quack_with_shim() is not None:  # reported, not part of the pass / fail
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as qlce

        fns["quack"] = lambda a, b, c: qlce(a, b, c, reduction="mean")
    for name, fn in fns.items():
        try:
            got = step(fn, x, w, y)
        except Exception as e:  # a crashing contender is a row; ours crashing fails the check below
            row[f"{name} error"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        for q, o, r in zip(("loss", "d_hidden", "d_weight"), got, ref):
            row[f"{name} {q} rel err"] = float((o.detach().double() - r).abs().max() / r.abs().max())
        del got
    for q in ("loss", "d_hidden", "d_weight"):
        for o in ours:  # each within 2x the bf16 materialized path's error, plus one bf16 ulp of slack
            ok &= row.get(f"{o} {q} rel err", float("inf")) <= 2 * row[f"bf16 materialized {q} rel err"] + 2 ** -8
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row, ok


def measure(name, fn, x, w, y, floor_ms, wrt=None) -> dict:
    """wrt: the tensors whose gradients the step asks for (default x and w; [x] times a frozen weight)."""
    wrt = [x, w] if wrt is None else wrt
    try:
        step(fn, x, w, y, wrt)  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step(fn, x, w, y, wrt)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        del out
        ms = do_bench(lambda: step(fn, x, w, y, wrt))
    except Exception as e:  # a contender that crashes is a row, not the end of the run
        return {"contender": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    grads = sum(t.numel() for t in wrt) * x.element_size()
    return {"contender": name, "ms": round(ms, 2), "x floor": round(ms / floor_ms, 2),
            "extra GiB": round(extra / GIB, 3), "beyond grads GiB": round((extra - grads) / GIB, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    ap.add_argument("--heads", default="0.5b,8b", help=f"comma list of {sorted(HEADS)}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_linear_cross_entropy: needs a CUDA GPU", file=sys.stderr)
        return 2
    peak = matmul_peak_tflops()
    fns, notes = contenders()
    rows, checks, all_ok = [], {}, True
    for head in args.heads.split(","):
        n, h, v = HEADS[head]
        floor_ms = 3 * 2 * n * h * v / peak / 1e9
        checks[head], ok = check(n, h, v)
        all_ok &= ok
        print(f"[{head}] check {'ok' if ok else 'FAILED'}: {checks[head]}", flush=True)
        x, w, y = inputs(n, h, v)
        rows.append({"head": head, "contender": "matmul floor (3 GEMMs at measured peak)", "ms": round(floor_ms, 2),
                     "x floor": 1.0})
        for name, fn in fns.items():
            r = {"head": head, **measure(name, fn, x, w, y, floor_ms)}
            print(r, flush=True)
            rows.append(r)
        del x, w, y
        torch.cuda.empty_cache()
    cols = ["head", "contender", "ms", "x floor", "extra GiB", "beyond grads GiB", "error"]
    table = markdown_table(rows, cols)
    md = (f"bf16 matmul peak measured: {peak:.0f} TFLOP/s; checks {'passed' if all_ok else 'FAILED'}\n\n"
          + table + "".join(f"\n- {s}" for s in notes))
    path = write_results("linear_cross_entropy", {"peak_tflops": peak, "checks": checks, "checks_ok": all_ok,
                                                   "rows": rows, "notes": notes}, markdown=md, out_dir=args.out)
    print(md)
    print(f"wrote {path}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
