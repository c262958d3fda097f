"""SwiGLU activation: silu(gate) * up.  Shapes: gate, up (..., I) -> (..., I).

The Triton path has two front doors over the same launchers: in eager mode ``SwiGLUFunction``, a plain
autograd.Function (the ``torch.library`` dispatch costs ~0.1 ms of CPU per call, about the forward kernel's
own time at the 0.5B shape: 3 x 16384 x 4864 x 2 B = 478 MB, 112 us at 4.25 TB/s); under torch.compile the
``torch.library`` op ``chronicals::swiglu`` (backward ``chronicals::swiglu_backward``), one graph node each.
Both kernels are flat elementwise kernels over the contiguous tensors, fp32 math inside:
- forward reads gate and up, writes y: 3 x N x I elements, nothing else is stored;
- backward recomputes sigmoid(gate) from the saved gate instead of saving silu(gate) from the forward
  (that would keep one more (N, I) tensor alive per layer: 235 MB at the 8B shape in bf16), reads
  gate, up, dy and writes dgate, dup: 5 x N x I elements.

``swiglu_gate_up(gu)`` is the same op on the packed output of one gate/up GEMM, gu (..., 2I) = x @ [Wg; Wu]^T
(gate = first half of the last dim, up = second half): row-strided (BLOCK_R, BLOCK_C) tiles read both
halves of a row, and the backward writes d_gu (..., 2I) in ONE kernel (dgate into the first half, dup into
the second). Splitting gu into two slices instead would make autograd allocate two zero-filled (N, 2I)
gradients and add them (3 extra passes of 2 x N x I, ~0.23 ms per layer-backward at the 0.5B shape).
Both ops share the per-element math (``_swiglu_fwd_math`` / ``_swiglu_bwd_math``), so the packed variant is
bit-identical to ``swiglu`` on the two halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._impl import resolve_impl
from ._triton_utils import check_device, tune_configs


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_gate_up_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu (..., 2I) = [gate | up] -> silu(gate) * up (..., I), contiguous; autograd through the two halves."""
    gate, up = gu.chunk(2, dim=-1)
    return swiglu_ref(gate, up).contiguous()


# ---------------------------------------------------------------- kernels

# BLOCK x bf16: 2048 elements over 8 warps are 8 per thread, one 16-byte vector load per tensor.
_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((2048, 8), (1024, 4), (4096, 8), (4096, 16),
                                                                   (8192, 16))]


@triton.jit
def _swiglu_fwd_math(g, u):
    """fp32 g, u -> silu(g) * u (shared by both forward kernels: one expression, one rounding)."""
    return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_bwd_math(dy, g, u):
    """fp32 dy, g, u -> (dgate, dup): dup = dy * silu(g); dgate = dy * up * sig(g) * (1 + g * (1 - sig(g)))."""
    sig = tl.sigmoid(g)
    silu = g * sig
    return dy * u * (sig + silu * (1.0 - sig)), dy * silu


@triton.autotune(configs=tune_configs(_CONFIGS), key=["size_class"])
@triton.jit
def _swiglu_fwd_kernel(G_ptr, U_ptr, Y_ptr, n, size_class, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _swiglu_fwd_math(g, u)
    tl.store(Y_ptr + offs, y.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=tune_configs(_CONFIGS), key=["size_class"])
@triton.jit
def _swiglu_bwd_kernel(DY_ptr, G_ptr, U_ptr, DG_ptr, DU_ptr, n, size_class, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dg, du = _swiglu_bwd_math(dy, g, u)
    tl.store(DU_ptr + offs, du.to(DU_ptr.dtype.element_ty), mask=mask)
    tl.store(DG_ptr + offs, dg.to(DG_ptr.dtype.element_ty), mask=mask)


# Packed gate/up: (BLOCK_R rows, BLOCK_C columns) tiles, grid (row blocks, column blocks), so no per-element
# division by I. BLOCK_C 1024 wastes 5% of the lanes at I = 4864 (5 blocks for 4864 columns) and none at
# I = 14336; 2 x 1024 bf16 over 8 warps is the flat kernel's 8 elements (16 bytes) per thread. The row
# stride 2I and the offset I of up are multiples of 16 at every real shape, so Triton's divisibility
# specialisation keeps 16-byte vector loads.
_GU_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
               for r, c, w in ((2, 1024, 8), (1, 1024, 4), (4, 1024, 8), (4, 1024, 16), (8, 1024, 16),
                               (4, 512, 8), (1, 2048, 8))]


@triton.autotune(configs=tune_configs(_GU_CONFIGS), key=["n_cols", "size_class"])
@triton.jit
def _swiglu_gate_up_fwd_kernel(GU_ptr, Y_ptr, n_rows, n_cols, gu_row_stride, y_row_stride, size_class,
                               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """gu (n_rows, 2 n_cols) row-strided: gate = [:, :n_cols], up = [:, n_cols:] -> y (n_rows, n_cols)."""
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]  # (BLOCK_R, 1)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]  # (1, BLOCK_C)
    mask = (rows < n_rows) & (cols < n_cols)
    g_off = rows * gu_row_stride + cols
    g = tl.load(GU_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU_ptr + g_off + n_cols, mask=mask, other=0.0).to(tl.float32)
    y = _swiglu_fwd_math(g, u)
    tl.store(Y_ptr + rows * y_row_stride + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_gate_up_bwd_body(DY_ptr, GU_ptr, DGU_ptr, ACT_ptr, n_rows, n_cols, dy_row_stride, gu_row_stride,
                             dgu_row_stride, STORE_ACT: tl.constexpr, IN_PLACE: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dy (n_rows, n_cols), gu (n_rows, 2 n_cols) -> dgu (n_rows, 2 n_cols): dgate | dup in one pass.
    STORE_ACT: also write act = silu(gate) * up (n_rows, n_cols) contiguous, bit-identical to the forward's
    (the same fp32 products in the same order): the recomputed input of down_proj's weight gradient.
    IN_PLACE: DGU_ptr is GU_ptr and ACT_ptr is DY_ptr. Every element is loaded and stored by the same
    program at the same address, so a barrier between the tile's loads and its stores is all the ordering
    needed (du and act do not depend on the values they overwrite, so nothing else orders them)."""
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g_off = rows * gu_row_stride + cols
    dy = tl.load(DY_ptr + rows * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU_ptr + g_off + n_cols, mask=mask, other=0.0).to(tl.float32)
    if IN_PLACE:
        tl.debug_barrier()
    dg, du = _swiglu_bwd_math(dy, g, u)
    d_off = rows * dgu_row_stride + cols
    tl.store(DGU_ptr + d_off, dg.to(DGU_ptr.dtype.element_ty), mask=mask)
    tl.store(DGU_ptr + d_off + n_cols, du.to(DGU_ptr.dtype.element_ty), mask=mask)
    if STORE_ACT:
        act = _swiglu_fwd_math(g, u)  # the forward kernels' own expression: the same bits
        tl.store(ACT_ptr + rows * n_cols + cols, act.to(ACT_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=tune_configs(_GU_CONFIGS), key=["n_cols", "size_class", "STORE_ACT"])
@triton.jit
def _swiglu_gate_up_bwd_kernel(DY_ptr, GU_ptr, DGU_ptr, ACT_ptr, n_rows, n_cols, dy_row_stride, gu_row_stride,
                               dgu_row_stride, size_class, STORE_ACT: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr):
    """Out of place (see ``_swiglu_gate_up_bwd_body``)."""
    _swiglu_gate_up_bwd_body(DY_ptr, GU_ptr, DGU_ptr, ACT_ptr, n_rows, n_cols, dy_row_stride, gu_row_stride,
                             dgu_row_stride, STORE_ACT, False, BLOCK_R, BLOCK_C)


@triton.jit
def _swiglu_gate_up_bwd_inplace_kernel(DY_ptr, GU_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr,
                                       BLOCK_C: tl.constexpr):
    """gu (n_rows, 2 n_cols) becomes d_gu and dy (n_rows, n_cols) becomes act, both contiguous. Not autotuned:
    the autotuner times each config by running the kernel again on the same buffers, which an in-place kernel
    has already overwritten (its restore_value would clone both, the very memory this kernel saves)."""
    _swiglu_gate_up_bwd_body(DY_ptr, GU_ptr, GU_ptr, DY_ptr, n_rows, n_cols, n_cols, 2 * n_cols, 2 * n_cols,
                             True, True, BLOCK_R, BLOCK_C)


# ---------------------------------------------------------------- launchers


def _size_class(n: int) -> int:
    """Autotune key: log2 of the element count, so every new sequence length does not re-tune."""
    return max(n, 1).bit_length()


def _grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


class SwiGLUFunction(torch.autograd.Function):
    """The eager door: gate, up (..., I) of one shape and dtype -> silu(gate) * up. Same launchers as the op."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    @once_differentiable  # the kernels' backward builds no graph: a double backward raises
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy.contiguous(), gate, up)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up contiguous, same shape and dtype -> silu(gate) * up, contiguous."""
    y = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[_grid(n)](gate, up, y, n, _size_class(n))
    return y


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """dy, gate, up contiguous, same shape -> (dgate, dup) in gate's / up's dtype."""
    dg = torch.empty_like(gate, memory_format=torch.contiguous_format)
    du = torch.empty_like(up, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[_grid(n)](dy, gate, up, dg, du, n, _size_class(n))
    return dg, du


# ---------------------------------------------------------------- torch.library registration


@torch.library.custom_op("chronicals::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(gate.contiguous(), up.contiguous())


@_swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("chronicals::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(dy.contiguous(), gate.contiguous(), up.contiguous())


@_swiglu_backward_op.register_fake
def _(dy, gate, up):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.chronicals.swiglu_backward(dy, gate, up)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def _check_swiglu(gate, up) -> None:
    """The argument checks both impls run (before choosing one)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have one shape and dtype (cast or broadcast them first)")
    check_device("swiglu", gate, up)


def swiglu(gate, up, *, impl: str = "auto"):
    """silu(gate) * up; gate, up (..., I) of one shape and dtype -> (..., I)."""
    _check_swiglu(gate, up)
    if resolve_impl("swiglu", impl, gate.device) == "torch":
        return swiglu_ref(gate, up)
    if torch.compiler.is_compiling():  # one graph node for the compiler
        return torch.ops.chronicals.swiglu(gate, up)
    return SwiGLUFunction.apply(gate, up)  # eager: skip the custom-op dispatch


# ---------------------------------------------------------------- packed gate/up: launchers


def _unit_col_rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """(..., cols) -> (N, cols) with unit column stride (a view when possible: F.linear's output is)."""
    t = t.reshape(-1, cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _gu_grid(n_rows: int, n_cols: int):
    return lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]), triton.cdiv(n_cols, meta["BLOCK_C"]))


def swiglu_gate_up_forward(gu: torch.Tensor) -> torch.Tensor:
    """gu (N, 2I) with unit column stride -> silu(gu[:, :I]) * gu[:, I:] (N, I), contiguous."""
    n, i = gu.shape[0], gu.shape[1] // 2
    y = torch.empty((n, i), device=gu.device, dtype=gu.dtype)
    if n and i:
        _swiglu_gate_up_fwd_kernel[_gu_grid(n, i)](gu, y, n, i, gu.stride(0), y.stride(0), _size_class(n * i))
    return y


def swiglu_gate_up_backward(dy: torch.Tensor, gu: torch.Tensor, act: torch.Tensor | None = None) -> torch.Tensor:
    """dy (N, I), gu (N, 2I), both with unit column stride -> d_gu (N, 2I) contiguous, gu's dtype.

    act: an (N, I) contiguous buffer to also receive silu(gate) * up (the forward's output, bit for bit), or None.
    """
    n, i = dy.shape
    dgu = torch.empty((n, 2 * i), device=gu.device, dtype=gu.dtype)
    if n and i:
        _swiglu_gate_up_bwd_kernel[_gu_grid(n, i)](dy, gu, dgu, dgu if act is None else act, n, i, dy.stride(0),
                                                   gu.stride(0), dgu.stride(0), _size_class(n * i),
                                                   STORE_ACT=act is not None)
    return dgu


# The in-place kernel's launch shape: the first of _GU_CONFIGS, 2 x 1024 elements over 8 warps (8 bf16 per thread,
# one 16-byte access per tensor), the shape the out-of-place kernel is tuned from.
_INPLACE_BLOCK_R, _INPLACE_BLOCK_C, _INPLACE_WARPS = 2, 1024, 8


def swiglu_gate_up_backward_(dy: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: gu (N, 2I) becomes d_gu and dy (N, I) becomes act = silu(gate) * up, bit for bit what
    ``swiglu_gate_up_backward(dy, gu, act)`` writes to fresh buffers; returns (d_gu, act), which ARE gu and dy.

    For backward passes that own both tensors (the decoder's MLP: gu is its saved GEMM output, dy a fresh
    d_act): no (N, 2I) d_gu and no (N, I) act beside them. At the 8B LoRA shape (8,192 x 14,336) that is
    3 x 235 MB less at the step's peak (the first MLP backward); at Qwen2.5-0.5B (16,384 x 4,864) 478 MB.
    Both must be contiguous and distinct; values of gu and dy are gone afterwards.
    """
    n, i = dy.shape
    if gu.shape != (n, 2 * i) or not (dy.is_contiguous() and gu.is_contiguous()) or gu.dtype != dy.dtype:
        raise ValueError(f"swiglu_gate_up_backward_: dy {tuple(dy.shape)} {dy.dtype} and gu {tuple(gu.shape)} "
                         f"{gu.dtype} must be contiguous (N, I) and (N, 2I) of one dtype; use "
                         "swiglu_gate_up_backward for other layouts")
    if n and i:
        grid = (triton.cdiv(n, _INPLACE_BLOCK_R), triton.cdiv(i, _INPLACE_BLOCK_C))
        _swiglu_gate_up_bwd_inplace_kernel[grid](dy, gu, n, i, BLOCK_R=_INPLACE_BLOCK_R, BLOCK_C=_INPLACE_BLOCK_C,
                                                 num_warps=_INPLACE_WARPS)
    return gu, dy


class SwiGLUGateUpFunction(torch.autograd.Function):
    """The eager door: gu (..., 2I) -> silu(gate) * up (..., I); backward returns d_gu (..., 2I) whole."""

    @staticmethod
    def forward(ctx, gu):
        two_i = gu.shape[-1]
        gu2 = _unit_col_rows(gu, two_i)  # (N, 2I)
        ctx.save_for_backward(gu2)  # what the split path keeps (gate and up), in one tensor
        ctx.lead_shape = gu.shape[:-1]
        return swiglu_gate_up_forward(gu2).view(*gu.shape[:-1], two_i // 2)

    @staticmethod
    @once_differentiable  # the kernels' backward builds no graph: a double backward raises
    def backward(ctx, dy):
        (gu2,) = ctx.saved_tensors
        dgu = swiglu_gate_up_backward(_unit_col_rows(dy, gu2.shape[1] // 2), gu2)
        return dgu.view(*ctx.lead_shape, gu2.shape[1])


# ---------------------------------------------------------------- packed gate/up: torch.library registration


@torch.library.custom_op("chronicals::swiglu_gate_up", mutates_args=())
def _swiglu_gate_up_op(gu: torch.Tensor) -> torch.Tensor:
    two_i = gu.shape[-1]
    return swiglu_gate_up_forward(_unit_col_rows(gu, two_i)).view(*gu.shape[:-1], two_i // 2)


@_swiglu_gate_up_op.register_fake
def _(gu):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


def swiglu_gate_up_dgu(dy: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """dy (..., I), gu (..., 2I) -> d_gu (..., 2I): the Triton backward on any leading shape (eager callers use
    it directly, skipping the custom op's dispatch)."""
    two_i = gu.shape[-1]
    dgu = swiglu_gate_up_backward(_unit_col_rows(dy, two_i // 2), _unit_col_rows(gu, two_i))
    return dgu.view(gu.shape)


@torch.library.custom_op("chronicals::swiglu_gate_up_backward", mutates_args=())
def _swiglu_gate_up_backward_op(dy: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    return swiglu_gate_up_dgu(dy, gu)


@_swiglu_gate_up_backward_op.register_fake
def _(dy, gu):
    return gu.new_empty(gu.shape)


def _gu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _gu_backward(ctx, dy):
    (gu,) = ctx.saved_tensors
    return torch.ops.chronicals.swiglu_gate_up_backward(dy, gu)


_swiglu_gate_up_op.register_autograd(_gu_backward, setup_context=_gu_setup_context)


# ---------------------------------------------------------------- packed gate/up: public API


def swiglu_gate_up(gu, *, impl: str = "auto"):
    """silu(gate) * up from one packed tensor: gu (..., 2I) = [gate | up] along the last dim (the output of
    ``x @ cat([Wg, Wu]).T``) -> (..., I) contiguous. The Triton backward writes d_gu (..., 2I) in one kernel.
    """
    if gu.dim() < 1 or gu.shape[-1] % 2 or not gu.shape[-1]:
        raise ValueError(f"swiglu_gate_up: gu {tuple(gu.shape)} must end in an even dim 2I >= 2 (gate | up halves); "
                         "pass the output of one GEMM with cat([gate_proj.weight, up_proj.weight])")
    if resolve_impl("swiglu_gate_up", impl, gu.device) == "torch":
        return swiglu_gate_up_ref(gu)
    if torch.compiler.is_compiling():  # one graph node for the compiler
        return torch.ops.chronicals.swiglu_gate_up(gu)
    return SwiGLUGateUpFunction.apply(gu)  # eager: skip the custom-op dispatch
