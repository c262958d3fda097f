"""Reading records from local files: .jsonl, .json, .parquet, .csv, directories of them, and
``datasets.save_to_disk`` directories (arrow IPC files listed in state.json).

Each record comes with where it was found (``train.jsonl:41``) so that every later error can say
``file:line: what is wrong, what was expected``. A record that cannot be parsed is returned as an error
entry, and the caller decides to fail or skip (``on_error``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Record:
    where: str  # "path:line" (or "path:row N" for parquet / arrow)
    data: dict | None  # the record, or None when it could not be read
    error: str | None = None  # what is wrong and what was expected, when data is None


class DataError(ValueError):
    """A dataset problem, phrased as ``file:line: what is wrong, what was expected``."""


def resolve_files(paths) -> list[Path]:
    """Paths (files, directories, save_to_disk directories) -> the data files to read, in order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        p = p.expanduser()
        if not p.exists():
            raise DataError(f"{p}: no such file or directory (expected a data file {'/'.join(SUFFIXES)} "
                            "or a directory of them)")
        if p.is_file():
            if p.suffix not in SUFFIXES and p.suffix != ".arrow":
                raise DataError(f"{p}: unsupported file type {p.suffix!r} (expected one of {', '.join(SUFFIXES)})")
            files.append(p)
        elif (p / "dataset_dict.json").exists():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise DataError(f"{p}: a datasets DatasetDict (splits {splits}); pass one split's directory, "
                            f"e.g. {p / (splits[0] if splits else 'train')}")
        elif (p / "state.json").exists():
            state = json.loads((p / "state.json").read_text())
            names = [f["filename"] for f in state.get("_data_files", [])]
            if not names:
                raise DataError(f"{p}/state.json: no '_data_files' listed (expected a datasets.save_to_disk directory)")
            files += [p / n for n in names]
        else:
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise DataError(f"{p}: directory holds no data files (expected {', '.join(SUFFIXES)} files, "
                                "or a datasets.save_to_disk directory with state.json)")
            files += found
    return files


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_file(path: Path) -> list[Record]:
    """All records of one file, in order."""
    if path.suffix == ".jsonl":
        return _read_jsonl(path, path.read_text(encoding="utf-8"))
    if path.suffix == ".json":
        return _read_json(path)
    if path.suffix == ".csv":
        return _read_csv(path)
    return _read_arrow(path)  # .parquet, .arrow


def _read_jsonl(path: Path, text: str) -> list[Record]:
    out = []
    # split on "\n" only: str.splitlines also breaks at U+2028, U+2029 and U+0085, which JSON allows
    # unescaped inside strings (json.dumps(..., ensure_ascii=False) writes them raw); "\r" is JSON whitespace
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.append(Record(where, None, f"invalid JSON ({e.msg} at column {e.colno}); "
                                           "expected one JSON object per line"))
            continue
        if not isinstance(obj, dict):
            out.append(Record(where, None, f"a JSON {type(obj).__name__}, expected a JSON object per line"))
            continue
        out.append(Record(where, obj))
    return out


def _read_json(path: Path) -> list[Record]:
    """A JSON array of objects (each record located by its line), or JSON lines saved as .json."""
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if i == len(text):
        return []
    if text[i] != "[":
        return _read_jsonl(path, text)  # {...}\n{...}: JSON lines under a .json name
    out, line, last = [], 1, 0
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            line += text.count("\n", last, i)
            out.append(Record(f"{path}:{line}", None, "JSON array not closed; expected ']' at the end"))
            return out
        line += text.count("\n", last, i)
        last = i
        if text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            out.append(Record(f"{path}:{e.lineno}", None, f"invalid JSON ({e.msg} at column {e.colno}); "
                                                           "expected a JSON array of objects (reading stops here)"))
            return out
        if isinstance(obj, dict):
            out.append(Record(f"{path}:{line}", obj))
        else:
            out.append(Record(f"{path}:{line}", None, f"a JSON {type(obj).__name__} in the array, expected objects"))


def _read_csv(path: Path) -> list[Record]:
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        start = 2  # line 1 is the header
        for row in reader:
            where = f"{path}:{start}"
            start = reader.line_num + 1
            if None in row:
                out.append(Record(where, None, f"{len(reader.fieldnames) + len(row[None])} fields, expected "
                                               f"{len(reader.fieldnames)} (the header's columns)"))
                continue
            out.append(Record(where, {k: v for k, v in row.items()}))
    return out


def _read_arrow(path: Path) -> list[Record]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading {path.suffix} files needs pyarrow; pip install 'chronicals[data]'") from e
    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:  # datasets writes the arrow IPC streaming format; plain IPC files are accepted too
        try:
            with pa.memory_map(str(path)) as src:
                table = pa.ipc.open_stream(src).read_all()
        except pa.ArrowInvalid:
            with pa.memory_map(str(path)) as src:
                table = pa.ipc.open_file(src).read_all()
    return [Record(f"{path}:row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
