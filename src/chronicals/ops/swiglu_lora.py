"""SwiGLU on a packed gate|up with a LoRA down_proj's rank-r products folded in (the skinny GEMMs that read act).

Shapes: gu (N, 2I) = [gate | up], act = silu(gate) * up (N, I); down_proj's LoRA A (r, I); dyb (N, r) =
s dy B (the LoRA branch's upstream gradient, already scaled).

A LoRA down_proj reads act twice beyond its base GEMM: xa = act A^T (N, r) in forward and dA = dyb^T act
(r, I) in backward. Each is a cuBLAS GEMM with a rank-32 side that only streams act: at the Qwen2.5-0.5B
LoRA protocol (16,384 x 4,864) 45 us and 51 us a layer in the H200 profile (git 6667fbd), 2.3 ms of a
~89 ms step over 24 layers. Here the SwiGLU kernels that already hold act in registers do them:
- ``swiglu_gate_up_xa(gu, a)`` -> (act, xa): one program per BLOCK_R rows walks the I columns, writes act
  and accumulates act_tile @ A^T_tile into a (BLOCK_R, r) fp32 tile: act bit-identical to
  ``swiglu_gate_up_forward``'s, xa from the same bf16 act as cuBLAS would read, summed in another order.
- ``swiglu_gate_up_backward_da(d_act, gu, dyb, in_place)`` -> (d_gu, dA): one program per (BLOCK_C columns,
  row split) walks its rows, writes d_gu (over gu when in_place) and accumulates dyb_tile^T @ act_tile into an
  (r, BLOCK_C) fp32 tile; act is never stored (the unfused path writes it only for dA's GEMM to read: one
  (N, I) write and read less). The row splits' partial sums (split, r, I) fp32, ~2.5 MB at 0.5B, are
  added by one ``sum(0)`` in a fixed order, so dA is deterministic.
Rank r up to 64 (``fused_ok``): the accumulator tiles live in registers.
Under TRITON_INTERPRET=1 the dots run in fp32 (the interpreter's bf16 arithmetic is not the GPU's).
The reference twins: ``swiglu_gate_up_xa_ref`` and ``swiglu_gate_up_backward_da_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._impl import triton_interpreting
from ._triton_utils import num_sms, tune_configs
from .swiglu import _swiglu_bwd_math, _swiglu_fwd_math, swiglu_gate_up_ref

MAX_RANK = 64  # accumulators (BLOCK_R, r) / (r, BLOCK_C) fp32 in registers: 64 x 64 x 4 B = 16 KB a program


def fused_ok(gu: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether these kernels take gu (N, 2I) and A (r, I): same floating dtype, r <= MAX_RANK, I = A's columns."""
    return (gu.dtype == a.dtype and gu.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and a.shape[0] <= MAX_RANK and 2 * a.shape[1] == gu.shape[-1])


def _r_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot wants every dimension >= 16


def swiglu_gate_up_xa_ref(gu: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (N, 2I), a (r, I) -> (act (N, I), xa = act @ a^T (N, r)), plain PyTorch."""
    act = swiglu_gate_up_ref(gu)
    return act, act @ a.t()


def swiglu_gate_up_backward_da_ref(d_act: torch.Tensor, gu: torch.Tensor, dyb: torch.Tensor):
    """d_act (N, I), gu (N, 2I), dyb (N, r) -> (d_gu (N, 2I), dA = dyb^T act (r, I)), plain PyTorch autograd."""
    with torch.enable_grad():
        g = gu.detach().requires_grad_()
        act = swiglu_gate_up_ref(g)
        d_gu = torch.autograd.grad(act, g, d_act)[0]
    return d_gu, dyb.t() @ act.detach()


# ---------------------------------------------------------------- kernels

# (BLOCK_R, BLOCK_C, warps): tl.dot needs BLOCK_R >= 16; 32 rows keep 256 programs at the 8B shape (8,192 rows)
_XA_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
               for r, c, w in ((32, 128, 4), (64, 64, 4), (64, 128, 8), (32, 64, 4), (16, 256, 4))]


@triton.autotune(configs=tune_configs(_XA_CONFIGS), key=["n_cols", "R_PAD", "size_class"])
@triton.jit
def _swiglu_gate_up_xa_kernel(GU_ptr, A_ptr, Y_ptr, XA_ptr, n_rows, n_cols, r, gu_row_stride, size_class,
                              R_PAD: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]  # (BLOCK_R, 1)
    rr = tl.arange(0, R_PAD)
    acc = tl.zeros((BLOCK_R, R_PAD), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows) & (cols[None, :] < n_cols)
        g_off = rows * gu_row_stride + cols[None, :]
        g = tl.load(GU_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU_ptr + g_off + n_cols, mask=mask, other=0.0).to(tl.float32)
        y = _swiglu_fwd_math(g, u).to(Y_ptr.dtype.element_ty)  # the forward kernels' bits
        tl.store(Y_ptr + rows * n_cols + cols[None, :], y, mask=mask)
        # A^T tile (BLOCK_C, R_PAD) from A (r, I) row-major; A is tiny and stays in L2
        at = tl.load(A_ptr + rr[None, :] * n_cols + cols[:, None], mask=(rr[None, :] < r) & (cols[:, None] < n_cols),
                     other=0.0)
        if DOT_F32:
            acc += tl.dot(y.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(y, at)
    tl.store(XA_ptr + rows * r + rr[None, :], acc.to(XA_ptr.dtype.element_ty), mask=(rows < n_rows) & (rr[None, :] < r))


@triton.jit
def _swiglu_gate_up_bwd_da_kernel(DY_ptr, GU_ptr, DGU_ptr, DYB_ptr, P_ptr, n_rows, n_cols, r, rows_per_split,
                                  gu_row_stride, dgu_row_stride, IN_PLACE: tl.constexpr, R_PAD: tl.constexpr, DOT_F32: tl.constexpr,
                                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (column block, row split): d_gu of its tiles, and P[split, :, cols] = sum over its rows of
    dyb^T act. IN_PLACE: DGU_ptr is GU_ptr; every element is loaded and stored by this program only, so a
    barrier between each tile's loads and stores orders them (as in ``ops.swiglu``'s in-place kernel)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    rr = tl.arange(0, R_PAD)
    row0 = split.to(tl.int64) * rows_per_split
    row_end = tl.minimum(row0 + rows_per_split, n_rows)
    acc = tl.zeros((R_PAD, BLOCK_C), dtype=tl.float32)
    for r0 in range(row0, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < row_end) & (cols[None, :] < n_cols)
        g_off = rows[:, None] * gu_row_stride + cols[None, :]
        d_off = rows[:, None] * dgu_row_stride + cols[None, :]
        dy = tl.load(DY_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(GU_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU_ptr + g_off + n_cols, mask=mask, other=0.0).to(tl.float32)
        if IN_PLACE:
            tl.debug_barrier()
        dg, du = _swiglu_bwd_math(dy, g, u)
        tl.store(DGU_ptr + d_off, dg.to(DGU_ptr.dtype.element_ty), mask=mask)
        tl.store(DGU_ptr + d_off + n_cols, du.to(DGU_ptr.dtype.element_ty), mask=mask)
        act = _swiglu_fwd_math(g, u).to(DGU_ptr.dtype.element_ty)  # the bits the forward wrote
        dybt = tl.load(DYB_ptr + rows[None, :] * r + rr[:, None], mask=(rr[:, None] < r) & (rows[None, :] < row_end),
                       other=0.0)  # (R_PAD, BLOCK_R)
        if DOT_F32:
            acc += tl.dot(dybt.to(tl.float32), act.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(dybt, act)
    p_off = split.to(tl.int64) * r * n_cols + rr[:, None] * n_cols + cols[None, :]
    tl.store(P_ptr + p_off, acc, mask=(rr[:, None] < r) & (cols[None, :] < n_cols))


# ---------------------------------------------------------------- launchers


def swiglu_gate_up_xa(gu: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (N, 2I) with unit column stride, a (r, I) (``fused_ok``) -> (act (N, I), xa = act a^T (N, r)), both
    contiguous in gu's dtype."""
    n, i = gu.shape[0], gu.shape[1] // 2
    r = a.shape[0]
    act = torch.empty((n, i), device=gu.device, dtype=gu.dtype)
    xa = torch.empty((n, r), device=gu.device, dtype=gu.dtype)
    if n and i:
        a = a.contiguous()
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]),)  # noqa: E731
        _swiglu_gate_up_xa_kernel[grid](gu, a, act, xa, n, i, r, gu.stride(0), max(n * i, 1).bit_length(),
                                        R_PAD=_r_pad(r), DOT_F32=triton_interpreting() or gu.dtype == torch.float32)
    elif n:
        xa.zero_()
    return act, xa


# The backward's launch shape, fixed: it may run in place, and the autotuner would rerun it on the buffers it
# has overwritten. 64 x 64 bf16 tiles over 4 warps: 8 elements (16 bytes) a thread per tensor, and a
# (32, 64) x (64, 64) dot a step.
_DA_BLOCK_R, _DA_BLOCK_C, _DA_WARPS = 64, 64, 4


def _splits(n_rows: int, col_blocks: int, device: torch.device, block_r: int) -> int:
    """Row splits so that col_blocks x splits fills the GPU twice (76 column blocks at I = 4,864: 4 splits)."""
    return max(1, min(triton.cdiv(2 * num_sms(device), col_blocks), triton.cdiv(n_rows, block_r)))


def swiglu_gate_up_backward_da(d_act: torch.Tensor, gu: torch.Tensor, dyb: torch.Tensor, in_place: bool,
                               block: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """d_act (N, I) and dyb (N, r) contiguous, gu (N, 2I) with unit column stride, one dtype (``fused_ok``) ->
    (d_gu (N, 2I), dA = dyb^T act (r, I) in dyb's dtype). in_place: d_gu is written over gu (returned as d_gu;
    gu's values are gone); else into a fresh contiguous (N, 2I)).
    block: (BLOCK_R, BLOCK_C, warps) instead of the shipped launch shape (probes only)."""
    n, i = d_act.shape
    r = dyb.shape[1]
    if (gu.shape != (n, 2 * i) or dyb.shape[0] != n or not (d_act.is_contiguous() and gu.stride(-1) == 1
                                                             and dyb.is_contiguous())
            or not (d_act.dtype == gu.dtype == dyb.dtype) or r > MAX_RANK):
        raise ValueError(f"swiglu_gate_up_backward_da: d_act {tuple(d_act.shape)}, gu {tuple(gu.shape)}, dyb "
                         f"{tuple(dyb.shape)} must be (N, I), (N, 2I), (N, r <= {MAX_RANK}) of one dtype, contiguous (gu: unit column stride) "
                         f"(got {d_act.dtype}, {gu.dtype}, {dyb.dtype}); use swiglu_gate_up_backward and a GEMM")
    d_gu = gu if in_place else torch.empty((n, 2 * i), device=gu.device, dtype=gu.dtype)
    if not (n and i):
        return d_gu, dyb.new_zeros((r, i))
    block_r, block_c, warps = block or (_DA_BLOCK_R, _DA_BLOCK_C, _DA_WARPS)
    col_blocks = triton.cdiv(i, block_c)
    splits = _splits(n, col_blocks, d_act.device, block_r)
    rows_per_split = triton.cdiv(triton.cdiv(n, splits), block_r) * block_r
    splits = triton.cdiv(n, rows_per_split)
    partial = torch.empty((splits, r, i), device=d_act.device, dtype=torch.float32)
    _swiglu_gate_up_bwd_da_kernel[(col_blocks, splits)](
        d_act, gu, d_gu, dyb, partial, n, i, r, rows_per_split, gu.stride(0), d_gu.stride(0), IN_PLACE=in_place, R_PAD=_r_pad(r),
        DOT_F32=triton_interpreting() or gu.dtype == torch.float32, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps)
    return d_gu, partial.sum(0).to(dyb.dtype)
