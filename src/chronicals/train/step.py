"""One optimizer step's forward/backward, and the held-out loss, both through the fused loss head.

Gradient accumulation is normalized by the global loss-token count of the optimizer step: each
micro-batch contributes ``loss_sum_i / N`` with ``N = sum_i num_loss_tokens_i``, so k micro-batches
give exactly the gradient of one batch holding all of them. (Averaging per-micro-batch means instead
weights a token of a 10-token micro-batch 10x more than one of a 100-token micro-batch.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models.generate import eval_mode

if TYPE_CHECKING:
    from .distributed import DistContext
    from .grad_buckets import GradBuckets
    from .graphs import GraphedStep


def _to(batch, device: torch.device) -> dict:
    cu = batch.cu_seqlens
    return {"input_ids": batch.input_ids.to(device, non_blocking=True),
            "position_ids": batch.position_ids.to(device, non_blocking=True),
            "shift_labels": batch.shift_labels.to(device, non_blocking=True),
            "cu_seqlens": None if cu is None else cu.to(device, non_blocking=True),
            "max_seqlen": batch.max_seqlen, "longest_doc": getattr(batch, "longest_doc", None)}


def batch_loss_sum(model, batch, device: torch.device) -> torch.Tensor:
    """Summed cross-entropy over the batch's loss tokens (fp32 scalar); no logits are materialized."""
    t = _to(batch, device)
    return model(t["input_ids"], position_ids=t["position_ids"], cu_seqlens=t["cu_seqlens"],
                 max_seqlen=t["max_seqlen"], longest_doc=t["longest_doc"], shift_labels=t["shift_labels"],
                 reduction="sum", num_loss_tokens=int(batch.num_loss_tokens))  # the head: on the loss rows only


def loss_token_count(micro_batches: list) -> int:
    """The micro-batches' loss tokens (a host int: every batch carries ``num_loss_tokens``)."""
    return sum(int(b.num_loss_tokens) for b in micro_batches)


def accumulate_gradients(model, micro_batches: list, device: torch.device,
                         graphs: "GraphedStep | None" = None, *, count: int | None = None) -> tuple[torch.Tensor, int]:
    """Forward + backward over ``micro_batches``; grads become d(sum of losses / N). Returns (mean loss, N).

    N is the step's total loss-token count, known before any backward because every batch carries
    ``num_loss_tokens``. The mean loss stays a device tensor (no host sync per micro-batch).
    ``graphs``: a ``train.graphs.GraphedStep`` built on ``model``: the same step replayed as CUDA graphs.
    ``count``: N when it is not these micro-batches' own count (data parallelism passes the all-ranks
    count, a device int64 scalar, returned as it is; the returned loss is then this rank's loss sum / N,
    which sums over the ranks to the mean).
    """
    n = loss_token_count(micro_batches) if count is None else count
    if graphs is not None:
        if graphs.model is not model:
            raise ValueError("accumulate_gradients: graphs was built on another model; build GraphedStep(model, ...)")
        return graphs.accumulate(micro_batches, count=n)
    denom = n.clamp(min=1).float() if isinstance(n, torch.Tensor) else max(int(n), 1)
    total = None
    for b in micro_batches:
        loss = batch_loss_sum(model, b, device)
        (loss / denom).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total / denom, n


def accumulate_data_parallel(model, micro_batches: list, device: torch.device, dist: "DistContext",
                             params: list, graphs: "GraphedStep | None" = None,
                             reducer: "GradBuckets | None" = None) -> tuple[torch.Tensor, int]:
    """``accumulate_gradients`` over this rank's ``micro_batches``, exact across ranks. Returns (mean loss, N).

    N = the loss tokens of every rank's micro-batches (an int64 device scalar, all-reduced before any backward
    and returned as it is: the trainer reads it with the step's metrics, without a host sync); each
    rank backpropagates its loss sum / N and the grads of ``params`` are then summed over the ranks, so
    every rank holds the gradient of one process training on all ranks' micro-batches. The returned mean
    loss is the same sum over the ranks (a device tensor, equal on every rank). One process: exactly
    ``accumulate_gradients``.
    ``reducer``: a ``GradBuckets`` over ``params`` (``train.overlap_grad_reduce``): the sum runs bucket by bucket
    during the last micro-batch's backward (with ``graphs``, inside its captured graph; build the GraphedStep
    with the same reducer). None (the default): ``DistContext.all_reduce_grads`` after the whole backward.
    """
    if not dist.enabled:
        return accumulate_gradients(model, micro_batches, device, graphs)
    if graphs is not None and graphs.reducer is not reducer:  # else the sum would run twice, or not at all
        raise ValueError("accumulate_data_parallel: graphs and this call disagree on the reducer; build "
                         "GraphedStep(model, device, params=..., reducer=reducer) with the reducer passed here")
    n = dist.all_reduce_count(loss_token_count(micro_batches))
    eager_reduce = reducer is not None and graphs is None  # with graphs, the captured graph holds the reduce
    if eager_reduce:
        reducer.begin(len(micro_batches))
    loss, _ = accumulate_gradients(model, micro_batches, device, graphs, count=n)
    if reducer is None:
        dist.all_reduce_grads(params)
    elif eager_reduce:
        reducer.finish()
    return dist.all_reduce_sum_(loss.detach().clone()), n


@torch.no_grad()
def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ with the total norm in fp32: torch's is in the gradients' dtype, so a bf16
    run logged 20.125 where the norm was 20.1425 (3 significant digits; its clip coefficient rounded alike). The
    same per-tensor foreach norms (accumulated in fp32, kept in fp32), then torch's clip_grads_with_norm_.
    Returns the norm before clipping, a 0-d fp32 tensor on the first gradient's device; no host sync."""
    total = grad_norm_fp32(params)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)  # no gradient: nothing to do
    return total


def grad_norm_fp32(params) -> torch.Tensor:
    """The L2 norm over the gradients of ``params``, a 0-d tensor on the first gradient's device (0 on the CPU when
    none has one): per-tensor foreach norms accumulated and kept in fp32, or in float64 when a gradient is float64
    (model.dtype=float64 reference runs: foreach_norm refuses to narrow them). No host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups: dict = {}  # (device, dtype, accumulation dtype) -> gradients: one foreach kernel per device and dtype
    for g in grads:
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        groups.setdefault((g.device, g.dtype, acc), []).append(g)
    wide = max((acc for *_, acc in groups), key=lambda dt: dt.itemsize)
    norms = [n for (*_, acc), gs in groups.items() for n in torch._foreach_norm(gs, 2, dtype=acc)]
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device, wide) for n in norms]))


@torch.no_grad()
def evaluate_loss(model, batches, device: torch.device, stop=None,
                  dp: DistContext | None = None) -> tuple[float | None, int]:
    """Mean cross-entropy per loss token over ``batches`` (sum of sums / total count), and the count.

    ``stop`` (a callable, optional) is asked before each batch: True abandons the pass -> (None, count so far).
    ``dp`` (data parallel, optional; every rank calls this with the same ``batches``): rank r evaluates batches
    r, r + W, ... and the sums and counts are all-reduced, so each rank returns the whole pass's loss in 1/W of its
    time; ``stop`` is then asked before each round of W batches and agreed on (any rank's True stops all of them
    there: a host sync a round, only when ``stop`` is given). A loader already sharded by rank (a PackedLoader with
    ``world_size`` > 1, which gives every rank as many batches) is this rank's share: all of it is scored."""
    rank, world = (dp.rank, dp.world_size) if dp is not None and dp.enabled else (0, 1)
    reduce = world > 1
    if getattr(batches, "world_size", 1) > 1:  # its own shard: every batch here, one round each
        rank, world = 0, 1
    total, n, stopped = torch.zeros((), dtype=torch.float64, device=device), 0, False
    with eval_mode(model):
        for i, b in enumerate(batches):
            if stop is not None and i % world == 0:
                stopped = bool(dp.all_reduce_flag(stop())) if reduce else bool(stop())
                if stopped:
                    break
            if i % world != rank:
                continue
            total += batch_loss_sum(model, b, device).double()
            n += int(b.num_loss_tokens)
    if reduce:
        sums = torch.stack([total, torch.tensor(float(n), dtype=torch.float64, device=device)])
        dp.all_reduce_sum_(sums)
        total, n = sums[0], int(sums[1].item())
    return (None if stopped else (total / max(n, 1)).item()), n
