"""The TMA + persistent variants of ``probe_gemm_swiglu.py``'s kernels (imported by it; not run on its own).

Session 5 measured the pointer-load Triton GEMM 20-35% behind cuBLAS at the MLP shapes, which ate the gain
of the SwiGLU epilogue. These kernels load tiles through tensor descriptors (TMA on Hopper: one thread
issues a whole tile copy, no address arithmetic in the loop) and run persistent (one program per SM walks
the tiles in grouped order), the two things the pointer-load version lacked. Same math and the same
roundings as the pointer-load kernels; the descriptors' block shapes are set per autotune config by a
pre-hook (host-side ``TensorDescriptor``).

Layouts: W (out, in) row-major as nn.Linear keeps it; the gate and up halves of gu (M, 2I) are written through
two (M, I) descriptors on column views, so a tile at the last column block is clipped at I by the copy
engine instead of spilling into the other half.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from chronicals.ops.swiglu import _swiglu_bwd_math, _swiglu_fwd_math

try:  # host-side descriptors need a recent triton; without them the TMA rows report why, the rest still runs
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError as e:
    TensorDescriptor, _MISSING = None, f"{type(e).__name__}: {e}"


def _hook(a_names, b_names, c_names, b_kn=False):
    """Pre-hook: block shapes from the config (A blocks [BM, BK], B [BN, BK] or [BK, BN], C [BM, BN])."""
    def hook(nargs):
        bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
        for n in a_names:
            nargs[n].block_shape = [bm, bk]
        for n in b_names:
            nargs[n].block_shape = [bk, bn] if b_kn else [bn, bk]
        for n in c_names:
            nargs[n].block_shape = [bm, bn]
    return hook


def _configs(hook):
    if not torch.cuda.is_available():  # the interpreter: one small config
        return [triton.Config({"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}, num_stages=1, num_warps=1,
                              pre_hook=hook)]
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=st, num_warps=w, pre_hook=hook)
            for bm, bn, bk, st, w in ((128, 128, 64, 3, 8), (128, 256, 64, 3, 8), (128, 128, 64, 4, 8),
                                      (128, 64, 64, 4, 4), (256, 128, 64, 3, 8))]


@triton.jit
def _grouped(tile, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size, (tile % per_group) // size


@triton.jit
def _acc(a_d, b_d, om, on, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KN: tl.constexpr):
    """fp32 tile at (om, on) of A @ B: A blocks [BM, BK]; B as (K, N) blocks [BK, BN] when B_KN, else as
    (N, K) (a weight's rows) blocks [BN, BK]."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = a_d.load([om, k * BK])
        if B_KN:
            acc = tl.dot(a, b_d.load([k * BK, on]), acc)
        else:
            acc = tl.dot(a, b_d.load([on, k * BK]).T, acc)
    return acc


_MM_HOOK = _hook(["a_d"], ["b_d"], ["c_d"])


@triton.autotune(configs=_configs(_MM_HOOK), key=["M", "N", "K"])
@triton.jit
def _tma_mm_kernel(a_d, b_d, c_d, M, N, K, PROGS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """C (M, N) = A (M, K) @ W^T, W (N, K): persistent over the tiles."""
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, PROGS):
        pm, pn = _grouped(tile, num_m, num_n, GROUP_M)
        acc = _acc(a_d, b_d, pm * BM, pn * BN, K, BM, BN, BK, False)
        c_d.store([pm * BM, pn * BN], acc.to(c_d.dtype))


_FWD_HOOK = _hook(["x_d"], ["wg_d", "wu_d"], ["g_d", "u_d", "act_d"])


@triton.autotune(configs=_configs(_FWD_HOOK), key=["M", "N", "K"])
@triton.jit
def _tma_gate_up_swiglu_kernel(x_d, wg_d, wu_d, g_d, u_d, act_d, M, N, K, PROGS, BM: tl.constexpr,
                               BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """gate | up = x @ [Wg; Wu]^T (one x tile feeds both), stored rounded, and act = silu(g) * u."""
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, PROGS):
        pm, pn = _grouped(tile, num_m, num_n, GROUP_M)
        om, on = pm * BM, pn * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            x = x_d.load([om, k * BK])
            acc_g = tl.dot(x, wg_d.load([on, k * BK]).T, acc_g)
            acc_u = tl.dot(x, wu_d.load([on, k * BK]).T, acc_u)
        g = acc_g.to(g_d.dtype)
        u = acc_u.to(u_d.dtype)
        g_d.store([om, on], g)
        u_d.store([om, on], u)
        act_d.store([om, on], _swiglu_fwd_math(g.to(tl.float32), u.to(tl.float32)).to(act_d.dtype))


_BWD_HOOK = _hook(["dy_d"], ["wd_d"], ["g_d", "u_d", "dg_d", "du_d", "act_d"], b_kn=True)


@triton.autotune(configs=_configs(_BWD_HOOK), key=["M", "N", "K"])
@triton.jit
def _tma_down_bwd_kernel(dy_d, wd_d, g_d, u_d, dg_d, du_d, act_d, M, N, K, PROGS, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """d_act = dy @ W_down (rounded as stored by the unfused path) -> d_gate, d_up, act from gate / up tiles."""
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, PROGS):
        pm, pn = _grouped(tile, num_m, num_n, GROUP_M)
        om, on = pm * BM, pn * BN
        d = _acc(dy_d, wd_d, om, on, K, BM, BN, BK, True).to(dg_d.dtype).to(tl.float32)
        g = g_d.load([om, on]).to(tl.float32)
        u = u_d.load([om, on]).to(tl.float32)
        dg, du = _swiglu_bwd_math(d, g, u)
        dg_d.store([om, on], dg.to(dg_d.dtype))
        du_d.store([om, on], du.to(du_d.dtype))
        act_d.store([om, on], _swiglu_fwd_math(g, u).to(act_d.dtype))


def _progs(t: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4


def _d(t: torch.Tensor):
    if TensorDescriptor is None:
        raise RuntimeError(f"TMA variants unavailable on this triton ({triton.__version__}): {_MISSING}")
    return TensorDescriptor.from_tensor(t, [16, 16])  # block shape set per config by the pre-hook


def tma_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T -> (M, N)."""
    m, k = x.shape
    n = w.shape[0]
    c = torch.empty(m, n, device=x.device, dtype=x.dtype)
    p = _progs(x)
    _tma_mm_kernel[(p,)](_d(x), _d(w), _d(c), m, n, k, p)
    return c


def tma_gate_up_swiglu(x: torch.Tensor, w: torch.Tensor):
    """x (M, K), w = [Wg; Wu] (2I, K) -> gu (M, 2I), act (M, I)."""
    m, k = x.shape
    i = w.shape[0] // 2
    gu = torch.empty(m, 2 * i, device=x.device, dtype=x.dtype)
    act = torch.empty(m, i, device=x.device, dtype=x.dtype)
    p = _progs(x)
    _tma_gate_up_swiglu_kernel[(p,)](_d(x), _d(w[:i]), _d(w[i:]), _d(gu[:, :i]), _d(gu[:, i:]), _d(act), m, i, k, p)
    return gu, act


def tma_down_dact_swiglu_bwd(dy: torch.Tensor, w_down: torch.Tensor, gu: torch.Tensor):
    """dy (M, H), w_down (H, I), gu (M, 2I) -> d_gu (M, 2I), act (M, I)."""
    m, h = dy.shape
    i = w_down.shape[1]
    dgu = torch.empty(m, 2 * i, device=dy.device, dtype=dy.dtype)
    act = torch.empty(m, i, device=dy.device, dtype=dy.dtype)
    p = _progs(dy)
    _tma_down_bwd_kernel[(p,)](_d(dy), _d(w_down), _d(gu[:, :i]), _d(gu[:, i:]), _d(dgu[:, :i]), _d(dgu[:, i:]),
                               _d(act), m, i, h, p)
    return dgu, act
