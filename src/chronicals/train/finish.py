"""The end of a run: its TrainResult, the final adapter or model directory, and a resume that finds the run's
last step already done (nothing to train; its closing evaluation runs if a signal stopped it before)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .._words import counted
from ..config import TrainConfig
from . import checkpoint as ckpt
from .distributed import DistContext
from .guards import final_dir
from .metrics import MetricsLog, plot_losses, rate_text, read_records
from .step import evaluate_loss

log = logging.getLogger("chronicals.train")


@dataclass
class TrainResult:
    status: str  # "completed" | "interrupted"
    step: int  # optimizer steps done
    total_steps: int
    out_dir: Path
    final_dir: Path | None = None  # adapter (LoRA) or HF model (full) directory
    checkpoint: Path | None = None  # last resumable checkpoint written
    start_step: int = 0  # the step this process began at (> 0 after a resume)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    last_loss: float | None = None
    tokens_per_s: float = 0.0  # loss tokens per second of training steps (eval excluded)
    train_seconds: float = 0.0
    first_step_seconds: float = 0.0  # this process's first step, one-time warm-up included (10.5 of the demo's
    # 10.8 s of training on an H100: Triton autotuning, compiling, the CUDA-graph capture)
    tokens_per_s_after_first: float = 0.0  # loss tokens per second of the steps after it (0: fewer than 2 steps)
    plot: Path | None = None
    data_stats: object | None = None  # the training set's DatasetStats (records kept, skipped, cut), if known


def closing_line(result: TrainResult) -> str:
    """What a completed run did and where its outputs went, in one log line: ``train()`` called without the CLI's
    ``report`` (whose printout says it at length) logged its steps and "saved DIR", and neither its held-out loss
    before and after nor where metrics.jsonl and loss.png went.

        done: 22 steps in 1350.5 s, 4.67 loss tokens/s; held-out loss 2.0026 -> 0.0114; adapter: runs/x/adapter;
        metrics: runs/x/metrics.jsonl; loss curve: runs/x/loss.png
    """
    ran = result.step - result.start_step
    parts = [f"done: {counted(ran, 'step')} in {result.train_seconds:.1f} s, {rate_text(result.tokens_per_s)} loss "
             f"tokens/s" + (f" (resumed at step {result.start_step})" if result.start_step else "")]
    b, a = result.eval_loss_before, result.eval_loss_after
    if a is not None:
        parts.append(f"held-out loss {b:.4f} -> {a:.4f}" if b is not None else f"held-out loss {a:.4f}")
    if result.final_dir is not None:
        parts.append(f"{result.final_dir.name}: {result.final_dir}")  # adapter/ (LoRA) or model/ (full)
    parts.append(f"metrics: {result.out_dir / 'metrics.jsonl'}")
    if result.plot is not None:
        parts.append(f"loss curve: {result.plot}")
    return "; ".join(parts)


def before_loss(records: list[dict]) -> float | None:
    """The held-out loss of the run's "before" evaluation in its metrics records (None: there is none)."""
    return next((r.get("eval_loss") for r in records if r.get("kind") == "eval" and r.get("tag") == "before"), None)


def _already_done(cfg: TrainConfig, dp: DistContext, out_dir: Path, model, tokenizer, checkpoint: Path,
                  total: int, closing: tuple, optimizer=None, changed: list[str] = ()) -> TrainResult:
    """resume found the run's last step: nothing to train, nothing logged again; the final directory is written
    from the checkpoint's weights, also when one is there: it may be an earlier run's (this one ran with
    train.save_final=false, or stopped between its last checkpoint and its final save), and was returned as this
    run's. A run stopped by a signal during its last step checkpointed that step but never ran its closing
    evaluation: it runs now (its "after" record, the result's held-out losses, the "after" report), as the
    uninterrupted run's end would have. ``closing``: (eval loader, held-out QA records, report callback).
    ``changed``: this run's settings that differ from the checkpoint's (resume.setting_diffs), said with the
    warning: with no step left they change nothing (a new optim.lr exited 0 without a word)."""
    eval_loader, heldout_qa, report = closing
    closing_due = (dp.is_main and eval_loader is not None and ckpt.is_own(checkpoint, out_dir)
                   and not _closed(out_dir, total))
    if dp.enabled:  # rank 0's finding, for every rank: each scores its share of the held-out set (collectives)
        closing_due = bool(dp.all_reduce_flag(closing_due))
    final = final_dir(cfg, out_dir)
    left = (["its closing evaluation"] if closing_due else []) + (
        [f"its final {final.name}"] if cfg.train.save_final and dp.is_main and not final.is_dir() else [])
    if left:  # a stop in the closing evaluation or the final save: this rerun completes the run, as the stop said
        log.info("%s is this run's last step (%d of %d): the run stopped before its end; finishing it: %s",
                 checkpoint, total, total, ", ".join(left))
    elif changed:
        log.warning("%s is this run's last step (%d of %d): nothing to train, so this run's other settings than the "
                    "checkpoint's change nothing: %s; raise train.max_steps to train on under them, or set "
                    "train.resume=none to start over with them", checkpoint, total, total, ", ".join(changed))
    else:
        log.warning("%s is this run's last step (%d of %d): nothing to train; raise train.max_steps to train on, or "
                    "set train.resume=none to start over", checkpoint, total, total)
    result = TrainResult(status="completed", step=total, total_steps=total, out_dir=out_dir, checkpoint=checkpoint,
                         start_step=total)
    if closing_due:
        loss, n = evaluate_loss(model, eval_loader, dp.device, dp=dp)
        result.eval_loss_after = loss
    if closing_due and dp.is_main:
        metrics = MetricsLog(out_dir, cfg.logging.tensorboard, total)  # out_dir's records up to its last step
        result.eval_loss_before = before_loss(metrics.records)
        metrics.write({"kind": "eval", "step": total, "eval_loss": loss, "eval_tokens": n, "tag": "after"})
        metrics.close()
        log.info("%s: the run was stopped after its last step, before its closing evaluation; its closing held-out "
                 "loss %.4f is logged now",
                 checkpoint, loss)
        if cfg.logging.plot:
            result.plot = plot_losses(metrics.records, out_dir / "loss.png")
    if closing_due and dp.enabled:  # rank 0 read it from metrics.jsonl: every rank returns rank 0's value
        result.eval_loss_before = dp.all_gather_object(result.eval_loss_before)[0]
    plot, records = out_dir / "loss.png", out_dir / "metrics.jsonl"
    if cfg.logging.plot and dp.is_main and result.plot is None and records.is_file():
        # the run ended between its last step and the curve (a failed or killed final save, a signal): draw it now,
        # as the uninterrupted run did; one that is there is the run's own
        result.plot = plot if plot.is_file() else plot_losses(read_records(records, total), plot)
    if cfg.train.save_final and dp.is_main:
        result.final_dir = save_final(model, tokenizer, cfg, out_dir, optimizer)
    if report and result.eval_loss_after is not None:
        report("after", model=model, tokenizer=tokenizer, eval_loss=result.eval_loss_after, heldout_qa=heldout_qa,
               result=result)
    return result


def _closed(out_dir: Path, total: int) -> bool:
    """out_dir's metrics.jsonl holds the closing ("after") evaluation of step ``total``; an unreadable file counts as
    closed (nothing is rewritten over it)."""
    try:
        return any(r.get("tag") == "after" and r.get("step") == total
                   for r in read_records(out_dir / "metrics.jsonl", total))
    except (OSError, ValueError):
        return True


def save_final(model, tokenizer, cfg: TrainConfig, out_dir: Path, optimizer=None) -> Path:
    """LoRA: a PEFT adapter directory (out_dir/adapter); full: a Hugging Face directory (out_dir/model).

    bf16 adapters trained with fp32 masters (``optim.master_weights``) are written as the masters, fp32, as PEFT
    keeps adapters: the bf16 weights are them rounded, and an update below half a bf16 step lives only in the
    master. A full model is written in its own dtype (an fp32 copy of a bf16 model would double its size)."""
    path = final_dir(cfg, out_dir)
    if cfg.lora.enabled:
        from ..lora import save_adapter

        master = getattr(optimizer, "master", None)
        save_adapter(model, path, base_model_name_or_path=getattr(model, "chronicals_base", None), value=master)
    else:
        from .. import save_model

        save_model(model, tokenizer, path)
    log.info("saved %s", path)
    return path
