"""Score a model on a dataset without training: ``chronicals eval``.

The numbers are the trainer's own, from the same code: the held-out loader ``train()`` builds (a question/answer
file rewritten as chat records with ``qa.heldout_system_prompt``, then ``chronicals.data.load_dataset`` and an
unshuffled ``PackedLoader``, as ``train.setup.build_loaders`` does for ``data.eval_path``), the loss of
``train.step.evaluate_loss`` (mean over loss tokens, through the fused loss head: no logits built) and the
keyword score of ``train.qa.answer_all``. So an adapter scored on the data its run held out gives that run's
"after" numbers::

    chronicals eval --adapter runs/demo/adapter demo     # the demo's held-out questions: loss and keywords

``evaluate(model, tokenizer, data, device)`` -> ``EvalResult``; ``data`` is a ``config.DataSection`` whose
``path`` is the file to score (``demo``: the packaged held-out questions). ``read_eval_data(tokenizer, data)`` reads
it without the model, for ``evaluate(..., read=)``: chronicals eval says a bad record before the weights load.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ._jsonio import write_text_atomic
from ._numbers import is_int
from ._words import counted
from .config import DataSection
from .data import DataError, DatasetStats, PackedLoader
from .data.dataset import map_stat_texts
from .models import require_chat_template
from .train.guards import check_ids_in_vocab
from .train.qa import QAResult, answer_all, heldout_system_prompt, read_qa_counted, write_chat_jsonl
from .train.setup import DATA_OPTION_KEYS, heldout_loader as setup_heldout_loader
from .train.step import evaluate_loss

log = logging.getLogger("chronicals.evaluate")


# DatasetStats counts written to --json beside records and examples (the summary line's "(2 bad records skipped, ...)")
LOST_COUNTS = ("skipped_errors", "truncated", "dropped_overlong", "split", "split_pieces", "dropped_no_loss")


@dataclass
class EvalResult:
    data: str  # the file scored (or "demo")
    loss: float  # mean cross-entropy per loss token
    loss_tokens: int
    examples: int  # documents scored (records kept after the data options)
    stats: DatasetStats
    system_prompt: str | None = None  # the system message of the QA prompts (None: not a QA file)
    qa: list[dict] | None = None  # the question records answered (after qa_limit)
    answers: QAResult | None = None
    settings: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        try:
            return math.exp(self.loss)
        except OverflowError:  # loss > ~709.8
            return math.inf

    def as_dict(self) -> dict:
        """The numbers as JSON values (a non-finite loss or perplexity is null)."""
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        out = {"data": self.data, "loss": num(self.loss), "perplexity": num(self.perplexity),
               "examples": self.examples, "loss_tokens": self.loss_tokens, "records": self.stats.records,
               # what the summary's parentheses say the data lost or split on the way in, as numbers
               **{k: getattr(self.stats, k) for k in LOST_COUNTS}, **self.settings, "qa": None}
        if self.answers is not None:
            res = self.answers
            out["qa"] = {"correct": sum(res.correct), "total": len(res.correct), "accuracy": res.fraction,
                         "system_prompt": self.system_prompt,
                         "answers": [{"question": r["question"], "keywords": r["keywords"], "answer": a, "correct": c}
                                     for r, a, c in zip(self.qa, res.answers, res.correct)]}
        return out

    def summary(self) -> str:
        st = self.stats
        lost = st.losses("--max-seq-len")
        lines = [f"data: {self.data}: {counted(self.examples, 'example')} of {counted(st.records, 'record')}"
                 + (f" ({', '.join(lost)})" if lost else "") + f", {self.loss_tokens} loss tokens",
                 f"held-out loss {self.loss:.4f}, perplexity {self.perplexity:#.4g}"]  # 13.00, not 13
        if self.answers is not None:
            res = self.answers
            # unquoted as chat says it: 'none' in quotes would read as a system message of that text
            system = repr(self.system_prompt) if self.system_prompt else "none (the chat template's default)"
            lines.append(f"held-out answers with their keywords: {res.fraction:.0%} ({sum(res.correct)}/"
                         f"{len(res.correct)}; greedy, system message {system})")
        return "\n".join(lines)


def heldout_loader(data: DataSection, tokenizer, workdir: Path, option_names: dict[str, str] | None = None,
                   system_prompt: str | None = None) -> tuple[PackedLoader, list[dict] | None]:
    """(loader, QA records or None) over ``data.path``, as ``train()`` builds its held-out loader: QA records are
    written to ``workdir`` as chat records (the system message ``system_prompt``, None: ``qa.heldout_system_prompt``)
    and read as chat, the loader's stats counting the QA file's records and bad ones skipped; other data is read
    with ``data.format`` (``train.setup.heldout_loader`` for both). ``option_names``: what the data's errors and
    warnings call the options (``load_dataset``'s option_names; None: the config keys,
    ``train.setup.DATA_OPTION_KEYS``, as train says them)."""
    names = DATA_OPTION_KEYS | (option_names or {})
    qa, records, skipped = read_qa_counted(data.path, data.on_error, on_error_name=names["on_error"])
    if qa is None:  # load_dataset's messages name the files after it: "the data to score (x.jsonl)"
        return setup_heldout_loader(data, tokenizer, Path(data.path).expanduser(), False, "the data to score",
                                    option_names=names), qa
    require_chat_template(tokenizer, "question/answer records are read as chat whatever data.format; to score "
                          "this model without a template, give text or prompt/completion records")  # once, as chat
    system = heldout_system_prompt(data) if system_prompt is None else system_prompt
    file = write_chat_jsonl(qa, workdir / "heldout.jsonl", system)
    name = f"the QA records of {data.path}, rewritten as chat"
    hide = _Unnamed(file)  # "record 3", not the rewritten file's path: it is deleted before the message is read
    data_log = logging.getLogger("chronicals.data")
    data_log.addFilter(hide)
    try:
        # not through the tokenization cache: its entries replace older ones of the same file path, and this copy's
        # path is new each time, so every edit of a QA file left one entry behind for good (a walk of chronicals
        # eval); a QA file's questions tokenize in well under a second (35 in the demo's)
        loader = setup_heldout_loader(replace(data, cache_dir="none"), tokenizer, file, True, name,
                                      option_names=names)
    except DataError as e:
        raise DataError(hide.text(str(e))) from None
    finally:
        data_log.removeFilter(hide)
    st = loader.dataset.stats  # the chat copy's records are the QA file's good ones: count the file's own
    loader.dataset.stats = st = replace(st, records=records, skipped_errors=st.skipped_errors + skipped)
    map_stat_texts(st, hide.text)  # its "file:line" texts name the deleted copy, as the messages did
    return loader, qa


class _Unnamed(logging.Filter):
    """Takes a temporary file's path out of the messages about it (warnings of chronicals.data, errors)."""

    def __init__(self, file: Path):
        super().__init__()
        self.file = str(file)

    def text(self, message: str) -> str:
        return message.replace(f" ({self.file})", "").replace(f"{self.file}:", "record ").replace(self.file, "it")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.file in message:
            record.msg, record.args = self.text(message), None
        return True


@dataclass
class EvalData:
    """The data ``evaluate`` scores, read and tokenized (``read_eval_data``), which needs the tokenizer alone:
    chronicals eval reads it before the model's weights load, so a bad record is said first."""
    loader: PackedLoader
    qa: list[dict] | None  # the question records of a QA file (None: not one)
    system_prompt: str | None  # the system message of the QA prompts ('' = none)


def read_eval_data(tokenizer, data: DataSection, option_names: dict[str, str] | None = None,
                   system_prompt: str | None = None) -> EvalData:
    """``data.path`` read and tokenized as ``evaluate`` scores it (``heldout_loader``; a QA file's chat copy goes to
    a temporary directory, removed once read). ``option_names``, ``system_prompt``: as ``evaluate`` takes them."""
    system = heldout_system_prompt(data) if system_prompt is None else system_prompt  # one answer for both uses
    with tempfile.TemporaryDirectory(prefix="chronicals-eval-") as tmp:
        loader, qa = heldout_loader(data, tokenizer, Path(tmp), option_names, system)
    return EvalData(loader, qa, system)


def check_read_ids(model, read: EvalData, data: DataSection) -> None:
    """ValueError naming ``data.path`` when the data ``read`` holds a token id the embedding of ``model`` has no row
    for (its config's vocab_size: ``model`` may be the decoder built on the meta device, before the weights load)."""
    ids = read.loader.dataset.ids
    if len(ids):
        check_ids_in_vocab(model, int(ids.max()), f"{data.path} holds token id")


def evaluate(model, tokenizer, data: DataSection, device: torch.device, *, qa_limit: int = 0,
             max_new_tokens: int = 24, option_names: dict[str, str] | None = None,
             system_prompt: str | None = None, read: EvalData | None = None) -> EvalResult:
    """Held-out loss of ``model`` over ``data.path`` and, for a question/answer file, the keyword accuracy of its
    greedy answers (the first ``qa_limit`` questions; 0 = all) of at most ``max_new_tokens`` tokens.
    ``option_names``: what the data's messages call its options (``heldout_loader``; chronicals eval: its flags).
    ``system_prompt``: the QA prompts' system message as given ('' = none); None: ``qa.heldout_system_prompt(data)``,
    which is data.system_prompt for the demo data or when it differs from the default, else none, as train asks.
    ``read``: the data as ``read_eval_data(tokenizer, data, option_names, system_prompt)`` gave it before the model
    loaded (chronicals eval); None: read here."""
    for name, value, least in (("qa_limit", qa_limit, 0), ("max_new_tokens", max_new_tokens, 1)):
        if not is_int(value) or value < least:  # -1 had dropped the last question
            raise ValueError(f"evaluate: {name}={value!r} must be a whole number >= {least}"
                             + (" (0 = every question)" if name == "qa_limit" else ""))
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context and data.max_seq_len > context:
        log.warning("max_seq_len=%d is longer than the model's max_position_embeddings=%d: positions past %d were "
                    "not trained, so the loss of longer examples says little", data.max_seq_len, context, context)
    if read is None:
        read = read_eval_data(tokenizer, data, option_names, system_prompt)
    loader, qa = read.loader, read.qa
    ds = loader.dataset
    check_read_ids(model, read, data)  # host ids: the embedding would raise a bare IndexError
    loss, n = evaluate_loss(model, loader, device)
    result = EvalResult(data=data.path, loss=loss, loss_tokens=n, examples=len(ds), stats=ds.stats)
    if qa is not None:
        result.qa = qa[:qa_limit] if qa_limit else qa
        result.system_prompt = read.system_prompt
        result.answers = answer_all(model, tokenizer, result.qa, result.system_prompt, max_new_tokens)
    return result


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` as JSON to ``path`` whole (``_jsonio.write_text_atomic``: a failed write leaves the old one)."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
