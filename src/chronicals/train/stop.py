"""Stopping a run cleanly: SIGINT / SIGTERM end the current step, which the loop checkpoints before it returns."""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("chronicals.train")


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the end of the current step and returns."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal() only works there
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and (signum == signal.SIGINT or _torchrun_second_ctrl_c(self.signum, signum)):
            raise KeyboardInterrupt  # a second Ctrl-C does not finish the step (a write in flight still completes)
        if self.signum is not None:  # a SIGTERM while already stopping: the first signal's stop goes on, said once
            log.warning("received %s while already stopping (%s): still finishing this step (Ctrl-C again: stop "
                        "without finishing it)", signal.Signals(signum).name, signal.Signals(self.signum).name)
            return
        self.signum = signum
        log.warning("received %s: finishing this step, writing a checkpoint, then exiting (Ctrl-C again: stop "
                    "without finishing this step)", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def _torchrun_second_ctrl_c(first: int, now: int) -> bool:
    """Under torchrun a second Ctrl-C reaches the ranks as SIGTERM: torchrun alone gets the terminal's signals (the
    ranks run in their own session), passes the first Ctrl-C on as SIGINT and the second as SIGTERM. Read as the
    second Ctrl-C it is, as the log line promises (a walk under torchrun: the step went on to the end)."""
    return first == signal.SIGINT and now == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ
