"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, with an optional fused residual add.

Shapes: x (..., H), weight (H,), residual (..., H) or None.
With a residual, the op computes s = x + residual and returns (rms_norm(s), s) so the next block can
reuse s as its residual stream.
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Pure-PyTorch reference, numerically the Hugging Face Llama RMSNorm (fp32 math, cast, then scale)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    return y if residual is None else (y, residual)


def rms_norm(x, weight, eps: float, *, residual=None, impl: str = "auto"):
    """RMSNorm over the last dim. Returns y, or (y, x + residual) when ``residual`` is given."""
    if resolve_impl("rms_norm", impl, x.device) == "torch":
        return rms_norm_ref(x, weight, eps, residual)
    raise NotImplementedError("rms_norm: the Triton kernel lands with the fused-kernels issue")
