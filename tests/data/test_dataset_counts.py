"""What load_dataset counts and says where a mutation walk found no test: a document of exactly max_seq_len, the
first record without a loss token, an empty completion under loss on all, and the cause when every one dropped."""
from __future__ import annotations

import json

from chronicals.data import load_dataset


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
