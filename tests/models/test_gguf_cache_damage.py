"""A cache entry whose safetensors file was damaged after it was published (truncated by a full disk under a copy
of the cache, zeroed, removed) is converted again on the next load, with a warning; an intact one is reused."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import save_file
from test_gguf import _tiny
from test_gguf_cache_prune import _write

from chronicals.models import gguf_cache, gguf_io
from chronicals.models.hf_io import load_hf_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHRONICALS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def tiny(tiny_hf_config):
    return _tiny(tiny_hf_config, "llama2")


def _truncate(f):
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)


def _zero_header(f):
    with open(f, "r+b") as fh:
        fh.write(b"\0" * 64)


@pytest.mark.parametrize("damage", [_truncate, _zero_header, os.remove], ids=["truncated", "zeroed", "removed"])
def test_a_damaged_entry_is_converted_again(tmp_path, cache, tiny, caplog, damage):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    want = load_hf_dir(out, dtype=torch.float32).state_dict()
    damage(out / "model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chronicals.models.gguf_cache"):
        again = gguf_io.cached_gguf_dir(path)
    assert again == out
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and str(path.resolve()) in said[0] and "converting it again" in said[0], said
    got = load_hf_dir(again, dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [d.name for d in out.parent.iterdir()] == [out.name]  # the damaged copy is gone, not left aside


def test_a_damaged_entry_that_cannot_be_moved_aside_says_so(tmp_path, cache, tiny, monkeypatch):
    """A damaged entry that cannot be moved aside (a cache we may not change) is an OSError naming the entry, the
    damage and the fix (delete it by hand); it was returned and loaded as it was."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    (out / "model.safetensors").unlink()

    def denied(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(gguf_cache.os, "rename", denied)
    with pytest.raises(OSError, match=rf"^{out}: this cached conversion of .* is damaged \(no \.safetensors file\) "
                                      r"and cannot be removed \(Permission denied\); delete that directory by hand"):
        gguf_io.cached_gguf_dir(path)


def test_an_intact_entry_is_reused_without_a_word(tmp_path, cache, tiny, caplog, monkeypatch):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    monkeypatch.setattr(gguf_io, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    with caplog.at_level(logging.WARNING, logger="chronicals.models.gguf_cache"):
        assert gguf_io.cached_gguf_dir(path) == out
    assert gguf_cache._damage(out) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_trailing_bytes_after_the_tensors_are_damage(tmp_path):
    """A cached safetensors file longer than its header says (bytes after the tensors, as a copy into an existing
    larger file leaves) is damage: safetensors refuses to load it, so the entry is converted again."""
    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(f))
    assert gguf_cache._damage(tmp_path) is None  # intact
    with open(f, "ab") as fh:
        fh.write(b"\0" * 16)
    why = gguf_cache._damage(tmp_path)
    assert why is not None and "model.safetensors" in why


@pytest.mark.parametrize("header, error", [
    ({"w": {"dtype": "F32", "shape": [1]}}, "KeyError"),  # a tensor without data_offsets (another tool's file)
    ('{"w": {"data_offsets": [0, 1e400]}}', "OverflowError"),  # int(inf)
    # nested past the JSON parser's depth: 2,000 is past 3.11's (1,000) but not 3.12's (the GPU machine parsed it)
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
])
def test_a_header_the_damage_check_cannot_read_is_damage_not_a_crash(tmp_path, header, error):
    """A cached safetensors header that names a tensor without data_offsets, an offset past any integer or a
    nesting past the parser's depth is damage: the entry is converted again. An exception out of _damage failed
    every load of that GGUF with a traceback until the user found and deleted the cache entry by hand."""
    header = (header if isinstance(header, str) else json.dumps(header)).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    why = gguf_cache._damage(tmp_path)
    assert why is not None and why.startswith(f"model.safetensors: {error}")


def test_a_damaged_entry_whose_reconversion_fails_is_not_left_aside(tmp_path, cache, tiny):
    """A damaged entry is moved aside and removed before the conversion runs again; when that conversion fails (the
    full disk that damaged the entry), the damaged copy (540 MB for SmolLM2) must not stay hidden in the cache as
    a ``.pruned-*`` directory: the user loses the space, and the next attempt fails for want of it again."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    _truncate(out / "model.safetensors")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        gguf_cache.cached_conversion(path, full_disk, gguf_io.convert_tokenizer)
    assert not [d.name for d in cache.iterdir() if ".pruned-" in d.name]
    assert not out.exists()


def test_a_conversion_another_process_published_first_is_used(tmp_path, cache, tiny):
    """Two converters of one new GGUF where flock is not available (a network file system): the second's publish
    fails with FileExistsError after the first's; its load uses the first's entry. A file where the entry belongs
    is an OSError that names the cache and CHRONICALS_CACHE."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)

    def other_won(gguf_path, out, replace=False, cache_entry=None):
        gguf_io.convert_gguf(gguf_path, out, replace=False, cache_entry=cache_entry)  # the other process
        raise FileExistsError(17, "File exists", str(out))

    out = gguf_cache.cached_conversion(path, other_won, gguf_io.convert_tokenizer)
    assert (out / "config.json").is_file() and out == gguf_cache.cache_dir_for(path)

    _write(path, tiny, shift=1.0)
    blocked = gguf_cache.cache_dir_for(path)

    def in_the_way(gguf_path, out, replace=False, cache_entry=None):
        out.write_text("not a directory")
        raise FileExistsError(17, "File exists", str(out))

    with pytest.raises(OSError, match=r"a file is in the way.*CHRONICALS_CACHE"):
        gguf_cache.cached_conversion(path, in_the_way, gguf_io.convert_tokenizer)
    assert blocked.is_file()


def test_a_conversion_that_finishes_second_leaves_the_first_entry_in_place(tmp_path, cache, tiny):
    """Two converters of one new GGUF without flock: the one that finishes second must not replace the entry the
    first published (a process already reading it would find its files renamed away and removed); its load uses
    the first's entry."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = []

    def second(gguf_path, out, replace=False, cache_entry=None):
        gguf_io.convert_gguf(gguf_path, out, replace=False, cache_entry=cache_entry)  # the other process
        first.append((out / "model.safetensors").stat().st_ino)
        return gguf_io.convert_gguf(gguf_path, out, replace=replace, cache_entry=cache_entry)  # this one

    out = gguf_cache.cached_conversion(path, second, gguf_io.convert_tokenizer)
    assert (out / "model.safetensors").stat().st_ino == first[0]


def test_a_small_file_that_cannot_be_renamed_leaves_no_temporary(tmp_path, monkeypatch):
    """_write_small_file (a cache entry's record, a retried tokenizer's error) writes a temporary beside the file
    and renames it over: when the rename fails, the temporary must go, not pile up hidden in the cache entry."""
    target = tmp_path / "gguf_tokenizer_error.txt"

    def fails(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(gguf_cache.os, "replace", fails)
    with pytest.raises(PermissionError):
        gguf_cache._write_small_file(target, "x\n")
    assert list(tmp_path.iterdir()) == []


def test_a_small_file_is_world_readable_under_a_strict_umask(tmp_path):
    """_write_small_file's files (an entry's record stamped on a hit, a retried tokenizer's error) are 0644 under
    umask 077, as the rest of a shared cache entry is; they were 0600, unreadable to the cache's other users."""
    target = tmp_path / gguf_cache.CACHE_ENTRY
    old = os.umask(0o077)
    try:
        gguf_cache._write_small_file(target, "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


@pytest.mark.parametrize("text", ['{"why": "no vocab"}', '{"error": 3}'], ids=["no error key", "error not a string"])
def test_a_json_tokenizer_error_file_that_is_no_record_is_read_as_text(tmp_path, text):
    """A gguf_tokenizer_error.txt that is JSON but not a record (no "error" string: a hand edit, another tool's file)
    is read as plain text, the error being its whole text. It made tokenizer_error raise a KeyError, or return the
    number 3 as the reason."""
    (tmp_path / gguf_cache.TOKENIZER_ERROR).write_text(text + "\n")
    assert gguf_cache.tokenizer_error(tmp_path) == text


def test_a_damaged_entry_another_process_discarded_first_is_converted_again(tmp_path, cache, tiny, monkeypatch):
    """Two loads find one damaged entry: the one whose move aside finds it gone (the other moved it first) goes on
    to convert it again, not out with a FileNotFoundError."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    _truncate(out / "model.safetensors")
    real = os.rename

    def discarded_by_the_other(src, dst):
        if ".pruned-" in os.path.basename(dst):
            shutil.rmtree(src)
            raise FileNotFoundError(2, "No such file or directory", str(src))
        return real(src, dst)

    monkeypatch.setattr(gguf_cache.os, "rename", discarded_by_the_other)
    assert gguf_io.cached_gguf_dir(path) == out and gguf_cache._damage(out) is None
