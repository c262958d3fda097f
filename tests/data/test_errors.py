"""Bad input: each case and its message (file:line: what is wrong, what was expected)."""

import json

import pytest

from chronicals.data import DataError, load_dataset

GOOD = {"instruction": "Say hi.", "output": "hi"}


def load(path, tokenizer, **kw):
    return load_dataset(path, tokenizer, **{"max_seq_len": 256, **kw})


def test_malformed_json_line(tokenizer, tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + '{"instruction": "x" "output": "y"}\n' + json.dumps(GOOD) + "\n")
    with pytest.raises(DataError, match=rf"^{p}:2: invalid JSON \(Expecting ',' delimiter at column 21\); "
                                        r"expected one JSON object per line \(on_error=skip drops bad records"):
        load(p, tokenizer)
    with pytest.raises(DataError, match=r"\(data.on_error=skip drops bad records"):  # the trainer's config keys
        load(p, tokenizer, option_names={"on_error": "data.on_error"})
    ds = load(p, tokenizer, on_error="skip")
    assert len(ds) == 2 and ds.stats.skipped_errors == 1 and ds.stats.first_errors[0].startswith(f"{p}:2:")


def test_the_skip_warning_names_the_first_three_bad_records(tokenizer, tmp_path, caplog):
    """on_error=skip says once how many bad records it skipped and names the first three (file:line: what), so the
    user sees whether they share one cause; only the first was named."""
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(["{bad", "{worse", "{worst", "{fourth", json.dumps(GOOD)]) + "\n")
    with caplog.at_level("WARNING", logger="chronicals.data"):
        ds = load(p, tokenizer, on_error="skip")
    assert (len(ds), ds.stats.skipped_errors) == (1, 4)
    warned = [r.getMessage() for r in caplog.records if "skipped 4 bad records" in r.getMessage()]
    assert len(warned) == 1, caplog.messages
    assert all(f"{p}:{line}: invalid JSON" in warned[0] for line in (1, 2, 3)), warned[0]
    assert f"{p}:4:" not in warned[0]


def test_missing_field_with_named_format(tokenizer, tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [GOOD, GOOD, {"instruction": "no output"}]))
    with pytest.raises(DataError, match=rf"{p}:3: missing field 'output' \(format alpaca expects 'instruction', "
                                        r"optional 'input', 'output'\)"):
        load(p, tokenizer, format="alpaca")


def test_unknown_fields_and_bad_messages(tokenizer, tmp_path):
    p = tmp_path / "b.jsonl"
    rows = [GOOD, {"question": "?"}, {"messages": [{"role": "user"}]}, {"messages": "hi"},
            {"conversations": [{"from": "robot", "value": "x"}]}, {"messages": []}, [1, 2]]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=rf"{p}:2: cannot tell the format from fields \['question'\]; expected one "
                                        r"of text \| messages \| conversations \| instruction\+output"):
        load(p, tokenizer)
    ds = load(p, tokenizer, on_error="skip")
    assert len(ds) == 1 and ds.stats.skipped_errors == 6
    errs = ds.stats.first_errors
    assert errs[1] == f"{p}:3: messages[0] has no 'content'; expected {{'role', 'content'}}"
    assert errs[2] == f"{p}:4: field 'messages' is a str, expected list"
    assert errs[3].startswith(f"{p}:5: conversations[0].from is 'robot'; expected one of ['assistant', ")
    assert errs[4] == f"{p}:6: field 'messages' is an empty list; expected at least one message"
    assert errs[5] == f"{p}:7: a JSON list, expected a JSON object per line"


def test_json_array_errors_carry_lines(tokenizer, tmp_path):
    p = tmp_path / "c.json"
    p.write_text('[\n  {"text": "a"},\n  {"txt": "b"},\n  {"text": "c"}\n]\n')
    with pytest.raises(DataError, match=rf"{p}:3: cannot tell the format"):
        load(p, tokenizer)
    p.write_text('[\n  {"text": "a"},\n  {"text": "b",\n]\n')
    with pytest.raises(DataError, match=rf"{p}:4: invalid JSON .*a JSON array cannot be read past a syntax error"):
        load(p, tokenizer)


def test_csv_wrong_field_count(tokenizer, tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("instruction,output\nSay hi.,hi\na,b,c\n")
    with pytest.raises(DataError, match=rf"{p}:3: 3 fields, expected 2 \(the header's columns\)"):
        load(p, tokenizer)


def test_empty_and_all_too_long(tokenizer, tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n\n")
    with pytest.raises(DataError, match=rf"the dataset is empty: no records in {p}"):
        load(p, tokenizer)
    p.write_text("\n".join(json.dumps({"text": "word " * 40}) for _ in range(3)))
    with pytest.raises(DataError, match="every example was dropped: 3 longer than max_seq_len=16 "
                                        r"\(raise max_seq_len or set overlong=truncate\)"):
        load(p, tokenizer, max_seq_len=16, overlong="drop")
    with pytest.raises(DataError, match=r"3 longer than data.max_seq_len=16 \(raise data.max_seq_len or set "
                                        r"data.on_long=truncate\)"):  # the option named as the caller calls it
        load(p, tokenizer, max_seq_len=16, overlong="drop",
             option_names={"max_seq_len": "data.max_seq_len", "overlong": "data.on_long"})
    skipped = tmp_path / "s.jsonl"  # a skipped bad record is counted among the causes
    skipped.write_text(p.read_text() + "\n{bad\n")
    with pytest.raises(DataError, match=r"every example was dropped: 3 longer .*, 0 with no trainable token, 1 bad; "
                                        rf"in the dataset \({skipped}\)"):
        load(skipped, tokenizer, max_seq_len=16, overlong="drop", on_error="skip")
    with pytest.raises(ValueError, match=r"^--max-seq-len=1; expected >= 2"):
        load(p, tokenizer, max_seq_len=1, option_names={"max_seq_len": "--max-seq-len"})
    ds = load(p, tokenizer, max_seq_len=16, overlong="truncate")
    assert ds.stats.truncated == 3 and ds.lengths.tolist() == [16, 16, 16]


def test_overlong_counts_and_no_loss(tokenizer, tmp_path):
    p = tmp_path / "f.jsonl"
    long_prompt = {"prompt": "word " * 40, "completion": "done"}  # truncation removes every target
    rows = [{"text": "short"}, {"text": "word " * 40}, long_prompt]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    ds = load(p, tokenizer, max_seq_len=16, overlong="drop")
    assert (len(ds), ds.stats.dropped_overlong, ds.stats.truncated) == (1, 2, 0)
    ds = load(p, tokenizer, max_seq_len=16, overlong="truncate")
    assert (len(ds), ds.stats.truncated, ds.stats.dropped_no_loss) == (2, 2, 1)
    q = tmp_path / "g.jsonl"
    q.write_text(json.dumps({"messages": [{"role": "user", "content": "no reply"}]}))
    with pytest.raises(DataError, match=r"no example has a trainable token .*loss_on=assistant needs .*"
                                        r"\(or set loss_on=all\)$"):
        load(q, tokenizer)


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_all_empty_texts_name_the_cause(tokenizer, tmp_path, loss_on):
    p = tmp_path / "e.jsonl"
    p.write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)))  # nothing to train, whatever loss_on
    with pytest.raises(DataError, match=rf"^no example has a trainable token in the dataset \({p}\): all 3 have an "
                                        rf"empty text \(first: {p}:1\), 0 bad records; fill in the text"):
        load(p, tokenizer, loss_on=loss_on)
    p.write_text("\n".join(json.dumps(r) for r in [{"text": ""}, {"messages": [{"role": "user", "content": "x"}]}]))
    with pytest.raises(DataError, match=rf"2 without one \(first: {p}:1\), 1 of them with an empty text, 0 bad "
                                        "records; loss_on=assistant needs assistant turns"):
        load(p, tokenizer)


def test_bad_paths_and_options(tokenizer, tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file or directory"):
        load(tmp_path / "nope.jsonl", tokenizer)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match=r"x.txt: unsupported file type '.txt' \(expected one of .jsonl.*\); convert"):
        load(tmp_path / "x.txt", tokenizer)
    (tmp_path / "x.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match=r"x.jsonl.gz: unsupported file type '.gz' .*; decompress it first"):
        load(tmp_path / "x.jsonl.gz", tokenizer)
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match="a datasets DatasetDict .*pass one split's directory, e.g. .*dd/train"):
        load(dd, tokenizer)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="directory holds no data files"):
        load(empty, tokenizer)
    with pytest.raises(ValueError, match="overlong='cut'; expected one of"):
        load(tmp_path, tokenizer, overlong="cut")


def test_what_the_data_lost_is_counted_in_words():
    """'1 bad records skipped' in the run's and eval's summaries."""
    from chronicals.data.dataset import DatasetStats

    st = DatasetStats(skipped_errors=1, truncated=2, unclosed_replies=1)
    assert st.losses() == ["1 bad record skipped", "2 truncated to data.max_seq_len",
                           "1 reply that trains no end-of-turn token"]
    st = DatasetStats(skipped_errors=3, dropped_no_loss=1, unclosed_replies=2)
    assert st.losses("--max-seq-len") == ["3 bad records skipped", "1 dropped with no loss tokens",
                                          "2 replies that train no end-of-turn token"]
    # truncated to no loss token, then dropped: said once (was '2 truncated ..., 1 dropped ...' for 2 examples)
    st = DatasetStats(truncated=2, dropped_no_loss=1, truncated_no_loss=1)
    assert st.losses() == ["1 truncated to data.max_seq_len",
                           "1 dropped with no loss tokens (1 of them truncated to none)"]
    # split records: why "5 examples of 3 records" (said nothing of the split: a walk of chronicals eval)
    st = DatasetStats(split=2, split_pieces=4)
    assert st.losses("--max-seq-len") == ["2 split into 4 pieces of --max-seq-len"]
    assert DatasetStats(split=1, split_pieces=1).losses() == ["1 split into 1 piece of data.max_seq_len"]


def test_files_after_a_failing_one_are_said_unread_not_unreadable(tokenizer, tmp_path, caplog):
    """on_error=fail stops at the first bad record; the files after it were listed as 'no readable records', sending
    the user to look for a problem in good files."""
    d = tmp_path / "mix"
    d.mkdir()
    (d / "a_text.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (d / "b_bad.jsonl").write_text(json.dumps({"what": 1}) + "\n")
    (d / "c_text.jsonl").write_text(json.dumps({"text": "good text"}) + "\n")
    with caplog.at_level("INFO", logger="chronicals.data"), pytest.raises(DataError, match="b_bad.jsonl:1"):
        load(d, tokenizer, loss_on="all")
    assert "b_bad.jsonl: no readable records; c_text.jsonl: not read (stopped at a bad record before it)" \
        in caplog.text


def test_fail_reads_no_record_after_the_bad_one(tokenizer, tmp_path, caplog):
    """on_error=fail stops at the bad record: the chat record after it (in the same chunk) is not read, so the file
    is said to hold text records and no mix of formats is warned about before the error."""
    p = tmp_path / "t.jsonl"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    p.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "t"}, {"txt": "typo"}, chat]))
    with caplog.at_level("INFO", logger="chronicals.data"), pytest.raises(DataError, match=f"^{p}:2: "):
        load(p, tokenizer)
    assert "format auto -> text" in caplog.text and "mixes record formats" not in caplog.text, caplog.text
