"""A hostile user's data: each case fails as ``file:line: what is wrong, what to do``, or is kept and counted,
instead of a raw traceback or data silently lost."""

import codecs
import copy
import json

import numpy as np
import pytest

from chronicals.data import DataError, PackedLoader, load_dataset
from chronicals.data.dataset import DatasetStats, TokenizedDataset
from chronicals.data.readers import read_file
from chronicals.data.files import resolve_files

BIG = "1" + "0" * 5000  # more digits than Python's int() takes from text (4300)


def load(path, tokenizer, **kw):
    return load_dataset(path, tokenizer, **{"max_seq_len": 64, **kw})


def test_number_too_long_is_a_record_error(tmp_path):
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer of > 4300 digits."""
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n{"text": %s}\n' % BIG)
    recs = read_file(p)
    assert recs[0].data == {"text": "ok"} and recs[1].data is None and "4300 digits" in recs[1].error
    j = tmp_path / "a.json"
    j.write_text('[{"text": "ok"},\n {"text": %s}]' % BIG)  # in an array: the element's end is not found
    with pytest.raises(DataError, match=rf"^{j}:2: a number of more than 4300 digits"):
        read_file(j)
    o = tmp_path / "o.json"
    o.write_text('{"text": %s}' % BIG)  # one object: the JSON-lines reader reports it
    assert "4300 digits" in read_file(o)[0].error


def test_number_too_long_in_a_csv_messages_cell(tokenizer, tmp_path):
    p = tmp_path / "a.csv"
    p.write_text('messages\n"[%s]"\n' % BIG)
    with pytest.raises(DataError, match=rf"^{p}:2: field 'messages' is not valid JSON \(.*4300 digits"):
        load(p, tokenizer)


@pytest.mark.parametrize("role", [["human"], {"a": 1}])
def test_sharegpt_from_that_is_not_a_string(tokenizer, tmp_path, role):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"conversations": [{"from": role, "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    with pytest.raises(DataError, match=rf"^{p}:1: conversations\[0\].from is .*; expected one of"):
        load(p, tokenizer)


def test_content_after_the_json_array_is_not_dropped(tmp_path):
    p = tmp_path / "two.json"
    p.write_text('[{"text": "a"}]\n[{"text": "b"}]\n')  # two arrays concatenated: the second was silently lost
    recs = read_file(p)
    assert recs[0].data == {"text": "a"}
    assert recs[-1].data is None and recs[-1].where == f"{p}:2" and "after the JSON array" in recs[-1].error
    q = tmp_path / "ok.json"
    q.write_text('[{"text": "a"}]\n\n')
    assert [r.data for r in read_file(q)] == [{"text": "a"}]


def test_csv_duplicate_column_names(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("text,prompt,text\na,b,c\n")  # DictReader keeps the last 'text': 'a' was silently lost
    with pytest.raises(DataError, match=rf"^{p}:1: column 'text' appears 2 times in the header"):
        read_file(p)


def test_every_record_bad_says_so(tokenizer, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("{nope\n[1]\n")
    with pytest.raises(DataError, match=rf"^every record in the dataset \({p}\) is bad \(2 skipped\); first: "
                                        rf"{p}:1: invalid JSON"):
        load(p, tokenizer, on_error="skip")


def test_every_reply_truncated_away_says_max_seq_len(tokenizer, tmp_path):
    p = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": "hi " * 50}, {"role": "assistant", "content": "yo"}]
    p.write_text(json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(DataError, match=r"no example has a trainable token .*: 1 without one, all truncated to "
                                        r"max_seq_len=16 before their replies start; raise max_seq_len or"):
        load(p, tokenizer, max_seq_len=16)


def test_glob_pattern_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match=r"\*\.jsonl: no such file or directory .*patterns are not expanded"):
        resolve_files(str(tmp_path / "*.jsonl"))
    (tmp_path / "run1").mkdir()
    with pytest.raises(DataError, match=r"glob patterns are not expanded: give the directory"):
        resolve_files(str(tmp_path / "run*" / "train.jsonl"))  # the pattern in a folder's name


def test_no_paths(tmp_path):
    with pytest.raises(DataError, match=r"no data files given"):
        resolve_files([])


def test_chat_without_template_and_loss_on_all(tokenizer, tmp_path):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=rf"^{p}:1: chat data needs a tokenizer with a chat template"):
        load(p, tok, loss_on="all")


def _tiny():
    lengths = np.array([3, 4, 5])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stats = DatasetStats(records=3, documents=3, tokens=12, loss_tokens=9)
    return TokenizedDataset(np.arange(12, dtype=np.int32), np.ones(12, bool), offsets, 0, stats, 8)


@pytest.mark.parametrize("bs", [0, -1])
def test_loader_batch_size_below_one(bs):
    with pytest.raises(ValueError, match=rf"PackedLoader: batch_size={bs}; expected an integer >= 1"):
        PackedLoader(_tiny(), batch_size=bs, max_seq_len=8)


def test_loader_state_missing_or_out_of_range():
    ld = PackedLoader(_tiny(), batch_size=1, max_seq_len=8)
    with pytest.raises(ValueError, match=r"load_state_dict: the state has no 'position'"):
        ld.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"load_state_dict: position=99 is not in 0..2"):
        ld.load_state_dict({**ld.state_dict(), "position": 99})


@pytest.mark.parametrize("codec, bits", [("utf-16", 16), ("utf-16-be", 16), ("utf-32", 32), ("utf-32-be", 32)])
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_utf16_file_names_the_encoding(tmp_path, suffix, codec, bits):
    """PowerShell's ``>`` writes UTF-16 with a byte-order mark: one error for the file, with the right iconv. A
    UTF-32 file is named UTF-32 (little-endian, its mark starts with UTF-16-LE's and was named UTF-16, whose iconv
    garbles it)."""
    p = tmp_path / f"ps{suffix}"
    bom = {"utf-16-be": codecs.BOM_UTF16_BE, "utf-32-be": codecs.BOM_UTF32_BE}.get(codec, b"")
    p.write_bytes(bom + '{"text": "a"}\n'.encode(codec))
    with pytest.raises(DataError, match=rf"^{p}: UTF-{bits} \(it starts with a UTF-{bits} byte-order mark\).*"
                                        rf"iconv -f utf-{bits} "):
        read_file(p)


def test_carriage_return_line_endings_are_named(tmp_path):
    p = tmp_path / "mac.jsonl"
    p.write_bytes(b'{"text": "a"}\r{"text": "b"}\r')  # classic Mac line ends: one line of two objects
    rec = read_file(p)[0]
    assert rec.data is None and "lines end in a bare carriage return" in rec.error
