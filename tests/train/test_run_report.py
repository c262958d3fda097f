"""The numbers of `chronicals train`'s closing summary (train/report.py): eval.qa_limit, before and after told apart,
"resumed" only for a resumed run, and the system message the held-out questions are asked with."""

from __future__ import annotations

import pytest

from chronicals.config import from_dict
from chronicals.train.finish import TrainResult
from chronicals.train.qa import QAResult

HELD = [{"question": "q?", "keywords": ["k"]}]


def _stub_report(monkeypatch, tmp_path, cfg=None):
    """A RunReport whose answer_all is a stub answering "the answer", all right; returns it, the number of questions
    of each answer_all call, and the lines it printed."""
    import chronicals.train.report as report

    calls = []
    monkeypatch.setattr(report, "answer_all", lambda m, t, qa, system, n: calls.append(len(qa)) or
                        QAResult(["the answer"] * len(qa), [True] * len(qa)))
    said = []
    rep = report.RunReport(from_dict({"train": {"out_dir": str(tmp_path)}, **(cfg or {})}), out=said.append)
    return rep, calls, said


def test_the_summary_counts_eval_qa_limit_questions_and_says_before_and_after_apart(monkeypatch, tmp_path):
    """eval.qa_limit=2 answers exactly 2 held-out questions (the report slices them itself); the before line shows
    the before answers' marks and counts, not the after ones; a fresh run (start_step 0) is not called resumed."""
    import chronicals.train.report as report

    calls = []

    def answer_all(model, tok, qa, system, max_new_tokens):
        calls.append(len(qa))
        ok = len(calls) > 1  # before: none right; after: all right
        return QAResult([f"answer {len(calls)}"] * len(qa), [ok] * len(qa))
    monkeypatch.setattr(report, "answer_all", answer_all)
    said = []
    cfg = from_dict({"eval": {"qa_limit": 2}, "train": {"out_dir": str(tmp_path)}})
    rep = report.RunReport(cfg, out=said.append)
    heldout = [{"question": f"q{i}?", "keywords": ["k"]} for i in range(4)]
    rep("before", model=None, tokenizer=object(), eval_loss=2.0, heldout_qa=heldout)
    rep("after", model=None, tokenizer=object(), eval_loss=1.0, heldout_qa=heldout)
    assert calls == [2, 2]
    assert any(s.startswith("  answered 2 held-out questions") and s.endswith("0/2 contain their keywords")
               for s in said)
    one = []  # eval.qa_limit=1: "1 held-out question" (it said "1 held-out questions")
    report.RunReport(from_dict({"eval": {"qa_limit": 1}, "train": {"out_dir": str(tmp_path)}}), out=one.append)(
        "before", model=None, tokenizer=object(), eval_loss=None, heldout_qa=heldout)
    assert any(s.startswith("  answered 1 held-out question in ") for s in one), one
    res = TrainResult(status="completed", step=3, total_steps=3, out_dir=tmp_path, train_seconds=1.0, tokens_per_s=10.0)
    text = rep.summary(res)
    assert text.count("Q: ") == 2
    assert "held-out answers with their keywords: 0% (0/2) -> 100% (2/2)" in text
    assert text.count("  before [ ] answer 1") == 2 and text.count("  after  [x] answer 2") == 2
    assert "training: 3 steps in 1.0 s" in text and "resumed" not in text
    assert "after the first step" not in text  # a result without the rate after the first step: nothing said
    res.first_step_seconds, res.tokens_per_s_after_first = 0.8, 1234.5
    assert "training: 3 steps in 1.0 s, 10 loss tokens/s (1,234 after the first step, which took 0.8 s with its " \
           "one-time warm-up); total wall time" in rep.summary(res)


def test_held_out_questions_without_an_eval_loss_are_still_answered(monkeypatch, tmp_path):
    """Held-out QA records but no eval data (eval_loss None): the questions are answered under the
    "== before training ==" header, with no loss line; returning early whenever eval_loss was None left them
    unanswered. Only a report with nothing held out at all stays silent."""
    import chronicals.train.report as report

    calls = []
    monkeypatch.setattr(report, "answer_all", lambda m, t, qa, system, n: calls.append(len(qa)) or
                        QAResult(["a"] * len(qa), [True] * len(qa)))
    said = []
    rep = report.RunReport(from_dict({"train": {"out_dir": str(tmp_path)}}), out=said.append)
    rep("before", model=None, tokenizer=object(), eval_loss=None, heldout_qa=[{"question": "q?", "keywords": ["k"]}])
    assert calls == [1] and "== before training ==" in said and rep.before is not None
    assert not any("held-out loss" in s for s in said)


def test_held_out_questions_are_not_asked_without_a_tokenizer_or_with_eval_qa_off(monkeypatch, tmp_path):
    """With no tokenizer (answer_all needs one) the eval loss is still reported but no question is asked; with
    eval.qa=false and no eval loss there is nothing to report: no empty "== before training ==" header either."""
    rep, calls, said = _stub_report(monkeypatch, tmp_path)
    rep("before", model=None, tokenizer=None, eval_loss=2.0, heldout_qa=HELD)
    assert calls == [] and rep.before is None and rep.qa is None and "  held-out loss 2.0000" in said
    rep, calls, said = _stub_report(monkeypatch, tmp_path, {"eval": {"qa": False}})
    rep("before", model=None, tokenizer=object(), eval_loss=None, heldout_qa=HELD)
    assert said == [] and calls == []
    rep("before", model=None, tokenizer=object(), eval_loss=2.0, heldout_qa=HELD)
    assert calls == [] and rep.before is None and said == ["== before training ==", "  held-out loss 2.0000"]


def test_a_long_answer_of_several_lines_is_shown_on_one_shortened_line(monkeypatch, tmp_path):
    import chronicals.train.report as report

    answer = "first line\n\n  second   line " + "word " * 40
    monkeypatch.setattr(report, "answer_all", lambda m, t, qa, system, n: QAResult([answer], [True]))
    rep = report.RunReport(from_dict({"train": {"out_dir": str(tmp_path)}}), out=lambda *a: None)
    rep("after", model=None, tokenizer=object(), eval_loss=None, heldout_qa=HELD)
    text = rep.summary(TrainResult(status="completed", step=1, total_steps=1, out_dir=tmp_path))
    line = next(s for s in text.splitlines() if s.startswith("  after  [x] "))
    assert line.startswith("  after  [x] first line second line word word")
    assert line.endswith(" ...") and len(line[len("  after  [x] "):]) <= 110


def test_the_summary_of_answers_on_one_side_only(monkeypatch, tmp_path):
    """A resumed run has after-answers only: each question is listed with its after line and no before line, and the
    score line shows "-" for the before score. A run stopped before its closing evaluation has before-answers only:
    no question list and no score line. Either one-sided case crashed on the missing answers (AttributeError)."""
    rep, _, _ = _stub_report(monkeypatch, tmp_path)
    rep("after", model=None, tokenizer=object(), eval_loss=1.0, heldout_qa=HELD)
    lines = rep.summary(TrainResult(status="completed", step=4, total_steps=4, out_dir=tmp_path,
                                    start_step=2)).splitlines()
    assert "  after  [x] the answer" in lines and not any(s.startswith("  before [") for s in lines)
    assert "held-out answers with their keywords: - -> 100% (1/1)" in lines
    rep, calls, _ = _stub_report(monkeypatch, tmp_path)
    rep("before", model=None, tokenizer=object(), eval_loss=2.0, heldout_qa=HELD)
    assert calls == [1]
    text = rep.summary(TrainResult(status="interrupted", step=1, total_steps=3, out_dir=tmp_path))
    assert "Q: " not in text and "held-out answers with their keywords" not in text


def test_the_summary_counts_pluralise(tmp_path):
    """Counts read as English at 0 and 1: "0 examples of 1 record", "1 example of 2 records", and a resumed run
    with nothing left to train "0 steps" (pluralising on > 1 gave "0 example", "0 step")."""
    from types import SimpleNamespace

    from chronicals.train.report import RunReport

    rep = RunReport(from_dict({"train": {"out_dir": str(tmp_path)}}), out=lambda *a: None)

    def data_line(documents, records, lost=()):
        st = SimpleNamespace(documents=documents, records=records, losses=lambda: list(lost))
        text = rep.summary(TrainResult(status="completed", step=1, total_steps=1, out_dir=tmp_path, data_stats=st))
        return next(s for s in text.splitlines() if s.startswith("training data:"))

    assert data_line(0, 1, ["1 too long"]) == "training data: 0 examples of 1 record (1 too long)"
    assert data_line(1, 2) == "training data: 1 example of 2 records"
    text = rep.summary(TrainResult(status="completed", step=5, total_steps=5, out_dir=tmp_path, start_step=5))
    assert "training: 0 steps (resumed at step 5, now at 5 of 5) in" in text


def test_the_summary_names_a_resumable_checkpoint_only_when_there_is_one(tmp_path):
    """With no checkpoint written (train.save_every 0, or a run that saved none) there is no "resumable checkpoint
    ...: None" line; with one, the line names it."""
    from chronicals.train.report import RunReport

    rep = RunReport(from_dict({"train": {"out_dir": str(tmp_path)}}), out=lambda *a: None)
    text = rep.summary(TrainResult(status="completed", step=1, total_steps=1, out_dir=tmp_path))
    assert "resumable checkpoint" not in text and "None" not in text
    ck = tmp_path / "checkpoint-1"
    text = rep.summary(TrainResult(status="completed", step=1, total_steps=1, out_dir=tmp_path, checkpoint=ck))
    assert any(s.startswith("resumable checkpoint") and s.endswith(f": {ck}") for s in text.splitlines())


def test_the_after_loss_alone_is_shown_when_no_before_loss_is_known(tmp_path):
    """No before-loss (none measured, none in metrics.jsonl): the summary still shows the after-training loss, as
    "held-out loss: A", not a blank line."""
    from chronicals.train.report import RunReport

    rep = RunReport(from_dict({"train": {"out_dir": str(tmp_path)}}), out=lambda *a: None)
    rep("after", model=None, tokenizer=None, eval_loss=1.5, heldout_qa=None)
    text = rep.summary(TrainResult(status="completed", step=2, total_steps=2, out_dir=tmp_path))
    assert "held-out loss: 1.5000" in text.splitlines() and "->" not in text


@pytest.mark.parametrize("lora,kind", [(True, "adapter (PEFT format)"), (False, "model (Hugging Face format)")])
def test_the_summary_says_whether_the_final_directory_is_an_adapter_or_a_model(tmp_path, lora, kind):
    """The final directory is named as what it holds: a LoRA run's is an adapter (loaded with PEFT), a full
    fine-tune's a model (loaded with from_pretrained); calling both a model sent LoRA users to the wrong loader."""
    from chronicals.train.report import RunReport

    rep = RunReport(from_dict({"lora": {"enabled": lora}, "train": {"out_dir": str(tmp_path)}}), out=lambda *a: None)
    final = tmp_path / "final"
    text = rep.summary(TrainResult(status="completed", step=1, total_steps=1, out_dir=tmp_path, final_dir=final))
    assert f"{kind}: {final}" in text.splitlines()


def test_the_report_asks_held_out_questions_with_the_held_out_system_message(monkeypatch, tmp_path):
    """Own data (data.path not the demo) with data.system_prompt left at its default: the before/after questions are
    asked with '' (what the user's records get, and what `chronicals eval` and the held-out chat file use); asked
    with data.system_prompt (the demo's text), the printed before -> after scores measured another prompt."""
    import chronicals.train.report as report

    systems = []
    monkeypatch.setattr(report, "answer_all", lambda m, t, qa, system, n: systems.append(system) or
                        QAResult(["a"] * len(qa), [True] * len(qa)))
    cfg = from_dict({"data": {"path": "mine.jsonl"}, "train": {"out_dir": str(tmp_path)}})
    rep = report.RunReport(cfg, out=lambda *a: None)
    rep("before", model=None, tokenizer=object(), eval_loss=2.0, heldout_qa=[{"question": "q?", "keywords": ["k"]}])
    assert systems == [""]


def test_the_closing_rerun_reports_after_with_the_held_out_qa_and_only_a_before_loss(tmp_path):
    """The rerun that runs a stopped run's closing evaluation calls the "after" report as an uninterrupted run's end
    does: with the held-out QA given to train() (the CLI's RunReport re-answers them; it got None), the closing loss
    and the result. Its "before" loss comes from a "before" record only: with that record gone it is None, not the
    loss of step 1's interval evaluation."""
    import json

    from chronicals.train import train

    from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model

    docs = synthetic_docs(40, seed=1)
    ev = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    train(tiny_config(tmp_path, train__max_steps=2, eval__every=1), model=tiny_model(),
          train_loader=SyntheticLoader(docs), eval_loader=ev())
    path = tmp_path / "run" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("tag") for r in recs if r.get("kind") == "eval"] == ["before", "interval", "after"]
    # the "before" record gone (as after an own resume without metrics.jsonl), and stopped before the "after" one
    path.write_text("".join(json.dumps(r) + "\n" for r in recs if r.get("tag") not in ("before", "after")))
    calls = []
    res = train(tiny_config(tmp_path, train__max_steps=2, eval__every=1, train__resume="auto"), model=tiny_model(),
                train_loader=SyntheticLoader(docs), eval_loader=ev(), heldout_qa=HELD,
                report=lambda event, **info: calls.append((event, info)))
    assert [event for event, _ in calls] == ["after"]
    info = calls[0][1]
    assert info["heldout_qa"] is HELD and info["result"] is res
    assert info["eval_loss"] == res.eval_loss_after is not None
    assert res.eval_loss_before is None

