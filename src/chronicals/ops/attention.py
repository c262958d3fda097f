"""Causal self-attention for unpacked and packed rows.

Shapes: q (B, S, Hq, D), k and v (B, S, Hk, D) with Hq % Hk == 0 (GQA) -> out (B, S, Hq, D).

Packed rows: several documents share a row; ``cu_seqlens`` (int32, (num_docs + 1,)) holds the
cumulative document lengths over the flattened B * S tokens (row-major) and ``max_seqlen`` the
longest document. A token attends only to earlier tokens of its own document.

    row 0: [a a a b b | row 1: c c c c d]   cu_seqlens = [0, 3, 5, 9, 10], max_seqlen = 4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._impl import resolve_impl


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens (N+1,) -> the document index of each of ``total`` flattened tokens, (total,)."""
    pos = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.to(pos.dtype), pos, right=True) - 1


def packed_causal_mask(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Block-diagonal causal mask (B, 1, S, S), True where attention is allowed."""
    doc = document_ids(cu_seqlens, batch * seqlen).view(batch, seqlen)
    same_doc = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=doc.device).tril()
    return (same_doc & causal)[:, None]


def attention_ref(q, k, v, *, cu_seqlens=None, max_seqlen=None, scale=None):
    """SDPA reference: causal for unpacked rows, block-diagonal causal mask for packed rows."""
    b, s, hq, _ = q.shape
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
    gqa = hq != k.shape[2]
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = packed_causal_mask(cu_seqlens, b, s)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def attention(q, k, v, *, cu_seqlens=None, max_seqlen=None, scale=None, impl: str = "auto"):
    """Causal attention; packed rows when ``cu_seqlens`` is given. See the module docstring."""
    chosen = resolve_impl("attention", impl, q.device)
    if chosen == "torch" or cu_seqlens is None:
        # unpacked rows: SDPA picks flash / cuDNN / efficient kernels on CUDA itself
        return attention_ref(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale)
    raise NotImplementedError("attention: the CUDA varlen path lands with the data/packing issue")
