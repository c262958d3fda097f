"""Temporary directories of writes that were killed mid-way, and how a later write tells them from live ones.

Our atomic writes (``hf_io.atomic_dir``, ``train.checkpoint.write_checkpoint``) build a temporary directory and
rename it into place. A write killed mid-way (SIGKILL, the OOM killer, a preempted node) leaves that directory
behind, up to a whole checkpoint's size, and nothing else ever looks at it: the next write into the same place
clears it (``remove_orphans``).

Replacing an existing output takes two renames (the output to ``<temp dir>.old``, the temporary directory into its
place), both under the writer's lock. A writer killed between them leaves no output, only the previous one under
the ``.old`` name: the next write of the same target renames it back first, since a write that did not finish must
leave the output as it was (``recover_replaced``). One killed after both leaves a stale ``.old`` copy, removed.

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

from .._jsonio import lock_fresh, lock_if_free
from .._words import size_text

try:
    import fcntl
except ImportError:  # not POSIX: no locks, no sweeping
    fcntl = None

log = logging.getLogger("chronicals.models")


def lock_path(tmp: Path) -> Path:
    """The lock file of temporary directory ``tmp``: ``<tmp>.lock`` beside it (inside, it would be published)."""
    return tmp.with_name(tmp.name + ".lock")


def old_path(tmp: Path) -> Path:
    """Where the writer of ``tmp`` moves the output it replaces: ``<tmp>.old``, so that ``tmp``'s lock covers it."""
    return tmp.with_name(tmp.name + ".old")


@contextmanager
def writer_lock(tmp: Path):
    """Hold the lock of temporary directory ``tmp`` (to be created inside the block) while the block runs."""
    if fcntl is None:
        yield
        return
    path = lock_path(tmp)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        lock_fresh(fd)
        yield
    finally:
        try:
            # kept where the writer leaves ``tmp`` or its ``.old`` behind (a removal or restoring that failed, or was
            # stopped by a second Ctrl-C: a walk's export left its directory without a lock, never swept), so that
            # a later write sweeps or recovers them; unlinked before the unlock, a sweeper finds it gone or locked
            if not os.path.lexists(old_path(tmp)) and not os.path.lexists(tmp):
                os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def publish_lock(parent: Path):
    """Hold an exclusive lock on directory ``parent`` while the block runs (waiting for other holders): the publish
    step of ``hf_io.atomic_dir`` (one or two renames, milliseconds), so that a second writer of the same output
    renames after the first's swap, not into the gap between its two renames (which failed one of two concurrent
    ``export --out SAME`` with "Directory not empty"). A file system whose directories take no flock (some network
    ones) publishes unlocked, as before: one of two concurrent writers may then fail, the output stays whole."""
    if fcntl is None:
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # EBADF/ENOLCK/EINVAL where flock on a directory is not supported
            log.debug("no lock on %s (%s): publishing unlocked", parent, e)
        yield
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (for the log line: a killed checkpoint write can leave GBs)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def remove_tree(path: Path, what: str, logger: logging.Logger) -> int | None:
    """rmtree ``path``; its size in bytes, or None (with a warning that says how to free it) when it is still there."""
    size = tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        logger.warning("could not remove %s, %s; remove it by hand to free its %s", path, what, size_text(size))
        return None
    return size


def remove_orphans(parent: Path, pattern: re.Pattern, logger: logging.Logger = log) -> list[Path]:
    """Remove the directories in ``parent`` whose names ``pattern`` fullmatches and whose writer is gone (its lock
    file exists and is not held); return them. Lock files left without their directory go too, unless the writer's
    ``.old`` directory is still there (``recover_replaced``'s)."""
    if fcntl is None or not parent.is_dir():
        return []
    removed = []
    for p in sorted(parent.iterdir()):
        is_lock = p.name.endswith(".lock")
        tmp = p.with_name(p.name[:-len(".lock")]) if is_lock else p
        if not pattern.fullmatch(tmp.name) or p.is_symlink() or \
                (is_lock and (tmp.exists() or os.path.lexists(old_path(tmp)))) or (not is_lock and not p.is_dir()):
            continue
        fd = lock_if_free(lock_path(tmp))
        if fd is None:
            continue
        try:
            if is_lock:  # its directory was published or removed, then the writer died before the unlink
                lock_path(tmp).unlink(missing_ok=True)
                continue
            size = remove_tree(tmp, "left by a write that was killed", logger)
            if size is None:
                continue
            if not os.path.lexists(old_path(tmp)):  # else recover_replaced still needs it
                lock_path(tmp).unlink(missing_ok=True)
            logger.info("removed %s (%s), left by a write that was killed before it finished", tmp, size_text(size))
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def recover_replaced(out: Path, tmp_pattern: re.Pattern, logger: logging.Logger = log) -> list[Path]:
    """Handle the ``<T>.old`` directories beside ``out`` (``<T>`` fullmatching ``tmp_pattern``) whose writer is gone:
    the previous ``out``, moved aside by a replacing write that was killed. With no ``out`` (killed between the two
    renames) it is renamed back to ``out``; with one (killed after both) it is removed. Return the ones handled.

    Without ``<T>.lock`` a live writer's ``.old`` cannot be told from a dead one's: left alone. ``<T>`` itself and
    then its lock are left for ``remove_orphans``, run after this."""
    parent = out.parent
    if fcntl is None or not parent.is_dir():
        return []
    handled = []
    for old in sorted(parent.iterdir()):
        name = old.name.removesuffix(".old")
        if name == old.name or not tmp_pattern.fullmatch(name) or old.is_symlink() or not old.is_dir():
            continue
        tmp = old.with_name(name)  # old == old_path(tmp)
        fd = lock_if_free(lock_path(tmp))
        if fd is None:  # a live writer, or no lock file: not known to be a killed write's
            continue
        try:
            if old.is_symlink() or not old.is_dir():  # another sweeper handled it before we took the lock
                continue
            if not os.path.lexists(out):
                try:
                    os.rename(old, out)
                except OSError as e:  # e.g. another writer published ``out`` meanwhile: that one is newer
                    if not os.path.lexists(out):
                        logger.warning("could not restore %s from %s (%s), left by a write that was killed "
                                       "while replacing it; rename it back by hand", out, old, e)
                        continue
                else:
                    logger.warning("restored %s from %s: the write that was replacing it was killed before it "
                                   "finished%s", out, old,
                                   f"; its temporary directory {tmp.name} is removed as an orphan" if tmp.exists()
                                   else "")
                    handled.append(old)
                    if not tmp.exists():
                        lock_path(tmp).unlink(missing_ok=True)
                    continue
            size = remove_tree(old, f"the previous {out.name} left by a write that was killed", logger)
            if size is None:
                continue
            if not tmp.exists():
                lock_path(tmp).unlink(missing_ok=True)
            logger.info("removed %s (%s), the previous %s left by a write that was killed after replacing it",
                        old, size_text(size), out.name)
            handled.append(old)
        finally:
            os.close(fd)
    return handled
