"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, with an optional fused residual add.

Shapes: x (..., H), weight (H,), residual (..., H) or None.
With a residual, the op computes s = x + residual and returns (rms_norm(s), s) so the next block can
reuse s as its residual stream.

The Triton path (``impl="triton"``) has two front doors over the same launchers:
- eager: ``RMSNormFunction``, a plain autograd.Function that launches the kernels directly. The
  ``torch.library`` custom-op dispatch costs ~0.1 ms of CPU per call, more than the kernel itself at the
  0.5B shape (forward ~14 us of bytes at 4.25 TB/s), so eager calls skip it.
- under torch.compile: the ``torch.library`` op ``chronicals::rms_norm`` (backward
  ``chronicals::rms_norm_backward``), so the compiler sees each as one node.

- forward: one program per BLOCK_M rows (several rows per program when H is small, e.g. 4 rows of
  896); math in fp32; writes y, s (with a residual) and rstd (N,) fp32 for the backward.
- backward: a persistent grid of P = (2, 4 or 8, autotuned) programs per SM, each looping over row
  blocks and keeping its share of dweight in fp32 registers; the (P, H) fp32 partials are summed at the
  end (skipped with the partials when the weight is frozen, as under LoRA). Byte arithmetic at the 8B
  shape (N=8192, H=4096, bf16): the op must move 3NH x 2 B = 201 MB
  (read s, dy; write dx), 47 us at 4.25 TB/s. Partials cost P x H x 4 B written + read again by the sum:
  P=264 (2/SM): 2 x 4.3 MB = 4% extra; P=528: 8%; P=1056: 17%. What they buy: each program walks
  4096 row blocks / P serially (31 at P=132, 16 at 264, 4 at 1056) with one block's loads (2 rows x 4096
  x 2 tensors x 2 B = 32 KB) in flight at a time; 8 MB in flight across 264 programs is only about 2x the
  bandwidth-delay product (4.25 TB/s x ~1 us), so more resident programs hide the latency of the
  load -> row-reduce -> store chain better. The autotuner picks the count on the GPU (key includes H).
  One program per row writing (N, H) partials would move another 2 x N x H x 4 bytes, more than the op.
- H larger than one block (8192 on CUDA, 1024 in the interpreter so the tests cover it) is handled by
  looping over column blocks, never by truncating.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .._numbers import is_int
from ._impl import resolve_impl, triton_interpreting
from .recompute import is_active, offer
from ._triton_utils import check_device, num_sms, tune_configs

# Widest row kept in registers in one piece. 8192 fp32 values over 16 warps are 16 per thread per tensor;
# past it the kernels loop over column blocks. The interpreter uses 1024 so hidden 4864 exercises the loop.
MAX_BLOCK_H = 1024 if triton_interpreting() else 8192
# Elements per tile: rows are packed into a tile until it holds about this many. The persistent backward
# walks its rows serially, so it takes twice the tile to keep ~2 x 16 KB of loads in flight per program
# (264 programs x 32 KB ~ 8 MB in flight, above the ~4 MB bandwidth-delay product of an H200).
TILE_ELEMS = 4096
BWD_TILE_ELEMS = 8192
# Persistent backward grid: programs per SM tried by the autotuner (see the module docstring for bytes).
PROGRAMS_PER_SM = (2, 4, 8)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Pure-PyTorch reference, numerically the Hugging Face Llama RMSNorm (fp32 math, cast, then scale). float64
    inputs too are normalized in fp32, as transformers does (``hidden_states.to(torch.float32)``): a float64 model
    matches transformers' float64 model, not float64 arithmetic (~5e-7 apart)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    return y if residual is None else (y, residual)


# ---------------------------------------------------------------- kernels

_WARPS = [triton.Config({}, num_warps=w) for w in (8, 4, 16, 2)]


@triton.autotune(configs=tune_configs(_WARPS), key=["H", "BLOCK_M", "BLOCK_H", "HAS_RESIDUAL"])
@triton.jit
def _rms_norm_fwd_kernel(X_ptr, R_ptr, W_ptr, Y_ptr, S_ptr, RSTD_ptr, N, H, x_row_stride, r_row_stride,
                         y_row_stride, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                         SINGLE_BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rows < N
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    x_row = X_ptr + rows[:, None] * x_row_stride  # (BLOCK_M, 1) pointers
    r_row = R_ptr + rows[:, None] * r_row_stride
    o_off = rows[:, None] * H  # s is contiguous (N, H)
    y_off = rows[:, None] * y_row_stride  # y: rows of a (N, H + spare) buffer
    if SINGLE_BLOCK:
        mask = row_ok[:, None] & (cols[None, :] < H)
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(r_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = x.to(S_ptr.dtype.element_ty)  # normalize the stream as stored, like the reference
            tl.store(S_ptr + o_off + cols[None, :], s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)  # (BLOCK_M,)
        w = tl.load(W_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y_ptr + y_off + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < H)
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                s = x.to(S_ptr.dtype.element_ty)
                tl.store(S_ptr + o_off + c[None, :], s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / H + eps)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < H)
            # recompute x (+ residual) instead of re-reading s: the stores above may come from other threads
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                x = x.to(S_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(W_ptr + c, mask=c < H, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * w[None, :]
            tl.store(Y_ptr + y_off + c[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(RSTD_ptr + rows, rstd, mask=row_ok)


@triton.autotune(configs=tune_configs(_WARPS), key=["H", "BLOCK_M", "BLOCK_H"])
@triton.jit
def _rms_norm_apply_kernel(S_ptr, RSTD_ptr, W_ptr, Y_ptr, N, H, y_row_stride, BLOCK_M: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    """y = s * rstd * w with the saved rstd: the forward's output rebuilt in backward, bit for bit (the same
    fp32 products in the same order on the same stored s). s contiguous (N, H); y rows of (N, H + spare)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    rstd = tl.load(RSTD_ptr + rows, mask=row_ok, other=0.0)
    for start in range(0, H, BLOCK_H):
        c = start + cols
        mask = row_ok[:, None] & (c[None, :] < H)
        x = tl.load(S_ptr + rows[:, None] * H + c[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W_ptr + c, mask=c < H, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y_ptr + rows[:, None] * y_row_stride + c[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


# (programs per SM, warps); the interpreter takes the first. 9 configs x ~0.15 s of tuning once per H.
_BWD_CONFIGS = [triton.Config({"PROGRAMS_PER_SM": p}, num_warps=w) for p in PROGRAMS_PER_SM for w in (8, 4, 16)]


@triton.autotune(configs=tune_configs(_BWD_CONFIGS), key=["H", "BLOCK_M", "BLOCK_H", "HAS_DS", "HAS_DW"])
@triton.jit
def _rms_norm_bwd_kernel(DY_ptr, DS_ptr, S_ptr, W_ptr, RSTD_ptr, DX_ptr, DW_ptr, N, H, dy_row_stride,
                         ds_row_stride, dx_row_stride, HAS_DS: tl.constexpr, HAS_DW: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
                         PROGRAMS_PER_SM: tl.constexpr):
    """dx = rstd * (w*dy - xhat * mean(w*dy*xhat)) (+ ds), xhat = s*rstd; dw partial = sum_rows dy*xhat.

    Persistent: program p handles row blocks p, p + P, p + 2P, ... and writes dw partial row p of (P, H)
    (HAS_DW; a frozen weight, as under LoRA, skips the partials and their sum).
    s is contiguous (N, H); dy, ds and dx have a row stride (dx's: a consumer's spare columns after each row).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    dw_row = DW_ptr + pid.to(tl.int64) * H
    if SINGLE_BLOCK:
        col_ok = cols < H
        w = tl.load(W_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for blk in range(pid, n_blocks, nprog):
            rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < N
            rows = rows.to(tl.int64)
            mask = row_ok[:, None] & col_ok[None, :]
            rstd = tl.load(RSTD_ptr + rows, mask=row_ok, other=0.0)
            xhat = tl.load(S_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat = xhat * rstd[:, None]
            dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            wdy = w[None, :] * dy
            mean = tl.sum(wdy * xhat, axis=1) / H
            dx = (wdy - xhat * mean[:, None]) * rstd[:, None]
            if HAS_DS:
                dx += tl.load(DS_ptr + rows[:, None] * ds_row_stride + cols[None, :], mask=mask,
                              other=0.0).to(tl.float32)
            tl.store(DX_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)
            if HAS_DW:
                dw_acc += dy * xhat
        if HAS_DW:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    else:
        if HAS_DW:
            for start in range(0, H, BLOCK_H):
                tl.store(dw_row + start + cols, tl.zeros([BLOCK_H], dtype=tl.float32), mask=start + cols < H)
            tl.debug_barrier()
        for blk in range(pid, n_blocks, nprog):
            rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < N
            rows = rows.to(tl.int64)
            rstd = tl.load(RSTD_ptr + rows, mask=row_ok, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
            for start in range(0, H, BLOCK_H):  # pass 1: mean(w*dy*xhat)
                c = start + cols
                mask = row_ok[:, None] & (c[None, :] < H)
                s = tl.load(S_ptr + rows[:, None] * H + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + c[None, :], mask=mask, other=0.0)
                w = tl.load(W_ptr + c, mask=c < H, other=0.0).to(tl.float32)
                acc += w[None, :] * dy.to(tl.float32) * s
            mean = tl.sum(acc, axis=1) * rstd / H
            for start in range(0, H, BLOCK_H):  # pass 2: dx and this program's dw partial
                c = start + cols
                col_ok = c < H
                mask = row_ok[:, None] & col_ok[None, :]
                xhat = tl.load(S_ptr + rows[:, None] * H + c[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = xhat * rstd[:, None]
                dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + c[None, :], mask=mask, other=0.0)
                dy = dy.to(tl.float32)
                w = tl.load(W_ptr + c, mask=col_ok, other=0.0).to(tl.float32)
                dx = (w[None, :] * dy - xhat * mean[:, None]) * rstd[:, None]
                if HAS_DS:
                    dx += tl.load(DS_ptr + rows[:, None] * ds_row_stride + c[None, :], mask=mask,
                                  other=0.0).to(tl.float32)
                tl.store(DX_ptr + rows[:, None] * dx_row_stride + c[None, :], dx.to(DX_ptr.dtype.element_ty), mask=mask)
                if HAS_DW:
                    part = tl.load(dw_row + c, mask=col_ok, other=0.0)
                    tl.store(dw_row + c, part + tl.sum(dy * xhat, axis=0), mask=col_ok)
                    # the next row block re-reads this partial; make the stores visible to all threads first
                    tl.debug_barrier()


# ---------------------------------------------------------------- launchers


@functools.lru_cache(maxsize=64)
def _blocks(h: int, tile: int = TILE_ELEMS) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_H columns) of a tile for hidden size h (cached: called on every launch)."""
    block_h = min(triton.next_power_of_2(h), MAX_BLOCK_H)
    return max(1, min(64, tile // block_h)), block_h


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """(..., H) -> (N, H) with unit column stride (a view when possible)."""
    if t.dim() != 2:
        t = t.reshape(-1, h)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], eps: float,
                     spare: int = 0):
    """x, residual (N, H) with unit column stride, weight (H,) -> y (N, H), s (N, H) or (0,), rstd (N,) fp32.

    spare > 0: y is the first H columns of a new (N, H + spare) buffer (row stride H + spare), the last ones
    left unwritten (see ``rms_norm``)."""
    n, h = x.shape
    y = torch.empty((n, h + spare), device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    y = y[:, :h] if spare else y
    s = torch.empty((n, h), device=x.device, dtype=x.dtype) if residual is not None else x.new_empty(0)
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    if n == 0:
        return y, s, rstd
    block_m, block_h = _blocks(h)
    r = residual if residual is not None else x
    _rms_norm_fwd_kernel[(triton.cdiv(n, block_m),)](
        x, r, weight, y, s, rstd, n, h, x.stride(0), r.stride(0), y.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_H=block_h, SINGLE_BLOCK=block_h >= h)
    return y, s, rstd


def rms_norm_apply(s: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                   spare: int = 0):
    """s (N, H) contiguous, rstd (N,) fp32, weight (H,) -> the forward's y again (recompute), in a new contiguous
    (N, H + spare) buffer's first H columns; the buffer is returned (spare 0: y itself)."""
    n, h = s.shape
    out = torch.empty((n, h + spare), device=s.device, dtype=out_dtype)
    if n:
        block_m, block_h = _blocks(h)
        _rms_norm_apply_kernel[(triton.cdiv(n, block_m),)](s, rstd, weight, out, n, h, out.stride(0),
                                                           BLOCK_M=block_m, BLOCK_H=block_h)
    return out


def rms_norm_backward(dy: torch.Tensor, ds: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor, need_dw: bool = True, dx_spare: int = 0):
    """dy (N, H), ds (N, H) or None (gradient of the returned stream), s (N, H) contiguous -> dx (N, H) in
    s.dtype, dweight (H,) in weight.dtype (None without ``need_dw``: a frozen weight). ``dx_spare``: dx is the
    first H columns of a new (N, H + dx_spare) buffer (``grad_spare_columns`` finds it)."""
    n, h = s.shape
    dx = torch.empty((n, h + dx_spare), device=s.device, dtype=s.dtype)
    if dx_spare:
        dx._chronicals_grad_spare = dx_spare  # the mark grad_spare_columns reads through a view's ._base
        dx = dx[:, :h]
    if n == 0:
        return dx, (torch.zeros_like(weight) if need_dw else None)
    block_m, block_h = _blocks(h, BWD_TILE_ELEMS)
    sms, n_blocks = num_sms(s.device), triton.cdiv(n, block_m)
    # room for the largest grid the autotuner may pick; only the launched programs' rows are summed
    dw_part = (torch.empty((min(sms * max(PROGRAMS_PER_SM), n_blocks), h), device=s.device, dtype=torch.float32)
               if need_dw else dx)  # without dW the kernel never touches the pointer
    dd = ds if ds is not None else dy
    _rms_norm_bwd_kernel[lambda meta: (min(sms * meta["PROGRAMS_PER_SM"], n_blocks),)](
        dy, dd, s, weight, rstd, dx, dw_part, n, h, dy.stride(0), dd.stride(0), dx.stride(0),
        HAS_DS=ds is not None, HAS_DW=need_dw, BLOCK_M=block_m, BLOCK_H=block_h, SINGLE_BLOCK=block_h >= h)
    if not need_dw:
        return dx, None
    programs = min(sms * _rms_norm_bwd_kernel.best_config.kwargs["PROGRAMS_PER_SM"], n_blocks)
    return dx, dw_part[:programs].sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """The eager door: x, residual (N, H) with unit column stride (or residual None), weight (H,) ->
    (y (N, H), s (N, H) or an empty tensor without a residual). Same launchers as the custom op."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, recompute=False, spare=0, held=None, grad_spare=0):
        y, s, rstd = rms_norm_forward(x, weight, residual, eps, spare)
        ctx.has_residual, ctx.grad_spare = residual is not None, grad_spare
        # the backward kernel reads s as contiguous (N, H); x may be row-strided
        kept = s if ctx.has_residual else x.contiguous()
        ctx.save_for_backward(kept, weight, rstd)
        full = _whole(y, spare)  # y, or its (N, H + spare) buffer
        if held is not None:
            held.append(full)
        if recompute:  # consumers that save y (q/k/v, gate/up) get it rebuilt from what this node keeps
            offer(full, functools.partial(rms_norm_apply, kept, rstd, weight, y.dtype, spare))
        if not ctx.has_residual:
            ctx.mark_non_differentiable(s)
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    @once_differentiable  # the kernels' backward builds no graph: a double backward raises
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        h = s.shape[1]
        # dy is None when only the stream s was used; ds is None when s was unused (then HAS_DS=False)
        dy = torch.zeros_like(s) if dy is None else _rows(dy, h)
        dx, dw = rms_norm_backward(dy, _rows(ds, h) if (ctx.has_residual and ds is not None) else None, s,
                                   weight, rstd, need_dw=ctx.needs_input_grad[1], dx_spare=ctx.grad_spare)
        # x and residual enter only through s = x + residual, so both receive ds_total (like add's backward)
        return dx, dw, (dx if ctx.has_residual else None), None, None, None, None, None


# ---------------------------------------------------------------- torch.library registration


@torch.library.custom_op("chronicals::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor],
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rms_norm_forward(x, weight, residual, eps)


@_rms_norm_op.register_fake
def _(x, weight, residual, eps):
    n, h = x.shape
    y = x.new_empty((n, h), dtype=torch.promote_types(x.dtype, weight.dtype))
    s = x.new_empty((n, h)) if residual is not None else x.new_empty(0)
    return y, s, x.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("chronicals::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, ds: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, ds, s.contiguous(), weight, rstd)


@_rms_norm_backward_op.register_fake
def _(dy, ds, s, weight, rstd):
    return torch.empty_like(s, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, residual, _ = inputs
    _, s, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(s if ctx.has_residual else x, weight, rstd)


def _backward(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.chronicals.rms_norm_backward(
        _rows(dy, dy.shape[-1]), _rows(ds, ds.shape[-1]) if ctx.has_residual else None, s, weight, rstd)
    # x and residual enter only through s = x + residual, so both receive ds_total (like add's backward)
    return dx, dw, (dx if ctx.has_residual else None), None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def _rms_norm_ref_contiguous(x, weight, eps, spare=0):
    """The reference's y in a new contiguous (N, H + spare) buffer's first H columns (spare 0: y itself)."""
    y = rms_norm_ref(x, weight, eps)
    return y.contiguous() if not spare else F.pad(y.reshape(-1, y.shape[-1]), (0, spare))


def _whole(y: torch.Tensor, spare: int) -> torch.Tensor:
    """y (N, H), the first H columns of a contiguous (N, H + spare) buffer -> that buffer (y itself for spare 0),
    as a tensor of its own: writes to its last columns do not count as changes of y (no version bump that a save
    of y in autograd, or a recipe holding y, would take for an in-place change of y's values)."""
    if not spare:
        return y
    n, h = y.shape
    with torch.no_grad():
        return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), (n, h + spare), (h + spare, 1))


def spare_columns(y: torch.Tensor, width: int) -> torch.Tensor | None:
    """The (N, width) buffer whose first H columns are ``y`` (..., H), when ``y`` came from ``rms_norm(...,
    spare=width - H)`` and is one of its buffer's own rows, else None. Its last columns are free for the caller."""
    full = getattr(y, "_chronicals_spare", None)
    if full is None or y.dim() < 1 or full.shape != (y.numel() // max(y.shape[-1], 1), width):
        return None
    return full if full.data_ptr() == y.data_ptr() else None


def grad_spare_columns(dy: torch.Tensor, width: int) -> torch.Tensor | None:
    """The (N, width) buffer whose first H columns are ``dy`` (N, H), when dy is the x (or residual) gradient of an
    ``rms_norm(..., grad_spare=width - H)`` (or a view of it with the same rows), else None. Its last columns are
    free for the caller: the producer of the norm's x writes there (``lora.layer``'s [dy | s dy B])."""
    full = dy._base
    if (full is None or dy.dim() != 2 or getattr(full, "_chronicals_grad_spare", 0) != width - dy.shape[1]
            or full.shape != (dy.shape[0], width) or dy.stride() != (width, 1)):
        return None
    return full if full.data_ptr() == dy.data_ptr() else None


def _check_rms_norm(x, weight, residual) -> int:
    """The argument checks both impls run (before choosing one) -> H."""
    h = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.shape != (h,) or not h:
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({h},) for x {tuple(x.shape)} "
                         "(x (..., H), weight (H,), H >= 1)")
    if not (x.is_floating_point() and weight.is_floating_point()):  # the torch impl truncated y to integers
        raise ValueError(f"rms_norm: x ({x.dtype}) and weight ({weight.dtype}) must be floating point")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}; cast it with .to(x.dtype) first")
    check_device("rms_norm", x, weight, residual)
    return h


def rms_norm(x, weight, eps: float, *, residual=None, impl: str = "auto", recompute: bool = False,
             spare: int = 0, grad_spare: int = 0):
    """RMSNorm over the last dim. Returns y, or (y, x + residual) when ``residual`` is given.

    x (..., H), weight (H,), residual (..., H) of x's dtype -> y (..., H) in promote(x, weight) dtype.
    recompute: offer y to an open ``ops.recompute`` session, so nodes that save y for backward hold
    nothing and get it rebuilt (bit-identical) from the norm's own saved input.
    spare: y is written into the first H columns of a new (N, H + spare) buffer (row stride H + spare) whose last
    ``spare`` columns are left for the consumer (``spare_columns(y, H + spare)`` returns the buffer): a LoRA group
    writes its x A^T there and runs its GEMM on [x | x A^T] without concatenating them (``lora.group``). Not under
    torch.compile (the compiler plans its own buffers): y is contiguous there.
    grad_spare: the same for backward's dx, the gradient of x (and of residual): the Triton kernel writes it into
    the first H columns of a new (N, H + grad_spare) buffer (``grad_spare_columns(dx, H + grad_spare)`` returns it),
    where the producer of x, a LoRA down_proj, puts s dy B beside its dy for one [dy | s dy B] GEMM (``lora.layer``).
    Eager Triton path only: the torch reference's autograd and the compiler make dx their own way.
    """
    h = _check_rms_norm(x, weight, residual)
    for name, v in (("spare", spare), ("grad_spare", grad_spare)):
        if not is_int(v) or v < 0:
            raise ValueError(f"rms_norm: {name}={v!r} must be an int >= 0 (columns left after each row of "
                             f"{'y' if name == 'spare' else 'dx'})")
    spare = 0 if torch.compiler.is_compiling() else int(spare)
    if resolve_impl("rms_norm", impl, x.device) == "torch":
        out = rms_norm_ref(x, weight, eps, residual)
        if not spare and not (recompute and is_active()):
            return out
        src, y = (x, out) if residual is None else (out[1], out[0])
        # contiguous: the reference keeps a transposed x's strides, and an offer owns its whole storage
        y2 = y.contiguous() if not spare else F.pad(y.reshape(-1, h), (0, spare))[:, :h]
        full = _whole(y2, spare)
        if recompute and is_active():
            offer(full, functools.partial(_rms_norm_ref_contiguous, src, weight, eps, spare))  # same ops, same input
        y = _with_spare(y2.view(y.shape), full, spare) if spare else y2  # y2: the offered tensor's own object
        return y if residual is None else (y, out[1])
    # the kernels read weight as (H,) with unit stride: a strided or expanded weight gave wrong outputs
    weight = weight.contiguous()
    x2, r2 = _rows(x, h), None if residual is None else _rows(residual, h)
    held = []  # the (N, H + spare) buffer, from the Function's forward
    if torch.compiler.is_compiling():  # one graph node for the compiler
        y, s, _ = torch.ops.chronicals.rms_norm(x2, weight, r2, float(eps))
    else:  # eager: skip the custom-op dispatch (~0.1 ms of CPU per call)
        y, s = RMSNormFunction.apply(x2, weight, r2, float(eps), bool(recompute and is_active()), spare, held,
                                     int(grad_spare))
    if x.dim() != 2:
        y, s = y.view(*x.shape[:-1], h), (s.view(*x.shape[:-1], h) if residual is not None else s)
    y = _with_spare(y, held[0] if held else None, spare)
    return y if residual is None else (y, s)


def _with_spare(y: torch.Tensor, full: torch.Tensor | None, spare: int) -> torch.Tensor:
    """y carrying its (N, H + spare) buffer for ``spare_columns``: the attribute keeps that tensor (and the recompute
    offer made on it, which lives as long as it does) exactly as long as y's own Python object."""
    if spare and full is not None:
        y._chronicals_spare = full
    return y
