"""A run's out_dir across ranks: the lock rank 0 holds there, the metrics log the run starts with (a resume
from another run's checkpoint carries that run's records over), and the config.yaml written there."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from .._words import counted
from ..config import ConfigError, TrainConfig, from_dict
from . import checkpoint as ckpt
from .distributed import DistContext
from .guards import out_dir_lock
from .metrics import MetricsLog

log = logging.getLogger("chronicals.train")


@contextlib.contextmanager
def _locked_out_dir(out_dir: Path, dp: DistContext):
    """out_dir_lock, held by rank 0 alone (it alone writes there); a refusal there is raised on every rank
    (a flag all-reduced), so no rank waits at a barrier for a rank 0 that has gone."""
    with contextlib.ExitStack() as stack:
        refused = None
        try:
            stack.enter_context(out_dir_lock(out_dir, hold=dp.is_main))
        except ConfigError as e:
            refused = e
        if dp.enabled and bool(dp.all_reduce_flag(refused is not None)) and refused is None:
            refused = ConfigError(f"train.out_dir={out_dir} is in use by another chronicals run (rank 0 could not "
                                  "lock it); wait for it to finish, or set another train.out_dir", "train.out_dir")
        if refused is not None:
            raise refused
        yield


class _RanksMetrics:
    """The MetricsLog stand-in of ranks other than 0: records kept in memory, no file written."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, rec: dict) -> None:
        self.records.append(rec)

    def close(self) -> None:
        pass


def _metrics_log(cfg: TrainConfig, out_dir: Path, resume_from: Path | None, start: int, on_open) -> MetricsLog:
    """The run's MetricsLog: a resume from one of out_dir's own checkpoints keeps out_dir's records up to its step;
    one from another run's checkpoint (runs/a/checkpoints/step-N into runs/b) takes that run's records up to
    step N instead (out_dir's own records are another history: kept, they mixed two runs' steps 1..N and gave
    the summary the wrong held-out loss "before"), or none, said, when that run's metrics.jsonl cannot be read."""
    tb = cfg.logging.tensorboard
    if resume_from is None:
        return MetricsLog(out_dir, tb, None, on_open=on_open)
    if ckpt.is_own(resume_from, out_dir):
        if start > 0 and not (out_dir / "metrics.jsonl").exists():  # said as for another run's checkpoint (a walk)
            log.warning("%s has no metrics.jsonl: it starts at step %d (the records of steps 1..%d, the held-out "
                        "'before' included, are gone)", out_dir, start + 1, start)
        return MetricsLog(out_dir, tb, start, on_open=on_open)
    ckdir = resume_from if resume_from.is_dir() else resume_from.parent
    metrics = MetricsLog(out_dir, tb, None, on_open=on_open)  # out_dir's metrics.jsonl is replaced at the first record
    source = ckdir.parent.parent / "metrics.jsonl" if ckdir.parent.name == "checkpoints" else None
    why = None
    if source is None or not source.is_file():
        why = "no metrics.jsonl beside it" if source is None else f"{source} does not exist"
    else:
        try:
            metrics.records = MetricsLog(source.parent, False, start).records
        except (OSError, ValueError) as e:
            why = f"{source} could not be read ({e})"
    if why:
        log.warning("%s is not one of %s's checkpoints and %s: %s starts at step %d", resume_from, out_dir, why,
                    metrics.path, start + 1)
    else:
        log.info("%s is another run's checkpoint: %s starts with that run's %s up to step %d (from %s)",
                 resume_from, metrics.path, counted(len(metrics.records), "record"), start, source)
    return metrics


def config_yaml(cfg: TrainConfig) -> str:
    """config.yaml's text: the run's settings with train.resume=auto, so that ``chronicals train out_dir/config.yaml``
    continues this run. Stored as given, a resume from another run's checkpoint went back to that checkpoint and
    removed this run's later checkpoints and final adapter as "another run's" (resume=none: started over). The
    setting the run started with is kept in a comment."""
    if cfg.train.resume == "auto":
        return cfg.to_yaml()
    stored = from_dict(cfg.to_dict(), ["train.resume=auto"])
    return (f"# train.resume is auto here, so that this file continues this run; it started with "
            f"train.resume={cfg.train.resume!r}\n" + stored.to_yaml())
