"""Packed-row causal attention through cuDNN's ragged (THD) SDPA kernels, built with NVIDIA's cuDNN Python
frontend (``pip install nvidia-cudnn-frontend``; imported only when this path runs).

Why: unpacked rows already run cuDNN's Hopper attention kernels under SDPA, while packed rows ran varlen
FlashAttention-2 (aten), which has no Hopper-specific kernels: on an H200 FA2 took 1.4-1.65x cuDNN's time per
layer, and the trainer's packed batches trained ~5% slower than dense rows (0.5B protocol, git d1d530d).
PyTorch's own entry to cuDNN's ragged kernels (``aten::_cudnn_attention_forward`` with cum_seq) gave wrong
q/k/v gradients and built a plan on every call on torch 2.11, so the graphs are built here, once per key.

Layout, for T = B * S packed tokens and n documents (cu_seqlens (n + 1,) int32, padding counted as a
document, as the collator writes it)::

    q (T, Hq, D), k / v (T, Hk, D)        one stream of tokens, documents back to back (THD)
    cuDNN sees q as (cap, Hq, s_max, D)   one "batch entry" per document, located by a ragged offset
    ragged offset of q  = cu_pad * Hq * D (elements), of k / v = cu_pad * Hk * D, of the stats = cu_pad * Hq
    seq_len             = cu_pad[1:] - cu_pad[:-1]

``cap`` is the document count padded to a bucket (the next power of two, at least 16) by repeating
cu_seqlens' last value: the extra documents are empty, so one built graph serves every batch of up to ``cap``
documents, and a CUDA-graph capture (which pads cu_seqlens the same way, ``train/graphs.py``) meets no new
shape. ``s_max`` is max_seqlen rounded up to a power of two (at least 64): a bound, not an exact value.
Everything derived from cu_seqlens stays on the device: no host sync.

The softmax statistics (log-sum-exp, fp32) are stored ragged too, (T, Hq): 4 bytes per token and head like
FlashAttention's, instead of a dense (cap, Hq, s_max) block that grows with documents x longest document.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

MIN_DOCS, MIN_SEQ = 16, 64
_lock = threading.Lock()
_handles: dict[int, object] = {}
_plans: dict[tuple, "_Plan"] = {}


def cudnn_frontend():
    """The ``cudnn`` module of nvidia-cudnn-frontend, with an error that says how to get it."""
    try:
        import cudnn  # noqa: PLC0415 (optional, GPU-only dependency)
    except ImportError as e:
        raise ImportError(
            "attention: model.attention=cudnn needs NVIDIA's cuDNN Python frontend: pip install "
            "'nvidia-cudnn-frontend>=1.12' (or pip install 'chronicals[cudnn]'); model.attention=flash uses "
            "PyTorch's varlen FlashAttention-2 instead") from e
    return cudnn


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the frontend imports and the cuDNN it loads is recent enough for ragged GQA (9.6)."""
    try:
        cudnn = cudnn_frontend()
        return cudnn.backend_version() >= 90600
    except Exception:  # noqa: BLE001 (any import / load failure means "not available")
        return False


def bucket(n: int, minimum: int) -> int:
    """The next power of two >= n, at least ``minimum`` (train.graphs pads cu_seqlens to the same buckets)."""
    cap = max(minimum, 1)
    while cap < n:
        cap *= 2
    return cap


@dataclass
class _Plan:
    fwd: object
    bwd: object
    t: dict  # name -> cudnn tensor of either graph (names prefixed "f_" / "b_")
    fwd_ws: int
    bwd_ws: int


def _handle(cudnn, device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    h = _handles.get(idx)
    if h is None:
        with torch.cuda.device(idx):
            h = _handles[idx] = cudnn.create_handle()
    return h


def _dtype(cudnn, dt: torch.dtype):
    if dt == torch.bfloat16:
        return cudnn.data_type.BFLOAT16
    if dt == torch.float16:
        return cudnn.data_type.HALF
    raise TypeError(f"attention: the cuDNN path needs bfloat16/float16 q/k/v (got {dt})")


def _qkv_tensors(cudnn, g, prefix, cap, s, hq, hk, d, io):
    """q, k, v graph tensors (THD with ragged offsets) and their offset tensors."""
    t = {}
    for name, h in (("q", hq), ("k", hk), ("v", hk)):
        t[name] = g.tensor(name=f"{prefix}{name}", dim=[cap, h, s, d], stride=[s * h * d, d, h * d, 1], data_type=io)
    for name in ("off_q", "off_k", "off_v", "off_o", "off_stats"):
        t[name] = g.tensor(name=f"{prefix}{name}", dim=[cap + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                           data_type=cudnn.data_type.INT64)
    for name in ("seq_q", "seq_kv"):
        t[name] = g.tensor(name=f"{prefix}{name}", dim=[cap, 1, 1, 1], stride=[1, 1, 1, 1],
                           data_type=cudnn.data_type.INT32)
    t["q"].set_ragged_offset(t["off_q"])
    t["k"].set_ragged_offset(t["off_k"])
    t["v"].set_ragged_offset(t["off_v"])
    return t


def _stats_layout(stats, t, hq: int, s: int) -> None:
    """(T, Hq) fp32: element (doc, h, i) at off_stats[doc] + i * Hq + h."""
    stats.set_stride([s * hq, 1, hq, 1]).set_ragged_offset(t["off_stats"])


def _finish(cudnn, g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def _build(cudnn, handle, io, cap, s, hq, hk, d, scale, total) -> _Plan:
    common = dict(attn_scale=scale, use_padding_mask=True, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                  diagonal_band_right_bound=0)
    gf = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                       compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    f = _qkv_tensors(cudnn, gf, "f_", cap, s, hq, hk, d, io)
    o, stats = gf.sdpa(name="sdpa", q=f["q"], k=f["k"], v=f["v"], generate_stats=True, seq_len_q=f["seq_q"],
                       seq_len_kv=f["seq_kv"], **common)
    o.set_output(True).set_dim([cap, hq, s, d]).set_stride([s * hq * d, d, hq * d, 1]).set_ragged_offset(f["off_o"])
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([cap, hq, s, 1])
    _stats_layout(stats, f, hq, s)
    f["o"], f["stats"] = o, stats
    _finish(cudnn, gf)

    gb = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                       compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    b = _qkv_tensors(cudnn, gb, "b_", cap, s, hq, hk, d, io)
    for name in ("o", "dO"):
        b[name] = gb.tensor(name=f"b_{name}", dim=[cap, hq, s, d], stride=[s * hq * d, d, hq * d, 1], data_type=io)
        b[name].set_ragged_offset(b["off_o"])
    b["stats"] = gb.tensor(name="b_stats", dim=[cap, hq, s, 1], stride=[s * hq, 1, hq, 1],
                           data_type=cudnn.data_type.FLOAT)
    _stats_layout(b["stats"], b, hq, s)
    max_t = -(-total // 64) * 64
    dq, dk, dv = gb.sdpa_backward(name="sdpa_backward", q=b["q"], k=b["k"], v=b["v"], o=b["o"], dO=b["dO"],
                                  stats=b["stats"], seq_len_q=b["seq_q"], seq_len_kv=b["seq_kv"],
                                  max_total_seq_len_q=max_t, max_total_seq_len_kv=max_t, **common)
    for name, t, h, off in (("dq", dq, hq, "off_q"), ("dk", dk, hk, "off_k"), ("dv", dv, hk, "off_v")):
        t.set_output(True).set_dim([cap, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_ragged_offset(b[off])
        b[name] = t
    _finish(cudnn, gb)
    tensors = {f"f_{k}": v for k, v in f.items()} | {f"b_{k}": v for k, v in b.items()}
    return _Plan(gf, gb, tensors, gf.get_workspace_size(), gb.get_workspace_size())


class Unsupported(ValueError):
    """cuDNN has no ragged kernel for these shapes (raised while building the graphs, before any launch)."""


def plan_for(device, dtype, cap, s, hq, hk, d, scale, total) -> _Plan:
    cudnn = cudnn_frontend()
    key = (device.index, dtype, cap, s, hq, hk, d, float(scale), total)
    p = _plans.get(key)
    if p is None:
        with _lock:
            p = _plans.get(key)
            if p is None:
                try:
                    p = _build(cudnn, _handle(cudnn, device), _dtype(cudnn, dtype), cap, s, hq, hk, d, scale, total)
                except cudnn.cudnnGraphNotSupportedError as e:
                    raise Unsupported(
                        f"attention: cuDNN {cudnn.backend_version()} has no ragged attention kernel for {hq} query / "
                        f"{hk} key heads of {d}, {dtype} ({e}); use model.attention=flash") from e
                _plans[key] = p
    return p


def ragged_meta(cu_seqlens: torch.Tensor, cap: int, hq: int, hk: int, d: int) -> dict[str, torch.Tensor]:
    """Device tensors the graphs read: cu_seqlens padded to cap + 1 entries, its lengths and offsets (o shares
    q's offsets and v k's: the same values)."""
    n1 = cu_seqlens.numel()
    cu = cu_seqlens
    if n1 < cap + 1:
        cu = torch.cat([cu, cu[-1:].expand(cap + 1 - n1)])
    seq = (cu[1:] - cu[:-1]).view(cap, 1, 1, 1)  # int32
    col = cu.to(torch.int64).view(cap + 1, 1, 1, 1)
    off_q, off_k = col * (hq * d), col * (hk * d)
    return {"seq_q": seq, "seq_kv": seq, "off_q": off_q, "off_o": off_q, "off_k": off_k, "off_v": off_k,
            "off_stats": col * hq}


def _execute(graph, tensors: dict, prefix: str, buffers: dict[str, torch.Tensor], ws_bytes: int, device) -> None:
    cudnn = cudnn_frontend()
    handle = _handle(cudnn, device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(max(ws_bytes, 1), device=device, dtype=torch.uint8)
    graph.execute({tensors[prefix + k]: v for k, v in buffers.items()}, workspace, handle=handle)


class CudnnRaggedAttention(torch.autograd.Function):
    """Causal attention over packed tokens: q (T, Hq, D), k / v (T, Hk, D), cu (n + 1,) int32 -> (T, Hq, D)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        total, hq, d = q.shape
        hk = k.shape[1]
        cap = bucket(cu_seqlens.numel() - 1, MIN_DOCS)
        s = bucket(max_seqlen, MIN_SEQ)
        plan = plan_for(q.device, q.dtype, cap, s, hq, hk, d, scale, total)
        meta = ragged_meta(cu_seqlens, cap, hq, hk, d)  # 6 small kernels per layer; backward reuses them
        out = torch.empty_like(q)
        stats = torch.empty(total, hq, 1, device=q.device, dtype=torch.float32)
        _execute(plan.fwd, plan.t, "f_", {"q": q, "k": k, "v": v, "o": out, "stats": stats, **meta}, plan.fwd_ws,
                 q.device)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.plan, ctx.meta = plan, meta  # meta: small int tensors derived from cu_seqlens, not inputs
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward builds no graph: a double backward raises
    def backward(ctx, grad_out):
        q, k, v, out, stats = ctx.saved_tensors
        meta = ctx.meta
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _execute(ctx.plan.bwd, ctx.plan.t, "b_", {"q": q, "k": k, "v": v, "o": out, "dO": grad_out.contiguous(),
                                                 "stats": stats, "dq": dq, "dk": dk, "dv": dv, **meta},
                 ctx.plan.bwd_ws, q.device)
        return dq, dk, dv, None, None, None


def attention_varlen_cudnn(q, k, v, cu_seqlens, max_seqlen, scale=None):
    """q (B, S, Hq, D), k/v (B, S, Hk, D) bf16/fp16 on CUDA; cu_seqlens (n + 1,) int32 over B * S -> (B, S, Hq, D)."""
    b, s, hq, d = q.shape
    hk = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = CudnnRaggedAttention.apply(q.reshape(b * s, hq, d).contiguous(), k.reshape(b * s, hk, d).contiguous(),
                                     v.reshape(b * s, hk, d).contiguous(), cu_seqlens.to(q.device), int(max_seqlen),
                                     float(scale))
    return out.view(b, s, hq, d)
