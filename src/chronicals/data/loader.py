"""``PackedLoader``: packed batches for the trainer, with a deterministic per-epoch order and exact resume.

The documents are packed once by Best-Fit-Decreasing (``pack_bfd``) into rows of ``max_seq_len`` (rows
mode) or into rows of at most ``tokens_per_batch`` tokens (token-budget mode, one padding-free row per
batch). Each epoch shuffles the packed rows with a generator seeded by (seed, epoch); rows mode then
groups ``batch_size`` consecutive rows into a batch. Packing once keeps ``len(loader)`` fixed across
epochs; the documents that share a row do not interact (block-diagonal attention, per-document labels),
so only which rows share a step changes between epochs.

Data parallel (``world_size`` W > 1): rank r takes global batches r, r + W, r + 2W, ... of the epoch, and
every rank gets the same number of batches (the ranks step together). When the G global batches of an epoch
are not a multiple of W, ``remainder`` says what happens to the last ``G % W``:
- "train" (default): every rank gets ceil(G / W) batches; in the last round the ranks past the end get an
  empty batch (one row of padding, no loss token: it adds nothing to the loss, the loss-token count or the
  gradient), so every document is trained once an epoch;
- "drop": every rank gets floor(G / W) batches and the last ``G % W`` are not trained in that epoch (the
  behaviour before ``remainder`` existed, which checkpoints written then need). Rows reshuffle each epoch, so
  other documents are left out each time; ``rows_left_out`` counts them.

    52 rows, batch_size=5, W=2:  G = ceil(52 / 5) = 11 global batches
    train: 6 per rank; rank 0's 6th is batch 11 (rows 51-52 of this epoch's order), rank 1's an empty batch
    drop:  5 per rank, 10 trained; batch 11 is not: 2 rows per epoch left out

Resume: ``state_dict()`` = {"epoch", "position"}: position is the number of this rank's batches of that
epoch already handed out, so a loader restored from it yields exactly the batches that would have come next.
A position counts one rank's batches of W ranks, so another W refuses it (except at an epoch's start or end).
The state also keeps the dataset's ``digest`` (token ids, masks, boundaries): data edited since the checkpoint
that still packs into as many rows is refused (``DataChanged``) instead of resuming at other documents.
"""

from __future__ import annotations

import logging

import numpy as np

from .._words import counted
from .collate import PackedBatch, collate_rows
from .packing import pack_bfd


log = logging.getLogger("chronicals.data")
REMAINDERS = ("train", "drop")  # data parallel: what becomes of an epoch's last, incomplete round of batches


class DataChanged(ValueError):
    """The saved loader's dataset had other contents (its digest differs) although it packed the same.
    ``args[1]``: what differs, without the advice (a caller names its own settings)."""


class LoaderMismatch(ValueError):
    """The saved loader packed other rows or batches, or had another seed: its position would index other batches.
    ``args[1]``: what differs, without the advice (the trainer names its own settings, not this class's
    arguments)."""


class PackedLoader:
    """Iterate PackedBatch over a TokenizedDataset (see the package docstring for the options)."""

    def __init__(self, dataset, *, batch_size: int | None = None, max_seq_len: int,
                 tokens_per_batch: int | None = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, pad_to_multiple_of: int = 1,
                 remainder: str = "train"):
        if (batch_size is None) == (tokens_per_batch is None):
            raise ValueError("PackedLoader: give exactly one of batch_size (rows of max_seq_len per batch) "
                             "or tokens_per_batch (one padding-free row per batch)")
        if batch_size is not None and batch_size < 1:  # 0 divided by zero, -1 made len() negative
            raise ValueError(f"PackedLoader: batch_size={batch_size}; expected an integer >= 1")
        if remainder not in REMAINDERS:
            raise ValueError(f"PackedLoader: remainder={remainder!r}; expected one of {', '.join(REMAINDERS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"PackedLoader: rank={rank} must be in 0..world_size-1 (world_size={world_size})")
        longest = int(dataset.lengths.max()) if len(dataset) else 0
        if longest > max_seq_len:
            raise ValueError(f"PackedLoader: a document has {longest} tokens > max_seq_len={max_seq_len}; "
                             "load the dataset with the same max_seq_len (it truncates or drops longer ones)")
        capacity = max_seq_len if tokens_per_batch is None else tokens_per_batch
        if capacity < max_seq_len:
            raise ValueError(f"PackedLoader: tokens_per_batch={tokens_per_batch} < max_seq_len={max_seq_len}; "
                             "a step must hold the longest document")
        self.dataset, self.batch_size, self.max_seq_len = dataset, batch_size, max_seq_len
        self.tokens_per_batch, self.seed, self.shuffle = tokens_per_batch, seed, shuffle
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.pad_to_multiple_of, self.remainder = pad_to_multiple_of, remainder
        if pad_to_multiple_of < 1:
            raise ValueError(f"PackedLoader: pad_to_multiple_of={pad_to_multiple_of}; expected an integer >= 1")
        self.rows = pack_bfd(dataset.lengths.tolist(), capacity)  # list of document index lists
        self.epoch, self.position = 0, 0
        self._cut: tuple[int, int] | None = None  # (epoch, global batches it trains): ``cut_epoch``
        if len(self) == 0:  # an epoch of no batches would make every `for` over the loader end at once
            # fewer global batches than ranks under "drop": "train" would run them (the other ranks empty)
            train_them = (" or remainder='train' (data.dp_remainder=train: the ranks past the last batch run an "
                          "empty one)") if remainder == "drop" and self._global_batches() else ""
            raise ValueError(f"PackedLoader: {counted(len(dataset), 'document')} pack{'s' * (len(dataset) == 1)} into "
                             f"{counted(len(self.rows), 'row')}, which give{'s' * (len(self.rows) == 1)} "
                             f"no batch per rank (batch_size={batch_size}, drop_last={drop_last}, "
                             f"world_size={world_size}, remainder={remainder!r}); use more data, a smaller "
                             f"batch_size, fewer ranks{train_them}")

    # ---- sizes ----
    def _global_batches(self) -> int:
        n = len(self.rows)
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        """Batches per epoch for this rank (every rank gets the same count; see ``remainder``)."""
        return self._per_rank(self.world_size, self.remainder)

    def _per_rank(self, world_size: int, remainder: str) -> int:
        """Batches per epoch for each of ``world_size`` ranks under ``remainder``."""
        g = self._global_batches()
        return -(-g // world_size) if remainder == "train" else g // world_size

    @property
    def rows_left_out(self) -> int:
        """Packed rows per epoch (all ranks) in no batch: with remainder="drop" the last ``G % world_size``
        global batches; the short last batch under drop_last. Different rows each epoch when shuffled."""
        g = self._global_batches()
        trained = g if self.remainder == "train" else g // self.world_size * self.world_size
        return len(self.rows) - min(len(self.rows), trained * (self.batch_size or 1))

    @property
    def trained_global_batches(self) -> int:
        """Global batches an epoch trains (all ranks): every one under remainder="train", whole rounds under "drop"."""
        return self._global_batches() if self.remainder == "train" else len(self) * self.world_size

    def cut_epoch(self, epoch: int | None, global_batches: int = 0) -> None:
        """Train only the first ``global_batches`` global batches of epoch ``epoch`` (the last pass of a fractional
        train.epochs); None: no cut. A rank's batch past them is an empty one, as in the last round of
        remainder="train", so W ranks train exactly the batches one process with grad_accum x W does: 0.2 epochs
        of 5 global batches is 1 batch, where whole rounds of 2 ranks trained 2 (a data-parallel walk). The rank's
        batch count (``len``) and positions are unchanged; the trainer sets the cut from train.epochs."""
        self._cut = None if epoch is None else (int(epoch), int(global_batches))

    @property
    def empty_batches(self) -> int:
        """Empty batches per epoch (all ranks): the last round's ranks past the end, with remainder="train"."""
        return len(self) * self.world_size - self._global_batches() if self.remainder == "train" else 0

    # ---- order ----
    def _row_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def _batch(self, order: np.ndarray, g: int) -> PackedBatch:
        ds = self.dataset
        if self.batch_size is None:
            docs = [ds[i] for i in self.rows[order[g]]]
            n = sum(len(d[0]) for d in docs)
            m = self.pad_to_multiple_of
            return collate_rows([docs], -(-n // m) * m, ds.pad_id)
        rows = order[g * self.batch_size:(g + 1) * self.batch_size]
        return collate_rows([[ds[i] for i in self.rows[r]] for r in rows], self.max_seq_len, ds.pad_id)

    def _empty_batch(self) -> PackedBatch:
        """One row of padding, no loss token: a rank's share of a last round that has no batch for it. As wide as
        the other ranks' batches: rows mode's are max_seq_len (pad_to_multiple_of is token-budget mode's: it made
        this one wider, a second shape for a CUDA graph; a property walk)."""
        m = self.pad_to_multiple_of if self.batch_size is None else 1
        return collate_rows([[]], -(-self.max_seq_len // m) * m, self.dataset.pad_id)

    def __iter__(self):
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._row_order(self.epoch)
        n = self._global_batches()
        if self._cut is not None and self._cut[0] == self.epoch:
            n = min(n, self._cut[1])
        while self.position < len(self):
            g = self.position * self.world_size + self.rank
            self.position += 1  # counted when handed out: a checkpoint taken now resumes after this batch
            yield self._batch(order, g) if g < n else self._empty_batch()
        self.epoch, self.position = self.epoch + 1, 0

    # ---- resume ----
    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "batches_per_epoch": len(self), "rows": len(self.rows), "remainder": self.remainder,
                "world_size": self.world_size, **self._digest_state(),
                **({"cut": list(self._cut)} if self._cut is not None else {})}

    def _digest_state(self) -> dict:
        digest = getattr(self.dataset, "digest", None)  # a dataset-like object without one: no check
        return {"data_digest": digest} if isinstance(digest, str) else {}

    def load_state_dict(self, state: dict) -> None:
        saved = (state.get("seed", self.seed), state.get("rows", len(self.rows)),
                 state.get("batches_per_epoch", len(self)))
        saved_w = state.get("world_size")  # absent in checkpoints from before it was saved
        other_w = isinstance(saved_w, int) and saved_w != self.world_size
        resume_w = f"torchrun --nproc-per-node {saved_w}" + ("" if saved_w != 1 else " or plain chronicals train")
        other_ranks = (f" (the saved loader ran on {saved_w} data-parallel rank(s), this one on {self.world_size}: "
                       f"resume with {resume_w})") if other_w else ""
        # per-rank batches follow the rank count: under another one, the saved count is checked for this data
        # under the saved count of ranks (an epoch's end resumes on any number of ranks; it was refused as a change)
        here = self._per_rank(saved_w, state.get("remainder", self.remainder)) if other_w else len(self)
        if saved != (self.seed, len(self.rows), here):  # else "position" would index other batches
            g, w = self._global_batches(), self.world_size
            if "remainder" not in state and self.remainder == "train" and saved[:2] == (self.seed, len(self.rows)) \
                    and saved[2] == self._per_rank(w, "drop") != len(self):
                raise ValueError(f"PackedLoader.load_state_dict: the saved loader, from before the remainder "
                                 f"setting, left the last {g % w} of {g} global batches out of each epoch "
                                 f"({saved[2]} per rank), this one trains them ({len(self)} per rank); resume it "
                                 "with remainder='drop' (data.dp_remainder=drop)")
            detail = (f"the saved loader had seed={saved[0]}, {counted(saved[1], 'packed row')} and "
                      f"{counted(saved[2], 'batch', 'batches')} per epoch, this one seed={self.seed}, {len(self.rows)} "
                      f"and {len(self)}")
            raise LoaderMismatch(f"PackedLoader.load_state_dict: {detail}; resume with the same dataset, max_seq_len, "
                                 f"batch settings (batch_size, drop_last, world_size) and seed{other_ranks}",
                                 detail + other_ranks)
        if "shuffle" in state and bool(state["shuffle"]) != self.shuffle:  # the same counts, another row order
            detail = (f"the saved loader {'shuffled' if state['shuffle'] else 'kept'} its rows' order, this one "
                      f"{'shuffles' if self.shuffle else 'keeps'} it")
            raise LoaderMismatch(f"PackedLoader.load_state_dict: {detail}; its position would index other batches: "
                                 f"resume with shuffle={bool(state['shuffle'])}", detail)
        # rank r's position p means global batches up to p * W: under another W it names other batches even when
        # the counts agree (4 global batches: 2 per rank on 2 and on 3 ranks; the 2-rank position 1 resumed on 3
        # ranks at batch 3, skipping batch 2). An epoch's start or end is the same place under any W.
        if other_w and state.get("position") not in (0, saved[2]):
            raise ValueError(f"PackedLoader.load_state_dict: the saved loader ran on {saved_w} data-parallel "
                             f"rank(s), this one on {self.world_size}; its position (batch {state.get('position')} "
                             f"of {saved[2]} per rank in epoch {state.get('epoch')}) counts the batches of "
                             f"{saved_w} rank(s) and would skip or repeat data under {self.world_size}; resume with "
                             f"{resume_w}")
        saved_digest, digest = state.get("data_digest"), self._digest_state().get("data_digest")
        if saved_digest is None:
            log.info("the saved data position has no digest of its dataset (a checkpoint from before it was "
                     "saved): the training data are not checked against it")
        elif digest is not None and saved_digest != digest:  # the same counts, other documents
            detail = (f"its dataset had other contents (digest {saved_digest}, this one {digest}) although both "
                      f"pack into {counted(len(self.rows), 'row')}, so its position (batch {state.get('position')} "
                      f"of epoch {state.get('epoch')}) would point at other documents")
            raise DataChanged(f"PackedLoader.load_state_dict: the training data changed since the saved loader's "
                              f"state was written: {detail}; resume with the original data, or start fresh", detail)
        for key in ("epoch", "position"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(f"PackedLoader.load_state_dict: the state has no '{key}' (a non-negative integer): "
                                 f"{key}={state.get(key)!r}; resume from a checkpoint this loader wrote")
        as_saved = state  # its position counts the saving loader's batches (the cut warning's arithmetic)
        if other_w and state["position"] == saved[2]:  # the saved epoch's end: this loader's own end of it
            state = {**state, "position": len(self)}
        if state["position"] > len(self):  # else the position is ignored and the rest of that epoch is skipped
            raise ValueError(f"PackedLoader.load_state_dict: position={state['position']} is not in 0..{len(self)} "
                             "(this loader's batches per epoch); resume from a checkpoint this loader wrote")
        self._warn_cut_skipped(as_saved)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _warn_cut_skipped(self, state: dict) -> None:
        """A run cut short in its epoch (``cut_epoch``: a fractional train.epochs under data parallelism) handed
        empty batches to the ranks past the cut in its last round; resumed on without that cut (more epochs), those
        global batches of that epoch are not trained: said, with the numbers. ``state``: as saved (its position in
        the saving loader's batches, which times its ranks is the global batches handed out)."""
        cut = state.get("cut")
        if not (isinstance(cut, list) and len(cut) == 2 and cut[0] == state["epoch"]) or tuple(cut) == self._cut:
            return
        handed = min(state["position"] * state.get("world_size", self.world_size), self._global_batches())
        if handed > cut[1]:
            log.warning("the saved loader trained %d of epoch %d's first %d global batches (its run's fractional "
                        "train.epochs ended in that round of ranks); this run goes on from batch %d, so global "
                        "batches %d..%d of that epoch are not trained in it", cut[1], cut[0], handed, handed + 1,
                        cut[1] + 1, handed)

    # ---- stats ----
    @property
    def stats(self) -> dict:
        """Per epoch (all ranks): loss tokens / slots is the packing efficiency."""
        ds, n_rows = self.dataset, len(self.rows)
        if self.batch_size is None:
            m = self.pad_to_multiple_of
            slots = sum(-(-int(ds.lengths[r].sum()) // m) * m for r in self.rows)
        else:
            slots = n_rows * self.max_seq_len
        return {"documents": len(ds), "rows": n_rows, "batches_per_epoch": len(self), "tokens": ds.stats.tokens,
                "loss_tokens": ds.stats.loss_tokens, "slots": slots,
                "efficiency": ds.stats.loss_tokens / max(slots, 1), "fill": ds.stats.tokens / max(slots, 1),
                "truncated": ds.stats.truncated, "dropped_overlong": ds.stats.dropped_overlong,
                "dropped_no_loss": ds.stats.dropped_no_loss, "skipped_errors": ds.stats.skipped_errors}
