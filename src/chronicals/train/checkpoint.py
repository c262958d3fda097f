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

from .._numbers import is_int
from .._words import size_text
from ..models.orphans import remove_orphans, writer_lock

log = logging.getLogger("chronicals.train")
_NAME = re.compile(r"^step-(\d+)$")
_TMP_NAME = re.compile(r"\.tmp-step-\d+-\d+")  # write_checkpoint's temporaries: .tmp-step-000120-{pid}
STATE_FILE = "state.pt"  # the one file of a checkpoint directory
# the layout of state.pt this version writes and reads: a later version that changes it raises the number, so this
# one refuses its checkpoints by name instead of reading renamed entries as another model's ("format" absent: 1)
FORMAT = 1


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


def _step_dirs(out_dir: str | Path) -> list[Path]:
    """Every ``step-N`` directory under ``out_dir/checkpoints``, oldest first, with its state.pt or not.

    NotADirectoryError when ``checkpoints`` is a file: asked while a run sets up (resume=auto, another run's
    checkpoints), so the run stops there rather than when its first checkpoint cannot be written."""
    root = Path(out_dir) / "checkpoints"
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"{root} is a file, not a directory: a run writes its checkpoints there; move it "
                                 "away or set another train.out_dir")
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``out_dir/checkpoints``, oldest first."""
    return [p for p in _step_dirs(out_dir) if (p / STATE_FILE).is_file()]


def is_own(checkpoint: str | Path, out_dir: str | Path) -> bool:
    """Whether ``checkpoint`` (a ``step-N`` directory or its state.pt) is one of ``out_dir``'s own checkpoints
    (``out_dir/checkpoints/step-N``), not another run's."""
    ckdir = Path(checkpoint)
    ckdir = ckdir if ckdir.is_dir() else ckdir.parent
    return ckdir.parent.resolve() == (Path(out_dir) / "checkpoints").resolve()


def not_this_runs(out_dir: str | Path, resume_from: str | Path | None, start: int) -> list[Path]:
    """The checkpoints under ``out_dir`` that are not in the history of a run starting now: every one for a fresh
    run (``resume_from`` None) or a resume from another directory; those past ``start`` for a resume from one of
    out_dir's own (the run it branches from went further). Pruning by step (``keep_last``) and resume=auto's
    latest-by-step would otherwise mix them with this run's."""
    dirs = _step_dirs(out_dir)  # with any that lost their state.pt: they are no part of this run either
    if resume_from is None:
        return dirs
    if is_own(resume_from, out_dir):
        return [d for d in dirs if int(_NAME.match(d.name).group(1)) > start]
    return dirs


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest ``step-N`` directory, also when it lacks its state.pt (never the case for one written here: the
    rename publishes it whole): resume=auto then says so (``load_checkpoint``) instead of silently resuming from an
    older one, or starting over and rewriting the run's metrics.jsonl when it was the only one."""
    dirs = _step_dirs(out_dir)
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
    return {"format": FORMAT, "step": step, "model": trainable_state(model),
            "optimizer": _to_cpu(optimizer.state_dict()), "optimizer_params": optimizer_param_names(model, optimizer),
            "scheduler": copy.deepcopy(scheduler.state_dict()),
            "data": copy.deepcopy(data_state), "rng": rng_state(), "extra": copy.deepcopy(extra or {})}


def optimizer_param_names(model: torch.nn.Module, optimizer) -> list[str | None]:
    """The model's name of each parameter in the optimizer's order (its state_dict numbers them 0, 1, ... across
    param_groups), None for one the model does not hold: lets a reader of the checkpoint find a weight's fp32
    master (``checkpoint_adapter``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p)) for g in getattr(optimizer, "param_groups", []) for p in g["params"]]


def masters_by_name(state: dict) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 master} from a checkpoint's optimizer state (``optim.master_weights``); {} for a run
    without masters. A checkpoint older than its ``optimizer_params`` list (before 49b06ef) names no master: each
    is matched to the one weight of ``state["model"]`` of its shape that it rounds to (ambiguous ones are left out,
    and that weight stays as stored)."""
    names, opt = state.get("optimizer_params"), state.get("optimizer") or {}
    if not isinstance(opt.get("param_groups"), list):
        return {}
    ids = [i for g in opt["param_groups"] for i in g.get("params", [])]
    masters = [(opt.get("state") or {}).get(i, {}).get("master") for i in ids]
    if isinstance(names, list):
        return {n: m for n, m in zip(names, masters) if n is not None and isinstance(m, torch.Tensor)}
    return _masters_by_value(state.get("model") or {}, [m for m in masters if isinstance(m, torch.Tensor)])


def _masters_by_value(weights: dict[str, torch.Tensor], masters: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each master paired with the weight it is the fp32 copy of (same shape, rounds to its stored values), where
    exactly one weight fits and no other master claims it."""
    fits: dict[str, list[torch.Tensor]] = {}
    for m in masters:
        hits = [n for n, w in weights.items()
                if w.shape == m.shape and w.is_floating_point() and torch.equal(m.to(w.dtype), w)]
        if len(hits) == 1:
            fits.setdefault(hits[0], []).append(m)
    return {n: ms[0] for n, ms in fits.items() if len(ms) == 1}


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is published: ``out_dir/checkpoints/step-{step:06d}``."""
    return Path(out_dir) / "checkpoints" / f"step-{step:06d}"


def _check_keep_last(keep_last: int) -> None:
    # keep_last=0 read as "[-0:]", i.e. every checkpoint kept: the opposite of what it says (a session-41 walk)
    if not is_int(keep_last) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: checkpoints to keep must be an integer >= 1 (the one just "
                         "written is always kept); pass keep_last=1 to keep only the newest")


def write_checkpoint(out_dir: str | Path, state: dict, keep_last: int = 2) -> Path:
    """Write a ``snapshot`` to ``checkpoint_path(out_dir, state["step"])`` atomically (a ``.tmp-*`` directory,
    fsynced, then renamed); delete all but the newest ``keep_last``.

    First removes the ``.tmp-step-*`` directories of writes that were killed (SIGKILL, OOM): each leaves a partial
    checkpoint, as large as a whole one, that ``checkpoint_dirs`` never lists. A live writer's, this process's
    background ``CheckpointWriter`` thread's included, holds its lock and is never touched (``models.orphans``)."""
    _check_keep_last(keep_last)
    final = checkpoint_path(out_dir, state["step"])
    # before the write too: checkpoints past keep_last (written under a higher one) free their room before this one
    # needs it. Pruned only after it, a full disk's advice "lower train.keep_last and resume" failed again at the
    # same step: the resumed run held keep_last=2's two 39 MB checkpoints while writing the third (a 100 MB tmpfs walk)
    _prune(out_dir, keep_last)
    # read before the write: after a failed one the disk still reads full ("0 B free" in the walk), torch's writer
    # holding its deleted file open from the traceback's frames
    free = _free_bytes(final.parent.parent)
    try:
        _publish(state, final)
    except (RuntimeError, OSError) as e:
        # torch.save's writer reports a full disk or a file-size limit as a RuntimeError ("unexpected pos"); fsync,
        # where a full disk or quota shows on NFS or ext4's delayed allocation, as a bare OSError naming no file; a
        # folder that is not writable fails at the lock file, as bare (walks)
        raise OSError(f"could not write checkpoint {final} ({e}); is the disk of train.out_dir={out_dir} full, or "
                      f"is the folder not writable? free space (or lower train.keep_last: a write needs room for one "
                      f"checkpoint beside the {keep_last} kept) or fix its permissions, and resume with "
                      f"train.resume=auto{_room(free, state)}") from e
    _prune(out_dir, keep_last)
    return final


def _prune(out_dir: str | Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` whole checkpoints, and every step-N that lost its state.pt (a kill
    mid-removal) wherever it is."""
    dirs = _step_dirs(out_dir)  # by step
    whole = [(p / STATE_FILE).is_file() for p in dirs]
    first = ([i for i, w in enumerate(whole) if w][-keep_last:] or [len(dirs)])[0]  # the oldest kept
    for i, (old, w) in enumerate(zip(dirs, whole)):
        if not w or i < first:
            remove_checkpoint(old)


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists, tuples): about the size of its state.pt."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the disk of ``path`` (its nearest existing folder), or None where it cannot be asked."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _room(free: int | None, state: dict) -> str:
    """' (the checkpoint takes ~38.6 MB; its disk had 22 MB free when the write began)': torch's own words for a full
    disk ('unexpected pos 25479040 vs 25478992') do not say it is full. Empty where the disk could not be asked."""
    if free is None:
        return ""
    return (f" (the checkpoint takes ~{size_text(_tensor_bytes(state))}; its disk had {size_text(free)} free when the "
            "write began)")


def remove_checkpoint(ckdir: Path) -> None:
    """Remove checkpoint directory ``ckdir``, renamed first to a write's temporary name (``.tmp-step-N-{pid}``):
    a kill during the removal leaves a directory the next write sweeps (``remove_orphans``), not a step-N without
    its state.pt that pruning never lists and that, as the newest, stops resume=auto (a SIGKILL walk left two)."""
    trash = ckdir.with_name(f".tmp-{ckdir.name}-{os.getpid()}")
    with writer_lock(trash):  # its lock file marks it as ours to sweep after a kill
        try:
            os.replace(ckdir, trash)
        except OSError:  # e.g. a leftover of that name: remove in place
            trash = ckdir
        shutil.rmtree(trash, ignore_errors=True)


def _publish(state: dict, final: Path) -> None:
    """``state`` written to ``final`` through a fsynced temporary directory and a rename; nothing half-written is
    left behind when a step fails."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_orphans(root, _TMP_NAME, log)  # before this write needs the disk space
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    with writer_lock(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            torch.save(state, tmp / STATE_FILE)
            _fsync(tmp / STATE_FILE)  # durable before the rename publishes it: no truncated state.pt after a power loss
        except BaseException:  # e.g. a full disk: leave nothing half-written behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)  # the rename itself


class CheckpointWriter:
    """Checkpoints written by a background thread: training waits only for the CPU snapshot.

        writer = CheckpointWriter(background=True)
        path = writer.save(out_dir, step, model, optimizer, scheduler, data_state, keep_last=2)  # snapshot, returns
        ...                                      # training goes on while the file is written and renamed into place
        writer.wait()                            # published (or the write's error raised) before anyone reads it

    One write at a time: ``save`` first waits for the previous one. A write that fails leaves no checkpoint
    (the rename is its last act) and its error is raised by the next ``save``, ``wait`` or ``raise_failed`` (the
    trainer's, once a step). With ``background=False`` ``save`` writes before it returns.
    """

    def __init__(self, background: bool):
        self.background = background
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # set by the write's thread as it ends (see wait)
        self._error: BaseException | None = None

    def save(self, out_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler, data_state: dict,
             keep_last: int = 2, extra: dict | None = None) -> Path:
        self.wait()
        _check_keep_last(keep_last)  # here, not in the background thread, so the caller's save raises it
        state = snapshot(step, model, optimizer, scheduler, data_state, extra)
        if not self.background:
            return write_checkpoint(out_dir, state, keep_last)

        def run():
            try:
                write_checkpoint(out_dir, state, keep_last)
            except BaseException as e:  # raised in the training thread by the next save() / wait()
                self._error = e
            finally:
                self._done.set()
        self._done.clear()
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=False)
        self._thread.start()
        return checkpoint_path(out_dir, step)

    @property
    def busy(self) -> bool:
        """Whether a write is still in flight."""
        return self._thread is not None and not self._done.is_set()

    def raise_failed(self) -> None:
        """Raise the last write's error if it has ended in one; never blocks. The trainer asks once a step, so a
        failed write stops the run at the next step, not at the next save (train.save_every steps later: the
        steps between were trained for nothing, their checkpoint never came)."""
        if self._thread is not None and self._done.is_set():
            self.wait()

    def wait(self) -> None:
        """Block until the last write is published; raise its error if it failed.

        A Ctrl-C while waiting raises KeyboardInterrupt here and the write goes on, still tracked: the next ``wait``
        waits for it. It waits on an Event, not in ``Thread.join``: Python 3.11's join, interrupted while the thread
        runs, marks the thread finished (bpo-45274's handling), so the next join returned at once and the process
        exited under the writing thread ("terminate called without an active exception", exit 134, the checkpoint
        left as a temporary directory)."""
        if self._thread is not None:
            self._done.wait()  # a Ctrl-C interrupts it (POSIX lock waits are interruptible) and changes nothing
            self._thread.join()  # its last bytecodes after the Event: returns at once
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


def _move_away_hint(ckdir: Path, auto: bool = True) -> str:
    """What to do with a checkpoint directory that cannot be resumed: move it away, and where resume=auto then goes;
    ``auto=False`` (train.resume named it): resume from the checkpoint before it instead."""
    named = _NAME.match(ckdir.name)
    earlier = [d for d in checkpoint_dirs(ckdir.parent.parent) if d != ckdir] if named else []
    if not auto:  # the newest one before it, not the newest other (step-3 was offered for a damaged step-2)
        earlier = [d for d in earlier if int(_NAME.match(d.name)[1]) < int(named[1])]
        return (f"resume from the checkpoint before it (train.resume={earlier[-1]}), or set train.resume=none to "
                "start over" if earlier else "give train.resume another checkpoint, or set train.resume=none to "
                "start over")
    return (f"move {ckdir} away, and train.resume=auto resumes from {earlier[-1]}" if earlier else
            f"move {ckdir} away, or set train.resume=none to start over")


def _unsafe_globals(file: Path) -> list[str]:
    """The classes and functions a state.pt's pickle names beyond what weights_only loading allows ([] when it
    names none, or cannot be read at all)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # noqa: BLE001 (a damaged file: the caller reports it as such)
        return []


def _first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's first line for a message, cut at a word boundary past ``limit`` characters (torch's pickle
    errors run to a page)."""
    first = str(e).partition("\n")[0]
    if len(first) <= limit:
        return first or "no message"  # an EOFError has none
    cut = first[:limit].rpartition(" ")[0] or first[:limit]  # no space at all: cut inside the word
    return cut.rstrip(",;:") + " ..."


def _damage(file: Path, e: BaseException) -> str:
    """Why a state.pt that torch.load refused is damaged: an empty file or one that is not a zip archive said as
    such (torch's own reason for those, 'mmap can only be used with files saved with
    _use_new_zipfile_serialization=True, please torch.save ...', advises a re-save that cannot happen)."""
    try:
        with open(file, "rb") as f:
            head = f.read(4)
    except OSError:
        head = None
    if head == b"":
        return "is empty (0 bytes)"
    if head is not None and not head.startswith(b"PK"):
        return "is not the zip archive torch.save writes"
    return f"cannot be read ({type(e).__name__}: {_first_line(e)})"


def _read_state(file: Path, mmap: bool = False, fix: str | None = None, resuming: bool = True) -> dict:
    """state.pt's dict, with the entries load_checkpoint uses; ValueError naming the file and what to do (``fix``;
    default: for a resume, move it away and where train.resume=auto then goes). ``resuming``: False for a reader
    (export, chat), told to read a newer format with the version that wrote it rather than to resume it.

    Loaded with weights_only=True: tensors and plain Python values only, so a crafted state.pt (a shared run
    directory, a downloaded checkpoint) runs no code when resumed. The ones written here hold nothing else,
    unless a caller's own data loader puts other objects in its state_dict: those are named, with the way to
    allow them. ``mmap``: tensors stay in the file, paged in when read (for a read-only use of a few of them)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        if not (isinstance(state, dict) and {"model", "optimizer", "scheduler", "step"} <= state.keys()):
            raise ValueError("not a chronicals checkpoint (no model / optimizer / scheduler / step entries)")
    except Exception as e:  # noqa: BLE001 (zip, pickle, EOF, OS errors alike) saves are atomic: damaged after writing
        unsafe = _unsafe_globals(file)
        if unsafe:
            names = ", ".join(unsafe[:4]) + (", ..." if len(unsafe) > 4 else "")
            raise ValueError(f"checkpoint {file} holds objects other than tensors and plain values ({names}), which "
                             "are not loaded, since unpickling them can run any code: chronicals writes none (a "
                             "train_loader's state_dict with such values does). If "
                             "you trust the file, allow them before train() with torch.serialization."
                             "add_safe_globals([...]); else move it away") from None
        raise ValueError(f"checkpoint {file} {_damage(file, e)}; it is truncated or corrupt: "
                         f"{fix or _move_away_hint(file.parent)}") from None
    fmt = state.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise ValueError(f"checkpoint {file} has format {fmt!r}, written by a newer chronicals (this one reads format "
                         f"{FORMAT}): " + ("resume it with the chronicals version that wrote it, or start over "
                                           "(train.resume=none or another train.out_dir)" if resuming else
                                           "read it with the chronicals version that wrote it"))
    problem = _entry_problem(state, file.parent.name)
    if problem:
        raise ValueError(f"checkpoint {file} is not one chronicals wrote as it is: {problem}; "
                         f"{fix or _move_away_hint(file.parent)}")
    return state


def _entry_problem(state: dict, dir_name: str) -> str | None:
    """What is wrong with a readable state.pt's entries (a hand edit, a rename, another tool's file), or None."""
    step, m = state["step"], _NAME.match(dir_name)
    if type(step) is not int or step < 0:
        return f"its step is {step!r}, not an integer >= 0"
    if m and int(m.group(1)) != step:  # resume=auto would take it for step N, and prune it as another run's
        return f"it holds step {step} but its directory is named {dir_name} (renamed by hand?)"
    missing = [k for k in ("data", "rng") if k not in state]
    if missing:
        return f"it lacks the {' and '.join(missing)} entr{'ies' if len(missing) > 1 else 'y'}"
    if not (isinstance(state["model"], dict) and all(isinstance(t, torch.Tensor) for t in state["model"].values())):
        return "its model entry is not a dict of tensors"
    return None


def _check_moments(optimizer, file: Path, auto: bool = True) -> None:
    """AdamW's moments, restored, belong to the parameters they were mapped to: a missing or misshapen one would
    fail (KeyError, a shape error) at the first step instead, without naming the checkpoint."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if "step" not in (st or {}):  # no step taken yet with this parameter: its moments are made then
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                t = st.get(key)
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    got = "none" if t is None else tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"checkpoint {file}: its optimizer state has {key} {got} for a parameter of "
                                     f"shape {tuple(p.shape)}; it was edited or written by another version: "
                                     f"{_move_away_hint(file.parent, auto)}")


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer, scheduler, config: dict | None = None,
                    auto: bool = True) -> dict:
    """Restore weights, optimizer, scheduler and RNG in place; return {step, data, extra}.

    ``config``: this run's config as a dict (``TrainConfig.to_dict()``); a checkpoint that does not fit the
    model is then reported with the model/lora keys that differ from the ones it was written with. ``auto``:
    train.resume=auto found the checkpoint (a damaged one's fix: move it away), else the config named it (resume
    from the one before it)."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        if path.is_dir() and _NAME.match(path.name):  # resume=auto's newest step-N lost its state.pt
            raise FileNotFoundError(f"checkpoint {path} holds no {STATE_FILE} (copied in part, or the file was "
                                    f"deleted): {_move_away_hint(path, auto)}")
        raise FileNotFoundError(f"checkpoint {file} not found (train.resume takes auto | none | a step-N directory)")
    state = _read_state(file, fix=None if auto else _move_away_hint(file.parent, auto=False))
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
    # a bf16 run's checkpoint resumed in float32 (or wider): its fp32 masters where it kept them, not the bf16
    # weights widened (up to half a bf16 step per weight lost; export / eval --dtype float32 read the masters too)
    wide = {n for n, t in state["model"].items() if n in params and params[n].element_size() >= 4
            and t.dtype in (torch.bfloat16, torch.float16)}
    masters = masters_by_name(state) if wide else {}
    with torch.no_grad():
        for n, t in state["model"].items():
            params[n].copy_(masters[n] if n in wide and n in masters else t)
    what = "optimizer"
    try:  # another parameter grouping, an edited or foreign state: the library's errors name no file
        optimizer.load_state_dict(state["optimizer"])
        what = "learning-rate schedule"
        scheduler.load_state_dict(state["scheduler"])
        what = "random number generator"
        set_rng_state(state["rng"])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {file}: its {what} state does not fit this run ({type(e).__name__}: "
                         f"{_first_line(e)}); "
                         "it was written for another model or lora config, by another version, or edited: resume "
                         "with the config it was written with, or start over (train.resume=none or another "
                         "train.out_dir)") from None
    _check_moments(optimizer, file, auto)
    if state["step"] > 0 and not any("step" in (optimizer.state.get(p) or {})
                                     for g in optimizer.param_groups for p in g["params"]):
        # every step updates some parameter, which then has its moments: none at step N > 0 means they were removed,
        # and the run would go on with fresh moments and bias corrections, off its trajectory
        raise ValueError(f"checkpoint {file}: its optimizer state holds no AdamW moments at step {state['step']}; it "
                         f"was edited or written by another version: {_move_away_hint(file.parent, auto)}")
    return {"step": state["step"], "data": state["data"], "extra": state.get("extra") or {}}
