"""The numbers of `chronicals train`'s closing summary (train/report.py): eval.qa_limit, before and after told apart,
"resumed" only for a resumed run, and the system message the held-out questions are asked with."""

from __future__ import annotations

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
