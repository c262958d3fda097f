"""LoRA+ (Hayou et al., 2024): train B with a larger learning rate than A, lr(B) = ratio x lr(A).

The paper's argument: with B = 0 at the start, equal rates make the update of B too small to learn
features efficiently at large width; a ratio of ~16 is its default.
"""

from __future__ import annotations

import math

import torch.nn as nn

from .layer import LoRALinear


def lora_plus_param_groups(model: nn.Module, lr: float, *, ratio: float = 16.0,
                           weight_decay: float = 0.0) -> list[dict]:
    """Optimizer parameter groups for the trainable parameters of a LoRA model.

    Groups (empty ones are left out; each has a "name" key, which torch optimizers keep and ignore):
      - "lora_A": every A, at ``lr`` with ``weight_decay``;
      - "lora_B": every B, at ``ratio * lr`` with ``weight_decay``;
      - "full": other trainable matrices (modules_to_save: lm_head, embed_tokens), at ``lr`` with
        ``weight_decay``;
      - "no_decay": trainable 1-D parameters (biases, norm weights), at ``lr`` without weight decay.
    Frozen parameters are left out; a tied parameter appears once.
    """
    if not (0 < ratio < math.inf and 0 < lr < math.inf):  # NaN fails both: NaN weights with no message otherwise
        raise ValueError(f"lora_plus_param_groups: lr={lr} and ratio={ratio} must be positive and finite")
    a_ids, b_ids = set(), set()
    for mod in model.modules():
        if isinstance(mod, LoRALinear):
            a_ids.add(id(mod.lora_A.weight))
            b_ids.add(id(mod.lora_B.weight))
    if not a_ids:
        raise ValueError("lora_plus_param_groups: the model has no LoRA adapters; call apply_lora first")
    groups = {"lora_A": [], "lora_B": [], "full": [], "no_decay": []}
    for p in model.parameters():  # deduplicates tied Parameters
        if not p.requires_grad:
            continue
        if id(p) in a_ids:
            groups["lora_A"].append(p)
        elif id(p) in b_ids:
            groups["lora_B"].append(p)
        elif p.ndim < 2:
            groups["no_decay"].append(p)
        else:
            groups["full"].append(p)
    settings = {"lora_A": (lr, weight_decay), "lora_B": (lr * ratio, weight_decay), "full": (lr, weight_decay),
                "no_decay": (lr, 0.0)}
    return [{"name": k, "params": ps, "lr": settings[k][0], "weight_decay": settings[k][1]}
            for k, ps in groups.items() if ps]
