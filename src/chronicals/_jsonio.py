"""Reading a small JSON file that must hold one JSON object: config.json, adapter_config.json, a shard index,
a ``datasets.save_to_disk`` state.json; and writing a small text file whole (``write_text_atomic``).

Every failure names the file, says what is wrong and what to do:

    m/config.json:3: invalid JSON (Expecting value at column 18); fix the file, or copy config.json from the
    original model again

Imports nothing of ours, so that models/, lora/ and data/ can all use it without breaking the one-way
dependency rule (data/ depends on nothing else of ours).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locks, no sweeping
    fcntl = None

# json (C scanner and Python fallback alike) recurses once per nesting level and raises RecursionError near
# Python's limit of 1000
NESTED = "nested too deeply (JSON arrays/objects more than ~1000 levels deep)"
# json.loads raises a plain ValueError (not JSONDecodeError) for an integer literal longer than Python's int limit
BIG_NUMBER = "a number of more than 4300 digits (Python's limit for reading an int); write it as a string"
REENCODE = "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > NEW)"


def json_kind(obj) -> str:
    """JSON's name for the type of a parsed value: 'array', not Python's 'list'; 'null', not 'NoneType'."""
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "true/false"
    return {dict: "object", list: "array", str: "string"}.get(type(obj), "number")


def json_error(e: json.JSONDecodeError) -> str:
    """The decoder's message and where, for "invalid JSON (...)": "Expecting value at column 18". Some of its
    messages end in "at" themselves ("Unterminated string starting at", "Invalid control character at"), which read
    "starting at at column 10" with the column appended."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def read_json_object(path, what: str, fix: str, *, missing: str | None = None,
                     error: type[Exception] = ValueError) -> dict:
    """The object a JSON file holds. A leading UTF-8 byte-order mark is ignored (Notepad and Excel write one).

    what: the file's kind in "so not a valid {what}" (``"config.json"``, ``"safetensors index"``).
    fix: the caller's remedy, after "fix the file, or ..." (``"copy the checkpoint again"``).
    missing: what to say after "{path}: not found; " or "is a directory, not a file; " (default: ``fix``); the
        first is a FileNotFoundError.
    error: the class of every other error (``ValueError``, or a subclass such as data's ``DataError``).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found; {missing or fix}") from None
    except OSError as e:  # IsADirectoryError on Linux; PermissionError for a directory on Windows
        if path.is_dir():
            raise error(f"{path}: is a directory, not a file; {missing or fix}") from None
        raise error(f"{path}: cannot read it ({e.strerror or e}); check that it is a readable file, or "
                    f"{fix}") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        line = data.count(b"\n", 0, at) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte {at}: {e.reason}, {data[at:at + 4]!r}), so not a valid "
                    f"{what}; {REENCODE}, or {fix}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: invalid JSON ({json_error(e)}); fix the file, or "
                    f"{fix}") from None
    except RecursionError:
        raise error(f"{path}: {NESTED}, so not a valid {what}; fix the file, or {fix}") from None
    except ValueError:  # after JSONDecodeError, its subclass: only an over-long integer is left
        raise error(f"{path}: {BIG_NUMBER}, or {fix}") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: a JSON {json_kind(obj)}, not an object, so not a valid {what}; fix the file, or "
                    f"{fix}")
    return obj


NAME_MAX = 255  # bytes of one file name on Linux file systems (ext4, xfs, tmpfs)


def fitting_name(name: str, room: int) -> str:
    """``name``, or where ``room`` more bytes would pass NAME_MAX, its first 200 bytes and an 8-digit hash of it: the
    stem of a temporary name beside ``name`` (a valid 250-byte name failed after minutes of scoring with "File name
    too long")."""
    if len(name.encode()) + room <= NAME_MAX:
        return name
    return f"{name.encode()[:200].decode(errors='ignore')}.{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def temp_beside(path) -> Path:
    """The temporary file beside ``path`` that is written first and renamed over it: ``.<name>.tmp-<pid>``, the name
    shortened by ``fitting_name`` where that would pass NAME_MAX."""
    path = Path(path)
    suffix = f".tmp-{os.getpid()}"
    return path.with_name(f".{fitting_name(path.name, 1 + len(suffix))}{suffix}")


@contextmanager
def atomic_open(path, mode: str = "w"):
    """A file handle on ``temp_beside(path)``; when the block ends, the file is fsynced and renamed over ``path``, so
    a reader never sees half a file and a failed or interrupted write leaves the old one. The writer holds an flock
    on its temporary file: a writer that was killed (SIGKILL, out of memory) leaves its temporary file unlocked, and
    the next write of ``path`` removes it (they had piled up beside metrics.jsonl and the data copies)."""
    path = Path(path).expanduser()
    _remove_dead_temps(path)
    tmp = temp_beside(path)
    try:
        with tmp.open(mode) as fh:
            lock_fresh(fh.fileno())
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
            os.replace(tmp, path)  # while the lock is held: a sweeper never takes a finished file for a dead one
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None and e.errno is not None:  # write, flush and fsync name no file: a full disk under the
            # run's held-out copy was "error: [Errno 28] No space left on device" alone (a tmpfs walk)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_dead_temps(path: Path) -> None:
    """Remove the temporary files of earlier writes of ``path`` whose writer is gone (their flock is free)."""
    if fcntl is None or not path.parent.is_dir():
        return
    mine = temp_beside(path).name
    stem = mine[:-len(str(os.getpid()))]  # ".<name>.tmp-": the pid follows
    for p in path.parent.glob(glob.escape(stem) + "*"):
        if not p.name[len(stem):].isdigit() or p.name == mine or not p.is_file() or p.is_symlink():
            continue
        try:  # a writer locks its file right after creating it: one younger than a minute may not be locked yet
            if time.time() - p.stat().st_mtime < 60:
                continue
        except OSError:
            continue
        fd = lock_if_free(p)
        if fd is None:
            continue
        try:
            p.unlink(missing_ok=True)
        finally:
            os.close(fd)


def lock_fresh(fd: int) -> None:
    """Take the writer's flock on the fresh temporary ``fd`` (a new name: nobody else holds it). Where the file system
    takes no flock (ENOLCK on some network mounts) the write goes on unlocked, and since ``lock_if_free`` cannot lock
    it there either, no sweeper takes it for a dead writer's. Raising instead failed every atomic write there
    (config.yaml, checkpoints, GGUF conversions) after the run lock had warned that it trains unlocked."""
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def lock_if_free(path) -> int | None:
    """An fd holding ``path``'s flock when no live process holds it (its writer is gone), else None (held by a live
    writer, or no such file). The one liveness test of our temporaries: the kernel drops a dead writer's lock,
    however it died. POSIX only (None elsewhere)."""
    if fcntl is None:
        return None
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


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` whole (``atomic_open``): metrics.jsonl's rewrite on resume, the run's
    config.yaml, ``chronicals eval --json`` and the bench's result files."""
    path = Path(path).expanduser()
    with atomic_open(path) as fh:
        fh.write(text)
    return path
