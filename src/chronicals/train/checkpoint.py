"""Resumable training checkpoints: trainable weights, optimizer, scheduler, data position, RNG states.

Layout: ``<out_dir>/checkpoints/step-000120/state.pt``. Each is written to a ``.tmp-*`` directory
first and renamed into place, so a crash mid-write never leaves a half checkpoint that ``resume=auto``
would pick up; a ``.tmp-*`` directory whose writer was killed mid-write (its lock is free) is removed by the
next write into ``checkpoints/``. Only trainable parameters are stored, with their optimizer state: under
LoRA the adapters, so SmolLM2-135M at r=16 (4.88M fp32 adapter parameters, 19.5 MB, plus AdamW's two moments)
writes a 59.0 MB state.pt (59,047,960 bytes measured, fp32 on CPU) instead of the 540 MB of its fp32 weights
alone. The last ``keep_last`` checkpoints are kept. ``CheckpointWriter`` (the trainer's, ``train.async_save``)
takes the CPU snapshot in the training thread and writes the file in a background thread.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import re
import shutil
import threading
from pathlib import Path

import torch

from ..models.orphans import remove_orphans, writer_lock

log = logging.getLogger("chronicals.train")
_NAME = re.compile(r"^step-(\d+)$")
_TMP_NAME = re.compile(r"\.tmp-step-\d+-\d+")  # write_checkpoint's temporaries: .tmp-step-000120-{pid}
STATE_FILE = "state.pt"  # the one file of a checkpoint directory


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the trainable parameters: one device-to-host copy each, no second copy of the
    weights on the GPU (a full fine-tune's clone would add 1 GB at 0.5B in bf16); a copy, not the tensor,
    since torch.save writes a view's whole storage (LoRA binds W as a view of its [W | s B] buffer)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``out_dir/checkpoints``, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def not_this_runs(out_dir: str | Path, resume_from: str | Path | None, start: int) -> list[Path]:
    """The checkpoints under ``out_dir`` that are not in the history of a run starting now: every one for a fresh
    run (``resume_from`` None) or a resume from another directory; those past ``start`` for a resume from one of
    out_dir's own (the run it branches from went further). Pruning by step (``keep_last``) and resume=auto's
    latest-by-step would otherwise mix them with this run's."""
    dirs = checkpoint_dirs(out_dir)
    if resume_from is None:
        return dirs
    src = Path(resume_from)
    src = src if src.is_dir() else src.parent
    root = Path(out_dir) / "checkpoints"
    if root.is_dir() and src.parent.resolve() == root.resolve():
        return [d for d in dirs if int(_NAME.match(d.name).group(1)) > start]
    return dirs


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_cpu(obj):
    """``obj`` with every tensor replaced by a CPU copy (nested dicts, lists, tuples): a snapshot later steps
    cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def snapshot(step: int, model: torch.nn.Module, optimizer, scheduler, data_state: dict,
             extra: dict | None = None) -> dict:
    """Everything a checkpoint holds, as CPU copies taken now (the next optimizer step cannot change them)."""
    # deep copies of the host-side parts too: a loader may reshuffle an array its state_dict returned
    return {"step": step, "model": trainable_state(model), "optimizer": _to_cpu(optimizer.state_dict()),
            "scheduler": copy.deepcopy(scheduler.state_dict()), "data": copy.deepcopy(data_state),
            "rng": rng_state(), "extra": copy.deepcopy(extra or {})}


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is published: ``out_dir/checkpoints/step-{step:06d}``."""
    return Path(out_dir) / "checkpoints" / f"step-{step:06d}"


def write_checkpoint(out_dir: str | Path, state: dict, keep_last: int = 2) -> Path:
    """Write a ``snapshot`` to ``checkpoint_path(out_dir, state["step"])`` atomically (a ``.tmp-*`` directory,
    fsynced, then renamed); delete all but the newest ``keep_last``.

    First removes the ``.tmp-step-*`` directories of writes that were killed (SIGKILL, OOM): each leaves a partial
    checkpoint, as large as a whole one, that ``checkpoint_dirs`` never lists. A live writer's, this process's
    background ``CheckpointWriter`` thread's included, holds its lock and is never touched (``models.orphans``)."""
    final = checkpoint_path(out_dir, state["step"])
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_orphans(root, _TMP_NAME, log)  # before this write needs the disk space
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    with writer_lock(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            torch.save(state, tmp / STATE_FILE)
            _fsync(tmp / STATE_FILE)  # durable before the rename publishes it: no truncated state.pt after a power loss
        except BaseException:  # e.g. a full disk: leave nothing half-written behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)  # the rename itself
    for old in checkpoint_dirs(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointWriter:
    """Checkpoints written by a background thread: training waits only for the CPU snapshot.

        writer = CheckpointWriter(background=True)
        path = writer.save(out_dir, step, model, optimizer, scheduler, data_state, keep_last=2)  # snapshot, returns
        ...                                      # training goes on while the file is written and renamed into place
        writer.wait()                            # published (or the write's error raised) before anyone reads it

    One write at a time: ``save`` first waits for the previous one. A write that fails leaves no checkpoint
    (the rename is its last act) and its error is raised by the next ``save`` or ``wait``. With
    ``background=False`` ``save`` writes before it returns.
    """

    def __init__(self, background: bool):
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, out_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler, data_state: dict,
             keep_last: int = 2, extra: dict | None = None) -> Path:
        self.wait()
        state = snapshot(step, model, optimizer, scheduler, data_state, extra)
        if not self.background:
            return write_checkpoint(out_dir, state, keep_last)

        def run():
            try:
                write_checkpoint(out_dir, state, keep_last)
            except BaseException as e:  # raised in the training thread by the next save() / wait()
                self._error = e
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=False)
        self._thread.start()
        return checkpoint_path(out_dir, step)

    def wait(self) -> None:
        """Block until the last write is published; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def config_diffs(saved: dict | None, current: dict | None, sections: dict) -> list[str]:
    """``["lora.rank=4 (this run: 8)", ...]``: the keys of ``sections`` ({section: key names, or None for every
    saved key}) whose value in the checkpoint's config ``saved`` differs from ``current``'s (``TrainConfig.to_dict()``
    both); [] when either is missing (checkpoints from before the config was stored)."""
    if not saved or not current:
        return []
    diffs = []
    for sec, keys in sections.items():
        old, now = saved.get(sec, {}), current.get(sec, {})
        for k in (old if keys is None else keys):
            if k in old and old[k] != now.get(k):
                diffs.append(f"{sec}.{k}={old[k]!r} (this run: {now.get(k)!r})")
    return diffs


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer, scheduler, config: dict | None = None) -> dict:
    """Restore weights, optimizer, scheduler and RNG in place; return {step, data, extra}.

    ``config``: this run's config as a dict (``TrainConfig.to_dict()``); a checkpoint that does not fit the
    model is then reported with the model/lora keys that differ from the ones it was written with."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {file} not found (train.resume takes auto | none | a step-N directory)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
        if not (isinstance(state, dict) and {"model", "optimizer", "scheduler", "step"} <= state.keys()):
            raise ValueError("not a chronicals checkpoint (no model / optimizer / scheduler / step entries)")
    except Exception as e:  # noqa: BLE001 (zip, pickle, EOF, OS errors alike) saves are atomic: damaged after writing
        ckdir = file.parent  # out_dir/checkpoints/step-N
        earlier = [d for d in checkpoint_dirs(ckdir.parent.parent) if d != ckdir]
        hint = (f"move {ckdir} away, and train.resume=auto resumes from {earlier[-1]}" if earlier else
                f"move {ckdir} away, or set train.resume=none to start over")
        raise ValueError(f"checkpoint {file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                         f"it is truncated or corrupt: {hint}") from None
    params = dict(model.named_parameters())
    extra = [n for n in state["model"] if n not in params]
    absent = [n for n, p in params.items() if p.requires_grad and n not in state["model"]]
    shapes = [f"{n} {tuple(t.shape)} vs the model's {tuple(params[n].shape)}" for n, t in state["model"].items()
              if n in params and t.shape != params[n].shape]
    if extra or absent or shapes:
        what = (f"holds parameters the model lacks ({extra[:3]}{'...' if len(extra) > 3 else ''})" if extra else
                f"lacks trainable parameters of the model ({absent[:3]}{'...' if len(absent) > 3 else ''})" if absent
                else f"has other shapes ({shapes[0]}{'...' if len(shapes) > 1 else ''})")
        diffs = config_diffs(state.get("extra", {}).get("config"), config, {"model": None, "lora": None})
        raise ValueError(f"checkpoint {path} {what}: it was written for another model or lora config"
                         f"{': ' + ', '.join(diffs) if diffs else ''}; resume with that config, "
                         "or start over (another train.out_dir, or train.resume=none)")
    with torch.no_grad():
        for n, t in state["model"].items():
            params[n].copy_(t)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return {"step": state["step"], "data": state["data"], "extra": state["extra"]}
