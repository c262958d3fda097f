"""A resume under another train.grad_accum or train.epochs trains exactly the batches that are left (session 26).

The step count was worked out from step 0 as if every earlier step had used this run's grad_accum and had started
on this run's step grid: 6 of 16 batches done at grad_accum 2, resumed at 4, ended "completed" after 8 batches; a
finished 1.5-epoch run resumed with train.epochs=2 left the last batch untrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chronicals.data import PackedLoader
from chronicals.data.dataset import DatasetStats, TokenizedDataset
from chronicals.train import train
from chronicals.train.optim import lr_factor
from chronicals.train.stream import _epoch_split, _replan, _step_plan, _Stream

from train_helpers import SyntheticLoader, sigterm_at_forward, tiny_config, tiny_model


def _records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _tokens(loader, *spans) -> list[int]:
    return [sum(b.num_loss_tokens for b in loader.batches[i:j]) for i, j in spans]


def _cfg(tmp_path, **over):
    return tiny_config(tmp_path, train__max_steps=0, train__save_every=1, **over)


@pytest.mark.parametrize("stop", [3, 4], ids=["inside-epoch-0", "at-epoch-0s-end"])
def test_another_grad_accum_trains_the_rest_of_both_epochs(tmp_path, docs, caplog, stop):
    """Stopped at step 3 (6 of 8 batches at grad_accum 2), the resume takes epoch 0's last 2 batches as a short step;
    stopped at step 4 (one epoch done) it goes straight into epoch 1. Either way the resumed run has 6 steps and says
    it runs under other settings. Given the plan from step 0 (16 batches / 4 = 4 steps), step 4 looked like the
    run's last, and the "resumed with other settings" warning was dropped."""
    loader = SyntheticLoader(docs[:36], shuffle=False)  # 8 batches
    assert len(loader) == 8
    first = train(_cfg(tmp_path, train__epochs=2, train__grad_accum=2),
                  model=sigterm_at_forward(tiny_model(), 2 * stop), train_loader=loader)
    assert (first.status, first.step, first.total_steps) == ("interrupted", stop, 8)
    cfg = _cfg(tmp_path, train__epochs=2, train__grad_accum=4, train__resume="auto")
    with caplog.at_level("WARNING", logger="chronicals.train"):
        res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs[:36], shuffle=False))
    assert f"resumed at step {stop} with other settings" in caplog.text and "train.grad_accum" in caplog.text
    # the rest of epoch 0 in steps of 2 (at step 3 a short step), then epoch 1 in steps of 4
    assert (res.status, res.step, res.total_steps) == ("completed", 6, 6)
    recs = _records(tmp_path / "run")
    assert [r["loss_tokens"] for r in recs] == _tokens(loader, (0, 2), (2, 4), (4, 6), (6, 8), (0, 4), (4, 8))
    peak, s = cfg.optim.lr, cfg.schedule
    # from the resume on the lr follows the 6-step run (min_lr_ratio at its last step), not the 8-step one
    for step in range(stop, 6):
        want = peak * lr_factor(step, 6, s.warmup_steps, s.kind, s.min_lr_ratio)
        assert recs[step]["lr"] == pytest.approx(want, rel=1e-6)


def test_more_epochs_after_a_fractional_run_train_every_batch_left(tmp_path, docs):
    loader = SyntheticLoader(docs[:36], shuffle=False)
    first = train(_cfg(tmp_path, train__epochs=1.5, train__grad_accum=3), model=tiny_model(), train_loader=loader)
    assert (first.status, first.total_steps) == ("completed", 5)  # 8 batches: 3, 3, 2; then 4: 3, 1
    res = train(_cfg(tmp_path, train__epochs=2, train__grad_accum=3, train__resume="auto"), model=tiny_model(),
                train_loader=SyntheticLoader(docs[:36], shuffle=False))
    assert (res.status, res.step) == ("completed", 7)
    assert [r["loss_tokens"] for r in _records(tmp_path / "run")] == \
        _tokens(loader, (0, 3), (3, 6), (6, 8), (0, 3), (3, 4), (4, 7), (7, 8))


@pytest.mark.parametrize("accum,spans,plans", [
    (3, [(1, 4)], [(1, 3), (1, 2), (1, 1), (0, 3)]),
    (2, [(1, 3), (3, 4)], [(2, 1), (1, 2), (1, 1), (0, 2)])], ids=["full-last-step", "short-last-step"])
def test_a_resume_inside_a_fractional_runs_last_epoch_trains_only_the_fractions_batches(tmp_path, docs, accum, spans,
                                                                                        plans):
    """1.5 epochs of 8 batches end after batch 12 (epoch 1's first 4). Stopped after 9 batches at grad_accum 1 and
    resumed at grad_accum 3, 3 batches are left: one step of 3. Counting the rest of the epoch the resume lands in
    to the epoch's end (16), not the run's, then back one epoch, planned 2 steps: a batch past the fraction was
    trained and the lr schedule was a step long. Resumed at grad_accum 2, the last step is a short one (1 batch):
    its short count applied only to a run that started at step 0, so the resumed run's last step took a full 2,
    one batch past the fraction."""
    loader = SyntheticLoader(docs[:36], shuffle=False)
    first = train(_cfg(tmp_path, train__epochs=1.5, train__grad_accum=1), model=sigterm_at_forward(tiny_model(), 9),
                  train_loader=loader)
    assert (first.status, first.step) == ("interrupted", 9)
    cfg = _cfg(tmp_path, train__epochs=1.5, train__grad_accum=accum, train__resume="auto")
    res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs[:36], shuffle=False))
    assert (res.status, res.step, res.total_steps) == ("completed", 9 + len(spans), 9 + len(spans))
    assert [r["loss_tokens"] for r in _records(tmp_path / "run")][9:] == _tokens(loader, *spans)
    # (steps, batches of the last one) from 9..12 batches done
    assert [_step_plan(cfg, 8, done=d) for d in (9, 10, 11, 12)] == plans


@pytest.mark.parametrize("accum,done,plan", [(4, 2, (3, 4)), (3, 2, (4, 1)), (4, 1, (3, 4)), (3, 5, (3, 1))])
def test_a_resume_inside_the_first_epoch_finishes_that_epoch_before_the_fraction(tmp_path, accum, done, plan):
    """1.5 epochs of 8 batches, resumed after `done` batches: the rest of that epoch is 8 - done batches, then the
    fraction's 4. Counting a whole epoch (8) from the resume point moved the plan's last step off the fraction's end:
    resumed after 2 batches at grad_accum 4, the last step took 2 of the fraction's 4 batches and the run still
    said "completed" with 2 of them never trained."""
    cfg = _cfg(tmp_path, train__epochs=1.5, train__grad_accum=accum)
    assert _step_plan(cfg, 8, done=done) == plan


@pytest.mark.parametrize("epochs,G,W,split,plan", [(1.5, 5, 2, (1, 2), (5, 1)), (0.5, 5, 2, (0, 2), (2, 1)),
                                                  (1.5, 5, 1, (1, 3), (8, 1)), (0.1, 9, 4, (0, 1), (1, 1))])
def test_a_cut_loaders_fraction_of_an_epoch_is_planned_rounded_up_as_the_cut(tmp_path, epochs, G, W, split, plan):
    """Under data parallelism (G global batches an epoch over W ranks) the plan's fraction of an epoch is
    ceil(fraction x G) global batches, rounded up as the loader's own cut (cut_fraction) rounds it: 1.5 epochs of 5
    on 2 ranks is 3 global batches of the second pass, 2 rounds. Rounded down, the plan ended a step early and the
    cut's second round of the fraction was never trained."""
    cfg = _cfg(tmp_path, train__epochs=epochs, train__grad_accum=1)
    B = -(-G // W)  # a rank's batches an epoch (the remainder padded)
    assert _epoch_split(cfg, B, (G, W)) == split
    assert _step_plan(cfg, B, spread=(G, W)) == plan


def test_a_fractional_epoch_run_cuts_its_loaders_last_pass(tmp_path):
    """train.epochs=0.5 over a PackedLoader of 5 batches: train() itself sets the loader's cut (cut_fraction), so
    the last pass stops after ceil(0.5 x 5) = 3 batches and the cut goes into the checkpoint's data position (under
    data parallelism it decides which ranks get empty batches). Without it the step plan alone ended the run and
    the loader was never cut."""
    rows = 9  # 5 batches of 2 rows
    ids = np.arange(rows * 8, dtype=np.int32) % 50 + 1
    stats = DatasetStats(records=rows, documents=rows, tokens=rows * 8, loss_tokens=rows * 7)
    ds = TokenizedDataset(ids, np.ones(rows * 8, dtype=bool), np.arange(rows + 1) * 8, 0, stats, 8)
    loader = PackedLoader(ds, batch_size=2, max_seq_len=8, shuffle=False, rank=0, world_size=1)
    res = train(_cfg(tmp_path, train__epochs=0.5), model=tiny_model(), train_loader=loader)
    assert (res.status, res.step) == ("completed", 3)
    assert loader.state_dict()["cut"] == [0, 3]


def test_fewer_epochs_than_were_trained_are_refused(tmp_path, docs):
    train(_cfg(tmp_path, train__epochs=1.5, train__grad_accum=3), model=tiny_model(),
          train_loader=SyntheticLoader(docs[:36], shuffle=False))
    with pytest.raises(ValueError, match=r"cannot resume from .*: 12 batches are trained, past this run's 8 "
                                         r"\(train.epochs=1 of 8 batches\); raise train.epochs"):
        train(_cfg(tmp_path, train__epochs=1, train__grad_accum=3, train__resume="auto"), model=tiny_model(),
              train_loader=SyntheticLoader(docs[:36], shuffle=False))


class _OtherKeysLoader(SyntheticLoader):
    """Its position under its own key names: the trainer cannot read it, and keeps the plan from step 0."""

    def state_dict(self):
        return {"ep": self.epoch, "pos": self.position}

    def load_state_dict(self, sd):
        self.epoch, self.position = sd["ep"], sd["pos"]


def test_a_loader_of_another_state_still_trains_the_epoch_to_its_end(tmp_path, docs):
    """1 epoch of 8 batches, stopped after step 1 at grad_accum 2, resumed at 3: 6 batches left in steps of 3, 3.
    The last step of a run that ends at an epoch's end asks for grad_accum (the epoch's end shortens it), so a
    position the trainer cannot read (off its step grid) still reaches the end: it asked for 8 - 2 x 3 = 2 and
    left batch 8 untrained."""
    first = train(_cfg(tmp_path, train__epochs=1, train__grad_accum=2), model=sigterm_at_forward(tiny_model(), 2),
                  train_loader=_OtherKeysLoader(docs[:36], shuffle=False))
    assert (first.status, first.step) == ("interrupted", 1)
    loader = _OtherKeysLoader(docs[:36], shuffle=False)
    res = train(_cfg(tmp_path, train__epochs=1, train__grad_accum=3, train__resume="auto"), model=tiny_model(),
                train_loader=loader)
    counts = [r["loss_tokens"] for r in _records(tmp_path / "run")][1:]
    assert res.status == "completed" and loader.position == 8
    assert counts == _tokens(loader, (2, 5), (5, 8))


class _EpochOnlyLoader:
    """A custom loader's state: an integer 'epoch' but no integer 'position'."""

    def __init__(self, state):
        self.state = state

    def __len__(self):
        return 8

    def state_dict(self):
        return dict(self.state)


@pytest.mark.parametrize("state", [{"epoch": 1, "seed": 0}, {"epoch": 1, "position": None},
                                   {"epoch": 1, "position": "3"}])
def test_a_state_with_an_epoch_but_no_integer_position_keeps_the_plan_from_step_0(tmp_path, state, caplog):
    """A loader state the trainer cannot read a position from keeps the plan from step 0, as one with neither key
    does, and says so in an info line naming the steps it counts from step 0 (without it nothing tells that this
    resume's length was not worked out from the batches left); checking the epoch alone read the missing position
    into the re-plan (TypeError: int + NoneType)."""
    cfg = _cfg(tmp_path, train__epochs=2, train__grad_accum=3)
    total, last = _step_plan(cfg, 8)
    assert (total, last) == (6, 3)  # 3, 3, 2 per epoch; the epoch's end shortens the last step
    with caplog.at_level("INFO", logger="chronicals.train"):
        plan = _replan(cfg, _Stream(_EpochOnlyLoader(state)), 2, total, last, Path("run/checkpoints/step-2"))
    assert plan == (total, last)
    assert "no integer 'epoch' and 'position'" in caplog.text and "counts 6 steps from step 0" in caplog.text


def test_the_short_warmup_warning_names_the_length_the_resumed_run_trains(tmp_path, docs, caplog):
    """6 batches x 2 epochs, warmup 5: stopped at step 5 of 12 (grad_accum 1), resumed at grad_accum 4, the run is
    5 + 1 + 2 = 8 steps and keeps its 5-step warmup; the warning was said for the 4 steps a run from step 0 would
    take, a schedule the run never used."""
    import logging

    cfg = dict(train__epochs=2, schedule__warmup_steps=5)
    train(_cfg(tmp_path, train__grad_accum=1, **cfg), model=sigterm_at_forward(tiny_model(), 5),
          train_loader=SyntheticLoader(docs[:28], shuffle=False))
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        res = train(_cfg(tmp_path, train__grad_accum=4, train__resume="auto", **cfg), model=tiny_model(),
                    train_loader=SyntheticLoader(docs[:28], shuffle=False))
    assert res.total_steps == 8 and "is not shorter than the run's" not in caplog.text, caplog.text


def test_a_finished_epochs_run_started_again_is_complete(tmp_path, docs):
    """A completed train.epochs run started again with train.resume=auto (the same command twice, a scheduler's
    retry) has every batch trained and completes at once: it was refused with "8 batches are trained, past this
    run's 8 ... raise train.epochs", a message that contradicts itself."""
    def run(**over):
        return train(_cfg(tmp_path, train__epochs=1, train__grad_accum=3, **over), model=tiny_model(),
                     train_loader=SyntheticLoader(docs[:36], shuffle=False))

    first = run()
    again = run(train__resume="auto")
    assert (first.status, first.step) == (again.status, again.step) == ("completed", 3)


def test_a_checkpoint_at_an_epochs_last_batch_resumes_into_the_next_epoch(tmp_path, docs):
    """8 batches at grad_accum 4: the step that takes an epoch's last batch asks the loader for no other, so its
    checkpoint's position is the epoch's end, and the resumed loader's first pass is empty before it rolls over.
    Taking that pass for a loader that never starts its next epoch refused every such resume (a finished run given
    more epochs) with "the training loader yielded no batches after its epoch ended"."""
    def run(epochs, **over):
        return train(_cfg(tmp_path, train__epochs=epochs, train__grad_accum=4, **over), model=tiny_model(),
                     train_loader=SyntheticLoader(docs[:36], shuffle=False))

    first = run(1)
    assert (first.status, first.step) == ("completed", 2)
    more = run(2, train__resume="auto")
    assert (more.status, more.step, more.total_steps) == ("completed", 4, 4)
