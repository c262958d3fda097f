"""Held-out questions: read them, turn them into chat records, answer them greedily, score keywords.

A held-out file holds one JSON object per line (.jsonl) or a JSON array (.json) of
{"question": str, "answer": str, "keywords": [str] or str (optional)}. An answer counts as right when it contains
every keyword (case-insensitive) as whole words: "seven" is not in "seventeen", nor "1742" in "17420" (``has_keyword``);
a string is one keyword ("Lake Ostrel", never split); without keywords, the reference answer's whole text is the
keyword.
"""

from __future__ import annotations

import csv
import json
import logging
import unicodedata
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .._jsonio import atomic_open
from .._words import counted
from ..config import DEMO, DEMO_SYSTEM_PROMPT
from ..data.chat_template import TEMPLATE_DATE, is_template_error
from ..data.formats import FormatError, a_type, check_text
from ..data.readers import DataError, read_file
from ..data.files import resolve_files
from ..data.reporting import report_bad_records
from ..models.generate import generate, greedy_rows, stop_ids
from .guards import check_ids_in_vocab

log = logging.getLogger("chronicals.train")


@dataclass
class QAResult:
    answers: list[str]
    correct: list[bool]

    @property
    def fraction(self) -> float:
        return sum(self.correct) / max(1, len(self.correct))


def demo_file(name: str) -> Path:
    """Path of a packaged demo data file (``train.jsonl`` or ``heldout.jsonl``)."""
    p = Path(str(resources.files("chronicals") / "demo_data" / name))
    if not p.is_file():
        raise FileNotFoundError(f"packaged demo data {p} is missing; reinstall chronicals (pip install -e .)")
    return p


def warn_demo_shadows(value: str, name: str) -> None:
    """``value`` (data.path, data.eval_path, eval's DATA) "demo" is the packaged demo data, also where the working
    directory holds a "demo" file or folder of the user's own, which was then left unread without a word."""
    if value == DEMO and Path(DEMO).exists():
        log.warning("%s=demo is chronicals' packaged demo data, not ./demo in this directory; to read that one, "
                    "pass %s=./demo", name, name)


def read_qa(path: str | Path, on_error: str = "fail", on_error_name: str = "data.on_error") -> list[dict] | None:
    """The held-out questions of ``path`` ('demo' = packaged), or None if its records are not QA records.

    A QA file is JSON lines (.jsonl) or a JSON array (.json) of
    ``{"question": str, "answer": str, "keywords": [str, ...]}``; ``keywords`` is optional: without it (or
    with an empty list) the answer's whole text is the one keyword, so a generated answer is right when it
    contains the reference answer (case-insensitive); a string is one keyword, as ``[str]`` (not split: a
    keyword may hold commas, "2,318"). Returns the records with ``keywords`` filled in, always a list.
    None (not QA: the caller reads the file as ordinary held-out data) when no record has a "question"
    or the file has no records. A .csv / .parquet / directory whose first record has a "question" is a
    DataError saying to convert it (it would fail as "cannot tell the format"). A malformed line or field, or
    a record without "question" beside QA records, is a bad record: DataError ``file:line: ...`` under
    ``on_error="fail"`` (data.on_error); under "skip" it is left out, and one warning counts them and names the
    first three (as load_dataset reports its bad records: ``data.reporting.report_bad_records``).
    ``on_error_name``: what the error calls the on_error option (chronicals eval: --on-error).
    """
    return read_qa_counted(path, on_error, on_error_name)[0]


def read_qa_counted(path: str | Path, on_error: str = "fail", on_error_name: str = "data.on_error"
                    ) -> tuple[list[dict] | None, int, int]:
    """``read_qa``'s records, with the file's record count and how many bad ones on_error=skip left out (0, 0 when
    not a QA file): chronicals eval reports them as it does for a chat file."""
    p = demo_file("heldout.jsonl") if str(path) == DEMO else Path(path).expanduser()
    if p.suffix.lower() not in (".jsonl", ".json") or not p.is_file():
        _refuse_qa_elsewhere(p)
        return None, 0, 0
    records = read_file(p)
    good = [r for r in records if r.data is not None]
    qa = [r for r in good if "question" in r.data]
    if not qa:
        return None, 0, 0
    kept, bad = [], []
    for r in records:
        try:
            if r.data is None:
                raise DataError(f"{r.where}: {r.error}")
            if "question" not in r.data:
                raise DataError(f"{r.where}: a record without 'question' in a held-out QA file (QA record at "
                                f"{qa[0].where}); a held-out file holds QA records only, or chat/text records only")
            kept.append(_qa_record(r.data, r.where))
        except DataError as e:
            bad.append(str(e))
            if on_error == "fail":
                break
    report_bad_records(len(bad), bad, on_error, len(records), str(p), on_error_name)
    return kept, len(records), len(bad)


_PEEK_FILES = 64  # files of a directory whose first record _refuse_qa_elsewhere reads (a line or a schema each)


def _refuse_qa_elsewhere(p: Path) -> None:
    """A held-out path that is not .jsonl/.json (a .csv, .parquet, a directory) holding question/answer
    records: say so before load_dataset fails with "cannot tell the format" on each of them. Peeks at the
    first record of each of the first _PEEK_FILES files only (a CSV header, a parquet schema, a JSON line)."""
    if not p.exists():
        return  # load_dataset names the missing path
    try:  # quiet: the walk's warnings (files it does not read) come once, from the load_dataset after this peek
        files = resolve_files(p, quiet=True)
    except DataError:
        return  # an empty directory, a damaged save_to_disk one: load_dataset reports it
    # any of the first files, not only the first: a QA file sorted after a chat file failed as "cannot tell the
    # format" (a walk of chronicals eval)
    peeked = files[:_PEEK_FILES]
    qa = [f for f in peeked if "question" in _first_keys(f)]
    if not qa:
        return
    first = qa[0]
    if first.suffix.lower() in (".jsonl", ".json"):  # a directory holding one: "convert qadir/qa.jsonl" was no fix
        others = len(peeked) - len(qa)  # chat or text files beside it: merging those in would not do
        more = (f" ({counted(others, 'other file')} of {p} {'holds' if others == 1 else 'hold'} other records; score "
                "them apart)" if others else
                f" (merge the {len(files)} files of {p} into one first)" if len(files) > 1 else "")
        raise DataError(f"{p}: question/answer held-out records are read from one .jsonl or .json file, not a "
                        f"directory; set data.eval_path to {first} itself{more}")
    raise DataError(f"{p}: question/answer held-out records are read from .jsonl or .json only; convert "
                    f"{first} (one {{\"question\": ..., \"answer\": ...}} object per line in a .jsonl) "
                    "and set data.eval_path to it")


def _first_keys(f: Path) -> list[str]:
    """The field names of a data file's first record, cheaply; [] when they cannot be read cheaply."""
    kind = f.suffix.lower()
    try:
        if kind == ".csv":
            with open(f, newline="", encoding="utf-8-sig") as fh:
                return next(csv.reader(fh), [])
        if kind in (".parquet", ".arrow"):
            import pyarrow as pa  # without pyarrow, load_dataset's own error comes first
            import pyarrow.parquet as pq

            if kind == ".parquet":
                return pq.read_schema(f).names
            with pa.memory_map(str(f)) as src:  # datasets.save_to_disk writes the IPC stream format
                return pa.ipc.open_stream(src).schema.names
        if kind == ".jsonl":
            with open(f, encoding="utf-8-sig") as fh:
                line = next((x for x in fh if x.strip()), "{}")
            obj = json.loads(line)
            return list(obj) if isinstance(obj, dict) else []
        recs = read_file(f)  # .json (a held-out file in a directory is small)
        return list(recs[0].data or {}) if recs else []
    except (ImportError, OSError, ValueError, RecursionError, csv.Error):
        return []  # unreadable here: load_dataset reports it with file:line


QA_EXPECTED = 'expected {"question": str, "answer": str, "keywords": [str, ...] or str (optional)}'


def _qa_text(rec: dict, key: str, where: str) -> str:
    if key not in rec:
        raise DataError(f"{where}: missing field {key!r}; {QA_EXPECTED}")
    v = rec[key]
    if v is None or not isinstance(v, str):
        what = "null" if v is None else f"{a_type(v)}, expected a string"
        raise DataError(f"{where}: {key!r} is {what}; {QA_EXPECTED}")
    if not v.strip():
        raise DataError(f"{where}: {key!r} is empty; {QA_EXPECTED}")
    try:
        return check_text(v, repr(key))
    except FormatError as e:
        raise DataError(f"{where}: {e}; {QA_EXPECTED}") from None


def _qa_record(rec: dict, where: str) -> dict:
    question, ans = _qa_text(rec, "question", where), _qa_text(rec, "answer", where)
    kws = rec.get("keywords")
    if kws is None or kws == []:
        kws = [ans.strip()]  # an empty list would make every answer right (all() over nothing)
    want = "expected a list of non-empty strings, or one string (or no 'keywords': the answer's text is the keyword)"
    if isinstance(kws, str):  # "Paris": one keyword; never split on commas ("2,318" is one keyword)
        if not kws.strip():
            raise DataError(f"{where}: 'keywords' is an empty string, {want}")
        kws = [kws]
    if not isinstance(kws, list):
        raise DataError(f"{where}: 'keywords' is {a_type(kws)}, {want}")
    for j, k in enumerate(kws):
        if not isinstance(k, str):
            raise DataError(f"{where}: keywords[{j}] is {a_type(k)}, {want}")
        if not k.strip():
            raise DataError(f"{where}: keywords[{j}] is empty, {want}")
        try:  # else it failed only when the answers were scored, after training
            check_text(k, f"keywords[{j}]")
        except FormatError as e:
            raise DataError(f"{where}: {e}; {want}") from None
    # stripped as the answers are: "Paris " never matched "Paris." (a generation walk)
    return {"question": question, "answer": ans, "keywords": [k.strip() for k in kws]}


def heldout_system_prompt(data) -> str:
    """The system message of held-out QA records and prompts for ``data`` (a DataConfig): data.system_prompt for
    the demo data (whose training records carry it too) or when set to another text than the demo's (the default
    is that text, so setting it to the default is not told apart from leaving it: a documented limit, found in a docs
    walk); else '' (the chat template's default), which is what the user's own records without a system message
    get, so held-out loss and answers see the training prompt."""
    if data.path == DEMO or data.system_prompt != DEMO_SYSTEM_PROMPT:
        return data.system_prompt
    return ""


def chat_messages(question: str, system_prompt: str, answer: str | None = None,
                  history: tuple | list = ()) -> list[dict]:
    """The system message, the earlier turns ``history`` ((user, assistant) pairs, oldest first), ``question`` and
    ``answer`` if given, as chat messages."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for said, replied in history:
        msgs += [{"role": "user", "content": said}, {"role": "assistant", "content": replied}]
    msgs.append({"role": "user", "content": question})
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    return msgs


def write_chat_jsonl(records: list[dict], path: Path, system_prompt: str) -> Path:
    """Chat records (``messages``) with ``system_prompt`` put first where a record has no system message.

    QA records ({"question", "answer"}) become a user turn and an assistant turn.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed: under data parallel every rank writes the same copy, and a rank reading it while
    # another truncated it saw an empty or partial file
    with atomic_open(path) as fh:
        for rec in records:
            if "messages" in rec:
                msgs = list(rec["messages"])
                if system_prompt and (not msgs or msgs[0].get("role") != "system"):
                    msgs.insert(0, {"role": "system", "content": system_prompt})
            else:
                msgs = chat_messages(rec["question"], system_prompt, rec["answer"])
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return path


class TemplateRefused(ValueError):
    """The chat template refused the conversation (its ``raise_exception``: Mistral-7B-Instruct v0.1/v0.2's
    "Conversation roles must alternate", given a system message)."""


def prompt_ids(tokenizer, question: str, system_prompt: str, history: tuple | list = ()) -> torch.Tensor:
    """The chat-templated prompt (after the earlier turns ``history``, see chat_messages) with the assistant turn
    opened, (S,) int64. TemplateRefused (a ValueError) where the template refuses the conversation: it was jinja2's
    bare TemplateError, `chronicals chat`'s "internal error" (exit 4) for a template that takes no system message."""
    try:
        text = tokenizer.apply_chat_template(chat_messages(question, system_prompt, history=history), tokenize=False,
                                             add_generation_prompt=True, date_string=TEMPLATE_DATE)  # as trained
    except Exception as e:
        if is_template_error(e):
            raise TemplateRefused(f"the chat template refused the conversation: {e}") from None
        raise
    # verbose=False: transformers' "Token indices sequence length is longer than ..." came before chat's own message
    # for an over-long prompt, which says how many tokens to cut (a walk of chronicals chat)
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)


def checked_prompt_ids(model, tokenizer, question: str, system_prompt: str,
                       history: tuple | list = ()) -> torch.Tensor:
    """prompt_ids, checked against the model's vocabulary (host tensors: the embedding would raise a bare
    IndexError on the device)."""
    ids = prompt_ids(tokenizer, question, system_prompt, history)
    if len(ids):
        check_ids_in_vocab(model, int(ids.max()), f"the prompt {question[:60]!r} tokenizes to id")
    return ids


def answer(model, tokenizer, question: str, system_prompt: str, max_new_tokens: int, temperature: float = 0.0,
           top_p: float = 1.0, generator: torch.Generator | None = None, history: tuple | list = (),
           streamer=None) -> str:
    """One answer (``models.generate.generate``: greedy, or sampled with ``temperature`` > 0), after the earlier
    turns ``history`` ((user, assistant) pairs); ``streamer`` as generate's (shows the answer as it comes)."""
    ids = checked_prompt_ids(model, tokenizer, question, system_prompt, history)
    out = generate(model, ids, max_new_tokens, eos_token_id=stop_ids(model, tokenizer), temperature=temperature,
                   top_p=top_p, generator=generator, streamer=streamer)
    return tokenizer.decode(out.tolist(), skip_special_tokens=True).strip()


# Prompts decoded together at most: the bf16 KV cache of 64 rows of 1,536 tokens (prompt + answer) takes 1.1 GiB
# at the 0.5B shape (24 layers, 2 kv heads of 64) and 12 GiB at the 8B shape (32 layers, 8 of 128)
QA_BATCH_ROWS = 64


def answer_many(model, tokenizer, questions: list[str], system_prompt: str, max_new_tokens: int) -> list[str]:
    """Greedy answers to ``questions``, decoded in batches of equal prompt length."""
    prompts = [checked_prompt_ids(model, tokenizer, q, system_prompt) for q in questions]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    answers: list[str] = [""] * len(questions)
    # rows of one length, QA_BATCH_ROWS at a time: the KV cache grows with rows x (prompt + answer)
    batches = [same[k:k + QA_BATCH_ROWS] for same in by_len.values() for k in range(0, len(same), QA_BATCH_ROWS)]
    stops = stop_ids(model, tokenizer)  # once: generation_config.json is parsed there
    for idx in batches:
        outs = greedy_rows(model, torch.stack([prompts[i] for i in idx]), max_new_tokens, stops)
        for i, toks in zip(idx, outs):
            answers[i] = tokenizer.decode(toks, skip_special_tokens=True).strip()
    return answers


def answer_all(model, tokenizer, qa: list[dict], system_prompt: str, max_new_tokens: int) -> QAResult:
    answers = answer_many(model, tokenizer, [r["question"] for r in qa], system_prompt, max_new_tokens)
    # no keywords is never right: all() over an empty list would count every answer, even an empty one
    correct = [bool(kw := r.get("keywords")) and all(has_keyword(a, k) for k in kw) for r, a in zip(qa, answers)]
    return QAResult(answers, correct)


def has_keyword(answer: str, keyword: str) -> bool:
    """Whether ``answer`` holds ``keyword`` (case-folded) as whole words: where the keyword begins or ends with a
    letter or digit, the answer's neighbouring character must not be one ("seven" is not in "seventeen", "1742" not
    in "17420", "gold" not in "golden": a substring test credited those; a generation walk). Letters of scripts
    written without spaces (CJK, Thai: Unicode category Lo) are no word's continuation: a keyword edge of one keeps
    the plain substring test, and one beside a keyword edge is a boundary ("1742" in "1742年", "Tower" in "東京Tower":
    the neighbour was judged as \\w, and CJK answers with Latin or digit keywords scored wrong; a mutation walk)."""
    key = _fold(keyword)
    if not key:
        return False

    def bounded(ch: str) -> bool:  # a letter or digit that continues a word (not Lo)
        return ch.isalnum() and unicodedata.category(ch) != "Lo"

    def joins(ch: str) -> bool:  # a neighbour that would make the keyword part of a longer word
        return ch == "_" or bounded(ch)

    text, n = _fold(answer), len(key)
    i = text.find(key)
    while i >= 0:
        if not (bounded(key[0]) and i > 0 and joins(text[i - 1])) and \
                not (bounded(key[-1]) and i + n < len(text) and joins(text[i + n])):
            return True
        i = text.find(key, i + 1)
    return False


def _fold(text: str) -> str:
    """Case-insensitive form for keyword matching: Unicode case folding of the NFC text (lower() left "Straße"
    apart from "STRASSE", and a composed "é" apart from "e" + combining accent)."""
    return unicodedata.normalize("NFC", text).casefold()
