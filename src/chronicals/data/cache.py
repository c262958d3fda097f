"""The tokenization cache: one directory per (file contents, tokenizer, settings) key.

An entry holds ids.npy (T,) int32, trainable.npy (T,) bool, offsets.npy (n + 1,) int64 and meta.json
(pad id, DatasetStats, per-file formats). It is written to a temporary directory and renamed into place,
so a complete entry appears at once. Loading checks every file against the others (dtype, shape,
offsets that start at 0, never decrease and end at T, counts that match meta.json): a damaged entry (a
truncated copy, a crashed write, a disk error) is reported as ``CacheError`` and the caller rebuilds it,
rather than training on arrays that disagree (a shorter ids.npy crashed the first step with "operands
could not be broadcast").
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .._jsonio import lock_fresh, lock_if_free
from .._numbers import is_int
from .._words import counted, size_text
from .readers import DataError, file_digest

try:
    import fcntl
except ImportError:  # not POSIX: no locks, no sweeping
    fcntl = None

log = logging.getLogger("chronicals.data")
CACHE_VERSION = 2  # bump when the entry layout or DatasetStats change (2: meta.json names the files' formats)
ARRAYS = (("ids", np.int32), ("trainable", np.bool_), ("offsets", np.int64))


class CacheError(Exception):
    """A cache entry that cannot be used: what is wrong with it (the caller names the entry and rebuilds)."""


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary/merges/normalizer (its JSON), chat template and special tokens, and of
    ``split_special_tokens``, a flag of transformers' wrapper (not of its JSON) that turns '<|im_end|>' in text
    into pieces of it rather than its id: with it left out, a cached entry kept the other setting's ids."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(f"split_special_tokens={bool(getattr(tokenizer, 'split_special_tokens', False))}".encode())
    return h.hexdigest()


# the code that reads files into records and turns records into token ids and trainable masks (relative to this
# package; the JSON reader is the package's own)
ENCODER_FILES = ("readers.py", "../_jsonio.py", "formats.py", "chat_template.py", "chat_turns.py", "tokenize.py",
                 "dataset.py", "workers.py")


def files_digest(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def encoder_digest() -> str:
    """Hash of ENCODER_FILES: entries made by other code are other entries, with no version number to remember to
    bump. With one (ENCODING_RULES, not bumped for 3a2cf1f), the demo kept training on the cached masks of the code
    before it: 3,380 loss tokens where that code gives 3,154. Any edit of these files re-tokenizes once."""
    return files_digest(Path(__file__).parent / name for name in ENCODER_FILES)


def cache_key(files, tokenizer, settings) -> str:
    blob = json.dumps({"version": CACHE_VERSION, "encoder": encoder_digest(), "files": [file_digest(f) for f in files],
                       "tokenizer": tokenizer_fingerprint(tokenizer), **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def source_key(files, tokenizer, settings) -> str:
    """What an entry was made from, less the files' contents and the encoding code: the files' paths, the tokenizer
    and the settings. A new entry of the same source replaces the older ones (``prune_stale``)."""
    blob = json.dumps({"files": [str(Path(f).resolve()) for f in files], "tokenizer": tokenizer_fingerprint(tokenizer),
                       **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def prune_stale(path: Path, source: str) -> tuple[int, int]:
    """Remove the other entries beside ``path`` whose meta.json names the same ``source``: the same files edited
    since, or tokenized by older code (each edit of a dataset left a whole entry behind, ~5 bytes a token, for
    ever; a data walk at scale). -> (entries removed, their bytes). Moved aside first, so a reader sees the whole
    entry or none (and tokenizes again); a process that mapped its arrays keeps reading them."""
    count, size = 0, 0
    for d in path.parent.iterdir():
        if d == path or d.name.startswith(".") or not d.is_dir():
            continue
        try:
            if json.loads((d / "meta.json").read_text()).get("source") != source:
                continue
            n = _size(d)
            trash = Path(tempfile.mkdtemp(dir=path.parent, prefix=".bad-"))
        except (OSError, ValueError, AttributeError):  # not an entry, or one being removed by another process
            continue
        try:
            d.rename(trash / "entry")
            count, size = count + 1, size + n
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(trash, ignore_errors=True)
    return count, size


_CACHE_FIX = "point data.cache_dir at a directory, or set data.cache_dir=none to disable the cache " \
             "(load_dataset: cache_dir=None)"


def check_cache_root(cache_dir) -> Path:
    """``cache_dir`` expanded; DataError when it is a file (the trainer asks before the model loads)."""
    root = Path(cache_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise DataError(f"data.cache_dir={root} is a file, not a directory; {_CACHE_FIX}")
    return root


def cache_root(cache_dir) -> Path:
    """``cache_dir`` as an existing directory, checked before any tokenization (a file there used to fail
    with a bare "[Errno 17] File exists" only after the whole dataset was tokenized)."""
    root = check_cache_root(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir={root}: cannot create it ({e.strerror or e}); {_CACHE_FIX}") from None
    return root


WRITER_LOCK = ".writer.lock"  # inside a temporary entry, flocked by its writer until the entry is published


def _remove_dead_writes(root: Path) -> None:
    """Remove the temporary entries (``.tmp-*``) of writers that were killed: their lock file is there and free. A
    killed write had left up to a whole entry's size behind, for ever; one without the lock file (made just now,
    or by an older version) is left alone."""
    if fcntl is None:
        return
    for d in root.glob(".tmp-*"):
        fd = lock_if_free(d / WRITER_LOCK)
        if fd is None:  # its writer is alive, or no lock file
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
            log.info("removed %s, a tokenization cache entry whose writer was killed before it finished", d)
        finally:
            os.close(fd)


def save(path: Path, ids, trainable, offsets, meta: dict) -> None:
    """Write the entry ``path`` atomically, replacing a damaged one. A failure is a warning: the data is
    already tokenized and the run goes on; the next run tokenizes again. The writer holds an flock on a file in its
    temporary entry, so the next save removes the temporary entry of a writer that was killed."""
    tmp, lock = None, None
    try:
        _remove_dead_writes(path.parent)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 kept a cache shared by a team unreadable to the others (a walk)
        if fcntl is not None:
            lock = os.open(tmp / WRITER_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
            lock_fresh(lock)  # a fresh directory: nobody else holds it
        for (name, _), arr in zip(ARRAYS, (ids, trainable, offsets)):
            np.save(tmp / f"{name}.npy", arr)
        (tmp / "meta.json").write_text(json.dumps(meta))
        if lock is not None:
            os.unlink(tmp / WRITER_LOCK)  # not published with the entry; still locked until the rename is done
        if path.exists():  # damaged (load found it so): move it aside, then put the new one in its place
            trash = Path(tempfile.mkdtemp(dir=path.parent, prefix=".bad-"))
            try:
                path.rename(trash / "entry")
            except OSError:
                pass  # another process moved or replaced it first
            shutil.rmtree(trash, ignore_errors=True)
        try:
            tmp.rename(path)
            tmp = None
        except OSError:
            if not (path / "meta.json").exists():
                raise
            # a concurrent writer of the same key finished first: its entry is the same data
        log.info("cached %d tokens in %s (%s)", int(offsets[-1]) if len(offsets) else 0, path,
                 size_text(_size(path)))
        if meta.get("source"):
            count, size = prune_stale(path, meta["source"])
            if count:
                log.info("removed %s of the same files and settings (%s)",
                         counted(count, "older tokenization cache entry", "older tokenization cache entries"),
                         size_text(size))
    except OSError as e:
        log.warning("could not write the tokenization cache entry %s (%s); training goes on, the next "
                    "run tokenizes again", path, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def load(path: Path):
    """(ids, trainable, offsets memory-mapped, meta dict); CacheError says what is inconsistent."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        stats, pad_id = meta["stats"], meta["pad_id"]
        n, total = int(stats["documents"]), int(stats["tokens"])
    except FileNotFoundError:
        raise CacheError("meta.json is missing (a write that did not finish)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CacheError(f"meta.json is unreadable ({type(e).__name__}: {e})") from None
    if not is_int(pad_id):  # JSON true is a Python int
        raise CacheError(f"meta.json: pad_id is {pad_id!r}, expected an integer")
    arrays = []
    for name, dtype in ARRAYS:
        try:
            a = np.load(path / f"{name}.npy", mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:  # missing, truncated header or data, not .npy
            raise CacheError(f"{name}.npy is unreadable ({type(e).__name__}: {e})") from None
        want = n + 1 if name == "offsets" else total
        if a.dtype != dtype or a.shape != (want,):
            raise CacheError(f"{name}.npy holds {a.dtype} {a.shape}, expected {np.dtype(dtype)} ({want},) "
                             f"for {n} documents of {total} tokens (meta.json)")
        arrays.append(a)
    offsets = arrays[2]
    if offsets[0] != 0 or offsets[-1] != total or (n and int(np.diff(offsets).min()) < 1):
        raise CacheError(f"offsets.npy does not split {total} tokens into {n} non-empty documents")
    return arrays[0], arrays[1], offsets, meta
