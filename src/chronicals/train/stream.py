"""The training batches as the loop takes them: an endless stream over epochs (a step never spans two), the
run's number of steps, and a checkpoint's data position restored into the stream."""

from __future__ import annotations

import logging
import math
from fractions import Fraction
from pathlib import Path

from .._words import counted
from ..config import TrainConfig
from ..data.loader import DataChanged, LoaderMismatch
from .resume import data_position_diffs, loss_setting_diffs

log = logging.getLogger("chronicals.train")


class _Stream:
    """An endless sequence of batches over epochs; the loader's own state_dict is the data position."""

    def __init__(self, loader):
        self.loader, self._it = loader, None

    def take(self, k: int) -> list:
        """The next ``k`` batches, or fewer when the epoch ends among them: a step never spans two epochs, so
        train.epochs=1 trains every batch once (10 batches at grad_accum 3: steps of 3, 3, 3, 1), as the Hugging
        Face Trainer does. Each step's loss is normalized by its own loss-token count, so a short step is exact."""
        out, fresh_empty = [], 0
        while len(out) < k:
            fresh = self._it is None
            if fresh:
                self._it = iter(self.loader)  # the next `iter` of the loader continues with the next epoch
            try:
                out.append(next(self._it))
            except StopIteration:
                self._it = None
                if out:
                    break
                # one empty pass is a loader saved at its epoch's end rolling over; two in a row would spin forever
                fresh_empty += fresh
                if fresh_empty > 1:
                    raise ValueError("the training loader yielded no batches after its epoch ended: its __iter__ "
                                     "must start the next epoch (as PackedLoader does), not return an exhausted "
                                     "iterator") from None
        return out

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.loader.load_state_dict(sd)
        self._it = None


def _restore_position(stream, restored: dict, cfg_dict: dict, path: Path) -> None:
    """The data position of checkpoint ``path``; a loader of other data, batches or seed is refused with the
    checkpoint's name and the keys this run changed (the loader's own message names only the counts)."""
    try:
        stream.load_state_dict(restored["data"])  # rank 0's position: every rank's equals it (equal shards)
    except DataChanged as e:  # the same counts, other documents (or other loss tokens): the run would change
        loss = loss_setting_diffs(restored["extra"].get("config"), cfg_dict)
        if loss:  # e.g. data.train_on: the same token ids with other trainable masks
            raise ValueError(f"cannot resume from {path}: this run changed {', '.join(loss.values())}, which "
                             f"changes the training documents or their loss tokens ({e.args[1]}); set the "
                             "checkpoint's value to continue its run, or start fresh with train.resume=none (or "
                             "another train.out_dir)") from None
        moved = data_position_diffs(restored["extra"].get("config"), cfg_dict)  # said here, not warned before
        raise ValueError(f"cannot resume from {path}: the training data changed since this checkpoint was written: "
                         f"{e.args[1]}{'; this run changed ' + ', '.join(moved) if moved else ''}; resume with the "
                         "original data, or start fresh with train.resume=none (or another train.out_dir)") from None
    except ValueError as e:
        if "data.dp_remainder=drop" in str(e) or "data-parallel rank(s)" in str(e):  # the loader names the fix
            raise ValueError(f"cannot resume from {path}: {e}") from None
        diffs = data_position_diffs(restored["extra"].get("config"), cfg_dict)
        diffs += list(loss_setting_diffs(restored["extra"].get("config"), cfg_dict).values())
        new_run = "a run over other data or batches is a new run: set train.resume=none or another train.out_dir"
        if diffs:
            why = f"this run changed {', '.join(diffs)}; {new_run}"
        else:
            why = (f"no data setting changed, so either the data files' contents did ({new_run}) or the number of "
                   "ranks did (resume with the checkpoint's torchrun --nproc-per-node)")
        detail = e.args[1] if isinstance(e, LoaderMismatch) else str(e)  # without its advice in its arguments' names
        raise ValueError(f"cannot resume from {path}: {detail}; {why}") from None


def _replan(cfg: TrainConfig, stream: _Stream, start: int, total: int, last_batches: int,
            path: Path) -> tuple[int, int]:
    """(total steps, batches of the last step) of a run resumed at step ``start`` from checkpoint ``path``: under
    train.epochs, ``start`` plus the steps for the batches left after the restored data position (another
    grad_accum or train.epochs than the checkpoint's run moves its steps off this run's grid); the plan from step 0
    under train.max_steps, or for a loader whose state has no epoch and position."""
    pos = stream.state_dict()
    epoch, position = pos.get("epoch"), pos.get("position")
    if cfg.train.max_steps > 0 or not (isinstance(epoch, int) and isinstance(position, int)):
        if cfg.train.max_steps == 0:
            log.info("the training loader's state has no integer 'epoch' and 'position' (PackedLoader's): this "
                     "resume counts %s from step 0 with this run's train.grad_accum", counted(total, "step"))
        return total, last_batches
    batches = len(stream.loader)
    try:
        left, last = _step_plan(cfg, batches, epoch * batches + position, _spread(stream.loader))
    except ValueError as e:
        raise ValueError(f"cannot resume from {path}: {e}; raise train.epochs, or set train.resume=none to start "
                         "over") from None
    return start + left, last


def _step_plan(cfg: TrainConfig, batches_per_epoch: int, done: int = 0,
               spread: tuple[int, int] | None = None) -> tuple[int, int]:
    """(steps, batches of the last one) that take the run from ``done`` batches trained (over all epochs: a resumed
    loader's epoch x batches_per_epoch + position) to its end. train.max_steps: that many steps from the start
    (``done`` is not used), grad_accum batches each. train.epochs: its batches (whole epochs, then the fraction's
    batches rounded up: ``_epoch_split``) in steps of grad_accum that never span two epochs (``_Stream.take``): 10
    batches at grad_accum 3 are steps of 3, 3, 3, 1. From the batches, not the steps, so a resume under another
    grad_accum or train.epochs trains exactly the batches that are left (the step count was worked out from 0 as
    if every earlier step had used this run's grad_accum: 6 batches done at grad_accum 2, resumed at 4, stopped
    after 8 of 16). The last step is fewer than grad_accum batches when a fractional train.epochs ends inside a step
    (2.1 epochs of 10 batches at grad_accum 4 is 21 batches: steps of 4, 4, 2 per epoch, then 1; it took 4, 24
    batches). ``spread``: a cut loader's (global batches, ranks), ``_epoch_split``. ValueError when ``done`` is past
    the run's end."""
    B, ga = batches_per_epoch, cfg.train.grad_accum
    if B == 0:  # with max_steps too: the first step would end in a bare StopIteration
        raise ValueError("the training loader yields no batches: is the dataset empty?")
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps, ga
    whole, part = _epoch_split(cfg, B, spread)
    end = whole * B + part  # in exact decimals: 1.1 - 1 is 0.10000000000000009 in floats (1.1 x 10 took 12 steps)
    if done > end:
        raise ValueError(f"{counted(done, 'batch', 'batches')} {'is' if done == 1 else 'are'} trained, past this "
                         f"run's {end} (train.epochs={cfg.train.epochs:g} of {counted(B, 'batch', 'batches')})")
    steps, last = 0, ga

    def segment(n: int, times: int = 1) -> None:  # `times` runs of n batches inside one epoch each
        nonlocal steps, last
        k = math.ceil(n / ga)
        steps, last = steps + k * times, n - (k - 1) * ga

    if done % B and done < end:  # the rest of the epoch the resume lands in
        n = min(done - done % B + B, end) - done
        segment(n)
        done += n
    if (end - done) // B:
        segment(B, (end - done) // B)
        done += (end - done) // B * B
    if end > done:
        segment(end - done)
    # a run that ends at an epoch's end: its last step is whatever is left of that epoch (``_Stream.take`` stops
    # there), so ask for grad_accum; a loader whose position is not known (``_replan``) may be off this grid
    return steps, last if end % B else ga


def _spread(loader) -> tuple[int, int] | None:
    """(global batches an epoch trains, ranks) of a loader that can cut its epochs (PackedLoader), else None."""
    if not hasattr(loader, "cut_epoch"):
        return None
    return loader.trained_global_batches, loader.world_size


def cut_fraction(cfg: TrainConfig, loader) -> None:
    """The last pass of a fractional train.epochs trains ceil(fraction x G) of its G global batches, as one process
    with grad_accum x W does (``PackedLoader.cut_epoch``: the ranks past them in that round get empty batches);
    whole rounds of ranks trained up to W - 1 more (0.2 of 5 global batches on 2 ranks: 2, one process 1). No
    cut under whole epochs or train.max_steps. Set before a checkpoint's data position is restored."""
    spread = _spread(loader)
    if spread is None:
        return
    whole, part = _epoch_split(cfg, spread[0]) if cfg.train.max_steps == 0 else (0, 0)
    loader.cut_epoch(whole if part else None, part)


def _epoch_split(cfg: TrainConfig, batches_per_epoch: int,
                 spread: tuple[int, int] | None = None) -> tuple[int, int]:
    """train.epochs as (whole epochs, batches of the next one): its fraction of the epoch's batches, rounded up.
    ``spread`` = (G global batches an epoch trains, W ranks) of a cut loader (``cut_fraction``): the fraction is of
    G, and a rank's batches are the rounds of ranks that hold them, ceil(ceil(fraction x G) / W)."""
    epochs = Fraction(str(cfg.train.epochs))
    whole = math.floor(epochs)
    if spread is not None:
        return whole, -(-math.ceil((epochs - whole) * spread[0]) // spread[1])
    return whole, math.ceil((epochs - whole) * batches_per_epoch)
