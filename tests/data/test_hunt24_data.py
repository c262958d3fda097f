"""Session 24's data-path hunt: null fields in auto-detection (parquet's filled-in columns), long CSV cells and
CSV line numbers, a tokenization cache inside the data directory, a data file's dangling symlink, ds[-1]."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from chronicals.data import DataError, TokenizedDataset
from chronicals.data.dataset import DatasetStats
from chronicals.data.formats import FormatError, detect_format
from chronicals.data.readers import read_file, resolve_files
from chronicals.config import from_dict
from chronicals.train.guards import check_data_paths


def test_null_fields_do_not_decide_the_format():
    assert detect_format({"text": "hello", "messages": None}) == "text"
    assert detect_format({"prompt": "a", "completion": "b", "text": None, "messages": None}) == "prompt_completion"
    assert detect_format({"messages": None}) == "chat"  # then read as chat: "field 'messages' is null"
    with pytest.raises(FormatError, match=r"cannot tell the format from fields \['body'\]"):
        detect_format({"body": None})


def test_a_mixed_parquet_file_reads_as_its_jsonl_does(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": ["hello", None], "messages": [None, [{"role": "user", "content": "hi"}]]})
    pq.write_table(table, tmp_path / "mixed.parquet")  # a column per field: each record's missing ones are null
    got = [detect_format(r.data) for r in read_file(tmp_path / "mixed.parquet")]
    assert got == ["text", "chat"]


def test_a_csv_cell_longer_than_the_csv_modules_default_limit_is_read(tmp_path):
    path = tmp_path / "long.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["text"], ["short"], ["word " * 40000]])
    recs = read_file(path)
    assert [r.error for r in recs] == [None, None] and len(recs[1].data["text"]) == 200000


def test_csv_rows_are_named_by_the_line_they_start_on(tmp_path):
    path = tmp_path / "blank.csv"
    path.write_text("text\nhello\n\n\nworld,x\n\"two\nlines\"\nend\n")
    recs = read_file(path)
    assert [r.where.rsplit(":", 1)[1] for r in recs] == ["2", "5", "6", "8"]
    assert recs[1].error.startswith("2 fields, expected 1") and recs[2].data == {"text": "two\nlines"}
    bad = tmp_path / "bad.csv"
    bad.write_text('text\na\nb\n"a"b\nc\n')
    with pytest.raises(DataError, match=rf"{bad.name}:4: malformed CSV"):
        read_file(bad)


@pytest.mark.parametrize("inside", [True, False])
def test_a_cache_dir_inside_the_data_directory_is_refused_before_the_model_loads(tmp_path, inside):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    cache = data / "cache" if inside else tmp_path / "cache"
    cfg = from_dict({"data": {"path": str(data), "cache_dir": str(cache)}, "train": {"out_dir": str(tmp_path / "run")}})
    if inside:  # its meta.json would be read as a data file by the next run
        with pytest.raises(ValueError, match=r"data.cache_dir=.* is inside data.path=.*put data.cache_dir outside"):
            check_data_paths(cfg)
        return
    check_data_paths(cfg)
    cache.write_text("a file")  # said before the model loads (it was said after)
    with pytest.raises(ValueError, match=r"data.cache_dir=.* is a file, not a directory"):
        check_data_paths(cfg)


def test_a_data_files_dangling_symlink_is_an_error_not_a_lost_shard(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    (d / "shard1.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    (d / "shard2.jsonl").symlink_to(tmp_path / "missing" / "shard2.jsonl")
    (d / "notes.md").symlink_to(tmp_path / "missing" / "notes.md")  # not a data file: not our business
    with pytest.raises(DataError, match=r"shard2.jsonl: a symlink to .*missing/shard2.jsonl, which does not exist"):
        resolve_files([str(d)])
    (d / "shard2.jsonl").unlink()
    assert [p.name for p in resolve_files([str(d)])] == ["shard1.jsonl"]


def test_a_dataset_indexes_like_a_list():
    ids = np.arange(1, 11, dtype=np.int32)
    ds = TokenizedDataset(ids, np.ones(10, bool), np.array([0, 3, 10]), 0, DatasetStats(), 16)
    assert ds[-1][0].tolist() == list(range(4, 11)) and ds[-2][0].tolist() == [1, 2, 3]
    assert [d[0].tolist() for d in ds] == [[1, 2, 3], list(range(4, 11))]
    for i in (2, -3):
        with pytest.raises(IndexError, match=f"document {i} of a dataset of 2"):
            ds[i]


def test_a_cache_hit_names_the_files_by_this_runs_names(tmp_path, tokenizer):
    """The cache is keyed by the files' contents: after `mv old.jsonl new.jsonl` the entry's "file:line" of the
    first bad record named old.jsonl, a file that no longer exists."""
    from chronicals.data import load_dataset

    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"txt": "x"}) + "\n")
    kw = dict(max_seq_len=32, on_error="skip", cache_dir=tmp_path / "cache")
    first = load_dataset([str(old)], tokenizer, **kw)
    assert first.stats.first_errors[0].startswith(f"{old}:2: ")
    old.rename(new)
    again = load_dataset([str(new)], tokenizer, **kw)  # a cache hit
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert again.stats.first_errors == [e.replace(str(old), str(new), 1) for e in first.stats.first_errors]


def test_a_cache_entry_damaged_within_its_shape_is_rebuilt(tmp_path, tokenizer, caplog):
    """Zeroed trainable masks (same shape and dtype) passed the entry's checks: a step trained on 0 loss tokens."""
    import logging

    from chronicals.data import load_dataset

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(4)))
    kw = dict(max_seq_len=32, cache_dir=tmp_path / "cache")
    first = load_dataset([str(data)], tokenizer, **kw)
    [entry] = list((tmp_path / "cache").iterdir())
    masks = np.load(entry / "trainable.npy")
    assert masks.any()
    np.save(entry / "trainable.npy", np.zeros_like(masks))
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        again = load_dataset([str(data)], tokenizer, **kw)
    assert "is damaged (the arrays do not match the digest written with them" in caplog.text
    assert np.array_equal(again.trainable, first.trainable)


def test_a_pipe_as_data_says_what_to_do(tmp_path):
    """data.path=<(cat a.jsonl) said "[Errno 20] Not a directory: '/dev/fd/63'"."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"pipe: not a regular file or a directory \(a pipe\?\).*write it to a file"):
        resolve_files([str(fifo)])


@pytest.mark.parametrize("text, line, says", [
    ('[{"text": "a"}\n {"text": "b"}]', 2, "expected ',' or ']' after an element"),
    ('[{"text": "a"},\n,{"text": "b"}]', 2, "a ',' with no element after it"),
    ('[{"text": "a"},\n]', 2, "a ',' with no element after it"),
    ('[,{"text": "a"}]', 1, "a ',' before the first element"),
])
def test_a_json_array_with_missing_or_extra_commas_is_invalid(tmp_path, text, line, says):
    """The array reader skipped commas and whitespace alike: [{...} {...}] and [{...},,{...}] read silently."""
    path = tmp_path / "a.json"
    path.write_text(text)
    recs = read_file(path)
    assert recs[-1].where == f"{path}:{line}" and recs[-1].error == f"invalid JSON array: {says} (reading stops here)"
    assert [r.data for r in recs[:-1]] == [{"text": "a"}][:len(recs) - 1]


def test_a_well_formed_json_array_still_reads(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"text": "a"} ,\n  {"text": "b"}\n]\n')
    got = [(r.where.rsplit(":", 1)[1], r.data) for r in read_file(path)]
    assert got == [("2", {"text": "a"}), ("3", {"text": "b"})]
    path.write_text("[ ]")
    assert read_file(path) == []
