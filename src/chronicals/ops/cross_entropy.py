"""Linear + cross-entropy (the loss head). Reference twin; the fused Triton kernel sits beside it.

Shapes: hidden (N, H), weight (V, H), bias (V,) or None, labels (N,) int64 already aligned (the caller
shifted them), ignore_index marks tokens without loss.
reduction: "mean" over non-ignored tokens (0 when there are none), "sum", or "none" ((N,), 0 where ignored).
softcap: Gemma-2 style logit capping, logits = softcap * tanh(logits / softcap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._impl import resolve_impl

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_ref(logits, labels, *, ignore_index=-100, reduction="mean", softcap=None):
    """logits (N, V) any dtype -> loss in fp32 with the given reduction."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    logits = logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per_tok = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return per_tok
    total = per_tok.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1)


def linear_cross_entropy_ref(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                             softcap=None):
    """Materializes the (N, V) logits: the reference, and what transformers does."""
    logits = F.linear(hidden, weight, bias)
    return cross_entropy_ref(logits, labels, ignore_index=ignore_index, reduction=reduction, softcap=softcap)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                         softcap=None, impl: str = "auto"):
    """Loss of ``hidden @ weight.T (+ bias)`` against ``labels``; see the module docstring."""
    if resolve_impl("linear_cross_entropy", impl, hidden.device) == "torch":
        return linear_cross_entropy_ref(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                        reduction=reduction, softcap=softcap)
    raise NotImplementedError("linear_cross_entropy: the fused kernel lands with the fused-loss issue")
