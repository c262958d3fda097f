"""A resume under another train.grad_accum or train.epochs trains exactly the batches that are left (session 26).

The step count was worked out from step 0 as if every earlier step had used this run's grad_accum and had started
on this run's step grid: 6 of 16 batches done at grad_accum 2, resumed at 4, ended "completed" after 8 batches; a
finished 1.5-epoch run resumed with train.epochs=2 left the last batch untrained.
"""

from __future__ import annotations

import json

import pytest

from chronicals.train import train
from chronicals.train.optim import lr_factor

from train_helpers import SyntheticLoader, sigterm_at_forward, tiny_config, tiny_model


def _records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _tokens(loader, *spans) -> list[int]:
    return [sum(b.num_loss_tokens for b in loader.batches[i:j]) for i, j in spans]


def _cfg(tmp_path, **over):
    return tiny_config(tmp_path, train__max_steps=0, train__save_every=1, **over)


def test_another_grad_accum_trains_the_rest_of_both_epochs(tmp_path, docs):
    loader = SyntheticLoader(docs[:36], shuffle=False)  # 8 batches
    assert len(loader) == 8
    first = train(_cfg(tmp_path, train__epochs=2, train__grad_accum=2), model=sigterm_at_forward(tiny_model(), 6),
                  train_loader=loader)
    assert (first.status, first.step, first.total_steps) == ("interrupted", 3, 8)
    cfg = _cfg(tmp_path, train__epochs=2, train__grad_accum=4, train__resume="auto")
    res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs[:36], shuffle=False))
    # epoch 0's last 2 batches (a short step), then epoch 1 in steps of 4
    assert (res.status, res.step, res.total_steps) == ("completed", 6, 6)
    recs = _records(tmp_path / "run")
    assert [r["loss_tokens"] for r in recs] == _tokens(loader, (0, 2), (2, 4), (4, 6), (6, 8), (0, 4), (4, 8))
    peak, s = cfg.optim.lr, cfg.schedule
    # from the resume on the lr follows the 6-step run (min_lr_ratio at its last step), not the 8-step one
    for step in (3, 4, 5):
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


def test_fewer_epochs_than_were_trained_are_refused(tmp_path, docs):
    train(_cfg(tmp_path, train__epochs=1.5, train__grad_accum=3), model=tiny_model(),
          train_loader=SyntheticLoader(docs[:36], shuffle=False))
    with pytest.raises(ValueError, match=r"cannot resume from .*: 12 batches are trained, past this run's 8 "
                                         r"\(train.epochs=1 of 8 batches\); raise train.epochs"):
        train(_cfg(tmp_path, train__epochs=1, train__grad_accum=3, train__resume="auto"), model=tiny_model(),
              train_loader=SyntheticLoader(docs[:36], shuffle=False))
