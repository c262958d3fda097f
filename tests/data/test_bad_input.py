"""Inputs a user walk found to crash or mislead: each must be a DataError naming file, line and field."""

import json

import pytest

from chronicals.data import DataError, load_dataset
from chronicals.data.readers import read_file
from chronicals.data.files import resolve_files


def load(path, tokenizer, **kw):
    return load_dataset(path, tokenizer, **{"max_seq_len": 64, **kw})


def test_lone_surrogate_is_named(tokenizer, tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n')  # a JSON escape of half a surrogate pair
    with pytest.raises(DataError, match=rf"^{p}:2: field 'text' is not valid Unicode \(lone surrogate "
                                        r"'\\ud800' at character 1\)"):
        load(p, tokenizer)
    p.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\udfffx"}]}\n')
    with pytest.raises(DataError, match=rf"^{p}:1: messages\[1\].content is not valid Unicode \(lone surrogate"):
        load(p, tokenizer)
    parts = '[{"type": "text", "text": "ok"}, {"type": "text", "text": "x\\ud800"}]'
    p.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ' + parts + '}]}\n')
    with pytest.raises(DataError, match=rf"^{p}:1: messages\[1\].content\[1\].text is not valid Unicode "
                                        r"\(lone surrogate '\\ud800' at character 1\)"):
        load(p, tokenizer)
    # other message fields the template renders: tool calls, names (the tokenizer raised a TypeError there)
    call = '{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}}'
    p.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [' + call
                 + ']}]}\n')
    with pytest.raises(DataError, match=rf"^{p}:1: messages\[1\]\.tool_calls\[0\]\.function\.arguments is not "
                                        r"valid Unicode"):
        load(p, tokenizer)
    p.write_text('{"messages": [{"role": "user", "content": "q", "name": "b\\udc00"}, '
                 '{"role": "assistant", "content": "a"}]}\n')
    with pytest.raises(DataError, match=rf"^{p}:1: messages\[0\]\.name is not valid Unicode"):
        load(p, tokenizer)
    # an arguments object's keys, which templates print (Qwen3-Coder's <parameter={{ k }}>), named escaped
    call = '{"type": "function", "function": {"name": "f", "arguments": {"ci\\ud800ty": "Paris"}}}'
    p.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [' + call
                 + ']}]}\n')
    with pytest.raises(DataError, match=rf"^{p}:1: messages\[1\]\.tool_calls\[0\]\.function\.arguments key "
                                        r"'ci\\ud800ty' is not valid Unicode \(lone surrogate '\\ud800' at "
                                        r"character 2\)"):
        load(p, tokenizer)


def test_deeply_nested_json_is_a_record_error(tmp_path):
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    p = tmp_path / "deep.jsonl"
    p.write_text('{"text": "ok"}\n' + deep + "\n")
    recs = read_file(p)
    assert recs[0].data == {"text": "ok"}
    assert recs[1].where == f"{p}:2" and recs[1].data is None and "nested too deeply" in recs[1].error
    q = tmp_path / "deep.json"  # in an array the element's end is not found: reading cannot go on past it
    q.write_text('[\n{"text": "ok"},\n' + deep + "\n]")
    with pytest.raises(DataError, match=rf"^{q}:3: nested too deeply .*cannot be read past an element it cannot parse"):
        read_file(q)


def test_dataset_dict_and_state_json_that_are_not_mappings(tmp_path):
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text("[1, 2]")
    with pytest.raises(DataError, match=rf"{dd / 'dataset_dict.json'}: a JSON array, not an object, so not a valid "
                                        r"datasets\.save_to_disk dataset_dict\.json; .*save the dataset again"):
        resolve_files(dd)
    (dd / "dataset_dict.json").write_text("{bad")
    with pytest.raises(DataError, match=rf"{dd / 'dataset_dict.json'}:1: invalid JSON"):
        resolve_files(dd)
    sv = tmp_path / "sv"
    sv.mkdir()
    (sv / "state.json").write_text('{"_data_files": [\n{"filename": 3}]}')
    with pytest.raises(DataError, match=rf"{sv / 'state.json'}: '_data_files' must list"):
        resolve_files(sv)
    (sv / "state.json").write_text('{"_data_files": [\n{"filename": }]}')
    with pytest.raises(DataError, match=rf"{sv / 'state.json'}:2: invalid JSON"):
        resolve_files(sv)


def test_garbage_arrow_names_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    for name in ("x.arrow", "y.parquet"):
        p = tmp_path / name
        p.write_bytes(b"garbage")
        with pytest.raises(DataError, match=rf"^{p}: not a readable {p.suffix[1:]} file"):
            read_file(p)


def test_not_utf8_names_file_line_and_byte(tokenizer, tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "fine"}\n')
    p = d / "b.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "also ok"}\n')
    with pytest.raises(DataError, match=rf"^{p}:2: not valid UTF-8 at byte 28 \(invalid continuation byte.*"
                                        r"re-encode the file as UTF-8"):
        load(d, tokenizer)
    ds = load(d, tokenizer, on_error="skip")  # one bad line is one bad record
    assert len(ds) == 3 and ds.stats.skipped_errors == 1
    for name, body in (("c.csv", b"text\nfine\ncaf\xe9\n"), ("c.json", b'[\n{"text": "ok"},\n{"text": "\xe9"}]')):
        q = tmp_path / name
        q.write_bytes(body)
        with pytest.raises(DataError, match=rf"^{q}:3: not valid UTF-8 at byte"):
            load(q, tokenizer, on_error="skip")


def test_byte_order_mark_is_ignored(tokenizer, tmp_path):
    bom = b"\xef\xbb\xbf"
    rows = {"c.csv": b"instruction,output\r\nAdd 2 and 2,4\r\n",
            "j.jsonl": b'{"instruction": "Add 2 and 2", "output": "4"}\n',
            "a.json": b'[{"instruction": "Add 2 and 2", "output": "4"}]'}
    for name, body in rows.items():
        p = tmp_path / name
        p.write_bytes(bom + body)
        recs = read_file(p)
        assert [r.data for r in recs] == [{"instruction": "Add 2 and 2", "output": "4"}], name
        assert recs[0].where == f"{p}:2" if name == "c.csv" else f"{p}:1"
        assert len(load(p, tokenizer, on_error="skip")) == 1


def test_csv_unclosed_quote(tokenizer, tmp_path):
    p = tmp_path / "q.csv"
    p.write_text("text\nrow a\n\"Quoted start but never closed\n" + "".join(f"row {i}\n" for i in range(100)))
    with pytest.raises(DataError, match=rf"^{p}:3: unclosed quote: .*close the quote"):
        load(p, tokenizer, on_error="skip")
    p.write_text('text\n"a ""quoted"" word, and a\nnewline"\nplain\n')  # valid quoting still reads
    assert [r.data["text"] for r in read_file(p)] == ['a "quoted" word, and a\nnewline', "plain"]


def test_null_text_alpaca_input_and_chat_roles(tokenizer, tmp_path):
    p = tmp_path / "r.jsonl"
    rows = [{"text": None}, {"instruction": "a", "input": 0, "output": "b"},
            {"instruction": "a", "input": [], "output": "b"}, {"instruction": "a", "input": None, "output": "b"},
            {"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "tool", "content": "x"}]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load(p, tokenizer, on_error="skip", loss_on="all")
    assert ds.stats.first_errors == [
        f"{p}:1: field 'text' is null (format text expects 'text')",
        f"{p}:2: field 'input' is an int, expected a string (or null, or no 'input')",
        f"{p}:3: field 'input' is a list, expected a string (or null, or no 'input')",
        f"{p}:5: messages[0].role is 'robot'; expected one of system, developer, user, assistant, tool, ipython, function"]
    assert len(ds) == 2  # null input is no input; a tool message is a chat message


def test_a_pretty_printed_json_in_a_jsonl_file_is_named(tmp_path):
    """Every line of a pretty-printed array was its own bad record ('invalid JSON (Expecting value at column 2)');
    the file is said to be one JSON value, with the fix."""
    p = tmp_path / "pp.jsonl"
    p.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=2))
    with pytest.raises(DataError, match=rf"^{p}: one JSON array spread over lines \(pretty-printed\), not JSON lines; "
                                        r"rename the file to pp\.json"):
        read_file(p)
    p.write_text(json.dumps({"text": "a"}, indent=2))
    with pytest.raises(DataError, match=rf"^{p}: one JSON object spread over lines .*write each record on one line"):
        read_file(p)
    p.write_text('[\n{"text": "a"},\n')  # not one value: the lines are said, as before
    assert read_file(p)[0].error.startswith("invalid JSON")
