"""Causal attention through FlashAttention-4's CuTe kernels (package flash-attn-4, module ``flash_attn.cute``), for
unpacked and packed rows: ``model.attention: fa4`` (opt-in; imported only when this path runs).

Shapes as ``ops.attention``: q (B, S, Hq, D), k / v (B, S, Hk, D) -> (B, S, Hq, D). Unpacked rows go to its dense
kernel; packed rows to its varlen kernel as one stream of B * S tokens with cu_seqlens (documents back to back,
padding a document of its own, GQA without repeating K / V heads), as ``attention_varlen_flash`` passes them to FA2.

Why (H100, fwd + bwd a layer, the summed time of the kernels by torch.profiler; ``benchmarks/probe_attention_fa4.py``
at git 0f71bf2 with flash-attn-4 4.0.0b40): the 0.5B protocol's heads (16 x 1024 tokens, 14/2 heads of 64) 0.445 ms
against 0.500 for cuDNN's kernels under SDPA (what unpacked rows run otherwise); chat-like packed rows there (50
documents) 0.454 against 0.630 for FA2 varlen; the 8B heads (4 x 2048, 32/8 of 128) 1.208 against 1.275. Max
errors against fp32 at SDPA's level (0.002-0.004 of the reference's largest value).
Cost: its Python launcher (CuTe DSL) took 0.89 ms of wall time for those 0.445 ms of kernels at 0.5B (SDPA 0.52
for 0.50): an eager step that is host-bound there gets slower, a CUDA-graphed one (``train.cuda_graphs``) does
not pay it. Each new shape compiles its kernels on first use in each process (9-12 s each on the H100); FA4 keeps
them on disk for later processes with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (FLASH_ATTENTION_CUTE_DSL_CACHE_DIR
names the folder), set before it is imported.
"""

from __future__ import annotations

import functools

import torch

INSTALL = ("pip install flash-attn-4 (a Hopper or newer GPU, CUDA 12.9 or newer; or pip install 'chronicals[fa4]'); "
           "model.attention=auto runs cuDNN's and FlashAttention-2's kernels without it")


def fa4_interface():
    """``flash_attn.cute.interface`` of flash-attn-4, with an error that says how to get it."""
    try:
        from flash_attn.cute import interface  # noqa: PLC0415 (optional, GPU-only dependency)
    except ImportError as e:
        raise ImportError(f"attention: model.attention=fa4 needs FlashAttention-4's CuTe kernels: {INSTALL}") from e
    return interface


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when flash-attn-4's CuTe interface imports."""
    try:
        fa4_interface()
        return True
    except Exception:  # noqa: BLE001 (any import / load failure of its CUDA libraries means "not available")
        return False


def check_fa4_inputs(q: torch.Tensor) -> None:
    """The dtypes and head dims FA4's Hopper kernels take (its own check is an AssertionError deep in the call)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"attention: model.attention=fa4 runs FlashAttention-4's kernels, which take bfloat16/float16 "
                        f"q/k/v (got {q.dtype}); set model.dtype=bfloat16, or model.attention=auto")
    d = q.shape[-1]
    if d % 8 or not 8 <= d <= 256:
        raise ValueError(f"attention: model.attention=fa4 runs FlashAttention-4's kernels, which need a head dim that "
                         f"is a multiple of 8 from 8 to 256 (got {d}); set model.attention=auto")


def attention_fa4(q, k, v, cu_seqlens=None, max_seqlen=None, scale=None):
    """Causal attention, q (B, S, Hq, D), k/v (B, S, Hk, D) bf16/fp16 on CUDA -> (B, S, Hq, D); packed rows when
    ``cu_seqlens`` ((N+1,) int32 over the B * S tokens) is given, ``max_seqlen`` a bound on its documents' lengths
    (a larger one is exact: train.graphs passes S; None costs one host sync)."""
    check_fa4_inputs(q)
    fa = fa4_interface()
    b, s, hq, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        out = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    else:
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        hk = k.shape[2]  # reshape: views for q / k / v cut from one (B, S, Hq + 2 Hk, D) projection (row stride S x)
        out = fa.flash_attn_varlen_func(q.reshape(b * s, hq, d), k.reshape(b * s, hk, d), v.reshape(b * s, hk, d),
                                        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=int(max_seqlen),
                                        max_seqlen_k=int(max_seqlen), softmax_scale=scale, causal=True)
    out = out[0] if isinstance(out, tuple) else out  # (out, lse) in 4.0.0b40
    return out.reshape(b, s, hq, d)
