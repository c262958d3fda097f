"""``load_dataset``: files -> records -> examples -> token ids + trainable masks, cached on disk.

A ``TokenizedDataset`` keeps every document in three flat arrays (one allocation, memory-mappable):
ids (T,) int32, trainable (T,) bool, offsets (n + 1,) int64; document i is ids[offsets[i]:offsets[i+1]].
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, fields
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .._numbers import is_int
from .._words import counted
from . import cache as cache_mod
from .formats import FORMATS, FormatError, detect_format, empty_target, to_example
from .readers import DataError, Record, iter_records, resolve_files
from .tokenize import (appends_eos, check_tokenizer, encode, has_generation_markers, turn_end_ids,
                       unclosed_last_reply, unclosed_replies)

log = logging.getLogger("chronicals.data")
PARALLEL_BYTES = 8 << 20  # data files below this (~25,000 short chats) tokenize in one process: worker start-up
# (~1 s) costs more than it saves
CHUNK = 1_000
SAY_READING_BYTES = 256 << 20  # data files this large get a line before they are hashed and read (~18 s)
# the load_dataset options its messages advise on; a caller whose users set them under other names passes those
OPTIONS = ("format", "max_seq_len", "loss_on", "on_error", "overlong", "num_proc")
LOST_TOKENS_WARN = 0.1  # truncation that cuts this share of the data's tokens is a warning, not an info line


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
    empty_no_loss: int = 0  # of those, the text that would carry loss is empty (e.g. {"text": ""}); 0 in older caches
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


def _note_alpaca_prompt(descs: list[str], tokenizer, name: str) -> None:
    """Once per set: alpaca records without a chat template use the classic Alpaca prompt (formats.ALPACA_PROMPT)."""
    if getattr(tokenizer, "chat_template", None) is None and any("alpaca" in d for d in descs):
        log.info("%s: the tokenizer has no chat template, so alpaca records use the classic Alpaca prompt "
                 "('Below is an instruction ... ### Response:'); give the tokenizer a chat template to train them "
                 "as a chat", name)


def _file_formats(files, counts: list[int], fmts: list, format_name: str = "format",
                  reached: int | None = None) -> list[str]:
    """Per file, the format of its records ("chat", "mixed: 3 chat, 1 text", "no readable records"). A file
    whose records have different formats gets a warning: often a typo'd field read as another format. Files from
    index ``reached`` on were not read (on_error=fail stopped at a bad record in an earlier one)."""
    out, at = [], 0
    for index, (f, n) in enumerate(zip(files, counts)):
        c = Counter(x for x in fmts[at:at + n] if x)
        unread = reached is not None and index >= reached
        at += n
        desc = next(iter(c)) if len(c) == 1 else "mixed: " + ", ".join(f"{n} {k}" for k, n in c.most_common())
        desc = desc if c else "not read (stopped at a bad record before it)" if unread else "no readable records"
        out.append(desc)
    _warn_mixed(files, out, format_name)
    return out


def _warn_mixed(files, descs: list[str], format_name: str) -> None:
    """A file whose records have different formats (``descs``: _file_formats'), said on every load (a cache hit
    said nothing)."""
    for f, desc in zip(files, descs):
        if desc.startswith("mixed: "):
            log.warning("%s mixes record formats (%s); each record is read in the format its fields say: "
                        "check that is intended (%s=FORMAT insists on one)", f, desc.removeprefix("mixed: "),
                        format_name)


def _summary_line(name: str, files, counts: list[int], descs: list[str], format: str) -> str:
    """One line: which files were read and the format of their records (per file when auto detected); ""
    when the per-file facts are missing or do not fit ``files`` (a cache entry from before they were kept)."""
    if not counts or len(counts) != len(files) or len(descs) != len(files):
        return ""
    head = f"{name}: {counted(len(files), 'file')} ({_names(files)}), {counted(sum(counts), 'record')}"
    if format != "auto":
        return f"{head}; format {format}"
    kinds = set(descs)
    if len(kinds) == 1:
        return f"{head}; format auto -> {kinds.pop()}"
    per = [(Path(f).name, d) for f, d in zip(files, descs)]
    shown = "; ".join(f"{n}: {d}" for n, d in per[:8])
    if len(per) > 8:
        shown += f"; and {counted(len(per) - 8, 'more file')}"
    return f"{head}; format auto -> {shown}"


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


def _names(files) -> str:
    return ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _finish(stats: DatasetStats, on_error: str, max_seq_len: int, n: dict[str, str], files=(),
            name: str = "the dataset") -> None:
    """Raise or warn about what the data lost; ``n``: what to call each option (load_dataset's option_names)."""
    where = f"{name} ({_names(files)})" if files else name
    report_bad_records(stats.skipped_errors, stats.first_errors, on_error, stats.records, where, n["on_error"])
    if stats.documents == 0:
        if stats.records == 0:
            raise DataError(f"{name} is empty: no records in {_names(files) or 'the files'} (give data files "
                            "with at least one example)")
        if stats.dropped_overlong:
            raise DataError(f"every example was dropped: {stats.dropped_overlong} longer than "
                            f"{n['max_seq_len']}={max_seq_len} (raise {n['max_seq_len']} or set {n['overlong']}=truncate), "
                            f"{stats.dropped_no_loss} with no trainable token, {stats.skipped_errors} bad; in {where}")
        first = f" (first: {stats.first_no_loss})" if stats.first_no_loss else ""
        bad = counted(stats.skipped_errors, "bad record")
        if stats.empty_no_loss and stats.empty_no_loss == stats.dropped_no_loss:
            raise DataError(f"no example has a trainable token in {where}: all {stats.dropped_no_loss} have an "
                            f"empty text{first}, {bad}; fill in the text (or the "
                            "replies / outputs / completions) or remove those records")
        empty = f", {stats.empty_no_loss} of them with an empty text" if stats.empty_no_loss else ""
        if stats.truncated_no_loss:  # the cause is max_seq_len, not missing replies
            fix = f"before their replies start; raise {n['max_seq_len']} or shorten the prompts"
            if stats.truncated_no_loss == stats.dropped_no_loss:
                raise DataError(f"no example has a trainable token in {where}: {stats.dropped_no_loss} without one, "
                                f"all truncated to {n['max_seq_len']}={max_seq_len} {fix}; {bad}")
            empty += f", {stats.truncated_no_loss} of them truncated to {n['max_seq_len']}={max_seq_len} {fix}"
        raise DataError(f"no example has a trainable token in {where}: {stats.dropped_no_loss} without one{first}"
                        f"{empty}, {bad}; {n['loss_on']}=assistant needs assistant "
                        f"turns / outputs / completions (or set {n['loss_on']}=all)")
    if stats.empty_targets:
        log.warning("%d examples in %s have an empty assistant reply / output / completion (in a chat, one "
                    "of its replies or more): its turn trains the end-of-turn token alone, so the model learns to "
                    "answer with nothing (first: %s); fill them in or remove them",
                    stats.empty_targets, where, stats.first_empty_target)
    if stats.truncated or stats.dropped_overlong or stats.dropped_no_loss or stats.split:
        cut = stats.truncated - stats.truncated_no_loss
        # the share of the data's tokens truncation took: 966 long replies of 20,000 lost 81% of a set's tokens
        # while only their count was said, at INFO (a data walk at scale)
        lost = stats.truncated_tokens / max(1, stats.truncated_tokens + stats.tokens)
        tokens = (f"; {stats.truncated_tokens:,} of their tokens cut ({lost:.0%} of the data's)"
                  if stats.truncated_tokens else "")
        parts = [f"{cut} truncated to {n['max_seq_len']}={max_seq_len} (kept{tokens})"] if cut else []
        if lost >= LOST_TOKENS_WARN:
            parts[-1] += f": raise {n['max_seq_len']} to keep more of them, or set {n['overlong']}=split"
        if stats.truncated_no_loss:
            parts.append(f"{stats.truncated_no_loss} truncated to no loss tokens (dropped), their replies start past "
                         f"{n['max_seq_len']}={max_seq_len}: raise {n['max_seq_len']} or shorten the prompts")
        if stats.dropped_overlong:
            parts.append(f"{stats.dropped_overlong} longer than {n['max_seq_len']}={max_seq_len} (dropped, "
                         f"{n['overlong']}=drop)")
        if stats.split:
            left = (f"; {stats.split_left_tokens:,} tokens in pieces without a target left out"
                    if stats.split_left_tokens else "")
            parts.append(f"{stats.split} longer than {n['max_seq_len']}={max_seq_len} split into {stats.split_pieces} "
                         f"documents ({n['overlong']}=split{left})")
        if stats.dropped_no_loss - stats.truncated_no_loss:
            first = f"; first: {stats.first_no_loss}" if stats.first_no_loss else ""  # "" from an older cache
            parts.append(f"{stats.dropped_no_loss - stats.truncated_no_loss} without loss tokens (dropped: no "
                         f"assistant turn / output / completion, or empty text{first})")
        dropped = stats.dropped_no_loss or stats.dropped_overlong or lost >= LOST_TOKENS_WARN
        kept = stats.documents - stats.split_pieces + stats.split  # records: a split one is several documents
        log.log(logging.WARNING if dropped else logging.INFO, "%s: %d of %d records kept; %s", where,
                kept, stats.records, "; ".join(parts))


def _warn_unclosed(stats: DatasetStats, tokenizer, n: dict[str, str], files=(), name: str = "the dataset",
                   loss_on: str = "assistant") -> None:
    """One warning per set when replies train no end-of-turn token (``tokenize.unclosed_replies``): the model would
    learn to write replies but not to end them, and nothing else would say so. The counts come from the stats (a
    cache hit warns as the first run did); the template's source and the fix from this run's tokenizer."""
    if not stats.unclosed_replies:
        return
    where = f"{name} ({_names(files)})" if files else name
    source = getattr(tokenizer, "chronicals_source", None) or getattr(tokenizer, "name_or_path", None)
    template = f"the chat template of {source}" if source else "the tokenizer's chat template"
    if loss_on == "all":  # one count per conversation that ends in a reply (tokenize.unclosed_last_reply)
        counts = (f"{stats.unclosed_replies} of {stats.replies} conversations that end in an assistant reply (of "
                  f"{stats.documents} examples) end in no end-of-turn token, so with {n['loss_on']}=all the model "
                  f"learns to stop only after replies that another turn follows (first: {stats.first_unclosed})")
        why = (f"{template} writes nothing after a conversation's last reply (as GLM's does: a turn ends where the "
               "next one begins); end each assistant turn with a token generation stops at, e.g. "
               "{{ content + eos_token }}")
    else:
        counts = (f"{stats.unclosed_replies} of {stats.replies} assistant replies in {stats.unclosed_examples} of "
                  f"{stats.documents} examples train no end-of-turn token (first: {stats.first_unclosed}), so the "
                  "model never learns to stop after a reply")
        if has_generation_markers(tokenizer):
            why = (f"{template} closes its {{% generation %}} markers before the special token that ends the turn; "
                   "move {% endgeneration %} after that token (ChatML: {% generation %}{{ content + '<|im_end|>' }}"
                   f"{{% endgeneration %}}), or set {n['loss_on']}=all (loss on the prompts too)")
        else:
            why = (f"{template} closes no reply with a special token (a conversation that ends in a reply renders "
                   "ending in the reply's text, as GLM's does); end each assistant turn with a token generation stops "
                   "at, e.g. {{ content + eos_token }}, or mark the reply and that token with {% generation %} ... "
                   "{% endgeneration %}")
    log.warning("%s: %s: %s", where, counts, why)


def _warn_across(stats: DatasetStats, files=(), name: str = "the dataset") -> None:
    """One warning per set for prompt/completion examples whose boundary falls inside a token: its loss covers prompt
    text, and served the prompt alone (tokenized on its own) the model continues another token sequence."""
    if not stats.across_boundary:
        return
    where = f"{name} ({_names(files)})" if files else name
    log.warning("%s: %d of %d examples split prompt and completion inside a token (first: %s): that token, "
                "trained, holds the end of the prompt, and served the prompt alone the model sees it tokenized "
                "another way; split them between words, the space at the start of the completion (prompt "
                "'Name:', completion ' John Smith')", where, stats.across_boundary, stats.documents,
                stats.first_across)


def _warn_no_eos(descs: list[str], tokenizer, files=(), name: str = "the dataset") -> None:
    """One warning per set when its text / prompt_completion records (or alpaca ones without a chat template: the
    Alpaca prompt) get no end token: ``tokenize.encode`` appends the tokenizer's eos (or the tokenizer adds it), and
    this tokenizer has none, so the model would never learn to stop. Chat records end as their template says."""
    if tokenizer.eos_token:
        return
    plain = ["text", "prompt_completion"] + ([] if getattr(tokenizer, "chat_template", None) else ["alpaca"])
    found = sorted({f for d in descs for f in plain if f in d})
    if not found:
        return
    where = f"{name} ({_names(files)})" if files else name
    log.warning("%s: the tokenizer has no eos_token, so its %s records end with no end token and the model "
                "never learns to stop after one; set eos_token in the tokenizer's tokenizer_config.json (or "
                "tokenizer.eos_token = ... before training), or end each record's text with the token generation "
                "should stop at", where, " / ".join(found))


def report_bad_records(count: int, first: list[str], on_error: str, records: int, where: str,
                       on_error_name: str = "on_error") -> None:
    """The one report of ``count`` bad records of ``records`` read (``first``: the first few ``file:line: what``):
    on_error=fail raises the first with how to skip them; skip warns once with the count and the first three, and
    raises when every record was bad (else "needs assistant turns" would follow, as if they had been read).
    ``on_error_name``: what the caller's users set (load_dataset's option_names; the trainer: data.on_error)."""
    if not count:
        return
    if on_error == "fail":
        raise DataError(f"{first[0]} ({on_error_name}=skip drops bad records and counts them)")
    if count == records:
        raise DataError(f"every record in {where} is bad ({count} skipped); first: {first[0]}")
    log.warning("%s: skipped %s; first: %s", where, counted(count, "bad record"),
                "; ".join(first[:3]))


# ---- tokenization (serial or in worker processes) ----

_WORKER: dict = {}


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when its parent (pid ``parent``) dies (prctl PR_SET_PDEATHSIG); elsewhere
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call: nobody would send the signal
        os._exit(1)


def _init_worker(tokenizer, opts, parent: int):
    """Worker processes only: each runs one tokenizer thread (8 workers x N Rust threads oversubscribe).

    Forked from a process whose SIGINT/SIGTERM may raise KeyboardInterrupt (the CLI's handler): a worker caught
    the pool's SIGTERM that stops the survivors of a killed worker and blocked again, so the run hung for ever (a
    concurrency walk). SIGTERM kills a worker, Ctrl-C is the parent's to handle, and a worker dies with its parent
    (a SIGKILLed run left them running)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizer, **opts)


def _encode_chunk(records: list[Record]):
    """Records -> list of (ids, trainable, format, empty target, (runs, unclosed, across)) or (None, "file:line:
    message", None, False, (0, 0, False)); empty target: the text that would carry loss with loss on assistant turns
    / completion is blank (whatever loss_on); runs, unclosed: a chat example's replies and those that train no
    end-of-turn token (``tokenize.unclosed_replies``; loss_on="all": ``tokenize.unclosed_last_reply``; (0, 0) for
    other examples); across: a prompt/completion example's boundary falls inside a token (``tokenize.encode``)."""
    w = _WORKER
    out = []
    for rec in records:
        if rec.data is None:
            out.append((None, f"{rec.where}: {rec.error}", None, False, (0, 0, False)))
            continue
        try:
            fmt = w["format"] if w["format"] != "auto" else detect_format(rec.data, rec.from_csv)
            ex = to_example(rec.data, fmt, w["has_template"], from_csv=rec.from_csv)
            across: list[bool] = []
            ids, mask = encode(w["tokenizer"], ex, w["loss_on"], w["markers"], w["own_eos"], across=across)
            if ex.messages is None:
                ends = (0, 0)
            elif w["loss_on"] == "assistant":
                ends = unclosed_replies(w["tokenizer"], ids, mask, w["end_ids"])
            else:
                ends = unclosed_last_reply(w["tokenizer"], ex.messages, ids, w["end_ids"])
            out.append((ids, mask, fmt, empty_target(ex), (*ends, any(across))))
        except FormatError as e:
            out.append((None, f"{rec.where}: {e}", None, False, (0, 0, False)))
    return out


def _chunks(files):
    """(file index, up to CHUNK records) over ``files`` in order, made as they are taken (a chunk never spans two
    files): the records are never all in memory at once."""
    for i, f in enumerate(files):
        chunk = []
        for rec in iter_records(f):
            chunk.append(rec)
            if len(chunk) == CHUNK:
                yield i, chunk
                chunk = []
        if chunk:
            yield i, chunk


def _encoded(files, num_proc: int, tokenizer, opts):
    """((file index, chunk), its _encode_chunk results) in order; in ``num_proc`` worker processes with at most
    2 x num_proc chunks in flight (Executor.map would read and submit every record at once)."""
    chunks = _chunks(files)
    if num_proc <= 1:
        _WORKER.update(tokenizer=tokenizer, **opts)  # not _init_worker: keep this process's tokenizer threads
        for item in chunks:
            yield item, _encode_chunk(item[1])
        return
    with ProcessPoolExecutor(num_proc, mp_context=get_context("fork"), initializer=_init_worker,
                             initargs=(tokenizer, opts, os.getpid())) as pool:
        pending = deque()
        try:
            for item in chunks:
                pending.append((item, pool.submit(_encode_chunk, item[1])))
                if len(pending) >= 2 * num_proc:
                    done, fut = pending.popleft()
                    yield done, fut.result()
            while pending:
                done, fut = pending.popleft()
                yield done, fut.result()
        finally:
            for _, fut in pending:  # stopped early (a bad record under on_error=fail, Ctrl-C)
                fut.cancel()


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
                if not cut:
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
