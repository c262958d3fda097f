"""Temporaries of killed writes are told from live ones by their lock, not by a pid (models/orphans.py): a writer
in another process (or pid namespace, or host) holds its lock and keeps its directory; a killed one's lock is free."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

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
    assert not orphans.lock_path(d).exists()  # released and removed at the end of the write
    # (atomic_dir and write_checkpoint rename or remove the directory inside the lock; one left without a lock
    # file is not known to be ours and stays)
    assert orphans.remove_orphans(tmp_path, PATTERN) == [] and d.is_dir()


def test_a_lock_held_by_a_live_writer_survives_its_release_race(tmp_path, held_lock):
    """A lock file with no directory yet (a writer between taking its lock and mkdir) is held: left alone."""
    lock = orphans.lock_path(tmp_path / ".model.tmp-7-0a1b2c3d")
    held_lock(tmp_path / ".model.tmp-7-0a1b2c3d")
    time.sleep(0.05)
    assert orphans.remove_orphans(tmp_path, PATTERN) == [] and lock.exists()
