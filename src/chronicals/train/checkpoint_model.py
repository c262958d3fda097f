"""A full fine-tuning run's training checkpoint used as a model: ``chronicals chat / eval / export --model
runs/x/checkpoints/step-000120``, to ask, score or write out the model of a step before the run's end (the run
writes only its last one, to model/).

Such a checkpoint's state.pt holds every trainable weight under the model's own names, and in ``extra`` the base
the run loaded (``checkpoint_adapter`` reads both). The model is that base, loaded as ``load_model`` loads it (its
config.json, tokenizer and any weight the run froze), with the checkpoint's tensors copied in: the fp32 masters of a
run with ``optim.master_weights``, rounded to nearest into the loaded dtype (what the run's bf16 weights were: the
optimizer rounds the same way), else the weights as trained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .._words import counted
from ..models.loading import SHORT_NAMES, load_model
from .checkpoint_adapter import CheckpointAdapter, read_run_checkpoint


def read_full_checkpoint(path: str | Path) -> CheckpointAdapter:
    """A full fine-tuning run's checkpoint (its config, base and tensors); ValueError naming the file and what to do
    for a LoRA run's, which is an adapter."""
    ck = read_run_checkpoint(path)
    if ck.config.lora.enabled:
        raise ValueError(f"checkpoint {ck.file} is a LoRA run's (lora.enabled true): it holds an adapter, not a "
                         "model; pass it as --adapter (chronicals chat / eval / export), its base as --model "
                         "(default: the base it records)")
    return ck


def checkpoint_base(path: str | Path) -> str:
    """The model a full fine-tuning run's checkpoint was trained from, as load_model takes it; FileNotFoundError
    naming it when it is not here (its config.json and tokenizer are not in the checkpoint)."""
    ck = read_full_checkpoint(path)
    if ck.base is None:
        raise FileNotFoundError(f"checkpoint {ck.file} does not name a base model that can be found from here "
                                f"({ck.why_no_base}); its architecture and tokenizer come from that model: pass it "
                                "as --base (chronicals chat / eval / export; from Python: "
                                "chronicals.train.load_checkpoint_model(path, base=...))")
    if ck.base.lower() not in SHORT_NAMES and not Path(ck.base).expanduser().exists():
        raise FileNotFoundError(f"checkpoint {ck.file} was trained from {ck.base}, which is not here: its "
                                "architecture and tokenizer come from that model; put it back at that path, or pass "
                                "its new place as --base (chronicals chat / eval / export; from Python: "
                                "load_checkpoint_model(path, base=...))")
    return ck.base


def apply_checkpoint_weights(model: torch.nn.Module, path: str | Path, rounded: torch.dtype | None = None,
                             given: str | None = None) -> torch.nn.Module:
    """Copy a full fine-tuning run's checkpoint ``path`` into ``model`` (its base) in place, each tensor cast to the
    parameter's dtype (first rounded to ``rounded`` when given: the dtype the run trained in, so a float32 model
    holds the bf16 weights of a bf16 run, not its fp32 masters); ValueError naming the checkpoint when a tensor has
    no parameter of its name and shape (another base; ``given``: the base the caller named, for the message). Weights
    the run froze stay the base's. Returns the model."""
    ck = read_full_checkpoint(path)
    params = dict(model.named_parameters())
    odd = sorted(n for n, t in ck.tensors.items() if n not in params or t.shape != params[n].shape)
    if odd:
        model_is = f"--base {given}" if given else "this model"
        raise ValueError(f"checkpoint {path} does not fit {model_is} ({counted(len(odd), 'tensor')} of another name "
                         f"or shape, e.g. {odd[0]}): it was trained from {ck.base or 'a model it does not name'}; "
                         "pass that model" + (", or where it has moved to, as --base" if given else ""))
    with torch.no_grad():
        for name, t in ck.tensors.items():
            # fp32 master -> bf16: round to nearest, as MasterWeightAdamW writes its params
            params[name].copy_(t if rounded is None else t.to(rounded))
    return model


def load_checkpoint_model(path: str | Path, *, base: str | None = None, dtype: torch.dtype | None = None,
                          device=None, impl: str = "auto", tokenizer: bool = True, as_trained: bool = False):
    """(model in eval mode, tokenizer or None) of a full fine-tuning run's checkpoint directory ``path``: ``base``
    (default: the one the checkpoint records) loaded by ``load_model`` with ``dtype`` / ``device`` / ``impl`` /
    ``tokenizer`` as there, then the checkpoint's weights copied in. dtype None: the dtype the run trained in, as its
    model/ directory is written (bf16 on CUDA from an fp32 base: a .gguf one too); torch.float32 keeps the fp32
    masters of a bf16 run as they are, unless ``as_trained``: the weights as the run trained with them (rounded to
    its dtype once), held in ``dtype`` (chat / eval --dtype auto on a CPU: a bf16 run's step scores as its model/)."""
    trained = read_full_checkpoint(path).trained_dtype
    model, tok = load_model(base or checkpoint_base(path), dtype=dtype or trained, device=device, impl=impl,
                            tokenizer=tokenizer)
    return apply_checkpoint_weights(model, path, rounded=trained if as_trained else None, given=base).eval(), tok
