"""Datasets for fine-tuning: reading, formatting, tokenization (cached), packing, collation.

This package uses nothing else of chronicals (only numpy, torch, transformers tokenizers, tqdm and,
for .parquet / ``datasets.save_to_disk`` directories, pyarrow).

The API the trainer codes against::

    from chronicals.data import load_dataset, PackedLoader, PackedBatch, pack_bfd

    ds = load_dataset(
        ["train.jsonl"],              # files (.jsonl .json .parquet .csv, any case; text files UTF-8, BOM
                                      # ignored), directories of them (recursive, sorted, names starting
                                      # with '.' skipped), or a datasets.save_to_disk directory
        tokenizer,                    # a transformers tokenizer (fast); chat data uses its chat template
        format="auto",                # "auto" | "text" | "alpaca" | "chat" (messages) | "sharegpt"
                                      # (conversations) | "prompt_completion"
        max_seq_len=2048,
        loss_on="assistant",          # "assistant": assistant / completion / output tokens only; "all"
        on_error="fail",              # "fail": raise "file:line: what is wrong, what was expected";
                                      # "skip": drop the record and count it (ds.stats.skipped_errors)
        overlong="truncate",          # "truncate" | "drop" examples longer than max_seq_len (counted)
        cache_dir=None,               # tokenization cache (keyed by file contents, tokenizer, settings);
                                      # a damaged entry is logged and rebuilt (data/cache.py)
        num_proc=None,                # worker processes; None: 1 below 8 MB of files, else min(8, cpus)
        name="the dataset",           # which set, in whole-set errors and the log ("the held-out set")
    )  # -> TokenizedDataset; logs one line of files read and formats found (ds.summary)
    len(ds); ds[i] -> (ids (L,) int32, trainable (L,) bool)   # trainable: loss on predicting the token
    ds.lengths (n,) int64; ds.pad_id; ds.stats (DatasetStats: counts of records, truncated, dropped, ...)

    loader = PackedLoader(
        ds,
        batch_size=8,                 # rows mode: B rows of max_seq_len per batch, documents packed by BFD
        max_seq_len=2048,
        tokens_per_batch=None,        # token-budget mode instead (batch_size=None): one padding-free row
                                      # of at most this many tokens per batch, shape (1, n)
        pad_to_multiple_of=1,         # token-budget mode: pad that row's length up to a multiple of this
        seed=0, shuffle=True,         # deterministic shuffle of the packed rows per epoch (seed, epoch)
        drop_last=False,
        rank=0, world_size=1,         # data parallel: each rank takes every world_size-th batch
    )
    len(loader)                       # batches per epoch (for this rank)
    for batch in loader: ...          # PackedBatch; one epoch from the current position, the next
                                      # ``for`` continues with the next epoch
    loader.state_dict() -> {"epoch": e, "position": k, ...}; loader.load_state_dict(sd)  # exact resume
    loader.set_epoch(e)               # jump to the start of an epoch
    loader.stats -> dict              # loss_tokens / slots (packing efficiency), rows, documents, counts

    PackedBatch: input_ids, position_ids, shift_labels (B, S) int64; cu_seqlens (docs + 1,) int32;
    max_seqlen, num_loss_tokens, num_tokens, num_docs: int; .to(device), .pin_memory(), .model_kwargs()
    (see DEVELOPERS.md "The batch contract between data and train").

    pack_bfd(lengths, capacity) -> list[list[int]]   # Best-Fit-Decreasing, O(n log n)
"""

from .collate import IGNORE_INDEX, PackedBatch, collate_rows, shift_document
from .dataset import DatasetStats, TokenizedDataset, load_dataset
from .formats import FORMATS, detect_format
from .loader import PackedLoader
from .packing import pack_bfd, pack_ffd
from .readers import DataError

__all__ = ["FORMATS", "IGNORE_INDEX", "DataError", "DatasetStats", "PackedBatch", "PackedLoader",
           "TokenizedDataset", "collate_rows", "detect_format", "load_dataset", "pack_bfd", "pack_ffd",
           "shift_document"]
