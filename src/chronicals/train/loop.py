"""The training loop: setup -> train -> save, in one function.

    from chronicals.config import load_config
    from chronicals.train import train
    result = train(load_config("configs/smollm2-135m/lora.yaml", ["train.max_steps=50"]))

Tests and callers may pass a ready model/tokenizer and loaders (anything iterating ``PackedBatch``es
with ``len``, ``state_dict`` and ``load_state_dict``), and an ``on_step(step, record)`` callback.

Data parallel under ``torchrun`` (WORLD_SIZE > 1; see ``train.distributed``): every rank runs this
function on its own shard of the batches (a passed train loader must already be this rank's shard) with
the exact all-ranks gradient; rank 0 alone writes config.yaml, metrics, the progress bar, checkpoints,
the final adapter/model and the plot; every rank evaluates the whole held-out set.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DEMO, TrainConfig, from_dict, load_config
from .._jsonio import write_text_atomic
from .._words import counted
from ..cuda_alloc import allocator_setting
from ..models.loading import recorded_name
from . import checkpoint as ckpt
from .checkpoint_adapter import lora_settings
from .divergence import TrainingDiverged, _check_finite, nonfinite_weights
from .finish import TrainResult, _already_done, before_loss, closing_line, save_final
from .metrics import (head_flops_per_token, matmul_peak_tflops, memory_gib, plot_losses, private_pool_bytes,
                      rate_text, train_flops_per_token)
from .optim import build_optimizer, build_scheduler, set_total_steps, warn_short_warmup
from .console import run_console
from .distributed import DistContext, init_distributed, main_rank_tells, rank_seed, shared_settings
from .grad_buckets import GradBuckets
from .graphs import GraphedStep, resolve_cuda_graphs
from .setup import (build_loaders, check_config_fits, load_base, load_base_tokenizer, ready_model, record_passed_model,
                    resolve_dtype)
from .readback import StepReadback, StepStart
from .guards import (check_cuda_graphs, check_data_paths, check_document_lengths, check_final_dir, check_impl,
                     check_max_seq_len, check_out_dir, check_resume_path, check_token_ids, remove_setup_files)
from .resume import (apply_optimizer_settings, base_fingerprint, check_resume_adapter, check_same_adapter,
                     optimizer_settings, refuse_other_adapter, setting_diffs, warn_data_changed,
                     warn_loss_settings_changed)
from .run_dir import EarlierFiles, _locked_out_dir, _metrics_log, _RanksMetrics, config_yaml, recorded
from .stop import StopFlag
from .step import accumulate_data_parallel, clip_grad_norm, evaluate_loss
from .stream import _replan, _restore_position, _spread, _step_plan, _Stream, cut_fraction

log = logging.getLogger("chronicals.train")


@dataclass
class _Pending:
    """An optimizer step whose scalars (loss, grad norm, loss tokens, the ranks' stop flag) are still on the way."""

    step: int
    lr: float
    readback: StepReadback
    computed: int  # tokens computed on this rank (padding included): MFU's numerator
    own_loss: int = 0  # this rank's loss tokens: the loss head's FLOPs in MFU's numerator


@dataclass
class _LoopState:
    train_time: float = 0.0
    loss_tokens: int = 0
    first_step_s: float = 0.0  # this process's first step: its one-time warm-up (autotuning, compiling, capture)
    first_loss_tokens: int = 0
    others_stop: bool = False  # data parallel: some rank got a signal (the all-ranks max of the flags)
    saves: int = 0  # checkpoints taken


def train(config: TrainConfig | dict | str | Path, *, model=None, tokenizer=None, train_loader=None, eval_loader=None,
          heldout_qa=None, on_step=None, report=None) -> TrainResult:
    """Run the training described by ``config``; see the module docstring. Returns a TrainResult.

    ``config``: a TrainConfig, a nested dict of sections, or a YAML path.
    ``report(event, **info)`` (optional) receives "before" / "after" evaluation events (the demo prints them).
    A passed ``model`` is trained in place and stays as training left it: moved to model.device / model.dtype,
    with ``lora.enabled`` its LoRA adapters injected (a model that already has them keeps them: a lora.rank, alpha,
    dropout, rslora or targets set away from its default must then be theirs, else a ConfigError; one left at its
    default gives way to theirs, with a warning) and the rest frozen, in training mode.
    A passed model needs ``tokenizer`` too, unless ``train_loader`` gives the batches. ``merge_lora`` turns it back
    into plain linear layers.
    """
    # Path(123)'s own words named no fix, and None trained the demo into runs/demo
    if not isinstance(config, (TrainConfig, dict, str, os.PathLike)):
        raise TypeError(f"train(config): expected a TrainConfig, a dict of sections ({{'optim': {{'lr': 0.0001}}}}) or "
                        f"a YAML file's path, got {type(config).__name__} {config!r:.80}; TrainConfig() is the demo's "
                        "settings, chronicals.config.load_config(path, ['key=value']) a file with overrides")
    if model is not None and tokenizer is None and train_loader is None:  # before anything is made or changed
        raise TypeError("train(config, model=...) needs tokenizer=... too, to tokenize data.path (the model's own, "
                        "e.g. from chronicals.load_model(path, tokenizer=True)), or train_loader=... with the "
                        "batches ready")
    # a script that set up no logging sees the progress and the summary too; under torchrun, each warning once
    # (rank 0's), not once per rank
    with run_console(), main_rank_tells():
        if isinstance(config, TrainConfig):  # checked again: a TrainConfig changed after it was built (grad_accum = 0
            cfg = from_dict(config.to_dict())  # gave a ZeroDivisionError deep in the loop, not the config's error)
        elif isinstance(config, dict):
            cfg = from_dict(config)
        else:
            cfg = load_config(config)
        cfg = record_passed_model(cfg, model)
        check_out_dir(cfg)
        check_resume_path(cfg)
        if train_loader is None:
            check_data_paths(cfg)  # before minutes of model loading, not after
        out_dir = Path(cfg.train.out_dir).expanduser()
        dp = init_distributed(cfg.model.device)
        try:
            if dp.enabled:  # before any collective that other settings would mismatch (a crash) or train apart
                dp.check_same(shared_settings(cfg), "every rank must run the same config (the same YAML file and "
                              "key=value arguments); only paths, model.device, data.num_proc and logging may differ")
            # any rank's view: without the collective, rank 1's mkdir could come before rank 0's look, and a setup that
            # failed would leave the new, empty out_dir behind as "already there"
            created = bool(dp.all_reduce_flag(not out_dir.is_dir()))
            new_parents = [d for d in out_dir.absolute().parents if not d.exists()]  # deepest first
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # was a bare "[Errno 2] No such file or directory: '/proc/x'"
                raise OSError(f"train.out_dir={cfg.train.out_dir}: cannot create it ({e.strerror or e}); set "
                              "train.out_dir to a folder you can write") from e
            with _locked_out_dir(out_dir, dp):
                # after the lock: another run's files are not ours
                existed = None if created else set(out_dir.iterdir())
                random.seed(cfg.train.seed)
                torch.manual_seed(cfg.train.seed)  # the same seed on every rank: one checkpoint fits all
                phase = _Phase()
                try:
                    result = _train(cfg, dp, out_dir, model, tokenizer, train_loader, eval_loader, heldout_qa, on_step,
                                    report, phase)
                    dp.barrier()  # no rank returns (and tears the group down) while rank 0 still writes the final files
                    if report is None and dp.is_main and result.status == "completed":  # the CLI's report prints it
                        log.info("%s", closing_line(result))
                    return result
                except BaseException:
                    if dp.is_main and not phase.training:
                        remove_setup_files(out_dir, existed, new_parents)
                    raise
        finally:
            dp.destroy()


@dataclass
class _Phase:
    training: bool = False  # set when the first step starts: from then on out_dir holds this run's record


def _train(cfg: TrainConfig, dp: DistContext, out_dir: Path, model, tokenizer, train_loader, eval_loader,
           heldout_qa, on_step, report, phase: _Phase) -> TrainResult:
    # ---- setup ----
    if cfg.train.save_final:  # refused now rather than after the training it would hold
        check_final_dir(cfg, out_dir)
    device = dp.device
    check_cuda_graphs(cfg, device)
    check_impl(cfg, device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_resume_adapter(cfg, out_dir)  # a LoRA resume under other adapter settings: before the load, not after
    passed = model is not None
    if passed:  # its checks are cheap: said before the data is read
        if getattr(model, "chronicals_base", None) is None:
            log.info("a model passed to train(): its adapter records no base model (model.path=%s is not what was "
                     "trained); set model.chronicals_base = its path or name to record one", cfg.model.path)
        model = ready_model(cfg, model, device, dtype)
        model_config = getattr(model, "config", None)
    else:
        # rank 0 first: a bad model path or tokenizer is said once; a .gguf not yet converted is read from each
        # rank's own weightless conversion (models.loading.tokenizer_and_config), its cache entry filled below
        with dp.main_first():
            tokenizer, model_config = load_base_tokenizer(cfg)
    check_max_seq_len(cfg, model_config)
    # what prepare_model refuses of the config alone (LoRA names, ...), said before the data too, on the decoder
    # built on the meta device (no weights); a passed model was prepared above
    shape = model if passed else check_config_fits(cfg, model_config)
    built = train_loader is None
    if built:
        # before the weights load (seconds for the embedded model, minutes at 8B): a bad record is said first
        with dp.main_first():  # rank 0 writes out_dir/data and the tokenization cache; the others reuse them
            train_loader, eval_loader, heldout_qa = build_loaders(cfg, tokenizer, out_dir, dp.rank, dp.world_size)
        # the data against the model's config (its vocabulary, a sliding window): before the weights load too
        check_token_ids(shape, train_loader, eval_loader)
        check_document_lengths(shape, train_loader, eval_loader)  # before step 1, not when a batch draws one
    if not passed:
        # rank 0 first: an error of its (a bad weights file) is every rank's, said once; it fills the GGUF conversion
        # cache, which the others then read
        with dp.main_first():
            model = load_base(cfg, device, dtype)
        model.chronicals_base = recorded_name(cfg.model.path)  # absolute when a path: chat/export find it anywhere
        model = ready_model(cfg, model, device, dtype)
    if not built and getattr(train_loader, "world_size", dp.world_size) != dp.world_size:
        raise ValueError(f"train_loader has world_size={train_loader.world_size} but the job runs "
                         f"{dp.world_size} ranks; build it with PackedLoader(rank=RANK, world_size=WORLD_SIZE)")
    if getattr(eval_loader, "world_size", 1) not in (1, dp.world_size):  # scored in part, silently
        raise ValueError(f"eval_loader has world_size={eval_loader.world_size} but the job runs {dp.world_size} "
                         "ranks; pass the held-out loader unsharded (each rank scores its share) or built with "
                         "PackedLoader(rank=RANK, world_size=WORLD_SIZE)")
    trainable = [p for p in model.parameters() if p.requires_grad]
    dp.broadcast_params(trainable)  # rank 0's values everywhere, even if an init differed between ranks
    total, last_batches = _step_plan(cfg, len(train_loader), spread=_spread(train_loader))
    cut_fraction(cfg, train_loader)  # a fractional epoch's last pass: the global batches one process would train
    optimizer = build_optimizer(model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, total, warn=False)  # said below, for the length after a resume
    scheduled = total
    stream = _Stream(train_loader)
    graphs = None
    use_graphs, why = resolve_cuda_graphs(cfg.train.cuda_graphs, device, cfg.model.checkpoint_setting, dp.world_size)
    log.info("%s", why)
    if device.type == "cuda":  # the chronicals CLI sets expandable segments unless the variable was set (cuda_alloc)
        log.info("CUDA allocator: %s", allocator_setting())
    # data parallel: the gradient all-reduce after backward, or (train.overlap_grad_reduce) in flat buckets during
    # the last micro-batch's backward (train/grad_buckets.py)
    reducer = GradBuckets(dp, trainable) if dp.enabled and cfg.train.overlap_grad_reduce else None
    if cfg.train.overlap_grad_reduce and not dp.enabled:
        log.warning("train.overlap_grad_reduce=true does nothing in one process: it overlaps data parallel's "
                    "gradient all-reduce with backward (torchrun --nproc-per-node N); drop it")
    if cfg.eval.every and eval_loader is None:
        log.warning("eval.every=%d does nothing: the run has no held-out data (data.eval_path=%r%s); set "
                    "data.eval_path to a held-out file, or drop eval.every", cfg.eval.every, cfg.data.eval_path,
                    ": auto is none beside your own data.path" if cfg.data.eval_path == "auto" and cfg.data.path != DEMO
                    else "")
    if dp.enabled:
        log.info("data parallel: gradient all-reduce %s", "overlapped with backward (train.overlap_grad_reduce)"
                 if reducer else "after backward")
    if use_graphs:  # captured at the first step (after any resume); raises off CUDA
        graphs = GraphedStep(model, device, params=trainable, reducer=reducer)
    if dp.rank > 0:  # setup drew alike on every rank; training draws (LoRA dropout) now differ per rank
        torch.manual_seed(rank_seed(cfg.train.seed, dp.rank))

    start, done = 0, False  # done: resumed at the run's last step
    base = base_fingerprint(model)  # of the model trained on: its architecture, weight file sizes and samples
    # stored in checkpoints, relative paths made absolute (as config.yaml); a resume compares it with the one there
    cfg_dict = recorded(cfg).to_dict()
    resume_from = None
    if cfg.train.resume == "auto":
        resume_from = ckpt.latest_checkpoint(out_dir)
    elif cfg.train.resume != "none":
        resume_from = Path(cfg.train.resume).expanduser()
    if resume_from is not None:
        fresh = optimizer_settings(optimizer, scheduler)
        check_resume_adapter(cfg, out_dir, now=lora_settings(model))  # the modules each run adapted, by name
        restored = ckpt.load_checkpoint(resume_from, model, optimizer, scheduler, config=cfg_dict,
                                        auto=cfg.train.resume == "auto")
        saved = restored["extra"].get("config")
        _restore_position(stream, restored, cfg_dict, resume_from)  # a refusal names the data keys changed
        total, last_batches = _replan(cfg, stream, restored["step"], total, last_batches, resume_from)
        if total != scheduled:
            set_total_steps(scheduler, cfg, total)
        rank_rng = restored["extra"].get("rank_rng")
        if dp.enabled and isinstance(rank_rng, list) and len(rank_rng) == dp.world_size:
            ckpt.set_rng_state(rank_rng[dp.rank])  # load_checkpoint set rank 0's
        elif dp.rank > 0:  # written by one process or another number of ranks: rank 0's state is on every rank;
            # the step too, so rank r does not draw its masks of a fresh run's first steps again
            torch.manual_seed(rank_seed(cfg.train.seed + restored["step"], dp.rank))
        start = restored["step"]
        if start > total:
            raise ValueError(f"{resume_from} is at step {start}, past this run's {counted(total, 'step')}; raise "
                             "train.max_steps (or train.epochs), or set train.resume=none to start over")
        adapters = dict(records=(restored["extra"].get("lora"), lora_settings(model)),
                        bases=(restored["extra"].get("base_fingerprint"), base))
        refuse_other_adapter(saved, cfg_dict, resume_from, **adapters)
        # said once nothing above refuses the resume (it was said before a refusal, and warnings with it)
        log.info("resumed from %s at step %d of %d", resume_from, start, total)
        warn_data_changed(saved, cfg_dict, resume_from)  # a loader that took the position under other keys
        warn_loss_settings_changed(saved, cfg_dict, resume_from)  # the same batches, other loss tokens
        check_same_adapter(saved, cfg_dict, resume_from, **adapters)
        apply_optimizer_settings(optimizer, scheduler, fresh, saved, cfg_dict, start, total)
        done = start == total
    warn_short_warmup(cfg, total)
    if dp.enabled:  # each rank found its own checkpoint and read its own data: they must be the same
        data = getattr(stream.loader, "dataset", None)
        held = getattr(eval_loader, "dataset", None)  # its pass is a series of collectives: other held-out sets
        dp.check_same({"first step": start, "steps": total, "data": getattr(data, "digest", None),  # mixed, or hung
                       "batches an epoch": len(stream.loader) if hasattr(stream.loader, "__len__") else None,
                       "held-out data": getattr(held, "digest", None),
                       "held-out batches": len(eval_loader) if hasattr(eval_loader, "__len__") else None},
                      "every rank must read the same train.out_dir (its checkpoints) and data files: on several "
                      "nodes, put them on a file system all of them share")
    # what out_dir holds of a history this run does not continue: removed once it writes its first record or
    # checkpoint, so a run that fails in setup leaves them (run_dir.EarlierFiles)
    earlier = EarlierFiles.find(cfg, out_dir, resume_from, start, dp.is_main)

    def first_record() -> None:
        write_text_atomic(out_dir / "config.yaml", config_yaml(cfg))  # chat / eval / export read it: never half
        earlier.forget()

    if dp.is_main:  # config.yaml and metrics.jsonl change only once this run writes its first record
        metrics = _metrics_log(cfg, out_dir, resume_from, start, first_record)
    else:
        metrics = _RanksMetrics()
    # the report (the CLI's held-out answers and printout) is rank 0's, in a rerun that only closes the run too
    report = report if dp.is_main else None
    if done:  # nothing to train. From another run's last checkpoint, out_dir becomes that run's record as a run
        # that trained would make it: its records, this config.yaml, no earlier run's files
        if dp.is_main and not ckpt.is_own(resume_from, out_dir):
            metrics.open()
        metrics.close()
        return _already_done(cfg, dp, out_dir, model, tokenizer, resume_from, total,
                             (eval_loader, heldout_qa, report), optimizer, setting_diffs(saved, cfg_dict))

    # rank 0 writes; periodic checkpoints in a background thread (train.async_save), waited for at a stop, at the
    # end and before an error names the last good one
    writer = ckpt.CheckpointWriter(background=cfg.train.async_save and dp.is_main)
    lora_record = lora_settings(model)
    state = _LoopState()

    def save(step: int, wait: bool = False) -> Path:
        state.saves += 1  # on every rank (the barriers below must pair)
        # config: names what differs if a resume does not fit; base and lora: what was trained, for the checkpoint
        # used as an adapter (train/checkpoint_adapter.py): a relative model.path, or a model passed in, differ
        extra = {"config": cfg_dict, "base": getattr(model, "chronicals_base", None), "lora": lora_record,
                 "base_fingerprint": base}
        if dp.enabled:  # each rank's RNG: LoRA dropout masks of unequal batch shapes advance them apart
            extra["rank_rng"] = dp.gather_object(ckpt.rng_state())
        if dp.is_main:
            earlier.forget()  # before pruning by step can meet them
            writer.save(out_dir, step, model, optimizer, scheduler, stream.state_dict(), keep_last=cfg.train.keep_last,
                        extra=extra)
            if wait:
                writer.wait()
        dp.barrier()  # no rank runs ahead of a checkpoint being taken (with wait: written)
        return ckpt.checkpoint_path(out_dir, step) if dp.is_main else ckpt.latest_checkpoint(out_dir)

    def last_good() -> Path | None:
        """The newest complete checkpoint, after any write in flight (for the TrainingDiverged message)."""
        if writer.busy:  # a second Ctrl-C lands here during the stop's write: say why the exit waits
            log.warning("waiting for the checkpoint being written to finish")
        try:
            writer.wait()
        except OSError as e:
            log.error("the checkpoint being written failed: %s", e)
        return ckpt.latest_checkpoint(out_dir)
    result = TrainResult(status="completed", step=start, total_steps=total, out_dir=out_dir, start_step=start)
    result.data_stats = getattr(getattr(train_loader, "dataset", None), "stats", None)
    if start:  # the held-out loss before training, from the run that began it (summary: before -> after)
        # rank 0 read metrics.jsonl; the other ranks hold no records: every rank returns rank 0's value (start is
        # the same on every rank, checked above, so all of them reach this collective)
        result.eval_loss_before = dp.all_gather_object(before_loss(metrics.records))[0]

    # MFU: needs a peak (logging.peak_tflops, else measured on CUDA); LoRA has no weight-gradient GEMMs
    peak = cfg.logging.peak_tflops or matmul_peak_tflops(device)
    method = "lora" if cfg.lora.enabled else "full"
    flops_per_token = train_flops_per_token(model.config, cfg.data.max_seq_len, method)
    head_flops = head_flops_per_token(model.config, method)  # per loss token: the head runs on those rows only

    def eval_record(step: int, tag: str) -> dict | None:
        if eval_loader is None:
            return None
        # a stop signal during an interval evaluation abandons it: the finished step is checkpointed at once (it
        # waited for the whole held-out pass, 51 s against 0.3 s steps in a concurrency walk, past a supervisor's
        # grace period); the "before" and "after" passes run outside the signal flag and stop at once. Under data
        # parallelism each rank evaluates its share of the batches, and a signal to any rank stops them all
        signalled = (lambda: stop.signum is not None) if tag == "interval" else None
        loss, n = evaluate_loss(model, eval_loader, device, stop=signalled, dp=dp)
        if loss is None:
            log.warning("held-out evaluation of step %d stopped after %s for the signal; no record of it",
                        step, counted(n, "loss token"))
            state.others_stop = True  # the ranks agreed on it: the pipelined loop reads its flags a step later
            return None
        return {"kind": "eval", "step": step, "eval_loss": loss, "eval_tokens": n, "tag": tag}

    def close_diverged() -> None:
        """metrics.jsonl closed and, for a run that diverged, its loss curve drawn: the climb to the NaN is the
        curve its user wants to see."""
        metrics.close()
        if cfg.logging.plot and dp.is_main:
            plot_losses(metrics.records, out_dir / "loss.png")

    def run_eval(step: int, tag: str) -> float | None:
        record = eval_record(step, tag)
        if record is None:
            return None
        loss = record["eval_loss"]
        metrics.write(record)
        if tag != "before" and not math.isfinite(loss):  # the guard checks each step before its update: the last
            # one's (or one before an interval evaluation) was never checked, and a ruined model exited 0 "completed"
            bad = nonfinite_weights(model)
            weights = (f"not finite ({counted(len(bad), 'tensor')}, e.g. {bad[0]})" if bad else
                       "finite, but give a non-finite loss")
            raise TrainingDiverged(
                f"held-out loss is {loss} after step {step}: the weights there are {weights}"
                f"; the final {'adapter' if cfg.lora.enabled else 'model'} is not written. Checkpoints from step "
                f"{step} on hold these weights: resume from an earlier one (train.resume=PATH) with a lower optim.lr "
                "or a longer schedule.warmup_steps, or start over (train.resume=none)")
        if tag == "interval" and dp.is_main:
            log.info("step %d/%d: held-out loss %.4f", step, total, loss)
        return loss

    # written when the first step starts: a run stopped in its "before" report leaves an earlier run's checkpoints,
    # config.yaml and metrics.jsonl as they were
    before = None
    if start == 0:
        before = eval_record(0, "before")
        result.eval_loss_before = before["eval_loss"] if before else None
        if report:
            report("before", model=model, tokenizer=tokenizer, eval_loss=result.eval_loss_before,
                   heldout_qa=heldout_qa)
        elif dp.is_main and result.eval_loss_before is not None:  # train() from a script: the log says it
            log.info("held-out loss before training: %.4f", result.eval_loss_before)

    # ---- train ----
    phase.training = True
    if before:
        metrics.write(before)  # this run's first record: config.yaml and the other run's checkpoints go now
    # Pipelined (fused AdamW, no on_step): step k's loss, gradient norm and token count are read on the host while
    # step k+1's forward/backward runs (train/readback.py: the per-step reads cost 2.5-2.8% at the 0.5B protocol);
    # a non-finite step's update is skipped on the device (fused AdamW's found_inf) and the stop is raised
    # before the next update. Otherwise (the CPU default, or an on_step callback, which sees each step as it
    # ends) every step is read before its update, as a host sync.
    pipelined = bool(optimizer.defaults.get("fused")) and on_step is None
    log.info("step metrics: %s", "read one step late, once the next step is queued (a non-finite step's update is "
             "skipped by the fused optimizer)" if pipelined else "read every step before the update (a host sync "
             "per step)")
    bar = None  # drawn after the lines above: a log line outside the redirect below prints on the bar's line
    # a terminal gets a progress bar; a log file (CI, nohup, a pipe) a plain line every ~5% of the run instead of
    # one carriage-return update per step
    log_every = 0
    if cfg.logging.progress and dp.is_main:
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
        else:
            log_every = max(1, total // 20)
            log.info("training steps %d..%d of %d", start + 1, total, total)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")

    pool_seen: list = [0, None]  # [graphs captured when last read, their pools' (reserved, allocated) bytes]

    def finish(rb: _Pending) -> dict:
        """The host side of a finished step: the non-finite stop, metrics, the progress bar. -> its record."""
        loss_val, gnorm, n_loss, others_stop = rb.readback.values()
        _check_finite(rb.step, loss_val, gnorm, last_good,  # pipelined: the update was skipped on the device
                      (lambda: nonfinite_weights(model)) if rb.step == start + 1 else None)
        n_loss, dt = int(n_loss), rb.readback.seconds()
        state.train_time += dt
        state.loss_tokens += n_loss
        if rb.step == start + 1:
            state.first_step_s, state.first_loss_tokens = dt, n_loss
        state.others_stop = state.others_stop or others_stop > 0
        # loss, loss_tokens, tokens_per_s: all ranks'; mfu: this rank's computed tokens on its GPU
        rec = {"kind": "train", "step": rb.step, "loss": loss_val, "lr": rb.lr, "grad_norm": gnorm,
               "loss_tokens": n_loss, "tokens_per_s": n_loss / dt, "step_s": dt}
        if peak:
            flops = (flops_per_token - head_flops) * rb.computed + head_flops * rb.own_loss
            rec["mfu"] = flops / dt / (peak * 1e12)
        if graphs is not None and len(graphs.captured()) != pool_seen[0]:  # the pools change only at a capture
            pool_seen[:] = [len(graphs.captured()), private_pool_bytes(device)]
        mem = memory_gib(device, pool_seen[1])  # with graphs: at least what a replay holds (metrics.memory_gib)
        if mem is not None:
            rec["mem_gib"] = mem
        metrics.write(rec)
        result.step, result.last_loss = rb.step, loss_val
        if bar is not None:
            post = {"loss": f"{loss_val:.3f}", "tok/s": rate_text(n_loss / dt)}
            if "mfu" in rec:
                post["mfu"] = f"{rec['mfu']:.1%}"
            if mem is not None:
                post["mem"] = f"{mem:.1f}G"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
        elif log_every and (rb.step % log_every == 0 or rb.step == total):
            log.info("step %d/%d: loss %.4f, lr %.3g, grad norm %.3g, %s loss tokens/s%s", rb.step, total, loss_val,
                     rb.lr, gnorm, rate_text(n_loss / dt), f", {mem:.1f} GiB" if mem is not None else "")
        return rec

    redirect = contextlib.nullcontext()
    if bar is not None:  # log lines printed above the bar, not glued to its line
        from tqdm.contrib.logging import logging_redirect_tqdm

        redirect = logging_redirect_tqdm()  # the root logger's console handler (the CLI's basicConfig)
    try:
        with redirect, StopFlag() as stop:
            pending: _Pending | None = None
            after = None  # the previous step's readback when nothing ran between it and this step
            for step in range(start, total):
                writer.raise_failed()  # a background checkpoint that failed stops the run now (rank 0 writes)
                started = StepStart(device)
                micro = stream.take(last_batches if step == total - 1 else cfg.train.grad_accum)
                # n_loss: all ranks' loss tokens, a host int (one process) or a device scalar (data parallel)
                loss, n_loss = accumulate_data_parallel(model, micro, device, dp, trainable, graphs, reducer)
                gnorm = clip_grad_norm(trainable, clip)
                if pending is not None:  # the previous step, read now that this one is queued behind it
                    finish(pending)
                    pending = None
                if pipelined:  # 1.0 skips the whole update on the device (params, moments, step count)
                    optimizer.found_inf = (~(torch.isfinite(loss) & torch.isfinite(gnorm))).float()
                lr = optimizer.param_groups[0]["lr"]
                if not pipelined:  # read now (a host sync) and stop before the update
                    _check_finite(step + 1, float(loss), float(gnorm), last_good,
                                  (lambda: nonfinite_weights(model)) if step == start else None)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                # a signal to any rank stops all of them after the same step: the max of the flags over the
                # ranks, read with this step's metrics (pipelined) or below, after on_step (every step read)
                flag = dp.all_reduce_flag(stop.signum is not None) if pipelined else 0
                rb = StepReadback([loss, gnorm, n_loss, flag], device, started=started, after=after)
                pending, after = _Pending(step + 1, lr, rb, sum(b.input_ids.numel() for b in micro),
                                         sum(b.num_loss_tokens for b in micro)), rb
                eval_due = bool(cfg.eval.every) and (step + 1) % cfg.eval.every == 0 and step + 1 < total
                save_due = bool(cfg.train.save_every) and (step + 1) % cfg.train.save_every == 0
                if not pipelined or eval_due or save_due or step + 1 == total:
                    rec = finish(pending)  # checked before any evaluation, checkpoint or return
                    pending = None
                if eval_due:
                    run_eval(step + 1, "interval")
                    after = None
                if save_due:
                    result.checkpoint = save(step + 1)
                    after = None
                if on_step is not None:  # (every step is read when there is one)
                    on_step(step + 1, rec)
                if dp.enabled and not pipelined:  # a host sync anyway: agree now on a signal got during this step
                    state.others_stop = state.others_stop or bool(dp.all_reduce_flag(stop.signum is not None))
                # data parallel: every rank stops after the same step, from the same all-reduced flags
                if state.others_stop if dp.enabled else stop.signum is not None:
                    if pending is not None:  # read (and checked) before the checkpoint
                        finish(pending)
                        pending = None
                    if not save_due:
                        result.checkpoint = save(step + 1, wait=True)
                    else:  # taken above: its file must exist before we return
                        writer.wait()
                        dp.barrier()
                    result.status = "interrupted"
                    why = signal.Signals(stop.signum).name if stop.signum is not None else "a signal to another rank"
                    log.warning("stopped by %s at step %d; checkpoint %s; run again with train.resume=auto",
                                why, step + 1, result.checkpoint)
                    break
    except BaseException as e:
        if isinstance(e, TrainingDiverged):
            close_diverged()
        else:
            metrics.close()
        last_good()  # a checkpoint in flight is published; a failed write is logged, the error in flight raised
        raise
    finally:
        if bar is not None:
            bar.close()
        if reducer is not None:  # the model may train again (another reducer) or be used without one
            reducer.remove()
        # captured graphs go now, also when an exception's traceback keeps this frame: graphs holding NCCL
        # collectives still alive at destroy_process_group hung both ranks on 2 H200s (bench_dp, b796b3d)
        graphs = None
    # a signal from here to the last checkpoint's publication waits for it, as one in the loop does: a Ctrl-C
    # raised into the writer's join abandoned the background write (no checkpoint; at exit, a SIGABRT)
    with StopFlag() as late:
        writer.wait()  # a checkpoint in flight is published (or its error raised) before train() goes on
        if dp.enabled and cfg.train.async_save and state.saves:  # the other ranks name what rank 0 has published
            dp.barrier()
            if not dp.is_main:
                result.checkpoint = ckpt.latest_checkpoint(out_dir)
        if result.status == "completed" and not (cfg.train.save_every and total % cfg.train.save_every == 0):
            # at the end too (train.save_every's "only at the end"): raising train.max_steps trains on from it,
            # and resume=auto in a finished out_dir finds the run done instead of an earlier signal's checkpoint
            result.checkpoint = save(total, wait=True)
    result.train_seconds = state.train_time
    result.tokens_per_s = state.loss_tokens / state.train_time if state.train_time else 0.0
    result.first_step_seconds = state.first_step_s
    rest = state.train_time - state.first_step_s
    result.tokens_per_s_after_first = (state.loss_tokens - state.first_loss_tokens) / rest if rest > 0 else 0.0
    if result.status == "completed" and bool(dp.all_reduce_flag(late.signum is not None)):
        # every step trained and checkpointed; the closing evaluation and final directory are left to the resume,
        # which finds the run done and does both (finish._already_done)
        result.status = "interrupted"
        why = signal.Signals(late.signum).name if late.signum is not None else "a signal to another rank"
        log.warning("stopped by %s after the last step; checkpoint %s; run again with train.resume=auto to write "
                    "the final %s", why, result.checkpoint, "adapter" if cfg.lora.enabled else "model")

    # ---- save ----
    if result.status == "completed":
        try:
            result.eval_loss_after = run_eval(result.step, "after")
        except TrainingDiverged:
            close_diverged()
            raise
        if cfg.train.save_final and dp.is_main:
            result.final_dir = save_final(model, tokenizer, cfg, out_dir, optimizer)
        if report:
            report("after", model=model, tokenizer=tokenizer, eval_loss=result.eval_loss_after,
                   heldout_qa=heldout_qa, result=result)
    metrics.close()
    if cfg.logging.plot and dp.is_main:
        result.plot = plot_losses(metrics.records, out_dir / "loss.png")
    return result
