"""Probe (dev): packed-row attention through cuDNN's ragged (THD) kernels vs the varlen FlashAttention-2 path we
use, at the 0.5B (16 x 1024, 14/2 heads of 64) and 8B (4 x 2048, 32/8 heads of 128) shapes.

cuDNN: ``aten::_cudnn_attention_forward`` with cum_seq_q = cum_seq_k (the op PyTorch's nested-tensor SDPA calls);
its backward through autograd (the op has a derivative) and through ``aten::_cudnn_attention_backward`` directly.
Checks outputs and q/k/v gradients against FA2 varlen (both bf16) and a float64 masked reference on a small
case, times fwd and fwd+bwd, and the first call at a new document count (cuDNN builds a plan per shape).

    PYTHONPATH=src python benchmarks/probe_attention_cudnn.py OUT.json
"""
import json
import sys
import time

import torch
from triton.testing import do_bench

from bench_attention import packed_or_rows as packed
from common import require_cuda
from chronicals.ops.attention import attention_ref, attention_varlen_flash

dev, bf = "cuda", torch.bfloat16


def cudnn_autograd(q, k, v, cu, maxs, scale):
    """q (T, Hq, D), k/v (T, Hk, D) -> out (T, Hq, D) through the op's registered derivative."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, maxs, maxs, True, 0.0, True, False,
                                                   scale=scale)[0]


class CudnnExplicit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, maxs, scale):
        out, lse, _, _, _, _, seed, off, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, maxs, maxs, True, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, off)
        ctx.maxs, ctx.scale = maxs, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu, seed, off = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            do.contiguous(), q, k, v, out, lse, seed, off, torch.empty(0, device=q.device, dtype=q.dtype), cu, cu,
            ctx.maxs, ctx.maxs, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def run(name, fn, q, k, v, g):
    qs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*qs)
    out.backward(g)
    return [out.detach().float()] + [t.grad.float() for t in qs]


def main(path):
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}
    gen = torch.Generator().manual_seed(0)
    # small float64 check: 3 rows of 256, docs ~60
    b, s, hq, hk, d = 3, 256, 8, 2, 64
    cu = packed(b, s, gen, 60)
    maxs = int(cu.diff().max())
    q, k, v = (torch.randn(b * s, h, d, generator=gen).to(dev) for h in (hq, hk, hk))
    g = torch.randn(b * s, hq, d, generator=gen).to(dev)
    ref = run("ref", lambda q_, k_, v_: attention_ref(q_.view(b, s, hq, d), k_.view(b, s, hk, d), v_.view(b, s, hk, d),
                                                      cu_seqlens=cu).reshape(b * s, hq, d),
              q.double(), k.double(), v.double(), g.double())
    variants = {
        "fa2 varlen": lambda q_, k_, v_: attention_varlen_flash(q_.view(b, s, hq, d), k_.view(b, s, hk, d),
                                                                v_.view(b, s, hk, d), cu, maxs).reshape(b * s, hq, d),
        "cudnn autograd": lambda q_, k_, v_: cudnn_autograd(q_, k_, v_, cu, maxs, d ** -0.5),
        "cudnn explicit": lambda q_, k_, v_: CudnnExplicit.apply(q_, k_, v_, cu, maxs, d ** -0.5),
    }
    res["check"] = {}
    for name, fn in variants.items():
        try:
            got = run(name, fn, q.to(bf), k.to(bf), v.to(bf), g.to(bf))
            errs = [float((a - r).abs().max()) for a, r in zip(got, ref)]
        except Exception as e:
            errs = f"{type(e).__name__}: {str(e)[:300]}"
        res["check"][name] = errs
        print(f"check {name}: max abs err out/dq/dk/dv vs float64 = {errs}", flush=True)

    res["time"] = {}
    for tag, (b, s, hq, hk, d) in {"0.5b": (16, 1024, 14, 2, 64), "8b": (4, 2048, 32, 8, 128)}.items():
        for docs in (None, 300):
            cu = packed(b, s, gen, docs)
            maxs = int(cu.diff().max())
            q, k, v = (torch.randn(b * s, h, d, device=dev, dtype=bf).requires_grad_() for h in (hq, hk, hk))
            g = torch.randn(b * s, hq, d, device=dev, dtype=bf)
            sc = d ** -0.5
            fns = {
                "fa2 varlen": lambda: attention_varlen_flash(q.view(b, s, hq, d), k.view(b, s, hk, d),
                                                             v.view(b, s, hk, d), cu, maxs, sc),
                "cudnn autograd": lambda: cudnn_autograd(q, k, v, cu, maxs, sc),
                "cudnn explicit": lambda: CudnnExplicit.apply(q, k, v, cu, maxs, sc),
            }
            if docs is None:
                qd, kd, vd = (t.detach().view(b, s, -1, d).transpose(1, 2).requires_grad_() for t in (q, k, v))
                gd = g.view(b, s, hq, d).transpose(1, 2)
                for be in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                    fns[f"sdpa dense causal {be}"] = (lambda be_: lambda: _sdpa(qd, kd, vd, be_))(be)
            base = None
            for name, fn in fns.items():
                key = f"{tag} docs={'row' if docs is None else docs} ({len(cu) - 1} docs) {name}"
                try:
                    t0 = time.perf_counter()
                    out = fn()
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    ins = (q, k, v) if "sdpa" not in name else (qd, kd, vd)
                    gg = g if "sdpa" not in name else gd
                    if base is None:
                        base = torch.autograd.grad(out, ins, gg) + (out,)
                        err = 0.0
                    else:
                        got = torch.autograd.grad(out, ins, gg) + (out,)
                        if "sdpa" in name:
                            got = tuple(t.transpose(1, 2).reshape(b * s, -1, d) for t in got)
                        err = max(float((a.float() - r.float()).abs().max()) for a, r in zip(got, base))
                    fwd = do_bench(fn, warmup=10, rep=50)
                    both = do_bench(lambda: torch.autograd.grad(fn(), ins, gg), warmup=10, rep=50)
                    res["time"][key] = {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both, 4),
                                        "first_call_s": round(first, 3), "max_abs_diff_vs_fa2": err}
                except Exception as e:
                    res["time"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                print(key, res["time"][key], flush=True)
    json.dump(res, open(path, "w"), indent=1)


def _sdpa(q, k, v, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=q.shape[1] != k.shape[1])


if __name__ == "__main__":
    require_cuda(__file__, "OUT.json")
    main(sys.argv[1])
