"""Optimizer and learning-rate schedule: AdamW (fused on CUDA), warmup then cosine / linear / constant.

Parameter groups: under LoRA the LoRA+ groups from ``chronicals.lora`` (lr(B) = ratio x lr(A));
under full fine-tuning two groups, with weight decay on matrices only (never on biases and norms).
"""

from __future__ import annotations

import logging
import math

import torch

from ..config import TrainConfig

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


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; fused when on CUDA (optim.fused=auto) or asked for."""
    o = cfg.optim
    if cfg.lora.enabled:
        from ..lora import lora_plus_param_groups

        groups = lora_plus_param_groups(model, lr=o.lr, ratio=cfg.lora.plus_ratio, weight_decay=o.weight_decay)
    else:
        groups = full_ft_param_groups(model, o.lr, o.weight_decay)
    n = sum(p.numel() for g in groups for p in g["params"])
    if n == 0:
        raise ValueError("no trainable parameters: with lora.enabled=true check lora.targets match module names "
                         "(e.g. q_proj, v_proj)")
    fused = {"auto": device.type == "cuda", "true": True, "false": False}[str(o.fused).lower()]
    log.info("AdamW over %d trainable parameters in %d groups (fused=%s)", n, len(groups), fused)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, fused=fused or None)


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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    s = cfg.schedule
    warmup = min(s.warmup_steps, max(0, total_steps - 1))
    if warmup < s.warmup_steps:
        log.warning("schedule.warmup_steps=%d is not shorter than the run's %d steps: warming up over %d steps, so "
                    "the lr reaches its peak at the last step and never decays; lower schedule.warmup_steps",
                    s.warmup_steps, total_steps, warmup)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, s.kind, s.min_lr_ratio))
