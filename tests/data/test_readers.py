"""Readers (no tokenizer needed): valid input that naive line splitting gets wrong, symlinked directories and
dangling links, a .json holding one object, JSON arrays with missing or extra commas, short CSV rows, long CSV
cells and CSV line numbers, pipes, data-like files a directory walk does not read, and a missing pyarrow."""

import codecs
import csv
import json
import logging
import re

import pytest

from chronicals.data.files import resolve_files
from chronicals.data.readers import DataError, iter_records, read_file


def test_jsonl_keeps_unicode_line_separators_inside_strings(tmp_path):
    # JSON allows U+2028 / U+2029 / U+0085 unescaped in strings; json.dumps(ensure_ascii=False) writes them raw
    rows = [{"text": "a\u2028b"}, {"text": "c\u2029d\x85e"}, {"text": "plain"}]
    p = tmp_path / "u.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    recs = read_file(p)
    assert [r.error for r in recs] == [None] * 3
    assert [r.data for r in recs] == rows
    assert [r.where for r in recs] == [f"{p}:{i}" for i in (1, 2, 3)]


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
            "more; a data directory is read for .jsonl, .json, .parquet, .arrow, .csv files only") in warned[0]
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
    assert [r.error for r in recs] == [None, "1 field, expected 2 (the header's columns)",
                                       "3 fields, expected 2 (the header's columns)", None]
    assert recs[1].where == f"{p}:3" and recs[3].data == {"prompt": "", "completion": ""}


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


def test_a_data_path_starting_with_tilde_is_under_the_home_directory(tmp_path, monkeypatch):
    """data.path=~/train.jsonl quoted (the shell left the ~) names $HOME/train.jsonl, a file or a directory, not a
    relative folder called '~' ("no such file or directory")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _chat(tmp_path / "train.jsonl")
    (tmp_path / "d").mkdir()
    _chat(tmp_path / "d" / "x.jsonl")
    assert resolve_files("~/train.jsonl") == [tmp_path / "train.jsonl"]
    assert resolve_files(["~/d"]) == [tmp_path / "d" / "x.jsonl"]


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
    """The array reader skipped commas and whitespace alike: [{...} {...}] and [{...},,{...}] read silently. Reading
    cannot go on past such an error, so it stops the load whatever on_error (test_input_advice.py has why)."""
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:{line}: invalid JSON array: {re.escape(says)}; a "
                                        "JSON array cannot be read past a syntax error"):
        read_file(path)


def test_a_well_formed_json_array_still_reads(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"text": "a"} ,\n  {"text": "b"}\n]\n')
    got = [(r.where.rsplit(":", 1)[1], r.data) for r in read_file(path)]
    assert got == [("2", {"text": "a"}), ("3", {"text": "b"})]
    path.write_text("[ ]")
    assert read_file(path) == []


@pytest.mark.parametrize("text, line", [
    ('[\n{"text": "a"},\n{"text": "b"},\n', 4),  # cut off after a comma (a download stopped between elements)
    ('[\n{"text": "a"},\n{"text": "b"}\n\n', 5),  # cut off before the ']': named at the end, not at "b"'s line
    ('[{"text": "a"}', 1),
])
def test_a_json_array_cut_off_before_its_closing_bracket_is_a_bad_record_at_the_end(tmp_path, text, line):
    """The records read so far, then a bad record at the file's last line saying the array is not closed: a
    truncated file is not read as if it were whole."""
    path = tmp_path / "a.json"
    path.write_text(text)
    recs = read_file(path)
    assert [r.data for r in recs[:-1]] == [{"text": "a"}, {"text": "b"}][:len(recs) - 1]
    assert (recs[-1].where, recs[-1].data) == (f"{path}:{line}", None)
    assert recs[-1].error == "JSON array not closed; expected ']' at the end"


def test_a_json_array_after_leading_blank_lines_is_read(tmp_path):
    """Blank lines and spaces before the '[' are skipped and each record keeps its own line; not skipped, the whole
    array was read as one element ("a JSON list in the array")."""
    path = tmp_path / "a.json"
    path.write_text('\n\n  [\n{"text": "a"},\n{"text": "b"}\n]\n')
    assert [(r.where, r.data, r.error) for r in read_file(path)] == [(f"{path}:4", {"text": "a"}, None),
                                                                    (f"{path}:5", {"text": "b"}, None)]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "json", "csv"])
def test_records_are_made_as_they_are_read(tmp_path, suffix):
    """A file's records were all made at once (parquet: the table's to_pylist, ~27x the file; jsonl: ~5x; a data walk
    at scale): taken one at a time, a file's records never all live together. JSON lines and CSV are read a line at
    a time, not as the file's whole bytes (a 10 GB .jsonl took 10 GB of memory before its first record); a .json
    array's text is still decoded whole (one JSON value), its records are not held."""
    import csv
    import tracemalloc

    rows = [{"text": f"record number {i} " + "word " * 20} for i in range(20_000)]
    path = tmp_path / f"d.{suffix}"
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1_000)
    elif suffix == "json":
        path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    elif suffix == "csv":
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text"])
            w.writerows([r["text"]] for r in rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    held = peak(lambda: list(iter_records(path)))
    streamed = peak(lambda: sum(1 for _ in iter_records(path)))
    assert streamed * (4 if suffix == "parquet" else 2) < held, (streamed, held)
    if suffix in ("jsonl", "csv"):  # not the file's bytes at once either
        assert streamed * 8 < path.stat().st_size, (streamed, path.stat().st_size)


def _arrow(path, rows: int, kind: str) -> None:
    pa = pytest.importorskip("pyarrow")
    table = pa.Table.from_pylist([{"text": f"row {i}"} for i in range(rows)])
    new = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=100)


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_an_arrow_files_every_batch_is_read_and_rows_numbered_across_batches(tmp_path, kind):
    """datasets writes the IPC stream format; pyarrow's own writers also the file format, read by the fallback.
    Every record batch is read, and a row's "file:row N" counts on across batches (what a bad row's error says)."""
    path = tmp_path / "d.arrow"
    _arrow(path, 250, kind)
    recs = read_file(path)
    assert len(recs) == 250 and recs[-1].data == {"text": "row 249"}
    assert [r.where for r in recs[99:101]] == [f"{path}:row 100", f"{path}:row 101"]
    assert recs[-1].where == f"{path}:row 250"


def test_a_truncated_arrow_stream_is_a_data_error(tmp_path):
    """An interrupted copy: pyarrow raises a plain OSError ("Expected to be able to read N bytes"), said as the
    file's error with the fix, not a traceback."""
    from chronicals.data import DataError

    path = tmp_path / "s.arrow"
    _arrow(path, 2500, "stream")
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(DataError, match="not a readable arrow file"):
        read_file(path)


@pytest.mark.parametrize("lead", [b"", codecs.BOM_UTF8, codecs.BOM_UTF8 + b"\n", b"\n\n \n"],
                         ids=["plain", "bom", "bom-blank-line", "blank-lines"])
def test_a_pretty_printed_array_in_a_jsonl_is_named_through_a_bom_and_blank_lines(tmp_path, lead):
    """One JSON array spread over lines under a .jsonl name is one DataError saying so, also after a byte-order
    mark and blank lines (BOM + blank line gave an 'invalid JSON' per line: a mutation walk)."""
    p = tmp_path / "x.jsonl"
    p.write_bytes(lead + json.dumps([{"prompt": "a", "completion": "b"}], indent=1).encode())
    with pytest.raises(DataError, match="one JSON array spread over lines"):
        read_file(p)


def test_line_one_of_a_bom_file_counts_the_bom_in_its_byte_offset_and_csv_keeps_quoted_crlf(tmp_path):
    """Byte offsets are the file's (the 3 BOM bytes included); a quoted CSV cell keeps its "\\r\\n" (universal
    newlines would make it "\\n")."""
    p = tmp_path / "b.jsonl"
    p.write_bytes(codecs.BOM_UTF8 + b'{"text": "\xff"}\n')
    (rec,) = read_file(p)
    assert rec.data is None and "not valid UTF-8 at byte 13" in rec.error, rec.error
    c = tmp_path / "c.csv"
    c.write_bytes(b'prompt,completion\r\n"line1\r\nline2",ok\r\n')
    assert [r.data for r in read_file(c)] == [{"prompt": "line1\r\nline2", "completion": "ok"}]


@pytest.mark.parametrize("name, body, line, byte", [
    ("c.csv", b"text\n\xe9t\n", 2, 8),  # the BOM's 3 bytes + "text\n": the bad byte opens line 2
    ("c.json", b'[\n\xe9]', 2, 5),
])
def test_a_bad_byte_of_a_bom_file_is_named_at_its_line_and_file_offset(tmp_path, name, body, line, byte):
    """.csv and .json are decoded whole: with a BOM, the line and byte offset of a byte that is not UTF-8 are
    counted in the file as it is on disk, BOM included (as the .jsonl reader does, above)."""
    p = tmp_path / name
    p.write_bytes(codecs.BOM_UTF8 + body)
    with pytest.raises(DataError, match=rf"^{p}:{line}: not valid UTF-8 at byte {byte} "):
        read_file(p)


def test_a_bom_at_the_start_of_a_later_json_line_is_a_bad_record_there(tmp_path):
    """A byte-order mark counts only at the start of the file (utf-8-sig): one at a later line (cat a.jsonl b.jsonl,
    b saved by Notepad) is a bad record at that line naming the BOM, so the seam is reported, not read past."""
    p = tmp_path / "joined.jsonl"
    p.write_bytes(codecs.BOM_UTF8 + b'{"text": "a"}\n' + codecs.BOM_UTF8 + b'{"text": "b"}\n{"text": "c"}\n')
    recs = read_file(p)
    assert [r.data for r in recs] == [{"text": "a"}, None, {"text": "c"}]
    assert recs[1].where == f"{p}:2" and "BOM" in recs[1].error


def test_a_json_line_that_is_not_an_object_is_a_record_error(tmp_path):
    """A .jsonl line holding a string, number, true or null is a bad record naming its line (skipped and counted
    under on_error=skip): read as a record, format detection crashed with AttributeError and no line."""
    p = tmp_path / "d.jsonl"
    p.write_text('"hello"\n3\ntrue\nnull\n{"text": "ok"}\n')
    recs = read_file(p)
    assert [r.data for r in recs] == [None, None, None, None, {"text": "ok"}]
    assert [r.error.split(",")[0] for r in recs[:4]] == ["a JSON str", "a JSON int", "a JSON bool", "a JSON NoneType"]
    assert [r.where for r in recs] == [f"{p}:{i}" for i in range(1, 6)]


def test_an_element_of_a_json_array_that_is_not_an_object_is_a_record_error(tmp_path):
    """As a .jsonl line: an int, string or list element of a .json array is a bad record at its line. Accepted, its
    data was an int or a str, which later code took for a dict and failed on far from the file and line."""
    p = tmp_path / "d.json"
    p.write_text('[\n{"text": "a"},\n5,\n"b",\n[{"text": "c"}]\n]\n')
    recs = read_file(p)
    assert [(r.where, r.data) for r in recs] == [(f"{p}:{i}", d) for i, d in [(2, {"text": "a"}), (3, None),
                                                                               (4, None), (5, None)]]
    assert [r.error for r in recs[1:]] == [f"a JSON {t} in the array, expected objects" for t in ("int", "str", "list")]


def test_whitespace_only_lines_in_json_lines_are_blank(tmp_path):
    """Spaces, a tab or a lone '\\r' (a CRLF file's blank line) is a blank line, not one "invalid JSON" record that
    on_error=fail (the default) refuses the whole file for."""
    p = tmp_path / "crlf.jsonl"
    p.write_bytes(b'{"text": "a"}\r\n\r\n   \n\t\n{"text": "b"}\r\n')
    assert [(r.where, r.data, r.error) for r in read_file(p)] == [(f"{p}:1", {"text": "a"}, None),
                                                                  (f"{p}:5", {"text": "b"}, None)]


@pytest.mark.parametrize("name", ["UP.JSONL", "UP.Json", "UP.CSV", "UP.PARQUET", "UP.Arrow"])
def test_upper_case_suffixes_are_read_as_their_format(tmp_path, name):
    """resolve_files takes TRAIN.JSONL (any case); reading must use the same case-blind suffix, or a .JSONL or
    .PARQUET (Windows tools write such names) went to the arrow reader and was refused as damaged."""
    p = tmp_path / name
    if name.endswith("CSV"):
        p.write_text("text\nrow 0\nrow 1\n")
    elif name.endswith("PARQUET"):
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": ["row 0", "row 1"]}), p)
    elif name.endswith("Arrow"):
        _arrow(p, 2, "stream")
    else:
        p.write_text('{"text": "row 0"}\n{"text": "row 1"}\n')
    assert resolve_files(tmp_path) == [p]
    recs = read_file(p)
    assert [r.data for r in recs] == [{"text": "row 0"}, {"text": "row 1"}]


def test_a_link_to_a_folder_above_the_data_reads_each_file_once(tmp_path):
    """data/up -> .. : a file under a symlinked directory is reached through a link even where its own entry is
    none, so data/'s files are not read a second time through up/data/."""
    d = tmp_path / "data"
    d.mkdir()
    _chat(d / "a.jsonl")
    (d / "up").symlink_to(tmp_path)
    assert resolve_files(d) == [d / "a.jsonl"]


def test_a_loop_inside_a_linked_folder_outside_the_tree_ends(tmp_path):
    """A link loop inside a shared folder outside the data tree (shared/again -> shared, reached through data/s)
    is walked once: it went round until the OS refused the path (ELOOP), and the file came back 39 levels deep."""
    shared = tmp_path / "shared"
    shared.mkdir()
    _chat(shared / "s.jsonl")
    (shared / "again").symlink_to(shared)
    d = tmp_path / "data"
    d.mkdir()
    (d / "s").symlink_to(shared)
    assert resolve_files(d) == [d / "s" / "s.jsonl"]


def test_a_link_into_a_hidden_folder_of_the_data_is_read(tmp_path):
    """Hidden folders are not walked, so a link into one (train.jsonl -> .versions/v3.jsonl, latest -> .snapshots/v2)
    is the only way to their files: read through the link. Walking hidden folders in the duplicate check took the
    link for a second path to a file read directly and dropped it: fewer files, or "holds no data files"."""
    d = tmp_path / "data"
    (d / ".versions").mkdir(parents=True)
    _chat(d / ".versions" / "v3.jsonl")
    _chat(d / "other.jsonl")
    (d / "train.jsonl").symlink_to(".versions/v3.jsonl")
    assert resolve_files(d) == [d / "other.jsonl", d / "train.jsonl"]
    e = tmp_path / "snap"
    (e / ".snapshots" / "v2").mkdir(parents=True)
    _chat(e / ".snapshots" / "v2" / "part-0.jsonl")
    (e / "latest").symlink_to(".snapshots/v2")
    assert resolve_files(e) == [e / "latest" / "part-0.jsonl"]


def test_a_saved_dataset_listing_no_files_is_named(tmp_path):
    """A datasets.save_to_disk directory whose state.json lists no '_data_files' says so, also nested in a data
    directory, where it contributed nothing without a word."""
    d = tmp_path / "data"
    (d / "saved").mkdir(parents=True)
    (d / "saved" / "state.json").write_text('{"_data_files": []}')
    _chat(d / "a.jsonl")
    with pytest.raises(DataError, match="no '_data_files' listed"):
        resolve_files(d)


def test_a_saved_dataset_missing_a_listed_shard_is_named(tmp_path):
    """A save_to_disk directory whose copy stopped partway (state.json there, a listed arrow shard not) is a
    DataError naming state.json and the missing shard, directly and nested: it was a bare FileNotFoundError from
    load_dataset's size sum, which `chronicals train` did not catch."""
    sv = tmp_path / "data" / "saved"
    sv.mkdir(parents=True)
    (sv / "data-00000-of-00002.arrow").write_bytes(b"")
    (sv / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                                {"filename": "data-00001-of-00002.arrow"}]}))
    for where in (sv, sv.parent):
        with pytest.raises(DataError, match=rf"{sv / 'state.json'}: lists 1 arrow file this directory lacks "
                                            r"\(data-00001-of-00002.arrow\); copy the whole"):
            resolve_files(where)


def test_a_saved_dataset_naming_files_outside_it_is_refused(tmp_path):
    """state.json's '_data_files' names are joined to the directory: an absolute name or one with '..' read a file
    elsewhere (here another dataset's shard) as this dataset's, without a word."""
    sv = tmp_path / "saved"
    sv.mkdir()
    (tmp_path / "other.arrow").write_bytes(b"")
    for name in (str(tmp_path / "other.arrow"), "../other.arrow"):
        (sv / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
        with pytest.raises(DataError, match=rf"{sv / 'state.json'}: '_data_files' names files outside this "
                                            r"directory \(.*other.arrow\); save_to_disk lists"):
            resolve_files(sv)


def test_a_header_with_two_unnamed_columns_is_refused(tmp_path):
    """Two empty header cells (a spreadsheet's trailing ',,') are a duplicate column name too: a dict keeps one ''
    column, and the other's cells were lost."""
    p = tmp_path / "t.csv"
    p.write_text("prompt,completion,,\nq,a,note 1,note 2\n")
    with pytest.raises(DataError, match=rf"{p}:1: column '' appears 2 times in the header"):
        read_file(p)


def test_the_bare_cr_hint_is_only_for_bare_cr_lines(tmp_path):
    """A CRLF line with two objects is "Extra data"; its '\\r' is only the line end, so no hint sends the user to
    convert line endings that are fine."""
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"text": "a"} {"text": "b"}\r\n')
    (rec,) = read_file(p)
    assert rec.error.startswith("invalid JSON (Extra data") and "carriage return" not in rec.error
