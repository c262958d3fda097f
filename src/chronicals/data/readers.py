"""Reading records from local files: .jsonl, .json, .parquet, .csv (``files.resolve_files`` finds them in
directories and ``datasets.save_to_disk`` directories).

Each record comes with where it was found (``train.jsonl:41``) so that every later error can say
``file:line: what is wrong, what was expected``. A record that cannot be parsed is returned as an error
entry, and the caller decides to fail or skip (``on_error``).
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from .._jsonio import BIG_NUMBER, NESTED, json_error  # NESTED: a record that deep is not data
from .._words import counted
from .files import DataError
from .formats import FormatError, detect_format

# a clone without git-lfs leaves this text where each data file should be
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
# (first bytes, the suffix whose files start so, what a file starting so is, what to do: {kind} is its suffix) for
# files that are not of the kind their name says; None: no data file of ours starts so
OTHER_KINDS = ((b"\x1f\x8b", None, "a gzip file (it starts with gzip's magic bytes 1f 8b)",
                "decompress it first: gunzip -c FILE > NEW{kind}"),
               (b"PK\x03\x04", None, "a zip archive (it starts with zip's magic bytes PK 03 04)",
                "extract it (unzip FILE) and give the files inside"),
               (b"PAR1", ".parquet", "a parquet file (it starts and ends with parquet's magic bytes PAR1)",
                "name it .parquet"),
               (b"ARROW1", ".arrow", "an arrow file (it starts with arrow's magic bytes ARROW1)", "name it .arrow"),
               (LFS_POINTER, None, f"a Git LFS pointer, not the data (it starts with '{LFS_POINTER.decode()}': "
                                   "cloned without git-lfs?)", "run git lfs pull in its repository, or download "
                                                               "the file itself"))

log = logging.getLogger("chronicals.data")


@dataclass
class Record:
    where: str  # "path:line" (or "path:row N" for parquet / arrow)
    data: dict | None  # the record, or None when it could not be read
    error: str | None = None  # what is wrong and what was expected, when data is None
    from_csv: bool = False  # a CSV row: every cell is a string, so message lists come as JSON text


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_file(path: Path) -> list[Record]:
    """All records of one file, in order. Text files are UTF-8, a leading byte-order mark is ignored."""
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[Record]:
    """The records of one file, in order, as ``read_file``'s, made as they are taken: as a list they took ~5x the
    file's size in memory. JSON lines and CSV are read a line at a time (a 10 GB .jsonl was read whole before its
    first record); a .json array's text is decoded whole (one JSON value), its records are not held."""
    kind = path.suffix.lower()
    _refuse_other_kind(path, kind)
    if kind in (".jsonl", ".json", ".csv"):
        with open(path, "rb") as f:
            head = f.read(4)
        # UTF-32-LE's mark starts with UTF-16-LE's, so it is tested first (iconv -f utf-16 garbles UTF-32)
        utf = next((n for n, boms in ((32, (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
                                      (16, (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)))
                    if head.startswith(boms)), None)
        if utf:  # PowerShell's `>` writes UTF-16: every line failed
            raise DataError(f"{path}: UTF-{utf} (it starts with a UTF-{utf} byte-order mark), expected UTF-8; "
                            f"re-encode it: iconv -f utf-{utf} -t utf-8 FILE > NEW (PowerShell: Out-File -Encoding "
                            "utf8)")
    if kind == ".jsonl":
        return _iter_jsonl_file(path)
    if kind == ".json":
        return _iter_json(path)
    if kind == ".csv":
        return _iter_csv(path)
    return _iter_arrow(path)  # .parquet, .arrow


def _refuse_other_kind(path: Path, kind: str) -> None:
    """A DataError when ``path``'s first bytes say it is another kind of file than its name (``OTHER_KINDS``): a
    gzip file named .jsonl was "not valid UTF-8 at byte 1 ...; re-encode the file as UTF-8 (iconv ...)", a parquet
    file named .jsonl the same, a Git LFS pointer "invalid JSON" or "not a readable parquet file"."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(LFS_POINTER))
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4))
            tail = f.read()
    except OSError:  # unreadable: its reader says so, as before
        return
    for magic, suffix, what, fix in OTHER_KINDS:
        # parquet ends with its magic too: a CSV whose header starts "PAR1" is not mistaken for one
        if head.startswith(magic) and kind != suffix and (magic != b"PAR1" or tail == magic):
            raise DataError(f"{path}: {what}; {fix.format(kind=kind)}")


def _not_utf8(e: UnicodeDecodeError, offset: int) -> str:
    return (f"not valid UTF-8 at byte {offset + e.start} ({e.reason}: {e.object[e.start:e.start + 4]!r}); "
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > NEW)")


def _decode(path: Path, data: bytes) -> str:
    """The text of a whole file (.json, .csv); a byte that is not UTF-8 fails with its line and offset."""
    bom = 3 if data.startswith(codecs.BOM_UTF8) else 0  # Excel and Notepad write one; utf-8-sig semantics
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, bom + e.start) + 1
        raise DataError(f"{path}:{line}: {_not_utf8(e, bom)}") from None


def _iter_jsonl_file(path: Path) -> Iterator[Record]:
    with open(path, "rb") as f:
        yield from _iter_jsonl(path, f)


def _iter_jsonl(path: Path, f: BinaryIO) -> Iterator[Record]:
    """JSON lines from a binary file (or BytesIO); each line is decoded alone, so a line that is not UTF-8 is one
    bad record (skipped and counted under on_error=skip) rather than the whole file."""
    _refuse_spread_json(path, f)
    # split on "\n" only (a binary file's lines): str.splitlines also breaks at U+2028, U+2029 and U+0085, which
    # JSON allows unescaped inside strings (json.dumps(..., ensure_ascii=False) writes them raw); "\r" is JSON
    # whitespace. b"\n" never occurs inside a multi-byte UTF-8 sequence, so splitting the bytes is safe.
    offset = 0
    for i, raw in enumerate(f, 1):
        where, start, offset = f"{path}:{i}", offset, offset + len(raw)
        if i == 1 and raw.startswith(codecs.BOM_UTF8):  # Excel and Notepad write one; utf-8-sig semantics
            raw, start = raw[3:], 3
        raw = raw.removesuffix(b"\n")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield Record(where, None, _not_utf8(e, start))
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield Record(where, None, _bad_line(line, e))
            continue
        except RecursionError:
            yield Record(where, None, f"{NESTED}; expected one JSON object per line")
            continue
        except ValueError:
            yield Record(where, None, f"{BIG_NUMBER}; expected one JSON object per line")
            continue
        if not isinstance(obj, dict):
            yield Record(where, None, f"a JSON {type(obj).__name__}, expected a JSON object per line")
            continue
        yield Record(where, obj)


def _bad_line(line: str, e: json.JSONDecodeError) -> str:
    """What is wrong with a JSON line that does not parse (``e``), with the fix where its text shows the cause."""
    if line[e.pos:e.pos + 1] == "\ufeff":
        return _mid_file_bom(e)
    fix = ""
    if "\r" in line.strip() and e.msg == "Extra data":
        fix = "; the lines end in a bare carriage return ('\\r'), not '\\n': convert them (tr '\\r' '\\n' < FILE > NEW)"
    elif line.lstrip().startswith("{") and e.pos >= len(line.rstrip()):  # the object still open at the line's end
        if line.rstrip()[-1] in "{[,":  # '{' or '{"text": "a",': an object's first line; a file that is one object
            # spread over lines is said whole (_refuse_spread_json), several not
            fix = ("; the objects seem pretty-printed over several lines, and JSON lines need each object on one "
                   "line: rewrite them, e.g. jq -c . FILE > NEW.jsonl")
        elif lacks := _unclosed(line):  # a whole value, then the end: was told "pretty-printed" too (a walk)
            fix = (f"; the line ends before its record closes (it lacks {lacks!r} at its end): the record was cut "
                   "short or lost its closing brackets; complete it or remove the line")
    return f"invalid JSON ({json_error(e)}); expected one JSON object per line{fix}"


def _unclosed(line: str) -> str:
    """The closing brackets of the objects and arrays still open at the end of JSON text ``line``, innermost first
    ('{"a": [1, {"b": 2}' -> ']}'); brackets inside strings do not count."""
    closers, in_string, escaped = [], False, False
    for ch in line:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and closers:
            closers.pop()
    return "".join(reversed(closers))


def _mid_file_bom(e: json.JSONDecodeError) -> str:
    """A UTF-8 byte-order mark where ``e`` stopped: a file's first bytes (a leading one is ignored), so one inside a
    file is most likely where two files were joined (cat a.jsonl b.jsonl); json's own "Unexpected UTF-8 BOM
    (decode using utf-8-sig)" named a fix that does not apply mid-file."""
    return (f"a UTF-8 byte-order mark (BOM, bytes EF BB BF) at column {e.colno}, in the middle of the file (two "
            "files joined?); remove it, e.g. sed 's/\\xEF\\xBB\\xBF//g' FILE > NEW")


def _refuse_spread_json(path: Path, f: BinaryIO) -> None:
    """A DataError when the JSON-lines file ``path`` (open as ``f``, left at its start) is one JSON value spread over
    lines (pretty-printed, the first line a lone '[' or '{'): every line was a bad record ('invalid JSON at column
    2', ...), none naming the cause."""
    head = [f.readline() for _ in range(8)]
    head[0] = head[0].removeprefix(codecs.BOM_UTF8)  # BOM + a blank line: that line is blank
    first = next((line.strip() for line in head if line.strip()), b"")
    f.seek(0)
    if first not in (b"[", b"{"):
        return
    try:  # the whole file, once: only a file that opens like one JSON value gets here
        value = json.loads(f.read().removeprefix(codecs.BOM_UTF8))
    except (ValueError, RecursionError):  # not one value: the lines say what is wrong with them
        return
    finally:
        f.seek(0)
    if isinstance(value, list):
        raise DataError(f"{path}: one JSON array spread over lines (pretty-printed), not JSON lines; rename the file "
                        f"to {path.stem}.json (read as an array of records), or write one record per line")
    raise DataError(f"{path}: one JSON {'object' if isinstance(value, dict) else type(value).__name__} spread over "
                    "lines (pretty-printed), not JSON lines; write each record on one line (json.dumps(record) per "
                    "line), or, for a list of records under a key, save that list as a .json file")


def _iter_json(path: Path) -> Iterator[Record]:
    """A JSON array of objects (each record located by its line), or JSON lines saved as .json; a file that is
    one JSON object over several lines, or a wrapper of records such as {"data": [...]}, is a DataError."""
    data = path.read_bytes()
    head = data.lstrip(codecs.BOM_UTF8 + b" \t\r\n")
    if not head.startswith(b"["):
        if head.startswith(b"{"):
            _refuse_one_object(path, data)
        yield from _iter_jsonl(path, io.BytesIO(data))  # {...}\n{...}: JSON lines under a .json name (or empty)
        return
    text = _decode(path, data)
    del data, head  # the text is the file from here on: one copy, not two
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    count, line, last = 0, 1, 0  # count: elements read
    i += 1

    def skip_space(at: int) -> int:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        return at

    def stop(at: int, what: str) -> DataError:  # a malformed array
        return _array_stops(path, text.count(chr(10), 0, at) + 1, f"invalid JSON array: {what}")

    while True:
        i = skip_space(i)
        nxt = text[i] if i < len(text) else ""  # "": the end, said below
        if nxt == "," and not count:  # [,{...}]
            raise stop(i, "a ',' before the first element")
        if count and nxt not in ("", ",", "]"):  # [{...} {...}]
            raise stop(i, "expected ',' or ']' after an element")
        if nxt == ",":
            i = skip_space(i + 1)
            if i < len(text) and text[i] in ",]":  # [{...},,{...}] or [{...},]
                raise stop(i, "a ',' with no element after it")
        if i >= len(text):
            line += text.count("\n", last, i)
            yield Record(f"{path}:{line}", None, "JSON array not closed; expected ']' at the end")
            return
        line += text.count("\n", last, i)
        last = i
        if text[i] == "]":
            rest = text[i + 1:]
            if rest.strip():  # e.g. a second array appended: its records would be lost without a word
                line += text.count("\n", i, i + 1 + len(rest) - len(rest.lstrip()))
                yield Record(f"{path}:{line}", None, "content after the JSON array's closing ']' (not read); "
                             "expected one array per file: merge the arrays, or write JSON lines")
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            what = _mid_file_bom(e) if text[e.pos:e.pos + 1] == "\ufeff" else f"invalid JSON ({json_error(e)})"
            raise _array_stops(path, e.lineno, what) from None
        except RecursionError:
            raise _array_stops(path, line, NESTED, "an element it cannot parse") from None
        except ValueError:
            raise _array_stops(path, line, BIG_NUMBER, "an element it cannot parse") from None
        count += 1
        if isinstance(obj, dict):
            yield Record(f"{path}:{line}", obj)
        else:
            yield Record(f"{path}:{line}", None, f"a JSON {type(obj).__name__} in the array, expected objects")


def _array_stops(path: Path, line: int, what: str, past: str = "a syntax error") -> DataError:
    """The error for a JSON array that cannot be read past ``line``, whatever on_error: the end of a malformed element
    cannot be found, so as one skipped bad record it lost every record after it without a word (a user walk: "40
    examples of 41 records (1 bad record skipped)" from a file of 70)."""
    return DataError(f"{path}:{line}: {what}; a JSON array cannot be read past {past}, so it is not skipped as one "
                     f"bad record (every record after it would be lost): fix line {line}, or write the data as JSON "
                     "lines (.jsonl, one object per line), where a bad line is skipped alone")


def _refuse_one_object(path: Path, data: bytes) -> None:
    """Raise when a .json file is one JSON object rather than JSON lines: a wrapper such as {"data": [...]}, or
    one record spread over lines, would otherwise be read line by line as "invalid JSON" records.

    One object on one line that is a record ({"text": ...}) is one line of JSON lines, and passes.
    """
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, a number too long
        return  # JSON lines ("Extra data" after the first line) or damaged: _iter_jsonl reports each line
    try:
        detect_format(obj)
        record = True
    except FormatError:
        record = False
    # a key holding the records: a non-empty list of objects that are not chat messages (role / from)
    key = None if record else next((k for k, v in obj.items() if isinstance(v, list) and v and all(
        isinstance(x, dict) for x in v) and not {"role", "from"} & set(v[0])), None)
    one_line = b"\n" not in data.strip()
    if one_line and key is None:
        return
    msg = (f"{path}: a JSON object, expected an array of records ([{{...}}, {{...}}]) or JSON lines (one object "
           "per line)")
    if key is not None:
        msg += (f"; the records may be under key {key!r}: extract them to a .jsonl "
                f"(jq -c '.[\"{key}\"][]' {path} > {path.with_suffix('.jsonl').name})")
    elif record:
        msg += "; if it is one record, write it on one line or inside [ ]"
    raise DataError(msg)


# a cell may hold a whole document: the csv module's default limit (131,072 characters) would refuse a long one as
# "malformed"; a process-wide setting, raised once (2^31 - 1: the largest every platform's C long holds)
CSV_FIELD_LIMIT = 2 ** 31 - 1


def _iter_csv(path: Path) -> Iterator[Record]:
    """Rows of a CSV file with a header line (blank lines skipped), each named by the line it starts on, read a
    line at a time. strict: a field opened with a quote and never closed would otherwise swallow every later row
    into one cell, silently. A byte that is not UTF-8 fails with its line and offset (``_decode``)."""
    if csv.field_size_limit() < CSV_FIELD_LIMIT:
        csv.field_size_limit(CSV_FIELD_LIMIT)
    names = None
    start = 1
    # utf-8-sig: a leading byte-order mark (Excel writes one) is not part of the first column's name
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, strict=True)
        try:
            while True:
                start = reader.line_num + 1  # the row read next starts on the line after the last one read
                row = next(reader, None)
                if row is None:
                    break
                if not row:  # a blank line
                    continue
                if names is None:
                    names = _csv_header(path, start, row)
                    continue
                if len(row) != len(names):
                    yield Record(f"{path}:{start}", None,
                                 f"{counted(len(row), 'field')}, expected {len(names)} (the header's columns)")
                    continue
                yield Record(f"{path}:{start}", dict(zip(names, row)), from_csv=True)
        except UnicodeDecodeError:  # decoded in blocks ahead of the rows: the whole file says where, once
            _decode(path, path.read_bytes())
            raise
        except csv.Error as e:
            if "end of data" in str(e):  # EOF inside a quoted field
                raise DataError(f"{path}:{start}: unclosed quote: a field of the row starting here opens a '\"' that "
                                "is never closed, so every later line would be read into it; close the quote (write a "
                                "quote inside a quoted field as \"\")") from None
            raise DataError(f"{path}:{start}: malformed CSV ({e}); expected comma-separated fields, quoted fields "
                            "closed by '\"' right before the comma or line end") from None


def _csv_header(path: Path, line: int, row: list[str]) -> list[str]:
    """The column names of a CSV header ``row``, without the spaces around them: "prompt, completion" (how CSV is
    written by hand) named a column ' completion', and the row read as "it has 'prompt' but no 'completion'". A name
    of ours never has such spaces, and the cells keep theirs. Names equal but for spaces are duplicates."""
    names = [n.strip() for n in row]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:  # a dict keeps one column of a name: the others' cells would be lost
        spaced = " (names are compared without the spaces around them)" if names != row else ""
        raise DataError(f"{path}:{line}: column {dup!r} appears {names.count(dup)} times in the header{spaced}; "
                        "expected distinct column names (rename or remove the extra columns)")
    return names


def pyarrow_modules(path: Path):
    """(pyarrow, pyarrow.parquet) to read ``path`` (a .parquet / .arrow file), or the DataError that says how to
    install them (also raised early, before a model loads, by train.guards)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading {path.suffix} files needs pyarrow; pip install 'chronicals[data]'") from e
    return pa, pq


def _iter_arrow(path: Path) -> Iterator[Record]:
    """A .parquet / .arrow file's rows as records, one record batch at a time (the whole table's to_pylist took
    ~27x the parquet file's size in memory; a data walk at scale)."""
    pa, pq = pyarrow_modules(path)
    kind = path.suffix[1:].lower()

    def batches():
        if kind == "parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=1_000)
            return
        with pa.memory_map(str(path)) as src:  # datasets writes the arrow IPC streaming format; files are accepted
            try:
                stream = pa.ipc.open_stream(src)
            except pa.ArrowInvalid:  # not a stream (a damaged stream fails later, below, as damaged)
                stream = None
            if stream is not None:
                yield from stream
                return
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_file(src)
            for k in range(reader.num_record_batches):
                yield reader.get_batch(k)

    i = 0
    try:
        for batch in batches():
            for row in batch.to_pylist():
                i += 1
                yield Record(f"{path}:row {i}", row)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable {kind} file ({type(e).__name__}: {e}); it is damaged or not "
                        f"{kind}: write it again, or remove it from the data") from None
