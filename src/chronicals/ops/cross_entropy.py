"""Linear + cross-entropy (the loss head) without the (N, V) logits; a materializing reference twin beside it.

Shapes: hidden (N, H), weight (V, H), bias (V,) or None, labels (N,) int64 or int32 already aligned (the
caller shifted them), ignore_index marks tokens without loss.
Labels must be in [0, V) or equal ignore_index. Any other label (V, -1, ...) gives a NaN loss for its row,
so NaN in "mean" / "sum" too, and a training step's NaN check stops the run instead of training on garbage;
such a row reads no logit and contributes zero gradient (like an ignored row), so the other rows' gradients
are unchanged. Both impls agree on this; checking on the host would need a device sync (labels.max()).
reduction: "mean" over non-ignored tokens (0 when there are none), "sum", or "none" ((N,), 0 where ignored).
softcap: Gemma-2 style logit capping, logits = softcap * tanh(logits / softcap).
The loss is fp32, or float64 for float64 inputs under impl="torch" (a float64 reference run stays float64 end
to end); gradients come back in the dtype of hidden / weight / bias.

Gradient accumulation and data parallelism: call with reduction="sum" and divide by the global count of
loss tokens (``(labels != ignore_index).sum()`` over every micro-batch and rank); "mean" is exactly
sum / count of this call (count clamped to 1, so an all-ignored batch gives 0, not NaN).

Design of the Triton path (``impl="triton"``; the op ``chronicals::linear_cross_entropy``)
-----------------------------------------------------------------------------------------
Rows are processed in chunks of C (C = max(H, 1,792) when the weight needs a gradient, so 1,792 at Qwen2.5-0.5B;
``DW_MIN_ROWS``; or all N rows at once where one chunk takes no more memory, ``single_chunk_fits``: Llama-3-8B's
head at N 8,192, whose dW then comes from one GEMM over all rows with no fp32 accumulator):

    logits[c]  = hidden[c] @ weight.T            cuBLAS, (C, V) in the input dtype, into one workspace
    row kernel : pass 1 online softmax over vocab tiles -> lse, loss (fp32 registers);
                 pass 2 overwrites the chunk with d_logits = scale * (softmax - onehot) [* softcap']
    dH[c]      = d_logits @ weight               cuBLAS, fp32 accumulation inside, written in place
    dW32      += d_logits.T @ hidden[c]          cuBLAS addmm into an fp32 (V, H) accumulator (Triton GEMM
                                                 under the interpreter)
    dbias32   += d_logits.sum(0)                 only with a bias

Without a weight gradient (LoRA, a frozen head) the training forward ("mean" / "sum", bf16 or fp32, no bias)
runs the row kernel in one pass instead: it writes w = exp(z - c) (c: the row's target logit) as it sums it,
with per-row factors rho = scale * e^(c - lse) and gamma = scale [* softcap'] such that
d_logits = rho * w - gamma * onehot; then
    dH[c]      = rho * (w @ weight) - gamma * weight[label]     the GEMM's fp32 output, rounded once (dh_finish)
So each logit is read once and written once (4 B in bf16) instead of read twice (6 B): at the Qwen2.5-0.5B head
the two-pass kernel ran 202.8 us per (862, 151,936) chunk on an H200, 91% of copy bandwidth (probe_lce_rows,
d3cf2ee). The target's softmax - 1 is never rounded, and dH is rounded once from fp32: its error is at most the
two-pass path's. With a weight gradient the factor would have to enter dW's contraction over rows (hidden's rows
scaled by rho and rounded to bf16: 2x the max error of dW in an H200 check, 3335ecc), so that case keeps two
passes, as do fp16 (w reaches e^40, past fp16's 65,504) and a bias gradient.

For "mean" and "sum" the loss is a scalar, so the gradients for grad_output = 1 are computed during the
forward (scale = 1/count or 1, read from device memory) and the backward only multiplies them by
grad_output: three GEMMs of N x H x V in all, the floor. "none" saves lse (N,) and recomputes the logits
in its backward with scale = grad_output[row]: four GEMMs. Without grad (eval) only the first GEMM and
pass 1 run. Nothing is filtered: the gradients are exact up to the input dtype's rounding of logits and
d_logits (the same roundings PyTorch's own bf16 path makes), with fp32 accumulation of dH, dW and dbias.

No host synchronization: the count of valid tokens stays on the device, chunk bounds depend on N only,
ignored rows skip the softmax math and write zero d_logits. Ignored rows still cost their share of the
cuBLAS GEMMs (skipping them would need their count on the host); the decoder compacts the rows before
calling when the host knows the count (``models.decoder.loss_rows``, fed by the collator's
``num_loss_tokens``: a stable device sort and a gather, no sync), and keeps every row under CUDA-graph
capture, where shapes must not depend on the batch. A step is CUDA-graph capturable once the dW kernel has been autotuned (first call).

Expected cost, Qwen2.5-0.5B head (N 16,384, H 896, V 151,936, bf16) on an H200 (781 TFLOP/s measured):
- GEMMs: 3 x 2NHV = 13.4 TFLOP = 17.1 ms at peak; ~20 ms at the ~85% cuBLAS reaches with K = 896.
- row kernel: reads each logit twice and writes it once, 3 x N x V x 2 B = 14.9 GB = ~3.5 ms.
- dW accumulator: 10 chunks x (read + write 544 MB) = 10.9 GB (at C = H it was 19 chunks, 20.7 GB, and the
  accumulating GEMM ran 9.65 ms a step for 6.4 ms of math); final fp32 -> bf16 cast 0.8 GB = 0.2 ms.
- total ~24 ms, ~1.4x the floor (torch.compile'd materialized: 26.7 ms with 5.2 GiB). The next step to
  ~1.2x: fold pass 1 into the logits GEMM's epilogue and d_logits into the other GEMMs' prologues
  (Triton GEMMs), removing the 3.5 ms; or overlap the row kernel of chunk i with GEMMs of chunk i-1.
Memory at that shape: workspace C x V bf16 = 544 MB (its first V x H elements become dW's storage at the
end), fp32 accumulator 544 MB, dH 29 MB: peak ~1.12 GB = 1.04 GiB including both gradients (0.79 GiB at C = H,
whose workspace was exactly dW's size; the whole training step peaks in the head, so C = 1,792 costs the
step 0.25 GiB of peak for ~3% of its speed: see DW_MIN_ROWS). Without a weight gradient (LoRA) C = 256 MB / (2V) and the extra is
the workspace alone. Llama-3-8B head (N 8,192, H 4,096, V 128,256): one chunk, workspace 2.1 GB, dW 1.05 GB
written once by its GEMM (two chunks of 4,096 took the same 3.2 GB with the gradients: workspace = dW 1.05 GB and
an fp32 accumulator of 2.1 GB read and written twice); its LoRA case has no dW at all.

Less memory, exactly (``vocab_parts`` k > 1, with a weight gradient): no fp32 accumulator beyond dW itself.
- dW (V, H) is allocated first; its bytes, read as fp32, hold V x elt / 4 rows (V / 2 in bf16). The pass
  above accumulates the weight gradient of the first vp = min(ceil(V / k), that) vocabulary rows there (in
  multiples of 8 rows), then rounds them in place into dW[:vp] (row blocks staged through the workspace:
  block [a, b) of the rounded rows overlaps accumulator rows [a/2, b/2), already read).
- A second pass covers vocabulary rows vp..V in chunks of cv over all N rows at once: logits (N x cv, one
  cuBLAS GEMM into the workspace, cv = C x V / N), d_logits from the stored log-sum-exp (the row kernel's
  pass 2), and dW of the chunk as one GEMM contracted over N with fp32 output (a <= 64 MB staging buffer),
  rounded once into dW: every dW element is still one fp32 sum rounded once.
- Cost: (V - vp) / V more logits GEMMs (3.5 GEMMs in all at k = 2), no per-chunk accumulator traffic in
  the second pass. Chunk widths are multiples of 8: an unaligned leading dimension (8,309) put cuBLAS on sm75
  CUTLASS kernels, 4-7x slower (66.5 ms for the whole head at k = 2, git 8f6fedf).
- Memory at Qwen2.5-0.5B: dW 272 MB + workspace 272 MB (C = H) + dH 29 MB + staging 30 MB = 0.56 GiB with
  both gradients, for any k > 1 (k only moves work between the passes; k = 2 does the least).
Measured on an H200 (git 638f39e, `linear_cross_entropy_0.5b_638f39e_*`, floor 19.8 ms): k = 1 29.7 ms
(1.50x) at 0.79 GiB; k = 2 33.9 ms (1.71x) and k = 4 35.3 ms (1.78x), both 0.563 GiB. The row-chunked k-part
scheme this replaced measured 41.7 / 46.3 ms at 0.66 / 0.56 GiB (git fe9aee8).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._numbers import is_integral, is_real
from ._impl import resolve_impl
from ._linear_ce_kernels import dh_finish, dw_accumulate, lce_rows, scale_by
from ._triton_utils import check_device

REDUCTIONS = ("mean", "sum", "none")
# Workspace target without a weight gradient: 256 MB is ~840 rows at V = 151,936, enough for cuBLAS to
# run K = 896 GEMMs near peak, and a small fraction of the 37.7 GiB the fp32 logits would take.
WORKSPACE_BYTES = 256 << 20
MIN_CHUNK_ROWS = 256


def cross_entropy_ref(logits, labels, *, ignore_index=-100, reduction="mean", softcap=None):
    """logits (N, V) any dtype, labels (N,) int -> loss in fp32 (float64 for float64 logits) with the given
    reduction.

    A label outside [0, V) that is not ignore_index gives NaN for its row and zero gradient (module docstring).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    # bf16 / fp16 / fp32 are computed in fp32; float64 stays float64 (model.dtype=float64, the reference runs)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    labels = labels.long()  # F.cross_entropy takes int64 targets only
    # out-of-range labels: NaN like the fused kernel (F.cross_entropy would raise IndexError on CPU and
    # assert on CUDA); masked_fill's backward gives those rows zero gradient, as the kernel writes
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= logits.shape[-1]))
    per_tok = F.cross_entropy(logits, labels.masked_fill(bad, ignore_index), ignore_index=ignore_index,
                              reduction="none").masked_fill(bad, float("nan"))
    if reduction == "none":
        return per_tok
    total = per_tok.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1)


def linear_cross_entropy_ref(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                             softcap=None):
    """Materializes the (N, V) logits: the reference, and what transformers does."""
    logits = F.linear(hidden, weight, bias)
    return cross_entropy_ref(logits, labels, ignore_index=ignore_index, reduction=reduction, softcap=softcap)


# ---------------------------------------------------------------- the chunked driver


# Rows per chunk with a weight gradient, at least: each chunk's dW GEMM (K = C rows) reads and writes the fp32
# (V, H) accumulator, 8 B per element against its 2 C FLOPs. At C = H = 896 (Qwen2.5-0.5B) that traffic showed:
# the accumulating GEMM ran 9.65 ms a step for 6.4 ms of math (H200, 21ced11). C = 1,792 halves it: full
# fine-tuning graphs 142.4k -> 146.5k tokens/s, same losses (probe_head_rows, 953e40e), for a (C, V) workspace
# of 2 x dW's size (dW still lives in its first half at the end: +V x H x 2 B, 0.25 GiB at that head).
# Heads with H >= 1,792 (Llama-3-8B: 4,096) keep C = H.
DW_MIN_ROWS = 1792


def default_chunk_rows(n: int, h: int, v: int, need_dw: bool, elt_bytes: int, vocab_parts: int = 1) -> int:
    """Rows per chunk: with a weight gradient max(H, DW_MIN_ROWS) for one vocabulary part (the workspace then
    holds at least V x H, dW's storage at the end), or all N rows where one chunk takes no more memory than that
    (``single_chunk_fits``), and H for several parts (the low-memory mode: the workspace holds the second pass's
    logits, V x H elements); else a workspace of ~256 MB."""
    if need_dw:
        rows = max(h, DW_MIN_ROWS) if vocab_parts == 1 else h
        if vocab_parts == 1 and single_chunk_fits(n, h, v, rows, elt_bytes):
            return max(1, n)
    else:
        rows = WORKSPACE_BYTES // (v * elt_bytes)
    return max(1, min(n, max(MIN_CHUNK_ROWS, rows)))


def single_chunk_fits(n: int, h: int, v: int, rows: int, elt_bytes: int) -> bool:
    """Whether one chunk of all N rows with a weight gradient (its (N, V) logits, and dW in one GEMM over all rows
    into its own (V, H): no fp32 accumulator) takes no more memory than chunks of ``rows`` (a (rows, V) workspace
    holding dW at the end, and the (V, H) fp32 accumulator). Llama-3-8B head, N 8,192: 2.1 + 1.05 GB against
    1.05 + 2.1 GB, and it saves the accumulator's read-modify-write (2 x 2 x 2.1 GB) and its final cast."""
    return n * v * elt_bytes + v * h * elt_bytes <= max(rows * v, v * h) * elt_bytes + v * h * 4


def part_one_rows(v: int, parts: int, elt_bytes: int) -> int:
    """Vocabulary rows whose weight gradient the first pass accumulates: ceil(V / k), and with k > 1 no more
    than dW's own storage holds as fp32 (V x elt_bytes / 4 rows), since that is where their accumulator lives,
    rounded down to a multiple of ALIGN_ROWS (so the second pass's chunks start aligned)."""
    vp = -(-v // parts)
    if parts == 1:
        return vp
    vp = min(vp, v * elt_bytes // 4)
    return max(1, vp - vp % ALIGN_ROWS if vp > ALIGN_ROWS else vp)


# Vocabulary chunk widths of the second pass are multiples of 8 elements: its logits chunk (N x cv) is a GEMM
# output and operand with leading dimension cv, and cuBLAS runs its Hopper kernels only on 16-byte aligned
# leading dimensions. H200, 0.5B head, cv = 8,309: the (N x cv) logits GEMM took 2.6 ms and the dW GEMM 1.6 ms
# in sm75 CUTLASS kernels, against ~0.36 ms each for the same FLOPs aligned (probe at 8f6fedf).
ALIGN_ROWS = 8


def fp32_rows_of(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` x H fp32 values stored in t's bytes: t (V, H) contiguous, fp32/bf16/fp16."""
    h = t.shape[1]
    flat = t.view(-1)[:rows * h * 4 // t.element_size()]
    return (flat if t.dtype == torch.float32 else flat.view(torch.float32)).view(rows, h)


def downcast_in_place_(acc32: torch.Tensor, out: torch.Tensor, staging: torch.Tensor) -> None:
    """out[:rows] = acc32 rounded to out's dtype, where acc32 (rows, H) fp32 shares out's first bytes.

    Row block [a, b) of out overlaps acc32 rows [a/2, b/2), all < b: rows below a were read by earlier
    blocks and rows [a, b) are read into ``staging`` (flat, out's dtype, not overlapping) before the write.
    """
    rows, h = acc32.shape
    if staging.numel() < h:  # a workspace smaller than one row (V < H and a 1-row chunk): stage row by row
        staging = out.new_empty(h)
    step = staging.numel() // h
    for a in range(0, rows, step):
        b = min(rows, a + step)
        stage = staging[:(b - a) * h].view(b - a, h)
        stage.copy_(acc32[a:b])
        out[a:b].copy_(stage)


# fp32 staging for one vocabulary chunk's weight gradient in the second pass (accumulated over all N rows in
# one GEMM, then rounded once into dW): at most 64 MB, so 4,096 vocabulary rows per chunk at H = 4,096.
DW_CHUNK_BYTES = 64 << 20


def linear_ce_chunked(hidden, weight, labels, bias, scale, lse_in, *, ignore_index: int, softcap,
                      need_dh: bool, need_dw: bool, need_db: bool, chunk_rows: int, vocab_parts: int = 1):
    """One pass over the rows in chunks, and with vocab_parts > 1 a second pass over vocabulary chunks for the
    rest of the weight gradient; see the module docstring.

    hidden (N, H), weight (V, H) contiguous, one dtype; labels (N,) int64; scale (1,) or (N,) fp32 on the
    device (gradient multiplier per row); lse_in (N,) fp32 or None (None: compute lse and the loss).
    vocab_parts k: the first pass accumulates the weight gradient of the first ``part_one_rows`` vocabulary
    rows in fp32 (k = 1: all of V in a (V, H) fp32 accumulator; k > 1: ceil(V / k) rows inside dW's own
    storage, no accumulator beyond it), the second pass the rest, chunk by vocabulary chunk over all rows.
    Returns loss_rows (N,) fp32 (empty when lse_in is given), lse (N,), dH (N, H), dW (V, H), dbias (V,),
    each gradient empty(0) when not asked for.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    grad = need_dh or need_dw or need_db
    c = max(1, min(n, chunk_rows))
    parts = max(1, min(int(vocab_parts), v)) if need_dw else 1
    vp = part_one_rows(v, parts, weight.element_size())
    compute_lse = lse_in is None
    loss_rows = torch.empty(n if compute_lse else 0, device=dev, dtype=torch.float32)
    lse = torch.empty(n, device=dev, dtype=torch.float32) if compute_lse else lse_in
    dh = torch.empty((n, h) if need_dh else (0,), device=dev, dtype=dt)
    db32 = torch.zeros(v if need_db else 0, device=dev, dtype=torch.float32)
    # The workspace holds one chunk of logits (C x V), and at least V x H elements with one vocabulary part and
    # a weight gradient: dW is its first V x H elements at the end, no second (V, H) allocation (with C > H the
    # returned dW is a view into the larger workspace, freed with it once the backward has scaled it). With
    # several parts, dW is allocated first and part 1's fp32 accumulator lives in its bytes.
    # One chunk of all rows (N > 0) takes dW in one GEMM contracted over N: fp32 inside the GEMM, rounded once, no
    # fp32 (V, H) accumulator; the workspace holds the logits then, so dW has its own storage.
    single = need_dw and parts == 1 and 0 < n <= c
    reuse = need_dw and parts == 1 and not single
    ws = torch.empty(max(c * v, v * h if reuse else 0), device=dev, dtype=dt)
    dw = torch.empty((v, h) if need_dw and not reuse else (0,), device=dev, dtype=weight.dtype)
    if need_dw and parts > 1:
        dw32 = fp32_rows_of(dw, vp).zero_()
    else:
        dw32 = torch.zeros((vp, h) if need_dw and not single else (0,), device=dev, dtype=torch.float32)
    # One-pass row kernel (the training forward of "mean" / "sum" without a weight or bias gradient: LoRA, a frozen
    # head): the chunk holds w with d_logits = rho * w - gamma * onehot, so dH = rho * (w @ W) - gamma * W[label],
    # from the GEMM's fp32 output, rounded once (``dh_finish``). A weight gradient would need rho inside its
    # contraction over rows (rho * x rounded to bf16: measured 2x the max error of dW on an H200) and the one-hot
    # term scattered into dW's rows: those keep two passes.
    one_pass = compute_lse and grad and not need_dw and not need_db and _one_pass_ok(hidden)
    rho = torch.empty(n if one_pass else 0, device=dev, dtype=torch.float32)
    gamma = torch.empty_like(rho)
    acc_dt = torch.float32 if dt == torch.bfloat16 else dt  # one pass runs on bf16, fp32 and fp64 (_one_pass_ok)
    dh_acc = torch.empty((c, h) if one_pass and need_dh else (0,), device=dev, dtype=acc_dt)
    for r0 in range(0, n, c):
        rows = min(c, n - r0)
        x = hidden[r0:r0 + rows]
        buf = ws[:rows * v].view(rows, v)
        torch.mm(x, weight.t(), out=buf)  # (rows, V) raw logits, bias added in the kernel in fp32
        lce_rows(buf, labels, r0, bias, scale, loss_rows, lse, ignore_index=ignore_index, softcap=softcap,
                 compute_lse=compute_lse, write_grad=grad, rho=rho if one_pass else None,
                 gamma=gamma if one_pass else None)
        if need_dh:
            if one_pass:
                dh_finish(_mm_wide(buf, weight, dh_acc[:rows]), weight, labels, r0, rho, gamma, dh[r0:r0 + rows])
            else:
                torch.mm(buf, weight, out=dh[r0:r0 + rows])
        if single:
            _dw_one_gemm(buf, x, dw)
        elif need_dw:
            dw_accumulate(buf[:, :vp], x, dw32)  # part 1: the first vp vocabulary rows
        if need_db:
            db32 += buf.sum(0, dtype=torch.float32)
    if reuse:
        dw = ws[:v * h].view(v, h)
    if need_dw and parts == 1 and not single:
        dw.copy_(dw32)
    elif need_dw and parts > 1 and dw.dtype != torch.float32:  # fp32 weights: the accumulator already is dw[:vp]
        downcast_in_place_(dw32, dw, ws)
    del dw32
    # Second pass: vocabulary rows vp..V in chunks of cv, each over all N rows: its logits (N x cv) from the
    # stored lse give d_logits, and dW of the chunk is one GEMM contracted over N (fp32, rounded once).
    cv = max(1, min(ws.numel() // max(n, 1), DW_CHUNK_BYTES // (4 * h)))
    cv = cv - cv % ALIGN_ROWS if cv > ALIGN_ROWS else cv
    # With N = 0 the chunks are (0 x cv): their dW parts come out as zeros through the same steps.
    acc = torch.empty((min(cv, v - vp), h) if need_dw else (0,), device=dev, dtype=torch.float32)
    for lo in range(vp, v if need_dw else 0, cv):
        hi = min(v, lo + cv)
        buf = ws[:n * (hi - lo)].view(n, hi - lo)
        torch.mm(hidden, weight[lo:hi].t(), out=buf)
        lce_rows(buf, labels, 0, None if bias is None else bias[lo:hi], scale, loss_rows, lse,
                 ignore_index=ignore_index, softcap=softcap, compute_lse=False, write_grad=True, col0=lo, vocab=v)
        part = acc[:hi - lo].zero_()
        dw_accumulate(buf, hidden, part)
        dw[lo:hi].copy_(part)
    db = db32.to(bias.dtype) if need_db else torch.empty(0, device=dev, dtype=dt)
    return loss_rows, lse, dh, dw, db


_CUBLAS_MM_FP32 = hasattr(torch.ops.aten.mm, "dtype_out")


def _one_pass_ok(t: torch.Tensor) -> bool:
    """Whether the one-pass row kernel applies to a chunk of t's dtype: its w = exp(z - c) values reach e^40
    (``ONE_PASS_MAX_GAP``), within bf16's and fp32's range but not fp16's (65,504 = e^11), and ``_mm_wide`` must
    run without an fp32 copy of the (C, V) chunk: fp32/fp64 inputs, cuBLAS's bf16 GEMM with fp32 output (aten
    mm.dtype_out, CUDA), or the CPU (the interpreter tests' small shapes)."""
    if t.dtype == torch.bfloat16:
        return not t.is_cuda or _CUBLAS_MM_FP32
    return t.dtype in (torch.float32, torch.float64)


def _dw_one_gemm(dlogits: torch.Tensor, x: torch.Tensor, dw: torch.Tensor) -> None:
    """dw (V, H) = dlogits (N, V).T @ x (N, H), accumulated in fp32 (fp64 for fp64) and rounded once into dw's dtype:
    cuBLAS accumulates its bf16 / fp16 GEMMs in fp32; on the CPU (the interpreter tests) the product is taken in
    fp32 and cast."""
    if dw.is_cuda or dw.dtype in (torch.float32, torch.float64):
        torch.mm(dlogits.t(), x, out=dw)
    else:
        dw.copy_(torch.mm(dlogits.t().float(), x.float()))


def _mm_wide(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b with out's (wider or equal) dtype, accumulated in fp32 or wider."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.ops.aten.mm.dtype_out(a, b, out.dtype, out=out)
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)  # CPU: no mm.dtype kernel there


# ---------------------------------------------------------------- torch.library registration


@torch.library.custom_op("chronicals::linear_cross_entropy", mutates_args=())
def _lce_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor],
            ignore_index: int, reduction: str, softcap: Optional[float], need_dh: bool, need_dw: bool,
            need_db: bool, chunk_rows: int, vocab_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor, torch.Tensor]:
    """-> loss (() or (N,) fp32), lse (N,), and for "mean"/"sum" the gradients for grad_output = 1."""
    n = hidden.shape[0]
    count = (labels != ignore_index).sum().clamp(min=1)  # stays on the device
    if reduction == "mean":
        scale = (1.0 / count.float()).reshape(1)
    else:
        scale = torch.ones(1, device=hidden.device, dtype=torch.float32)
    fwd_grads = reduction != "none"
    loss_rows, lse, dh, dw, db = linear_ce_chunked(
        hidden, weight, labels, bias, scale, None, ignore_index=ignore_index, softcap=softcap,
        need_dh=need_dh and fwd_grads, need_dw=need_dw and fwd_grads, need_db=need_db and fwd_grads,
        chunk_rows=chunk_rows, vocab_parts=vocab_parts)
    if reduction == "none":
        loss = loss_rows
    else:
        loss = loss_rows.sum() * scale[0] if n else loss_rows.new_zeros(())
    return loss, lse, dh, dw, db


@_lce_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, reduction, softcap, need_dh, need_dw, need_db, chunk_rows,
      vocab_parts):
    n, h = hidden.shape
    v = weight.shape[0]
    fwd = reduction != "none"
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    return (loss, hidden.new_empty(n, dtype=torch.float32),
            hidden.new_empty((n, h) if need_dh and fwd else (0,)),
            weight.new_empty((v, h) if need_dw and fwd else (0,)),
            hidden.new_empty((v,) if need_db and fwd else (0,)))


@torch.library.custom_op("chronicals::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     bias: Optional[torch.Tensor], lse: torch.Tensor, ignore_index: int, softcap: Optional[float],
                     need_dh: bool, need_dw: bool, need_db: bool, chunk_rows: int,
                     vocab_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of reduction="none": grad_rows (N,) -> dH (N, H), dW (V, H), dbias (V,) (empty when not asked)."""
    _, _, dh, dw, db = linear_ce_chunked(
        hidden, weight, labels, bias, grad_rows.float().contiguous(), lse, ignore_index=ignore_index,
        softcap=softcap, need_dh=need_dh, need_dw=need_dw, need_db=need_db, chunk_rows=chunk_rows,
        vocab_parts=vocab_parts)
    return dh, dw, db


@_lce_backward_op.register_fake
def _(grad_rows, hidden, weight, labels, bias, lse, ignore_index, softcap, need_dh, need_dw, need_db, chunk_rows,
      vocab_parts):
    n, h = hidden.shape
    v = weight.shape[0]
    return (hidden.new_empty((n, h) if need_dh else (0,)), weight.new_empty((v, h) if need_dw else (0,)),
            hidden.new_empty((v,) if need_db else (0,)))


@torch.library.custom_op("chronicals::linear_cross_entropy_scale_grad", mutates_args=())
def _scale_grad_op(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """grad * g (0-dim fp32) computed in fp32 and rounded once to grad's dtype (see _backward)."""
    return scale_by(grad.contiguous(), g)


@_scale_grad_op.register_fake
def _(grad, g):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    (hidden, weight, labels, bias, ignore_index, reduction, softcap, need_dh, need_dw, need_db, chunk_rows,
     vocab_parts) = inputs
    _, lse, dh, dw, db = output
    # lse and the gradients are outputs nobody differentiates: without this autograd would hand _backward a
    # zero tensor for each (zeros_like(dW): +0.25 GiB at Qwen2.5-0.5B, measured as the backward's peak)
    ctx.set_materialize_grads(False)
    ctx.reduction, ctx.has_bias = reduction, bias is not None
    ctx.args = (ignore_index, softcap, need_dh, need_dw, need_db, chunk_rows, vocab_parts)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, bias, lse)
    else:
        ctx.save_for_backward(dh, dw, db)


def _backward(ctx, g_loss, _g_lse, _g_dh, _g_dw, _g_db):
    ignore_index, softcap, need_dh, need_dw, need_db, chunk_rows, vocab_parts = ctx.args
    if g_loss is None:  # only lse / the gradient outputs were used downstream: nothing flows back
        return (None,) * 12
    if ctx.reduction == "none":
        hidden, weight, labels, bias, lse = ctx.saved_tensors
        dh, dw, db = torch.ops.chronicals.linear_cross_entropy_backward(
            g_loss, hidden, weight, labels, bias, lse, ignore_index, softcap, need_dh, need_dw, need_db, chunk_rows,
            vocab_parts)
    else:
        dh, dw, db = ctx.saved_tensors
        # g_loss is usually 1, or 1/count from the trainer: multiplied in fp32, rounded once (torch's
        # bf16 * 0-dim fp32 would round 1/count itself to bf16 first, a 2^-9 error on every gradient)
        dh, dw, db = (torch.ops.chronicals.linear_cross_entropy_scale_grad(t, g_loss) for t in (dh, dw, db))
    return (dh if need_dh else None, dw if need_dw else None, None, db if need_db else None,
            None, None, None, None, None, None, None, None)


_lce_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def _check(hidden, weight, labels, bias, reduction, softcap=None, vocab_parts=1, ignore_index=-100):
    """The argument checks both impls run (before choosing one). Host metadata only: label values are not
    read (that would sync); out-of-range ones give NaN instead (module docstring)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or not weight.shape[1] \
            or not weight.shape[0]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "must be (N, H) and (V, H) with H >= 1 and V >= 1; flatten batch dims with "
                         "hidden.reshape(-1, H)")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} must be ({hidden.shape[0]},), "
                         "one target per row of hidden (flatten with labels.reshape(-1))")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"linear_cross_entropy: hidden {hidden.dtype}, weight {weight.dtype} and bias "
                         f"{None if bias is None else bias.dtype} must share one dtype; cast hidden to the weight's")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: labels must be int64 or int32 class indices, got {labels.dtype}; "
                         "convert with labels.long()")
    # softcap = 0 made every logit 0 * tanh(x / 0) = 0 (a uniform loss of log V, silently); < 0 flips the logits
    if softcap is not None and not (is_real(softcap) and 0 < softcap < float("inf")):
        raise ValueError(f"linear_cross_entropy: softcap={softcap!r} must be None (no capping) or a finite number "
                         "> 0 (Gemma-2 uses 30.0: logits = softcap * tanh(logits / softcap))")
    if isinstance(vocab_parts, bool) or int(vocab_parts) != vocab_parts or vocab_parts < 1:
        raise ValueError(f"linear_cross_entropy: vocab_parts={vocab_parts!r} must be an integer >= 1 "
                         "(1: one fp32 weight-gradient accumulator of V x H; k: V x H / k for (k-1)/k more GEMMs)")
    if not is_integral(ignore_index):  # 0.5 was read as 0
        raise ValueError(f"linear_cross_entropy: ignore_index={ignore_index!r} must be an integer label (-100 is "
                         "transformers' and the data collator's)")
    check_device("linear_cross_entropy", hidden, weight, labels, bias)


def linear_cross_entropy_triton(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                                softcap=None, chunk_rows: int | None = None, vocab_parts: int = 1):
    """The fused path with an explicit chunk size (None: ``default_chunk_rows``); tests vary it."""
    _check(hidden, weight, labels, bias, reduction, softcap, vocab_parts, ignore_index)
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden.requires_grad
    need_dw = grad_on and weight.requires_grad
    need_db = grad_on and bias is not None and bias.requires_grad
    n, h = hidden.shape
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(n, h, weight.shape[0], need_dw, hidden.element_size(), int(vocab_parts))
    loss = torch.ops.chronicals.linear_cross_entropy(
        hidden.contiguous(), weight.contiguous(), labels.contiguous().long(),
        None if bias is None else bias.contiguous(), int(ignore_index), reduction,
        None if softcap is None else float(softcap), need_dh, need_dw, need_db, int(chunk_rows), int(vocab_parts))[0]
    return loss


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                         softcap=None, impl: str = "auto", vocab_parts: int = 1):
    """Loss of ``hidden @ weight.T (+ bias)`` against ``labels``; see the module docstring.

    hidden (N, H), weight (V, H), labels (N,), bias (V,) or None -> fp32 loss (float64 for float64 inputs
    under impl="torch"), () or (N,) for "none".
    impl: "triton" is the fused path that never builds the (N, V) logits; "torch" (what "auto" picks on CPU)
    is its reference twin, ``linear_cross_entropy_ref``: it materializes the (N, V) logits (as transformers
    does) and ignores vocab_parts.
    vocab_parts (fused path, weight gradient only): k > 1 keeps the fp32 weight-gradient accumulator at
    V x H x 4 / k bytes for (k - 1) / k more logits GEMMs and as many dW GEMMs of 1/k the size.
    Labels must be in [0, V) or equal ignore_index; any other label gives NaN for its row (and for "mean" /
    "sum") and zero gradient from it, on both impls (no host-side check: that would sync the device).
    """
    _check(hidden, weight, labels, bias, reduction, softcap, vocab_parts, ignore_index)
    if resolve_impl("linear_cross_entropy", impl, hidden.device) == "torch":
        return linear_cross_entropy_ref(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                        reduction=reduction, softcap=softcap)
    return linear_cross_entropy_triton(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                       reduction=reduction, softcap=softcap, vocab_parts=vocab_parts)
