"""Triton kernels of the fused linear cross-entropy (see cross_entropy.py for the design and its numbers).

- ``_lce_rows_kernel``: one program per row of a logits chunk (C, V). Two passes: the online softmax over
  vocab tiles (log-sum-exp and the target logit, fp32 in registers), then the chunk overwritten in place
  with d_logits = scale * (softmax - onehot) (times the softcap derivative). One pass (``ONE_PASS``, the
  training forward): exp(z - target logit) written as it is summed, and a per-row factor that the GEMMs'
  consumers apply (4 bytes per bf16 logit instead of 6). Ignored rows skip both
  passes' math and only write zeros so the GEMMs that follow add nothing for them. A label outside
  [0, vocab) that is not ignore_index reads nothing: its loss is NaN (so a training step's NaN check stops
  the run) and its d_logits are zeros, like an ignored row's (no host-side label check: that would sync).
- ``_dw_accumulate_kernel``: dW32 (V, H) fp32 += dlogits(C, V).T @ hidden(C, H). cuBLAS offers no
  "bf16 x bf16 accumulated into an existing fp32 matrix" that torch 2.11 and 2.13 both expose, so this is
  a small tiled GEMM whose epilogue adds into the fp32 accumulator (exact fp32 accumulation of dW).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._impl import triton_interpreting
from ._triton_utils import tune_configs

# Row-kernel tiles. CUDA: one row per program, vocab tiles of 4096 (fp32 over 8 warps: 16 values per thread
# per tensor); the kernel is memory-bound (6 bytes per bf16 logit: read, read, write), so one config does.
# The interpreter pays per operation, not per element: 16 rows x 8192 columns per step keeps the V = 32000
# tests to a few dozen steps per chunk while still running the tile loop with a masked tail.
BLOCK_R_ROWS, BLOCK_V_ROWS = (16, 8192) if triton_interpreting() else (1, 4096)
ROWS_NUM_WARPS = 8


@triton.jit
def _tanh(x):
    # tanh from exp2, which saturates cleanly (exp2 -> inf gives 1, exp2 -> 0 gives -1), has an absolute error of
    # ~1e-7 that near 0 is all of it: z = softcap * tanh(raw / softcap) was off by ~softcap * 1e-7 (softcap 1e6:
    # loss off by 8e-3; 1e8: every logit 0). Below |x| = 1/4 the odd Taylor series to x^9 instead: relative error
    # < 1e-8 there (the next term, 1382/155925 x^11, is 2e-9 at 1/4); above it exp2's form is within 3e-7 relative.
    big = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(x) < 0.25, small, big)


@triton.jit
def _load_logits(ptrs, bias_ptrs, mask, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Raw GEMM logits -> (z, t) in fp32: z the (capped) logit, t = tanh(raw / softcap) (raw without a cap)."""
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
    t = z
    if HAS_SOFTCAP:
        t = _tanh(z / softcap)
        z = softcap * t
    return z, t


@triton.jit
def _logit_tile(row_ptrs, BIAS_ptr, rmask, cols, v0, V, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The (BLOCK_R, BLOCK_V) tile of logits at columns v0 + cols -> (offs, mask, z, t): z in fp32 and -inf where
    masked (outside V or a padded row), t as ``_load_logits`` gives it."""
    offs = v0 + cols
    mask = rmask[:, None] & (offs < V)
    z, t = _load_logits(row_ptrs + offs, BIAS_ptr + offs, mask, softcap, HAS_BIAS, HAS_SOFTCAP)
    return offs, mask, tl.where(mask, z, float("-inf")), t


LOG2E = tl.constexpr(1.4426950408889634)  # a jit kernel reads module globals only as constexpr
# One-pass rows (``ONE_PASS``) write w = exp(z - c), c starting at the row's target logit; w overflows bf16 / fp32
# near z - c = 88. When a vocab tile's largest logit exceeds c by more than this, c moves up to it and the row's
# tiles written so far are rescaled in place (a read and write of that prefix). So w <= e^40 (2.4e17), and the row
# factor rho = scale * e^(c - lse) >= scale * e^-(40 + ln V), far above fp32's smallest normal (1.2e-38) for any
# scale >= 1e-9. A model puts a logit 40 above the target's only where its probability for the target is below
# e^-40 (a loss above 40 for that token): the rescale is rare.
ONE_PASS_MAX_GAP = 40.0
_MAX_GAP = tl.constexpr(ONE_PASS_MAX_GAP)


@triton.jit
def _online_lse(row_ptrs, BIAS_ptr, rmask, cols, V, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Log-sum-exp of each row by online softmax over vocab tiles (m running max, s running sum of exp(z - m))."""
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs, mask, z, t = _logit_tile(row_ptrs, BIAS_ptr, rmask, cols, v0, V, softcap, HAS_BIAS, HAS_SOFTCAP)
        m_new = tl.maximum(tl.maximum(m, tl.max(z, 1)), -1e30)  # -1e30: padded rows stay finite
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new[:, None]) * LOG2E), 1)
        m = m_new
    return m + tl.log(tl.maximum(s, 1e-30))  # s >= 1 on real rows; padded rows stay finite


@triton.jit
def _write_dlogits(row_ptrs, BIAS_ptr, rmask, ok, label, lse, scale, cols, col0, V, softcap,
                   HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite the rows with d_logits = scale * (softmax - onehot) [* softcap'] from the known lse (0 unless ok)."""
    lse = tl.where(ok, lse, float("inf"))  # ignored / out-of-range rows: exp2(-inf) = 0, no overflow
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = rmask[:, None] & (offs < V)
        z, t = _load_logits(row_ptrs + offs, BIAS_ptr + offs, mask, softcap, HAS_BIAS, HAS_SOFTCAP)
        onehot = tl.where(col0 + offs == label[:, None], 1.0, 0.0)
        d = tl.exp2((z - lse[:, None]) * LOG2E) - onehot
        if HAS_SOFTCAP:
            d = d * (1.0 - t * t)  # d(softcap * tanh(x / softcap)) / dx
        d = tl.where(ok[:, None], d, 0.0) * scale[:, None]
        tl.store(row_ptrs + offs, d.to(row_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _lce_rows_kernel(L_ptr, l_row_stride, LABELS_ptr, BIAS_ptr, SCALE_ptr, scale_stride, LOSS_ptr, LSE_ptr, RHO_ptr,
                     GAMMA_ptr, row0, col0, C, V, vocab, ignore_index, softcap,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_LSE: tl.constexpr,
                     WRITE_GRAD: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """L (C, V) raw logits of rows row0 .. row0 + C of the batch; LABELS/LOSS/LSE/SCALE/RHO index global rows.
    col0: the vocabulary index of L's first column (a vocabulary part; 0 with COMPUTE_LSE, which needs all V).
    vocab: the whole vocabulary's size; a label outside [0, vocab) and != ignore_index gets LOSS = NaN and
    zero d_logits (``ok`` below is False for it), and no load ever uses it as an offset.

    COMPUTE_LSE: LOSS (0 where ignored) and LSE are written; otherwise LSE is read (backward of "none").
    WRITE_GRAD, with g the gradient of the row's loss times SCALE[row * scale_stride] with respect to the raw logits:
    - two passes (not ONE_PASS): pass 1 the online softmax (lse, loss), pass 2 overwrites L with g: each logit
      read twice, written once (6 B per bf16 logit);
    - ONE_PASS (needs COMPUTE_LSE): one read and one write per logit (4 B). With c the target logit, L gets
      w = exp(z - c) [* softcap'] while the sum of those values gives lse = c + log(sum), and
      g = RHO[row] * w - GAMMA[row] * onehot(target), RHO = scale * e^(c - lse), GAMMA = scale [* softcap' of the
      target]: the one-hot term is left to the consumer, which applies it in fp32 (``dh_finish``), so the
      target's softmax - 1 is never rounded (the two-pass kernel rounds it to bf16, which is nearly exact only
      when the target's probability is small). A tile whose largest logit is more than ONE_PASS_MAX_GAP above c
      moves c up to it and rescales the row's earlier tiles in place. Rows that are not ok get w = 0, RHO = 0
      and GAMMA = 0.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) rows of the chunk
    rmask = r < C
    g = row0 + r
    label = tl.load(LABELS_ptr + g, mask=rmask, other=ignore_index)
    valid = label != ignore_index
    ok = valid & (label >= 0) & (label < vocab)  # valid and inside the vocabulary: only these are read
    row_ptrs = L_ptr + r.to(tl.int64)[:, None] * l_row_stride  # (BLOCK_R, 1)
    cols = tl.arange(0, BLOCK_V)[None, :]
    safe = tl.where(ok, label, 0)  # out-of-range labels load column 0 (masked off too), never past V
    if tl.max(valid.to(tl.int32), 0) > 0:  # a block of ignored rows skips the math
        if COMPUTE_LSE:
            z_t, t_t = _load_logits(L_ptr + r.to(tl.int64) * l_row_stride + safe, BIAS_ptr + safe, rmask & ok,
                                    softcap, HAS_BIAS, HAS_SOFTCAP)
            if ONE_PASS:
                c = tl.where(ok, z_t, 0.0)  # the reference: w = exp(z - c), s = sum of w (before softcap')
                s = tl.zeros([BLOCK_R], tl.float32)
                for v0 in range(0, V, BLOCK_V):
                    offs, mask, z, t = _logit_tile(row_ptrs, BIAS_ptr, rmask, cols, v0, V, softcap, HAS_BIAS,
                                                   HAS_SOFTCAP)
                    z_max = tl.max(z, 1)
                    jump = ok & (z_max > c + _MAX_GAP)
                    if tl.max(jump.to(tl.int32), 0) > 0:  # rare: move c up to this tile's max, rescale what is written
                        c_new = tl.where(jump, z_max, c)
                        f = tl.exp2((c - c_new) * LOG2E)  # 1 on the other rows: their values stay bit for bit
                        s = s * f
                        tl.debug_barrier()  # the earlier tiles' stores, from any thread of the program, come first
                        for u0 in range(0, v0, BLOCK_V):
                            offs_u = u0 + cols
                            mask_u = rmask[:, None] & (offs_u < V)
                            w = tl.load(row_ptrs + offs_u, mask=mask_u, other=0.0).to(tl.float32) * f[:, None]
                            tl.store(row_ptrs + offs_u, w.to(L_ptr.dtype.element_ty), mask=mask_u)
                        c = c_new
                    e = tl.exp2((z - c[:, None]) * LOG2E)
                    s += tl.sum(e, 1)
                    if HAS_SOFTCAP:
                        e = e * (1.0 - t * t)
                    tl.store(row_ptrs + offs, tl.where(ok[:, None], e, 0.0).to(L_ptr.dtype.element_ty), mask=mask)
                # s >= 1 on ok rows: the target's own term, or after a move the new max's
                lse = c + tl.log(tl.maximum(s, 1e-30))
            else:
                lse = _online_lse(row_ptrs, BIAS_ptr, rmask, cols, V, softcap, HAS_BIAS, HAS_SOFTCAP, BLOCK_R,
                                  BLOCK_V)
            loss = tl.where(ok, lse - z_t, tl.where(valid, float("nan"), 0.0))
            tl.store(LOSS_ptr + g, loss, mask=rmask)
            tl.store(LSE_ptr + g, tl.where(valid, lse, 0.0), mask=rmask)
        else:
            lse = tl.load(LSE_ptr + g, mask=rmask, other=0.0)
        if WRITE_GRAD:
            scale = tl.load(SCALE_ptr + g * scale_stride, mask=rmask, other=0.0).to(tl.float32)
            if ONE_PASS:
                gamma = scale
                if HAS_SOFTCAP:
                    gamma = gamma * (1.0 - t_t * t_t)
                tl.store(RHO_ptr + g, tl.where(ok, scale * tl.exp2((c - lse) * LOG2E), 0.0), mask=rmask)
                tl.store(GAMMA_ptr + g, tl.where(ok, gamma, 0.0), mask=rmask)
            else:
                _write_dlogits(row_ptrs, BIAS_ptr, rmask, ok, label, lse, scale, cols, col0, V, softcap, HAS_BIAS,
                               HAS_SOFTCAP, BLOCK_V)
    else:
        if COMPUTE_LSE:
            tl.store(LOSS_ptr + g, tl.zeros([BLOCK_R], tl.float32), mask=rmask)
            tl.store(LSE_ptr + g, tl.zeros([BLOCK_R], tl.float32), mask=rmask)
        if WRITE_GRAD:
            zero = tl.zeros([BLOCK_R, BLOCK_V], tl.float32).to(L_ptr.dtype.element_ty)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + cols
                tl.store(row_ptrs + offs, zero, mask=rmask[:, None] & (offs < V))
            if ONE_PASS:
                tl.store(RHO_ptr + g, tl.zeros([BLOCK_R], tl.float32), mask=rmask)
                tl.store(GAMMA_ptr + g, tl.zeros([BLOCK_R], tl.float32), mask=rmask)


def lce_rows(logits: torch.Tensor, labels: torch.Tensor, row0: int, bias, scale, loss_rows, lse, *,
             ignore_index: int, softcap, compute_lse: bool, write_grad: bool, col0: int = 0,
             vocab: int | None = None, rho: torch.Tensor | None = None,
             gamma: torch.Tensor | None = None) -> None:
    """Run the row kernel on a chunk ``logits`` (C, V), stride(1) == 1, holding rows row0 .. row0 + C.

    labels (N,) int64; bias (V,) or None; scale (1,) or (N,) fp32 (stride 0 or 1 per row); loss_rows and
    lse (N,) fp32 (lse is read instead of written when ``compute_lse`` is False). col0: vocabulary index of
    the first column when ``logits`` (and ``bias``) hold one vocabulary part; only without ``compute_lse``.
    vocab: the whole vocabulary's size (labels outside [0, vocab) give NaN loss, zero d_logits); required
    with col0 > 0, else V.
    rho, gamma (N,) fp32: the one-pass kernel (with compute_lse and write_grad): the chunk then holds w with
    d_logits = rho[row] * w - gamma[row] * onehot(label) (see ``_lce_rows_kernel``); None: two passes, the chunk
    holds d_logits.
    """
    c, v = logits.shape
    if compute_lse and col0:
        raise ValueError("lce_rows: the log-sum-exp needs the whole vocabulary (col0 = 0)")
    if (rho is None) != (gamma is None) or rho is not None and not (compute_lse and write_grad):
        raise ValueError("lce_rows: the one-pass kernel needs rho and gamma, compute_lse and write_grad")
    if vocab is None:
        if col0:
            raise ValueError("lce_rows: a vocabulary part (col0 > 0) needs vocab=, the whole vocabulary's size")
        vocab = v
    if c == 0:
        return
    _lce_rows_kernel[(triton.cdiv(c, BLOCK_R_ROWS),)](
        logits, logits.stride(0), labels, bias if bias is not None else logits, scale,
        1 if scale.numel() > 1 else 0, loss_rows, lse, rho if rho is not None else lse,
        gamma if gamma is not None else lse, row0, col0, c, v, vocab,
        ignore_index, float(softcap) if softcap is not None else 1.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, COMPUTE_LSE=compute_lse,
        WRITE_GRAD=write_grad, ONE_PASS=rho is not None, BLOCK_R=BLOCK_R_ROWS, BLOCK_V=BLOCK_V_ROWS,
        num_warps=ROWS_NUM_WARPS)


@triton.jit
def _dh_finish_kernel(ACC_ptr, W_ptr, LABELS_ptr, RHO_ptr, GAMMA_ptr, OUT_ptr, row0, C, H, V, w_row_stride,
                      out_row_stride, BLOCK_H: tl.constexpr):
    """OUT[r] = RHO[g] * ACC[r] - GAMMA[g] * W[label[g]] in fp32, rounded once; g = row0 + r, one program per row."""
    r = tl.program_id(0)
    g = row0 + r
    label = tl.load(LABELS_ptr + g)
    safe = tl.where((label >= 0) & (label < V), label, 0).to(tl.int64)  # GAMMA is 0 on the other rows
    rho = tl.load(RHO_ptr + g)
    gamma = tl.load(GAMMA_ptr + g)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.load(ACC_ptr + r.to(tl.int64) * H + cols, mask=mask, other=0.0)
        w = tl.load(W_ptr + safe * w_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        out = rho * acc - gamma * w
        tl.store(OUT_ptr + r.to(tl.int64) * out_row_stride + cols, out.to(OUT_ptr.dtype.element_ty), mask=mask)


def dh_finish(acc: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row0: int, rho, gamma,
              out: torch.Tensor) -> None:
    """out (C, H) = rho * acc - gamma * weight[label] per row (rows row0 .. row0 + C of labels / rho / gamma): the
    one-pass kernel's d_hidden from acc = w @ weight (C, H) fp32. weight (V, H) and out with unit column stride."""
    c, h = acc.shape
    if c:
        _dh_finish_kernel[(c,)](acc, weight, labels, rho, gamma, out, row0, c, h, weight.shape[0], weight.stride(0),
                                out.stride(0), BLOCK_H=min(1024, triton.next_power_of_2(h)), num_warps=4)


# Hopper-friendly tiles first; the interpreter takes only the first (tune_configs). H = 896 = 7 x 128, so
# BLOCK_H = 128 wastes nothing at the 0.5B head, 256 wastes 12.5% of the last column block.
_DW_CONFIGS = [
    triton.Config({"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 128, "BLOCK_H": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 256, "BLOCK_H": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_K": 32}, num_warps=4, num_stages=5),
]


# restore_value: the kernel adds into ACC, so each autotune trial must start from the same accumulator.
# The interpreter pays per operation: large tiles, few programs (H <= 128 in the tests is one column block).
_DW_INTERPRET = [triton.Config({"BLOCK_V": 1024, "BLOCK_H": 128, "BLOCK_K": 128})]


@triton.autotune(configs=_DW_INTERPRET if triton_interpreting() else tune_configs(_DW_CONFIGS), key=["V", "H"],
                 restore_value=["ACC_ptr"])
@triton.jit
def _dw_accumulate_kernel(D_ptr, X_ptr, ACC_ptr, C, V, H, d_row_stride, x_row_stride, acc_row_stride,
                          DOT_FP32: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """ACC (V, H) fp32 += D(C, V).T @ X(C, H). Programs walk H fastest so neighbours share D's columns."""
    pid = tl.program_id(0)
    n_h = tl.cdiv(H, BLOCK_H)
    pid_v = pid // n_h
    pid_h = pid % n_h
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_V, BLOCK_H], tl.float32)
    for k0 in range(0, C, BLOCK_K):
        ks = k0 + offs_k
        d = tl.load(D_ptr + ks[:, None].to(tl.int64) * d_row_stride + offs_v[None, :],
                    mask=(ks[:, None] < C) & (offs_v[None, :] < V), other=0.0)  # (BLOCK_K, BLOCK_V)
        x = tl.load(X_ptr + ks[:, None].to(tl.int64) * x_row_stride + offs_h[None, :],
                    mask=(ks[:, None] < C) & (offs_h[None, :] < H), other=0.0)  # (BLOCK_K, BLOCK_H)
        if DOT_FP32:
            # fp32 inputs (exact, no TF32), and the interpreter, whose bf16 arithmetic is not trustworthy;
            # products of bf16 values are exact in fp32, so the result equals the tensor-core path's.
            acc += tl.dot(tl.trans(d.to(tl.float32)), x.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(d), x)
    out = ACC_ptr + offs_v[:, None].to(tl.int64) * acc_row_stride + offs_h[None, :]
    omask = (offs_v[:, None] < V) & (offs_h[None, :] < H)
    tl.store(out, tl.load(out, mask=omask, other=0.0) + acc, mask=omask)


# cuBLAS can add a bf16/fp16 product straight into an fp32 matrix (aten addmm.dtype_out, CUDA only).
# Measured on an H200 at the Qwen2.5-0.5B head: this Triton GEMM took 12.1 ms per step for the 19 dW
# chunks, about twice what cuBLAS needs for the same FLOPs; so on CUDA cuBLAS does it, and the Triton
# kernel serves the interpreter (CPU tests) and torch builds without the overload.
_CUBLAS_FP32_ACC = hasattr(torch.ops.aten.addmm, "dtype_out")


def dw_accumulate(dlogits: torch.Tensor, x: torch.Tensor, acc: torch.Tensor) -> None:
    """acc (V, H) fp32 += dlogits (C, V).T @ x (C, H); dlogits and x in one dtype, last dims contiguous."""
    c, v = dlogits.shape
    h = x.shape[1]
    if c == 0:
        return
    if acc.is_cuda:
        if dlogits.dtype == torch.float32:
            acc.addmm_(dlogits.t(), x)  # fp32 cuBLAS (TF32 stays off unless the user enabled it)
            return
        if _CUBLAS_FP32_ACC:
            torch.ops.aten.addmm.dtype_out(acc, dlogits.t(), x, torch.float32, out=acc)
            return
    dot_fp32 = dlogits.dtype == torch.float32 or triton_interpreting()

    def grid(meta):
        return (triton.cdiv(v, meta["BLOCK_V"]) * triton.cdiv(h, meta["BLOCK_H"]),)

    _dw_accumulate_kernel[grid](dlogits, x, acc, c, v, h, dlogits.stride(0), x.stride(0), acc.stride(0),
                                DOT_FP32=dot_fp32)


@triton.jit
def _scale_kernel(X_ptr, G_ptr, OUT_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G_ptr).to(tl.float32)
    x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT_ptr + offs, (x * g).to(OUT_ptr.dtype.element_ty), mask=mask)


def scale_by(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x (any shape, contiguous) * g (0-dim, on x's device) in fp32, rounded once to x.dtype."""
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        block = 4096
        _scale_kernel[(triton.cdiv(n, block),)](x, g.reshape(1), out, n, BLOCK=block, num_warps=8)
    return out
