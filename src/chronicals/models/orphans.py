"""Temporary directories of writes that were killed mid-way, and how a later write tells them from live ones.

Our atomic writes (``hf_io.atomic_dir``, ``train.checkpoint.write_checkpoint``) build a temporary directory and
rename it into place. A write killed mid-way (SIGKILL, the OOM killer, a preempted node) leaves that directory
behind, up to a whole checkpoint's size, and nothing else ever looks at it: the next write into the same place
clears it (``remove_orphans``).

Liveness is a lock, not a pid: each writer holds an exclusive ``flock`` on ``<temp dir>.lock`` (a file beside the
directory, taken before the directory exists) for the whole write, and the kernel drops it when the writer dies,
however it dies. A pid would say "gone" for a live writer in another container's pid namespace or on another host
sharing the directory (the GGUF conversion cache is built for concurrent writers), and "alive" for a reused pid.
A directory without its lock file (never ours, or from before this scheme) is left alone. POSIX only: elsewhere
nothing is swept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locks, no sweeping
    fcntl = None

log = logging.getLogger("chronicals.models")


def lock_path(tmp: Path) -> Path:
    """The lock file of temporary directory ``tmp``: ``<tmp>.lock`` beside it (inside, it would be published)."""
    return tmp.with_name(tmp.name + ".lock")


@contextmanager
def writer_lock(tmp: Path):
    """Hold the lock of temporary directory ``tmp`` (to be created inside the block) while the block runs."""
    if fcntl is None:
        yield
        return
    path = lock_path(tmp)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
        yield
    finally:
        try:
            os.unlink(path)  # before the unlock: a sweeper that opens it now finds it gone or locked
        except FileNotFoundError:
            pass
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An fd holding ``path``'s lock when its writer is gone, else None (held by a live writer, or no file)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a live writer holds it
        os.close(fd)
        return None
    return fd


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (for the log line: a killed checkpoint write can leave GBs)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def remove_orphans(parent: Path, pattern: re.Pattern, logger: logging.Logger = log) -> list[Path]:
    """Remove the directories in ``parent`` whose names ``pattern`` fullmatches and whose writer is gone (its lock
    file exists and is not held); return them. Lock files left without their directory go too."""
    if fcntl is None or not parent.is_dir():
        return []
    removed = []
    for p in sorted(parent.iterdir()):
        is_lock = p.name.endswith(".lock")
        tmp = p.with_name(p.name[:-len(".lock")]) if is_lock else p
        if not pattern.fullmatch(tmp.name) or p.is_symlink() or (is_lock and tmp.exists()) or \
                (not is_lock and not p.is_dir()):
            continue
        fd = _try_lock(lock_path(tmp))
        if fd is None:
            continue
        try:
            if is_lock:  # its directory was published or removed, then the writer died before the unlink
                lock_path(tmp).unlink(missing_ok=True)
                continue
            size = _tree_bytes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if tmp.exists():
                logger.warning("could not remove %s, left by a write that was killed; remove it by hand to free its "
                               "%.1f MB", tmp, size / 1e6)
                continue
            lock_path(tmp).unlink(missing_ok=True)
            logger.info("removed %s (%.1f MB), left by a write that was killed before it finished", tmp, size / 1e6)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed
