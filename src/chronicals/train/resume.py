"""Resuming with this run's settings: the optimizer and schedule hyperparameters it sets, and warnings when a
checkpoint was written by a run with other settings, data, loss tokens (data.train_on, ...) or weights dtype."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..models.loading import same_model
from . import checkpoint as ckpt

log = logging.getLogger("chronicals.train")


# how this run's AdamW computes (optim.fused, CUDA graphs' capturable): a checkpoint's groups carried the old run's,
# so optim.fused=true over a fused=false checkpoint ran the unfused path, which refused the loop's found_inf
# ("Expected grad_scale and found_inf to be None", exit 4)
IMPL_KEYS = ("fused", "foreach", "capturable")


def optimizer_settings(optimizer, scheduler) -> dict:
    """What this run's config set in the freshly built optimizer and schedule (before a checkpoint's state
    replaces them): per group betas, eps, weight_decay, and the schedule's base learning rates."""
    keys = ("betas", "eps", "weight_decay") + IMPL_KEYS
    return {"groups": [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups],
            "base_lrs": list(scheduler.base_lrs)}


def _place_steps(optimizer) -> None:
    """Each AdamW state's step count where its group's implementation reads it: on the parameter's device (fp32)
    for fused or capturable groups, on the CPU otherwise (torch's own load_state_dict policy, applied again after
    IMPL_KEYS changed). MasterWeightAdamW keeps every step on the device itself."""
    if not isinstance(optimizer, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            step = st.get("step")
            if isinstance(step, torch.Tensor):
                st["step"] = step.to(device=p.device if on_device else "cpu", dtype=torch.float32)


def apply_optimizer_settings(optimizer, scheduler, fresh: dict, saved_cfg: dict | None, cfg_dict: dict,
                           step: int, total: int | None = None) -> None:
    """After a resume, this run's optimizer / schedule settings apply from ``step`` on (the checkpoint's state
    dicts carry the old run's lr, betas, eps and weight decay; the AdamW moments and step counts are kept).
    With an unchanged config the values are the ones restored, bit for bit. At the run's last step (``total``)
    nothing is trained under them: no warning (the run says it has nothing to train)."""
    for group, new in zip(optimizer.param_groups, fresh["groups"]):
        group.update(new)
    _place_steps(optimizer)
    scheduler.base_lrs = list(fresh["base_lrs"])
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(optimizer.param_groups, scheduler.base_lrs, lrs):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = lrs
    diffs = setting_diffs(saved_cfg, cfg_dict)
    if diffs and (total is None or step < total):
        log.warning("resumed at step %d with other settings than the checkpoint's run: %s; they apply from step %d "
                    "on (the AdamW moments are kept)", step, ", ".join(diffs), step + 1)


def setting_diffs(saved: dict | None, current: dict) -> list[str]:
    """The settings a resume applies from its step on that differ from the checkpoint's run's: "optim.lr=0.001 (this
    run: 0.0005)", ... (the optimizer, schedule, LoRA+ ratio and dropout, and the run's length)."""
    return ckpt.config_diffs(saved, current, {"optim": None, "schedule": None, "lora": ("plus_ratio", "dropout"),
                                              "train": ("max_steps", "epochs", "grad_accum")})


# data settings that change which tokens carry the loss, or which examples and prompts there are, without a
# refusal: a resume under other values went on silently (data.train_on=all took a loss of 0.39 to 3.39)
LOSS_KEYS = {
    "train_on": "data.train_on: whether only the replies / outputs / completions or every token carries loss",
    "on_long": "data.on_long: whether examples longer than data.max_seq_len are cut, dropped or split",
    "system_prompt": "data.system_prompt: the system message of the demo data and of held-out QA prompts",
}


# the data settings a checkpoint's data position depends on (which batches, in which order)
DATA_POSITION_KEYS = {"data": ("path", "format", "max_seq_len", "batch_size", "tokens_per_batch", "dp_remainder"),
                      "train": ("seed",)}


def data_position_diffs(saved: dict | None, current: dict) -> list[str]:
    """``ckpt.config_diffs`` over DATA_POSITION_KEYS, less data.batch_size where both runs set
    data.tokens_per_batch: the loader then ignores batch_size (``DataSection.loader_shape``), so another value
    moves no batch."""
    diffs = ckpt.config_diffs(saved, current, DATA_POSITION_KEYS)
    if (saved or {}).get("data", {}).get("tokens_per_batch") and current.get("data", {}).get("tokens_per_batch"):
        diffs = [d for d in diffs if not d.startswith("data.batch_size=")]
    # a relative data.path and the absolute one a run now records (run_dir.recorded) for the same file: one path
    if same_model((saved or {}).get("data", {}).get("path"), current.get("data", {}).get("path")):
        diffs = [d for d in diffs if not d.startswith("data.path=")]
    return diffs


def _same_effective_system_prompt(saved: dict, current: dict) -> bool:
    """data.system_prompt reaches the tokens only as ``qa.heldout_system_prompt`` says (beside the user's own data
    its default and '' are the same: none), so only a change of that effective value is a change."""
    from types import SimpleNamespace

    from .qa import heldout_system_prompt

    def effective(cfg):
        d = cfg.get("data", {})
        return heldout_system_prompt(SimpleNamespace(path=d.get("path"), system_prompt=d.get("system_prompt")))

    return effective(saved) == effective(current)


def loss_setting_diffs(saved: dict | None, current: dict) -> dict[str, str]:
    """{LOSS_KEYS key: "data.key=new (checkpoint: old)"} for the keys this run changed (data.system_prompt only where
    its effective value changed)."""
    loss = {k: d for k in LOSS_KEYS for d in ckpt.config_diffs(saved, current, {"data": (k,)})}
    if "system_prompt" in loss and _same_effective_system_prompt(saved or {}, current):
        del loss["system_prompt"]
    return loss


def warn_data_changed(saved: dict | None, current: dict, path: Path) -> None:
    """Warn, before the data position is restored (which may refuse), when a resumed checkpoint was written over
    other data or batches: its position then points elsewhere (typically resume=auto finding an unrelated earlier
    run in the same train.out_dir)."""
    diffs = data_position_diffs(saved, current)
    if diffs:
        log.warning("resuming from %s, written with %s: its data position refers to other batches; if this is a "
                    "new run, set train.resume=none or another train.out_dir", path, ", ".join(diffs))


def warn_loss_settings_changed(saved: dict | None, current: dict, path: Path) -> None:
    """Warn, once the data position is restored (the same documents in the same batches), when the checkpoint was
    written with other LOSS_KEYS: the same batches then carry another loss."""
    loss = loss_setting_diffs(saved, current)
    if loss:
        log.warning("resumed from %s, written with %s: from here on the run trains or evaluates on other tokens "
                    "(%s), so its losses are not comparable with the checkpoint's; set the checkpoint's values to "
                    "continue its run, or train.resume=none for a new run", path, ", ".join(loss.values()),
                    "; ".join(LOSS_KEYS[k] for k in loss))


# LoRA settings that change what a checkpoint's adapter weights compute (scaling, which modules, which base): a
# resume under other values would continue from weights that mean something else
ADAPTER_KEYS = ("enabled", "rank", "alpha", "rslora", "targets", "modules_to_save")


def _module_sets(cfg: dict) -> dict:
    """``cfg`` with lora.targets and lora.modules_to_save as sorted sets: [v_proj, q_proj] adapts the modules
    [q_proj, v_proj] does (a resume under the other order was refused as computing something else)."""
    lora = dict(cfg.get("lora", {}))
    for key in ("targets", "modules_to_save"):
        if isinstance(lora.get(key), list):
            lora[key] = sorted(set(lora[key]))
    return {**cfg, "lora": lora}


# lora config key -> the list of the LoRA record (train.checkpoint_adapter.lora_settings) naming what it picked
PICKED = {"targets": "lora_modules", "modules_to_save": "saved_modules"}


def _picks_same(names, old_names, picked_then: list[str], picked_now: list[str] | None) -> bool:
    """Whether this run's lora.targets or lora.modules_to_save (``names``) picks the modules the checkpoint's run
    picked with ``old_names`` (``picked_then``): [self_attn.q_proj] and [q_proj] name the same modules of a decoder
    (PEFT's suffix rule), as may a regular expression. ``picked_now`` (what apply_lora picked in this run's model)
    decides; before the model is built (None) only a sure difference counts: a listed name matching none of the
    modules picked then, or new names matching fewer of them than the old names did (modules_to_save's list also
    holds tied partners, which no name picked: [embed_tokens] may stand for a tied [lm_head])."""
    from ..lora.inject import name_matches

    if picked_now is not None:
        return sorted(picked_then) == sorted(picked_now)
    listed = [names] if isinstance(names, str) else list(names or [])
    if isinstance(names, list) and any(not any(name_matches(m, [n]) for m in picked_then) for n in listed):
        return False
    named_then = [m for m in picked_then if old_names and name_matches(m, old_names)]
    named_now = [m for m in picked_then if listed and name_matches(m, names)]
    return len(named_now) >= len(named_then)


def _same_picks(saved: dict, current: dict, records: tuple[dict | None, dict | None]) -> dict:
    """``current`` with lora.targets / lora.modules_to_save set to the checkpoint's where they name the same modules
    in other words (``_picks_same``): resuming under them computes the same thing. ``records``: the checkpoint's
    LoRA record and this run's (None before the model is built); without the checkpoint's, the words are compared."""
    then, now = records
    if not isinstance(then, dict):
        return current
    lora = dict(current.get("lora", {}))
    for key, field in PICKED.items():
        old, new = saved.get("lora", {}).get(key), lora.get(key)
        picked = then.get(field)
        if old != new and isinstance(picked, list) and \
                _picks_same(new, old, picked, None if now is None else now.get(field, [])):
            lora[key] = old
    return {**current, "lora": lora}


def _adapter_diffs(saved: dict, current: dict, path: Path, base: bool = True,
                   records: tuple[dict | None, dict | None] = (None, None)) -> tuple[bool, list[str]]:
    """(whether either run is LoRA, the settings that differ: "key=old (this run: new)", model.path last where
    ``base`` and it differs); ValueError for a LoRA checkpoint under other adapter settings. ``records``: see
    _same_picks."""
    was, now = (bool(c.get("lora", {}).get("enabled")) for c in (saved, current))
    if was != now:
        kind = {True: "a LoRA run (lora.enabled true)", False: "a full fine-tuning run (lora.enabled false)"}
        raise ValueError(f"checkpoint {path} was written by {kind[was]}, and this run is {kind[now]}: its weights "
                         f"are not this run's trainable ones; set lora.enabled={str(was).lower()} to resume it, or "
                         "start over (train.resume=none or another train.out_dir)")
    lora = was
    if lora:
        current = _same_picks(saved, current, records)
    diffs = ckpt.config_diffs(_module_sets(saved), _module_sets(current), {"lora": ADAPTER_KEYS}) if lora else []
    old_path, new_path = saved.get("model", {}).get("path"), current.get("model", {}).get("path")
    moved = [f"model.path={old_path!r} (this run: {new_path!r})"] if (
        base and old_path is not None and not same_model(old_path, new_path)) else []
    if lora and diffs:
        raise ValueError(f"checkpoint {path} holds LoRA adapters trained with {', '.join(diffs + moved)}: under this "
                         "run's settings they would compute something else; resume with the checkpoint's values, or "
                         "start over (train.resume=none or another train.out_dir)")
    return lora, diffs + moved


def check_resume_adapter(cfg, out_dir: Path, now: dict | None = None) -> None:
    """Before the model loads and the data is tokenized (minutes for an 8B model): the ValueError check_same_adapter
    raises after the resume, for a LoRA checkpoint this run would continue under other adapter settings (lora.rank
    was refused only by load_checkpoint's shape check, after both). Another model.path is left to that later check:
    a path that does not exist is the load's to say. Called again with ``now`` (this run's LoRA record,
    lora_settings) once apply_lora has run, before the checkpoint's state is loaded: lora.targets / modules_to_save in
    other words are then compared by the modules they picked (another set failed as the optimizer's state not
    fitting, naming no key). The checkpoint's pickle is read, memory-mapped, not its tensors; one that cannot be
    read is left to the resume, which says why."""
    if cfg.train.resume == "none":
        return
    try:
        path = ckpt.latest_checkpoint(out_dir) if cfg.train.resume == "auto" else Path(cfg.train.resume).expanduser()
        if path is None:
            return
        file = path if path.is_file() else path / ckpt.STATE_FILE
        extra = ckpt._read_state(file, mmap=True).get("extra") or {}
    except (OSError, ValueError):
        return
    saved = extra.get("config")
    if isinstance(saved, dict):
        _adapter_diffs(saved, cfg.to_dict(), path, base=False, records=(extra.get("lora"), now))


# ModelConfig fields that do not change what the weights compute (token ids) or are config.json's other keys
NOT_ARCHITECTURE = ("extra", "bos_token_id", "eos_token_id", "pad_token_id")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SAMPLE = 1 << 16  # bytes read at each of 3 places of a weight file: 192 KiB a file, however large


def base_fingerprint(model) -> dict | None:
    """What a checkpoint records of the base its run trained on (checkpoint extra "base_fingerprint"), so that a
    resume tells a moved or copied base from another model without hashing gigabytes: {"config": the model's
    architecture (its ModelConfig less NOT_ARCHITECTURE), "files": _weight_files of its ``chronicals_base``, None
    for a model passed without one}; None without a ModelConfig."""
    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    arch = {k: v for k, v in dataclasses.asdict(config).items() if k not in NOT_ARCHITECTURE}
    return {"config": arch, "files": _weight_files(getattr(model, "chronicals_base", None))}


def _weight_files(base: str | None) -> dict[str, list] | None:
    """{file name: [bytes, sha256 of SAMPLE bytes at its start, middle and end]} for the weight files of model
    ``base`` (a .gguf file, or an HF directory's *.safetensors / *.bin); None when there is no base or it cannot be
    read. Sizes alone are the same for every model of one architecture and dtype (a fine-tune of the base): the
    middle and end samples are weights, which differ between two trainings."""
    import hashlib

    from ..models.loading import resolve_path

    if not base:
        return None
    try:
        where = resolve_path(base)
        files = [where] if where.is_file() else [f for f in sorted(where.iterdir()) if f.suffix in WEIGHT_SUFFIXES]
        out = {}
        for f in files:
            size, digest = f.stat().st_size, hashlib.sha256()
            with open(f, "rb") as fh:
                for at in (0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)):
                    fh.seek(at)
                    digest.update(fh.read(SAMPLE))
            out[f.name] = [size, digest.hexdigest()]
        return out or None
    except (OSError, ValueError):
        return None


def _base_words(path: Path, moved: str, bases: tuple[dict | None, dict | None]) -> str:
    """What a LoRA resume on another model.path continues on, from the checkpoint's base fingerprint and this
    run's (``bases``); ValueError when their architectures differ (the adapters' shapes may fit another model)."""
    then, now = bases
    if not (isinstance(then, dict) and isinstance(now, dict) and isinstance(then.get("config"), dict)):
        return ("the adapters fit this model's shapes; nothing more of the checkpoint's base is recorded (a "
                "checkpoint written before chronicals recorded it), so whether this is the same model is not known")
    # the keys both record: a field another chronicals version added or dropped is no difference of the models
    other = [f"{k}={v!r} (this run: {now['config'][k]!r})" for k, v in then["config"].items()
             if k in now["config"] and now["config"][k] != v]
    if other:
        raise ValueError(f"checkpoint {path} holds LoRA adapters trained on a model of another architecture "
                         f"({moved}; {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): on this run's model "
                         "they would compute something else; resume with the checkpoint's model.path, or start over "
                         "(train.resume=none or another train.out_dir)")
    old_files, new_files = then.get("files"), now.get("files")
    if not old_files or not new_files:
        return ("the same architecture; whether its weights are the checkpoint's base's is not known (one of them "
                "was passed to train() without its files)")
    if old_files == new_files:
        return ("the same files (its config, and its weight files' sizes and sampled bytes, are the checkpoint's "
                "base's: moved or copied), so the adapters go on as trained")
    differ = sorted(set(old_files) ^ set(new_files)) or [n for n in old_files if old_files[n] != new_files[n]]
    return (f"the same architecture with other weights ({', '.join(differ[:3])} differ): the adapters, trained on "
            "the checkpoint's base, go on from here on these weights; set model.path to that base to continue its "
            "run as it was")


def refuse_other_adapter(saved: dict | None, current: dict, path: Path,
                         records: tuple[dict | None, dict | None] = (None, None),
                         bases: tuple[dict | None, dict | None] = (None, None)) -> str | None:
    """check_same_adapter's refusals alone (ValueError), so the trainer can say "resumed from" only once they have
    passed; -> the warning check_same_adapter gives, or None."""
    if not saved:
        return None
    lora, diffs = _adapter_diffs(saved, current, path, records=records)
    if not diffs:
        return None
    # diffs is model.path alone here (other LoRA settings were refused above)
    what = _base_words(path, diffs[-1], bases) if lora else \
        "the checkpoint's weights replace every trainable weight of this run's model"
    return f"resumed from {path}, written with {', '.join(diffs)}: {what}"


def check_same_adapter(saved: dict | None, current: dict, path: Path,
                       records: tuple[dict | None, dict | None] = (None, None),
                       bases: tuple[dict | None, dict | None] = (None, None)) -> None:
    """A LoRA checkpoint resumes only under the lora settings it was trained with (ValueError naming the keys that
    differ: lora.targets / modules_to_save in other words for the same modules are the same: ``records`` = the
    checkpoint's LoRA record and this run's, lora_settings). Another model.path warns, saying whether it is the same
    model (moved or copied: its config and weight file sizes, ``bases`` = the checkpoint's base_fingerprint and this
    run's) or other weights of the same architecture; another architecture is refused. A full fine-tune's
    checkpoint holds every trainable weight, so another model.path of the same shapes only warns. Another
    model.dtype warns in either case (_warn_dtype_changed)."""
    said = refuse_other_adapter(saved, current, path, records, bases)
    if saved:
        _warn_dtype_changed(saved, current, path)
    if said:
        log.warning("%s", said)


BITS = {"bfloat16": 16, "float32": 32, "float64": 64}


def _weights_dtype(model: dict) -> str:
    """The dtype a run's weights had under its ``model`` section (setup.resolve_dtype): auto is bfloat16 on
    CUDA, float32 on CPU; a run with model.device=auto is taken to have run where this one does."""
    name, device = model.get("dtype", "auto"), str(model.get("device", "auto"))
    if name != "auto":
        return name
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if cuda else "float32"


def _warn_dtype_changed(saved: dict, current: dict, path: Path) -> None:
    """Warn when the checkpoint's weights were trained in another dtype than this run's: load_checkpoint casts
    them (float32 -> bfloat16 rounds every weight to 8 significant bits), and the steps after compute in the
    new one. A warning, not a refusal: a bf16 run continued from fp32 weights is a legitimate choice (memory)."""
    old_model, new_model = saved.get("model", {}), current.get("model", {})
    if "dtype" not in old_model:
        return
    old, new = _weights_dtype(old_model), _weights_dtype(new_model)
    if old == new:
        return
    # "'auto' = bfloat16": the setting as written, and what it meant where auto decided
    shown = [repr(m["dtype"]) + ("" if m["dtype"] == d else f" = {d}") for m, d in ((old_model, old), (new_model, new))]
    cast = ("rounded to" if BITS.get(new, 0) < BITS.get(old, 0) else
            "loaded from its fp32 master weights where it kept them (optim.master_weights), else widened, as")
    log.warning("resumed from %s, written with model.dtype=%s (this run: %s): the checkpoint's %s weights are %s %s "
                "and every step from here on computes in %s, so the loss moves at the resume; set model.dtype=%s to "
                "continue its run as it was, or train.resume=none for a new run", path, shown[0], shown[1], old,
                cast, new, new, old)
