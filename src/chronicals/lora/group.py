"""LoRA projections that share one input (q/k/v, gate/up) run as one GEMM: ``LoRAGroup``.

Shapes: x (..., in) -> y (..., sum out_i); member i: W_i (out_i, in), A_i (r_i, in), B_i (out_i, r_i), s_i.

    y = [x, x A_all^T] @ M^T (+ [b_0; b_1; ...])      A_all = [A_0; A_1; ...]   (R, in), R = sum r_i
    M = | W_0  s_0 B_0   0      ...  |                (sum out_i, in + R), one persistent buffer
        | W_1   0     s_1 B_1   ...  |

The members' base weights are row blocks of M (``W_i.data`` is a view: no memory beyond the R columns, as in
``LoRALinear``'s own [W | s B] layout); the s_i B_i blocks are refreshed each call (sum out_i x r_i elements),
the off-diagonal blocks stay zero. Backward, with dy = [dy_0, dy_1, ...] (N, sum out_i):

    g   = dy @ M                    (N, in + R) = [sum_i dy_i W_i | s_i dy_i B_i ...]: dy read once
    dx  = g[:, :in] + g[:, in:] @ A_all         one rank-R update into g (ops.lowrank): the members' dx arrive
                                                summed, no copy
    dA  = g[:, in:]^T @ x           (R, in)     one GEMM; rows split back to the A_i by cat's backward
    dB_i = s_i dy_i^T (x A_i^T)     (out_i, r_i) one small GEMM per member

The zero blocks add exact zeros, so every sum is the members' own sum (up to the GEMMs' accumulation order).

With LoRA dropout (in training), member i's branch sees drop_i(x) = x * m_i / (1 - p_i), its own mask m_i from its
own ``DropDraw`` (a seed, ``ops.dropout``: the mask is rebuilt where it is applied, never stored), drawn in member
order as separate calls draw them (so the same seed gives the same masks): x A_i^T becomes drop_i(x) A_i^T (one
small GEMM per member instead of one for all), dx's rank-r term per member is added through m_i in one pass, and
dA_i reads drop_i(x) rebuilt. The base GEMM, M, dy @ M and every dB_i are unchanged.

Why (Qwen2.5-0.5B protocol, LoRA r=32 on all 7 projections, 24 layers): per layer the separate path runs
q/k/v as 3 base GEMMs (k and v are 896 -> 128: far too narrow to reach the matmul peak), 3 rank-r GEMMs
reading x, 3 dA GEMMs reading x again, and autograd sums the three dx (2 adds of N x 896) and the two of
gate/up (1 add). Grouped: x is read by 2 GEMMs instead of 6 forward, the dx sum happens inside one GEMM,
and gate/up come out as one (N, 2I) tensor that ``ops.swiglu_gate_up`` reads directly (its backward
writes d_gu whole). Cost: the zero blocks are extra K columns (R - r_i per row block: 64 of 992 at q/k/v,
32 of 960 at gate/up, 0.5B shape) and the activation cat (N x (in + R)).

Which members qualify: LoRALinear with impl "fused", one in_features, base dtype and device,
one adapter dtype no wider than the base's (fp32 adapters on a bf16 base run PEFT's fp32 branch apart, see
``LoRALinear.forward``), no forward hooks, all or none with a bias. Otherwise ``why_not`` says why, and the
members run apart.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..models.fused_proj import LORA_GROUPS
from ..ops.lowrank import lowrank_update_
from ..ops.rms_norm import spare_columns
from .layer import LoRALinear, add_branch_dx_, branch_input, mm_scaled

log = logging.getLogger("chronicals.lora")


def why_not(members) -> str | None:
    """None when ``members`` can form a LoRAGroup, else the reason (for the log)."""
    if not all(type(m) is LoRALinear for m in members):
        return "not every module is a LoRALinear"
    m0 = members[0]
    for m in members:
        if m.impl != "fused":
            return f"impl={m.impl!r} (the group is the fused path)"
        if m._forward_hooks or m._forward_pre_hooks:
            return "a module has forward hooks"
        if m.in_features != m0.in_features:
            return "the modules differ in in_features"
        if m.weight.dtype != m0.weight.dtype or m.weight.device != m0.weight.device:
            return "the base weights differ in dtype or device"
        if m.lora_A.weight.dtype != m0.lora_A.weight.dtype or m.lora_B.weight.dtype != m0.lora_A.weight.dtype:
            return "the adapters differ in dtype"
        if m.wide:  # M holds s B in W's dtype
            return (f"{str(m.adapter_dtype).removeprefix('torch.')} adapters on "
                    f"{str(m.weight.dtype).removeprefix('torch.')} weights run their branch in their own dtype")
        if m.weight.device.type == "meta":
            return "the weights are on the meta device"
    if len({m.bias is None for m in members}) > 1:
        return "some have a bias and some do not"
    return None


def group_forward(x2, mat, bias, a_all, ranks=(), draws=None, full=None):
    """x2 (N, in) -> (y = [x2, xa] @ M^T (+ bias) (N, sum out), xa (N, R)). No autograd.

    xa = x2 A_all^T; with ``draws`` (one ``DropDraw`` or None per member) member i's columns are drop_i(x2) A_i^T.
    full: None, or the (N, in + R) buffer whose first ``in`` columns are x2 (``ops.rms_norm``'s ``spare``): xa is
    written into its last R columns and the GEMM reads it, instead of a new [x2, xa] (the same values in the same
    layout, so the same bits)."""
    if draws is None:
        xa = torch.mm(x2, a_all.t())  # (N, R)
    else:
        parts, r = [], 0
        for rank, draw in zip(ranks, draws):
            parts.append(torch.mm(branch_input(x2, draw), a_all[r:r + rank].t()))  # (N, r_i)
            r += rank
        xa = torch.cat(parts, dim=1)
    if full is None:  # (N, in + R): freed after forward, only x and xa are saved
        xcat = torch.cat([x2, xa], dim=1)
    else:  # xa stays a tensor of its own for backward: norm recompute rebuilds x2's buffer without these columns
        xcat = full
        full[:, x2.shape[1]:].copy_(xa)
    y = torch.mm(xcat, mat.t()) if bias is None else torch.addmm(bias, xcat, mat.t())  # (N, sum out)
    return y, xa


class LoRAGroupFunction(torch.autograd.Function):
    """y = [x, x A_all^T] @ M^T (+ bias) with gradients for x, A_all and each B_i (see the module docstring).

    Arguments: x (..., in); mat M (sum out, in + R), kept on ctx (its s B blocks are rewritten by the layer's
    next forward with the same values until the optimizer steps, which must not trip the version check);
    bias (sum out,) or None; a_all (R, in); outs, ranks, scales (per member); draws: None (no dropout) or one
    ``DropDraw`` or None per member; full: None or x's (N, in + R) buffer (``group_forward``); then B_0, B_1, ...
    (out_i, r_i).
    """

    @staticmethod
    def forward(ctx, x, mat, bias, a_all, outs, ranks, scales, draws, full, *bs):
        shape = x.shape
        x2 = x.reshape(-1, a_all.shape[1])  # (N, in)
        y, xa = group_forward(x2, mat, bias, a_all, ranks, draws, full)
        # the B_i are inputs for their gradients only: M holds s B; draws hold a (1,) seed each, no mask
        ctx.save_for_backward(x2, a_all, xa)
        ctx.mat, ctx.outs, ctx.ranks, ctx.scales, ctx.shape = mat, outs, ranks, scales, shape
        ctx.draws = draws
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, a_all, xa = ctx.saved_tensors
        draws = ctx.draws
        mat, fin = ctx.mat, a_all.shape[1]  # kept on ctx: the group's own buffer, and a second backward needs it
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, sum out)
        need_x, need_a = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        dx = da = None
        da_parts = {}  # member -> dA_i computed beside its dx term (dropout: one pass builds both)
        if need_x:
            g = torch.mm(dy2, mat)  # (N, in + R) = [dy W | s dy B]
            dyb = g[:, fin:]
            # (N, in), the members' dx summed in the GEMM, written in place into g's first columns: dx is a
            # row-strided view (row stride in + R). Out of place, addmm first copies that view into a fresh
            # (N, in) tensor with torch's strided copy kernel: 2 per layer, 1.8 ms of a 0.5B LoRA step and
            # ~4 ms at 8B in the H200 profiles. dx goes to the RMSNorm backward, which reads row strides.
            dx = g[:, :fin]
            if draws is None:
                lowrank_update_(dx, dyb, a_all)
            else:  # member i's branch saw drop_i(x): its rank-r term goes through m_i, added in one pass that
                # also writes drop_i(x) for dA_i (used at once, so one such copy is alive at a time)
                for i, (dyb_i, a_i, draw) in enumerate(_per_member(dyb, a_all, ctx.ranks, draws)):
                    if draw is None:
                        lowrank_update_(dx, dyb_i, a_i)
                        continue
                    xd = add_branch_dx_(dx, dyb_i, a_i, draw, x2 if need_a else None)
                    if xd is not None:
                        da_parts[i] = torch.mm(dyb_i.t(), xd)
                        del xd
        elif need_a:
            dyb = torch.mm(dy2, mat[:, fin:])  # (N, R)
        if need_a:
            if draws is None:
                da = torch.mm(dyb.t(), x2)  # (R, in)
            else:  # dA_i = dyb_i^T drop_i(x), as LoRALinear computes it
                da = torch.cat([da_parts[i] if i in da_parts else torch.mm(dyb_i.t(), branch_input(x2, draw))
                                for i, (dyb_i, _, draw) in enumerate(_per_member(dyb, a_all, ctx.ranks, draws))])
        dbs = []
        o = r = 0
        for i, (out, rank, s) in enumerate(zip(ctx.outs, ctx.ranks, ctx.scales)):
            need_b = ctx.needs_input_grad[9 + i]  # x, mat, bias, a_all, outs, ranks, scales, draws, full, *bs
            dbs.append(mm_scaled(dy2[:, o:o + out].t(), xa[:, r:r + rank], s) if need_b else None)
            o, r = o + out, r + rank
        # ctx.draws stays: a second backward (retain_graph) must drop what the first did (a (1,) seed each)
        return ((None if dx is None else dx.view(ctx.shape)), None, None, da, None, None, None, None, None, *dbs)


def _per_member(dyb, a_all, ranks, draws):
    """(dyb_i (N, r_i), A_i (r_i, in), draw_i) per member: column / row blocks of dyb and A_all."""
    r = 0
    for rank, draw in zip(ranks, draws):
        yield dyb[:, r:r + rank], a_all[r:r + rank], draw
        r += rank


class LoRAGroup:
    """Members (LoRALinear sharing one input) run as one GEMM. Not an nn.Module: the state dict, the
    parameters and the module tree stay the members' own; ``apply_lora`` stores a group on the parent
    module (``attn.lora_qkv``, ``mlp.lora_gate_up``), where ``models.fused_proj`` finds it."""

    def __init__(self, members):
        reason = why_not(members)
        if reason is not None:
            raise ValueError(f"LoRAGroup: these modules cannot share one GEMM: {reason}")
        self.members = tuple(members)
        self.fin = members[0].in_features
        self.outs = tuple(m.out_features for m in members)
        self.ranks = tuple(m.r for m in members)
        self.scales = tuple(float(m.scaling) for m in members)
        self._mat = None
        self._ptrs: list[int] = []  # data_ptr of each member's W view into the bound buffer
        self._b_views: list[torch.Tensor] = []  # each member's s B block of the bound buffer
        for m in members:  # the member's own [W | s B] buffer gives way to the group's
            m.group = self
            m._bind_concat_buffer()
        self.bind()

    @property
    def width(self) -> int:
        return self.fin + sum(self.ranks)

    def is_current(self, mods) -> bool:
        """True when ``mods`` are still exactly the members (merge_lora puts plain Linears back) and none has
        gained a forward hook since the group was made: the members then run apart, as ``why_not`` would have
        them, so the hook runs (the group's GEMM calls no member; a hook added later was skipped silently)."""
        return (len(mods) == len(self.members) and all(a is b for a, b in zip(mods, self.members))
                and not any(m._forward_hooks or m._forward_pre_hooks for m in self.members))

    @torch.no_grad()
    def bind(self) -> None:
        """Copy the members' W into one new (sum out, in + R) buffer and make each W a row-block view of it."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("LoRAGroup: the base weights changed storage during CUDA-graph capture; move or "
                               "load the model before the first training step")
        self._mat, self._ptrs, self._b_views = None, [], []  # the old buffer is freed once no W points into it
        w0 = self.members[0].weight
        mat = torch.zeros(sum(self.outs), self.width, dtype=w0.dtype, device=w0.device)
        o, c = 0, self.fin
        for m in self.members:
            mat[o:o + m.out_features, :self.fin].copy_(m.weight)
            m.weight.data = mat[o:o + m.out_features, :self.fin]  # same Parameter object (ties, optimizer refs)
            self._ptrs.append(m.weight.data_ptr())
            self._b_views.append(mat[o:o + m.out_features, c:c + m.r])
            o, c = o + m.out_features, c + m.r
        self._mat = mat

    def release_if_stale(self) -> None:
        """Called by a member's ``_apply`` (``model.to``): when a W got new storage, drop the buffer now (so the
        old device's copy is freed once every member has moved) and rebind at the next call."""
        if not self._bound():  # the B views too: they held the whole old buffer (q/k/v or gate/up W) alive
            self._mat, self._ptrs, self._b_views = None, [], []

    def _bound(self) -> bool:
        mat = self._mat
        if mat is None:
            return False
        if torch.compiler.is_compiling():  # data_ptr is a graph break; eager calls keep the check
            return True
        return all(m.weight.data_ptr() == p and m.weight.dtype == mat.dtype
                   for m, p in zip(self.members, self._ptrs))

    def matrix(self, bs) -> torch.Tensor:
        """M with its s_i B_i blocks refreshed from ``bs`` (the members' B in x's dtype)."""
        if not self._bound():
            log.info("LoRAGroup: rebinding the shared weight buffer after a base weight changed storage")
            self.bind()
        with torch.no_grad():
            for b, s, view in zip(bs, self.scales, self._b_views):
                torch.mul(b, s, out=view)
        return self._mat

    def _inputs(self, dt):
        """(A_all (R, in), [B_i], bias or None) in the activations' dtype ``dt``."""
        a_s = [m.lora_A.weight for m in self.members]
        bs = [m.lora_B.weight for m in self.members]
        if a_s[0].dtype != dt:  # bf16 adapters on an fp32 base: cast the small matrices, not x
            a_s, bs = [a.to(dt) for a in a_s], [b.to(dt) for b in bs]
        bias = None if self.members[0].bias is None else torch.cat([m.bias for m in self.members])
        return torch.cat(a_s), bs, bias  # cat's backward splits dA back to the members

    def _draws(self, x: torch.Tensor):
        """Each member's dropout draw (or None) from ``LoRALinear.dropout_draw`` in member order, as separate calls
        draw them; None when no member drops (eval mode, or dropout 0)."""
        if not any(m.dropout > 0 and m.training for m in self.members):
            return None
        return tuple(m.dropout_draw(x) for m in self.members)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> y (..., sum out_i), member outputs side by side in member order."""
        return self.with_recipe(x)[0]

    def with_recipe(self, x: torch.Tensor):
        """(``self(x)``, a function that rebuilds that output bit for bit: for ``ops.recompute`` offers)."""
        if torch.is_grad_enabled() and any(m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad)
                                           for m in self.members):  # M is a buffer: W would get no gradient
            raise RuntimeError("LoRAGroup: the base weight and bias must be frozen (requires_grad=False; "
                               "apply_lora does this); train them with a plain nn.Linear, or merge_lora first")
        draws = self._draws(x)
        a_all, bs, bias = self._inputs(x.dtype)
        mat = self.matrix(bs)
        full = spare_columns(x, self.width)
        y = LoRAGroupFunction.apply(x, mat, bias, a_all, self.outs, self.ranks, self.scales, draws, full, *bs)
        return y, functools.partial(self.recompute, x, draws)

    @torch.no_grad()
    def recompute(self, x: torch.Tensor, draws=None) -> torch.Tensor:
        """The output of a ``self(x)`` with these dropout draws again, bit for bit (same GEMMs on the same values:
        M's s B blocks still hold the forward's B, which only the optimizer step changes)."""
        a_all, _, bias = self._inputs(x.dtype)
        y, _ = group_forward(x.reshape(-1, self.fin), self._mat, bias, a_all, self.ranks, draws,
                             spare_columns(x, self.width))
        return y.view(*x.shape[:-1], y.shape[-1])


def bind_groups(model: torch.nn.Module) -> int:
    """Give every attention block with LoRA q/k/v and every MLP with LoRA gate/up a LoRAGroup; return how many.

    Blocks whose projections do not qualify (see ``why_not``) keep separate calls; the reason is logged once.
    """
    made, reasons = 0, set()
    for mod in model.modules():
        for attr, names in LORA_GROUPS:
            if not all(isinstance(getattr(mod, n, None), LoRALinear) for n in names):
                continue
            members = [getattr(mod, n) for n in names]
            reason = why_not(members)
            if reason is None:
                setattr(mod, attr, LoRAGroup(members))
                made += 1
            else:
                reasons.add(f"{attr}: {reason}")
    for r in sorted(reasons):
        log.info("LoRA groups: separate projection calls (%s)", r)
    return made


def unbind_groups(model: torch.nn.Module) -> None:
    """Drop every LoRAGroup (merge_lora): members get plain storage back through ``LoRALinear.to_linear``."""
    for mod in model.modules():
        for attr, _ in LORA_GROUPS:
            group = mod.__dict__.pop(attr, None)
            if group is not None:
                for m in group.members:
                    m.group = None
