"""Optimizer and learning-rate schedule: AdamW (fused on CUDA), warmup then cosine / linear / constant.

Master weights: bf16 trainable weights (full fine-tuning and LoRA adapters) get fp32 masters by default
(``optim.master_weights``, train/master_adamw.py); plain AdamW on bf16 weights rounds away updates below half a
bf16 step.

Parameter groups: under LoRA the LoRA+ groups from ``chronicals.lora`` (lr(B) = ratio x lr(A));
under full fine-tuning two groups, with weight decay on matrices only (never on biases and norms).
"""

from __future__ import annotations

import logging
import math

import torch

from .._words import counted
from ..config import TrainConfig
from .master_adamw import LOW_PRECISION, MasterWeightAdamW

log = logging.getLogger("chronicals.train")


def full_ft_param_groups(model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict]:
    """Trainable params split into decayed matrices and undecayed vectors (biases, norm weights)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "lr": lr, "weight_decay": weight_decay, "name": "matrices"},
              {"params": no_decay, "lr": lr, "weight_decay": 0.0, "name": "vectors"}]
    return [g for g in groups if g["params"]]


FULL_FT_HIGH_LR = 2e-4  # above it a full fine-tune gets a warning (LoRA's default lr is 1e-3)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; fused when on CUDA (optim.fused=auto) or asked for.

    With fp32 master weights (``optim.master_weights``, see ``uses_master_weights``) a ``MasterWeightAdamW``
    (train/master_adamw.py), else ``torch.optim.AdamW`` on the parameters themselves.
    """
    o = cfg.optim
    if cfg.lora.enabled:
        from ..lora import lora_plus_param_groups

        groups = lora_plus_param_groups(model, lr=o.lr, ratio=cfg.lora.plus_ratio, weight_decay=o.weight_decay)
    else:
        groups = full_ft_param_groups(model, o.lr, o.weight_decay)
        if o.lr > FULL_FT_HIGH_LR:
            log.warning("optim.lr=%g for full fine-tuning: the default 1e-3 is LoRA's; full fine-tunes of pretrained "
                        "models usually take 1e-5 to 1e-4 (the SmolLM2 demo's held-out loss rose 1.87 -> 2.24 in "
                        "2 steps at 1e-3); set optim.lr", o.lr)
    params = [p for g in groups for p in g["params"]]
    n = sum(p.numel() for p in params)
    if n == 0:
        raise ValueError("no trainable parameters: with lora.enabled=true check lora.targets match module names "
                         "(e.g. q_proj, v_proj)")
    fused = {"auto": device.type == "cuda", "true": True, "false": False}[str(o.fused).lower()]
    masters, why = uses_master_weights(cfg, params)
    kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if masters:
        log.info("MasterWeightAdamW over %d trainable parameters in %s (fused=%s): %s", n,
                 counted(len(groups), "group"), fused, why)
        return MasterWeightAdamW(groups, fused=fused, **kw)
    if any(p.dtype in LOW_PRECISION for p in params):  # only optim.master_weights=false gets here
        log.warning("%s in %s without fp32 masters (%s): AdamW updates smaller than half a bf16 step of a weight "
                    "(0.0039 up from 1.0) are rounded away, so at small lr many weights never change (every "
                    "RMSNorm weight near 1.0 at lr=2e-5; 85%% of lora_A elements at lr=1e-4 in a test); "
                    "optim.master_weights=auto keeps them (+8 bytes per trainable parameter: fp32 master and "
                    "moments)", "LoRA adapters" if cfg.lora.enabled else "full fine-tuning", _dtypes(params), why)
    log.info("AdamW over %d trainable parameters in %s (fused=%s)", n, counted(len(groups), "group"), fused)
    opt = torch.optim.AdamW(groups, fused=fused or None, **kw)
    opt.register_load_state_dict_pre_hook(_drop_masters)
    return opt


def uses_master_weights(cfg: TrainConfig, params: list[torch.Tensor]) -> tuple[bool, str]:
    """(use fp32 masters?, why) from ``optim.master_weights`` and the trainable parameters' dtypes.

    auto: on when trainable weights are bf16/fp16 (model.dtype=bfloat16, or auto on CUDA), full fine-tuning and
    LoRA alike (bf16 adapters lost most lora_A updates at lr <= 1e-4 in a test: 85% of elements never changed);
    off for float32 weights (nothing is lost). true: the same; false: off. The bench protocol builds its own
    plain AdamW, as every anchor trains.
    """
    setting = str(cfg.optim.master_weights).lower()
    low = any(p.dtype in LOW_PRECISION for p in params)
    if setting == "false":
        return False, "optim.master_weights=false"
    if not low:
        return False, f"the trainable weights are {_dtypes(params)}: no masters needed"
    if setting == "true":
        return True, "optim.master_weights=true"
    what = "LoRA adapters" if cfg.lora.enabled else "weights under full fine-tuning"
    return True, (f"optim.master_weights=auto with {_dtypes(params)} {what} (+8 bytes per trainable parameter: "
                  "updates below half a bf16 step are kept)")


def _dtypes(params: list[torch.Tensor]) -> str:
    return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))


def _drop_masters(optimizer, state_dict: dict) -> dict:
    """Resuming a checkpoint written with fp32 masters into a plain AdamW (optim.master_weights=false now): the
    weights come from the checkpoint's model (the masters rounded), the masters would only hold memory."""
    state = {k: {n: v for n, v in st.items() if n != "master"} for k, st in state_dict["state"].items()}
    return {**state_dict, "state": state}


def lr_factor(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based) of ``total``.

    Warmup rises linearly to 1 over ``warmup`` steps ((step + 1) / warmup, so step 0 already moves the
    weights); then cosine / linear decay to ``min_ratio`` at the last step, or constant 1.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup - 1)
    t = min(1.0, max(0.0, (step - warmup) / span))
    if kind == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    if kind == "linear":
        return 1 - (1 - min_ratio) * t
    raise ValueError(f"schedule.kind={kind!r} is not one of cosine | linear | constant")


SHORT_RUN_WARMUP = 10  # a run no longer than schedule.warmup_steps warms up over 1/10 of its steps (rounded up)


def short_run_warmup(warmup_steps: int, total: int) -> int:
    """The warmup a run of ``total`` steps uses: ``warmup_steps``, or ceil(total / 10) when the run is not longer.

    A recipe's warmup_steps=20 in a 10-step smoke run would end the run before the lr peaks, with no decay at all;
    1/10 of the run (the common warmup_ratio of 0.1) still warms up and leaves the other 9/10 to the decay:
    10 steps -> 1, 15 -> 2, 3 -> 1. A function of (warmup_steps, total) only, so a resumed run's schedule is the
    uninterrupted run's.
    """
    if 0 < total <= warmup_steps:
        return -(-total // SHORT_RUN_WARMUP)  # ceil in integers: 30 * 0.1 is 3.0000000000000004
    return warmup_steps


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int, warn: bool = True):
    """LambdaLR at ``lr_factor`` of (step, total_steps, the config): nothing else, so a resume is exact. ``warn``:
    say here when the run is too short for its warmup (``warn_short_warmup``); the trainer says it once it knows
    the run's length after a resume."""
    if warn:
        warn_short_warmup(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg, total_steps))


def set_total_steps(scheduler, cfg: TrainConfig, total_steps: int) -> None:
    """A resumed run whose step count differs from the one the scheduler was built with (another train.epochs or
    grad_accum: ``stream._step_plan``): its lr follows this run's length from the resume on."""
    scheduler.lr_lambdas = [_schedule(cfg, total_steps)] * len(scheduler.lr_lambdas)


def warn_short_warmup(cfg: TrainConfig, total_steps: int) -> None:
    """A warning when schedule.warmup_steps is not shorter than the run (``short_run_warmup`` then shortens it)."""
    s = cfg.schedule
    warmup = short_run_warmup(s.warmup_steps, total_steps)
    if warmup != s.warmup_steps:
        decays = s.kind != "constant" and total_steps - warmup >= 2  # the first step after warmup is still the peak
        after = (f"decays ({s.kind}) to schedule.min_lr_ratio={s.min_lr_ratio:g} of it at step {total_steps}"
                 if decays else "holds it")
        log.warning("schedule.warmup_steps=%d is not shorter than the run's %d step(s) (the warmup would take the "
                    "whole run and leave no step to decay): warming up over %d step(s) instead (1/%d of the run, "
                    "rounded up), so the lr reaches its peak at step %d and %s; set schedule.warmup_steps below %d "
                    "to choose the warmup yourself (0 = none)", s.warmup_steps, total_steps, warmup,
                    SHORT_RUN_WARMUP, warmup, after, total_steps)


def _schedule(cfg: TrainConfig, total_steps: int):
    """step -> lr multiplier for a run of ``total_steps``."""
    s = cfg.schedule
    warmup = short_run_warmup(s.warmup_steps, total_steps)
    return lambda step: lr_factor(step, total_steps, warmup, s.kind, s.min_lr_ratio)
