"""The numbers of `chronicals train`'s closing summary (train/report.py): eval.qa_limit, before and after told apart,
"resumed" only for a resumed run, and the system message the held-out questions are asked with."""

from __future__ import annotations

import pytest

from chronicals.config import from_dict
from chronicals.train.finish import TrainResult
from chronicals.train.qa import QAResult


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
    res = TrainResult(status="completed", step=3, total_steps=3, out_dir=tmp_path, train_seconds=1.0, tokens_per_s=10.0)
    text = rep.summary(res)
    assert text.count("Q: ") == 2
    assert "held-out answers with their keywords: 0% (0/2) -> 100% (2/2)" in text
    assert text.count("  before [ ] answer 1") == 2 and text.count("  after  [x] answer 2") == 2
    assert "training: 3 steps in 1.0 s" in text and "resumed" not in text


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
