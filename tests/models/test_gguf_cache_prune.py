"""The GGUF conversion cache removes a file's older conversions when it completes a new one (540 MB each for the
embedded SmolLM2), and only those: not other files' entries, not entries it cannot tell are that file's, not one
used in the last PRUNE_AFTER_S seconds, not a write in progress; a failure to remove is a warning."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from test_gguf import _tiny, write_gguf

from chronicals._words import size_text
from chronicals.models import gguf_cache, gguf_io

pytestmark = pytest.mark.usefixtures("one_thread")

LOGGER = "chronicals.models.gguf_cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own: the listing is what this test wrote."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CHRONICALS_CACHE", str(root))
    return root / "gguf"


@pytest.fixture
def tiny(tiny_hf_config):
    return _tiny(tiny_hf_config, "llama2")


def _write(path, tiny, shift: float = 0.0) -> None:
    """A tiny GGUF at ``path``; each ``shift`` gives other weights (so a new identity)."""
    cfg, model = tiny
    with torch.no_grad():
        sd = {k: v + shift for k, v in model.state_dict().items()}
    tmp = path.with_name(path.name + ".new")
    write_gguf(tmp, "llama", cfg, sd, quantize=False)
    os.replace(tmp, path)  # a new inode: a new cache key


def _age(entry, seconds: float = 2 * gguf_cache.PRUNE_AFTER_S) -> None:
    """Make ``entry`` look unused for ``seconds``: its record's mtime (or its config.json's, without one)."""
    t = time.time() - seconds
    f = entry / gguf_cache.CACHE_ENTRY
    os.utime(f if f.is_file() else entry / "config.json", (t, t))


def _lines(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_new_conversion_removes_the_older_ones_of_the_same_file_only(tmp_path, cache, tiny, caplog):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = gguf_io.cached_gguf_dir(path)
    rec = json.loads((first / gguf_cache.CACHE_ENTRY).read_text())
    assert rec["source"] == str(path.resolve()) and rec["converter_version"] == gguf_cache.CONVERTER_VERSION
    _age(first)

    (tmp_path / "elsewhere").mkdir()  # another file of the same name: the same {stem}-{key} pattern
    _write(tmp_path / "elsewhere" / "m.gguf", tiny)
    other = gguf_io.cached_gguf_dir(tmp_path / "elsewhere" / "m.gguf")
    _age(other)
    unknown = cache / "m-0123456789abcdef"  # the entry pattern, but no record saying whose it is
    unknown.mkdir()
    (unknown / "config.json").write_text("{}")
    _age(unknown)
    writing = cache / f".{first.name}.tmp-123-0123abcd"  # a write in progress (atomic_dir's temporary directory)
    writing.mkdir()
    (writing / gguf_cache.CACHE_ENTRY).write_text((first / gguf_cache.CACHE_ENTRY).read_text())
    size = sum(f.stat().st_size for f in first.iterdir())

    _write(path, tiny, shift=0.5)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        second = gguf_io.cached_gguf_dir(path)
    assert second != first and (second / "config.json").is_file()
    assert not first.exists()
    assert other.is_dir() and unknown.is_dir() and writing.is_dir()
    assert not [p for p in cache.iterdir() if ".pruned-" in p.name]
    removed = [m for m in _lines(caplog) if m.startswith("removed")]
    assert removed == [f"removed 1 older conversion of {path.resolve()} from {cache} ({first.name}): "
                       f"{size_text(size)} freed"]


def test_older_entries_of_a_gguf_loaded_by_a_relative_path_are_removed(tmp_path, cache, tiny, monkeypatch):
    """The record names the resolved path (the one pruning compares with), not the path as given: a GGUF loaded by a
    relative path never had its older entries removed."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "m.gguf", tiny)
    first = gguf_io.cached_gguf_dir("m.gguf")
    assert json.loads((first / gguf_cache.CACHE_ENTRY).read_text())["source"] == str((tmp_path / "m.gguf").resolve())
    _age(first)
    _write(tmp_path / "m.gguf", tiny, shift=0.5)
    second = gguf_io.cached_gguf_dir("m.gguf")
    assert second != first and not first.exists()


def test_entry_used_recently_is_kept(tmp_path, cache, tiny):
    """Another process may be loading an older entry: kept while it was used (a cache hit) in the last
    PRUNE_AFTER_S seconds, removed by the next conversion after that."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = gguf_io.cached_gguf_dir(path)
    _age(first)
    assert gguf_io.cached_gguf_dir(path) == first  # a hit: stamps the use
    _write(path, tiny, shift=0.5)
    second = gguf_io.cached_gguf_dir(path)
    assert first.is_dir() and second.is_dir()
    _age(first)
    _write(path, tiny, shift=1.0)
    gguf_io.cached_gguf_dir(path)
    assert not first.exists() and second.is_dir()  # second is still recent


def test_a_hit_whose_use_cannot_be_stamped_still_loads(tmp_path, cache, tiny, monkeypatch):
    """Stamping a hit on the entry's record is best effort: a cache hit on a cache that cannot be written (shared
    read-only) returns the entry; it failed the load with PermissionError."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = gguf_io.cached_gguf_dir(path)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_cache.os, "utime", denied)
    assert gguf_io.cached_gguf_dir(path) == first


def test_converter_version_bump_removes_the_older_versions_entry_not_a_newer_ones(tmp_path, cache, tiny,
                                                                                   monkeypatch):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    v = gguf_cache.CONVERTER_VERSION
    entries = {}
    for version in (v - 1, v + 1):
        monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", version)
        entries[version] = gguf_io.cached_gguf_dir(path)
    assert entries[v - 1].is_dir()  # the v+1 conversion kept v-1's entry: it was recent then
    for entry in entries.values():
        _age(entry)
    monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", v)
    current = gguf_io.cached_gguf_dir(path)
    assert current not in entries.values()
    assert not entries[v - 1].exists()
    assert entries[v + 1].is_dir()  # another install's newer converter keeps its entry


def test_entry_from_before_records_is_recognised_by_its_key_and_stamped_when_used(tmp_path, cache, tiny,
                                                                                   monkeypatch):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    p, st = path.resolve(), path.stat()
    v = gguf_cache.CONVERTER_VERSION
    # the present file's entry under the (path, size, mtime) key used before 2f71d96, without a record
    monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", v + 1)  # so that this entry is written beside, not used
    legacy = cache / gguf_cache._entry_name(p, gguf_cache._identity(p, st, v, legacy=True))
    gguf_io.convert_gguf(path, legacy)
    assert not (legacy / gguf_cache.CACHE_ENTRY).exists()
    _age(legacy)
    gguf_io.cached_gguf_dir(path)  # a new entry under v + 1
    assert not legacy.exists()

    current = gguf_io.cached_gguf_dir(path)  # a hit on an entry without a record writes it
    (current / gguf_cache.CACHE_ENTRY).unlink()
    assert gguf_io.cached_gguf_dir(path) == current
    assert json.loads((current / gguf_cache.CACHE_ENTRY).read_text())["source"] == str(p)


def test_failure_to_remove_is_a_warning(tmp_path, cache, tiny, monkeypatch, caplog):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = gguf_io.cached_gguf_dir(path)
    _age(first)
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src) == first.name and ".pruned-" in os.path.basename(dst):
            raise PermissionError(13, "Permission denied")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    _write(path, tiny, shift=0.5)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        second = gguf_io.cached_gguf_dir(path)
    assert (second / "config.json").is_file() and first.is_dir()
    warnings = _lines(caplog, logging.WARNING)
    assert len(warnings) == 1 and warnings[0].startswith(f"could not remove {first}, an older conversion of ")
    assert "Permission denied" in warnings[0] and "remove it by hand" in warnings[0]
    assert not [m for m in _lines(caplog) if m.startswith("removed")]


def test_a_killed_conversion_of_an_older_key_is_swept_by_the_next_one(tmp_path, cache, tiny):
    """atomic_dir sweeps killed writes of its own target name only: a conversion killed with -9 before the GGUF was
    replaced (or touched, or the converter upgraded) left its temporary directory, 514 MB for SmolLM2, for ever (a
    GGUF walk). The next conversion of that stem sweeps those whose writer is gone; a live one (lock held) stays."""
    from chronicals.models.orphans import lock_path, writer_lock

    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = gguf_io.cached_gguf_dir(path)
    killed = cache / f".{first.name}.tmp-4242-0123abcd"  # a dead writer's: its lock file left, not held
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"x" * 1000)
    lock_path(killed).write_text("")
    live = cache / f".{first.name}.tmp-4243-0123abce"
    with writer_lock(live):
        live.mkdir()
        _write(path, tiny, shift=0.5)
        gguf_io.cached_gguf_dir(path)
        assert not killed.exists() and not lock_path(killed).exists()
        assert live.is_dir()


def test_an_older_entry_left_aside_by_a_failed_removal_is_swept_by_the_next_conversion(tmp_path, cache, tiny):
    """An older entry renamed to ``.{name}.pruned-*`` whose removal then failed (a file busy on a network file
    system, the process killed mid-rmtree) is hidden from the user; the next conversion of that file removes it
    (a whole model's size, 540 MB for SmolLM2), and an unrelated file's stays."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    first = gguf_io.cached_gguf_dir(path)
    trash = cache / f".{first.name}.pruned-4242-0123abcd"
    trash.mkdir()
    (trash / "model.safetensors").write_bytes(b"x" * 1000)
    other = cache / ".other-0123456789abcdef.pruned-4242-0123abcd"
    other.mkdir()
    _write(path, tiny, shift=0.5)
    gguf_io.cached_gguf_dir(path)
    assert not trash.exists() and other.is_dir()


def test_an_entry_without_a_record_written_recently_is_kept_whatever_its_atime(tmp_path, cache, tiny, monkeypatch):
    """An entry without a record (written by a chronicals from before records) is last used at its config.json's
    atime or mtime, the later: on a noatime mount (or after cp -a) the atime is old while the entry was written
    moments ago by the other install, which may be loading it now; removing it under that load fails it."""
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    p, st = path.resolve(), path.stat()
    v = gguf_cache.CONVERTER_VERSION
    monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", v + 1)
    legacy = cache / gguf_cache._entry_name(p, gguf_cache._identity(p, st, v, legacy=True))
    gguf_io.convert_gguf(path, legacy)
    old = time.time() - 2 * gguf_cache.PRUNE_AFTER_S
    os.utime(legacy / "config.json", (old, time.time()))  # atime old, written just now
    gguf_io.cached_gguf_dir(path)
    assert legacy.is_dir()


@pytest.mark.parametrize("read_now, kept", [(True, True), (False, False)], ids=["read just now", "unused for long"])
def test_an_entry_without_a_record_read_recently_is_kept_whatever_its_mtime(tmp_path, cache, read_now, kept):
    """The other way round: an entry without a record written long ago (old mtime) that another process read just
    now (atime now) is kept, for that process may be loading it; pruned by its mtime alone, it went under that
    load. With both times old it goes (its name is known as this file's older entry)."""
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    p = p.resolve()
    keep = gguf_cache.cache_dir_for(p)
    keep.mkdir(parents=True)
    legacy = cache / gguf_cache._entry_name(p, gguf_cache._identity(p, p.stat(), gguf_cache.CONVERTER_VERSION - 1,
                                                                   legacy=True))
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    old = time.time() - 2 * gguf_cache.PRUNE_AFTER_S
    os.utime(legacy / "config.json", (time.time() if read_now else old, old))
    assert gguf_cache.prune_older_entries(p, keep) == ([] if kept else [legacy])
    assert (legacy / "config.json").is_file() == kept


def _older_entry(tmp_path, cache, version=gguf_cache.CONVERTER_VERSION):
    """(m.gguf resolved, its present entry dir, a directory holding an unused older entry of it: config.json and a
    record naming it with converter_version ``version``)."""
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    p = p.resolve()
    keep = gguf_cache.cache_dir_for(p)
    keep.mkdir(parents=True)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / gguf_cache.CACHE_ENTRY).write_text(json.dumps({"source": str(p), "converter_version": version}))
    _age(old)
    return p, keep, old


@pytest.mark.parametrize("version", [None, "3", 4.0], ids=["null", "a string", "a float"])
def test_a_record_whose_converter_version_is_no_integer_is_kept(tmp_path, cache, version):
    """An older entry of this GGUF whose record says converter_version null, "3" or 4.0 (a hand edit, another tool's
    file) is not known to be ours: pruning keeps it and the load goes on. null or "3" raised a TypeError out of the
    load (compared with an int); 4.0 was removed."""
    p, keep, old = _older_entry(tmp_path, cache, version)
    entry = old.rename(cache / f"m-{'0' * 16}")
    assert gguf_cache.prune_older_entries(p, keep) == []
    assert (entry / "config.json").is_file()


def test_a_record_that_is_not_a_json_object_is_kept(tmp_path, cache):
    """An older entry whose record is JSON but no object (a list: a hand edit, another tool's file) is not known to
    be ours: pruning keeps it and goes on; it raised an AttributeError out of the load."""
    p, keep, old = _older_entry(tmp_path, cache)
    (old / gguf_cache.CACHE_ENTRY).write_text("[]\n")
    _age(old)
    entry = old.rename(cache / f"m-{'0' * 16}")
    assert gguf_cache.prune_older_entries(p, keep) == []
    assert (entry / "config.json").is_file()


def test_a_symlinked_older_entry_is_left_alone(tmp_path, cache, caplog):
    """An entry linked into the cache (a conversion kept on another disk) stays as it is: pruning the file's older
    entries skips it. It was renamed to a hidden .pruned-* link that removal cannot delete: the entry gone from the
    cache, a warning, and nothing freed."""
    p, keep, old = _older_entry(tmp_path, cache)
    link = cache / f"m-{'0' * 16}"
    link.symlink_to(old, target_is_directory=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert gguf_cache.prune_older_entries(p, keep) == []
    assert link.is_symlink() and (old / "config.json").is_file()
    assert sorted(d.name for d in cache.iterdir()) == sorted([keep.name, link.name])
    assert not _lines(caplog, logging.WARNING)


@pytest.mark.parametrize("back, legacy", [(1, False), (0, True)],
                         ids=["an earlier converter version", "the older key scheme, this converter version"])
def test_an_unused_entry_without_a_record_under_an_earlier_key_is_removed(tmp_path, cache, back, legacy):
    """The present file's entry without a record is recognised by its name under every key this file had before
    (an earlier converter version; the (path, size, mtime) key scheme, the present version included) and removed
    once unused: left, each is a whole model's size."""
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    p = p.resolve()
    keep = gguf_cache.cache_dir_for(p)
    keep.mkdir(parents=True)
    version = gguf_cache.CONVERTER_VERSION - back
    older = cache / gguf_cache._entry_name(p, gguf_cache._identity(p, p.stat(), version, legacy=legacy))
    older.mkdir()
    (older / "config.json").write_text("{}")
    _age(older)
    assert gguf_cache.prune_older_entries(p, keep) == [older]
    assert not older.exists() and keep.is_dir()


def test_an_entry_left_aside_that_still_cannot_be_removed_is_not_reported_removed(tmp_path, cache, monkeypatch):
    """The sweep of ``.pruned-*`` directories reports (and counts as freed) only those that are gone."""
    p, keep, _ = _older_entry(tmp_path, cache)
    trash = cache / f".{keep.name}.pruned-4242-0123abcd"
    trash.mkdir()
    monkeypatch.setattr(gguf_cache.shutil, "rmtree", lambda *a, **k: None)  # a file busy on a network file system
    assert gguf_cache.prune_older_entries(p, keep) == []
    assert trash.is_dir()
