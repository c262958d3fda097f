"""SwiGLU on packed gate|up fused with a LoRA down_proj's rank-r products, forward and backward.

Shapes: gu (N, 2I) = [gate | up], A (r, I) (down_proj's lora_A), act = silu(gate) * up (N, I).
- forward: ``swiglu_gate_up_xa(gu, A) -> (act, xa)``, xa = act A^T (N, r): the kernel that writes act
  also multiplies it by A^T as it goes, so the (N, I) act is not read again by a skinny GEMM.
- backward: ``swiglu_gate_up_backward_da(d_act, gu, dyb) -> (d_gu, dA)``, dA = dyb^T act (r, I) with
  dyb = s dy B (N, r): the SwiGLU backward rebuilds act in registers for dA instead of writing it out.

Why (Qwen2.5-0.5B LoRA protocol, N = 16,384, I = 4,864, r = 32; H200 profile, ``lora.mlp``): down_proj's
x A^T GEMM took 45 us a layer and its dA GEMM 51 us, each reading the 159 MB act; the SwiGLU backward also
wrote that act (159 MB) for dA. Fused, those bytes are gone: ~2 ms of a ~91 ms step by arithmetic.

Layouts: the forward walks each program's BLOCK_R rows across all I columns (xa's row sum stays in the
program); the backward walks each program's BLOCK_C columns down a share of the N rows (dA's column sum
stays in the program), with ``splits`` shares so that (I / BLOCK_C) x splits programs fill the GPU; the
shares' fp32 partial dA (splits, r, I) are added in fp32 and rounded once. Ranks pad to a power of two
>= 16 (tl.dot's smallest side); r <= ``MAX_RANK``.

Rounding: act is computed by ``_swiglu_fwd_math`` (the SwiGLU kernels' own expression: the same bits) and
rounded to gu's dtype before the products, as the GEMMs it replaces read it; the products accumulate in
fp32. Under the interpreter (CPU tests), and for fp32 inputs, the dots run in fp32 IEEE on the rounded
values (the interpreter's bf16 arithmetic is not trustworthy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._impl import triton_interpreting
from ._triton_utils import num_sms, tune_configs
from .swiglu import _swiglu_bwd_math, _swiglu_fwd_math, swiglu_gate_up_ref

MAX_RANK = 128  # acc (BLOCK_R, R) fp32 in registers: 64 x 128 is 64 regs a thread at 4 warps


def swiglu_gate_up_xa_ref(gu: torch.Tensor, lora_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (N, 2I), A (r, I) -> (act (N, I), act A^T (N, r)), autograd through both."""
    act = swiglu_gate_up_ref(gu)
    return act, act @ lora_a.t()


def swiglu_gate_up_backward_da_ref(d_act, gu, dyb) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gu (N, 2I), dA = dyb^T act (r, I)) for act = swiglu_gate_up(gu), upstream d_act (N, I), dyb (N, r)."""
    with torch.enable_grad():
        g = gu.detach().requires_grad_()
        act = swiglu_gate_up_ref(g)
        (d_gu,) = torch.autograd.grad(act, g, d_act)
    return d_gu, dyb.t() @ act.detach()


def _rank_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


# ---------------------------------------------------------------- forward

# (BLOCK_R, BLOCK_C, warps, stages): 64 x 128 bf16 tiles are 16 KB per operand; the first is the
# interpreter's (few, large steps) and CHRONICALS_AUTOTUNE=first's.
_FWD_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w, num_stages=s)
                for r, c, w, s in ((64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3),
                                   (64, 256, 8, 2), (32, 256, 4, 2))]


@triton.autotune(configs=tune_configs(_FWD_CONFIGS), key=["n_cols", "R", "size_class"])
@triton.jit
def _swiglu_xa_fwd_kernel(GU_ptr, A_ptr, ACT_ptr, XA_ptr, n_rows, n_cols, gu_row_stride, r, size_class,
                          R: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: BLOCK_R rows of gu across all n_cols columns -> act rows, xa rows (BLOCK_R, r)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    ks = tl.arange(0, R)
    acc = tl.zeros((BLOCK_R, R), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < n_cols
        m = rmask[:, None] & cmask[None, :]
        g_off = rows[:, None] * gu_row_stride + cols[None, :]
        g = tl.load(GU_ptr + g_off, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU_ptr + g_off + n_cols, mask=m, other=0.0).to(tl.float32)
        act = _swiglu_fwd_math(g, u).to(ACT_ptr.dtype.element_ty)  # masked lanes: silu(0) * 0 = 0
        tl.store(ACT_ptr + rows[:, None] * n_cols + cols[None, :], act, mask=m)
        at = tl.load(A_ptr + ks[None, :] * n_cols + cols[:, None], mask=cmask[:, None] & (ks < r)[None, :],
                     other=0.0)  # (BLOCK_C, R) = A^T's block
        if FP32_DOT:
            acc += tl.dot(act.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(act, at)
    tl.store(XA_ptr + rows[:, None] * r + ks[None, :], acc.to(XA_ptr.dtype.element_ty),
             mask=rmask[:, None] & (ks < r)[None, :])


def swiglu_gate_up_xa(gu: torch.Tensor, lora_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (N, 2I) with unit column stride, A (r, I) contiguous, one dtype -> (act (N, I), xa (N, r)), contiguous.

    act is bit for bit ``swiglu_gate_up_forward(gu)``; xa is act A^T with fp32 accumulation, rounded once."""
    n, i = gu.shape[0], gu.shape[1] // 2
    r = lora_a.shape[0]
    _check(gu.stride(1) == 1 and lora_a.is_contiguous() and lora_a.shape[1] == i and gu.dtype == lora_a.dtype
           and 0 < r <= MAX_RANK, f"gu {tuple(gu.shape)} {gu.dtype} (unit column stride), lora_a "
           f"{tuple(lora_a.shape)} {lora_a.dtype} (contiguous (r, I), r <= {MAX_RANK}, gu's dtype)")
    act = torch.empty((n, i), device=gu.device, dtype=gu.dtype)
    xa = torch.empty((n, r), device=gu.device, dtype=gu.dtype)
    if n and i:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]),)  # noqa: E731
        _swiglu_xa_fwd_kernel[grid](gu, lora_a, act, xa, n, i, gu.stride(0), r, max(n * i, 1).bit_length(),
                                    R=_rank_pad(r), FP32_DOT=_fp32_dot(gu))
    else:
        xa.zero_()
    return act, xa


# ---------------------------------------------------------------- backward


@triton.jit
def _swiglu_da_bwd_kernel(DY_ptr, GU_ptr, DGU_ptr, DYB_ptr, PART_ptr, n_rows, n_cols, dy_row_stride, gu_row_stride,
                          dgu_row_stride, rows_per_split, r, R: tl.constexpr, IN_PLACE: tl.constexpr,
                          FP32_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (column block, split): BLOCK_C columns over rows [split * rows_per_split, + rows_per_split):
    d_gu's tiles, and the partial dA (R, BLOCK_C) of those rows into PART[split] (fp32, (splits, R, n_cols)).
    IN_PLACE: DGU_ptr is GU_ptr; every element is loaded and stored by one program at one address, after a
    barrier between the tile's loads and stores (as ``swiglu._swiglu_gate_up_bwd_body``)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    ks = tl.arange(0, R)
    start = tl.program_id(1).to(tl.int64) * rows_per_split
    stop = tl.minimum(start + rows_per_split, n_rows)
    acc = tl.zeros((R, BLOCK_C), dtype=tl.float32)
    for r0 in range(start, stop, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < stop
        m = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g_off = rows[:, None] * gu_row_stride + cols[None, :]
        g = tl.load(GU_ptr + g_off, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU_ptr + g_off + n_cols, mask=m, other=0.0).to(tl.float32)
        if IN_PLACE:
            tl.debug_barrier()
        dg, du = _swiglu_bwd_math(dy, g, u)
        d_off = rows[:, None] * dgu_row_stride + cols[None, :]
        tl.store(DGU_ptr + d_off, dg.to(DGU_ptr.dtype.element_ty), mask=m)
        tl.store(DGU_ptr + d_off + n_cols, du.to(DGU_ptr.dtype.element_ty), mask=m)
        act = _swiglu_fwd_math(g, u).to(DGU_ptr.dtype.element_ty)  # the forward's bits; masked rows are 0
        dyb = tl.load(DYB_ptr + rows[:, None] * r + ks[None, :], mask=rmask[:, None] & (ks < r)[None, :],
                      other=0.0)  # (BLOCK_R, R)
        if FP32_DOT:
            acc += tl.dot(tl.trans(dyb.to(tl.float32)), act.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(dyb), act)
    tl.store(PART_ptr + tl.program_id(1).to(tl.int64) * R * n_cols + ks[:, None] * n_cols + cols[None, :], acc,
             mask=cmask[None, :])


# Not autotuned: the in-place variant overwrites gu, so the autotuner's reruns would read gradients (its
# restore_value clones gu, the very memory in-place saves). 64 x 64 bf16 tiles: each row's 64 columns are one
# 128-byte line; 4 warps. The interpreter takes large tiles (it pays per operation).
_BWD_BLOCK_R, _BWD_BLOCK_C, _BWD_WARPS, _BWD_STAGES = (64, 128, 4, 1) if triton_interpreting() else (64, 64, 4, 3)


def _splits(n_rows: int, col_blocks: int, device: torch.device) -> int:
    """Row shares so that col_blocks x shares >= 2 programs per SM (at least one row tile each)."""
    want = triton.cdiv(2 * num_sms(device), col_blocks)
    return max(1, min(want, triton.cdiv(n_rows, _BWD_BLOCK_R)))


def swiglu_gate_up_backward_da(d_act: torch.Tensor, gu: torch.Tensor, dyb: torch.Tensor,
                               in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """d_act (N, I), gu (N, 2I) with unit column stride, dyb (N, r) contiguous, one dtype -> (d_gu (N, 2I),
    dA (r, I) = dyb^T silu(gate) * up). in_place: d_gu is written over gu (both must be contiguous; gu's
    values are gone) and returned as gu itself; else into a fresh contiguous tensor.

    d_gu is bit for bit ``swiglu_gate_up_backward(d_act, gu)``; dA accumulates in fp32 and is rounded once."""
    n, i = d_act.shape
    r = dyb.shape[1]
    _check(gu.shape == (n, 2 * i) and dyb.shape[0] == n and d_act.stride(1) == 1 and gu.stride(1) == 1
           and dyb.is_contiguous() and d_act.dtype == gu.dtype == dyb.dtype and 0 < r <= MAX_RANK
           and (not in_place or gu.is_contiguous()),
           f"d_act {tuple(d_act.shape)}, gu {tuple(gu.shape)}, dyb {tuple(dyb.shape)} ({d_act.dtype}, {gu.dtype}, "
           f"{dyb.dtype}): (N, I), (N, 2I), contiguous (N, r <= {MAX_RANK}), unit column strides, one dtype"
           + ("; in place needs a contiguous gu" if in_place else ""))
    dgu = gu if in_place else torch.empty((n, 2 * i), device=gu.device, dtype=gu.dtype)
    if not (n and i):
        return dgu, torch.zeros((r, i), device=gu.device, dtype=gu.dtype)
    col_blocks = triton.cdiv(i, _BWD_BLOCK_C)
    splits = _splits(n, col_blocks, gu.device)
    rows_per_split = triton.cdiv(triton.cdiv(n, splits), _BWD_BLOCK_R) * _BWD_BLOCK_R
    splits = triton.cdiv(n, rows_per_split)
    rp = _rank_pad(r)
    part = torch.empty((splits, rp, i), device=gu.device, dtype=torch.float32)
    _swiglu_da_bwd_kernel[(col_blocks, splits)](
        d_act, gu, dgu, dyb, part, n, i, d_act.stride(0), gu.stride(0), dgu.stride(0), rows_per_split, r,
        R=rp, IN_PLACE=in_place, FP32_DOT=_fp32_dot(gu), BLOCK_R=_BWD_BLOCK_R, BLOCK_C=_BWD_BLOCK_C,
        num_warps=_BWD_WARPS, num_stages=_BWD_STAGES)
    da = part[0, :r] if splits == 1 else part[:, :r].sum(0)
    return dgu, da.to(gu.dtype)


def _fp32_dot(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 or triton_interpreting()


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"swiglu_lora: {what}; lay the tensors out so (the LoRA MLP's callers do)")
