"""A LoRA run's training checkpoint used as its adapter: ``chronicals export / chat / eval --adapter
runs/x/checkpoints/step-000120``, to merge, ask or score the model of a step before the run's end.

A checkpoint directory holds one ``state.pt``: the trainable tensors under the model's own names (the LoRA A and B
of every target, and any ``lora.modules_to_save`` module) and, in ``extra``, what the run trained: ``base`` (the
model, as the run's adapter/ records it: an absolute path or a short name; None for a model passed to train()),
``lora`` (the settings apply_lora used, from ``model.lora_config``) and ``config`` (the run's config). Those rebuild
the adapter in memory: ``apply_lora`` with the recorded settings, then the tensors copied in, as a resume restores
them. The tensors are the fp32 masters of a run with ``optim.master_weights`` (bf16 on CUDA), as the run's final
adapter/ is saved, else the weights themselves; in checkpoints older than their ``optimizer_params`` list a master
is found by the weight it rounds to (``masters_by_name``). Checkpoints written before ``base`` and ``lora`` were
recorded fall back to the config's model.path (only when it names the model from anywhere: absolute, ``~``, or a
short name) and lora section.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .._words import counted
from ..config import TrainConfig, from_dict
from ..config_schema import stored_config
from .checkpoint import STATE_FILE, _read_state, masters_by_name


def lora_settings(model: torch.nn.Module) -> dict | None:
    """What apply_lora did to ``model`` (``model.lora_config``) as plain values for a checkpoint, or None."""
    rec = getattr(model, "lora_config", None)
    if rec is None:
        return None
    targets = rec.target_modules if isinstance(rec.target_modules, str) else list(rec.target_modules)
    return {"r": rec.r, "alpha": rec.alpha, "dropout": rec.dropout, "use_rslora": rec.use_rslora,
            "target_modules": targets, "lora_modules": list(rec.lora_modules), "saved_modules": list(rec.saved_modules)}


@dataclass
class CheckpointAdapter:
    file: Path
    config: TrainConfig  # the run's
    base: str | None  # the model the run trained; None: not known from here (``why_no_base`` says why)
    why_no_base: str
    lora: dict  # apply_lora keyword arguments ({} for a full fine-tuning run's)
    tensors: dict[str, torch.Tensor]  # memory-mapped from state.pt: read when copied in
    lora_modules: list[str] | None  # the modules the run adapted (None: not recorded, or no LoRA)
    trained_dtype: torch.dtype | None = None  # the dtype of the weights as trained (bf16 beside fp32 masters)


def is_checkpoint_dir(path: str | Path | None) -> bool:
    """True for a training checkpoint directory (its state.pt and no adapter_config.json)."""
    if not path:
        return False
    p = Path(path).expanduser()
    return (p / STATE_FILE).is_file() and not (p / "adapter_config.json").exists()


def read_run_checkpoint(path: str | Path) -> CheckpointAdapter:
    """What a run's checkpoint directory holds, LoRA or full fine-tuning (``config.lora.enabled`` says which): its
    config, the base it trained, its tensors (fp32 masters where the run kept them). ValueError naming the file when
    it carries no config or a tensor that is not floating point. Read once per file version (chat or export ask for
    the base first, then the tensors), memory-mapped: the optimizer's moments in the same file are never paged in."""
    file = Path(path).expanduser().resolve() / STATE_FILE
    if not file.is_file():  # was a bare "[Errno 2] No such file or directory: '.../state.pt'"
        raise FileNotFoundError(_not_a_checkpoint(Path(path).expanduser()))
    st = file.stat()
    return _read(file, (st.st_mtime_ns, st.st_size, st.st_ino))


def _not_a_checkpoint(p: Path) -> str:
    """Why ``p`` is no run checkpoint (runs/x/checkpoints/step-N holding state.pt), and what to pass instead."""
    what = f"{p}: not a training checkpoint (a run's checkpoints/step-N directory, holding {STATE_FILE})"
    holder = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted(holder.glob(f"step-*/{STATE_FILE}")) if p.is_dir() else []
    if steps:
        return f"{what}; it holds a run's checkpoints: pass one, e.g. {steps[-1].parent}"
    if (p / "adapter_config.json").is_file():
        return f"{what}; it is a PEFT adapter: chronicals.lora.load_adapter(model, path) puts it on its base"
    if (p / "config.json").is_file():
        return f"{what}; it is a model directory: chronicals.load_model(path) loads it"
    return what + ("" if p.exists() else "; no such directory")


def read_lora_checkpoint(path: str | Path) -> CheckpointAdapter:
    """The adapter a LoRA run's checkpoint directory describes; ValueError naming the file and what to do when it is
    a full fine-tuning run's or carries no config."""
    ck = read_run_checkpoint(path)
    if not ck.config.lora.enabled:
        raise ValueError(f"checkpoint {ck.file} is a full fine-tuning run's (lora.enabled false): it holds the whole "
                         "model's trainable weights, not an adapter; pass it as --model (chronicals chat / eval / "
                         "export), without --adapter")
    return ck


def _instead(ckdir: Path) -> str:
    """What to use in place of a damaged run checkpoint ``ckdir`` (runs/x/checkpoints/step-N): the run's latest
    other checkpoint, and its adapter/ or model/ where the run wrote one."""
    from .checkpoint import checkpoint_dirs

    run = ckdir.parent.parent
    if ckdir.parent.name != "checkpoints":  # a copy outside a run
        return "use another checkpoint of that run"
    others = [d for d in checkpoint_dirs(run) if d != ckdir]
    finals = [run / d for d in ("adapter", "model") if (run / d).is_dir()]
    options = ([f"another of the run's checkpoints ({others[-1]})"] if others else []) + \
        [f"the run's final {d.name}/ ({d})" for d in finals]
    return "use " + " or ".join(options) if options else "use another checkpoint of that run"


@functools.lru_cache(maxsize=1)
def _read(file: Path, _version: tuple) -> CheckpointAdapter:
    state = _read_state(file, mmap=True, fix=_instead(file.parent), resuming=False)
    extra = state.get("extra") or {}
    saved = extra.get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {file} records no run config, so the model it belongs to is unknown; use the "
                         "run's adapter/ or model/ directory, or resume the run (train.resume) to write one")
    try:
        with stored_config():
            cfg = from_dict(saved)
    except ValueError as e:
        raise ValueError(f"checkpoint {file}: its run config no longer reads ({e}); it was written by another "
                         "version: use the run's adapter/ or model/ directory") from None
    base, why = _base(extra, cfg)
    for name, t in state["model"].items():  # a crafted file: load_adapter refuses these too
        if not t.is_floating_point():
            raise ValueError(f"checkpoint {file}: tensor {name} is stored as {t.dtype}, not as floating point; it "
                             "was not written by chronicals: use the run's adapter/ or model/ directory")
    record = extra.get("lora")
    tensors = dict(state["model"])
    trained = next(iter(tensors.values())).dtype if tensors else None
    for name, master in masters_by_name(state).items():  # paged in from the file: the moments beside them are not
        if name in tensors and master.shape == tensors[name].shape:
            tensors[name] = master
    lora = _lora_kwargs(record, cfg) if cfg.lora.enabled else {}
    return CheckpointAdapter(file, cfg, base, why, lora, tensors,
                             None if record is None else list(record["lora_modules"]), trained)


def _base(extra: dict, cfg: TrainConfig) -> tuple[str | None, str]:
    """(the base the run trained, or None with why) from the checkpoint's record, else from model.path."""
    if "base" in extra:
        base = extra["base"]
        return base, "" if base else "the run was given its model in Python (train(cfg, model=...))"
    path = cfg.model.path
    from ..models.loading import SHORT_NAMES

    if path.lower() in SHORT_NAMES or Path(path).is_absolute() or path.startswith("~"):
        return path, ""
    return None, (f"its model.path {path!r} is relative to the directory that run started in, and this checkpoint "
                  "is older than the base it now records")


def _lora_kwargs(record: dict | None, cfg: TrainConfig) -> dict:
    """apply_lora's arguments: the recorded settings (the targets as given, so a saved adapter_config.json lists
    them as the run's adapter/ does; the adapted modules are compared after), else the config's."""
    if record is not None:
        targets = record.get("target_modules", record["lora_modules"])  # full names match the same modules
        return dict(r=record["r"], alpha=record["alpha"], dropout=record["dropout"], use_rslora=record["use_rslora"],
                    target_modules=targets if isinstance(targets, str) else tuple(targets),
                    modules_to_save=tuple(record["saved_modules"]), group=cfg.lora.group)
    lora = cfg.lora
    return dict(r=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.targets),
                use_rslora=lora.rslora, group=lora.group, modules_to_save=tuple(lora.modules_to_save))


def _untie_as_trained(model: torch.nn.Module, rec, names: set[str]) -> None:
    """Untie tied saved modules (lm_head, embed_tokens) the way the checkpoint's run had them: a run continued
    from a PEFT adapter that trained lm_head alone, or both with different values, trained them untied
    (``load_adapter``: ``_untie_if_partial`` / ``_untie_if_different``), and its checkpoint holds ``lm_head.weight``
    where ``apply_lora`` re-tied the pair under ``model.embed_tokens.weight``: every such checkpoint was refused as
    "does not fit this base" (a LoRA walk). ``names``: the checkpoint's tensor names. A tied member the checkpoint
    holds gets its own trainable Parameter; one it does not hold stays on the frozen base tensor and is no longer
    saved."""
    from ..lora.peft_io import saved_param_owners

    owners = saved_param_owners(model, rec)
    listed = {id(p): n for n, p in model.named_parameters()}  # a shared Parameter under its first owner's name
    dropped = set()
    for key, group in owners.items():
        held = [i for i, (n, pn) in enumerate(group) if f"{n}.{pn}" in names]
        if len(group) < 2 or not held or [f"{group[i][0]}.{group[i][1]}" for i in held] == [listed.get(key)]:
            continue  # tied, as apply_lora ties it
        shared = getattr(model.get_submodule(group[0][0]), group[0][1])
        for i, (n, pn) in enumerate(group):
            if i in held:
                setattr(model.get_submodule(n), pn, torch.nn.Parameter(shared.detach().clone(), requires_grad=True))
            else:
                dropped.add(n)
        shared.requires_grad_(False)
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            model.config.tie_word_embeddings = False
    rec.saved_modules = [n for n in rec.saved_modules if n not in dropped]


def _check_adapted(path, ck: CheckpointAdapter, adapted: list[str]) -> None:
    """ValueError when the modules the run's LoRA settings adapt on this base (``adapted``) are not those the run
    adapted (its checkpoint records them): it trained another model."""
    if ck.lora_modules is not None and list(adapted) != ck.lora_modules:
        odd = sorted(set(adapted) ^ set(ck.lora_modules))
        raise ValueError(f"checkpoint {path} does not fit this base: its LoRA targets match other modules here (e.g. "
                         f"{odd[0]}); it was trained on {ck.base or 'a model it does not name'}; pass that model")


def _tensors_fit(path, ck: CheckpointAdapter, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapted ``model``'s parameters by name, once the checkpoint's tensor names and shapes are checked against
    its trainable ones (ValueError: it was trained on another base). apply_checkpoint_adapter checks so before it
    copies; check_checkpoint_adapter, against a copy of the model on the meta device, before the weights load."""
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    shapes = [n for n, t in ck.tensors.items() if n in params and t.shape != params[n].shape]
    if set(ck.tensors) != trainable or shapes:
        odd = sorted(set(ck.tensors) ^ trainable) + shapes
        raise ValueError(f"checkpoint {path} does not fit this base ({counted(len(odd), 'tensor')} of another name or "
                         f"shape, e.g. {odd[0]}): it was trained on {ck.base or 'a model it does not name'}; pass "
                         "that model")
    return params


def check_checkpoint_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """The refusals ``apply_checkpoint_adapter(model, path)`` makes before it copies a tensor, in its words and with
    ``model`` left as it is: the checkpoint (a LoRA run's: ``read_lora_checkpoint``), apply_lora's checks of the run's
    settings, the modules they adapt here against those the run adapted, and the checkpoint's tensor names and shapes
    (memory-mapped: no value read) against a copy of ``model`` on the meta device adapted with those settings
    (``lora.inject.meta_lora_copy``). Module names, kinds and shapes are all it reads of ``model``: it may be the
    decoder built on the meta device from its config (``chronicals eval --adapter``, before it reads its data and the
    weights load)."""
    from ..lora.inject import meta_lora_copy

    ck = read_lora_checkpoint(path)
    shadow = meta_lora_copy(model, **ck.lora)
    _check_adapted(path, ck, shadow.lora_config.lora_modules)
    _untie_as_trained(shadow, shadow.lora_config, set(ck.tensors))
    _tensors_fit(path, ck, shadow)


def apply_checkpoint_adapter(model: torch.nn.Module, path: str | Path, adapter_dtype: torch.dtype | None = None):
    """Put the adapter of the LoRA run's checkpoint ``path`` on ``model`` (its base, not yet adapted) in place: LoRA
    with the run's settings, then the checkpoint's tensors. ValueError naming the checkpoint when they do not fit
    (another base; the model is then left adapted: the commands that call this stop there). Returns the model.
    ``adapter_dtype``: as load_adapter's (None: float32 on a bf16 or fp16 model, so that a checkpoint and the run's
    adapter/ answer alike there)."""
    from ..lora import apply_lora
    from ..lora.peft_io import loaded_adapter_dtype

    ck = read_lora_checkpoint(path)
    rec = apply_lora(model, adapter_dtype=loaded_adapter_dtype(model, adapter_dtype), **ck.lora)
    _check_adapted(path, ck, rec.lora_modules)
    _untie_as_trained(model, rec, set(ck.tensors))
    params = _tensors_fit(path, ck, model)
    with torch.no_grad():
        for name, t in ck.tensors.items():
            params[name].copy_(t)
    return model
