"""Rotary position embedding on Q and K, Hugging Face half-rotation layout (not interleaved).

Shapes: q (B, S, Hq, D), k (B, S, Hk, D), cos/sin (B, S, R) with R <= D the rotary dims (R < D is
partial rotary: dims R..D pass through). cos/sin come from per-token positions, so packed rows whose
positions restart at 0 per document are handled by the caller's ``position_ids``.
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32):
    """position_ids (B, S) int, inv_freq (R/2,) fp32 -> cos, sin (B, S, R) in ``dtype`` (math in fp32)."""
    freqs = position_ids.float()[..., None] * inv_freq.float()  # (B, S, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D), cos/sin (B, S, R) -> x rotated on its first R dims."""
    r = cos.shape[-1]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, S, 1, R)
    if r == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat((xr * c + _rotate_half(xr) * s, xp), dim=-1)


def rope_qk_ref(q, k, cos, sin):
    return rope_ref(q, cos, sin), rope_ref(k, cos, sin)


def rope_qk(q, k, cos, sin, *, impl: str = "auto"):
    """Rotate q and k by the same per-token angles. Returns (q_rot, k_rot)."""
    if resolve_impl("rope_qk", impl, q.device) == "torch":
        return rope_qk_ref(q, k, cos, sin)
    raise NotImplementedError("rope_qk: the Triton kernel lands with the fused-kernels issue")
