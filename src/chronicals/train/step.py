"""One optimizer step's forward/backward, and the held-out loss, both through the fused loss head.

Gradient accumulation is normalized by the global loss-token count of the optimizer step: each
micro-batch contributes ``loss_sum_i / N`` with ``N = sum_i num_loss_tokens_i``, so k micro-batches
give exactly the gradient of one batch holding all of them. (Averaging per-micro-batch means instead
weights a token of a 10-token micro-batch 10x more than one of a 100-token micro-batch.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .graphs import GraphedStep


def _to(batch, device: torch.device) -> dict:
    cu = batch.cu_seqlens
    return {"input_ids": batch.input_ids.to(device, non_blocking=True),
            "position_ids": batch.position_ids.to(device, non_blocking=True),
            "shift_labels": batch.shift_labels.to(device, non_blocking=True),
            "cu_seqlens": None if cu is None else cu.to(device, non_blocking=True),
            "max_seqlen": batch.max_seqlen}


def batch_loss_sum(model, batch, device: torch.device) -> torch.Tensor:
    """Summed cross-entropy over the batch's loss tokens (fp32 scalar); no logits are materialized."""
    t = _to(batch, device)
    return model(t["input_ids"], position_ids=t["position_ids"], cu_seqlens=t["cu_seqlens"],
                 max_seqlen=t["max_seqlen"], shift_labels=t["shift_labels"], reduction="sum",
                 num_loss_tokens=int(batch.num_loss_tokens))  # the loss head runs on the loss rows only


def accumulate_gradients(model, micro_batches: list, device: torch.device,
                         graphs: "GraphedStep | None" = None) -> tuple[torch.Tensor, int]:
    """Forward + backward over ``micro_batches``; grads become d(sum of losses / N). Returns (mean loss, N).

    N is the step's total loss-token count, known before any backward because every batch carries
    ``num_loss_tokens``. The mean loss stays a device tensor (no host sync per micro-batch).
    ``graphs``: a ``train.graphs.GraphedStep`` built on ``model``: the same step replayed as CUDA graphs.
    """
    if graphs is not None:
        if graphs.model is not model:
            raise ValueError("accumulate_gradients: graphs was built on another model; build GraphedStep(model, ...)")
        return graphs.accumulate(micro_batches)
    n = sum(int(b.num_loss_tokens) for b in micro_batches)
    denom = max(n, 1)
    total = None
    for b in micro_batches:
        loss = batch_loss_sum(model, b, device)
        (loss / denom).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total / denom, n


@torch.no_grad()
def evaluate_loss(model, batches, device: torch.device) -> tuple[float, int]:
    """Mean cross-entropy per loss token over ``batches`` (sum of sums / total count), and the count."""
    was_training = model.training
    model.eval()
    total, n = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for b in batches:
            total += batch_loss_sum(model, b, device).double()
            n += int(b.num_loss_tokens)
    finally:
        model.train(was_training)
    return (total / max(n, 1)).item(), n
