"""What ``load_dataset`` says about a set: the summary line of files and formats, and the reports of what the data
lost on the way in (bad records, truncated, dropped, empty or unclosed replies, prompt/completion splits inside a
token, no end token), raised as errors when nothing is left or logged once per set.

Every function reads the counts of a ``DatasetStats`` (dataset.py) or the per-file formats, so a cache hit reports
what the first run did.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from .._words import counted
from .chat_template import has_generation_markers
from .readers import DataError

if TYPE_CHECKING:
    from .dataset import DatasetStats

log = logging.getLogger("chronicals.data")
LOST_TOKENS_WARN = 0.1  # truncation that cuts this share of the data's tokens is a warning, not an info line


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
            first = f"; first: {stats.first_truncated_no_loss}" if stats.first_truncated_no_loss else ""
            parts.append(f"{stats.truncated_no_loss} truncated to no loss tokens (dropped{first}), their replies start "
                         f"past {n['max_seq_len']}={max_seq_len}: raise {n['max_seq_len']} or shorten the prompts")
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
