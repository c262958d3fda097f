"""Inputs a user walk of the loader found to get wrong, cryptic or no advice: a JSON array read past its syntax error,
"at at column", a tool call's null content, binary files named as data, pretty-printed JSON lines, a byte-order mark
mid-file, near-miss field and role names, blank text records, and a directory of splits trained on as one set."""

import copy
import gzip
import io
import json
import logging
import re
import zipfile

import pytest

from chronicals.data import DataError, load_dataset
from chronicals.data.formats import FormatError, to_example
from chronicals.data.readers import read_file
from chronicals.data.files import resolve_files


def load(path, tokenizer, **kw):
    return load_dataset(path, tokenizer, **{"max_seq_len": 64, **kw})


def lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# ---- 1. a JSON array cannot be skipped past a syntax error ----

@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_syntax_error_in_a_json_array_stops_the_load_even_with_skip(tokenizer, tmp_path, on_error):
    """Skipped as one bad record, the 29 records after it were never read and the count said "1 bad record
    skipped" (a user walk); the end of a malformed element cannot be found, so it is an error with the fix."""
    p = tmp_path / "arr.json"
    recs = [json.dumps({"text": f"record {i}"}) for i in range(70)]
    recs[40] = '{"text": "record 40", }'  # line 42
    p.write_text("[\n" + ",\n".join(recs) + "\n]\n")
    with pytest.raises(DataError) as err:
        load(p, tokenizer, on_error=on_error)
    assert str(err.value) == (
        f"{p}:42: invalid JSON (Expecting property name enclosed in double quotes at column 23); a JSON array cannot "
        "be read past a syntax error, so it is not skipped as one bad record (every record after it would be lost): "
        "fix line 42, or write the data as JSON lines (.jsonl, one object per line), where a bad line is skipped "
        "alone")


# ---- 2. "at at column" ----

def test_json_errors_say_at_once(tokenizer, tmp_path):
    """json's "Unterminated string starting at" and "Invalid control character at" got " at column N" appended."""
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "abc\n{"text": "a\tb"}\n')
    assert [r.error for r in read_file(p)] == [
        "invalid JSON (Unterminated string starting at column 10); expected one JSON object per line",
        "invalid JSON (Invalid control character at column 12); expected one JSON object per line"]
    q = tmp_path / "a.json"
    q.write_text('[\n{"text": "abc')  # cut off inside a string
    with pytest.raises(DataError, match=rf"^{q}:2: invalid JSON \(Unterminated string starting at column 10\);"):
        read_file(q)
    c = tmp_path / "m.csv"  # a message list as JSON text in a CSV cell
    c.write_text('messages\n"[{""role"": ""user"", ""content"": ""hi}]"\n')
    with pytest.raises(DataError, match=r"m.csv:2: field 'messages' is not valid JSON \(Unterminated string "
                                        r"starting at column 30\)"):
        load(c, tokenizer)
    saved = tmp_path / "saved"  # a save_to_disk state.json, read by the shared _jsonio reader
    saved.mkdir()
    (saved / "state.json").write_text('{"_data_files": [{"filename": "x}]}')
    with pytest.raises(DataError, match=r"state.json:1: invalid JSON \(Unterminated string starting at column "
                                        r"31\); fix the file"):
        resolve_files(saved)


# ---- 3. null content beside tool_calls ----

TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize("name", ["get_weather", "f"])
@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_null_content_beside_tool_calls_says_the_template_drops_the_calls(tokenizer, tmp_path, name, loss_on):
    """SmolLM2's template reads every message's content: null content beside tool_calls (OpenAI's export) failed it
    with "'dict object' has no attribute 'content'", where "" content said the template drops the calls. A name the
    template writes anyway ('f' is in its default system prompt, "... Hugging Face") is no proof it renders them."""
    call = copy.deepcopy(TOOL_CALL)
    call["function"]["name"] = name
    p = tmp_path / "t.jsonl"
    for content in (None, ""):
        p.write_text(lines({"messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": content, "tool_calls": [call]},
                                         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42."}]}))
        with pytest.raises(DataError, match=rf"^{p}:1: message 1 calls tool '{name}', but the chat template does not "
                                            "render tool_calls"):
            load(p, tokenizer, loss_on=loss_on)


def test_null_content_a_template_with_tool_calls_cannot_render_says_so(tokenizer, tmp_path):
    """A template that renders the calls but fails on null content: its own error, and the fix."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                         "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}"
                         "{{ '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    p = tmp_path / "t.jsonl"
    p.write_text(lines({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]}))
    with pytest.raises(DataError, match=r"no attribute 'content'; message 1 has null content beside its tool_calls, "
                                        r"which this chat template cannot render: give it \"content\": \"\""):
        load(p, tok)
    p.write_text(p.read_text().replace("null", '""'))
    assert len(load(p, tok)) == 1  # rendered with the call, trained


# ---- 4. binary files named as data ----

LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1234\n"


def _zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("train.jsonl", '{"text": "a"}\n')
    return buf.getvalue()


def _parquet() -> bytes:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), buf)
    return buf.getvalue()


@pytest.mark.parametrize("name, body, says", [
    ("a.jsonl", lambda: gzip.compress(b'{"text": "a"}\n'), r"a gzip file \(it starts with gzip's magic bytes 1f 8b\); "
                                                             r"decompress it first: gunzip -c FILE > NEW\.jsonl"),
    ("a.csv", _zip, r"a zip archive .*; extract it \(unzip FILE\)"),
    ("a.jsonl", _parquet, r"a parquet file .*; name it \.parquet"),
    ("a.json", _parquet, r"a parquet file .*; name it \.parquet"),
    ("a.jsonl", lambda: LFS, r"a Git LFS pointer, not the data .*; run git lfs pull in its repository"),
    ("a.parquet", lambda: LFS, r"a Git LFS pointer, not the data .*; run git lfs pull in its repository"),
    ("a.csv", lambda: LFS, r"a Git LFS pointer, not the data"),
])
def test_a_binary_file_named_as_data_says_what_it_is(tmp_path, name, body, says):
    """A gzip or parquet file named .jsonl was "not valid UTF-8 at byte 1 ...; re-encode the file as UTF-8 (iconv)";
    a Git LFS pointer "invalid JSON" or "not a readable parquet file"."""
    p = tmp_path / name
    p.write_bytes(body())
    with pytest.raises(DataError, match=rf"^{re.escape(str(p))}: {says}"):
        read_file(p)


def test_a_csv_header_starting_like_parquet_is_still_csv(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("PAR1,text\nx,hello\n")  # parquet also ends with PAR1: this does not
    assert [r.data for r in read_file(p)] == [{"PAR1": "x", "text": "hello"}]


# ---- 5. pretty-printed JSON lines, a byte-order mark mid-file ----

@pytest.mark.parametrize("name", ["p.jsonl", "p.json"])
def test_pretty_printed_objects_in_json_lines_are_named(tmp_path, name):
    """Several objects, each over several lines: line 1 ('{') was "invalid JSON (Expecting property name ...)"."""
    p = tmp_path / name
    p.write_text("".join(json.dumps({"text": f"rec {i}"}, indent=2) + "\n" for i in range(3)))
    first = read_file(p)[0]
    assert first.where == f"{p}:1" and first.error == (
        "invalid JSON (Expecting property name enclosed in double quotes at column 2); expected one JSON object per "
        "line; the objects seem pretty-printed over several lines, and JSON lines need each object on one line: "
        "rewrite them, e.g. jq -c . FILE > NEW.jsonl")
    p.write_text('{"text": "a"}\n{"text": "b",\n "more": 1}\n')  # one object opened and cut at its line's end
    assert "pretty-printed" in read_file(p)[1].error
    p.write_text('{"text": "a"}\n{"text": }\n')  # a line broken inside: no such hint
    assert "pretty-printed" not in read_file(p)[1].error


@pytest.mark.parametrize("line, lacks", [('{"messages": [{"role": "user", "content": "x"}', "]}"),
                                         ('{"text": "a \\" [ {", "n": 1', "}"), ('{"a": [1, {"b": true}', "]}")])
def test_a_line_cut_short_is_not_told_it_is_pretty_printed(tmp_path, line, lacks):
    """A record whose line ends after a whole value with its brackets still open (a write cut short, a bracket lost
    in an edit) was told "the objects seem pretty-printed over several lines" and to run jq, which refuses the file
    too (a walk of chronicals train). It is told which closing brackets the line lacks."""
    p = tmp_path / "cut.jsonl"
    p.write_text('{"text": "a"}\n' + line + '\n{"text": "c"}\n')
    error = read_file(p)[1].error
    assert "pretty-printed" not in error, error
    assert error.endswith(f"; expected one JSON object per line; the line ends before its record closes (it lacks "
                          f"{lacks!r} at its end): the record was cut short or lost its closing brackets; complete "
                          "it or remove the line"), error


def test_a_byte_order_mark_mid_file_is_named(tmp_path):
    """json's own "Unexpected UTF-8 BOM (decode using utf-8-sig)" named a fix that does not apply mid-file."""
    bom = b"\xef\xbb\xbf"
    p = tmp_path / "joined.jsonl"
    p.write_bytes(b'{"text": "a"}\n' + bom + b'{"text": "b"}\n')
    assert read_file(p)[1].error == ("a UTF-8 byte-order mark (BOM, bytes EF BB BF) at column 1, in the middle of "
                                     "the file (two files joined?); remove it, e.g. sed 's/\\xEF\\xBB\\xBF//g' FILE "
                                     "> NEW")
    q = tmp_path / "joined.json"
    q.write_bytes(b'[{"text": "a"},\n' + bom + b'{"text": "b"}]')
    with pytest.raises(DataError, match=rf"^{q}:2: a UTF-8 byte-order mark \(BOM, bytes EF BB BF\) at column 1, in "
                                        "the middle of the file"):
        read_file(q)


# ---- 6. near-miss field names ----

@pytest.mark.parametrize("record, says", [
    ({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "conversations[0] has no 'from'; expected {'from', 'value'}; these are OpenAI-style messages "
     "({'role', 'content'}): name the field 'messages'"),
    ({"messages": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "messages[0] has no 'role'; expected {'role', 'content'}; these are ShareGPT-style turns ({'from', 'value'}): "
     "name the field 'conversations'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assitant", "content": "a"}]},
     "messages[1].role is 'assitant'; expected one of system, developer, user, assistant, tool, ipython, function; "
     "did you mean 'assistant'?"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "Assistant", "content": "a"}]},
     "messages[1].role is 'Assistant'; expected one of system, developer, user, assistant, tool, ipython, function; "
     "did you mean 'assistant'?"),
    ({"conversations": [{"from": "humam", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "did you mean 'human'?"),
])
def test_near_miss_names_get_a_hint(record, says):
    fmt = "chat" if "messages" in record else "sharegpt"
    with pytest.raises(FormatError) as err:
        to_example(record, fmt, has_chat_template=True)
    assert str(err.value).endswith(says)


def test_a_csv_header_with_spaces_after_commas_names_its_columns(tokenizer, tmp_path):
    """"prompt, completion" named a column ' completion', read as "it has 'prompt' but no 'completion'". The names
    are stripped (no field of ours has spaces around it); the cells keep theirs."""
    p = tmp_path / "pc.csv"
    p.write_text("prompt, completion\nWhat is 2+2?, 4\n")
    assert read_file(p)[0].data == {"prompt": "What is 2+2?", "completion": " 4"}
    assert len(load(p, tokenizer)) == 1
    p.write_text("text, text \na,b\n")  # equal but for spaces: two columns of one name
    with pytest.raises(DataError, match=rf"^{p}:1: column 'text' appears 2 times in the header \(names are compared "
                                        r"without the spaces around them\)"):
        read_file(p)


# ---- 7. a whitespace-only text record ----

def test_a_blank_text_record_is_dropped_as_an_empty_one(tokenizer, tmp_path, caplog):
    """{"text": "   "} trained its eos alone, with a warning about empty assistant replies; {"text": ""} was dropped
    and counted as an empty text. Both are now."""
    p = tmp_path / "t.jsonl"
    p.write_text(lines({"text": "   "}, {"text": "real text"}, {"text": ""}, {"text": "\n\t"}))
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        ds = load(p, tokenizer)
    s = ds.stats
    assert (len(ds), s.dropped_no_loss, s.empty_no_loss, s.empty_targets, s.first_no_loss) == (1, 3, 3, 0, f"{p}:1")
    assert "answer with nothing" not in caplog.text and "3 without loss tokens (dropped" in caplog.text
    p.write_text(lines({"text": " "}, {"text": ""}))
    with pytest.raises(DataError, match=r"all 2 have an empty text"):
        load(p, tokenizer, loss_on="all")


# ---- 8. a directory of splits ----

def test_a_directory_of_splits_warns_that_held_out_files_are_trained_on(tmp_path, caplog):
    d = tmp_path / "splits"
    d.mkdir()
    for name in ("train.jsonl", "test.jsonl", "validation.jsonl", "latest.jsonl"):  # 'latest' is no split
        (d / name).write_text(lines({"text": "a"}))
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        resolve_files(d)
    assert (f"{d}: 2 files named like a held-out split, read with the others as one set: {d / 'test.jsonl'}, "
            f"{d / 'validation.jsonl'}; to keep a split held out, point data.path at the training files and "
            "data.eval_path at the held-out ones") in caplog.text
    caplog.clear()
    hub = tmp_path / "hub"  # a Hugging Face dataset's layout: split-named shards, or a folder per split
    for rel in ("data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet", "dev/part-0.jsonl",
                "heldout.jsonl"):
        (hub / rel).parent.mkdir(parents=True, exist_ok=True)
        (hub / rel).write_text("")
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        resolve_files(hub)
    assert "3 files named like a held-out split" in caplog.text
    caplog.clear()
    held = tmp_path / "held"  # held-out files alone: how a held-out set is given, not warned about
    held.mkdir()
    for name in ("test.jsonl", "validation.jsonl"):
        (held / name).write_text(lines({"text": "a"}))
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        resolve_files(held)
    assert "held-out split" not in caplog.text
