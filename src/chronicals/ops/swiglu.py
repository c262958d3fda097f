"""SwiGLU activation: silu(gate) * up.  Shapes: gate, up (..., I) -> (..., I)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._impl import resolve_impl


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate, up, *, impl: str = "auto"):
    if resolve_impl("swiglu", impl, gate.device) == "torch":
        return swiglu_ref(gate, up)
    raise NotImplementedError("swiglu: the Triton kernel lands with the fused-kernels issue")
