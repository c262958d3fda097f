"""SwiGLU on packed gate|up fused with a LoRA down_proj's rank-r products, forward and backward.

Shapes: gu (N, 2I) = [gate | up], A (r, I) (down_proj's lora_A), act = silu(gate) * up (N, I).
- forward: ``swiglu_gate_up_xa(gu, A) -> (act, xa)``, xa = act A^T (N, r): the kernel that writes act
  also multiplies it by A^T as it goes, so the (N, I) act is not read again by a skinny GEMM.
- backward: ``swiglu_gate_up_backward_da(d_act, gu, dyb) -> (d_gu, dA, None)``, dA = dyb^T act (r, I) with
  dyb = s dy B (N, r): the SwiGLU backward rebuilds act in registers for dA instead of writing it out. Given
  the x A^T of a LoRA gate/up pair that made gu (``gate_up_xa``), it also makes their dB = s d_gate^T xa_gate
  and s d_up^T xa_up (I, r_g), (I, r_u) from the d_gu tiles it holds: two more skinny GEMMs that read d_gu.

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


def swiglu_gate_up_backward_da_ref(d_act, gu, dyb, gate_up_xa=None):
    """(d_gu (N, 2I), dA = dyb^T act (r, I), dBs) for act = swiglu_gate_up(gu), upstream d_act (N, I), dyb (N, r);
    dBs = (s_g d_gate^T xa[:, :r_g], s_u d_up^T xa[:, r_g:r_g + r_u]) for gate_up_xa = (xa, r_g, r_u, s_g, s_u),
    else None."""
    with torch.enable_grad():
        g = gu.detach().requires_grad_()
        act = swiglu_gate_up_ref(g)
        (d_gu,) = torch.autograd.grad(act, g, d_act)
    dbs = None
    if gate_up_xa is not None:
        xa, r_g, r_u, s_g, s_u = gate_up_xa
        d_gate, d_up = d_gu.chunk(2, dim=-1)
        dbs = (s_g * (d_gate.t() @ xa[:, :r_g]), s_u * (d_up.t() @ xa[:, r_g:r_g + r_u]))
    return d_gu, dyb.t() @ act.detach(), dbs


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
def _dot_t(a, b, FP32_DOT: tl.constexpr):
    """a^T b with fp32 accumulation (fp32 IEEE on fp32 values under FP32_DOT)."""
    if FP32_DOT:
        return tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), input_precision="ieee")
    return tl.dot(tl.trans(a), b)


@triton.jit
def _swiglu_da_bwd_kernel(DY_ptr, GU_ptr, DGU_ptr, DYB_ptr, PART_ptr, XA_ptr, DBG_ptr, DBU_ptr, n_rows, n_cols,
                          dy_row_stride, gu_row_stride, dgu_row_stride, xa_row_stride, rows_per_split, r, r_g, r_u,
                          R: tl.constexpr, RG: tl.constexpr, RU: tl.constexpr, HAS_DB: tl.constexpr,
                          IN_PLACE: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Program (column block, split): BLOCK_C columns over rows [split * rows_per_split, + rows_per_split):
    d_gu's tiles, and the partial dA (R, BLOCK_C) of those rows into PART[split] (fp32, (splits, R, n_cols)).
    HAS_DB: also the gate/up adapters' partial dB, d_gate^T xa_gate into DBG[split] (fp32, (splits, n_cols, RG))
    and d_up^T xa_up into DBU[split], from the rounded d_gu (what the GEMMs they replace read) and xa (N, r_g +
    r_u) at row stride xa_row_stride (the gate/up group's x A^T: gate's r_g columns, then up's r_u).
    IN_PLACE: DGU_ptr is GU_ptr; every element is loaded and stored by one program at one address, after a
    barrier between the tile's loads and stores (as ``swiglu._swiglu_gate_up_bwd_body``)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    ks = tl.arange(0, R)
    kg = tl.arange(0, RG)
    ku = tl.arange(0, RU)
    split = tl.program_id(1).to(tl.int64)
    start = split * rows_per_split
    stop = tl.minimum(start + rows_per_split, n_rows)
    acc = tl.zeros((R, BLOCK_C), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_C, RG), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_C, RU), dtype=tl.float32)
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
        dg = dg.to(DGU_ptr.dtype.element_ty)
        du = du.to(DGU_ptr.dtype.element_ty)
        tl.store(DGU_ptr + d_off, dg, mask=m)
        tl.store(DGU_ptr + d_off + n_cols, du, mask=m)
        act = _swiglu_fwd_math(g, u).to(DGU_ptr.dtype.element_ty)  # the forward's bits; masked rows are 0
        dyb = tl.load(DYB_ptr + rows[:, None] * r + ks[None, :], mask=rmask[:, None] & (ks < r)[None, :],
                      other=0.0)  # (BLOCK_R, R)
        acc += _dot_t(dyb, act, FP32_DOT)
        if HAS_DB:  # masked rows: dy = 0 gives dg = du = 0
            x_off = XA_ptr + rows[:, None] * xa_row_stride
            xg = tl.load(x_off + kg[None, :], mask=rmask[:, None] & (kg < r_g)[None, :], other=0.0)
            xu = tl.load(x_off + r_g + ku[None, :], mask=rmask[:, None] & (ku < r_u)[None, :], other=0.0)
            acc_g += _dot_t(dg, xg, FP32_DOT)
            acc_u += _dot_t(du, xu, FP32_DOT)
    tl.store(PART_ptr + split * R * n_cols + ks[:, None] * n_cols + cols[None, :], acc, mask=cmask[None, :])
    if HAS_DB:
        tl.store(DBG_ptr + split * n_cols * RG + cols[:, None] * RG + kg[None, :], acc_g, mask=cmask[:, None])
        tl.store(DBU_ptr + split * n_cols * RU + cols[:, None] * RU + ku[None, :], acc_u, mask=cmask[:, None])


# Not autotuned: the in-place variant overwrites gu, so the autotuner's reruns would read gradients (its
# restore_value clones gu, the very memory in-place saves). 64 x 64 bf16 tiles: each row's 64 columns are one
# 128-byte line; 4 warps. The interpreter takes large tiles (it pays per operation).
_BWD_BLOCK_R, _BWD_BLOCK_C, _BWD_WARPS, _BWD_STAGES = (64, 128, 4, 1) if triton_interpreting() else (64, 64, 4, 3)


_PROGRAMS_PER_SM = 2  # the backward's grid: enough row shares for this many programs per SM


def _splits(n_rows: int, col_blocks: int, device: torch.device) -> int:
    """Row shares so that col_blocks x shares >= _PROGRAMS_PER_SM programs per SM (at least one row tile each)."""
    want = triton.cdiv(_PROGRAMS_PER_SM * num_sms(device), col_blocks)
    return max(1, min(want, triton.cdiv(n_rows, _BWD_BLOCK_R)))


def swiglu_gate_up_backward_da(d_act: torch.Tensor, gu: torch.Tensor, dyb: torch.Tensor, in_place: bool = False,
                               gate_up_xa=None):
    """d_act (N, I), gu (N, 2I) with unit column stride, dyb (N, r) contiguous, one dtype -> (d_gu (N, 2I),
    dA (r, I) = dyb^T silu(gate) * up, dBs). in_place: d_gu is written over gu (both must be contiguous; gu's
    values are gone) and returned as gu itself; else into a fresh contiguous tensor.

    gate_up_xa: None (dBs None), or (xa, r_g, r_u, s_g, s_u) of the LoRA gate/up pair that made gu: xa (N, >= r_g +
    r_u) with unit column stride, gate's x A_g^T then up's; dBs = (s_g d_gate^T xa_g (I, r_g), s_u d_up^T xa_u
    (I, r_u)) from the rounded d_gu, as their GEMMs compute them.

    d_gu is bit for bit ``swiglu_gate_up_backward(d_act, gu)``; dA and dBs accumulate in fp32, rounded once."""
    n, i = d_act.shape
    r = dyb.shape[1]
    _check(gu.shape == (n, 2 * i) and dyb.shape[0] == n and d_act.stride(1) == 1 and gu.stride(1) == 1
           and dyb.is_contiguous() and d_act.dtype == gu.dtype == dyb.dtype and 0 < r <= MAX_RANK
           and (not in_place or gu.is_contiguous()),
           f"d_act {tuple(d_act.shape)}, gu {tuple(gu.shape)}, dyb {tuple(dyb.shape)} ({d_act.dtype}, {gu.dtype}, "
           f"{dyb.dtype}): (N, I), (N, 2I), contiguous (N, r <= {MAX_RANK}), unit column strides, one dtype"
           + ("; in place needs a contiguous gu" if in_place else ""))
    xa, r_g, r_u, s_g, s_u = gate_up_xa if gate_up_xa is not None else (dyb, 1, 1, 1.0, 1.0)
    if gate_up_xa is not None:
        _check(xa.dim() == 2 and xa.shape[0] == n and xa.shape[1] >= r_g + r_u and xa.stride(1) == 1
               and xa.dtype == gu.dtype and 0 < r_g <= MAX_RANK and 0 < r_u <= MAX_RANK,
               f"gate/up xa {tuple(xa.shape)} {xa.dtype} with ranks {r_g}, {r_u}: (N, >= r_g + r_u), unit column "
               f"stride, gu's dtype, ranks <= {MAX_RANK}")
    dev, dt = gu.device, gu.dtype
    dgu = gu if in_place else torch.empty((n, 2 * i), device=dev, dtype=dt)
    col_blocks = triton.cdiv(i, _BWD_BLOCK_C)
    splits = _splits(n, col_blocks, dev) if n else 1
    rows_per_split = max(triton.cdiv(triton.cdiv(n, splits), _BWD_BLOCK_R) * _BWD_BLOCK_R, _BWD_BLOCK_R)
    splits = max(triton.cdiv(n, rows_per_split), 1)
    rp, rg, ru = _rank_pad(r), _rank_pad(r_g), _rank_pad(r_u)
    has_db = gate_up_xa is not None
    alloc = torch.empty if n and i else torch.zeros  # with no rows the kernel does not run: zero gradients
    part = alloc((splits, rp, i), device=dev, dtype=torch.float32)
    dbg = alloc((splits, i, rg) if has_db else (1,), device=dev, dtype=torch.float32)
    dbu = alloc((splits, i, ru) if has_db else (1,), device=dev, dtype=torch.float32)
    if n and i:
        _swiglu_da_bwd_kernel[(col_blocks, splits)](
            d_act, gu, dgu, dyb, part, xa, dbg, dbu, n, i, d_act.stride(0), gu.stride(0), dgu.stride(0),
            xa.stride(0), rows_per_split, r, r_g, r_u, R=rp, RG=rg, RU=ru, HAS_DB=has_db, IN_PLACE=in_place,
            FP32_DOT=_fp32_dot(gu), BLOCK_R=_BWD_BLOCK_R, BLOCK_C=_BWD_BLOCK_C, num_warps=_BWD_WARPS,
            num_stages=_BWD_STAGES)
    da = _add_shares(part)[:r].to(dt)
    if not has_db:
        return dgu, da, None
    return dgu, da, ((_add_shares(dbg)[:, :r_g] * s_g).to(dt), (_add_shares(dbu)[:, :r_u] * s_u).to(dt))


def _add_shares(part: torch.Tensor) -> torch.Tensor:
    """(splits, ...) fp32 partial sums -> their fp32 sum (no copy for one share)."""
    return part[0] if part.shape[0] == 1 else part.sum(0)


def _fp32_dot(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 or triton_interpreting()


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"swiglu_lora: {what}; lay the tensors out so (the LoRA MLP's callers do)")
