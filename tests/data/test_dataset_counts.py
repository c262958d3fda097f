"""What load_dataset counts and says where a mutation walk found no test: a document of exactly max_seq_len, the
first record without a loss token, an empty completion under loss on all, the cause when every one dropped, the
share of cut tokens that makes truncation a warning, the pad id, and a tokenizer that is not a fast one."""
from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest

from chronicals.data import load_dataset
from chronicals.data.dataset import OPTIONS, DatasetStats, _pad_id
from chronicals.data.readers import DataError
from chronicals.data.reporting import LOST_TOKENS_WARN, _finish


TRAINER_NAMES = {k: k for k in OPTIONS} | {"max_seq_len": "data.max_seq_len", "loss_on": "data.train_on",
                                            "overlong": "data.on_long"}


def bare_option(text):
    """An option said by its parameter name ("overlong=split") where the caller gave its own (data.on_long)."""
    return re.search(r"(?<![\w.])(max_seq_len|loss_on|overlong)\b", text)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_document_of_exactly_max_seq_len_is_not_truncated(tokenizer, tmp_path):
    """A document of len(ids) == max_seq_len is kept whole: not counted (nor reported) as truncated."""
    p = write(tmp_path / "t.jsonl", [{"text": "one two three four five six seven"}])
    n = len(load_dataset(p, tokenizer, max_seq_len=4096)[0][0])
    ds = load_dataset(p, tokenizer, max_seq_len=n)
    assert len(ds[0][0]) == n and ds.stats.truncated == 0 and ds.stats.truncated_tokens == 0
    assert not any("truncated" in x for x in ds.stats.losses())


def test_first_no_loss_names_a_record_without_a_reply_not_one_truncated_to_none(tokenizer, tmp_path):
    """The first record dropped for having no loss token that truncation did not cause is named."""
    long_prompt = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    no_reply = {"messages": [{"role": "user", "content": "hi"}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    p = write(tmp_path / "t.jsonl", [long_prompt, no_reply, short])
    ds = load_dataset(p, tokenizer, max_seq_len=64)
    assert (ds.stats.dropped_no_loss, ds.stats.truncated_no_loss) == (2, 1)
    assert ds.stats.first_no_loss == f"{p}:2"
    assert ds.stats.first_truncated_no_loss == f"{p}:1"  # named apart: the long-chat drop said no record (a user walk)


def test_an_empty_completion_under_loss_on_all_is_no_empty_reply(tokenizer, tmp_path):
    """With loss_on=all the prompt trains too: an empty completion is not counted or warned as an empty reply."""
    p = write(tmp_path / "t.jsonl", [{"prompt": "Question: hi", "completion": ""},
                                     {"prompt": "Question: yo", "completion": " ok"}])
    assert load_dataset(p, tokenizer, max_seq_len=64).stats.empty_targets == 1
    assert load_dataset(p, tokenizer, max_seq_len=64, loss_on="all").stats.empty_targets == 0


def test_all_dropped_some_truncated_some_without_a_reply_names_both_causes(tokenizer, tmp_path):
    """'all truncated to max_seq_len' only when every dropped example was; else both causes."""
    import pytest

    from chronicals.data.readers import DataError

    long_prompt = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    no_reply = {"messages": [{"role": "user", "content": "hi"}]}
    p = write(tmp_path / "t.jsonl", [long_prompt, no_reply])
    with pytest.raises(DataError) as e:
        load_dataset(p, tokenizer, max_seq_len=64)
    msg = str(e.value)
    assert "2 without one" in msg and "1 of them truncated to max_seq_len=64" in msg and "all truncated" not in msg


def test_the_truncated_and_kept_count_leaves_out_those_truncated_to_no_loss(tokenizer, tmp_path, caplog):
    """"N truncated to max_seq_len (kept)" counts the truncated examples that train; one truncated to no loss token
    is said once, as dropped. Counting it in both told the user a dropped example was kept and trained."""
    long_prompt = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    long_text = {"text": "word " * 200}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    p = write(tmp_path / "t.jsonl", [long_prompt, long_text, short])
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=64)
    assert (ds.stats.truncated, ds.stats.truncated_no_loss, ds.stats.documents) == (2, 1, 2)
    line = next(r.getMessage() for r in caplog.records if "records kept" in r.getMessage())
    assert "2 of 3 records kept" in line
    assert "1 truncated to max_seq_len=64 (kept" in line and "2 truncated to max_seq_len=64" not in line
    assert f"1 truncated to no loss tokens (dropped; first: {p}:1)" in line


def test_truncation_that_cuts_exactly_the_warning_share_of_tokens_warns(caplog):
    """The summary turns WARNING (with the advice to raise max_seq_len or split) from LOST_TOKENS_WARN of the data's
    tokens cut, that share included: 1 of 10 tokens cut warns, 1 of 11 stays INFO. A `>` said exactly 10% at INFO."""
    assert LOST_TOKENS_WARN == 0.1
    names = {k: k for k in OPTIONS}
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        _finish(DatasetStats(records=1, documents=1, truncated=1, truncated_tokens=1, tokens=9), "fail", 9, names)
        _finish(DatasetStats(records=1, documents=1, truncated=1, truncated_tokens=1, tokens=10), "fail", 10, names)
    at, below = [r for r in caplog.records if "records kept" in r.getMessage()]
    assert at.levelno == logging.WARNING and "raise max_seq_len to keep more of them" in at.getMessage()
    assert below.levelno == logging.INFO and "raise max_seq_len" not in below.getMessage()


def test_a_skipped_bad_record_keeps_each_files_format_its_own(tokenizer, tmp_path, caplog):
    """Each read record holds its place in the per-file format tally, a bad one too (as no format): else the next
    file's records were counted in this one's, and a clean text file was warned about as mixing text and
    prompt/completion records."""
    a = write(tmp_path / "a.jsonl", [{"text": "one two"}, {"txt": "typo"}, {"text": "three"}])
    b = write(tmp_path / "b.jsonl", [{"prompt": "q", "completion": " a"}, {"prompt": "r", "completion": " b"}])
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset([str(a), str(b)], tokenizer, max_seq_len=32, on_error="skip")
    assert ds.stats.skipped_errors == 1 and ds.file_counts == [3, 2]
    assert ds.file_formats == ["text", "prompt_completion"]
    assert "mixes record formats" not in caplog.text


def test_fail_on_a_cache_entry_written_under_skip_names_the_first_bad_record(tokenizer, tmp_path):
    """on_error is not part of the cache key: a run with on_error=fail that hits the entry a skip run wrote raises
    from the entry's list of bad records. It must name the first bad record (line 2), as a fresh read stops there;
    naming another one (the list's last) sent the user to line 4 while line 2 still fails."""
    p = write(tmp_path / "t.jsonl", [{"text": "a b c"}, {"txt": "x"}, {"text": "d e"}, {"txt": "y"}])
    kw = dict(max_seq_len=32, cache_dir=tmp_path / "cache")
    skipped = load_dataset(p, tokenizer, on_error="skip", **kw)
    assert skipped.stats.skipped_errors == 2 and len(skipped.stats.first_errors) == 2
    with pytest.raises(DataError) as fresh:
        load_dataset(p, tokenizer, on_error="fail", max_seq_len=32)
    with pytest.raises(DataError) as hit:
        load_dataset(p, tokenizer, on_error="fail", **kw)  # a cache hit
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert str(fresh.value).startswith(f"{p}:2: ") and str(hit.value) == str(fresh.value)


def test_the_pad_id_is_the_pad_token_before_eos():
    """ds.pad_id (collate_rows fills rows with it) is the tokenizer's pad token when it has one, else eos, else 0.
    SmolLM2's pad is its eos, so preferring eos over a pad token of its own went unseen."""
    assert _pad_id(SimpleNamespace(pad_token_id=3, eos_token_id=2)) == 3
    assert _pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert _pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0


def test_a_slow_tokenizer_is_refused_with_how_to_load_a_fast_one(tmp_path):
    """Character offsets need a fast (Rust) tokenizer: load_dataset refuses another one up front with a TypeError
    that says use_fast=True. Without the check it failed later with an unrelated error from inside tokenizing."""
    p = write(tmp_path / "d.jsonl", [{"text": "hello"}])
    slow = SimpleNamespace(is_fast=False, chat_template=None, eos_token="</s>", eos_token_id=2, pad_token_id=None)
    with pytest.raises(TypeError, match=r"needs a fast \(Rust\) tokenizer .*use_fast=True"):
        load_dataset(p, slow, max_seq_len=16)


def test_what_the_data_lost_names_each_fix_by_the_callers_option_names(caplog):
    """The trainer's users set data.on_long / data.max_seq_len: every fix the summary advises names those, in each
    of its parts (truncated past the warning share, truncated to no loss, dropped, split)."""
    stats = DatasetStats(records=9, documents=6, truncated=2, truncated_tokens=50, tokens=100, truncated_no_loss=1,
                         dropped_no_loss=1, dropped_overlong=1, split=1, split_pieces=2)
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        _finish(stats, "fail", 64, TRAINER_NAMES)
    (line,) = [r.getMessage() for r in caplog.records if "records kept" in r.getMessage()]
    for fix in ("or set data.on_long=split", "raise data.max_seq_len or shorten the prompts",
                "(dropped, data.on_long=drop)", "(data.on_long=split)"):
        assert fix in line, (fix, line)
    assert not bare_option(line), line


@pytest.mark.parametrize("truncated, fix", [(1, "raise data.max_seq_len or shorten the prompts"),
                                            (0, "(or set data.train_on=all)")], ids=["truncated", "no_reply"])
def test_no_trainable_token_names_the_fix_by_the_callers_option_names(truncated, fix):
    """Every example dropped without a loss token: the refusal's fix names the option as the caller's users set it."""
    stats = DatasetStats(records=2, dropped_no_loss=2, truncated=truncated, truncated_no_loss=truncated)
    with pytest.raises(DataError) as e:
        _finish(stats, "fail", 64, TRAINER_NAMES)
    assert fix in str(e.value) and not bare_option(str(e.value)), str(e.value)
