"""The GGUF conversion cache: each .gguf file is converted once (``gguf_io.convert_gguf``) into a Hugging Face
directory under ``$CHRONICALS_CACHE`` (default ``~/.cache/chronicals``), which later loads read.

An entry is keyed by the file's resolved path, size, mtime, inode and ctime (a file rewritten in place with its old
size and mtime put back, by cp -p or touch -r, still changes its ctime, which users cannot set) and
CONVERTER_VERSION; it is published whole by a rename (``hf_io.atomic_dir``). Each entry records its source
(``gguf_cache_entry.json``); completing a new one removes the source's older entries (``prune_older_entries``:
540 MB each for SmolLM2). A tokenizer conversion that failed is recorded with the versions it failed under and
retried once they change (``tokenizer_stamp``).

The converter is passed in (``cached_conversion``'s ``convert``, ``convert_tokenizer``): ``gguf_io`` imports this
module, not the other way round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from .._words import counted, size_text
from .config import GGUF_CONVERSION_RECORD
from .hf_io import TEMP_SUFFIX, atomic_dir, save_tokenizer
from .orphans import remove_orphans, remove_tree, tree_bytes

log = logging.getLogger(__name__)

# Bump when the converted directory's contents change (what gguf_io.convert_gguf writes), so stale caches are not
# reused.
# 2: linear rope scaling given by its factor alone (llama.cpp: an absent type is linear); 3: llama files with
# partial rope (rope.dimension_count < head_dim) un-permute only the rotated rows of each head's Q/K; 4: the tokenizer's
# special tokens, BOS/EOS and byte-level decoder set from the file's metadata (gguf_tokenizer; transformers 5.17 set a
# llama file's eos to its bos token); 5: a SentencePiece file's add_space_prefix=false honoured (no "▁" before the text);
# 6: the tokenizer's model_max_length is the file's context_length (was transformers' "no limit", 1e30)
CONVERTER_VERSION = 6

CACHE_ENTRY = GGUF_CONVERSION_RECORD  # in a cache entry: its source (resolved path, identity), converter version
TOKENIZER_ERROR = "gguf_tokenizer_error.txt"  # in a converted directory: why the GGUF's tokenizer is missing
# An older entry last used (read, or written) this recently is kept: another process may be loading it (entries
# are read without a lock; a load of the embedded model takes about 1 s, a 7B model's from a slow disk minutes).
PRUNE_AFTER_S = 600


def cache_root() -> Path:
    """$CHRONICALS_CACHE (``~`` expanded: set in quotes or a Docker ENV it is not, and the conversion went to
    $HOME while its load looked in ./~; a GGUF walk), else ~/.cache/chronicals."""
    return Path(os.environ.get("CHRONICALS_CACHE") or Path.home() / ".cache" / "chronicals").expanduser()


def _identity(p: Path, st: os.stat_result, version: int, legacy: bool = False) -> str:
    """The hashed part of a cache key (legacy: the (path, size, mtime) keys written before 2f71d96)."""
    if legacy:
        return f"{p}|{st.st_size}|{st.st_mtime_ns}|v{version}"
    return f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}|v{version}"


def _entry_stem(p: Path) -> str:
    """The GGUF's stem, cut to its first 180 bytes: a file named with 244-255 bytes (a valid name) made an entry
    name past the file system's 255 ('File name too long', naming the cache; a GGUF walk). Up to 180 bytes the
    names are as before, with room for the ``.{name}.tmp-*`` and ``.pruned-*`` names made beside them."""
    return p.stem.encode()[:180].decode(errors="ignore")


def _entry_name(p: Path, ident: str) -> str:
    return f"{_entry_stem(p)}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def cache_dir_for(gguf_path: str | Path) -> Path:
    """The cache directory of one GGUF file: keyed by resolved path, size, mtime, inode, ctime and converter
    version (size and mtime alone: a file overwritten in place with the same size and its mtime put back,
    cp -p or touch -r, reused the stale conversion; ctime cannot be set by users, and moves a file's
    replacement or in-place rewrite to a new key)."""
    p = Path(gguf_path).resolve()
    return _entry_dir(p, p.stat())


def has_conversion(gguf_path: str | Path) -> bool:
    """Whether the GGUF file's conversion is in the cache, published and undamaged (``_damage``): a load then reads
    it without converting. Else the first load converts it (a damaged entry is converted again), and
    ``models.loading.tokenizer_and_config`` reads the config and tokenizer from the file alone, before that."""
    out = cache_dir_for(gguf_path)
    return (out / "config.json").is_file() and _damage(out) is None


def _entry_dir(p: Path, st: os.stat_result) -> Path:
    """The cache directory of resolved GGUF path ``p`` with stat ``st`` under this CONVERTER_VERSION."""
    return cache_root() / "gguf" / _entry_name(p, _identity(p, st, CONVERTER_VERSION))


def cached_conversion(gguf_path: str | Path, convert: Callable[..., Path],
                      convert_tokenizer: Callable[[Path], tuple]) -> Path:
    """The converted HF directory of a GGUF file, converting it on first use (and then removing the file's older
    conversions, ``prune_older_entries``).

    convert(gguf_path, out_dir, replace=False, cache_entry=record): writes the directory atomically
    (``gguf_io.convert_gguf``); convert_tokenizer(resolved path) -> (tokenizer, None) or (None, why it failed):
    run again when a recorded tokenizer failure is from other versions."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    out = _entry_dir(p, st)
    if not (out / "config.json").is_file():
        with _converting(out):  # a second process waits for the first's conversion, then reads it
            return _cached_conversion(gguf_path, p, st, out, convert, convert_tokenizer)
    return _cached_conversion(gguf_path, p, st, out, convert, convert_tokenizer)


@contextmanager
def _converting(out: Path):
    """An flock on ``.{out.name}.lock`` beside the entry while it is converted: two processes loading one new GGUF
    both converted it in full (2 x the model's size of temporary disk and the CPU time; a concurrency walk). The
    kernel drops a killed holder's lock; the small file stays. No lock without fcntl or where the cache is not
    writable (the conversion then says why)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting to %s", out)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: convert unlocked
            pass
        yield
    finally:
        # removed while held: a process that opened it before then finds the entry once it gets the lock; one that
        # makes a new file meanwhile finds the entry too (at worst, after a failed conversion, two convert at once,
        # as without the lock: the second's publish yields to the first's)
        try:
            lock.unlink()
        except OSError:
            pass
        os.close(fd)


def source_record(p: Path, st: os.stat_result) -> dict:
    """A cache entry's record (CACHE_ENTRY) of resolved GGUF path ``p`` with stat ``st``: its source's identity,
    as the entry's key hashes it (``_identity``), and the converter version."""
    return {"source": str(p), "converter_version": CONVERTER_VERSION, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}


def _cached_conversion(gguf_path, p: Path, st: os.stat_result, out: Path, convert: Callable[..., Path],
                       convert_tokenizer: Callable[[Path], tuple]) -> Path:
    entry = source_record(p, st)
    damage = _damage(out) if (out / "config.json").is_file() else None
    if damage is not None:
        _discard(out, p, damage)
    if (out / "config.json").is_file():
        _mark_used(out, entry)
        rec = _read_tokenizer_error(out)
        if rec is not None:  # a failure recorded under other versions (or none: written before stamps) is retried
            stamp = tokenizer_stamp()
            if any(rec.get(k) != v for k, v in stamp.items()):
                _retry_tokenizer(p, out, rec, stamp, convert_tokenizer)
        return out
    log.info("converting %s to a Hugging Face directory in %s (first load only)", gguf_path, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(gguf_path, out, replace=False, cache_entry=entry)
    except FileExistsError:  # another process finished the same conversion first: use theirs (it prunes)
        if not (out / "config.json").is_file():  # a file where a folder of the cache belongs
            raise _cache_error(gguf_path, out, "a file is in the way") from None
        return out
    except OSError as e:  # a read-only home, a CHRONICALS_CACHE that is a file: was a bare "[Errno 20] Not a
        raise _cache_error(gguf_path, out, e.strerror or str(e)) from None  # directory: '.../gguf'"
    prune_older_entries(p, out, st)
    return out


def _damage(out: Path) -> str | None:
    """Why a published entry cannot be loaded, from its safetensors headers and sizes (a file truncated or zeroed
    since: a full disk under a copy, an interrupted rsync of the cache), or None. Reads 8 bytes and a header per
    file, not the tensors; a changed byte inside a tensor is not seen."""
    files = sorted(out.glob("*.safetensors"))
    if not files:
        return "no .safetensors file"
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                size = os.fstat(fh.fileno()).st_size
                if n <= 0 or 8 + n > size:
                    return f"{f.name}: its header length {n} does not fit its {size} bytes"
                header = json.loads(fh.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError) as e:  # int(1e400): OverflowError; a header nested 1,000 deep: RecursionError
            return f"{f.name}: {type(e).__name__}: {e}"
        if 8 + n + end != size:
            return f"{f.name}: {size} bytes where its header needs {8 + n + end}"
    return None


def _discard(out: Path, p: Path, why: str) -> None:
    """Move a damaged entry of ``p`` aside (a hidden ``.pruned-*`` name, so no reader sees half of it) and
    remove it; the caller converts again. A cache we cannot change is an OSError with the fix."""
    log.warning("the cached conversion of %s in %s is damaged (%s); converting it again", p, out, why)
    trash = out.parent / f".{out.name}.pruned-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(out, trash)
    except FileNotFoundError:  # another process discarded it first
        return
    except OSError as e:
        raise OSError(f"{out}: this cached conversion of {p} is damaged ({why}) and cannot be removed "
                      f"({e.strerror or e}); delete that directory by hand, and it is converted again") from None
    remove_tree(trash, f"a damaged conversion of {p}", log)


def tokenizer_stamp() -> dict:
    """What a failed GGUF tokenizer conversion is recorded under: the converter version and the packages the
    conversion runs (transformers' GGUF converter, built on tokenizers and gguf). A failure recorded under another
    stamp (an upgrade may have fixed it) is retried on the next load instead of being raised."""
    return {"converter_version": CONVERTER_VERSION,
            **{pkg: metadata.version(pkg) for pkg in ("transformers", "tokenizers", "gguf")}}


def tokenizer_error_json(why: str) -> str:
    """The contents of TOKENIZER_ERROR: why the tokenizer conversion failed, under today's ``tokenizer_stamp``."""
    return json.dumps({"error": why, **tokenizer_stamp()}, indent=2, sort_keys=True) + "\n"


def _read_tokenizer_error(converted_dir: Path) -> dict | None:
    """The recorded failure {"error", stamp...}; a plain-text file (written before the stamp) has no stamp."""
    f = converted_dir / TOKENIZER_ERROR
    try:
        text = f.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    return rec if isinstance(rec, dict) and isinstance(rec.get("error"), str) else {"error": text.strip()}


def tokenizer_error(converted_dir: str | Path) -> str | None:
    """Why a GGUF file's converted directory has no tokenizer although the file has tokenizer metadata, or None."""
    rec = _read_tokenizer_error(Path(converted_dir))
    return rec["error"] if rec else None


def _write_small_file(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it): readers run concurrently."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _mark_used(out: Path, entry: dict) -> None:
    """Stamp a cache hit on the entry's record (its mtime is the last use ``prune_older_entries`` reads); an entry
    written before records existed gets one. Best effort: a read-only cache is still read."""
    f = out / CACHE_ENTRY
    try:
        if f.is_file():
            os.utime(f)
        else:
            _write_small_file(f, json.dumps(entry, indent=2, sort_keys=True) + "\n")
    except OSError:
        pass


def _retry_tokenizer(p: Path, out: Path, rec: dict, stamp: dict, convert_tokenizer: Callable[[Path], tuple]) -> None:
    """Convert the tokenizer of a cached entry again, its recorded failure being from other versions (``stamp``
    differs): on success the entry is published again with the tokenizer (its other files hard-linked, not
    dequantized again); on failure the error is recorded under the new stamp. A cache we cannot write is left as
    it is (the recorded error is raised)."""
    was = ", ".join(f"{k} {rec.get(k, '?')}" for k in stamp if rec.get(k) != stamp[k])
    log.info("retrying the tokenizer conversion of %s (it failed under %s; now %s)", p, was,
             ", ".join(f"{k} {stamp[k]}" for k in stamp if rec.get(k) != stamp[k]))
    tok, why = convert_tokenizer(p)
    try:
        if tok is None:
            _write_small_file(out / TOKENIZER_ERROR, tokenizer_error_json(why))
            return
        with atomic_dir(out, replace=True) as tmp:
            for f in out.iterdir():
                if f.name != TOKENIZER_ERROR and not f.name.startswith(".") and f.is_file() and not f.is_symlink():
                    try:
                        os.link(f, tmp / f.name)
                    except OSError:  # a file system without hard links
                        shutil.copy2(f, tmp / f.name)
            save_tokenizer(tok, tmp, out)
        log.info("%s: its tokenizer converts now; added to %s", p, out)
    except OSError as e:
        log.warning("could not update %s with the retried tokenizer conversion of %s (%s)", out, p, e)


def prune_older_entries(p: Path, keep: Path, st: os.stat_result | None = None) -> list[Path]:
    """Remove the cache entries of GGUF file ``p`` (resolved) other than ``keep``, its newly completed one: those of
    its earlier contents (the key follows the file's identity) and of earlier converter versions. Return them.

    An entry is removed only when it is recognisably ``p``'s: its name is ``{stem}-{16 hex}`` and its
    ``gguf_cache_entry.json`` names ``p`` and a converter version not newer than ours (another install's newer
    converter keeps its own), or, written before records existed, its name is a key of ``p``'s present identity
    under an earlier key scheme or converter version (a converter upgrade leaves the previous entry of an unchanged
    file). One used in the last PRUNE_AFTER_S seconds is kept (another process may be
    reading it). Writes in progress are never touched: they are hidden ``.{name}.tmp-*`` directories until their
    final rename (``atomic_dir``), and a published entry is complete. Each is renamed to a hidden
    ``.{name}.pruned-*`` directory first, so a reader sees the whole entry or none (and converts again), then
    removed. A failure is a warning: the load goes on."""
    parent, st = keep.parent, st or p.stat()
    entry_re = re.compile(rf"{re.escape(_entry_stem(p))}-[0-9a-f]{{16}}")
    trash_re = re.compile(rf"\.{re.escape(_entry_stem(p))}-[0-9a-f]{{16}}\.pruned-\d+-[0-9a-f]{{8}}")
    legacy = {_entry_name(p, _identity(p, st, v, old))  # the present file's entries under every earlier key
              for v in range(1, CONVERTER_VERSION + 1) for old in (False, True)} - {keep.name}
    now, removed, freed = time.time(), [], 0
    try:
        listing = sorted(parent.iterdir())
    except OSError:
        return []
    for d in listing:
        if trash_re.fullmatch(d.name) and d.is_dir() and not d.is_symlink():  # one whose removal failed before
            size = tree_bytes(d)
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
                freed += size
            continue
        if d == keep or not entry_re.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        last_use = _last_use_if_ours(d, p, legacy)
        if last_use is None or now - last_use < PRUNE_AFTER_S:
            continue
        trash = parent / f".{d.name}.pruned-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        size = tree_bytes(d)
        try:
            os.rename(d, trash)
        except FileNotFoundError:  # another process pruned it first
            continue
        except OSError as e:
            log.warning("could not remove %s, an older conversion of %s (%s); remove it by hand to free its %s",
                        d, p, e.strerror or e, size_text(size))
            continue
        removed.append(d)
        if remove_tree(trash, f"an older conversion of {p}", log) is not None:
            freed += size
    # killed conversions of this stem under any key: atomic_dir sweeps those of its own target name only, so one of
    # an older key (the file since replaced, touched, or a converter upgrade) stayed for ever (514 MB for SmolLM2;
    # a GGUF walk). Only those whose writer is gone (its lock free) go.
    remove_orphans(parent, re.compile(rf"\.{re.escape(_entry_stem(p))}-[0-9a-f]{{16}}{TEMP_SUFFIX}"), log)
    if removed:
        log.info("removed %s of %s from %s (%s): %s freed", counted(len(removed), "older conversion"), p,
                 parent, ", ".join(d.name for d in removed), size_text(freed))
    return removed


def _last_use_if_ours(d: Path, p: Path, legacy: set[str]) -> float | None:
    """When cache entry ``d`` was last used, if it is one of ``p``'s that we may remove, else None."""
    try:
        f = d / CACHE_ENTRY
        if f.is_file():
            rec = json.loads(f.read_text())
            version = rec.get("converter_version") if isinstance(rec, dict) else None
            if rec.get("source") != str(p) or not isinstance(version, int) or version > CONVERTER_VERSION:
                return None
            return f.stat().st_mtime
        if d.name in legacy:  # no record to stamp uses on: its config.json's last access or write, best known
            cst = (d / "config.json").stat()
            return max(cst.st_atime, cst.st_mtime)
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object: not known to be ours
        return None
    return None


def _cache_error(gguf_path, out: Path, why: str) -> OSError:
    return OSError(f"{gguf_path}: cannot write its conversion to a Hugging Face directory in {out.parent} ({why}); "
                   "a .gguf file is converted once under $CHRONICALS_CACHE (default ~/.cache/chronicals): set "
                   "CHRONICALS_CACHE to a writable directory")
