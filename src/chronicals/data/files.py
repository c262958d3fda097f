"""Which files a data path names: a file, a directory of data files (read recursively, hidden names skipped, each
real file once through symlinks), or a ``datasets.save_to_disk`` directory (the arrow files its state.json lists).
``readers`` reads their records. Split out of readers.py (past 600 lines), no behaviour change.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from .._jsonio import read_json_object
from .._words import counted

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")  # a loose .arrow in a directory was skipped unnamed
# files that look like data but that a directory walk does not read (warned about rather than skipped silently)
COMPRESSED = (".gz", ".zst", ".bz2", ".xz", ".zip")
UNREAD = COMPRESSED + (".txt", ".tsv")
# file names of held-out splits (test.jsonl, validation-00000-of-00001.parquet, test_sft.jsonl, val/part-0.jsonl)
HELD_OUT = re.compile(r"(?:^|[-_. ])(?:test|validation|valid|val|eval|dev|held[-_]?out)(?:$|[-_. ])", re.IGNORECASE)

log = logging.getLogger("chronicals.data")


class DataError(ValueError):
    """A dataset problem, phrased as ``file:line: what is wrong, what was expected``."""


def glob_hint(path) -> str:
    """'; glob patterns are not expanded: ...' for a missing path with * ? [ in it (the shell's job, not ours),
    else ''. Appended to the not-found errors of ``resolve_files`` and of the trainer's pre-check."""
    return ("; glob patterns are not expanded: give the directory that holds the files"
            if set("*?[") & set(str(path)) else "")


def resolve_files(paths, quiet: bool = False) -> list[Path]:
    """Paths (files, directories, save_to_disk directories) -> the data files to read, in order.

    A directory is read recursively: its data files (extension in SUFFIXES, any case) and those of its
    subdirectories, in sorted name order; names starting with '.' (hidden files and folders, editor lock
    files such as ``.~lock.a.jsonl#``) are skipped, so are files of other types (a README; compressed shards,
    .txt and .tsv files are named in a warning). Symlinks are followed, each real file is read once.
    ``quiet``: no log lines about skipped files (a caller peeking at the files before the load that reports them).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise DataError("no data files given (expected data files .jsonl/.json/.parquet/.csv or directories of them)")
    files: list[Path] = []
    for p in map(Path, paths):
        p = p.expanduser()
        if not p.exists():
            raise DataError(f"{p}: no such file or directory (expected a data file {'/'.join(SUFFIXES)} "
                            f"or a directory of them{glob_hint(p)})")
        if p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                fix = ("; decompress it first, e.g. to .jsonl" if p.suffix.lower() in COMPRESSED else
                       "; convert it to .jsonl" if p.suffix.lower() in UNREAD else "")
                raise DataError(f"{p}: unsupported file type {p.suffix!r} (expected one of {', '.join(SUFFIXES)}){fix}")
            files.append(p)
            continue
        if not p.is_dir():  # a pipe (data.path=<(zcat x.jsonl.gz)), a socket, a device
            raise DataError(f"{p}: not a regular file or a directory (a pipe?); the data is read more than once (its "
                            "digest keys the tokenization cache, then its records), so write it to a file first "
                            f"(expected a data file {'/'.join(SUFFIXES)} or a directory of them)")
        found = _dir_files(p, quiet)
        if not found:
            raise DataError(f"{p}: directory holds no data files (expected {', '.join(SUFFIXES)} files, in it or "
                            "its subdirectories, or a datasets.save_to_disk directory with state.json)")
        files += found
    return files


def _saved_dataset_files(p: Path) -> list[Path] | None:
    """The arrow files of a ``datasets.save_to_disk`` directory, or None when ``p`` is not one."""
    if (p / "dataset_dict.json").exists():
        splits = _json_object(p / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list):
            splits = []
        raise DataError(f"{p}: a datasets DatasetDict (splits {splits}); pass one split's directory, "
                        f"e.g. {p / (splits[0] if splits else 'train')}")
    if not (p / "state.json").exists():
        return None
    state = _json_object(p / "state.json")
    entries = state.get("_data_files", [])
    if not (isinstance(entries, list) and all(isinstance(f, dict) and isinstance(f.get("filename"), str)
                                              for f in entries)):
        raise DataError(f"{p / 'state.json'}: '_data_files' must list {{'filename': str}} objects (a "
                        "datasets.save_to_disk directory); the file is damaged: save the dataset again")
    if not entries:
        raise DataError(f"{p}/state.json: no '_data_files' listed (expected a datasets.save_to_disk directory)")
    outside = [f["filename"] for f in entries if Path(f["filename"]).is_absolute() or ".." in Path(f["filename"]).parts]
    if outside:  # save_to_disk lists names inside the directory; p / "/abs" would read a file elsewhere
        raise DataError(f"{p / 'state.json'}: '_data_files' names files outside this directory "
                        f"({_some([Path(m) for m in outside])}); save_to_disk lists names inside it: the file is "
                        "damaged or hand-edited, save the dataset again")
    files = [p / f["filename"] for f in entries]
    missing = [f["filename"] for f, path in zip(entries, files) if not path.is_file()]
    if missing:  # a copy or download that stopped partway: state.json came, a shard did not
        raise DataError(f"{p / 'state.json'}: lists {len(missing)} arrow file{'s'[:len(missing) != 1]} this "
                        f"directory lacks ({_some([Path(m) for m in missing])}); copy the whole save_to_disk "
                        "directory again or save the dataset again")
    return files


def _dir_files(p: Path, quiet: bool = False) -> list[Path]:
    """The data files under directory ``p`` (see resolve_files), each real file once.

    Symlinks are followed, but a file or directory reached through one is skipped when its real path is also
    reached without symlinks, or was reached before: ``data/latest -> v2`` beside ``data/v2/`` reads v2's files
    once (as ``data/v2/...``), and a link back to an ancestor (a loop) ends there instead of recursing.
    """
    saved = _saved_dataset_files(p)
    if saved is not None:
        return saved
    direct_dirs, direct_files = set(), set()  # real paths reached without following a symlink
    for root, dirs, names in os.walk(p):  # followlinks=False: lists symlinked directories but does not enter them
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        direct_dirs.add(os.path.realpath(root))
        direct_files.update(os.path.realpath(os.path.join(root, n)) for n in names
                            if not n.startswith(".") and not os.path.islink(os.path.join(root, n)))
    out, unread, dup = [], [], []
    seen = {os.path.realpath(p)}  # real paths of the directories walked and the files taken

    def walk(d: Path, via_link: bool) -> None:
        for f in sorted(d.iterdir()):
            if f.name.startswith("."):
                continue
            link = via_link or f.is_symlink()
            real = os.path.realpath(f)
            if f.is_dir():
                if link and (real in direct_dirs or real in seen):
                    dup.append(f)
                    continue
                seen.add(real)
                saved = _saved_dataset_files(f)
                if saved is None:
                    walk(f, link)
                else:
                    out.extend(saved)
            elif f.is_file():
                if link and (real in direct_files or real in seen):
                    if f.suffix.lower() in SUFFIXES:
                        dup.append(f)
                    continue
                seen.add(real)
                if f.suffix.lower() in SUFFIXES:
                    out.append(f)
                elif f.suffix.lower() in UNREAD:
                    unread.append(f)
            elif f.is_symlink() and f.suffix.lower() in SUFFIXES:  # a data file's link to nothing: a missing shard
                raise DataError(f"{f}: a symlink to {os.readlink(f)}, which does not exist, so this data file cannot "
                                f"be read (a download that did not finish?); restore its target or remove the link")

    walk(p, False)
    if quiet:
        return out
    _warn_splits(p, out)
    if dup:
        log.info("%s: %s reached again through a symlink, not read twice: %s", p,
                 counted(len(dup), "entry", "entries"), _some(dup))
    if unread:
        log.warning("%s: %s not read: %s; a data directory is read for %s files only (decompress "
                    "compressed shards, convert text/TSV files to .jsonl)", p, counted(len(unread), "file"),
                    _some(unread), ", ".join(SUFFIXES))
    return out


def _warn_splits(p: Path, files: list[Path]) -> None:
    """Warn when directory ``p`` holds files named like held-out splits (``HELD_OUT``) beside others: a dataset's
    train.jsonl, test.jsonl and validation.jsonl were all trained on without a word (a user walk), so the model saw
    its test set. Only beside other files: a directory of held-out files alone is how a held-out set is given."""
    held = [f for f in files if any(HELD_OUT.search(part) for part in f.relative_to(p).with_suffix("").parts)]
    if held and len(held) < len(files):
        log.warning("%s: %s named like a held-out split, read with the others as one set: %s; to keep a split "
                    "held out, point data.path at the training files and data.eval_path at the held-out ones "
                    "(load_dataset: one call each)", p, counted(len(held), "file"), _some(held))


def _some(paths: list[Path], n: int = 3) -> str:
    return ", ".join(map(str, paths[:n])) + (f" and {len(paths) - n} more" if len(paths) > n else "")


def _json_object(path: Path) -> dict:
    """A small JSON file that must hold one object (state.json, dataset_dict.json)."""
    return read_json_object(path, f"datasets.save_to_disk {path.name}",
                            "save the dataset again (datasets' save_to_disk)", error=DataError)
