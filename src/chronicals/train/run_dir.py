"""A run's out_dir across ranks: the lock rank 0 holds there, the metrics log the run starts with (a resume
from another run's checkpoint carries that run's records over), the config.yaml written there, and the files of an
earlier history the run removes once it writes."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from .._words import counted
from ..config import ConfigError, TrainConfig, from_dict
from . import checkpoint as ckpt
from .distributed import DistContext
from .guards import earlier_finals, final_dir, out_dir_lock
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


@dataclass
class EarlierFiles:
    """What out_dir holds of a history this run does not continue, removed (``forget``, each said) once the run
    writes its first record or checkpoint: another run's checkpoints (resume=none over a finished run, a resume
    from another directory) or this run's own later ones (a ``rewind``: a resume from an earlier step of out_dir),
    the final adapter/model they led to (guards.earlier_finals), and the loss curve of a history this run does not
    continue at all."""

    cfg: TrainConfig
    resume_from: Path | None
    start: int
    checkpoints: list[Path]
    finals: list[Path]
    rewind: bool
    plot: Path | None

    @classmethod
    def find(cls, cfg: TrainConfig, out_dir: Path, resume_from: Path | None, start: int, main: bool):
        """Those of ``out_dir`` for a run starting at step ``start`` from ``resume_from``; none off rank 0
        (``main``), which alone writes there."""
        own = resume_from is not None and ckpt.is_own(resume_from, out_dir)
        stale = ckpt.not_this_runs(out_dir, resume_from, start) if main else []
        rewind = own and bool(stale)
        finals = earlier_finals(cfg, out_dir, resume_from, rewind) if main else []
        return cls(cfg, resume_from, start, stale, finals, rewind, out_dir / "loss.png" if main and not own else None)

    def forget(self) -> None:
        """Remove them, a warning each (once: later calls find nothing left)."""
        cfg, start = self.cfg, self.start
        why = (f"train.resume={cfg.train.resume} starts this out_dir over" if self.resume_from is None else
               f"a rewind: training continues from {self.resume_from}, at step {start}" if self.rewind else
               f"this run continues from {self.resume_from}")
        if self.checkpoints:
            for d in self.checkpoints:
                ckpt.remove_checkpoint(d)
            names, where = ", ".join(d.name for d in self.checkpoints), self.checkpoints[0].parent
            if self.rewind:  # this run's own, not another run's (a walk read that of a rewind's later steps)
                log.warning("removed %s of this run from %s: %s (%s)", counted(len(self.checkpoints),
                                                                              "later checkpoint"), where, names, why)
            else:
                log.warning("removed %d checkpoint(s) of another run from %s: %s (%s)", len(self.checkpoints), where,
                            names, why if self.resume_from is None else f"{why}, not from them")
            self.checkpoints = []
        for final in self.finals:  # chat --adapter out_dir/adapter would pair it with this run's config.yaml
            shutil.rmtree(final, ignore_errors=True)
            mine = final == final_dir(cfg, final.parent)
            whose = (f"the final {final.name} of this run's steps after {start}, which the rewind discards"
                     if self.rewind and mine else f"another run's final {final.name}")
            log.warning("removed %s, %s (%s%s)", final, whose, why,
                        "; train.save_final=false: this run writes none" if mine and not cfg.train.save_final else
                        "" if mine else f"; this run writes {'an adapter' if cfg.lora.enabled else 'a model'}")
        self.finals = []
        plot = self.plot  # the earlier history's curve: this run draws its own at the end
        if plot is not None and plot.is_file() and not plot.is_symlink():
            plot.unlink(missing_ok=True)
            log.info("removed %s, the loss curve of the run before (%s)", plot, why)
        self.plot = None


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


def _found_anywhere(value: str) -> str:
    """A relative path that exists, made absolute (from the working directory, symlinks kept); anything else as
    written (an absolute path, a short model name, a path that does not exist here)."""
    path = Path(value).expanduser()
    return str(path.absolute()) if value and not path.is_absolute() and path.exists() else value


def recorded(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as the run records it (config.yaml, the checkpoints' config): model.path, data.path and data.eval_path
    that name existing relative paths made absolute, so they name what this run read from any working directory
    (``chronicals train runs/x/config.yaml`` from elsewhere read another data.path, or none). The demo's and short
    model names stay as they are (they win over a folder of that name)."""
    from ..config import DEMO
    from ..models.loading import SHORT_NAMES

    model, data = cfg.model, cfg.data
    path = model.path if model.path.lower() in SHORT_NAMES else _found_anywhere(model.path)
    train_path = data.path if data.path == DEMO else _found_anywhere(data.path)
    eval_path = data.eval_path if data.eval_path in (DEMO, "auto") else _found_anywhere(data.eval_path)
    if (path, train_path, eval_path) == (model.path, data.path, data.eval_path):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(model, path=path),
                               data=dataclasses.replace(data, path=train_path, eval_path=eval_path))


def config_yaml(cfg: TrainConfig) -> str:
    """config.yaml's text: the run's settings (``recorded``: its relative paths made absolute) with
    train.resume=auto, so that ``chronicals train out_dir/config.yaml`` continues this run from any directory (the
    file's own directory is the run's: config.run_dir_of). Stored as given, a resume from another run's checkpoint
    went back to that checkpoint and removed this run's later checkpoints and final adapter as "another run's"
    (resume=none: started over). The setting the run started with is kept in a comment."""
    stored = recorded(cfg)
    if cfg.train.resume == "auto":
        return stored.to_yaml()
    stored = from_dict(stored.to_dict(), ["train.resume=auto"])
    return (f"# train.resume is auto here, so that this file continues this run; it started with "
            f"train.resume={cfg.train.resume!r}\n" + stored.to_yaml())
