"""``load_dataset``: files -> records -> examples -> token ids + trainable masks, cached on disk.

A ``TokenizedDataset`` keeps every document in three flat arrays (one allocation, memory-mappable):
ids (T,) int32, trainable (T,) bool, offsets (n + 1,) int64; document i is ids[offsets[i]:offsets[i+1]].

Here: ``DatasetStats``, ``TokenizedDataset``, ``load_dataset``, a cache entry read back, and the fold of encoded
records into the arrays. The records are encoded in workers.py; what the data lost is said by reporting.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .._numbers import is_int
from .._words import counted
from . import cache as cache_mod
from .chat_template import has_generation_markers
from .formats import FORMATS
from .readers import DataError
from .files import resolve_files
from .reporting import (_file_formats, _finish, _note_alpaca_prompt, _summary_line, _warn_across, _warn_mixed,
                        _warn_no_eos, _warn_unclosed)
from .tokenize import appends_eos, check_tokenizer, turn_end_ids
from .workers import _encoded

log = logging.getLogger("chronicals.data")
PARALLEL_BYTES = 8 << 20  # data files below this (~25,000 short chats) tokenize in one process: worker start-up
# (~1 s) costs more than it saves
SAY_READING_BYTES = 256 << 20  # data files this large get a line before they are hashed and read (~18 s)
# the load_dataset options its messages advise on; a caller whose users set them under other names passes those
OPTIONS = ("format", "max_seq_len", "loss_on", "on_error", "overlong", "num_proc")


@dataclass
class DatasetStats:
    records: int = 0  # records read (including bad ones)
    documents: int = 0  # kept
    skipped_errors: int = 0  # bad records skipped (on_error="skip")
    truncated: int = 0  # longer than max_seq_len, cut to it (overlong="truncate")
    truncated_tokens: int = 0  # tokens cut off the kept truncated examples; 0 in older caches
    dropped_overlong: int = 0  # longer than max_seq_len, dropped (overlong="drop")
    split: int = 0  # longer than max_seq_len, cut into documents of max_seq_len (overlong="split"); 0 in older caches
    split_pieces: int = 0  # the documents those became (a piece without a target is left out)
    split_left_tokens: int = 0  # tokens of the pieces left out (a chat's prompt-only pieces); 0 in older caches
    dropped_no_loss: int = 0  # no trainable token left (no assistant turn, or truncated away)
    truncated_no_loss: int = 0  # of those, truncation cut every loss token (also counted in truncated)
    first_no_loss: str = ""  # "file:line" of the first dropped with no loss token that truncation did not cause
    first_truncated_no_loss: str = ""  # "file:line" of the first truncation cut to no loss token; "" in older caches
    empty_no_loss: int = 0  # of those, the text that would carry loss is blank (e.g. {"text": " "}); 0 in older caches
    empty_targets: int = 0  # kept, but the reply / output / completion is blank: only end-of-turn has loss
    first_empty_target: str = ""  # "file:line" of the first of those
    replies: int = 0  # runs of loss tokens in kept chat examples: one per reply as a rule (loss_on="all": examples
    # that end in a reply)
    unclosed_replies: int = 0  # of those, the ones no trained special token closes: the model never learns to stop
    unclosed_examples: int = 0  # kept chat examples with at least one (before truncation)
    first_unclosed: str = ""  # "file:line" of the first of those
    across_boundary: int = 0  # prompt/completion examples whose boundary falls inside a token (tokenize.encode)
    first_across: str = ""  # "file:line" of the first of those
    tokens: int = 0
    loss_tokens: int = 0  # positions with a target, after the per-document shift
    first_errors: list[str] = field(default_factory=list)  # up to 10 "file:line: ..." messages

    def losses(self, max_seq_len_name: str = "data.max_seq_len") -> list[str]:
        """What the data lost on the way in, for a summary line: ["2 bad records skipped", "1 truncated to
        data.max_seq_len", ...], the counts that are not 0 (``max_seq_len_name``: the option as the user set it)."""
        # an example truncated to no loss token is dropped: counted once, with the dropped (it was in both counts)
        cut = self.truncated_no_loss
        counts = ((self.skipped_errors, "bad record skipped", "bad records skipped"),
                  (self.truncated - cut, f"truncated to {max_seq_len_name}", None),
                  (self.dropped_overlong, "dropped as too long", None),
                  # why there are more examples than records ("5 examples of 3 records" said nothing of it: a walk)
                  (self.split, f"split into {counted(self.split_pieces, 'piece')} of {max_seq_len_name}", None),
                  (self.dropped_no_loss, "dropped with no loss tokens" + (f" ({cut} of them truncated to none)"
                                                                          if cut else ""), None),
                  (self.empty_targets, "with an empty reply", None),
                  (self.unclosed_replies, "reply that trains no end-of-turn token",
                   "replies that train no end-of-turn token"))
        return [f"{n} {one if n == 1 or many is None else many}" for n, one, many in counts if n]


class TokenizedDataset:
    """Documents as flat arrays. ``ds[i]`` -> (ids (L,) int32, trainable (L,) bool)."""

    def __init__(self, ids: np.ndarray, trainable: np.ndarray, offsets: np.ndarray, pad_id: int,
                 stats: DatasetStats, max_seq_len: int):
        self.ids, self.trainable, self.offsets = ids, trainable, offsets
        self.pad_id, self.stats, self.max_seq_len = pad_id, stats, max_seq_len
        self.lengths = np.diff(offsets)  # (n,) int64
        self.summary = ""  # "the training set: 2 files (...), 120 records; format auto -> chat" (logged)
        self.file_counts: list[int] = []  # records per file read
        self.file_formats: list[str] = []  # the format of each file's records

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def digest(self) -> str:
        """A fingerprint of the documents (token ids, trainable masks, boundaries), computed once: a loader saves
        it so that resuming over edited data that packs into as many rows is refused (its position would point
        at other documents). sha256 over the arrays' bytes: about 0.4 s for 100M tokens."""
        if getattr(self, "_digest", None) is None:
            h = hashlib.sha256()
            for a in (np.ascontiguousarray(self.ids, dtype=np.int32),
                      np.packbits(np.asarray(self.trainable, dtype=bool)),
                      np.ascontiguousarray(self.offsets, dtype=np.int64)):
                h.update(len(a).to_bytes(8, "little"))
                h.update(memoryview(a).cast("B"))
            self._digest = h.hexdigest()[:32]
        return self._digest

    def __getitem__(self, i: int):
        n = len(self.offsets) - 1
        if not -n <= i < n:
            raise IndexError(f"document {i} of a dataset of {n}")
        i %= n  # ds[-1]: the last document, as for a list
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.trainable[a:b]


def load_dataset(paths, tokenizer, *, format: str = "auto", max_seq_len: int, loss_on: str = "assistant",
                 on_error: str = "fail", overlong: str = "truncate", cache_dir=None,
                 num_proc: int | None = None, name: str = "the dataset",
                 option_names: dict[str, str] | None = None) -> TokenizedDataset:
    """Read, format and tokenize ``paths``; see the package docstring for every option.

    ``name`` says which set this is in the errors that concern the whole set, e.g. "the held-out set".
    ``option_names``: what the errors and warnings call the options they advise on (keys from ``OPTIONS``), for a
    caller whose users set them elsewhere: the trainer passes its config keys, ``{"overlong": "data.on_long", ...}``
    ("raise data.max_seq_len or set data.on_long=truncate"); by default the parameter names.
    """
    unknown = set(option_names or {}) - set(OPTIONS)
    if unknown:
        raise ValueError(f"option_names: unknown option(s) {sorted(unknown)}; expected keys from {OPTIONS}")
    names = {k: k for k in OPTIONS} | (option_names or {})
    if format not in ("auto",) + FORMATS:
        raise ValueError(f"format={format!r}; expected one of {('auto',) + FORMATS}")
    for key, value, allowed in (("loss_on", loss_on, ("assistant", "all")), ("on_error", on_error, ("fail", "skip")),
                                 ("overlong", overlong, ("truncate", "drop", "split"))):
        if value not in allowed:
            raise ValueError(f"{key}={value!r}; expected one of {allowed}")
    if max_seq_len < 2:
        raise ValueError(f"{names['max_seq_len']}={max_seq_len}; expected >= 2 (a document needs a token and a target)")
    check_tokenizer(tokenizer)
    files = resolve_files(paths)
    size = sum(f.stat().st_size for f in files)
    if size >= SAY_READING_BYTES:  # the hashing and reading below take ~4.5 s per 65 MB, before any bar
        log.info("reading %s (%.1f GB in %d file%s)", name, size / 1e9, len(files), "s"[:len(files) != 1])
    # the cache key also holds a digest of the encoding code (cache.encoder_digest): other code, another entry
    settings = {"format": format, "max_seq_len": max_seq_len, "loss_on": loss_on, "overlong": overlong}
    cache = None
    if cache_dir is not None:
        cache = cache_mod.cache_root(cache_dir) / cache_mod.cache_key(files, tokenizer, settings)
        if cache.exists():
            try:
                ds = _from_cache(cache, max_seq_len, files)
            except cache_mod.CacheError as e:
                log.warning("tokenization cache entry %s is damaged (%s); rebuilding it", cache, e)
            else:
                log.info("loaded %d documents from cache %s", len(ds), cache)
                # the entry is keyed by content: the line is rebuilt with this run's file names and set name
                ds.summary = _summary_line(name, files, ds.file_counts, ds.file_formats, format)
                if ds.summary:
                    log.info("%s", ds.summary)
                _note_alpaca_prompt(ds.file_formats, tokenizer, name)
                _warn_mixed(files, ds.file_formats, names["format"])
                _finish(ds.stats, on_error, max_seq_len, names, files, name)
                _warn_unclosed(ds.stats, tokenizer, names, files, name, loss_on)  # the entry's stats: every run says it
                _warn_across(ds.stats, files, name)
                _warn_no_eos(ds.file_formats, tokenizer, files, name)
                return ds
    try:
        ds, fmts, counts, reached = _tokenize(files, tokenizer, format, max_seq_len, loss_on, overlong, on_error,
                                              num_proc, size)
    except BrokenProcessPool:  # a worker killed (the OOM killer, a SIGKILL): the pool cannot finish the set
        raise DataError(f"a tokenizer worker process died while tokenizing {name} (killed by the system, out of "
                        f"memory?); each holds its share of the records: set {names['num_proc']}=1 (or 2), or split "
                        "the data, and run again") from None
    ds.file_counts = counts
    ds.file_formats = _file_formats(files, counts, fmts, names["format"], reached)
    ds.summary = _summary_line(name, files, ds.file_counts, ds.file_formats, format)
    log.info("%s", ds.summary)
    _note_alpaca_prompt(ds.file_formats, tokenizer, name)
    _finish(ds.stats, on_error, max_seq_len, names, files, name)
    _warn_unclosed(ds.stats, tokenizer, names, files, name, loss_on)
    _warn_across(ds.stats, files, name)
    _warn_no_eos(ds.file_formats, tokenizer, files, name)
    if cache is not None:
        cache_mod.save(cache, ds.ids, ds.trainable, ds.offsets,
                       {"pad_id": ds.pad_id, "stats": asdict(ds.stats), "file_counts": ds.file_counts,
                        "file_formats": ds.file_formats, "files": [str(f) for f in files], "digest": ds.digest,
                        "source": cache_mod.source_key(files, tokenizer, settings)})
    return ds


def _renamed(stats: DatasetStats, written: list | None, files: list[Path]) -> None:
    """A cache entry is keyed by the files' contents: moved or renamed files hit the entry their old names wrote.
    Its "file:line" strings (first_errors, first_no_loss, ...) are put under this run's names, file by file."""
    if not isinstance(written, list) or len(written) != len(files):
        return
    moves = [(f"{old}:", f"{new}:") for old, new in zip(written, map(str, files)) if old != new]
    if not moves:
        return

    def fix(text: str) -> str:
        for old, new in moves:
            if text.startswith(old):
                return new + text[len(old):]
        return text

    map_stat_texts(stats, fix)


def map_stat_texts(stats: DatasetStats, fix) -> None:
    """Put each text of ``stats`` (its "file:line" strings: first_errors, first_no_loss, ...) through ``fix``, in
    place."""
    for f in fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, str):
            setattr(stats, f.name, fix(value))
        elif isinstance(value, list):
            setattr(stats, f.name, [fix(v) if isinstance(v, str) else v for v in value])



def _from_cache(path: Path, max_seq_len: int, files: list[Path]) -> TokenizedDataset:
    ids, trainable, offsets, meta = cache_mod.load(path)
    try:
        stats = DatasetStats(**meta["stats"])
    except TypeError as e:
        raise cache_mod.CacheError(f"meta.json: stats do not match this version ({e})") from None
    _renamed(stats, meta.get("files"), files)
    ds = TokenizedDataset(ids, trainable, offsets, meta["pad_id"], stats, max_seq_len)
    # the arrays' bytes against the digest written with them (entries before it have none): a damaged array of the
    # right shape and dtype (zeroed masks trained a step with 0 loss tokens) is rebuilt, not trained on. Not
    # extra work: the loader's checkpoint state needs the digest anyway (about 0.4 s per 100M tokens)
    if "digest" in meta and ds.digest != meta["digest"]:
        raise cache_mod.CacheError("the arrays do not match the digest written with them (damaged since)")
    counts, descs = meta.get("file_counts"), meta.get("file_formats")
    if isinstance(counts, list) and not all(is_int(n) for n in counts):
        raise cache_mod.CacheError(f"meta.json: file_counts is {counts!r}, not whole numbers")  # int("x") raised bare
    ds.file_counts = list(counts) if isinstance(counts, list) else []
    ds.file_formats = [str(d) for d in descs] if isinstance(descs, list) else []
    return ds


# ---- tokenization (serial or in worker processes) ----

class _Fold:
    """The kept documents and the stats, one encoded record at a time; ids and masks joined per chunk."""

    def __init__(self, max_seq_len: int, overlong: str, loss_on: str, on_error: str):
        self.max_seq_len, self.overlong, self.loss_on, self.on_error = max_seq_len, overlong, loss_on, on_error
        self.stats = DatasetStats()
        self.ids, self.masks, self.lengths, self.fmts = [], [], [], []

    def add(self, records, results) -> bool:
        """Fold one chunk in; False: on_error=fail met a bad record (stop reading)."""
        stats, max_seq_len = self.stats, self.max_seq_len
        ids_list, mask_list = [], []
        go_on = True
        for rec, (ids, mask, fmt, empty, (runs, unclosed, across)) in zip(records, results):
            stats.records += 1
            self.fmts.append(fmt)
            if ids is None:
                stats.skipped_errors += 1
                if len(stats.first_errors) < 10:
                    stats.first_errors.append(mask)
                if self.on_error == "fail":
                    go_on = False
                    break
                continue
            if empty and fmt == "text":  # blank text ({"text": "   "}): it trained its eos alone, with a warning about
                # empty replies, where {"text": ""} was dropped; dropped and counted as that one (a user walk)
                stats.dropped_no_loss += 1
                stats.empty_no_loss += 1
                stats.first_no_loss = stats.first_no_loss or rec.where
                continue
            cut = len(ids) > max_seq_len
            pieces, split = None, cut and self.overlong == "split"
            if split:  # rows of max_seq_len, each its own document; a piece with no target (a chat's prompt
                # alone, a last single token) trains nothing and is left out
                pieces = [(ids[k:k + max_seq_len], mask[k:k + max_seq_len]) for k in range(0, len(ids), max_seq_len)]
                pieces = [(a, m) for a, m in pieces if m[1:].any()]
                cut = False
            elif cut:
                if self.overlong == "drop":
                    stats.dropped_overlong += 1
                    continue
                cut_tokens = len(ids) - max_seq_len
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                stats.truncated += 1
            if pieces is None:
                pieces = [(ids, mask)]
            n_loss = sum(int(m[1:].sum()) for _, m in pieces)  # the first token of a document is never a target
            if n_loss == 0:
                stats.dropped_no_loss += 1
                stats.truncated_no_loss += cut
                if cut:
                    stats.first_truncated_no_loss = stats.first_truncated_no_loss or rec.where
                else:
                    stats.first_no_loss = stats.first_no_loss or rec.where
                    stats.empty_no_loss += empty
                continue
            if empty and self.loss_on == "assistant":
                stats.empty_targets += 1
                stats.first_empty_target = stats.first_empty_target or rec.where
            stats.replies += runs  # counted before truncation: a reply cut off at max_seq_len is reported as truncated
            if unclosed:
                stats.unclosed_replies += unclosed
                stats.unclosed_examples += 1
                stats.first_unclosed = stats.first_unclosed or rec.where
            if across:
                stats.across_boundary += 1
                stats.first_across = stats.first_across or rec.where
            if cut:
                stats.truncated_tokens += cut_tokens
            if split:  # also when one piece is left: the tokens of the others are said, as truncation's are
                stats.split += 1
                stats.split_pieces += len(pieces)
                stats.split_left_tokens += len(ids) - sum(len(a) for a, _ in pieces)
            for a, m in pieces:
                ids_list.append(a)
                mask_list.append(m)
                self.lengths.append(len(a))
            stats.loss_tokens += n_loss
        if ids_list:  # one array per chunk: per-record arrays cost ~100 bytes each beyond their tokens
            self.ids.append(np.concatenate(ids_list).astype(np.int32, copy=False))
            self.masks.append(np.concatenate(mask_list))
        return go_on


def _tokenize(files, tokenizer, format, max_seq_len, loss_on, overlong, on_error, num_proc,
              size: int) -> tuple[TokenizedDataset, list, list[int], int]:
    """-> (dataset, each read record's format (None: bad), records read per file, files reached): under
    on_error=fail the reading stops at the first bad record, and the files after it are not reached. ``size``:
    the files' bytes (num_proc None: one process below PARALLEL_BYTES)."""
    opts = {"format": format, "loss_on": loss_on, "markers": has_generation_markers(tokenizer),
            "own_eos": appends_eos(tokenizer), "end_ids": turn_end_ids(tokenizer),
            "has_template": getattr(tokenizer, "chat_template", None) is not None}
    if num_proc is None:
        num_proc = 1 if size < PARALLEL_BYTES else min(8, os.cpu_count() or 1)
    if num_proc > 1:
        log.info("tokenizing in %d processes", num_proc)
    # drawn once tokenizing has taken 2 s, whatever the record count (19,999 long records ran a minute unseen)
    bar = tqdm(desc="tokenizing", unit="ex", delay=2)
    fold, counts, reached = _Fold(max_seq_len, overlong, loss_on, on_error), [0] * len(files), 0
    try:
        for (i, records), results in _encoded(files, num_proc, tokenizer, opts):
            reached = i + 1
            counts[i] += len(records)
            bar.update(len(records))
            if not fold.add(records, results):
                break
        else:
            reached = len(files)
    finally:
        bar.close()
    stats = fold.stats
    offsets = np.zeros(len(fold.lengths) + 1, dtype=np.int64)
    np.cumsum(fold.lengths, out=offsets[1:])
    stats.documents, stats.tokens = len(fold.lengths), int(offsets[-1])
    ids = np.concatenate(fold.ids) if fold.ids else np.zeros(0, np.int32)
    mask = np.concatenate(fold.masks) if fold.masks else np.zeros(0, bool)
    ds = TokenizedDataset(ids.astype(np.int32, copy=False), mask, offsets, _pad_id(tokenizer), stats, max_seq_len)
    return ds, fold.fmts, counts, reached


def _pad_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0  # padding is never attended by real tokens nor a target: any id works
