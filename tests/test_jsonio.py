"""read_json_object: every way a small JSON file can fail names the file, what is wrong, and the caller's fix."""

import json
import os
import re
import time
from pathlib import Path

import pytest

from chronicals import _jsonio
from chronicals._jsonio import atomic_open, json_kind, read_json_object, temp_beside, write_text_atomic
from chronicals.data.readers import DataError

FIX = "copy the thing again"


def _read(path, **kw):
    return read_json_object(path, "thing.json", FIX, **kw)


def test_an_object_is_returned(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"a": [1, 2], "b": null}')
    assert _read(p) == {"a": [1, 2], "b": None}
    assert _read(str(p)) == {"a": [1, 2], "b": None}  # a str path too


def test_a_utf8_byte_order_mark_is_ignored(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b"\xef\xbb\xbf" + '{"\u00e9": 1}'.encode())  # Notepad's UTF-8
    assert _read(p) == {"\u00e9": 1}


def test_missing_file_is_file_not_found_with_the_missing_hint(tmp_path):
    p = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(p))}: not found; {FIX}$"):
        _read(p)
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(p))}: not found; a directory needs one$"):
        _read(p, missing="a directory needs one", error=DataError)  # FileNotFoundError whatever `error` is


def test_a_directory_says_so(tmp_path):
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: is a directory, not a file; {FIX}$"):
        _read(tmp_path)
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path))}: is a directory, not a file; a dir needs one$"):
        _read(tmp_path, missing="a dir needs one", error=DataError)


def test_an_unreadable_file_says_why(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    p.write_text("{}")

    def denied(self):  # chmod 0 does not bind under root, where the tests may run
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: cannot read it \(Permission denied\); "
                                         rf"check that it is a readable file, or {FIX}$"):
        _read(p)
    with pytest.raises(DataError, match=rf"^{re.escape(str(p))}: cannot read it"):  # the caller's class here too
        _read(p, error=DataError)


def test_not_utf8_gives_line_byte_and_both_fixes(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b'{\n"a": "caf\xe9"}')  # Latin-1 e-acute on line 2, byte 11
    bad = re.escape(repr(b'\xe9"}'))  # the bad byte and what follows it, to find it in an editor
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}:2: not UTF-8 text \(byte 11: invalid continuation "
                                         rf"byte, {bad}\), so not a valid thing\.json; re-encode it as UTF-8 \(e\.g\. "
                                         rf"iconv .*\), or {FIX}$"):
        _read(p)
    p.write_bytes(b"\xef\xbb\xbf\xff")  # the offset counts the byte-order mark
    with pytest.raises(ValueError, match=r":1: not UTF-8 text \(byte 3: invalid start byte"):
        _read(p)
    p.write_bytes(b'{\n"a": "caf\xe9",\n"b": 1\n}\n')  # lines after the bad byte are not counted
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}:2: not UTF-8 text \(byte 11:"):
        _read(p)


def test_invalid_json_gives_line_and_column(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"a": 1,\n  "b": }')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}:2: invalid JSON \(Expecting value at column 8\); "
                                         rf"fix the file, or {FIX}$"):
        _read(p)


def test_too_deep_and_too_long_a_number(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: nested too deeply .*, so not a valid thing\.json; "
                                         rf"fix the file, or {FIX}$"):
        _read(p)
    p.write_text('{"a": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: a number of more than 4300 digits .*write it as "
                                         rf"a string, or {FIX}$"):
        _read(p)


@pytest.mark.parametrize("text,kind", [("[1, 2]", "array"), ("null", "null"), ('"x"', "string"), ("3.5", "number"),
                                       ("3", "number"), ("true", "true/false")])
def test_a_value_that_is_no_object(tmp_path, text, kind):
    p = tmp_path / "a.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: a JSON {kind}, not an object, so not a valid "
                                         rf"thing\.json; fix the file, or {FIX}$"):
        _read(p)
    assert json_kind(json.loads(text)) == kind


def test_errors_take_the_callers_class(tmp_path):
    p = tmp_path / "a.json"
    for text in ("[1]", "{bad", "\xff", '{"a": ' + "9" * 5000 + "}"):  # the too-long number too, not a ValueError
        p.write_bytes(text.encode("latin-1"))
        with pytest.raises(DataError, match=rf"^{re.escape(str(p))}"):
            _read(p, error=DataError)


def test_a_name_one_byte_too_long_for_its_plain_temporary_is_written(tmp_path):
    """A valid name one byte too long for '.' + name + '.tmp-<pid>' to fit NAME_MAX: its temporary is named
    shorter, not refused with 'File name too long' (after minutes of scoring, for eval --json)."""
    suffix = f".tmp-{os.getpid()}"
    target = tmp_path / ("a" * (_jsonio.NAME_MAX - len(suffix) - len(".json")) + ".json")
    write_text_atomic(target, "whole\n")
    assert len(temp_beside(target).name.encode()) <= _jsonio.NAME_MAX
    assert target.read_text() == "whole\n" and os.listdir(tmp_path) == [target.name]


def test_a_long_non_ascii_name_is_measured_and_cut_in_bytes(tmp_path):
    """NAME_MAX counts bytes: a 250-byte name of 124 characters needs a shortened temporary, and the cut at 200 bytes,
    inside a two-byte character here, drops that character rather than failing to decode."""
    target = tmp_path / ("a" + "\u00e9" * 122 + ".json")
    assert len(target.name.encode()) == 250
    write_text_atomic(target, "whole\n")
    assert len(temp_beside(target).name.encode()) <= _jsonio.NAME_MAX
    assert target.read_text() == "whole\n" and os.listdir(tmp_path) == [target.name]


def test_fitting_name_keeps_a_name_that_fits_exactly_and_hashes_the_whole_name(tmp_path):
    """A name whose temporary is exactly NAME_MAX bytes is kept (the limit is inclusive); one byte more is shortened.
    Two long names sharing their first 200+ bytes get different stems: hashing only a prefix made their temporaries
    collide, so one write's temporary could replace the other's target."""
    name = "a" * (_jsonio.NAME_MAX - 10)
    assert _jsonio.fitting_name(name, 10) == name and _jsonio.fitting_name(name + "b", 10) != name + "b"
    a, b = "p" * 240 + "-one.json", "p" * 240 + "-two.json"
    assert _jsonio.fitting_name(a, 20) != _jsonio.fitting_name(b, 20)
    assert temp_beside(tmp_path / a) != temp_beside(tmp_path / b)


def test_the_written_path_is_returned_with_home_expanded(tmp_path, monkeypatch):
    """write_text_atomic returns the path it wrote with '~' expanded (what `chronicals eval --json ~/x.json` reports
    as written), not the path as given."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert write_text_atomic("~/scores.json", "whole\n") == tmp_path / "scores.json"
    assert (tmp_path / "scores.json").read_text() == "whole\n"
    with atomic_open("~/curve.png", "wb") as fh:  # the plots and the bench write through atomic_open itself
        fh.write(b"png")
    assert (tmp_path / "curve.png").read_bytes() == b"png"


def test_the_temporary_is_fsynced_before_it_replaces_the_file(tmp_path, monkeypatch):
    """The temporary's data reach the disk before the rename over the target: without the fsync a power cut after
    the rename can leave an empty file where the old one was."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(_jsonio.os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(_jsonio.os, "replace", lambda a, b: calls.append("replace") or real_replace(a, b))
    target = tmp_path / "x.json"
    write_text_atomic(target, "whole\n")
    assert target.read_text() == "whole\n" and calls == ["fsync", "replace"]


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """Ctrl-C (KeyboardInterrupt, a BaseException) inside the write keeps the old file and removes the hidden
    temporary at once; it is not left for a later write to sweep."""
    target = tmp_path / "scores.json"
    target.write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(target) as fh:
            fh.write("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["scores.json"]


def _aged(path):
    old = time.time() - 3600
    os.utime(path, (old, old))
    return path


@pytest.mark.skipif(_jsonio.fcntl is None, reason="POSIX flock")
def test_a_slow_live_writers_temporary_is_not_swept_by_another_writer(tmp_path, monkeypatch):
    """A write of one file running for more than a minute holds the flock on its temporary: another process
    writing the same file then must leave it, or the first write fails at its rename with its data lost."""
    target = tmp_path / "metrics.jsonl"
    with atomic_open(target) as fh:
        fh.write("first ")
        _aged(temp_beside(target))
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: 999999)  # another process
            write_text_atomic(target, "second\n")
        fh.write("whole\n")
    assert target.read_text() == "first whole\n"


@pytest.mark.skipif(_jsonio.fcntl is None, reason="POSIX flock")
def test_a_file_named_like_a_temporary_but_not_ours_is_left_alone(tmp_path):
    """Only '.<name>.tmp-<pid>' (digits alone after the dash), a regular file, is one of our temporaries: a user's
    '.metrics.jsonl.tmp-backup' or another tool's '.metrics.jsonl.tmp-12-x' beside the file is not removed by
    our next write of it (data the user kept there would be lost), nor is a symlink '.metrics.jsonl.tmp-12345'
    (even an old one to an unlocked file: the sweep unlinked the user's link)."""
    target = tmp_path / "metrics.jsonl"
    stem = temp_beside(target).name.rsplit("-", 1)[0] + "-"
    theirs = [tmp_path / (stem + "backup"), tmp_path / (stem + "12-x"), tmp_path / "real.txt"]
    for f in theirs:
        f.write_text("keep me")
        _aged(f)
    link = tmp_path / (stem + "12345")
    link.symlink_to(theirs[-1])
    write_text_atomic(target, "whole\n")
    assert all(f.read_text() == "keep me" for f in theirs) and link.is_symlink()
    assert target.read_text() == "whole\n"


@pytest.mark.skipif(_jsonio.fcntl is None, reason="POSIX flock")
def test_a_finished_temporary_is_renamed_while_its_writer_still_holds_the_lock(tmp_path, monkeypatch):
    """Another writer of the same file sweeping between this writer's last byte and its rename must find the
    temporary locked; an unlocked old temporary is taken for a killed writer's and removed, and the rename would
    fail with the data lost."""
    target, real_replace = tmp_path / "metrics.jsonl", os.replace

    def another_writer_sweeps_first(src, dst):
        _aged(src)
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: 999999)
            _jsonio._remove_dead_temps(target)
        return real_replace(src, dst)

    monkeypatch.setattr(_jsonio.os, "replace", another_writer_sweeps_first)
    write_text_atomic(target, "whole\n")
    assert target.read_text() == "whole\n"


@pytest.mark.skipif(_jsonio.fcntl is None, reason="POSIX flock")
def test_a_killed_writers_temporary_beside_a_name_with_glob_characters_is_removed(tmp_path):
    """'metrics[1].jsonl' is a file name, not a pattern: the killed writer's temporary beside it is found and removed
    by the next write ('[1]' read as a pattern matches only '1', and the temporary would stay for ever)."""
    target = tmp_path / "metrics[1].jsonl"
    dead = target.with_name(f".{target.name}.tmp-999999")
    dead.write_text("half")
    _aged(dead)
    write_text_atomic(target, "whole\n")
    assert os.listdir(tmp_path) == [target.name] and target.read_text() == "whole\n"


def test_a_full_disk_names_the_file_and_leaves_the_old_one(tmp_path, monkeypatch):
    """write, flush and fsync raise OSErrors that name no file: a full disk under a run's held-out copy was
    "error: [Errno 28] No space left on device" alone (a tmpfs walk). The error names the file being written,
    keeps its errno (callers say its strerror), and the old file stays, with no temporary beside it."""
    import errno

    target = tmp_path / "heldout.jsonl"
    target.write_text("old\n")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(_jsonio.os, "fsync", full)
    with pytest.raises(OSError, match=re.escape(f"[Errno 28] No space left on device: '{target}'")) as e:
        write_text_atomic(target, "new\n")
    assert e.value.errno == errno.ENOSPC and e.value.strerror == os.strerror(errno.ENOSPC)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["heldout.jsonl"]
