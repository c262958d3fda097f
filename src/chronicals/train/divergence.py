"""The divergence guard: a step whose loss or gradient norm is NaN/inf stops the run (TrainingDiverged) before
its update, naming the last good checkpoint; at the first step a process runs (a resumed one too), the weights that
were NaN/inf before it."""

from __future__ import annotations

import math

import torch

from .._words import counted


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


def nonfinite_weights(model: torch.nn.Module) -> list[str]:
    """Names of the parameters holding NaN/inf (one pass over the weights: only asked once a step has failed)."""
    return [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def _check_finite(step: int, loss_val: float, gnorm: float, last_good, bad_weights=None) -> None:
    """TrainingDiverged when step ``step``'s loss or gradient norm is NaN/inf; its update is not applied.

    ``last_good()``: the last good checkpoint (named in the message). ``bad_weights()`` (the first step a process runs
    only): the parameters that were NaN/inf before any update, which no lr or warmup setting mends."""
    if math.isfinite(loss_val) and math.isfinite(gnorm):
        return
    bad = bad_weights() if bad_weights is not None else []
    if bad:
        raise TrainingDiverged(f"{'loss' if not math.isfinite(loss_val) else 'gradient norm'} is not finite at step "
                               f"{step}, the first this process ran, and the model's weights held NaN/inf before any "
                               f"update: {counted(len(bad), 'tensor')}, e.g. {', '.join(bad[:3])}; the checkpoint "
                               "(or model) it started from is damaged: load an intact copy (a lower optim.lr would "
                               "not help)")
    good = last_good()
    # a large lr can leave finite but ruined weights in the checkpoints before the NaN: starting over is the other way
    where = (f"The last good checkpoint is {good}; train.resume=auto continues from it with the changed settings, "
             "train.resume=none starts over from the model (if the loss was already climbing before this step)"
             if good is not None else "No checkpoint was written before it (one is written every train.save_every "
             "steps, and at the end); the run starts over")
    what = (f"loss is {loss_val}" if not math.isfinite(loss_val)
            else f"gradient norm is {gnorm} (loss {loss_val:.4f})")
    raise TrainingDiverged(f"{what} at step {step}; stopping without its update. {where} (lower optim.lr, raise "
                           "schedule.warmup_steps, or check the data)")
