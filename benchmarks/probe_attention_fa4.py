"""Probe: FlashAttention-4's CuTe kernels (package flash-attn-4, module flash_attn.cute) against what the step runs
now, causal, bf16, forward and forward + backward, at the bench protocol's two attention shapes:

    0.5B: q (16, 1024, 14, 64), k/v (16, 1024, 2, 64)      8B: q (4, 2048, 32, 128), k/v (4, 2048, 8, 128)

Rows: dense rows through SDPA's default order (cuDNN's sm90 kernels on Hopper: what ops.attention runs for unpacked
rows), FA4 dense, and packed rows (one document a row, and chat-like rows of ~40-52 documents per 16 x 1024 tokens)
through PyTorch's FlashAttention-2 varlen op (ops.attention's "flash") and FA4's varlen kernels. TFLOP/s counts the
causal half of the score matrix: fwd 2 GEMMs, bwd 5, each 2 * S^2/2 * D per head (dense rows; packed rows count
their documents' own squares). Correctness: out, dq, dk, dv of every kernel against fp32 SDPA math on the same inputs
(max abs error over the reference's max abs). Times: wall ms per call (CUDA events over 20 calls: the host's
launch cost shows where it is the limit) and kernel ms (the summed GPU time of its kernels, torch.profiler: what a
CUDA-graphed step pays). Session 63's run had wall times only, and FA4's 0.5B forward read 0.179 ms in every layout,
which looked like its Python launcher's cost rather than its kernels'.

Usage (GPU; flash-attn-4 and its deps on PYTHONPATH):  python3 benchmarks/probe_attention_fa4.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {"0.5b": (16, 1024, 14, 2, 64), "8b": (4, 2048, 32, 8, 128)}


def timed(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def chat_lengths(rows, s, gen):
    """Document lengths that fill each row exactly, ~40-52 documents per 16 rows of 1024 (the notes' chat-like rows)."""
    out = []
    for _ in range(rows):
        left = s
        while left:
            n = min(left, int(torch.randint(64, 700, (1,), generator=gen)))
            out.append(n)
            left -= n
    return out


def sdpa_dense(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def ref_fp32(q, k, v, lengths):
    """fp32 math SDPA over each document (lengths None: each row one document)."""
    b, s, hq, d = q.shape
    qf, kf, vf = (t.float().reshape(b * s, t.shape[2], d) for t in (q, k, v))
    lengths = lengths or [s] * b
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(qf[sl].transpose(0, 1)[None], kf[sl].transpose(0, 1)[None],
                                           vf[sl].transpose(0, 1)[None], is_causal=True, enable_gqa=hq != k.shape[2])
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs).view(b, s, hq, d)


def errors(fn, q, k, v, lengths, dout):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fn(qs, ks, vs).backward(dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o32 = ref_fp32(q32, k32, v32, lengths)
    o32.backward(dout.float())
    out = fn(q.detach(), k.detach(), v.detach())
    pairs = {"out": (out, o32.detach()), "dq": (qs.grad, q32.grad), "dk": (ks.grad, k32.grad), "dv": (vs.grad, v32.grad)}
    return {n: float((a.float() - r).abs().max() / r.abs().max()) for n, (a, r) in pairs.items()}


def main(path):
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    sys.path.insert(0, "src")
    sys.path.insert(0, "benchmarks")
    from chronicals.ops.attention import attention_varlen_flash
    from common import kernel_ms

    def fa4_dense(q, k, v):
        r = flash_attn_func(q, k, v, causal=True)
        return r[0] if isinstance(r, tuple) else r

    def fa4_varlen(cu, mx):
        def f(q, k, v):
            b, s, hq, d = q.shape
            r = flash_attn_varlen_func(q.reshape(b * s, hq, d), k.reshape(b * s, -1, d), v.reshape(b * s, -1, d),
                                       cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True)
            return (r[0] if isinstance(r, tuple) else r).view(b, s, hq, d)
        return f

    def fa2_varlen(cu, mx):
        return lambda q, k, v: attention_varlen_flash(q, k, v, cu, mx)

    gen = torch.Generator().manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for shape, (b, s, hq, hk, d) in SHAPES.items():
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        layouts = {"rows": None, "chat": chat_lengths(b, s, gen) if shape == "0.5b" else None}
        for layout, lengths in layouts.items():
            if layout == "chat" and lengths is None:
                continue
            lens = lengths or [s] * b
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
            mx = max(lens)
            flop_fwd = sum(2 * 2 * n * n / 2 * d * hq for n in lens)
            kernels = {"fa2-varlen": fa2_varlen(cu, mx), "fa4-varlen": fa4_varlen(cu, mx)}
            if layout == "rows":
                kernels = {"sdpa-default": sdpa_dense, "fa4-dense": fa4_dense, **kernels}
            for name, fn in kernels.items():
                row = {"shape": shape, "layout": layout, "docs": len(lens), "kernel": name}
                try:
                    t_c = time.time()
                    row["errors"] = errors(fn, q, k, v, lengths, dout)
                    row["first_call_s"] = round(time.time() - t_c, 1)
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                    row["fwd_ms"] = timed(lambda: fn(q, k, v))
                    row["fwd_bwd_ms"] = timed(lambda: fn(qg, kg, vg).backward(dout))
                    row["fwd_tflops"] = flop_fwd / row["fwd_ms"] / 1e9
                    row["fwd_bwd_tflops"] = 3.5 * flop_fwd / row["fwd_bwd_ms"] / 1e9
                    row["fwd_kernel_ms"] = kernel_ms(lambda: fn(q, k, v))
                    row["fwd_bwd_kernel_ms"] = kernel_ms(lambda: fn(qg, kg, vg).backward(dout))
                    row["fwd_bwd_kernel_tflops"] = 3.5 * flop_fwd / row["fwd_bwd_kernel_ms"] / 1e9
                except Exception as e:  # a probe: report the kernel's refusal and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
