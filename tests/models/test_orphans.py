"""Temporaries of killed writes are told from live ones by their lock, not by a pid (models/orphans.py): a writer
in another process (or pid namespace, or host) holds its lock and keeps its directory; a killed one's lock is free."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chronicals.models import orphans

PATTERN = re.compile(r"\.model\.tmp-\d+-[0-9a-f]{8}")


def _tmp(parent, name, nbytes=1000, lock=True):
    d = parent / name
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\0" * nbytes)
    if lock:
        orphans.lock_path(d).touch()  # the lock file a killed writer leaves, nobody holding it
    return d


@pytest.fixture
def held_lock(tmp_path):
    """Start a process that holds the lock of a temporary directory (a live writer) until the test ends."""
    procs = []

    def hold(d):
        code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
                "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
        p = subprocess.Popen([sys.executable, "-c", code, str(orphans.lock_path(d))], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "locked"
        procs.append(p)

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def test_a_killed_writers_directory_goes_and_a_live_writers_stays(tmp_path, held_lock, caplog):
    dead = _tmp(tmp_path, ".model.tmp-4242-0a1b2c3d", nbytes=1_500_000)
    live = _tmp(tmp_path, ".model.tmp-4243-0a1b2c3e")
    held_lock(live)  # another process writing it now, whatever its pid means here
    unlocked = _tmp(tmp_path, ".model.tmp-4244-0a1b2c3f", lock=False)  # no lock file: not known to be ours
    other = _tmp(tmp_path, ".other.tmp-4242-0a1b2c3d")
    stale = orphans.lock_path(tmp_path / ".model.tmp-4245-0a1b2c40")
    stale.touch()  # the writer published or removed its directory, then died before removing its lock file
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        removed = orphans.remove_orphans(tmp_path, PATTERN)
    assert removed == [dead] and not dead.exists() and not orphans.lock_path(dead).exists()
    assert live.is_dir() and orphans.lock_path(live).exists() and unlocked.is_dir() and other.is_dir()
    assert not stale.exists()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and dead.name in msgs[0] and "1.5 MB" in msgs[0]


def test_a_writer_lock_keeps_its_directory_from_a_sweep_in_the_same_process(tmp_path):
    """The background checkpoint thread sweeps in the process whose training thread may be writing: flock locks
    belong to open files, so the sweeper's own open of the lock file cannot take a lock this process holds."""
    d = tmp_path / ".model.tmp-1-0a1b2c3d"
    with orphans.writer_lock(d):
        d.mkdir()
        assert orphans.remove_orphans(tmp_path, PATTERN) == [] and d.is_dir()
        d.rmdir()  # atomic_dir and write_checkpoint rename or remove the directory inside the lock
    assert not orphans.lock_path(d).exists()  # released and removed at the end of the write


def test_a_directory_its_writer_left_behind_keeps_its_lock_file_and_is_swept(tmp_path, monkeypatch):
    """A second Ctrl-C while an interrupted export removed its temporary directory stopped that removal, and the
    writer's lock file went anyway: the half-removed directory, not known to be ours, was never swept (a walk left
    an empty one from a Ctrl-C right after its mkdir; a model's would hold GBs). Left behind, it keeps its lock file,
    and the next write of the output removes it."""
    from chronicals.models import hf_io

    out = tmp_path / "model"
    real_rmtree, stopped = hf_io.shutil.rmtree, []

    def second_ctrl_c(path, *a, **k):
        if not stopped and Path(path).name.startswith(".model.tmp-"):
            stopped.append(Path(path))
            raise KeyboardInterrupt
        real_rmtree(path, *a, **k)
    monkeypatch.setattr(hf_io.shutil, "rmtree", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with hf_io.atomic_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"\0" * 1000)
            raise KeyboardInterrupt  # the first Ctrl-C
    assert stopped == [tmp] and tmp.is_dir() and orphans.lock_path(tmp).exists()
    with hf_io.atomic_dir(out) as tmp2:
        (tmp2 / "config.json").write_text("{}")
    assert _names(tmp_path) == ["model"]


def test_a_lock_held_by_a_live_writer_survives_its_release_race(tmp_path, held_lock):
    """A lock file with no directory yet (a writer between taking its lock and mkdir) is held: left alone."""
    lock = orphans.lock_path(tmp_path / ".model.tmp-7-0a1b2c3d")
    held_lock(tmp_path / ".model.tmp-7-0a1b2c3d")
    time.sleep(0.05)
    assert orphans.remove_orphans(tmp_path, PATTERN) == [] and lock.exists()


def test_symlinks_and_files_named_like_temporaries_or_locks_are_left_alone(tmp_path, caplog):
    """A symlink is never ours to sweep, whatever its name: without the guard the sweep tried to rmtree a link
    named like a temporary directory (failing, with a false "could not remove ... by hand" warning) and unlinked a
    link named like a stale lock file. A regular file named like a temporary directory is not ours either: left
    alone, silently (no false warning)."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.bin").write_bytes(b"x" * 10)
    parent = tmp_path / "out"
    parent.mkdir()
    link = parent / ".model.tmp-7-0a1b2c3d"
    link.symlink_to(target)
    orphans.lock_path(link).touch()  # a free lock beside it, as a killed writer's
    lock_target = tmp_path / "some.file"
    lock_target.write_text("data")
    lock_link = orphans.lock_path(parent / ".model.tmp-8-0a1b2c3e")
    lock_link.symlink_to(lock_target)
    a_file = parent / ".model.tmp-9-0a1b2c3f"
    a_file.write_text("not a directory")
    orphans.lock_path(a_file).touch()
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        assert orphans.remove_orphans(parent, PATTERN) == []
    assert link.is_symlink() and (target / "keep.bin").exists() and a_file.read_text() == "not a directory"
    assert lock_link.is_symlink() and lock_target.read_text() == "data"
    assert not [r for r in caplog.records if "could not remove" in r.getMessage()]


# ---------------------------------------------------------------- an interrupted replace (hf_io.atomic_dir)
# Replacing ``model`` renames it to ``<tmp>.old``, then ``<tmp>`` to ``model``, under ``<tmp>``'s lock.
OUT_PATTERN = re.compile(r"\.model\.tmp-\d+-[0-9a-f]{8}")  # hf_io._temp_pattern("model")

_KILLED_WRITE = """
import os, signal, sys
from pathlib import Path
from chronicals.models import hf_io
out, when, real = Path(sys.argv[1]), sys.argv[2], os.rename

def rename(src, dst):  # SIGKILL right after the first ("between") or the second ("after") rename of the replace
    real(src, dst)
    if Path(src if when == "between" else dst) == out:
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename
with hf_io.atomic_dir(out) as tmp:
    (tmp / "config.json").write_text("new")
"""


def _model_dir(path, text, nbytes=0):
    path.mkdir()
    (path / "config.json").write_text(text)
    if nbytes:
        (path / "model.safetensors").write_bytes(b"\0" * nbytes)
    return path


def _kill_a_replace(out, when):
    p = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(out), when], capture_output=True, text=True)
    assert p.returncode == -9, p.stderr


def _names(parent):
    return sorted(p.name for p in parent.iterdir())


def test_a_replace_killed_between_its_renames_gets_the_previous_output_back(tmp_path, caplog):
    """Killed after moving the previous output aside, before renaming the new one into place: there is no output
    until the next write of it, which first renames the previous one back (a write that did not finish leaves the
    output as it was: replace=False refuses), then writes over it, leaving nothing else behind."""
    from chronicals.models import hf_io

    out = _model_dir(tmp_path / "model", "old")
    _kill_a_replace(out, "between")
    assert not out.exists()
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        with pytest.raises(FileExistsError, match="already exists"):
            with hf_io.atomic_dir(out, replace=False) as tmp:
                (tmp / "config.json").write_text("refused")
    assert (out / "config.json").read_text() == "old" and _names(tmp_path) == ["model"]
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and f"restored {out} from" in msgs[0] and "killed before it finished" in msgs[0]
    with hf_io.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("newer")
    assert (out / "config.json").read_text() == "newer" and _names(tmp_path) == ["model"]


def test_a_replace_killed_after_its_renames_leaves_no_stale_copy(tmp_path, caplog):
    """Killed after the new output is in place, before the previous one (as large as a whole model) is removed:
    the next write of it removes that copy."""
    from chronicals.models import hf_io

    out = _model_dir(tmp_path / "model", "old", nbytes=1_500_000)
    _kill_a_replace(out, "after")
    assert (out / "config.json").read_text() == "new"
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        with hf_io.atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("newer")
    assert (out / "config.json").read_text() == "newer" and _names(tmp_path) == ["model"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and ".old (1.5 MB)" in msgs[0] and "killed after replacing it" in msgs[0]


def test_recover_replaced_restores_the_output_and_leaves_the_temporary_directory_to_remove_orphans(tmp_path, caplog):
    out = tmp_path / "model"
    tmp = _tmp(tmp_path, ".model.tmp-4242-0a1b2c3d")  # complete new content, its lock free
    old = _model_dir(orphans.old_path(tmp), "old")
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        assert orphans.recover_replaced(out, OUT_PATTERN) == [old]
    assert (out / "config.json").read_text() == "old" and not old.exists()
    assert tmp.is_dir() and orphans.lock_path(tmp).exists()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and f"restored {out} from {old}" in msgs[0]
    assert f"{tmp.name} is removed as an orphan" in msgs[0]
    assert orphans.remove_orphans(tmp_path, OUT_PATTERN) == [tmp] and _names(tmp_path) == ["model"]


def test_remove_orphans_keeps_the_lock_of_a_killed_replace_until_it_is_recovered(tmp_path):
    """Swept first, the temporary directory goes but its lock file stays: it still tells the ``.old`` directory
    of a killed writer from a live one's."""
    out = tmp_path / "model"
    tmp = _tmp(tmp_path, ".model.tmp-4242-0a1b2c3d")
    old = _model_dir(orphans.old_path(tmp), "old")
    assert orphans.remove_orphans(tmp_path, OUT_PATTERN) == [tmp] and orphans.lock_path(tmp).exists()
    assert orphans.remove_orphans(tmp_path, OUT_PATTERN) == [] and orphans.lock_path(tmp).exists()
    assert orphans.recover_replaced(out, OUT_PATTERN) == [old]
    assert (out / "config.json").read_text() == "old" and _names(tmp_path) == ["model"]


def test_recover_replaced_removes_a_stale_previous_output(tmp_path, caplog):
    out = _model_dir(tmp_path / "model", "new")
    tmp = tmp_path / ".model.tmp-4242-0a1b2c3d"  # renamed to out
    old = _model_dir(orphans.old_path(tmp), "old", nbytes=1_500_000)
    orphans.lock_path(tmp).touch()
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        assert orphans.recover_replaced(out, OUT_PATTERN) == [old]
    assert (out / "config.json").read_text() == "new" and _names(tmp_path) == ["model"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and old.name in msgs[0] and "1.5 MB" in msgs[0]


def test_a_stale_previous_output_is_removed_and_its_temporary_directory_then_swept(tmp_path):
    """A write killed after both renames with its temporary directory still there: once recover_replaced removes
    the stale ``<T>.old``, ``<T>.lock`` stays so that remove_orphans then removes ``<T>``; unlinking the lock early
    left ``<T>`` without one, never swept (up to a whole checkpoint)."""
    out = _model_dir(tmp_path / "model", "new")
    tmp = _tmp(tmp_path, ".model.tmp-7-0a1b2c3d")
    old = _model_dir(orphans.old_path(tmp), "previous")
    assert orphans.recover_replaced(out, OUT_PATTERN) == [old]
    assert not old.exists() and orphans.lock_path(tmp).exists()
    assert orphans.remove_orphans(tmp_path, OUT_PATTERN) == [tmp] and _names(tmp_path) == ["model"]


@pytest.mark.parametrize("out_exists", [False, True])
def test_recover_replaced_leaves_a_live_writers_and_unknown_directories_alone(tmp_path, held_lock, out_exists):
    """A live writer (another process's, or this one's) is between or after its renames: its ``.old`` is its own.
    Without a lock file, or under another target's or an older scheme's name, a directory is not known to be ours."""
    out = tmp_path / "model"
    if out_exists:
        _model_dir(out, "new")
    live = _tmp(tmp_path, ".model.tmp-4243-0a1b2c3e")
    held_lock(live)
    here = tmp_path / ".model.tmp-4244-0a1b2c3f"
    no_lock = tmp_path / ".model.tmp-4245-0a1b2c40"
    others = [orphans.old_path(tmp_path / ".other.tmp-4246-0a1b2c41"), tmp_path / ".model.old-0a1b2c42",
              orphans.old_path(tmp_path / ".model.tmp-4247-0a1b2c4")]  # not 8 hex digits: not atomic_dir's
    for d in [orphans.old_path(t) for t in (live, here, no_lock)] + others:
        _model_dir(d, "old")
    for d in [tmp_path / ".other.tmp-4246-0a1b2c41", tmp_path / ".model.old-0a1b2c42",
              tmp_path / ".model.tmp-4247-0a1b2c4"]:
        orphans.lock_path(d).touch()
    with orphans.writer_lock(here):
        before = _names(tmp_path)
        assert orphans.recover_replaced(out, OUT_PATTERN) == [] and _names(tmp_path) == before
    # here's writer ended with its .old still there: its lock file stays, free, and the .old is handled now
    assert orphans.recover_replaced(out, OUT_PATTERN) == [orphans.old_path(here)]
    assert _names(tmp_path) == sorted(set(before) - {orphans.old_path(here).name, orphans.lock_path(here).name}
                                      | {"model"})


def test_a_replace_leaves_nothing_beside_its_output(tmp_path, monkeypatch):
    """The previous output is moved aside under the writer's lock (``<tmp>.old``), then removed with the lock."""
    from chronicals.models import hf_io

    out = _model_dir(tmp_path / "model", "old")
    real, renames = hf_io.os.rename, []
    monkeypatch.setattr(hf_io.os, "rename", lambda src, dst: (renames.append((Path(src), Path(dst))), real(src, dst)))
    with hf_io.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("new")
    assert renames == [(out, orphans.old_path(tmp)), (tmp, out)]
    assert (out / "config.json").read_text() == "new" and _names(tmp_path) == ["model"]


def test_a_directory_that_takes_no_flock_publishes_unlocked(tmp_path, monkeypatch, caplog):
    """Where the output's parent directory takes no flock (EBADF/ENOLCK on some network file systems) the publish
    step runs unlocked and the replace completes, said at DEBUG; the writer's own lock (a file) is still taken."""
    import errno
    import fcntl

    from chronicals.models import hf_io

    real, ops = fcntl.flock, []

    def flock(fd, op):
        ops.append(op)
        if op == fcntl.LOCK_EX:  # the blocking lock is publish_lock's, on the directory
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, op)

    monkeypatch.setattr(orphans.fcntl, "flock", flock)
    out = _model_dir(tmp_path / "model", "old")
    with caplog.at_level(logging.DEBUG, logger="chronicals"):
        with hf_io.atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "new" and _names(tmp_path) == ["model"]
    assert fcntl.LOCK_EX in ops and fcntl.LOCK_EX | fcntl.LOCK_NB in ops
    assert f"no lock on {tmp_path} ([Errno {errno.ENOLCK}] No locks available): publishing unlocked" in caplog.text


def test_a_replace_that_cannot_put_the_previous_output_back_keeps_its_lock(tmp_path, monkeypatch):
    """When both the new directory's rename and the previous output's rename back fail, the previous output stays
    under ``<tmp>.old`` with its lock file (free once the writer is done): the next write puts it back."""
    from chronicals.models import hf_io

    out = _model_dir(tmp_path / "model", "old")
    real = hf_io.os.rename

    def rename(src, dst):
        if Path(dst) == out:
            raise OSError("simulated failure")
        return real(src, dst)

    monkeypatch.setattr(hf_io.os, "rename", rename)
    with pytest.raises(OSError, match="simulated failure"):
        with hf_io.atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("new")
    assert not out.exists() and _names(tmp_path) == [orphans.lock_path(tmp).name, orphans.old_path(tmp).name]
    monkeypatch.setattr(hf_io.os, "rename", real)
    with pytest.raises(FileExistsError):
        with hf_io.atomic_dir(out, replace=False):
            pass
    assert (out / "config.json").read_text() == "old" and _names(tmp_path) == ["model"]


def test_an_output_name_near_name_max_is_written_replaced_and_its_orphans_found(tmp_path):
    """A 250-byte directory name is valid, but ``.<name>.tmp-<pid>-<hex>.lock`` would pass 255 bytes ("File name too
    long" after the whole save): the temporaries take a shortened stem, and the sweep looks for that stem."""
    from chronicals._jsonio import fitting_name
    from chronicals.models.hf_io import _TEMP_ROOM, _temp_pattern, atomic_dir

    out = tmp_path / ("m" * 250)
    for text in ("first", "second"):
        with atomic_dir(out) as d:
            (d / "config.json").write_text(text)
            assert all(len(p.name.encode()) <= 255 - len(".lock") for p in tmp_path.iterdir())
    assert (out / "config.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    dead = _tmp(tmp_path, f".{'m' * 200}.{'0' * 8}.tmp-4242-0a1b2c3d")  # another target's stem: not ours
    killed = _tmp(tmp_path, f".{fitting_name(out.name, _TEMP_ROOM)}.tmp-4242-0a1b2c3d")
    assert orphans.remove_orphans(tmp_path, _temp_pattern(out.name)) == [killed] and dead.is_dir()


@pytest.mark.parametrize("exists", [True, False], ids=["replace", "first-write"])
def test_two_writers_of_one_output_at_once_both_succeed_and_the_later_wins(tmp_path, monkeypatch, exists):
    """Two ``export --out SAME`` at once: the second writer's publish waits for the first's two renames (a lock on the
    parent directory for the few milliseconds of the swap) instead of renaming into the gap between them, which failed
    one of them with "Directory not empty" or "No such file" (2 of 600 writes in a concurrency walk)."""
    import threading

    from chronicals.models import hf_io

    out = tmp_path / "model"
    if exists:
        _model_dir(out, "old")
    real, paused, go = hf_io.os.rename, threading.Event(), threading.Event()

    def rename(src, dst):  # writer A stops inside its publish: after it saw whether ``out`` exists, before it is done
        if not exists:  # a first write is one rename: stop before it
            pause()
        real(src, dst)
        if exists:  # a replace is two: stop between them
            pause()

    def pause():
        if threading.current_thread().name == "A" and not paused.is_set():
            paused.set()
            go.wait(10)

    monkeypatch.setattr(hf_io.os, "rename", rename)
    errors = []

    def write(text):
        try:
            with hf_io.atomic_dir(out) as tmp:
                (tmp / "config.json").write_text(text)
        except BaseException as e:  # noqa: BLE001 -- reported by the assert below
            errors.append(f"{text}: {e!r}")

    a = threading.Thread(target=write, args=("A",), name="A")
    a.start()
    assert paused.wait(10)
    b = threading.Thread(target=write, args=("B",), name="B")
    b.start()
    b.join(0.5)  # B runs its write now; its publish must wait for A's
    go.set()
    a.join(10)
    b.join(10)
    assert errors == []
    assert (out / "config.json").read_text() == "B" and _names(tmp_path) == ["model"]


def test_a_racing_creator_of_the_output_is_named(tmp_path, monkeypatch):
    """A writer that takes no lock creating the output between the check and the rename: FileExistsError naming
    it, not a bare ENOTEMPTY. (A failed rename of the new directory putting the previous output back is
    test_checkpoint_io's test_atomic_dir_restores_the_old_output_when_the_final_rename_fails.)"""
    from chronicals.models import hf_io

    real = hf_io.os.rename
    fresh = tmp_path / "fresh"

    def racing(src, dst):
        if Path(dst) == fresh:
            fresh.mkdir()
            (fresh / "x").write_text("someone else's")
        return real(src, dst)

    monkeypatch.setattr(hf_io.os, "rename", racing)
    with pytest.raises(FileExistsError, match="appeared while writing it"):
        with hf_io.atomic_dir(fresh) as tmp:
            (tmp / "config.json").write_text("new")
    assert (fresh / "x").read_text() == "someone else's"


def test_an_orphan_that_cannot_be_removed_keeps_its_lock_and_is_not_said_removed(tmp_path, monkeypatch, caplog):
    """A killed write's temporary directory whose removal fails (a busy file on NFS, a read-only subfolder) is
    said with the fix (remove it by hand), not logged as removed; its lock file stays, so the next write still
    knows it for a dead writer's and retries (without the lock file it is never swept again: a whole model)."""
    dead = _tmp(tmp_path, ".model.tmp-4242-0a1b2c3d")
    monkeypatch.setattr(orphans.shutil, "rmtree", lambda *a, **k: None)  # the removal fails
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        assert orphans.remove_orphans(tmp_path, PATTERN) == []
    assert dead.is_dir() and orphans.lock_path(dead).exists()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and msgs[0].startswith(f"could not remove {dead}") and "by hand" in msgs[0], msgs
    monkeypatch.undo()
    assert orphans.remove_orphans(tmp_path, PATTERN) == [dead] and not dead.exists()


def test_a_previous_output_another_sweeper_restored_first_is_not_handled_twice(tmp_path, monkeypatch, caplog):
    """Two loads sweeping one killed replace at once: the one that takes the lock second finds the ``.old``
    directory already renamed back to the output; it must not log a removal of it nor count it handled."""
    out = tmp_path / "model"
    tmp = tmp_path / ".model.tmp-4242-0a1b2c3d"
    old = orphans.old_path(tmp)
    old.mkdir()
    (old / "config.json").write_text("old")
    orphans.lock_path(tmp).touch()
    real = orphans.lock_if_free

    def other_sweeper_first(path):
        old.rename(out)  # the other sweeper restored it between our listing and our lock
        return real(path)

    monkeypatch.setattr(orphans, "lock_if_free", other_sweeper_first)
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        assert orphans.recover_replaced(out, PATTERN) == []
    assert (out / "config.json").read_text() == "old"
    assert not [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]


@pytest.mark.parametrize("newer", [False, True])
def test_a_previous_output_that_cannot_be_renamed_back(tmp_path, monkeypatch, caplog, newer):
    """The rename back failing: with no output (a read-only directory) the ``.old`` directory stays, with the fix
    said; when another writer published a newer output meanwhile (the rename's ENOTEMPTY) that one is kept and the
    previous output, now stale, is removed without a warning."""
    out = tmp_path / "model"
    tmp = tmp_path / ".model.tmp-4242-0a1b2c3d"
    old = _model_dir(orphans.old_path(tmp), "old")
    orphans.lock_path(tmp).touch()

    def rename(src, dst):
        if newer:
            _model_dir(out, "newer")
        raise OSError(39, "Directory not empty" if newer else "Read-only file system")

    monkeypatch.setattr(orphans.os, "rename", rename)
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        handled = orphans.recover_replaced(out, OUT_PATTERN)
    monkeypatch.undo()
    msgs = [r.getMessage() for r in caplog.records]
    if newer:
        assert handled == [old] and (out / "config.json").read_text() == "newer" and _names(tmp_path) == ["model"]
        assert len(msgs) == 1 and msgs[0].startswith(f"removed {old}") and "could not restore" not in caplog.text
    else:
        assert handled == [] and not out.exists() and (old / "config.json").read_text() == "old"
        assert orphans.lock_path(tmp).exists()
        assert len(msgs) == 1 and msgs[0].startswith(f"could not restore {out} from {old}") and "by hand" in msgs[0]


def test_a_parent_directory_that_is_not_there_has_nothing_to_sweep(tmp_path):
    gone = tmp_path / "not-made-yet"
    assert orphans.remove_orphans(gone, PATTERN) == [] and orphans.recover_replaced(gone / "model", PATTERN) == []
    assert not gone.exists()
