"""CausalLM.forward's arguments: shape and dtype checks before any work, and right-padded batches.

A padded batch as a tokenizer makes it (``tokenizer(texts, padding=True, return_tensors="pt")``, padding side
right): row i holds L_i tokens, then S - L_i padding tokens, and ``attention_mask`` is 1 on the tokens:

    input_ids       t0  t1  t2  t3  pad pad
    attention_mask  1   1   1   1   0   0
    labels          t0  t1  t2  t3  pad pad        -> targets  t1  t2  t3  -   -   -     (- = -100)

Causal attention already gives the tokens the logits they get without the padding (no token attends to a later
position), so the mask changes only the loss: padding predicts nothing and is never a target, whatever labels
holds there (transformers counts a padding target unless its label is -100; with -100 there, as its collators
write, the two losses are the same). Logits at padding positions are not defined. Left padding (0s before 1s)
would need the attention to skip keys, which this forward does not do: it is refused.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
INDEX_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")


def check_forward_args(input_ids, labels, shift_labels, reduction: str, position_ids=None,
                       attention_mask=None) -> None:
    """CausalLM.forward's arguments, before any work: input_ids (B, S) int64 / int32, at most one of labels /
    shift_labels, of input_ids' shape and an integer dtype, a known reduction, position_ids (B, S) or (1, S) of
    an integer dtype, attention_mask (B, S) bool or integer. Reads only shapes and dtypes."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids (B, S), got {type(input_ids).__name__}; "
                        "use torch.tensor(ids)[None] for one sequence")
    if input_ids.dim() != 2:
        fix = (f"add a batch dimension: model(ids[None]) gives (1, {input_ids.shape[0]})" if input_ids.dim() == 1
               else "reshape to (batch, sequence)")
        raise ValueError(f"input_ids must be 2-D (B, S), got shape {tuple(input_ids.shape)}; {fix}")
    if input_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"input_ids must hold token ids as int64 or int32, got {input_ids.dtype}; "
                         "convert with input_ids.long()")
    b, s = input_ids.shape
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError(f"position_ids must be a tensor (B, S) or (1, S), got {type(position_ids).__name__}")
        if position_ids.dim() != 2 or position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} but input_ids has ({b}, {s}): "
                             f"give one position per token, ({b}, {s}) or (1, {s}) for every row alike "
                             f"(position_ids[None] for a 1-D one)")
        if position_ids.dtype not in INDEX_DTYPES:
            raise ValueError(f"position_ids must be int64 or int32, got {position_ids.dtype}; convert with "
                             "position_ids.long()")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor (B, S) like input_ids, got "
                            f"{type(attention_mask).__name__}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                             f"{tuple(input_ids.shape)}: one entry per token, 1 for a token and 0 for padding")
        if attention_mask.dtype != torch.bool and (attention_mask.is_floating_point() or attention_mask.is_complex()):
            raise ValueError(f"attention_mask must be bool or integer (1 token, 0 padding), got "
                             f"{attention_mask.dtype}; convert with attention_mask.long()")
    if labels is not None and shift_labels is not None:
        raise ValueError("pass one of labels= (Hugging Face form, shifted here per document) and shift_labels= "
                         "(already aligned targets), not both")
    name, t = ("labels", labels) if labels is not None else ("shift_labels", shift_labels)
    if t is not None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor (B, S) like input_ids, got {type(t).__name__}")
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}: "
                             f"{name} needs one target per input token, the same (B, S) shape (-100 where no loss)")
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int64 or int32 token ids (-100 where no loss), got {t.dtype}; "
                             f"convert with {name}.long()")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")


def mask_padding(attention_mask: torch.Tensor, labels, shift_labels, *, cu_seqlens=None, kv_caches=None,
                 num_loss_tokens=None):
    """(labels, shift_labels) with -100 where the right-padded batch's ``attention_mask`` says padding (see the
    module docstring). Reads the mask on the host (a device sync on CUDA): the trainer's packed batches carry no
    padding and pass no mask. ValueError for left padding, values other than 0/1, or a mask beside packed rows,
    a KV cache or num_loss_tokens."""
    if cu_seqlens is not None:
        raise ValueError("attention_mask is for padded batches; packed rows (cu_seqlens) carry their documents' "
                         "boundaries already: pass one or the other")
    if kv_caches is not None:
        raise ValueError("attention_mask with kv_caches: generation runs one unpadded row (models.generate)")
    if num_loss_tokens is not None:
        raise ValueError("num_loss_tokens counts the targets of an unpadded batch (PackedBatch.num_loss_tokens); "
                         "with attention_mask leave it out")
    keep = attention_mask.bool()
    if attention_mask.dtype != torch.bool and not bool((attention_mask == keep).all()):
        raise ValueError("attention_mask holds values other than 0 and 1: 1 marks a token, 0 padding")
    left = ~keep[:, :-1] & keep[:, 1:]  # a token after padding
    if bool(left.any()):
        row = int(left.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {row} has padding before a token (left padding): this forward takes "
                         "right-padded batches, where causal attention gives every token the logits it has alone; "
                         "pad on the right (tokenizer.padding_side = 'right')")
    if bool(keep.all()):
        return labels, shift_labels
    if labels is not None:  # shifted later: a padding label is then no position's target
        return labels.masked_fill(~keep, IGNORE_INDEX), None
    if shift_labels is not None:  # aligned: position t's target is token t + 1
        target_kept = torch.ones_like(keep)
        target_kept[:, :-1] = keep[:, 1:]
        return None, shift_labels.masked_fill(~(keep & target_kept), IGNORE_INDEX)
    return labels, shift_labels


def documents_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor | None, int | None]:
    """(cu_seqlens, max_seqlen) of the documents that ``position_ids`` (B, S) mark by restarting at 0 inside a row,
    over the flattened B * S tokens as ``PackedBatch`` gives them; (None, None) when no row restarts (plain rows).
    transformers 5 reads restarting position_ids without an attention mask as packed documents too
    (DataCollatorWithFlattening): without this, the loss was split per document (``shift_labels_per_document``)
    while attention crossed them (logits 80% off the per-document ones; an architecture walk). Reads the positions
    on the host: a device sync on CUDA (the trainer passes cu_seqlens itself)."""
    restart = position_ids[:, 1:] == 0
    if not bool(restart.any()):
        return None, None
    B, S = position_ids.shape
    starts = torch.ones(B, S, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = restart
    begin = starts.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([B * S], device=begin.device, dtype=begin.dtype)
    cu = torch.cat([begin, end]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())
