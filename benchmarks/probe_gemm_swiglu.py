"""Probe (dev): can a Triton GEMM with the SwiGLU in its epilogue beat cuBLAS + our separate SwiGLU kernel?

The question before any model change (benchmarks/NOTES.md, "Next"): the MLP's two SwiGLU passes move bytes
a GEMM epilogue could keep in registers.
- forward:  gu = x @ [Wg; Wu]^T (cuBLAS, writes N x 2I), then act = silu(g) * u (reads N x 2I, writes N x I).
  Fused: one kernel holds the gate and up tiles of the same columns in two accumulators and writes gu (kept
  for backward) and act: the N x 2I read is gone (319 MB per layer at the 0.5B protocol, ~75 us at 4.2 TB/s).
- backward: d_act = dy @ W_down (cuBLAS, writes N x I), then the SwiGLU backward (reads d_act and gu, writes
  d_gu and act). Fused: the d_act tile never leaves registers: N x I written and read less (2 x 159 MB).
Each fused kernel rounds exactly where the unfused path does (GEMM output to bf16, then the same fp32
SwiGLU expressions from ops/swiglu.py), so only the GEMM's accumulation order differs.

The gain is worth having only if the Triton GEMM itself runs close to cuBLAS: the plain Triton GEMM of the
same loop is timed too. Two families: pointer loads (one tile per program; measured on the H200 at git
9676978, results/probe_gemm_swiglu_9676978_*: 20-35% behind cuBLAS) and TMA descriptors + persistent
programs (``probe_gemm_tma.py``; CPU-checked, not yet timed on a GPU).

    PYTHONPATH=src python benchmarks/probe_gemm_swiglu.py OUT.json            # GPU: 0.5B and 8B MLP shapes
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/probe_gemm_swiglu.py --check   # CPU: tiny fp32 check
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from chronicals.ops._triton_utils import tune_configs
from chronicals.ops.swiglu import _swiglu_bwd_math, _swiglu_fwd_math, swiglu_gate_up_backward, swiglu_gate_up_forward
from probe_gemm_tma import _grouped, tma_down_dact_swiglu_bwd, tma_gate_up_swiglu, tma_mm  # benchmarks/, beside this
from common import require_cuda  # noqa: E402

_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in ((128, 128, 64, 3, 8), (128, 64, 64, 4, 4), (128, 128, 64, 4, 8),
                                     (64, 128, 64, 4, 4), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8))]
if torch.cuda.is_available():
    CONFIGS = tune_configs(_CONFIGS)
else:  # the interpreter: one small config
    CONFIGS = [triton.Config({"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}, num_stages=1, num_warps=1)]


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile, one tile per program."""
    return _grouped(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)


@triton.jit
def _mm_tile(A, B, M, N, K, sam, sbk, sbn, pm, pn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The (pm, pn) tile of A (M, K) row-major @ B (K, N) with strides (sbk, sbn), fp32: (acc, rows, cols)."""
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ap = A + rm[:, None].to(tl.int64) * sam + rk[None, :]
    bp = B + rk[:, None].to(tl.int64) * sbk + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        km = rk < K - k * BK
        a = tl.load(ap, mask=(rm[:, None] < M) & km[None, :], other=0.0)
        b = tl.load(bp, mask=km[:, None] & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        ap += BK
        bp += BK * sbk
    return acc, rm, rn


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def _mm_kernel(A, B, C, M, N, K, sam, sbk, sbn, scm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr):
    """C (M, N) = A (M, K) @ B (K, N); A row-major, B with strides (sbk, sbn): the plain GEMM of the loop below."""
    pm, pn = _tile_ids(M, N, BM, BN, GROUP_M)
    acc, rm, rn = _mm_tile(A, B, M, N, K, sam, sbk, sbn, pm, pn, BM, BN, BK)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(C + rm[:, None].to(tl.int64) * scm + rn[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def _gate_up_swiglu_kernel(X, W, GU, ACT, M, N, K, sxm, swn, sgm, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP_M: tl.constexpr):
    """x (M, K), W = [Wg; Wu] (2N, K) -> gu (M, 2N) = x @ W^T in the input dtype, act (M, N) = silu(g) * u."""
    pm, pn = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = X + rm[:, None].to(tl.int64) * sxm + rk[None, :]
    gp = W + rn[None, :].to(tl.int64) * swn + rk[:, None]  # (BK, BN) tile of Wg^T
    up = gp + N * swn  # the up rows: N rows further
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        km = rk < K - k * BK
        x = tl.load(xp, mask=(rm[:, None] < M) & km[None, :], other=0.0)
        wm = km[:, None] & (rn[None, :] < N)
        acc_g = tl.dot(x, tl.load(gp, mask=wm, other=0.0), acc_g)
        acc_u = tl.dot(x, tl.load(up, mask=wm, other=0.0), acc_u)
        xp += BK
        gp += BK
        up += BK
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    g = acc_g.to(GU.dtype.element_ty)  # the rounding the unfused path's gu gets
    u = acc_u.to(GU.dtype.element_ty)
    off = rm[:, None].to(tl.int64) * sgm + rn[None, :]
    tl.store(GU + off, g, mask=mask)
    tl.store(GU + off + N, u, mask=mask)
    act = _swiglu_fwd_math(g.to(tl.float32), u.to(tl.float32))
    tl.store(ACT + rm[:, None].to(tl.int64) * N + rn[None, :], act.to(ACT.dtype.element_ty), mask=mask)


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def _down_dact_swiglu_bwd_kernel(DY, WD, GU, DGU, ACT, M, N, K, sdm, swk, sgm, BM: tl.constexpr,
                                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """dy (M, K), W_down (K, N) row-major, gu (M, 2N) -> d_gu (M, 2N) and act (M, N): d_act = dy @ W_down stays
    in registers (rounded to the input dtype, as the unfused path stores it)."""
    pm, pn = _tile_ids(M, N, BM, BN, GROUP_M)
    acc, rm, rn = _mm_tile(DY, WD, M, N, K, sdm, swk, 1, pm, pn, BM, BN, BK)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    d = acc.to(DGU.dtype.element_ty).to(tl.float32)
    off = rm[:, None].to(tl.int64) * sgm + rn[None, :]
    g = tl.load(GU + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + off + N, mask=mask, other=0.0).to(tl.float32)
    dg, du = _swiglu_bwd_math(d, g, u)
    tl.store(DGU + off, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + off + N, du.to(DGU.dtype.element_ty), mask=mask)
    tl.store(ACT + rm[:, None].to(tl.int64) * N + rn[None, :], _swiglu_fwd_math(g, u).to(ACT.dtype.element_ty),
             mask=mask)


def _grid(m, n):
    return lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)


def triton_mm(a, b):
    """a (M, K) row-major @ b (K, N) any strides -> (M, N)."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, device=a.device, dtype=a.dtype)
    _mm_kernel[_grid(m, n)](a, b, c, m, n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0))
    return c


def fused_gate_up_swiglu(x, w):
    """x (M, K), w (2I, K) -> gu (M, 2I), act (M, I)."""
    m, k = x.shape
    i = w.shape[0] // 2
    gu = torch.empty(m, 2 * i, device=x.device, dtype=x.dtype)
    act = torch.empty(m, i, device=x.device, dtype=x.dtype)
    _gate_up_swiglu_kernel[_grid(m, i)](x, w, gu, act, m, i, k, x.stride(0), w.stride(0), gu.stride(0))
    return gu, act


def fused_down_dact_swiglu_bwd(dy, w_down, gu):
    """dy (M, H), w_down (H, I) (nn.Linear's (out, in)), gu (M, 2I) -> d_gu (M, 2I), act (M, I)."""
    m, h = dy.shape
    i = w_down.shape[1]
    dgu = torch.empty(m, 2 * i, device=dy.device, dtype=dy.dtype)
    act = torch.empty(m, i, device=dy.device, dtype=dy.dtype)
    _down_dact_swiglu_bwd_kernel[_grid(m, i)](dy, w_down, gu, dgu, act, m, i, h, dy.stride(0), w_down.stride(0),
                                              gu.stride(0))
    return dgu, act


def reference(x, w, dy, w_down):
    """fp32 references: (gu, act) of the forward, (d_gu, act) of the backward, from the bf16-rounded points the
    unfused path stores (gu, d_act)."""
    gu = (x.float() @ w.float().t()).to(x.dtype).float()
    i = w.shape[0] // 2
    g, u = gu[:, :i], gu[:, i:]
    act = torch.nn.functional.silu(g) * u
    d = (dy.float() @ w_down.float()).to(dy.dtype).float()
    sig = torch.sigmoid(g)
    dgu = torch.cat([d * u * sig * (1 + g * (1 - sig)), d * g * sig], dim=1)
    return gu, act, dgu


def rel_err(got, want):
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def check_small(dev, dtype):
    """Odd sizes (masks on every edge) against the fp32 reference; returns the worst relative error. The TMA
    kernels join where the copy engine's 16-byte alignment holds (I and K multiples of 8)."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for m, k, i in ((37, 40, 23), (37, 40, 24), (64, 48, 32)):
        x = torch.randn(m, k, generator=g).to(dev, dtype)
        w = (torch.randn(2 * i, k, generator=g) * k ** -0.5).to(dev, dtype)
        dy = torch.randn(m, k, generator=g).to(dev, dtype)
        wd = (torch.randn(k, i, generator=g) * i ** -0.5).to(dev, dtype)
        gu_r, act_r, dgu_r = reference(x, w, dy, wd)
        gu, act = fused_gate_up_swiglu(x, w)
        dgu, act2 = fused_down_dact_swiglu_bwd(dy, wd, gu)
        errs = [rel_err(gu, gu_r), rel_err(act, act_r), rel_err(dgu, dgu_r), rel_err(act2, act_r),
                rel_err(triton_mm(x, w.t()), x.float() @ w.float().t())]
        if i % 8 == 0 and k % 8 == 0:
            try:  # on a GPU whose triton cannot build them, the pointer-load rows still run
                t_gu, t_act = tma_gate_up_swiglu(x, w)
                t_dgu, t_act2 = tma_down_dact_swiglu_bwd(dy, wd, gu)
                errs += [rel_err(t_gu, gu_r), rel_err(t_act, act_r), rel_err(t_dgu, dgu_r), rel_err(t_act2, act_r),
                         rel_err(tma_mm(x, w), x.float() @ w.float().t())]
            except Exception as e:
                if dev == "cpu":
                    raise
                print(f"check m={m} k={k} i={i}: TMA variants failed: {type(e).__name__}: {str(e)[:200]}")
        print(f"check m={m} k={k} i={i}: gu, act, dgu, act(bwd), mm" + (" and the same by TMA" if len(errs) > 5
              else "") + ": " + " ".join(f"{e:.1e}" for e in errs), flush=True)
        worst = max(worst, *errs)
    return worst


def bench(out_path):
    from triton.testing import do_bench

    dev, bf = "cuda", torch.bfloat16
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "check_worst_rel_err_bf16": check_small(dev, bf)}
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    ms = do_bench(lambda: a @ a, warmup=25, rep=200)
    res["peak_tflops"] = 2 * 8192 ** 3 / ms / 1e9
    print(f"bf16 matmul 8192^3: {res['peak_tflops']:.0f} TFLOP/s", flush=True)
    del a
    for tag, n, h, i in (("0.5b", 16384, 896, 4864), ("8b", 8192, 4096, 14336)):
        x = torch.randn(n, h, device=dev, dtype=bf)
        w = (torch.randn(2 * i, h, device=dev) * h ** -0.5).to(bf)
        dy = torch.randn(n, h, device=dev, dtype=bf)
        wd = (torch.randn(h, i, device=dev) * i ** -0.5).to(bf)
        gu = x @ w.t()
        d_act = dy @ wd
        wd_t = wd.t().contiguous()  # tma_mm takes a weight's (N, K) rows
        act_buf = torch.empty(n, i, device=dev, dtype=bf)
        f_gu, f_act = fused_gate_up_swiglu(x, w)
        f_dgu, _ = fused_down_dact_swiglu_bwd(dy, wd, gu)
        errs = {"fwd gu vs cuBLAS": rel_err(f_gu, gu.float()),
                "fwd act vs unfused": rel_err(f_act, swiglu_gate_up_forward(gu).float()),
                "bwd dgu vs unfused": rel_err(f_dgu, swiglu_gate_up_backward(d_act, gu).float())}
        t = {
            "fwd cuBLAS gu": lambda: torch.mm(x, w.t()),
            "fwd swiglu kernel": lambda: swiglu_gate_up_forward(gu),
            "fwd cuBLAS + swiglu": lambda: swiglu_gate_up_forward(torch.mm(x, w.t())),
            "fwd triton mm (no epilogue)": lambda: triton_mm(x, w.t()),
            "fwd fused gemm+swiglu": lambda: fused_gate_up_swiglu(x, w),
            "bwd cuBLAS d_act": lambda: torch.mm(dy, wd),
            "bwd swiglu kernel (+act)": lambda: swiglu_gate_up_backward(d_act, gu, act_buf),
            "bwd cuBLAS + swiglu (+act)": lambda: swiglu_gate_up_backward(torch.mm(dy, wd), gu, act_buf),
            "bwd triton mm (no epilogue)": lambda: triton_mm(dy, wd),
            "bwd fused gemm+swiglu": lambda: fused_down_dact_swiglu_bwd(dy, wd, gu),
            "fwd tma mm (no epilogue)": lambda: tma_mm(x, w),
            "fwd tma fused gemm+swiglu": lambda: tma_gate_up_swiglu(x, w),
            "bwd tma mm (no epilogue)": lambda: tma_mm(dy, wd_t),
            "bwd tma fused gemm+swiglu": lambda: tma_down_dact_swiglu_bwd(dy, wd, gu),
        }
        row = {"errors": errs}
        for name, fn in t.items():
            try:  # a variant that does not compile on this triton says why, the others still run
                fn()
                row[name] = round(do_bench(fn, warmup=25, rep=100) * 1e3, 1)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:160]}"
        try:
            errs["tma fwd gu vs cuBLAS"] = rel_err(tma_gate_up_swiglu(x, w)[0], gu.float())
            errs["tma bwd dgu vs unfused"] = rel_err(tma_down_dact_swiglu_bwd(dy, wd, gu)[0],
                                                     swiglu_gate_up_backward(d_act, gu).float())
        except Exception as e:
            errs["tma"] = f"{type(e).__name__}: {str(e)[:160]}"
        flops = 2 * n * h * 2 * i
        for name in ("fwd cuBLAS gu", "fwd triton mm (no epilogue)", "fwd fused gemm+swiglu", "fwd tma mm (no epilogue)",
                     "fwd tma fused gemm+swiglu"):
            if isinstance(row[name], float):
                row[name + " TFLOP/s"] = round(flops / row[name] / 1e6)
        for name in ("bwd cuBLAS d_act", "bwd triton mm (no epilogue)", "bwd fused gemm+swiglu", "bwd tma mm (no epilogue)",
                     "bwd tma fused gemm+swiglu"):
            if isinstance(row[name], float):
                row[name + " TFLOP/s"] = round(flops / 2 / row[name] / 1e6)
        import probe_gemm_tma as tma

        kernels = {"mm": _mm_kernel, "fwd fused": _gate_up_swiglu_kernel, "bwd fused": _down_dact_swiglu_bwd_kernel,
                   "tma mm": tma._tma_mm_kernel, "tma fwd fused": tma._tma_gate_up_swiglu_kernel,
                   "tma bwd fused": tma._tma_down_bwd_kernel}
        row["best configs"] = {k_: str(getattr(kern, "best_config", None)) for k_, kern in kernels.items()}
        res[tag] = row
        print(f"== {tag} (N {n}, H {h}, I {i}), us:", flush=True)
        for k_, v in row.items():
            print(f"   {k_}: {v}", flush=True)
        del x, w, dy, wd, wd_t, gu, d_act, act_buf, f_gu, f_act, f_dgu
        torch.cuda.empty_cache()
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    if "--check" in sys.argv:
        worst = check_small("cpu", torch.float32)
        assert worst < 1e-4, worst
        print("ok")
    else:
        require_cuda(__file__, "OUT.json | --check")
        bench(sys.argv[1])
