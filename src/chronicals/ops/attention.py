"""Causal self-attention for unpacked and packed rows.

Shapes: q (B, S, Hq, D), k and v (B, S, Hk, D) with Hq % Hk == 0 (GQA) -> out (B, S, Hq, D).

Packed rows: several documents share a row; ``cu_seqlens`` (int32, (num_docs + 1,)) holds the
cumulative document lengths over the flattened B * S tokens (row-major) and ``max_seqlen`` the
longest document. A token attends only to earlier tokens of its own document. A document lies within one
row (the collator packs rows so): the CUDA kernels read the B rows as one stream, where a document that ran
past a row's end would see the row before, and the reference, which masks each row, refuses one.

    row 0: [a a a b b | row 1: c c c c d]   cu_seqlens = [0, 3, 5, 9, 10], max_seqlen = 4

Implementations (``impl``; "auto" = a varlen kernel on CUDA, reference on CPU):
- "torch" (``attention_ref``): SDPA; packed rows use a block-diagonal causal mask (B, 1, S, S), which
  costs O(S^2) memory per row and lets SDPA use only its masked kernels.
- "triton" on CUDA, packed rows: variable-length FlashAttention-2 through PyTorch's own aten op
  (``aten::_flash_attention_forward / _backward`` with cum_seq_q = cum_seq_k = cu_seqlens; the same
  positional signature on torch 2.11 and 2.13). The B rows are one stream of B * S tokens: no mask, no
  work across documents, and GQA without repeating K/V heads (the kernel maps query head h to key head
  h // (Hq / Hk)). bf16/fp16 only (the kernel's dtypes). On an H200 this measured 0.505 ms fwd+bwd for
  16 rows of 1024 at 14/2 heads of 64 (FlexAttention with a document mask: 1.05 ms).
  ``torch.nn.attention.varlen.varlen_attn`` wraps the same op on newer torch, but its keywords changed
  between releases; the aten op's positional signature did not, so it is called directly. Unpacked rows (no cu_seqlens) use SDPA's causal kernels on every impl.
- packed rows on CUDA pick their kernel with ``varlen`` (``model.attention``): "flash" is the FA2 path above;
  "cudnn" runs cuDNN's ragged (THD) Hopper kernels through graphs built with NVIDIA's cuDNN Python frontend
  (``ops/attention_cudnn.py``; ``pip install nvidia-cudnn-frontend``), the kernels SDPA already uses for
  unpacked rows; "auto" takes cudnn where the frontend is installed, its cuDNN is >= 9.6, the GPU is Hopper
  or newer and the batch's documents average >= CUDNN_MIN_MEAN_DOC tokens, else flash. Each choice is logged
  once. H200, the 0.5B training step on chat-like packed rows (40-52 documents per 16 x 1024 tokens, graphed):
  full 114.95 -> 111.55 ms, LoRA 95.57 -> 92.61 ms with cudnn; one document a row, 0.5B full / LoRA and 8B LoRA
  reach 98.2% / 98.4% / 99.1% of dense rows' tokens/s with cudnn, 96.0% / 94.9% / 94.7% with flash (git
  6a5e008, b5bb95b). Eager steps pay its Python launch (~0.3 ms a call): the LoRA step at 0.5B is host-bound
  without CUDA graphs.
- "fa4" (opt-in) runs FlashAttention-4's CuTe kernels for unpacked and packed rows alike (``ops/attention_fa4.py``;
  ``pip install flash-attn-4``): faster kernels than cuDNN's and FA2's at the protocol's shapes on an H100, with a
  Python launcher that only CUDA graphs hide (numbers there).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._numbers import is_integral
from .._words import counted
from ._impl import log, resolve_impl

_logged_notes: set[str] = set()
VARLEN_KERNELS = ("auto", "cudnn", "flash", "fa4")


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


def _check_within_rows(cu_seqlens: torch.Tensor, seqlen: int) -> None:
    """Each document [start, end) of cu_seqlens lies within one row of ``seqlen`` tokens, else a ValueError. A
    host read: skipped while a CUDA graph is captured or the compiler traces."""
    if torch.compiler.is_compiling() or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if bool((cu_seqlens[0] != 0) | (ends < starts).any()):  # one host read
        raise ValueError(f"attention: cu_seqlens must start at 0 and never decrease (cumulative document lengths), "
                         f"got {cu_seqlens.tolist()[:8]}{' ...' if cu_seqlens.numel() > 8 else ''}")
    crossing = (ends > starts) & (starts // seqlen != (ends - 1) // seqlen)
    if bool(crossing.any()):
        i = int(crossing.nonzero()[0, 0])
        raise ValueError(f"attention: document {i} (tokens {int(starts[i])}..{int(ends[i]) - 1} of cu_seqlens) runs "
                         f"across a row boundary (rows of {counted(seqlen, 'token')}); pack each document into one row "
                         "(chronicals.data's collator does)")


def attention_ref(q, k, v, *, cu_seqlens=None, max_seqlen=None, scale=None):
    """SDPA reference: causal for unpacked rows, block-diagonal causal mask for packed rows."""
    b, s, hq, _ = q.shape
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
    gqa = hq != k.shape[2]
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        _check_within_rows(cu_seqlens, s)
        mask = packed_causal_mask(cu_seqlens, b, s)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


class VarlenFlashFunction(torch.autograd.Function):
    """Causal varlen FlashAttention over packed tokens: q (T, Hq, D), k/v (T, Hk, D), cu (N+1,) int32."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward builds no graph: a double backward raises
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True,
            rng_state, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def attention_varlen_flash(q, k, v, cu_seqlens, max_seqlen=None, scale=None):
    """q (B, S, Hq, D), k/v (B, S, Hk, D) bf16/fp16 on CUDA; cu_seqlens (N+1,) over B*S -> (B, S, Hq, D)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"attention: the CUDA varlen flash path needs bfloat16/float16 q/k/v (got {q.dtype}); "
                        "cast the model to bf16, or pass impl='torch' for the masked SDPA reference")
    b, s, hq, d = q.shape
    hk = k.shape[2]
    if hq % hk:
        raise ValueError(f"attention: Hq={hq} is not a multiple of Hk={hk}")
    if cu_seqlens.dtype != torch.int32:  # its last entry must be B*S: not checked here (a sync per layer)
        raise ValueError(f"attention: cu_seqlens must be int32 (got {cu_seqlens.dtype})")
    if d % 8 or d > 256:  # else FA2's "head_size must be a multiple of 8, this is ensured by padding!"
        raise ValueError(f"attention: packed rows on CUDA run FlashAttention-2's varlen kernels, which need a head "
                         f"dim that is a multiple of 8 and at most 256 (got {d}); pass impl='torch' (the masked "
                         "SDPA reference), or train unpacked rows")
    if max_seqlen is None:  # one host sync; the collator passes it
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    scale = d ** -0.5 if scale is None else scale
    out = VarlenFlashFunction.apply(q.reshape(b * s, hq, d).contiguous(), k.reshape(b * s, hk, d).contiguous(),
                                    v.reshape(b * s, hk, d).contiguous(), cu_seqlens.to(q.device),
                                    int(max_seqlen), float(scale))
    return out.view(b, s, hq, d)


def _check_attention(q, k, v, cu_seqlens, max_seqlen=None) -> None:
    """The argument checks every impl runs (before choosing one); shapes, dtypes and max_seqlen only. cu_seqlens'
    entries (0 first, non-decreasing, B * S last) are not checked here: reading them would sync the device once per
    layer (the reference path reads them on the host and checks them there)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: expected q (B, S, Hq, D) and k, v (B, S, Hk, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.is_floating_point()):
        raise TypeError(f"attention: q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[2] == 0:
        raise ValueError("attention: k and v have 0 heads; expected Hk >= 1 key/value heads")
    if max_seqlen is not None and not torch.compiler.is_compiling() and (  # traced: a SymInt, left to the guards
            not is_integral(max_seqlen) or max_seqlen < 1):
        # FA2 read max_seqlen=0 as no tokens (garbage out) and 1 as a reshape error from inside the kernel's call
        raise ValueError(f"attention: max_seqlen={max_seqlen!r}; expected the longest document's length, an int "
                         ">= 1 (or None to read it from cu_seqlens, one host sync)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: Hq={q.shape[2]} query heads are not a multiple of Hk={k.shape[2]} key/value "
                         "heads (grouped-query attention shares each key head among Hq / Hk query heads)")
    if cu_seqlens is not None and (cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1
                                   or cu_seqlens.numel() < 2):
        raise ValueError(f"attention: cu_seqlens must be int32 (num_docs + 1,) cumulative document lengths over the "
                         f"B * S tokens, starting at 0 (got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}); build it "
                         "with torch.tensor([0, len0, len0 + len1, ...], dtype=torch.int32)")


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    """cuDNN's ragged (THD) attention kernels exist for compute capability 9.0 and newer."""
    return torch.cuda.get_device_capability(device)[0] >= 9


# "auto" takes cuDNN's ragged kernels only for documents averaging at least this many tokens (tokens / entries
# of cu_seqlens, both known on the host). H200, kernel time fwd + bwd per layer, 0.5B heads (14/2 x 64) over
# 16 x 1024 tokens (probe_attention_cudnn_fe, git ddc3b75): 1 document a row 0.49 ms vs FA2 0.68; 76 documents
# (~215 tokens) 0.47 vs 0.56; 253 documents (~65 tokens) 0.70 vs 0.62.
CUDNN_MIN_MEAN_DOC = 128


def resolve_varlen(varlen: str, device: torch.device, tokens: int = 0, docs: int = 1) -> str:
    """"cudnn" | "flash" for packed rows on a CUDA ``device`` (see the module docstring); logs each choice once.
    tokens / docs: the batch's token count and cu_seqlens entries (padded ones too), for "auto"."""
    if varlen not in VARLEN_KERNELS:
        raise ValueError(f"attention: varlen={varlen!r} is not one of {VARLEN_KERNELS} (model.attention)")
    from . import attention_cudnn  # noqa: PLC0415 (light: imports cudnn only when asked)

    why = ""
    if varlen != "auto":
        chosen = varlen
    elif not (attention_cudnn.available() and _hopper(device)):
        chosen, why = "flash", "nvidia-cudnn-frontend with cuDNN >= 9.6 and a Hopper GPU are needed for cudnn"
    elif torch.compiler.is_compiling():
        chosen, why = "flash", "torch.compile traces FA2's aten op; the cuDNN frontend's call would break the graph"
    elif tokens < CUDNN_MIN_MEAN_DOC * docs:
        chosen, why = "flash", f"documents average < {CUDNN_MIN_MEAN_DOC} tokens, where FA2's kernels are faster"
    else:
        chosen, why = "cudnn", f"documents average >= {CUDNN_MIN_MEAN_DOC} tokens"
    if chosen == "cudnn":
        attention_cudnn.cudnn_frontend()  # an ImportError that says what to install
    key = f"varlen {varlen} {chosen} {why}"
    if key not in _logged_notes and not torch.compiler.is_compiling():
        _logged_notes.add(key)
        log.info("attention: packed rows use %s (model.attention=%s%s)", chosen, varlen, f": {why}" if why else "")
    return chosen


def attention(q, k, v, *, cu_seqlens=None, max_seqlen=None, scale=None, impl: str = "auto", varlen: str = "auto"):
    """Causal attention; packed rows when ``cu_seqlens`` is given. See the module docstring."""
    _check_attention(q, k, v, cu_seqlens, max_seqlen)
    if varlen not in VARLEN_KERNELS:
        raise ValueError(f"attention: varlen={varlen!r} is not one of {VARLEN_KERNELS} (model.attention)")
    chosen = resolve_impl("attention", impl, q.device)
    if chosen == "torch" or (cu_seqlens is None and varlen != "fa4"):
        # unpacked rows: SDPA picks flash / cuDNN / efficient kernels on CUDA itself
        return attention_ref(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale)
    # the varlen kernels run on CUDA in bf16/fp16: elsewhere (impl="triton" under TRITON_INTERPRET=1; attention has
    # no Triton kernel) and in float32 / float64 on CUDA (model.dtype=float32 there was exit 4) the masked reference
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        rows = "packed rows" if cu_seqlens is not None else "unpacked rows (model.attention=fa4)"
        why = (f"on {q.device.type} (the fast path is CUDA varlen flash, not a Triton kernel)"
               if q.device.type != "cuda" else
               f"in {q.dtype} (FA2's, cuDNN's and FA4's kernels take bf16/fp16; the mask holds B x S x S booleans)")
        if (rows, why) not in _logged_notes and not torch.compiler.is_compiling():
            _logged_notes.add((rows, why))
            log.info("attention: %s %s run the SDPA reference", rows, why)
        return attention_ref(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale)
    if varlen == "fa4":
        from .attention_fa4 import attention_fa4  # noqa: PLC0415 (imports flash-attn-4 only when asked)

        if "fa4" not in _logged_notes and not torch.compiler.is_compiling():
            _logged_notes.add("fa4")
            log.info("attention: unpacked and packed rows use FlashAttention-4's kernels (model.attention=fa4)")
        return attention_fa4(q, k, v, cu_seqlens, max_seqlen, scale)
    if resolve_varlen(varlen, q.device, q.shape[0] * q.shape[1], cu_seqlens.numel() - 1) == "cudnn":
        from .attention_cudnn import attention_varlen_cudnn  # noqa: PLC0415

        if max_seqlen is None:  # one host sync; the collator passes it
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return cudnn_or_flash(varlen, lambda: attention_varlen_cudnn(q, k, v, cu_seqlens, max_seqlen, scale),
                              lambda: attention_varlen_flash(q, k, v, cu_seqlens, max_seqlen, scale))
    return attention_varlen_flash(q, k, v, cu_seqlens, max_seqlen, scale)


def cudnn_or_flash(varlen: str, run_cudnn, run_flash):
    """run_cudnn(); where cuDNN has no kernel for the shapes (``Unsupported``, raised while building its graphs,
    before any launch): with varlen="auto" a warning (once per message) and run_flash(), else the error."""
    from .attention_cudnn import Unsupported  # noqa: PLC0415

    try:
        return run_cudnn()
    except Unsupported as e:
        if varlen != "auto":
            raise
        if str(e) not in _logged_notes:
            _logged_notes.add(str(e))
            log.warning("%s; model.attention=auto runs FA2 for these shapes", e)
    return run_flash()
