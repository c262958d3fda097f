"""Dropout whose mask is a function of (seed, element index): never stored, rebuilt wherever it is needed.

Used by the LoRA branch (``chronicals.lora``): drop(x) = x * m / (1 - p). A stored bool mask costs 1 byte per
element for every adapter of every layer until backward (4.0 GiB at the 0.5B LoRA protocol with dropout 0.1:
15.7 vs 11.7 GiB peak, H200, git c32ba10), and building it through ``torch.rand(shape) >= p`` writes and reads
4 more bytes per element. Here a ``DropDraw`` holds one int64 seed on the device (drawn from torch's generator,
so ``torch.manual_seed``, checkpoints' RNG state and CUDA-graph replays work as for ``torch.rand``), and every
kernel that needs the mask recomputes it from the seed: forward ``dropped`` (read x, write drop(x)), backward
``add_dropped_`` (base += drop(t) in one pass, which can also write drop(x) for dA with the same mask).

The mask, exactly (both implementations give the same bits):
- x is viewed as (rows, cols); counter c = row * ceil(cols / 8) + col // 8 (so a row's mask does not depend on
  the tensor's row stride); Philox-4x32-10 (Triton's ``tl.philox``) with key = the seed (low, high 32 bits) and
  counter (c low, c high, 0, 0) gives four 32-bit words w0..w3;
- column col takes the 16-bit half (col % 8) % 2 (0 low, 1 high) of word (col % 8) // 2;
- kept where that value >= thr, thr = round(p * 65536) (at most 65535): p is rounded to a multiple of 2^-16
  (0.1 -> 0.100006) and kept values are scaled by 65536 / (65536 - thr), so E[drop(x)] = x exactly. One Philox
  call serves 8 elements: at 1 per element its ~120 integer operations would take ~0.6 ms for the 0.5B down
  projection's 80M elements on an H200 (~16 T int32 op/s), 7x the pass's memory time.

Math is fp32 (fp64 for fp64 tensors), rounded once to the tensor's dtype. ``impl``: "triton" (CUDA, or the CPU
under TRITON_INTERPRET=1) or "torch" (the reference twin: the same Philox in int64 tensor arithmetic).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._impl import resolve_impl
from ._triton_utils import check_device

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
LANES = 8  # elements per Philox call: 4 words x 2 halves


class DropDraw(NamedTuple):
    """One dropout draw: ``seed`` (1,) int64 on the device, ``p`` as asked, ``thr`` and ``scale`` as applied."""
    seed: torch.Tensor
    p: float
    thr: int
    scale: float

    @property
    def p_applied(self) -> float:
        """The drop probability the mask has: thr / 65536."""
        return self.thr / 65536.0


def threshold(p: float) -> tuple[int, float]:
    """p in [0, 1) -> (thr, scale): drop where the 16-bit value < thr; kept values times scale."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p={p} must be in [0, 1)")
    thr = min(int(round(p * 65536)), 65535)
    return thr, 65536.0 / (65536 - thr)


def draw(p: float, device: torch.device | str) -> DropDraw:
    """A fresh draw: the seed comes from torch's generator on ``device`` (one small kernel, no host sync)."""
    thr, scale = threshold(p)
    seed = torch.randint(0, 2 ** 62, (1,), device=device, dtype=torch.int64)
    return DropDraw(seed, float(p), thr, scale)


# ---------------------------------------------------------------- kernel

@triton.jit
def _dropout_kernel(X_ptr, OUT_ptr, SEED_ptr, X2_ptr, OUT2_ptr, n_rows, n_cols, x_row_stride, out_row_stride,
                    x2_row_stride, thr, ADD: tl.constexpr, PAIR: tl.constexpr, F64: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """OUT = drop(X) (ADD False) or OUT += drop(X) (ADD True) over a (BLOCK_R rows, BLOCK_G x 8 columns) tile;
    one Philox call per row and group of 8 columns. PAIR: also OUT2 = drop(X2) (contiguous), the same mask."""
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None, None]  # (R, 1, 1)
    groups = (tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G))[None, :, None]  # (1, G, 1)
    lanes = tl.arange(0, 8)[None, None, :]  # (1, 1, 8)
    cols = groups * 8 + lanes  # (1, G, 8)
    mask = (rows < n_rows) & (cols < n_cols)
    ctr = rows * ((n_cols + 7) // 8) + groups  # (R, G, 1) int64
    lo = (ctr & 0xFFFFFFFF).to(tl.uint32)
    hi = (ctr >> 32).to(tl.uint32)
    zero = lo * 0
    seed = tl.load(SEED_ptr)
    w0, w1, w2, w3 = tl.philox(seed, lo, hi, zero, zero)
    word = lanes // 2
    w = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))  # (R, G, 8) uint32
    bits = (w >> ((lanes % 2) * 16).to(tl.uint32)) & 0xFFFF
    keep = bits.to(tl.int32) >= thr
    x = tl.load(X_ptr + rows * x_row_stride + cols, mask=mask, other=0.0)
    x = x.to(tl.float64) if F64 else x.to(tl.float32)
    # scale = 65536 / (65536 - thr), correctly rounded in the math dtype (a float argument would arrive as
    # fp32, off the twin's fp64 scale by up to 3e-8 relative)
    if F64:
        scale = 65536.0 / tl.cast(65536 - thr, tl.float64)  # fp64 division is correctly rounded
    else:
        denom = tl.cast(65536 - thr, tl.float32)
        scale = tl.math.div_rn(denom * 0 + 65536.0, denom)  # fp32 "/" may be the approximate division
    y = tl.where(keep, x * scale, 0.0)
    o_ptrs = OUT_ptr + rows * out_row_stride + cols
    if ADD:
        base = tl.load(o_ptrs, mask=mask, other=0.0)
        y = (base.to(tl.float64) if F64 else base.to(tl.float32)) + y
    tl.store(o_ptrs, y.to(OUT_ptr.dtype.element_ty), mask=mask)
    if PAIR:
        x2 = tl.load(X2_ptr + rows * x2_row_stride + cols, mask=mask, other=0.0)
        x2 = x2.to(tl.float64) if F64 else x2.to(tl.float32)
        tl.store(OUT2_ptr + rows * n_cols + cols, tl.where(keep, x2 * scale, 0.0).to(OUT2_ptr.dtype.element_ty),
                 mask=mask)


_BLOCK_R, _BLOCK_G = 4, 64  # 4 x 512 elements a program: 16 bf16 (32 bytes) per thread over 4 warps


def _launch(x2, out2, d: DropDraw, add: bool, pair=None) -> None:
    """pair: None, or (X2, OUT2) for the PAIR output (X2 of x2's shape, OUT2 contiguous)."""
    n_rows, n_cols = x2.shape
    if n_rows == 0 or n_cols == 0:
        return
    grid = (triton.cdiv(n_rows, _BLOCK_R), triton.cdiv(triton.cdiv(n_cols, LANES), _BLOCK_G))
    src2, out_2 = pair if pair is not None else (x2, out2)  # unused pointers when PAIR is off
    _dropout_kernel[grid](x2, out2, d.seed, src2, out_2, n_rows, n_cols, x2.stride(0), out2.stride(0),
                          src2.stride(0), d.thr, ADD=add, PAIR=pair is not None, F64=x2.dtype == torch.float64,
                          BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G, num_warps=4)


# ---------------------------------------------------------------- reference twin

def _mulhi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) mod 2^32 for int64 tensors a < 2^32 and a 32-bit constant b, without
    overflowing int64 (b split into 16-bit halves: every product stays below 2^48)."""
    bh, bl = b >> 16, b & 0xFFFF
    ah, al = a * bh, a * bl
    return (ah + (al >> 16)) >> 16, (((ah & 0xFFFF) << 16) + al) & _M32


def philox_ref(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2=None, c3=None):
    """Philox-4x32-10 on int64 tensors holding uint32 values: counter (c0, c1, c2, c3) (c2, c3 default 0), key =
    seed (int64 tensor) split into low and high 32 bits, as ``tl.philox`` computes it. Returns (w0, w1, w2, w3)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c2 = torch.zeros_like(c0) if c2 is None else c2
    c3 = torch.zeros_like(c0) if c3 is None else c3
    for _ in range(10):
        hi_b, lo_b = _mulhi_lo(c2, _ROUND_B)
        hi_a, lo_a = _mulhi_lo(c0, _ROUND_A)
        c0, c2 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1
        c1, c3 = lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def _keep_ref(d: DropDraw, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """bool (n_rows, n_cols): the twin of the kernel's ``keep``."""
    groups = -(-n_cols // LANES)
    ctr = (torch.arange(n_rows, device=device, dtype=torch.int64)[:, None] * groups
           + torch.arange(groups, device=device, dtype=torch.int64)[None, :])  # (rows, groups)
    words = philox_ref(d.seed.to(device), ctr & _M32, ctr >> 32)
    halves = torch.stack([h for w in words for h in (w & 0xFFFF, w >> 16)], dim=-1)  # (rows, groups, 8)
    return (halves.reshape(n_rows, groups * LANES)[:, :n_cols] >= d.thr)


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _drop_ref(x2: torch.Tensor, keep: torch.Tensor, d: DropDraw, md: torch.dtype) -> torch.Tensor:
    """The twin's drop(x2) in the math dtype ``md``: x2 * scale where kept, else 0 (the kernel's ``y``)."""
    return torch.where(keep, x2.to(md) * d.scale, 0.0)


# ---------------------------------------------------------------- API

def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., cols) -> a (rows, cols) view with unit column stride (copies only if it has none)."""
    if x.dim() == 0:
        raise ValueError("dropout: x is a 0-d tensor; expected (..., cols)")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def keep_mask(d: DropDraw, n_rows: int, n_cols: int, device, *, impl: str = "auto") -> torch.Tensor:
    """bool (n_rows, n_cols): the elements ``d`` keeps (for references and tests; the ops never build it)."""
    if resolve_impl("dropout", impl, torch.device(device)) == "torch":
        return _keep_ref(d, n_rows, n_cols, device)
    ones = torch.ones(n_rows, n_cols, device=device, dtype=torch.float32)
    out = torch.empty_like(ones)
    _launch(ones, out, d, add=False)
    return out != 0


def dropped(x: torch.Tensor, d: DropDraw, *, impl: str = "auto") -> torch.Tensor:
    """x (..., cols) -> drop(x) (rows, cols) contiguous, x's dtype: x * scale where kept, else 0."""
    x2 = _as_rows(x)
    check_device("dropout", x2, d.seed)
    if resolve_impl("dropout", impl, x2.device) == "torch":
        return _drop_ref(x2, _keep_ref(d, *x2.shape, x2.device), d, _math_dtype(x2)).to(x2.dtype)
    if x.requires_grad and torch.is_grad_enabled():  # the kernel's output has no grad_fn: a silent constant
        raise ValueError("dropout.dropped(impl='triton') builds no autograd graph (LoRA's backward applies the mask "
                         "itself); call it under torch.no_grad() or on x.detach(), or use impl='torch'")
    out = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    _launch(x2, out, d, add=False)
    return out


def add_dropped_(base: torch.Tensor, t: torch.Tensor, d: DropDraw, *, also: torch.Tensor | None = None,
                 impl: str = "auto"):
    """base (rows, cols), unit column stride, any row stride (a view into a wider buffer is fine) += drop(t),
    t (rows, cols) or (..., cols); in place, one pass: sum in fp32 (fp64), rounded once. Returns base; with
    ``also`` (rows, cols), returns (base, drop(also)) from the same pass (LoRA's backward: dx's term and dA's input,
    one launch and one mask build instead of two)."""
    t2 = _as_rows(t)
    if base.dim() != 2 or tuple(base.shape) != tuple(t2.shape) or (base.shape[1] > 1 and base.stride(1) != 1):
        raise ValueError(f"add_dropped_: base {tuple(base.shape)} (strides {base.stride()}) must be 2-D with unit "
                         f"column stride and the shape of t {tuple(t2.shape)}")
    a2 = None if also is None else _as_rows(also)
    if a2 is not None and (tuple(a2.shape) != tuple(t2.shape) or a2.dtype != base.dtype):
        raise ValueError(f"add_dropped_: also {tuple(a2.shape)} {a2.dtype} must have base's shape and dtype "
                         f"{tuple(base.shape)} {base.dtype}")
    check_device("dropout", base, t2, d.seed, a2)
    if resolve_impl("dropout", impl, base.device) == "torch":
        keep = _keep_ref(d, *t2.shape, base.device)
        md = _math_dtype(base)
        base.copy_(base.to(md) + _drop_ref(t2, keep, d, md))
        if a2 is None:
            return base
        return base, _drop_ref(a2, keep, d, md).to(a2.dtype)
    if a2 is None:
        _launch(t2, base, d, add=True)
        return base
    out = torch.empty(a2.shape, dtype=a2.dtype, device=a2.device)
    _launch(t2, base, d, add=True, pair=(a2, out))
    return base, out
