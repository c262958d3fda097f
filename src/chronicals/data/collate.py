"""Collation of packed documents into rows: the ``PackedBatch`` the trainer consumes.

Two documents a = [a0 a1 a2] (loss on a1, a2) and b = [b0 b1] (loss on b1) in one row of 7:

    input_ids     a0   a1   a2   b0   b1   pad  pad
    position_ids  0    1    2    0    1    0    1       restart at 0 per document (padding too)
    shift_labels  a1   a2   -100 b1   -100 -100 -100    target of each position, shifted inside a document
    cu_seqlens    [0, 3, 5, 7]                           over the flattened B * S tokens; padding is a document

No position predicts a token of another document: each document's last position has no target.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    """One step's batch. B rows of S tokens (rows mode: S = max_seq_len; token-budget mode: B = 1).

    input_ids (B, S) int64; position_ids (B, S) int64; shift_labels (B, S) int64 (-100: no loss);
    cu_seqlens (num_docs + 1,) int32 over the flattened B * S tokens, padding counted as documents;
    max_seqlen: the longest entry of cu_seqlens' differences (the attention kernels' bound, padding included);
    num_loss_tokens: (shift_labels != -100).sum(); num_tokens: real (non-padding) tokens; num_docs: real documents;
    longest_doc: the longest real document (what a sliding window or a dynamic rope limits; a row's padding, one
    segment of up to S tokens, attends only to itself), None where not known (max_seqlen stands in).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_loss_tokens: int
    num_tokens: int = 0
    num_docs: int = 0
    longest_doc: int | None = None

    def _map(self, fn) -> "PackedBatch":
        """A copy with ``fn`` applied to every tensor field (the ints are kept)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBatch(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        """Move every tensor to ``device`` (pin_memory() first for an asynchronous host-to-device copy)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PackedBatch":
        return self._map(torch.Tensor.pin_memory)

    def model_kwargs(self) -> dict:
        """Keyword arguments for ``CausalLM.forward`` (besides input_ids)."""
        return {"position_ids": self.position_ids, "cu_seqlens": self.cu_seqlens,
                "max_seqlen": self.max_seqlen, "shift_labels": self.shift_labels, "longest_doc": self.longest_doc}


def shift_document(ids: np.ndarray, trainable: np.ndarray) -> np.ndarray:
    """ids (L,), trainable (L,) bool (loss on predicting that token) -> shift_labels (L,) int64."""
    out = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    out[:-1] = np.where(trainable[1:], ids[1:], IGNORE_INDEX)
    return out


def collate_rows(rows: list[list[tuple[np.ndarray, np.ndarray]]], row_len: int, pad_id: int) -> PackedBatch:
    """rows: per row, its documents as (ids (L,), trainable (L,)) -> PackedBatch of shape (len(rows), row_len).

    Each row is its documents back to back, then padding (one extra document of pad_id, no loss).
    """
    b = len(rows)
    if b == 0:  # max() over no row's lengths said 'max() arg is an empty sequence' (a property walk)
        raise ValueError("collate_rows: no rows; a batch holds at least one row (a row of no documents is padding)")
    input_ids = np.full((b, row_len), pad_id, dtype=np.int64)
    position_ids = np.zeros((b, row_len), dtype=np.int64)
    shift_labels = np.full((b, row_len), IGNORE_INDEX, dtype=np.int64)
    seqlens: list[int] = []
    num_tokens = num_docs = longest = 0
    for r, docs in enumerate(rows):
        t = 0
        for ids, trainable in docs:
            n = len(ids)
            if t + n > row_len:
                raise ValueError(f"collate_rows: row {r} holds {t + n} tokens, more than row_len={row_len}")
            input_ids[r, t:t + n] = ids
            position_ids[r, t:t + n] = np.arange(n)
            shift_labels[r, t:t + n] = shift_document(ids, trainable)
            seqlens.append(n)
            longest = max(longest, n)
            t += n
        num_tokens += t
        num_docs += len(docs)
        if t < row_len:  # padding: its own document, so no real token attends to it or it to them
            position_ids[r, t:] = np.arange(row_len - t)
            seqlens.append(row_len - t)
    cu = np.zeros(len(seqlens) + 1, dtype=np.int32)
    np.cumsum(seqlens, out=cu[1:])
    labels = torch.from_numpy(shift_labels)
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids), position_ids=torch.from_numpy(position_ids),
        shift_labels=labels, cu_seqlens=torch.from_numpy(cu), max_seqlen=int(max(seqlens)),
        num_loss_tokens=int((labels != IGNORE_INDEX).sum()), num_tokens=num_tokens, num_docs=num_docs,
        longest_doc=longest)
