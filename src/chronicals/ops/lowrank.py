"""Low-rank update in place: y += alpha * x @ w, with x (M, K) and w (K, N) of a small K (a LoRA rank: 8 .. 192).

Shapes: y (M, N), x (M, K) and w (K, N), any strides (y: a column block of a wider buffer, say); alpha a float.
Returns y. float64 takes the reference under "auto" (the kernel sums in fp32).

Why a kernel: cuBLAS runs this product (``y.addmm_(x, w, alpha=alpha)``) as a GEMM with one K step whose epilogue
reads y. The op is bandwidth-bound (read y, write y; x and w are small) but ran at 55-65% of copy bandwidth on an H100 (`probe_skinny_gemms.py`: 34.1 us against
19.3 for y of 16,384 x 896, 72.7 against 44.2 for 8,192 x 4,096). The kernel issues y's load first and keeps several
tiles per SM in flight (25.1 vs 34.8 us and 50.3 vs 73.7 at those shapes, outputs bit-identical to cuBLAS's at every
shape probed; not promised in general: both round one fp32 sum, in their own orders). The LoRA layers call it
where they accumulate a rank-r term into a full-size tensor: the forward's y += s (x A^T) B^T, the backward's
dx += (s dy B) A. In the graphed 0.5B LoRA step it gave only +0.1-0.3% (same-call A/B, H100). Likely why: there y was
just written by the GEMM before the update, and its 29 MB fit the 50 MB L2, which the probe flushes between calls.
Under torch.compile ``addmm_`` runs (the compiler plans its own GEMMs).

Math as cuBLAS's: products of the input dtype summed in fp32, plus y in fp32, rounded once (fp32 inputs: IEEE fp32
products, not TF32). The reference twin is ``addmm_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._impl import resolve_impl, triton_interpreting
from ._triton_utils import check_device

# (BLOCK_M, BLOCK_N, num_warps): one config, no autotuning (the op runs inside captured CUDA graphs, and its first
# call may come during capture). Chosen on an H100 by probe_lowrank_update.py over 12 configs.
BLOCK_M, BLOCK_N, NUM_WARPS = (16, 64, 4) if triton_interpreting() else (64, 128, 4)


@triton.jit
def _lowrank_update_kernel(Y_ptr, X_ptr, W_ptr, M, N, K, y_row_stride, y_col_stride, x_row_stride, x_col_stride,
                           w_row_stride, w_col_stride, alpha, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    rm64 = rm.to(tl.int64)
    y_ptrs = Y_ptr + rm64[:, None] * y_row_stride + rn[None, :] * y_col_stride
    tile_ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=tile_ok, other=0.0)  # first: the bytes that make this op's time
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X_ptr + rm64[:, None] * x_row_stride + rk[None, :] * x_col_stride,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W_ptr + rk[:, None] * w_row_stride + rn[None, :] * w_col_stride,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:  # fp32 inputs (and the interpreter, whose bf16 arithmetic is not exact): fp32 products
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = y.to(tl.float32) + alpha * acc
    tl.store(y_ptrs, out.to(Y_ptr.dtype.element_ty), mask=tile_ok)


def lowrank_update_ref(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """y += alpha * x @ w in place (PyTorch): the reference twin."""
    return y.addmm_(x, w, alpha=alpha)


def _launch(y, x, w, alpha, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=NUM_WARPS):
    m, n = y.shape
    k = x.shape[1]
    if m == 0 or n == 0:
        return y
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _lowrank_update_kernel[grid](
        y, x, w, m, n, k, y.stride(0), y.stride(1), x.stride(0), x.stride(1), w.stride(0), w.stride(1), float(alpha),
        IEEE=y.dtype == torch.float32 or triton_interpreting(), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def lowrank_update_(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, alpha: float = 1.0, *,
                    impl: str = "auto") -> torch.Tensor:
    """y (M, N) += alpha * x (M, K) @ w (K, N) in place; returns y. ``impl``: "auto" (Triton on CUDA), "triton",
    "torch" (``addmm_``). Tensors without autograd history to record (call it inside an autograd.Function)."""
    if y.dim() != 2 or x.dim() != 2 or w.dim() != 2 or x.shape[0] != y.shape[0] or w.shape != (x.shape[1], y.shape[1]):
        raise ValueError(f"lowrank_update_: y {tuple(y.shape)} += x {tuple(x.shape)} @ w {tuple(w.shape)} does not "
                         "fit: y (M, N), x (M, K), w (K, N)")
    if not (x.dtype == w.dtype == y.dtype):
        raise ValueError(f"lowrank_update_: y, x and w must share a dtype, got {y.dtype}, {x.dtype}, {w.dtype}")
    check_device("lowrank_update_", y, x, w)
    if y.dtype == torch.float64:
        if impl == "triton":
            raise ValueError("lowrank_update_: the kernel sums in fp32; float64 takes impl='torch' (or 'auto')")
        impl = "torch"
    if resolve_impl("lowrank_update", impl, y.device) == "torch" or torch.compiler.is_compiling():
        return lowrank_update_ref(y, x, w, alpha)
    return _launch(y, x, w, alpha)
