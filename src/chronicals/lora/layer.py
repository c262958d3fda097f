"""The LoRA linear layer: a frozen base ``W (out, in)`` plus a trainable low-rank update ``s * B @ A``.

Shapes: x (..., in) -> y (..., out); W (out, in); bias (out,) or None; A (r, in); B (out, r); s a float.

    y = x W^T (+ bias) + s * (drop(x) A^T) B^T

Two implementations, picked explicitly with ``impl``:

- ``"fused"``: ``LoRALinearFunction``, a custom autograd.Function. It never forms ``B @ A`` (out x in),
  computes no gradient for the frozen ``W`` / bias (a 0.5B model at 16k tokens skips 2 x 16384 x 896 x 4864
  FLOPs per MLP projection), and saves only ``x`` (shared with q/k/v or gate/up, so usually no new
  memory), the small ``s * x A^T`` (N, r) and, with dropout, a bool mask (1 byte per element instead of a
  second bf16 copy of x). Accumulations run as in-place ``addmm_`` so cuBLAS adds into the output in its
  epilogue: one launch fewer per add and no full-size temporary.
- ``"torch"``: ``lora_linear_ref``, plain autograd over F.linear (what PEFT does). Tests and benchmarks
  compare against it.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("chronicals.lora")
IMPLS = ("fused", "torch")


def lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling: float, mask=None, dropout: float = 0.0):
    """Reference: F.linear(x, W, b) + s * F.linear(F.linear(drop(x), A), B).

    mask: bool (..., in) of kept elements (dropout p = ``dropout``), or None for no dropout.
    """
    xd = x if mask is None else x * mask / (1.0 - dropout)
    return F.linear(x, weight, bias) + scaling * F.linear(F.linear(xd, lora_a), lora_b)


class LoRALinearFunction(torch.autograd.Function):
    """y = x W^T (+b) + s (drop(x) A^T) B^T with gradients for x, A, B only (W and b are frozen).

    ``concat`` picks how the rank-r term joins the big GEMM (same math, different memory traffic):
      - False: ``y.addmm_(s xA^T, B^T)``: the small GEMM re-reads and re-writes y (2 N out elements) and,
        in backward, ``dy B`` is one more pass over dy (N out).
      - True: forward ``[x, s xA^T] @ [W, B]^T`` (K = in + r) and backward ``dy @ [W, B]`` (N = in + r),
        which yields dx's base part and ``dy B`` in one pass over dy; costs copies of ~3 N in elements.
    So concat wins when out is well above in: gate/up at the Qwen2.5-0.5B shape (896 -> 4864) move
    ~3 x 29 MB instead of ~2 x 159 MB (forward) per call at 16k tokens. ``LoRALinear`` picks it by shape.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, mask, dropout: float, concat: bool = False):
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise RuntimeError("LoRALinearFunction: the base weight and bias must be frozen "
                               "(requires_grad=False; apply_lora does this); train them with a plain nn.Linear")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, in); a view when x is contiguous
        xd = x2 if mask is None else x2 * mask.reshape(x2.shape) * (1.0 / (1.0 - dropout))
        xa = torch.mm(xd, lora_a.t()).mul_(scaling)  # (N, r), scaled once here (small) instead of on (N, out)
        if concat:
            xcat = torch.cat([x2, xa], dim=1)  # (N, in + r), freed after forward: only x and xa are saved
            wcat = torch.cat([weight, lora_b], dim=1)  # (out, in + r)
            y = torch.mm(xcat, wcat.t()) if bias is None else torch.addmm(bias, xcat, wcat.t())
        else:
            y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())  # (N, out)
            y.addmm_(xa, lora_b.t())  # y += (s x A^T) B^T, accumulated by the GEMM itself
        ctx.save_for_backward(x2, weight, lora_a, lora_b, xa, mask)
        ctx.scaling, ctx.dropout, ctx.shape, ctx.concat = scaling, dropout, shape, concat
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, lora_a, lora_b, xa, mask = ctx.saved_tensors
        s = ctx.scaling if mask is None else ctx.scaling / (1.0 - ctx.dropout)
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
        need_x, need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dx = da = db = dyb = None
        fin = x2.shape[1]
        # dyb = s * dy B (N, r): the small tensor both dx and dA need; the scale (and 1/(1-p)) goes here.
        if need_x and ctx.concat:
            g = torch.mm(dy2, torch.cat([weight, lora_b], dim=1))  # (N, in + r): [dy W | dy B], dy read once
            dyb = g[:, fin:].mul(s)
            dx_base = g[:, :fin]
        elif need_x or need_a:
            dyb = torch.mm(dy2, lora_b).mul_(s)
        if need_x:
            if not ctx.concat:
                dx_base = torch.mm(dy2, weight)  # (N, in)
            if mask is None:
                dx = torch.addmm(dx_base, dyb, lora_a) if ctx.concat else dx_base.addmm_(dyb, lora_a)
            else:  # the LoRA branch saw drop(x): its gradient goes through the mask
                dx = torch.mm(dyb, lora_a).mul_(mask.reshape(dx_base.shape)).add_(dx_base)
            dx = dx.view(ctx.shape)
        if need_a:
            xd = x2 if mask is None else x2 * mask.reshape(x2.shape)  # 1/(1-p) already in dyb
            da = torch.mm(dyb.t(), xd)  # (r, in)
        if need_b:
            db = torch.mm(dy2.t(), xa)  # (out, r); xa already carries s (and the dropout scale)
        return dx, None, None, da, db, None, None, None, None


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float, mask=None, dropout: float = 0.0,
                impl: str = "fused", concat: bool = False):
    """See the module docstring. ``impl``: "fused" (LoRALinearFunction) or "torch" (reference)."""
    if impl == "fused":
        return LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, scaling, mask, dropout, concat)
    if impl == "torch":
        return lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling, mask, dropout)
    raise ValueError(f"lora_linear: impl={impl!r} is not one of {IMPLS}")


class LoRALinear(nn.Module):
    """Replaces an nn.Linear in place. Keeps the base ``weight`` / ``bias`` Parameters (same objects,
    so tied weights and existing references survive; frozen here) under the same names, and adds ``lora_A.weight``
    (r, in) and ``lora_B.weight`` (out, r): the state-dict keys PEFT saves, minus its prefix.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 impl: str = "fused", adapter_dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None, concat: bool | str = "auto"):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r={r} must be a positive integer")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout={dropout} must be in [0, 1)")
        if impl not in IMPLS:
            raise ValueError(f"LoRALinear: impl={impl!r} is not one of {IMPLS}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        for p in (self.weight, self.bias):  # the fused path computes no gradient for them
            if p is not None:
                p.requires_grad_(False)
        self.r, self.alpha, self.dropout, self.use_rslora, self.impl = r, alpha, dropout, use_rslora, impl
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        if concat not in ("auto", True, False):
            raise ValueError(f"LoRALinear: concat={concat!r} must be 'auto', True or False")
        # "auto": the concatenated GEMMs when out >= 2 in (see LoRALinearFunction for the byte counts)
        self.concat = self.out_features >= 2 * self.in_features if concat == "auto" else concat
        dev, dtype = base.weight.device, adapter_dtype or base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device="meta")
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device="meta")
        a = torch.empty(r, self.in_features, dtype=torch.float32)
        # PEFT's init: kaiming-uniform with a=sqrt(5) (bound 1/sqrt(in)), drawn in fp32 on the CPU so a
        # seed gives the same adapter on every device; B = 0 so the model starts exactly at the base.
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.weight = nn.Parameter(a.to(device=dev, dtype=dtype))
        self.lora_B.weight = nn.Parameter(torch.zeros(self.out_features, r, device=dev, dtype=dtype))

    def forward(self, x):
        a, b = self.lora_A.weight, self.lora_B.weight
        if a.dtype != x.dtype:  # fp32 adapters on a bf16 base: cast the small matrices, not x
            a, b = a.to(x.dtype), b.to(x.dtype)
        mask = None
        if self.dropout > 0 and self.training:
            mask = torch.rand(x.shape, device=x.device) >= self.dropout  # bool: 1 byte per element saved
        return lora_linear(x, self.weight, self.bias, a, b, self.scaling, mask, self.dropout, impl=self.impl,
                           concat=self.concat)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """s * B @ A (out, in) in fp32: only for merging, never in the training path."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """W += s B A (in W's dtype, computed in fp32) and return a plain nn.Linear on the same Parameters."""
        self.weight.add_(self.delta_weight().to(self.weight.dtype))
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin.train(self.training)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"alpha={self.alpha}, scaling={self.scaling:g}, dropout={self.dropout}, impl={self.impl}, "
                f"concat={self.concat}")
