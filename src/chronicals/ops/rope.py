"""Rotary position embedding on Q and K, Hugging Face half-rotation layout (not interleaved).

Shapes: q (B, S, Hq, D), k (B, S, Hk, D), cos/sin (B, S, R) with R <= D the rotary dims (R < D is
partial rotary: dims R..D pass through). cos/sin come from per-token positions, so packed rows whose
positions restart at 0 per document are handled by the caller's ``position_ids``.

The Triton path has two front doors over one launcher: in eager mode ``RopeQKFunction``, a plain
autograd.Function (skips the ~0.1 ms of CPU that the ``torch.library`` dispatch costs per call; the kernel
moves 2 x 8192 x 40 x 128 x 2 B = 168 MB at the 8B shape, 39 us at 4.25 TB/s); under torch.compile the
``torch.library`` op ``chronicals::rope_qk`` (backward ``chronicals::rope_qk_backward``).
One launch rotates q and k together; each program takes BLOCK_T tokens, loads their cos/sin once and
rotates all Hq + Hk heads of them as (BLOCK_T, heads, R/2) tiles. With x1 = x[:R/2], x2 = x[R/2:R]:

    forward   y1 = x1 * cos1 - x2 * sin1        backward (inverse rotation, the transpose)
              y2 = x2 * cos2 + x1 * sin2                  dx1 = dy1 * cos1 + dy2 * sin2
                                                          dx2 = dy2 * cos2 - dy1 * sin1

Outputs are new tensors. There is no in-place variant: whatever produced q and k (a bias add, a LoRA
path, q/k norms) may have saved them for its own backward, so rotating them in place is not safe under
autograd; out of place costs memory, not bandwidth. Bytes: q and k read once and written once in each
direction; cos/sin add R / ((Hq + Hk) * D) of that (2.5% at the 8B shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._impl import resolve_impl
from ._triton_utils import check_device, tune_configs


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32):
    """position_ids (B, S) int, inv_freq (R/2,) fp32 -> cos, sin (B, S, R) in ``dtype``. The math is fp32 for any
    ``dtype``, float64 too, as transformers' rotary embedding computes it (angles ~1.5e-4 off float64 at position
    4095): a float64 model matches transformers' float64 model."""
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


# ---------------------------------------------------------------- kernels


@triton.jit
def _rotate_heads(X_ptr, O_ptr, x_tok, o_tok, x_head_stride, NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                  c1, c2, a, b, tok_ok, BLOCK_NH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_PASS: tl.constexpr):
    """BLOCK_T tokens x NH heads as one (BLOCK_T, BLOCK_NH, BLOCK_HALF) tile: o1 = x1*c1 + x2*a,
    o2 = x2*c2 + x1*b (a, b = -sin1, sin2 forward). x_tok, o_tok, tok_ok: (BLOCK_T, 1, 1) token offsets/mask."""
    heads = tl.arange(0, BLOCK_NH)[None, :, None]  # (1, BLOCK_NH, 1)
    half = tl.arange(0, BLOCK_HALF)[None, None, :]  # (1, 1, BLOCK_HALF)
    mask = tok_ok & (heads < NH) & (half < R // 2)
    x_off = x_tok + heads * x_head_stride + half
    o_off = o_tok + heads * D + half  # outputs have head stride D (contiguous heads; tokens at o_tok)
    x1 = tl.load(X_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + x_off + R // 2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1 + x2 * a
    o2 = x2 * c2 + x1 * b
    tl.store(O_ptr + o_off, o1.to(O_ptr.dtype.element_ty), mask=mask)
    tl.store(O_ptr + o_off + R // 2, o2.to(O_ptr.dtype.element_ty), mask=mask)
    if D > R:  # partial rotary: dims R..D pass through unchanged
        p = tl.arange(0, BLOCK_PASS)[None, None, :]
        pmask = tok_ok & (heads < NH) & (p < D - R)
        xp = tl.load(X_ptr + x_tok + heads * x_head_stride + R + p, mask=pmask, other=0.0)
        tl.store(O_ptr + o_tok + heads * D + R + p, xp.to(O_ptr.dtype.element_ty), mask=pmask)


# The interpreter takes the first config: 16 tokens per program keeps the CPU tests' program count low.
_CONFIGS = [triton.Config({"BLOCK_T": t}, num_warps=w)
            for t, w in ((16, 4), (1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8))]


@triton.autotune(configs=tune_configs(_CONFIGS), key=["HQ", "HK", "D", "R"])
@triton.jit
def _rope_qk_kernel(Q_ptr, K_ptr, COS_ptr, SIN_ptr, QO_ptr, KO_ptr, T, S,
                    q_stride_b, q_stride_s, q_stride_h, k_stride_b, k_stride_s, k_stride_h, cs_stride_b,
                    cs_stride_s, qo_stride_b, qo_stride_s, ko_stride_b, ko_stride_s, HQ: tl.constexpr,
                    HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                    BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens pid*BLOCK_T .. +BLOCK_T of the flattened B*S; cos/sin (B, S, R) loaded once per token."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = (t < T)[:, None, None]  # (BLOCK_T, 1, 1)
    bi = t // S
    si = t % S
    half = tl.arange(0, BLOCK_HALF)[None, None, :]
    cs = (bi * cs_stride_b + si * cs_stride_s)[:, None, None] + half  # (BLOCK_T, 1, BLOCK_HALF)
    cmask = tok_ok & (half < R // 2)
    c1 = tl.load(COS_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS_ptr + cs + R // 2, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN_ptr + cs + R // 2, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:
        a = s2
        b = -s1
    else:
        a = -s1
        b = s2
    _rotate_heads(Q_ptr, QO_ptr, (bi * q_stride_b + si * q_stride_s)[:, None, None],
                  (bi * qo_stride_b + si * qo_stride_s)[:, None, None], q_stride_h,
                  HQ, D, R, c1, c2, a, b, tok_ok, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(K_ptr, KO_ptr, (bi * k_stride_b + si * k_stride_s)[:, None, None],
                  (bi * ko_stride_b + si * ko_stride_s)[:, None, None], k_stride_h,
                  HK, D, R, c1, c2, a, b, tok_ok, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


# ---------------------------------------------------------------- launchers


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_qk_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """q (B, S, Hq, D), k (B, S, Hk, D), cos/sin (B, S, R) -> rotated (or, backward, un-rotated) copies,
    contiguous, or written into ``out`` (qo, ko of q's and k's shapes and dtype whose heads are contiguous, D
    elements apart, tokens at any stride: column blocks of one (B, S, H, D) tensor, ``rope_qkv``'s backward).
    Inputs may be strided except in their last dim; cos/sin may broadcast over B (stride 0)."""
    q, k, cos, sin = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    bsz, s, hq, d = q.shape
    hk, r = k.shape[2], cos.shape[-1]
    if sin.stride() != cos.stride():
        sin = sin.expand_as(cos).contiguous()
        cos = cos.expand_as(sin).contiguous()
    if out is None:
        qo = torch.empty((bsz, s, hq, d), device=q.device, dtype=q.dtype)
        ko = torch.empty((bsz, s, hk, d), device=k.device, dtype=k.dtype)
    else:
        qo, ko = out
        if qo.shape != q.shape or ko.shape != k.shape or qo.stride()[2:] != (d, 1) or ko.stride()[2:] != (d, 1):
            raise ValueError(f"rope_qk_apply: out {tuple(qo.shape)}, {tuple(ko.shape)} must have q's and k's shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)} with heads D={d} elements apart")
    t = bsz * s
    if t == 0:
        return qo, ko
    _rope_qk_kernel[lambda meta: (triton.cdiv(t, meta["BLOCK_T"]),)](
        q, k, cos, sin, qo, ko, t, s, *q.stride()[:3], *k.stride()[:3], cos.stride(0), cos.stride(1),
        *qo.stride()[:2], *ko.stride()[:2], HQ=hq, HK=hk, D=d, R=r, BACKWARD=backward,
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=triton.next_power_of_2(max(r // 2, 1)),
        BLOCK_PASS=triton.next_power_of_2(max(d - r, 1)))
    return qo, ko


class RopeQKFunction(torch.autograd.Function):
    """The eager door: q (B, S, Hq, D), k (B, S, Hk, D), cos/sin (B, S, R) -> (q_rot, k_rot)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_qk_apply(q, k, cos, sin, backward=False)

    @staticmethod
    @once_differentiable  # the kernels' backward builds no graph: a double backward raises
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_qk_apply(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


class RopeQKVFunction(torch.autograd.Function):
    """qkv (B, S, Hq + 2 Hk, D), one GEMM's q | k | v heads -> (q_rot, k_rot, v), each contiguous; backward writes dq,
    dk and dv into one new (B, S, Hq + 2 Hk, D) tensor (see ``rope_qkv``)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, nq: int, nkv: int):
        q, k, v = qkv.split([nq, nkv, nkv], dim=2)
        ctx.save_for_backward(cos, sin)
        ctx.nq, ctx.nkv = nq, nkv
        # v copied out: attention saves it, and a view would keep the whole GEMM output alive (qkv_proj)
        return (*rope_qk_apply(q, k, cos, sin, backward=False), v.contiguous())

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        nq, nkv = ctx.nq, ctx.nkv
        b, s, _, d = dq.shape
        dqkv = dq.new_empty((b, s, nq + 2 * nkv, d))
        rope_qk_apply(dq, dk, cos, sin, backward=True, out=(dqkv[:, :, :nq], dqkv[:, :, nq:nq + nkv]))
        dqkv[:, :, nq + nkv:].copy_(dv)
        return dqkv, None, None, None, None


def rope_qkv(qkv, cos, sin, nq: int, nkv: int, *, impl: str = "auto"):
    """(q_rot, k_rot, v) from one GEMM's output: q, k, v = qkv.split([nq, nkv, nkv], 2), q and k rotated as
    ``rope_qk`` rotates them, v copied out contiguous. qkv (B, S, nq + 2 nkv, D), cos/sin as ``rope_qk``'s.

    Why one op: with the split in autograd, backward concatenated the rotated-back dq, dk and dv into the GEMM's
    (B, S, nq + 2 nkv, D) gradient, one more read and write of all of it (2.29 ms a step at the 8B LoRA protocol, 32 x
    (8192, 6144) bf16, H100 profile). Here the rotation's backward kernel writes dq and dk into their heads of that
    tensor and only dv is copied (nkv / (nq + 2 nkv) of the bytes: 1/6 at 8B, 1/9 at 0.5B). The Triton path in eager
    mode; the torch reference and torch.compile take the split.
    """
    if qkv.dim() != 4 or qkv.shape[2] != nq + 2 * nkv:
        raise ValueError(f"rope_qkv: qkv {tuple(qkv.shape)} must be (B, S, nq + 2 nkv = {nq + 2 * nkv}, D)")
    q, k, v = qkv.split([nq, nkv, nkv], dim=2)
    b, s, r = _check_rope_qk(q, k, cos, sin)
    if (resolve_impl("rope_qk", impl, q.device) == "torch" or torch.compiler.is_compiling()
            or cos.requires_grad or sin.requires_grad):  # rope_qk says what it does with a cos that needs grad
        return (*rope_qk(q, k, cos, sin, impl=impl), v.contiguous())
    return RopeQKVFunction.apply(qkv, cos.expand(b, s, r), sin.expand(b, s, r), nq, nkv)


# ---------------------------------------------------------------- torch.library registration


@torch.library.custom_op("chronicals::rope_qk", mutates_args=())
def _rope_qk_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_qk_apply(q, k, cos, sin, backward=False)


@_rope_qk_op.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("chronicals::rope_qk_backward", mutates_args=())
def _rope_qk_backward_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_qk_apply(dq, dk, cos, sin, backward=True)


@_rope_qk_backward_op.register_fake
def _(dq, dk, cos, sin):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.chronicals.rope_qk_backward(dq, dk, cos, sin)
    return dq, dk, None, None


_rope_qk_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def _check_rope_qk(q, k, cos, sin) -> tuple[int, int, int]:
    """The argument checks both impls run (before choosing one) -> (B, S, R)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rope_qk: expected q (B, S, Hq, D) and k (B, S, Hk, D), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    b, s, _, d = q.shape
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1] != s or cos.shape[0] not in (1, b):
        raise ValueError(f"rope_qk: cos/sin must be ({b} or 1, {s}, R), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    r = cos.shape[-1]
    if r % 2 or r > d:
        raise ValueError(f"rope_qk: rotary dims R={r} must be even and <= head_dim {d} (the half-rotation layout "
                         "pairs dim i with i + R/2); build cos/sin with rope_cos_sin from R/2 inverse frequencies")
    check_device("rope_qk", q, k, cos, sin)
    if q.dtype != k.dtype:
        raise ValueError(f"rope_qk: q and k must share a dtype, got {q.dtype} and {k.dtype}")
    # fp32 cos with bf16 q came back fp32 from impl="torch" and bf16 from impl="triton"; integer q as fp32 / int64
    if not q.is_floating_point() or cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError(f"rope_qk: q/k ({q.dtype}) must be floating point and cos/sin ({cos.dtype}, {sin.dtype}) "
                         "of the same dtype; build them with rope_cos_sin(..., dtype=q.dtype)")
    return b, s, r


def rope_qk(q, k, cos, sin, *, impl: str = "auto"):
    """Rotate q and k by the same per-token angles. Returns (q_rot, k_rot).

    q (B, S, Hq, D), k (B, S, Hk, D), cos/sin (B, S, R) or (1, S, R), R even and <= D.
    """
    b, s, r = _check_rope_qk(q, k, cos, sin)
    if resolve_impl("rope_qk", impl, q.device) == "torch":
        return rope_qk_ref(q, k, cos, sin)
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope_qk(impl='triton') does not differentiate cos/sin; pass cos.detach(), sin.detach() "
                         "or use impl='torch'")
    cos, sin = cos.expand(b, s, r), sin.expand(b, s, r)
    if torch.compiler.is_compiling():  # one graph node for the compiler
        return torch.ops.chronicals.rope_qk(q, k, cos, sin)
    return RopeQKFunction.apply(q, k, cos, sin)  # eager: skip the custom-op dispatch
