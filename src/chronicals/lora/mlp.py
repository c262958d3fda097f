"""``down_proj(swiglu(gate, up))`` for a LoRA down_proj, without keeping the SwiGLU product for backward.

Shapes: gate, up (..., I) -> y (..., H); down_proj W (H, I), A (r, I), B (H, r). Packed form: gate = gu
(..., 2I) = [gate | up] (one GEMM's output: plain gate/up Linears or a ``LoRAGroup``) and up = None; then the
SwiGLU is ``ops.swiglu_gate_up`` and the gradient comes back as one d_gu (..., 2I).

The plain MLP keeps three (N, I) tensors per layer for backward: gate and up (the SwiGLU op's inputs) and
act = silu(gate) * up, saved by down_proj as its input (a LoRA down_proj needs it for dA = (s dy B)^T act).
``LoRASwiGLUDownFunction`` saves gate and up only and recomputes act in backward: one elementwise pass
(read 2, write 1 (N, I) tensors: 0.7 GB, ~0.2 ms per layer at the 8B shape, ~6 ms per step of ~500) for
235 MB less per layer at the 8B shape (4 x 2048 tokens x 14336 x bf16): 7.0 GiB over 32 layers. The
recomputed act is bit-identical to the forward's (same kernel, same inputs), so gradients are unchanged.
Backward order keeps the transient peak of the plain path: act and d_act, then act freed before the
SwiGLU backward allocates dgate / dup. Packed gu on the Triton path (the default on a GPU) skips that
recompute: d_act is computed first and the SwiGLU backward kernel writes act beside d_gu (one more (N, I)
write instead of a pass reading gu again), for a transient peak of one more (N, I) tensor. One H200 run at the
Qwen2.5-0.5B protocol with CUDA graphs (git 06763cc): 163.5k -> 166.7k tokens/s, 11.9 -> 12.1 GiB.
With ``in_place`` (``RuntimeOptions.swiglu_backward_in_place``, the default) that kernel writes d_gu over the
saved gu and act over d_act (``models.fused_proj.swiglu_backward_owned``): no (N, 2I) and (N, I) beside them.
``RuntimeOptions.fused_swiglu_recompute=False`` (bench contender ``chronicals-lora-graphs-offer``) picks the
second forward.
"""

from __future__ import annotations

import torch

from ..ops import swiglu, swiglu_gate_up
from ..ops._impl import resolve_impl
from ..models.fused_proj import swiglu_backward_owned
from ..ops.swiglu import _unit_col_rows, swiglu_backward, swiglu_gate_up_dgu, swiglu_gate_up_ref, swiglu_ref
from .layer import concat_weight, lora_backward, lora_forward


def swiglu_for_impl(gate: torch.Tensor, up: torch.Tensor | None, impl: str) -> torch.Tensor:
    """silu(gate) * up through the ops' op (``impl`` "auto" | "triton" | "torch"); up None: gate is packed gu."""
    return swiglu_gate_up(gate, impl=impl) if up is None else swiglu(gate, up, impl=impl)


def swiglu_gate_up_grad(d_act: torch.Tensor, gu: torch.Tensor, impl: str) -> torch.Tensor:
    """d_gu (..., 2I) of act = swiglu_gate_up(gu) for upstream d_act (..., I)."""
    if resolve_impl("swiglu_gate_up", impl, gu.device) == "triton":
        if torch.compiler.is_compiling():
            return torch.ops.chronicals.swiglu_gate_up_backward(d_act, gu)
        return swiglu_gate_up_dgu(d_act, gu)  # eager: the launcher itself, as swiglu_grads does
    with torch.enable_grad():
        g = gu.detach().requires_grad_()
        return torch.autograd.grad(swiglu_gate_up_ref(g), g, d_act)[0]


def swiglu_grads(d_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, impl: str):
    """(dgate, dup) of act = silu(gate) * up for upstream d_act: the Triton backward op, or autograd
    through the reference (the same two paths ``chronicals.ops.swiglu`` takes). up None: (d_gu, None)."""
    if up is None:
        return swiglu_gate_up_grad(d_act, gate, impl), None
    if resolve_impl("swiglu", impl, gate.device) == "triton":
        if torch.compiler.is_compiling():  # one graph node for the compiler
            return torch.ops.chronicals.swiglu_backward(d_act, gate, up)
        # eager: the launcher itself, skipping the custom-op dispatch (~0.1 ms of CPU per call)
        return swiglu_backward(d_act.contiguous(), gate.contiguous(), up.contiguous())
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        return torch.autograd.grad(swiglu_ref(g, u), (g, u), d_act)


class LoRASwiGLUDownFunction(torch.autograd.Function):
    """y = LoRALinear(silu(gate) * up): gradients for gate, up, A, B (W and bias frozen).

    Arguments after gate / up are LoRALinearFunction's (weight, bias, lora_a, lora_b, scaling, draw,
    concat, wcat) plus ``impl``, the SwiGLU op's, ``fused_act`` (packed gu on Triton: the SwiGLU
    backward kernel writes act for dA; False: a second SwiGLU forward rebuilds it) and ``in_place`` (with
    fused_act: that kernel writes d_gu over the gu it was given, so only for a gu nobody reads after backward,
    such as the decoder MLP's own GEMM output), then ``wa`` (LoRALinearFunction's: the [W ; A] buffer or None).
    ``draw`` (a ``DropDraw`` or None) drops elements of act.
    up None: gate is the packed gu (..., 2I), and its gradient d_gu comes back whole.
    """

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scaling: float, draw, concat: bool, wcat, impl: str,
                fused_act: bool = True, in_place: bool = False, wa=None):
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            raise RuntimeError("LoRASwiGLUDownFunction: down_proj's base weight and bias must be frozen "
                               "(requires_grad=False; apply_lora does this)")
        if up is not None and gate.shape != up.shape:
            raise ValueError(f"LoRA MLP: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
        if concat and wcat is None:
            wcat = concat_weight(weight, lora_b, scaling)
        act = swiglu_for_impl(gate, up, impl)  # (..., I): lives only until the GEMMs below are done
        shape = act.shape
        wa = None if concat else wa
        y, xa = lora_forward(act.reshape(-1, shape[-1]), weight, bias, lora_a, lora_b, scaling, draw,
                             wcat if concat else None, wa)
        del act
        ctx.save_for_backward(gate, up, weight, lora_a, lora_b, xa)
        ctx.wcat, ctx.wa = (wcat if concat else None), wa
        ctx.scaling, ctx.draw, ctx.impl, ctx.act_shape = scaling, draw, impl, shape
        ctx.fused_act, ctx.in_place, ctx.spent = fused_act, in_place, False
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight, lora_a, lora_b, xa = ctx.saved_tensors
        need_act = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_a, need_b = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        fused = ctx.fused_act and need_act and need_a and _fused_act_ok(gate, up, ctx.impl)
        act2, out = None, {}
        if fused:
            # d_act first, then one kernel writes d_gu and act (its STORE_ACT output, the forward's bits),
            # then dA reads act: no separate SwiGLU forward pass over gu
            gu2 = _unit_col_rows(gate, gate.shape[-1])

            def act2(d_act):  # d_act is lora_backward's own fresh dx, unused after this (dg comes from out)
                out["dgu"], act = swiglu_backward_owned(ctx, d_act, gu2)
                return act
        elif need_a:  # dA needs act again: recompute it (bit-identical to the forward's)
            with torch.no_grad():
                act2 = swiglu_for_impl(gate, up, ctx.impl).reshape(-1, ctx.act_shape[-1])
        d_act, da, db = lora_backward(dy.reshape(-1, dy.shape[-1]), act2, weight, lora_a, lora_b, xa, ctx.draw,
                                      ctx.scaling, ctx.wcat, need_act, need_a, need_b, ctx.wa)
        del act2  # freed before dgate / dup exist: the same transient peak as the plain MLP's backward
        ctx.wcat = ctx.wa = None
        dg = du = None
        if fused:
            dg = out["dgu"].view(gate.shape)
        elif need_act:
            dg, du = swiglu_grads(d_act.view(ctx.act_shape), gate, up, ctx.impl)
        return dg, du, None, None, da, db, None, None, None, None, None, None, None, None


def _fused_act_ok(gate: torch.Tensor, up: torch.Tensor | None, impl: str) -> bool:
    """The packed Triton path outside torch.compile: the SwiGLU backward kernel can also write act."""
    return (up is None and not torch.compiler.is_compiling()
            and resolve_impl("swiglu_gate_up", impl, gate.device) == "triton")
