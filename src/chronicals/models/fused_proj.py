"""One GEMM for q/k/v and one for gate/up, while the parameters stay the separate Hugging Face modules.

Why (full fine-tuning, Qwen2.5-0.5B shape, 16 x 1024 tokens, 24 layers, H200 profile): three nn.Linear
calls on one input cost ~3.5 ms per step that one GEMM does not:
- autograd sums the dx of q/k/v (2 adds per layer) and of gate/up (1 add): 72 bf16 adds, 1.67 ms;
- q/k/v biases reduce their gradients separately: 72 reductions, 1.88 ms;
- k_proj / v_proj (896 -> 128) are GEMMs far too small to reach the matmul peak.

    qkv = x @ [Wq; Wk; Wv]^T + [bq; bk; bv]     (B, S, (Hq + 2 Hk) D)   one GEMM forward,
    q, k, v = views of qkv per head              (B, S, H*, D)            one dx GEMM, one dW GEMM,
    gu  = x @ [Wg; Wu]^T (+ [bg; bu])            (B, S, 2I)               one bias reduction backward

Backward of the q/k/v views is one cat of (dq, dk, dv) (``split``'s backward: 37.7 MB read + written per
layer at the 0.5B shape, ~18 us), then F.linear's backward on the concatenated weight; the gate/up
gradient arrives whole from ``ops.swiglu.swiglu_gate_up`` (one kernel writes d_gu). The weight gradient of
the concatenation comes back as row slices (views) of one dW, one per module: nothing is copied.

Which modules qualify: exactly ``nn.Linear`` (not a subclass: LoRA puts ``LoRALinear`` there, whose extra
path must run), without forward hooks (calling F.linear directly would skip them), with one dtype and
device and either all or none of the biases. Anything else takes the separate module calls.

Without gradients (evaluation, generation) the modules run separately: the joint GEMM's gains are all in
backward, and the concatenation would copy the weights at every call (every generated token).

The concatenated weight is rebuilt by every call, never cached: the optimizer changes the weights every
step. At the 0.5B shape it is (896 + 2 x 128) x 896 x 2 B = 2.1 MB (q/k/v) + 2 x 4864 x 896 x 2 B = 17.4 MB
(gate/up) per layer: 24 x 19.5 MB = 468 MB read and written per step, ~0.2 ms at ~4 TB/s, against the ~3.5 ms
saved. F.linear saves that weight for its dx GEMM; it is offered to ``ops.recompute`` so that, inside the
training forward's ``recompute_session()``, the graph keeps nothing (468 MB less at the peak) and the
backward concatenates the same parameters again (bit-identical; ~0.2 ms more per step). Outside a session
the offer is a no-op and the graph keeps the 468 MB.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops._impl import resolve_impl
from ..ops.recompute import offer
from ..ops.rope import rope_qk, rope_qkv
from ..ops.swiglu import (_unit_col_rows, swiglu_gate_up_backward, swiglu_gate_up_backward_,
                          swiglu_gate_up_forward)

log = logging.getLogger("chronicals.models")
_logged: set[tuple[str, str]] = set()


def fusable(*mods: nn.Module) -> str | None:
    """None when ``mods`` can share one GEMM, else why not (a short reason, for the log)."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in mods):  # first: the reason a LoRA group runs apart
        return "a module has forward hooks"
    for m in mods:
        if type(m) is not nn.Linear:
            return f"{type(m).__name__} is not a plain nn.Linear"
    w0 = mods[0].weight
    if any(m.weight.dtype != w0.dtype or m.weight.device != w0.device for m in mods):
        return "the weights differ in dtype or device"
    if len({m.bias is None for m in mods}) > 1:
        return "some have a bias and some do not"
    return None


def _note(kind: str, reason: str | None, one: str = "one GEMM") -> None:
    """Log once per (kind, path) which path runs (not inside a compiled graph: logging breaks fullgraph)."""
    path = one if reason is None else f"separate modules ({reason})"
    if (kind, path) not in _logged and not torch.compiler.is_compiling():
        _logged.add((kind, path))
        log.info("%s: %s", kind, path)


def _cat_params(mods) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[W_0; W_1; ...] (sum out, in) offered for recomputation, and [b_0; b_1; ...] or None."""
    ws = [m.weight for m in mods]
    w = offer(torch.cat(ws), functools.partial(torch.cat, ws))
    b = None if mods[0].bias is None else torch.cat([m.bias for m in mods])  # not saved by F.linear
    return w, b


def _lora_group(owner: nn.Module, attr: str, mods):
    """The LoRA group (``chronicals.lora.group.LoRAGroup``, put there by apply_lora) of exactly ``mods``, or None.

    Duck-typed: models/ does not import lora/. A group whose members were since replaced (merge_lora) is
    ignored."""
    group = owner.__dict__.get(attr)
    return group if group is not None and group.is_current(mods) else None


# where a LoRA group of a block's projections sits on the block (``lora.group.bind_groups`` puts it there), and its
# members in their order along the group's output
LORA_GROUPS = (("lora_qkv", ("q_proj", "k_proj", "v_proj")), ("lora_gate_up", ("gate_proj", "up_proj")))


def norm_spare(block: nn.Module) -> int:
    """Columns the norm before ``block`` (a decoder ``Attention`` or ``MLP``) leaves free after each row of its
    output (``ops.rms_norm``'s ``spare``): the summed rank R of the LoRA group that reads it, which writes its
    x A^T there and runs its GEMM on the (N, in + R) buffer instead of a new [x | x A^T] (``lora.group``); else 0.
    The cat it saves copies (N, in + R): 44 us a layer per group at the 8B LoRA protocol (H100 profile)."""
    for attr, names in LORA_GROUPS:
        if attr in block.__dict__:
            group = _lora_group(block, attr, tuple(getattr(block, n) for n in names))
            if group is None or group.width % 8:
                # x then has a row stride of in + R elements, which the x A^T and dA GEMMs read: a leading dimension
                # that is not a multiple of 8 drops cuBLAS to slower kernels (the concatenating path keeps x dense)
                return 0
            return group.width - group.fin
    return 0


def grad_spare(block: nn.Module) -> int:
    """Columns the norm that reads ``block``'s output (a decoder ``MLP``'s: the next layer's input norm or the final
    norm; an ``Attention``'s: the post-attention norm) leaves free after each row of its x gradient (``ops.rms_norm``'s
    ``grad_spare``): the rank r of a LoRA down_proj / o_proj whose backward runs one [dy | s dy B] GEMM
    (``LoRALinear.dy_spare``) and writes s dy B there. Else 0.
    At 8B, down_proj's cat of (N, H + r) took ~44 us a layer (H100 profile); o_proj's dx had a rank-r update of (N, H)
    instead (50 us at 8B, 25 at 0.5B)."""
    out = block._modules.get("down_proj", block._modules.get("o_proj"))
    r = getattr(out, "dy_spare", 0)
    return r if r and (out.out_features + r) % 8 == 0 else 0  # dy's row stride feeds the s dy B GEMM


def _linear_cat(x: torch.Tensor, mods) -> torch.Tensor:
    """F.linear(x, [W_0; W_1; ...], [b_0; b_1; ...]) without autograd: the same GEMM as the forward's (run
    in backward, where no recompute session is open, so _cat_params' offer is a no-op)."""
    with torch.no_grad():
        return F.linear(x, *_cat_params(mods))


def _joint_gemm(kind: str, owner: nn.Module, attr: str, mods, x: torch.Tensor):
    """(x @ [W_0; W_1; ...]^T (+ biases) as one GEMM, a recipe that runs it again) or None when ``mods`` can
    not share one: a LoRA group's GEMM (``owner.<attr>``) when there is one, else plain ``nn.Linear``s'."""
    group = _lora_group(owner, attr, mods)
    if group is not None:
        _note(kind, None, "one LoRA group GEMM")
        return group.with_recipe(x)
    reason = fusable(*mods)
    if reason is None and not torch.is_grad_enabled():
        # what the one GEMM saves is in backward; without one, the concatenation is only a copy of the weights
        # per call: per generated token 30 x 7.1 MB at SmolLM2-135M in fp32, 38% of a CPU forward (eval, chat)
        reason = "no gradient: the weights are read where they are, not concatenated per call"
    _note(kind, reason)
    if reason is not None:
        return None
    w, bias = _cat_params(mods)
    return F.linear(x, w, bias), functools.partial(_linear_cat, x, mods)


def qkv_proj(attn: nn.Module, x: torch.Tensor):
    """q (B, S, Hq, D), k (B, S, Hk, D), v (B, S, Hk, D) of ``attn`` (a decoder ``Attention``) for x (B, S, H).

    One GEMM when q/k/v_proj qualify (see module docstring); q, k, v are then views of its (B, S, (Hq + 2 Hk) D)
    output: the last dim has unit stride, the token stride is (Hq + 2 Hk) D. ``rope_qk`` reads such strided
    views and writes contiguous outputs, so q and k cost no copy; v is returned contiguous (see below).
    """
    qkv = _qkv_joint(attn, x)
    if qkv is None:
        return _qkv_apart(attn, x)
    # split's backward is one cat of (dq, dk, dv) into (B, S, Hq + 2 Hk, D): one dx GEMM follows
    q, k, v = qkv.split([attn.nq, attn.nkv, attn.nkv], dim=2)
    # v is copied out (B S Hk D: 4 MB per layer at 0.5B): attention saves v for backward, and a view would
    # keep the whole (B, S, Hq + 2 Hk, D) GEMM output alive with it (q and k are rebuilt by rope anyway):
    # 33.5 MB per layer, 0.75 GiB over 24 layers at the Qwen2.5-0.5B protocol.
    return q, k, v.contiguous()


def qkv_rope(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``qkv_proj`` with q and k rotated (``ops.rope_qk``; cos/sin (B, S, R)): with the joint GEMM, one op
    (``ops.rope_qkv``) takes q, k, v out of its output, and backward writes dq, dk and dv into one gradient instead
    of split's cat of them (2.29 ms a step at the 8B LoRA protocol, H100 profile)."""
    qkv = _qkv_joint(attn, x)
    if qkv is None:
        q, k, v = _qkv_apart(attn, x)
        return (*rope_qk(q, k, cos, sin, impl=attn.opts.impl), v)
    return rope_qkv(qkv, cos, sin, attn.nq, attn.nkv, impl=attn.opts.impl)


def _qkv_joint(attn: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The joint GEMM's output as (B, S, Hq + 2 Hk, D), or None when q/k/v_proj do not share one."""
    joint = _joint_gemm("qkv_proj", attn, "lora_qkv", (attn.q_proj, attn.k_proj, attn.v_proj), x)
    b, s, _ = x.shape
    return None if joint is None else joint[0].view(b, s, attn.nq + 2 * attn.nkv, attn.d)


def _qkv_apart(attn: nn.Module, x: torch.Tensor):
    """q (B, S, Hq, D), k and v (B, S, Hk, D) from three module calls."""
    b, s, _ = x.shape
    nq, nkv, d = attn.nq, attn.nkv, attn.d
    return attn.q_proj(x).view(b, s, nq, d), attn.k_proj(x).view(b, s, nkv, d), attn.v_proj(x).view(b, s, nkv, d)


def gate_up_proj(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """gu (B, S, 2I) = x @ [Wg; Wu]^T (+ [bg; bu]) of ``mlp`` (a decoder ``MLP``) for x (B, S, H): gate in the
    first half of the last dim, up in the second (the layout ``ops.swiglu.swiglu_gate_up`` takes).
    None when gate_proj / up_proj do not qualify (see module docstring): call them separately then.

    With "gate_up" in ``mlp.opts.recompute`` (``opts.rebuilds_gate_up(mlp.layer_idx)``: every layer, or the
    first ``opts.gate_up_layers``) gu is offered to ``ops.recompute``: inside the training forward's
    session the graph keeps x (B, S, H) instead of gu (B, S, 2I), and backward runs the GEMM again (same
    inputs, same bits). Qwen2.5-0.5B protocol: 16,384 x 9,728 x 2 B = 319 MB less per layer, less the 29 MB
    of x the recipe keeps (6.5 GiB over 24), for one more GEMM of 2 x 16,384 x 896 x 9,728 = 286 GFLOP per
    layer (~0.4 ms on an H200, ~10 ms a step).
    """
    joint = _joint_gemm("gate_up_proj", mlp, "lora_gate_up", (mlp.gate_proj, mlp.up_proj), x)
    if joint is None:
        return None
    gu, recipe = joint
    if mlp.opts.rebuilds_gate_up(mlp.layer_idx):
        offer(gu, recipe)  # a no-op outside the training forward's session
    return gu


class SwiGLUDownFunction(torch.autograd.Function):
    """y = down(silu(gate) * up) for gu (N, 2I), down's weight (H, I) and bias (H,) or None, saving only gu.

    The plain path keeps act = silu(gate) * up (N, I) for down_proj's weight gradient; offering it to
    ``ops.recompute`` rebuilds it with a second SwiGLU forward in backward (read 2I, write I per token:
    ~2.8 ms per step at the Qwen2.5-0.5B protocol). Here the SwiGLU backward kernel, which reads gate and up
    anyway, writes act as a third output (write I per token: ~0.9 ms), in this order:
        d_act = dy @ W            (N, I)   cuBLAS
        d_gu, act = kernel(d_act, gu)      one pass; act bit-identical to the forward's
        dW = dy^T @ act, db = dy.sum(0)    the same calls as F.linear's backward
    so gradients equal the plain path's bit for bit. Triton path only (the op's other doors use the offer).
    ``in_place`` (``RuntimeOptions.swiglu_backward_in_place``): the kernel writes d_gu over the saved gu and
    act over d_act (``ops.swiglu.swiglu_gate_up_backward_``), so the backward's transients are 3 (N, I)
    tensors fewer; the same bits. Only for a gu nobody reads after backward (the decoder MLP's own GEMM output);
    a second backward through the same forward (retain_graph) raises.
    """

    @staticmethod
    def forward(ctx, gu, weight, bias, in_place: bool = False):
        gu2 = _unit_col_rows(gu, gu.shape[-1])  # (N, 2I)
        act = swiglu_gate_up_forward(gu2)  # (N, I): freed when this forward returns
        y = F.linear(act, weight, bias)  # (N, H)
        ctx.save_for_backward(gu2, weight)
        ctx.has_bias, ctx.lead, ctx.in_place, ctx.spent = bias is not None, gu.shape[:-1], in_place, False
        return y.view(*gu.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        gu2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0])
        d_act = dy2.mm(weight)  # (N, I)
        dgu, act = swiglu_backward_owned(ctx, d_act, gu2)
        del d_act
        dw = dy2.t().mm(act) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dgu.view(*ctx.lead, gu2.shape[1]), dw, db, None


def swiglu_backward_owned(ctx, d_act: torch.Tensor, gu2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gu (N, 2I), act (N, I)) from d_act (N, I) and the saved gu2 (N, 2I) for a backward that owns both:
    in place when ``ctx.in_place`` and both are contiguous (``ops.swiglu.swiglu_gate_up_backward_``), else into
    fresh buffers. In place, ``ctx.spent`` marks gu2 as overwritten, and a second backward raises."""
    if ctx.in_place:
        if ctx.spent:
            raise RuntimeError(
                "the decoder MLP's backward ran twice through one forward (retain_graph=True?), but its first "
                "backward wrote the gate/up gradient over the saved gate/up output (RuntimeOptions."
                "swiglu_backward_in_place, on by default); set model.opts.swiglu_backward_in_place = False "
                "before the forward to backpropagate through it more than once")
        if d_act.is_contiguous() and gu2.is_contiguous():
            ctx.spent = True
            return swiglu_gate_up_backward_(d_act, gu2)
    act = torch.empty_like(d_act)
    return swiglu_gate_up_backward(d_act, gu2, act), act


def swiglu_down(mlp: nn.Module, gu: torch.Tensor) -> torch.Tensor | None:
    """down_proj(swiglu_gate_up(gu)) through ``SwiGLUDownFunction`` (gu (B, S, 2I) -> (B, S, H)), or None when
    it does not apply: down_proj not a plain nn.Linear, the op not on Triton, or under torch.compile."""
    if fusable(mlp.down_proj) is not None or torch.compiler.is_compiling():
        return None
    if resolve_impl("swiglu_gate_up", mlp.opts.impl, gu.device) != "triton":
        return None
    return SwiGLUDownFunction.apply(gu, mlp.down_proj.weight, mlp.down_proj.bias, mlp.opts.swiglu_backward_in_place)
