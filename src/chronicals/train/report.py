"""What ``chronicals train`` prints around training: held-out answers and loss before/after, the summary.

With held-out QA records (the demo's heldout.jsonl) the model answers each question greedily before
and after training; an answer is right when it contains all of its keywords.
"""

from __future__ import annotations

import textwrap
import time

from .._words import counted
from ..config import TrainConfig
from .metrics import rate_text
from .qa import QAResult, answer_all, heldout_system_prompt


class RunReport:
    """The ``report`` callback of ``train``: collects and prints the before/after evaluation."""

    def __init__(self, cfg: TrainConfig, out=print):
        self.cfg, self.out = cfg, out
        self.before: QAResult | None = None
        self.after: QAResult | None = None
        self.qa: list[dict] | None = None
        self.loss = {}
        self.t_start = time.perf_counter()

    def _answer(self, model, tokenizer, heldout_qa):
        if not (self.cfg.eval.qa and heldout_qa and tokenizer is not None):
            return None
        qa = heldout_qa[: self.cfg.eval.qa_limit] if self.cfg.eval.qa_limit else heldout_qa
        self.qa = qa
        t0 = time.perf_counter()
        res = answer_all(model, tokenizer, qa, heldout_system_prompt(self.cfg.data), self.cfg.eval.max_new_tokens)
        self.out(f"  answered {counted(len(qa), 'held-out question')} in {time.perf_counter() - t0:.1f} s: "
                 f"{sum(res.correct)}/{len(qa)} contain their keywords")
        return res

    def __call__(self, event: str, *, model, tokenizer, eval_loss, heldout_qa, result=None):
        self.loss[event] = eval_loss
        if eval_loss is None and not (self.cfg.eval.qa and heldout_qa and tokenizer is not None):
            return  # nothing held out: no empty "== before training ==" header
        self.out(f"== {event} training ==")
        if eval_loss is not None:
            self.out(f"  held-out loss {eval_loss:.4f}")
        answers = self._answer(model, tokenizer, heldout_qa)
        if event == "before":
            self.before = answers
        else:
            self.after = answers

    def summary(self, result) -> str:
        lines = []
        if self.qa and self.after is not None:
            lines.append("held-out questions (greedy answers before -> after; [x] = contains the keywords):")
            for i, rec in enumerate(self.qa):
                lines.append(f"Q: {rec['question']}   (keywords: {', '.join(rec.get('keywords', []))})")
                if self.before is not None:
                    lines.append(_fmt("before", self.before.answers[i], self.before.correct[i]))
                lines.append(_fmt("after ", self.after.answers[i], self.after.correct[i]))
        lines.append("== summary ==")
        b, a = self.loss.get("before"), self.loss.get("after")
        b = result.eval_loss_before if b is None else b  # a resumed run: the first run's, from metrics.jsonl
        if a is not None:
            lines.append(f"held-out loss: {b:.4f} -> {a:.4f}" if b is not None else f"held-out loss: {a:.4f}")
        if self.after is not None:
            frac_b = f"{self.before.fraction:.0%} ({sum(self.before.correct)}/{len(self.qa)})" if self.before else "-"
            lines.append(f"held-out answers with their keywords: {frac_b} -> "
                         f"{self.after.fraction:.0%} ({sum(self.after.correct)}/{len(self.qa)})")
        st = result.data_stats
        if st is not None:  # what the data lost on the way in, where the log may have scrolled away
            lost = st.losses()
            lines.append(f"training data: {counted(st.documents, 'example')} of {counted(st.records, 'record')}"
                         + (f" ({', '.join(lost)})" if lost else ""))
        ran = result.step - result.start_step
        steps = counted(ran, "step") + (
            f" (resumed at step {result.start_step}, now at {result.step} of {result.total_steps})"
            if result.start_step else "")
        warm = "" if not result.tokens_per_s_after_first else (
            f" ({rate_text(result.tokens_per_s_after_first)} after the first step, which took "
            f"{result.first_step_seconds:.1f} s with its one-time warm-up)")
        lines.append(f"training: {steps} in {result.train_seconds:.1f} s, {rate_text(result.tokens_per_s)} loss "
                     f"tokens/s{warm}; total wall time {time.perf_counter() - self.t_start:.0f} s")
        out = result.out_dir
        if result.final_dir is not None:
            kind = "adapter (PEFT format)" if self.cfg.lora.enabled else "model (Hugging Face format)"
            lines.append(f"{kind}: {result.final_dir}")
        if result.checkpoint is not None:
            lines.append(f"resumable checkpoint (weights + optimizer state; train.max_steps higher and "
                         f"train.resume=auto train on from it; a new run here sets train.resume=none): {result.checkpoint}")
        lines.append(f"metrics: {out / 'metrics.jsonl'}   config: {out / 'config.yaml'}")
        if result.plot is not None:
            lines.append(f"loss curve: {result.plot}")
        return "\n".join(lines)


def _fmt(tag: str, ans: str, ok: bool) -> str:
    one_line = " ".join(ans.split())
    return f"  {tag} [{'x' if ok else ' '}] " + textwrap.shorten(one_line, width=110, placeholder=" ...")
