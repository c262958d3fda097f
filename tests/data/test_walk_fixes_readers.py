"""Reader fixes from the data-journey walk: symlinked directories, a .json holding one object, short CSV
rows, and data-like files a directory walk does not read."""

import json
import logging

import pytest

from chronicals.data.readers import DataError, read_file, resolve_files


def _chat(path, n=2):
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(n)))
    return path


def test_symlinked_directory_is_read_once_at_its_real_path(tmp_path, caplog):
    v2 = tmp_path / "vdir" / "v2"
    v2.mkdir(parents=True)
    _chat(v2 / "train.jsonl")
    (tmp_path / "vdir" / "latest").symlink_to("v2")  # sorts before v2: the walk reaches the link first
    (v2 / "alias.jsonl").symlink_to("train.jsonl")  # a file link to a file read directly
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        assert resolve_files(tmp_path / "vdir") == [v2 / "train.jsonl"]
    assert "2 entries reached again through a symlink, not read twice" in caplog.text
    # the link alone (nothing reaches v2 directly) is read through the link
    assert resolve_files(tmp_path / "vdir" / "latest") == [tmp_path / "vdir" / "latest" / "train.jsonl"]


def test_symlink_loop_ends(tmp_path):
    d = tmp_path / "ldir"
    d.mkdir()
    _chat(d / "chat.jsonl")
    (d / "loop").symlink_to(d)  # back to the top: was read 41 times (until ELOOP)
    assert resolve_files(d) == [d / "chat.jsonl"]
    e = tmp_path / "edir"
    (e / "sub").mkdir(parents=True)
    _chat(e / "sub" / "chat.jsonl")
    (e / "sub" / "up").symlink_to("..")  # back to the parent
    assert resolve_files(e) == [e / "sub" / "chat.jsonl"]


def test_symlink_outside_the_tree_is_read_once(tmp_path):
    outside = tmp_path / "shared"
    outside.mkdir()
    _chat(outside / "s.jsonl")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a").symlink_to(outside)
    (d / "b").symlink_to(outside)  # two links to one directory outside
    assert resolve_files(d) == [d / "a" / "s.jsonl"]


def test_unread_data_like_files_are_named_in_a_warning(tmp_path, caplog):
    d = tmp_path / "gzdir"
    d.mkdir()
    _chat(d / "part-0.jsonl")
    for name in ("part-1.jsonl.gz", "part-2.jsonl.zst", "notes.txt", "t.tsv", "README.md"):
        (d / name).write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        assert resolve_files(d) == [d / "part-0.jsonl"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert (f"{d}: 4 files not read: {d / 'notes.txt'}, {d / 'part-1.jsonl.gz'}, {d / 'part-2.jsonl.zst'} and 1 "
            "more; a data directory is read for .jsonl, .json, .parquet, .csv files only") in warned[0]
    assert "README" not in warned[0]


def test_json_file_holding_one_object_is_named_not_read_per_line(tmp_path):
    p = tmp_path / "wrapped.json"
    p.write_text(json.dumps({"data": [{"text": "a"}, {"text": "b"}]}, indent=2))
    with pytest.raises(DataError, match=rf"^{p}: a JSON object, expected an array of records .* or JSON lines "
                                        r".*; the records may be under key 'data': extract them to a \.jsonl"):
        read_file(p)
    p.write_text(json.dumps({"data": [{"text": "a"}]}))  # on one line (json.dump's default) too
    with pytest.raises(DataError, match="under key 'data'"):
        read_file(p)
    p.write_text(json.dumps({"text": "single"}, indent=2))  # one record, pretty-printed
    with pytest.raises(DataError, match=rf"^{p}: a JSON object, .*; if it is one record, write it on one line"):
        read_file(p)
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    p.write_text(json.dumps(chat, indent=2))  # messages are not "the records"
    with pytest.raises(DataError, match="if it is one record") as e:
        read_file(p)
    assert "under key" not in str(e.value)


def test_json_lines_under_a_json_name_still_read(tmp_path):
    p = tmp_path / "l.json"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    for rows in ([{"text": "one"}], [{"text": "a"}, {"text": "b"}], [chat]):
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert [r.data for r in read_file(p)] == rows
    p.write_text('{"text": "a"}\n{"text": \n')  # a damaged line is still one bad record, by line
    recs = read_file(p)
    assert recs[0].data == {"text": "a"} and recs[1].where == f"{p}:2" and "invalid JSON" in recs[1].error


def test_csv_row_with_too_few_fields_is_counted_like_too_many(tmp_path):
    p = tmp_path / "short.csv"
    p.write_text('prompt,completion\nok,fine\nshort row\na,b,c\n"",\n')
    recs = read_file(p)
    assert [r.error for r in recs] == [None, "1 fields, expected 2 (the header's columns)",
                                       "3 fields, expected 2 (the header's columns)", None]
    assert recs[1].where == f"{p}:3" and recs[3].data == {"prompt": "", "completion": ""}


def test_qa_heldout_in_csv_or_a_directory_says_to_convert(tmp_path):
    from chronicals.train.qa import read_qa

    p = tmp_path / "qa.csv"
    p.write_text("question,answer\nCapital of France?,Paris\n")
    with pytest.raises(DataError, match=rf"^{p}: question/answer held-out records are read from \.jsonl or "
                                        rf"\.json only; convert {p} "):
        read_qa(p)
    d = tmp_path / "qa_dir"
    d.mkdir()
    (d / "part-0.jsonl").write_text(json.dumps({"question": "a?", "answer": "b"}) + "\n")
    with pytest.raises(DataError, match=rf"^{d}: question/answer .*not a directory; set data.eval_path to "
                                        rf"{d / 'part-0.jsonl'} itself$"):
        read_qa(d)
    (d / "part-0.jsonl").write_text(json.dumps({"text": "plain held-out text"}) + "\n")  # not QA: read as data
    assert read_qa(d) is None
    p.write_text("prompt,completion\na,b\n")
    assert read_qa(p) is None and read_qa(tmp_path / "missing.csv") is None
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    q = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": ["a?"], "answer": ["b"]}), q)
    with pytest.raises(DataError, match=rf"^{q}: question/answer held-out records are read from"):
        read_qa(q)


def test_missing_pyarrow_is_found_before_the_model_loads(tmp_path, monkeypatch):
    import sys

    from chronicals.config import load_config
    from chronicals.train import train
    from chronicals.train.guards import check_data_paths

    t = tmp_path / "t.parquet"
    t.write_bytes(b"PAR1")  # never opened: the import fails first
    sv = tmp_path / "dir" / "sub" / "saved"
    sv.mkdir(parents=True)
    (sv / "data-00000-of-00001.arrow").write_bytes(b"x")
    _chat(tmp_path / "dir" / "a.jsonl")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError, installed or not
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError) as reader:
        read_file(t)

    def cfg(*args):
        return load_config(None, ["model.path=/nonexistent/model", f"train.out_dir={tmp_path / 'run'}", *args])

    with pytest.raises(DataError) as early:
        check_data_paths(cfg(f"data.path={t}"))
    assert str(early.value) == str(reader.value) == (f"{t}: reading .parquet files needs pyarrow; pip install "
                                                     "'chronicals[data]'")
    with pytest.raises(DataError, match=rf"^{sv / 'data-00000-of-00001.arrow'}: reading \.arrow files needs pyarrow"):
        check_data_paths(cfg(f"data.path={_chat(tmp_path / 'ok.jsonl')}", f"data.eval_path={tmp_path / 'dir'}"))
    with pytest.raises(DataError, match="needs pyarrow"):  # not "/nonexistent/model: no such model"
        train(cfg(f"data.path={t}"))
    assert not (tmp_path / "run").exists()
    check_data_paths(cfg(f"data.path={tmp_path / 'ok.jsonl'}"))  # no parquet, no complaint
