"""What the training loop prints on a tiny random decoder: the run's summary, step lines in a log file, and the
progress bar on a terminal."""

from __future__ import annotations

import io
import sys

import tqdm.auto

from chronicals.train import train

from train_helpers import SyntheticLoader, sigterm_at_forward, tiny_config, tiny_model


def test_the_summary_of_a_resumed_run(tmp_path):
    from chronicals.train.loop import TrainResult
    from chronicals.train.report import RunReport

    cfg = tiny_config(tmp_path)
    rep = RunReport(cfg, out=lambda *a: None)
    rep("after", model=None, tokenizer=None, eval_loss=1.5, heldout_qa=None)
    res = TrainResult(status="completed", step=8, total_steps=8, out_dir=tmp_path, start_step=4,
                      eval_loss_before=2.25, train_seconds=2.0, tokens_per_s=100.0)
    text = rep.summary(res)
    assert "held-out loss: 2.2500 -> 1.5000" in text and "training data" not in text
    from chronicals.data.dataset import DatasetStats
    res.data_stats = DatasetStats(records=10, documents=7, skipped_errors=2, truncated=1, dropped_no_loss=1,
                                  unclosed_replies=3)
    assert "training data: 7 examples of 10 records (2 bad records skipped, 1 truncated to data.max_seq_len, " \
           "1 dropped with no loss tokens, 3 replies that train no end-of-turn token)" in rep.summary(res)
    assert "training: 4 steps (resumed at step 4, now at 8 of 8) in 2.0 s, 100 loss tokens/s" in text
    res.start_step = 7
    assert "training: 1 step (resumed at step 7, now at 8 of 8)" in rep.summary(res)
    res.checkpoint = tmp_path / "checkpoints" / "step-000008"
    assert f"resumable checkpoint (weights + optimizer state; " in rep.summary(res)


def test_a_log_file_gets_step_lines_not_a_progress_bar(tmp_path, docs, caplog, capsys):
    """logging.progress with stderr not a terminal (CI, nohup): a plain line every ~5% of the run (41 // 20 = 2
    steps) and the interval evaluations, no carriage-return bar; and a line for step 41, the run's last (its final
    loss), though 41 is not a multiple of 2 (without it the log file ended at step 40)."""
    cfg = tiny_config(tmp_path, train__max_steps=41, eval__every=20, logging__progress=True)
    with caplog.at_level("INFO", logger="chronicals.train"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split(":")[0] for m in lines if "loss tokens/s" in m] == \
        [f"step {k}/41" for k in range(2, 41, 2)] + ["step 41/41"]
    assert any(m.startswith("step 20/41: held-out loss") for m in lines)
    assert "\r" not in capsys.readouterr().err
    caplog.clear()
    with caplog.at_level("INFO", logger="chronicals.train"):  # logging.progress=false: no step lines
        train(tiny_config(tmp_path / "quiet", train__max_steps=2), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert "training steps" not in caplog.text and "step 2/2" not in caplog.text


def test_slow_steps_show_their_rate_in_significant_digits_not_as_0(tmp_path, docs, caplog, monkeypatch):
    """A step of a few loss tokens that took 10-30 s printed "0 loss tokens/s" in its step line and the summary."""
    import re

    from chronicals.train.readback import StepReadback
    from chronicals.train.report import RunReport

    monkeypatch.setattr(StepReadback, "seconds", lambda self: 100.0)  # every step: < 1 loss token/s
    cfg = tiny_config(tmp_path, train__max_steps=2, logging__progress=True)
    with caplog.at_level("INFO", logger="chronicals.train"):
        result = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    lines = [r.getMessage() for r in caplog.records if "loss tokens/s" in r.getMessage()]
    done = [m for m in lines if m.startswith("done: ")]  # train()'s closing line, without the CLI's report
    lines = [m for m in lines if m.startswith("step ")]
    assert len(lines) == 2 and all(re.search(r", 0\.[1-9]\d{0,2} loss tokens/s$", m) for m in lines), lines
    assert len(done) == 1 and re.search(r"in 200\.0 s, 0\.[1-9]\d{0,2} loss tokens/s;", done[0]), done
    text = RunReport(cfg, out=lambda *a: None).summary(result)
    assert re.search(r"in 200\.0 s, 0\.[1-9]\d{0,2} loss tokens/s \(0\.[1-9]\d{0,2} after the first step", text), text
    from chronicals.train.metrics import rate_text
    assert [rate_text(x) for x in (0.0, 0.31234, 12.345, 99.4, 1623.4)] == ["0", "0.312", "12.3", "99.4", "1,623"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_no_log_line_is_glued_to_the_progress_bar(tmp_path, docs, monkeypatch):
    """On a terminal, "step metrics: ..." was logged after the bar was drawn and outside tqdm's logging redirect, so
    it printed on the bar's first line ("train:   0%|  | 0/2 [00:00<?, ?step/s]INFO step metrics: ...")."""
    import logging

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    handler = logging.StreamHandler(term)  # what the CLI's basicConfig puts on the root logger
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        train(tiny_config(tmp_path, train__max_steps=2, logging__progress=True), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    lines = term.getvalue().split("\n")
    assert any("train:" in line and "step/s" in line for line in lines)  # the bar was drawn on this "terminal"
    assert any("step metrics:" in line for line in lines)
    # tqdm's redirect clears the bar's line ("\r   \r") before a log line; glued, the line follows the bar's text
    glued = [seg for line in lines for seg in line.split("\r") if "INFO" in seg and "step/s" in seg]
    assert not glued, glued


def test_a_resumed_runs_progress_bar_counts_from_its_step_to_the_runs_end(tmp_path, docs, monkeypatch):
    """On a terminal the bar counts the whole run: total = the run's steps, initial = the step a resume starts at,
    one update per step trained, so a resumed run's bar ends at its total (it started at 0, or moved by the step
    number); and logging.progress=false draws no bar (the setting was ignored)."""
    made = []

    class Bar(tqdm.auto.tqdm):  # the real bar, drawn into a string; what it was told is kept
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "file": io.StringIO()})
            self.start_n, self.updates, self.was_closed = self.n, [], False
            made.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

        def close(self):
            self.was_closed = True
            return super().close()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    cfg = tiny_config(tmp_path, train__max_steps=6, train__resume="auto", logging__progress=True)
    assert train(cfg, model=sigterm_at_forward(tiny_model(), 2), train_loader=SyntheticLoader(docs)).step == 2
    assert train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs)).step == 6
    assert [(b.total, b.start_n, b.updates, b.n, b.was_closed) for b in made] == \
        [(6, 0, [1, 1], 2, True), (6, 2, [1, 1, 1, 1], 6, True)]
    train(tiny_config(tmp_path / "quiet", train__max_steps=2), model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert len(made) == 2
