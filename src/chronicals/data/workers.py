"""Records -> encoded examples, in chunks of CHUNK records, serially or in forked worker processes.

``_encoded`` yields each chunk with its ``_encode_chunk`` results in order, reading the files as it goes (at most
2 x num_proc chunks in flight); dataset.py folds them into a ``TokenizedDataset``. A worker holds the tokenizer and
the options in ``_WORKER``, dies with its parent and leaves Ctrl-C to it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from .formats import FormatError, detect_format, empty_target, to_example
from .readers import Record, iter_records
from .tokenize import encode, unclosed_last_reply, unclosed_replies

CHUNK = 1_000

_WORKER: dict = {}


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when its parent (pid ``parent``) dies (prctl PR_SET_PDEATHSIG); elsewhere
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call: nobody would send the signal
        os._exit(1)


def _init_worker(tokenizer, opts, parent: int):
    """Worker processes only: each runs one tokenizer thread (8 workers x N Rust threads oversubscribe).

    Forked from a process whose SIGINT/SIGTERM may raise KeyboardInterrupt (the CLI's handler): a worker caught
    the pool's SIGTERM that stops the survivors of a killed worker and blocked again, so the run hung for ever (a
    concurrency walk). SIGTERM kills a worker, Ctrl-C is the parent's to handle, and a worker dies with its parent
    (a SIGKILLed run left them running)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizer, **opts)


def _encode_chunk(records: list[Record]):
    """Records -> list of (ids, trainable, format, empty target, (runs, unclosed, across)) or (None, "file:line:
    message", None, False, (0, 0, False)); empty target: the text that would carry loss with loss on assistant turns
    / completion is blank (whatever loss_on); runs, unclosed: a chat example's replies and those that train no
    end-of-turn token (``tokenize.unclosed_replies``; loss_on="all": ``tokenize.unclosed_last_reply``; (0, 0) for
    other examples); across: a prompt/completion example's boundary falls inside a token (``tokenize.encode``)."""
    w = _WORKER
    out = []
    for rec in records:
        if rec.data is None:
            out.append((None, f"{rec.where}: {rec.error}", None, False, (0, 0, False)))
            continue
        try:
            fmt = w["format"] if w["format"] != "auto" else detect_format(rec.data, rec.from_csv)
            ex = to_example(rec.data, fmt, w["has_template"], from_csv=rec.from_csv)
            across: list[bool] = []
            ids, mask = encode(w["tokenizer"], ex, w["loss_on"], w["markers"], w["own_eos"], across=across)
            if ex.messages is None:
                ends = (0, 0)
            elif w["loss_on"] == "assistant":
                ends = unclosed_replies(w["tokenizer"], ids, mask, w["end_ids"])
            else:
                ends = unclosed_last_reply(w["tokenizer"], ex.messages, ids, w["end_ids"])
            out.append((ids, mask, fmt, empty_target(ex), (*ends, any(across))))
        except FormatError as e:
            out.append((None, f"{rec.where}: {e}", None, False, (0, 0, False)))
    return out


def _chunks(files):
    """(file index, up to CHUNK records) over ``files`` in order, made as they are taken (a chunk never spans two
    files): the records are never all in memory at once."""
    for i, f in enumerate(files):
        chunk = []
        for rec in iter_records(f):
            chunk.append(rec)
            if len(chunk) == CHUNK:
                yield i, chunk
                chunk = []
        if chunk:
            yield i, chunk


def _encoded(files, num_proc: int, tokenizer, opts):
    """((file index, chunk), its _encode_chunk results) in order; in ``num_proc`` worker processes with at most
    2 x num_proc chunks in flight (Executor.map would read and submit every record at once)."""
    chunks = _chunks(files)
    if num_proc <= 1:
        _WORKER.update(tokenizer=tokenizer, **opts)  # not _init_worker: keep this process's tokenizer threads
        for item in chunks:
            yield item, _encode_chunk(item[1])
        return
    with ProcessPoolExecutor(num_proc, mp_context=get_context("fork"), initializer=_init_worker,
                             initargs=(tokenizer, opts, os.getpid())) as pool:
        pending = deque()
        try:
            for item in chunks:
                pending.append((item, pool.submit(_encode_chunk, item[1])))
                if len(pending) >= 2 * num_proc:
                    done, fut = pending.popleft()
                    yield done, fut.result()
            while pending:
                done, fut = pending.popleft()
                yield done, fut.result()
        finally:
            for _, fut in pending:  # stopped early (a bad record under on_error=fail, Ctrl-C)
                fut.cancel()
