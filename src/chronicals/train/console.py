"""The console log: one format for the CLI and for ``train()`` called from a program that set up no logging."""

from __future__ import annotations

import contextlib
import logging

FORMAT, DATEFMT = "%(asctime)s %(name)s: %(message)s", "%H:%M:%S"


class LevelFormatter(logging.Formatter):
    """Info lines as they are; a warning or an error says so ("12:00:01 chronicals.train: warning: ..."): in a
    console of info lines nothing told them apart."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno < logging.WARNING:
            return super().format(record)
        record = logging.makeLogRecord(record.__dict__)  # other handlers see the record unchanged
        record.msg = f"{record.levelname.lower()}: {record.msg}"
        return super().format(record)


def console_handler() -> logging.Handler:
    """A stderr handler in the console format."""
    handler = logging.StreamHandler()
    handler.setFormatter(LevelFormatter(FORMAT, DATEFMT))
    return handler


@contextlib.contextmanager
def run_console():
    """Within: where nothing set up logging (no handler on the root or the ``chronicals`` logger), the chronicals log
    goes to stderr at INFO, as under the CLI; taken away on exit. A program that set up its own logging keeps it.

    Why: Python's default shows warnings only, so ``train()`` called from a script said nothing at all, neither
    progress nor the before/after summary: 7 min 53 s of silence for the README's demo config on a 2-core CPU
    (a user walk). The handler goes on the root logger, where the progress bar's tqdm redirect looks for it."""
    root, ours = logging.getLogger(), logging.getLogger("chronicals")
    if root.handlers or ours.handlers:
        yield
        return
    handler, level = console_handler(), ours.level
    root.addHandler(handler)
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        ours.setLevel(level)
