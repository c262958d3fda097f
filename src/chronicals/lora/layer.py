"""The LoRA linear layer: a frozen base ``W (out, in)`` plus a trainable low-rank update ``s * B @ A``.

Shapes: x (..., in) -> y (..., out); W (out, in); bias (out,) or None; A (r, in); B (out, r); s a float.

    y = x W^T (+ bias) + s * (drop(x) A^T) B^T

Two implementations, picked explicitly with ``impl``:

- ``"fused"``: ``LoRALinearFunction``, a custom autograd.Function. It never forms ``B @ A`` (out x in),
  computes no gradient for the frozen ``W`` / bias (a 0.5B model at 16k tokens skips 2 x 16384 x 896 x 4864
  FLOPs per MLP projection), and saves only ``x`` (shared with q/k/v or gate/up, so usually no new
  memory) and the small ``x A^T`` (N, r); with dropout, the mask is not saved either: a ``DropDraw`` (one seed,
  ``ops.dropout``) rebuilds it inside the passes that apply it. Rank-r terms are accumulated in place
  (``ops.lowrank.lowrank_update_``: a Triton kernel on CUDA, 25 vs cuBLAS addmm_'s 35 us at the 0.5B o_proj; ``addmm_``
  elsewhere) and every scale ``s`` rides in a GEMM's ``alpha``: no separate scaling kernels, no
  full-size temporaries.
- ``"torch"``: ``lora_linear_ref``, plain autograd over F.linear (what PEFT does). Tests and benchmarks
  compare against it.

Kernel count per call (dropout 0), forward + backward: 8 (addmm_ layout) and 8 (concatenated layout,
including the s B refresh), down from 10 and 11 before the scales moved into ``alpha`` and the
concatenated weight became persistent (at the 0.5B shape, 168 calls per step: ~420 fewer launches).
A wide input (in >= 2 out, no bias: down_proj) keeps W in the first rows of a [W ; A] buffer, so the base GEMM also
makes x A^T in training (``LoRALinear._layout`` "rows", ``lora_forward``): x is read once instead of twice.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import dropout as D
from ..ops.lowrank import lowrank_update_
from ..ops.rms_norm import grad_spare_columns

log = logging.getLogger("chronicals.lora")
IMPLS = ("fused", "torch")


def wider(adapter_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """True when adapters of ``adapter_dtype`` hold more precision than activations of ``x_dtype`` (fp32 A and B
    on a bf16 or fp16 base): their branch then runs in the adapters' dtype, as PEFT's does."""
    return adapter_dtype != x_dtype and torch.promote_types(adapter_dtype, x_dtype) == adapter_dtype


def lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling: float, mask=None, dropout: float = 0.0):
    """Reference: F.linear(x, W, b) + s * F.linear(F.linear(drop(x), A), B), in x's dtype.

    mask: bool (..., in) of kept elements (dropout p = ``dropout``), or None for no dropout.
    A and B wider than x (fp32 on a bf16 base): x goes into the branch in their dtype and the sum is rounded to
    x's, PEFT's own computation (``autocast_adapter_dtype``): round(round(x W^T + b) + s (drop(x) A^T) B^T).
    A and B of two dtypes (fp32 A, bf16 B): the branch runs in the wider one, both cast to it (exactly).
    """
    ad = torch.promote_types(lora_a.dtype, lora_b.dtype)
    lora_a, lora_b = lora_a.to(ad), lora_b.to(ad)  # no-ops unless A and B differ
    xd = x.to(ad)  # a no-op unless the adapters are wider: then dropout's 1/(1-p) is applied in theirs
    if mask is not None:
        xd = xd * mask / (1.0 - dropout)
    return (F.linear(x, weight, bias) + scaling * F.linear(F.linear(xd, lora_a), lora_b)).to(x.dtype)


def draw_mask(draw: D.DropDraw, shape) -> torch.Tensor:
    """The bool mask (``shape``, last dim = in) a draw applies: what ``lora_linear_ref`` takes, with
    ``draw.p_applied`` as its dropout."""
    return D.keep_mask(draw, math.prod(shape[:-1]), shape[-1], draw.seed.device).reshape(shape)


def mm_scaled(a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """s * (a @ b) in one GEMM: addmm with beta=0 ignores its (uninitialized, broadcast) input, and
    cuBLAS multiplies by alpha in the epilogue. Saves the separate ``mul_`` launch of ``mm(a, b) * s``."""
    if s == 1.0:
        return torch.mm(a, b)
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=s)


def concat_weight(weight: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """[W | s B] (out, in + r): the per-call form, for direct callers; LoRALinear keeps one persistent."""
    return torch.cat([weight, lora_b * scaling], dim=1)


def branch_input(x2, draw):
    """The LoRA branch's input (N, in): x2, or drop(x2) under ``draw`` (one pass, ``ops.dropout``). One function
    for LoRALinear and LoRAGroup, so grouped and separate calls compute the same bits."""
    return x2 if draw is None else D.dropped(x2, draw)


def add_branch_dx_(dx, dyb, lora_a, draw, x2=None):
    """dx (N, in) += drop(dyb A) in place, one pass (the rank-r term of a branch that saw drop(x)); with x2, also
    returns drop(x2) from that pass (dA's input: one launch and one mask build), else None."""
    if x2 is None:
        D.add_dropped_(dx, torch.mm(dyb, lora_a), draw)
        return None
    return D.add_dropped_(dx, torch.mm(dyb, lora_a), draw, also=x2)[1]


def lora_forward(x2, weight, bias, lora_a, lora_b, scaling: float, draw, wcat, wa=None):
    """x2 (N, in) -> (y (N, out), xa = drop(x2) A^T (N, r), unscaled). No autograd (called in forward).

    draw: a ``DropDraw`` (dropout) or None; wcat: None for the addmm_ layout, else [W | s B] (out, in + r) for
    the concatenated layout; wa: None, or [W ; A] (out + r, in) for the addmm_ layout, where for a wide input (in >= 2
    out) x A^T then comes out of the base GEMM (without dropout and bias): y is then a row-strided view (row stride
    out + r).
    """
    if wcat is None and wa is not None and draw is None and bias is None and x2.shape[1] >= 2 * weight.shape[0]:
        # [x W^T | x A^T] in one GEMM: x is read once, not twice (the rank-r GEMM re-read all of x: 64 us a layer for
        # down_proj's 16,384 x 4,864 at the 0.5B LoRA protocol, H100), for r more output columns
        out = weight.shape[0]
        ye = torch.mm(x2, wa.t())  # (N, out + r)
        xa = ye[:, out:].contiguous()  # (N, r), saved for dB: the strided columns would keep all of ye alive
        y = ye[:, :out]
        lowrank_update_(y, xa, lora_b.t(), scaling)  # y += s (x A^T) B^T in place: y stays a view of ye
        return y, xa
    xa = torch.mm(branch_input(x2, draw), lora_a.t())  # (N, r)
    if wcat is not None:
        xcat = torch.cat([x2, xa], dim=1)  # (N, in + r), freed after forward: only x and xa are saved
        y = torch.mm(xcat, wcat.t()) if bias is None else torch.addmm(bias, xcat, wcat.t())
    else:
        y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())  # (N, out)
        lowrank_update_(y, xa, lora_b.t(), scaling)  # y += s (x A^T) B^T in place (ops.lowrank: see there)
    return y, xa


def lora_backward(dy2, x2, weight, lora_a, lora_b, xa, draw, scaling: float, wcat,
                  need_x: bool, need_a: bool, need_b: bool, wa=None):
    """dy2 (N, out) -> (dx2 (N, in), dA (r, in), dB (out, r)), None where not needed.

    x2 is only read for dA (so a caller may pass a recomputed x2, or None when not need_a). It may also be a
    function of dx2 returning x2, called once dx2 exists (LoRASwiGLUDownFunction rebuilds its input in the
    kernel that consumes dx2). wa: the layer's [W ; A] buffer or None (``lora_forward``).
    """
    dx = da = db = xd = None
    fin = lora_a.shape[1]
    # dyb = s dy B (N, r): the small tensor both dx and dA need.
    if need_x and wcat is not None:
        g = torch.mm(dy2, wcat)  # (N, in + r) = [dy W | s dy B]: dy read once for both
        dx_base, dyb = g[:, :fin], g[:, fin:]
    elif need_x or need_a:
        dyb = mm_scaled(dy2, lora_b, scaling)
    joint = need_x and wcat is None and draw is None
    # [dy | s dy B]: in the buffer the norm after this layer wrote dy into, when it left r columns free
    # (``ops.rms_norm``'s grad_spare, ``LoRALinear.dy_spare``), else a cat of (N, out + r): ~18 us a layer at 0.5B,
    # 44 at 8B (H100)
    full = grad_spare_columns(dy2, dy2.shape[1] + lora_a.shape[0]) if joint and wa is not None else None
    if joint and (fin >= 2 * dy2.shape[1] or full is not None):
        # dx = [dy | s dy B] @ [W ; A] in one GEMM (K = out + r), rounded once. dy W + (s dy B) A as two GEMMs ends in a
        # rank-r update that reads and writes (N, in): 123 us a layer for a wide input (down_proj, in = I) at the 0.5B
        # LoRA protocol (16,384 x 4,864), 188 us at 8B (H200 profiles); the cat of dy copies a quarter of those bytes
        # or less when in >= 2 out. With the norm's buffer there is no cat: then o_proj too (in = out; its rank-r
        # update ran 25 us a layer at 0.5B, 50 at 8B, H100). [W ; A]: the layer's own buffer (the forward's), or a
        # per-call copy of W (117 MB at the 8B down_proj)
        if full is None:
            full = torch.cat([dy2, dyb], 1)
        else:
            full[:, dy2.shape[1]:].copy_(dyb)
        dx = torch.mm(full, wa if wa is not None else torch.cat([weight, lora_a], 0))
    elif need_x:
        if wcat is None:
            dx_base = torch.mm(dy2, weight)  # (N, in)
        if draw is None:  # out of place from the strided g view: same bytes as in place + a later copy
            dx = torch.addmm(dx_base, dyb, lora_a) if wcat is not None else lowrank_update_(dx_base, dyb, lora_a)
        else:  # the LoRA branch saw drop(x): in place into g's strided dx columns, or into the fresh dy W
            xd = add_branch_dx_(dx_base, dyb, lora_a, draw, x2 if need_a and not callable(x2) else None)
            dx = dx_base
    if need_a:
        if callable(x2):
            x2 = x2(dx)
        da = torch.mm(dyb.t(), branch_input(x2, draw) if xd is None else xd)  # (r, in)
    if need_b:
        db = mm_scaled(dy2.t(), xa, scaling)  # (out, r); xa already carries the dropout scale
    return dx, da, db


class LoRALinearFunction(torch.autograd.Function):
    """y = x W^T (+b) + s (drop(x) A^T) B^T with gradients for x, A, B only (W and b are frozen).

    ``concat`` picks how the rank-r term joins the big GEMM (same math, different memory traffic):
      - False: ``lowrank_update_(y, xA^T, B^T, s)``: the rank-r update re-reads and re-writes y (2 N out elements)
        and, in backward, ``s dy B`` is one more pass over dy (N out).
      - True: forward ``[x, xA^T] @ [W, s B]^T`` (K = in + r) and backward ``dy @ [W, s B]`` (in + r
        columns), which yields dx's base part and ``s dy B`` in one pass over dy; costs the activation cat
        (read N in, write N (in + r)). ``wcat`` is the [W | s B] buffer (out, in + r): LoRALinear keeps
        one whose first ``in`` columns ARE W's storage and refreshes only the s B columns (out x r) per
        call; None builds it here per call (a full copy of W: 2 x 117 MB at the 8B gate/up, fwd and bwd).
    Without concat, ``wa`` (LoRALinear's [W ; A] buffer (out + r, in), whose first ``out`` rows ARE W's storage, or
    None) makes a wide input's x A^T in the base GEMM as r more output columns (in >= 2 out, without dropout and bias;
    ``lora_forward``), and dx as one GEMM over [dy | s dy B] and [W ; A] (``lora_backward``) reads it: a wide input's
    always, another's (o_proj) when the norm after it left dy r free columns (``ops.rms_norm``'s grad_spare).
    wcat and wa are kept on ctx, not save_for_backward: their s B columns / A rows are rewritten by the next forward
    of the same layer (same values until the optimizer steps), which must not trip autograd's version check.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, draw, concat: bool = False, wcat=None,
                wa=None):
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise RuntimeError("LoRALinearFunction: the base weight and bias must be frozen "
                               "(requires_grad=False; apply_lora does this); train them with a plain nn.Linear")
        if concat and wcat is None:
            wcat = concat_weight(weight, lora_b, scaling)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, in); a view when x is contiguous
        wa = None if concat else wa
        y, xa = lora_forward(x2, weight, bias, lora_a, lora_b, scaling, draw, wcat if concat else None, wa)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, xa)
        ctx.wcat, ctx.wa = (wcat if concat else None), wa
        ctx.scaling, ctx.draw, ctx.shape = scaling, draw, shape  # draw: a (1,) seed, not an activation
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, lora_a, lora_b, xa = ctx.saved_tensors
        dx, da, db = lora_backward(dy.reshape(-1, dy.shape[-1]), x2, weight, lora_a, lora_b, xa, ctx.draw,
                                   ctx.scaling, ctx.wcat, ctx.needs_input_grad[0],
                                   ctx.needs_input_grad[3], ctx.needs_input_grad[4], ctx.wa)
        ctx.wcat = ctx.wa = None
        return (None if dx is None else dx.view(ctx.shape)), None, None, da, db, None, None, None, None, None


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float, draw=None, impl: str = "fused",
                concat: bool = False, wcat=None):
    """See the module docstring. ``impl``: "fused" (LoRALinearFunction) or "torch" (reference, with the mask
    ``draw`` applies built in full). ``draw``: a ``DropDraw`` (``ops.dropout.draw``) or None."""
    if draw is not None and not isinstance(draw, D.DropDraw):  # the (mask, dropout) arguments this took before
        raise TypeError(f"lora_linear: draw must be an ops.dropout.DropDraw or None, got {type(draw).__name__}; "
                        f"make one with ops.dropout.draw(p, device) (a bool mask and a dropout p are not taken)")
    if impl == "fused":
        if not lora_a.dtype == lora_b.dtype == x.dtype:  # torch.mm's "expected m1 and m2 to have the same dtype"
            raise ValueError(f"lora_linear(impl='fused') takes A and B in x's dtype ({x.dtype}), got A {lora_a.dtype} "
                             f"and B {lora_b.dtype}; cast them (.to(x.dtype)), or pass impl='torch', which computes "
                             "wider adapters as PEFT does (x cast to theirs in the branch, the sum rounded to x's)")
        return LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, scaling, draw, concat, wcat)
    if impl == "torch":
        if draw is None:
            return lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling)
        return lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling, draw_mask(draw, x.shape), draw.p_applied)
    raise ValueError(f"lora_linear: impl={impl!r} is not one of {IMPLS}")


class LoRALinear(nn.Module):
    """Replaces an nn.Linear in place. Keeps the base ``weight`` / ``bias`` Parameters (same objects,
    so tied weights and existing references survive; frozen here) under the same names, and adds ``lora_A.weight``
    (r, in) and ``lora_B.weight`` (out, r): the state-dict keys PEFT saves, minus its prefix.

    With the fused concatenated layout, ``weight`` becomes a strided view (row stride in + r) into a
    private (out, in + r) buffer whose last r columns hold s B (refreshed each forward, out x r elements):
    no memory beyond r columns, and no per-call copy of W. Without concat (fused, no bias: down_proj, o_proj)
    ``weight`` is the first ``out`` rows of a private (out + r, in) buffer [W ; A] whose last r rows hold A
    (refreshed each training forward): for a wide input (in >= 2 out) the base GEMM makes x A^T too
    (``lora_forward``), and the backward's joint dx GEMM reads the buffer. ``model.to(...)`` rebinds either
    (``_apply``); ``to_linear`` / merge_lora give W back a storage of its own.
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
        # "auto": concatenated when out >= 2 in. Per call, concat costs the activation cat (~2 N in
        # elements) and saves the addmm_ pass over y (2 N out) and the dy B pass (N out): a win in bytes
        # from out > 2/3 in, but its GEMMs have K = in + r and in + r output columns (a partial tile: up
        # to ~3% of a GEMM at in = 4096), so near out ~ in it is a wash; out >= 2 in keeps it where the
        # saving is clear (gate/up: 8B 4096 -> 14336 saves ~570 MB per call, ~9 ms per step).
        self.concat = self.out_features >= 2 * self.in_features if concat == "auto" else concat
        self._wcat = None  # [W | s B] (out, in + r), a plain attribute: not in the state dict
        self.group = None  # a LoRAGroup (lora.group) owning W's storage; then no [W | s B] buffer of its own
        # as down_proj: recompute the SwiGLU product in backward (forward_swiglu); False keeps it (A/B runs)
        self.recompute_swiglu = True
        dev, dtype = base.weight.device, adapter_dtype or base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device="meta")
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device="meta")
        a = torch.empty(r, self.in_features, dtype=torch.float32)
        # PEFT's init: kaiming-uniform with a=sqrt(5) (bound 1/sqrt(in)), drawn in fp32 on the CPU so a
        # seed gives the same adapter on every device; B = 0 so the model starts exactly at the base.
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.weight = nn.Parameter(a.to(device=dev, dtype=dtype))
        self.lora_B.weight = nn.Parameter(torch.zeros(self.out_features, r, device=dev, dtype=dtype))
        self._bind_concat_buffer()

    @property
    def _layout(self) -> str | None:
        """The private buffer W lives in: "cols", [W | s B] (concat); "rows", [W ; A] (no concat, no bias: backward's
        joint dx GEMM reads it, and for in >= 2 out the forward's base GEMM makes x A^T); None (impl torch, a group's
        member, wide adapters, meta weights, a bias without concat)."""
        if self.impl != "fused" or self.group is not None or self.weight.device.type == "meta" or self.wide:
            return None
        if self.concat:
            return "cols"
        # rows without a bias. The forward's x A^T comes from the base GEMM only for a wide input (down_proj), where
        # the rank-r GEMM's read of x outweighs r more output columns: H100 (probe_lora_stacked_out): 0.5B down
        # 286.8 -> 237.0 us, 8B down 1,474 -> 1,462 us, but 8B o_proj 448 -> 460 us (4,096 + 32 columns: a partial
        # tile). Backward's [dy | s dy B] @ [W ; A] reads it for both (``lora_backward``): no per-call cat of W
        # (88 us at the 8B down_proj)
        return "rows" if self.bias is None else None

    @property
    def _uses_wcat(self) -> bool:
        return self._layout == "cols"

    def _uses(self, x: torch.Tensor) -> bool:
        """Whether this call runs through the bound buffer: "cols" always; "rows" in training only. Without gradients
        (evaluation, generation) y = x W^T stays the base model's own GEMM, so a zero B gives the base's logits bit
        for bit (the GEMM of r more output columns may sum in another order)."""
        layout = self._layout
        return layout == "cols" or (layout == "rows" and torch.is_grad_enabled())

    @property
    def dy_spare(self) -> int:
        """r when backward's dx can run one GEMM over [dy | s dy B] and this layer's [W ; A] buffer (``lora_backward``:
        the "rows" layout, no dropout), so the norm that reads this layer's output can leave r free columns after
        each row of its dy for s dy B (``models.fused_proj.grad_spare``); else 0."""
        return self.r if self._layout == "rows" and self.dropout == 0 else 0

    @property
    def wide(self) -> bool:
        """A and B wider than the base weight (fp32 on bf16 / fp16, as ``load_adapter`` puts them there): the
        branch runs in their dtype through ``lora_linear_ref``, PEFT's computation (see ``forward``)."""
        return wider(self.adapter_dtype, self.weight.dtype)

    @property
    def adapter_dtype(self) -> torch.dtype:
        """The dtype of A and B, or the wider of the two where they differ (a user cast only one of them)."""
        return torch.promote_types(self.lora_A.weight.dtype, self.lora_B.weight.dtype)

    @torch.no_grad()
    def _bind_concat_buffer(self) -> None:
        """Move W into a new buffer of ``_layout``: the first ``in`` columns of (out, in + r), or the first ``out`` rows
        of (out + r, in) (one copy of W, once)."""
        self._wcat = None
        layout = self._layout
        if layout is None:
            return
        w, (o, i) = self.weight, (self.out_features, self.in_features)
        buf = torch.empty((o, i + self.r) if layout == "cols" else (o + self.r, i), dtype=w.dtype, device=w.device)
        view = buf[:, :i] if layout == "cols" else buf[:o]
        view.copy_(w)
        w.data = view  # same Parameter object (ties, optimizer refs), new storage
        self._wcat = buf

    def _concat_buffer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The bound buffer with its s B columns ("cols") or A rows ("rows") refreshed from ``b`` / ``a`` (one small
        kernel)."""
        buf = self._wcat
        # weight.data replaced from outside (load, .data =, a dtype/device move not through _apply)?
        # data_ptr is a graph break under torch.compile, so the check runs in eager mode only.
        if buf is None or (not torch.compiler.is_compiling() and self.weight.data_ptr() != buf.data_ptr()):
            log.info("LoRALinear: rebinding [W | s B] after the base weight's storage changed")
            self._bind_concat_buffer()
            buf = self._wcat
        with torch.no_grad():
            if buf.shape[0] == self.out_features:  # "cols" (out, in + r); "rows" is (out + r, in): no second _layout
                torch.mul(b, self.scaling, out=buf[:, self.in_features:])
            else:
                buf[self.out_features:].copy_(a)
        return buf

    def _apply(self, fn, recurse=True):
        # .to(dtype/device) gives W a new contiguous tensor: bind a new buffer on the new device (the old
        # one is freed when this returns); a no-op move (same dtype and device) keeps the binding.
        old, self._wcat = self._wcat, None
        super()._apply(fn, recurse)
        if self.group is not None:  # W left the group's buffer: let it go now, rebind at the next call
            self.group.release_if_stale()
        if old is not None and self.weight.data_ptr() == old.data_ptr() and self.weight.dtype == old.dtype:
            self._wcat = old
        else:
            del old
            self._bind_concat_buffer()
        return self

    def _adapters(self, x):
        """(A, B in x's dtype unless wider than it, this call's ``DropDraw`` or None). A and B of two dtypes
        both take the wider one first (fp32 A and bf16 B on a bf16 base run as fp32 adapters)."""
        ad = self.adapter_dtype
        if not wider(ad, x.dtype):  # bf16 adapters on an fp32 base: cast the small matrices (exactly), not x
            ad = x.dtype
        return self.lora_A.weight.to(ad), self.lora_B.weight.to(ad), self.dropout_draw(x)

    def dropout_draw(self, x):
        """This call's dropout draw (one seed from torch's generator on x's device: the mask is rebuilt from it
        where it is applied, never stored), or None (eval, or dropout 0). A LoRAGroup draws its members' here
        too, in member order, so grouped and separate calls draw the same masks."""
        if self.dropout > 0 and self.training:
            return D.draw(self.dropout, x.device)
        return None

    def forward(self, x):
        a, b, draw = self._adapters(x)
        # Adapters wider than x (fp32 A and B on a bf16 base: load_adapter's default there, as PEFT's) run the
        # reference, PEFT's computation. The fused layouts would round them to bf16 ([W | s B] holds s B in W's
        # dtype): the logits' mean error against float64 was then 1.23x PEFT's, 1.01x this way (bf16, 3 strong
        # adapters, tests/lora/test_adapter_dtype.py). The trainer's adapters take the base's dtype: never here.
        if self.impl == "torch" or a.dtype != x.dtype:
            return lora_linear(x, self.weight, self.bias, a, b, self.scaling, draw, impl="torch")
        buf = self._concat_buffer(a, b) if self._uses(x) else None
        return LoRALinearFunction.apply(x, self.weight, self.bias, a, b, self.scaling, draw, self.concat,
                                        buf if self.concat else None, None if self.concat else buf)

    def forward_swiglu(self, gate, up=None, impl: str = "auto", fused_act: bool = True, in_place: bool = False):
        """``self(swiglu(gate, up))`` without keeping the SwiGLU product for backward: it is recomputed
        from the saved gate / up (see ``chronicals.lora.mlp``). gate, up (..., in) -> (..., out); up None:
        gate is the packed gu (..., 2 in) = [gate | up] (``ops.swiglu_gate_up``).
        The decoder's MLP calls this when its down_proj offers it; ``impl`` is the SwiGLU op's; ``fused_act``:
        the SwiGLU backward kernel writes the product for dA (packed gu on Triton), else a second forward;
        ``in_place``: that kernel writes over the saved gu and d_act (``RuntimeOptions.swiglu_backward_in_place``)."""
        from .mlp import LoRASwiGLUDownFunction, swiglu_for_impl

        if self.impl == "torch" or not self.recompute_swiglu or wider(self.adapter_dtype, gate.dtype):
            return self(swiglu_for_impl(gate, up, impl))  # plain autograd (the product is kept), or wide adapters
        a, b, draw = self._adapters(gate)
        buf = self._concat_buffer(a, b) if self._uses(gate) else None
        return LoRASwiGLUDownFunction.apply(gate, up, self.weight, self.bias, a, b, self.scaling, draw,
                                            self.concat, buf if self.concat else None, impl, fused_act, in_place,
                                            None if self.concat else buf)

    def _merge_dtype(self) -> torch.dtype:
        """fp32, or float64 when W, A or B is float64 (an fp64 model's merge was rounded to fp32 on the way)."""
        wide = torch.float64 in (self.weight.dtype, self.lora_A.weight.dtype, self.lora_B.weight.dtype)
        return torch.float64 if wide else torch.float32

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """s * B @ A (out, in) in fp32 (float64 for float64 tensors): only for merging, never in the training path."""
        dt = self._merge_dtype()
        return self.scaling * (self.lora_B.weight.to(dt) @ self.lora_A.weight.to(dt))

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """W += s B A (W + s B A computed in fp32, or float64, rounded once to W's dtype) and return a plain nn.Linear on the
        same Parameters. (Adding the rounded delta in bf16 rounds twice: ~46% of a bf16 merge's elements then
        differed from the correctly rounded sum.)"""
        self.weight.copy_(self.weight.to(self._merge_dtype()).add_(self.delta_weight()))
        if self._wcat is not None or not self.weight.is_contiguous():  # leave the [W | s B] or [W ; A] buffer (or a
            # LoRAGroup's): W gets a storage of its own back
            self.weight.data = self.weight.data.clone(memory_format=torch.contiguous_format)
        self._wcat = None
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin.train(self.training)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"alpha={self.alpha}, scaling={self.scaling:g}, dropout={self.dropout}, impl={self.impl}, "
                f"concat={self.concat}")
