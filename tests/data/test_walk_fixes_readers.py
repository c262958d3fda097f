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
