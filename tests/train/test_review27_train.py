"""Behaviour that mutation testing (session 27) showed no test would notice breaking: the summary's loss tokens/s,
the closing evaluation of a finished run resumed without it, no second evaluation of the last step, keep_last."""

from __future__ import annotations

import json

import pytest

from chronicals.train import train
from chronicals.train.checkpoint import checkpoint_dirs, write_checkpoint

from train_helpers import SyntheticLoader, tiny_config, tiny_model


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_result_tokens_per_s_is_loss_tokens_over_step_seconds(tmp_path, docs):
    res = train(tiny_config(tmp_path, train__max_steps=3), model=tiny_model(), train_loader=SyntheticLoader(docs))
    steps = [r for r in _records(tmp_path / "run") if r.get("kind") == "train"]
    want = sum(r["loss_tokens"] for r in steps) / sum(r["step_s"] for r in steps)
    assert res.tokens_per_s == pytest.approx(want, rel=1e-6)
    assert res.train_seconds == pytest.approx(sum(r["step_s"] for r in steps), rel=1e-6)


def test_resume_of_a_finished_run_without_its_closing_eval_runs_it(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=2)
    ev = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    first = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=ev())
    path = tmp_path / "run" / "metrics.jsonl"
    # as a signal after the last step's checkpoint leaves it: every step trained, no "after" evaluation
    kept = [r for r in _records(tmp_path / "run") if r.get("tag") != "after"]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    again = tiny_config(tmp_path, train__max_steps=2, train__resume="auto")
    res = train(again, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=ev())
    assert res.eval_loss_after == pytest.approx(first.eval_loss_after)
    assert [r["step"] for r in _records(tmp_path / "run") if r.get("tag") == "after"] == [2]


def test_interval_eval_skips_the_last_step(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=4, eval__every=2)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs),
          eval_loader=SyntheticLoader(docs[:4], shuffle=False))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r.get("tag")) for r in recs if r.get("kind") == "eval"]
    assert [s for s, _ in evals].count(4) == 1, evals
    assert (2, "interval") in evals and (4, "after") in evals


def test_keep_last_keeps_exactly_the_newest(tmp_path):
    for step in range(1, 6):
        write_checkpoint(tmp_path, {"step": step}, keep_last=2)
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-000004", "step-000005"]
