"""A LoRA run's training checkpoint used as its adapter: ``chronicals export / chat / eval --adapter
runs/x/checkpoints/step-000120``, to merge, ask or score the model of a step before the run's end.

A checkpoint directory holds one ``state.pt``: the trainable tensors under the model's own names (the LoRA A and B
of every target, and any ``lora.modules_to_save`` module) and, in ``extra["config"]``, the run's config, which names
the base (``model.path``) and the LoRA settings. Those rebuild the adapter in memory: ``apply_lora`` with the run's
settings, then the tensors copied in, as a resume restores them. The tensors are the weights the step's forward
used (bf16 on CUDA), the same ones the run's final ``adapter/`` is saved from.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..config import TrainConfig, from_dict
from .checkpoint import STATE_FILE, _read_state


def is_checkpoint_dir(path: str | Path | None) -> bool:
    """True for a training checkpoint directory (its state.pt and no adapter_config.json)."""
    if not path:
        return False
    p = Path(path).expanduser()
    return (p / STATE_FILE).is_file() and not (p / "adapter_config.json").exists()


def read_lora_checkpoint(path: str | Path) -> tuple[TrainConfig, dict[str, torch.Tensor]]:
    """(the run's config, its trainable tensors) of a LoRA run's checkpoint; ValueError naming the file and what to
    do when it is a full fine-tuning run's or carries no config. Read once per file version (chat or export ask
    for the base first, then the tensors)."""
    file = Path(path).expanduser().resolve() / STATE_FILE
    return _read(file, file.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read(file: Path, _mtime_ns: int) -> tuple[TrainConfig, dict[str, torch.Tensor]]:
    state = _read_state(file)
    saved = (state.get("extra") or {}).get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {file} records no run config, so the adapter's settings are unknown; use the "
                         "run's adapter/ directory, or resume the run (train.resume) to write one")
    try:
        cfg = from_dict(saved)
    except ValueError as e:
        raise ValueError(f"checkpoint {file}: its run config no longer reads ({e}); it was written by another "
                         "version: use the run's adapter/ directory") from None
    if not cfg.lora.enabled:
        raise ValueError(f"checkpoint {file} is a full fine-tuning run's (lora.enabled false): it holds the whole "
                         "model's trainable weights, not an adapter; the run writes the model to its model/ directory "
                         "at the end (chronicals chat / eval --model)")
    return cfg, state["model"]


def apply_checkpoint_adapter(model: torch.nn.Module, path: str | Path, adapter_dtype: torch.dtype | None = None):
    """Put the adapter of the LoRA run's checkpoint ``path`` on ``model`` (its base, not yet adapted) in place: LoRA
    with the run's settings, then the checkpoint's tensors. ValueError naming the checkpoint when they do not fit
    (another base; the model is then left adapted: the commands that call this stop there). Returns the model."""
    from ..lora import apply_lora

    cfg, tensors = read_lora_checkpoint(path)
    lora = cfg.lora
    apply_lora(model, r=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.targets),
               use_rslora=lora.rslora, group=lora.group, modules_to_save=tuple(lora.modules_to_save),
               adapter_dtype=adapter_dtype)
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    shapes = [n for n, t in tensors.items() if n in params and t.shape != params[n].shape]
    if set(tensors) != trainable or shapes:
        odd = sorted(set(tensors) ^ trainable) + shapes
        raise ValueError(f"checkpoint {path} does not fit this base ({len(odd)} tensors differ in name or shape, e.g. "
                         f"{odd[0]}): it was trained on {cfg.model.path}; pass that model")
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
    return model
