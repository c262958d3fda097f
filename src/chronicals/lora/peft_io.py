"""Adapters in PEFT's on-disk format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are PEFT's, without the adapter name: ``base_model.model.<module>.lora_A.weight`` (r, in),
``base_model.model.<module>.lora_B.weight`` (out, r), and ``base_model.model.<module>.<param>`` for the
modules trained in full (modules_to_save). Because our module names are Hugging Face's, ``<module>`` is
the same string in our model and in transformers', so ``peft.PeftModel.from_pretrained(hf_model, dir)``
and ``load_adapter(our_model, dir)`` read the same file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn as nn

from .._jsonio import read_json_object
from ..models.hf_io import atomic_dir, load_safetensors, safetensors_shapes, save_safetensors
from ..models.loading import missing_checkpoint
from .group import unbind_groups
from .inject import LoraRecord, _set_module, apply_lora, check_lora, lora_modules, meta_lora_copy, name_matches

log = logging.getLogger("chronicals.lora")
PREFIX = "base_model.model."
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
# PEFT options we do not implement: loading an adapter that uses one must fail, not load it wrong.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
                "layers_to_transform": None, "lora_bias": False, "target_parameters": None,
                "layer_replication": None, "trainable_token_indices": None, "exclude_modules": None}
# PEFT's LoRA variants (not written by save_adapter: older PEFT versions refuse fields they do not know). Each computes
# something other than x W^T + s x A^T B^T, or (KaSA) rewrites W: aLoRA's adapter acts only from its invocation tokens
# on (loaded as plain LoRA: logits 0.35 off PEFT's at the test's shape); the others carry tensors of their own (QA-LoRA:
# an A over pooled inputs, on GPTQ models), refused by key or shape as 'saved for a different model?'.
_VARIANTS = {"alora_invocation_tokens": None, "use_qalora": False, "kasa_config": None, "velora_config": None,
             "monteclora_config": None, "use_bdlora": None, "arrow_config": None}
# init_lora_weights values that only set A and B (which the file then overwrites); the others rewrite the base
# weights when PEFT initializes (PiSSA, OLoRA, CorDA, LoRA-GA: W - s B0 A0; LoftQ: W quantized), so the saved A and B
# hold only on that changed base: loaded on the original one, PiSSA's logits were 0.09 off PEFT's at the test's shape
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica")  # and True (PEFT's default), False (random B too)
# every other field of PEFT's LoraConfig (0.21) and PeftConfig: settings that do not change the adapter's outputs.
# A field outside all these lists (a PEFT newer than this code) with a value set is refused: it may be a variant.
_INERT = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
          "peft_version", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "modules_to_save",
          "init_lora_weights", "layers_pattern", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
          "megatron_config", "megatron_core", "qalora_group_size", "runtime_config", "ensure_weight_tying",
          "bias"}  # checked on its own: "none", or "all" / "lora_only" where they train no bias (_check_bias)
_BIAS_MODES = ("none", "all", "lora_only")


def _require_record(model: nn.Module, who: str) -> LoraRecord:
    rec = getattr(model, "lora_config", None)
    if rec is None:
        raise ValueError(f"{who}: the model has no LoRA adapters; call apply_lora(model, ...) or load_adapter first")
    return rec


def adapter_config_dict(rec: LoraRecord, base_model_name_or_path: str | None = None) -> dict:
    """The adapter_config.json PEFT reads for this record."""
    targets = rec.target_modules if isinstance(rec.target_modules, str) else sorted(rec.target_modules)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": rec.r, "lora_alpha": rec.alpha, "lora_dropout": rec.dropout, "use_rslora": rec.use_rslora,
        "target_modules": targets, "modules_to_save": list(rec.saved_modules) or None,
        "init_lora_weights": True, "inference_mode": True, "revision": None, "auto_mapping": None,
        "layers_pattern": None, "bias": "none", **_UNSUPPORTED,
    }


def adapter_state_dict(model: nn.Module, value=None) -> dict[str, torch.Tensor]:
    """PEFT-named tensors (contiguous CPU copies; tied tensors copied per key, as safetensors requires).
    ``value(parameter) -> tensor``: what to write for each parameter (default: the parameter itself; the trainer
    passes its optimizer's fp32 masters of bf16 adapters)."""
    rec = _require_record(model, "adapter_state_dict")
    value = value or (lambda p: p)

    def copy(p: torch.Tensor) -> torch.Tensor:
        t = value(p)
        if t.shape != p.shape:
            raise ValueError(f"adapter_state_dict: value() gave a tensor of shape {tuple(t.shape)} for a parameter "
                             f"of shape {tuple(p.shape)}")
        return t.detach().cpu().clone().contiguous()

    out = {}
    for name, mod in lora_modules(model):
        out[f"{PREFIX}{name}.lora_A.weight"] = copy(mod.lora_A.weight)
        out[f"{PREFIX}{name}.lora_B.weight"] = copy(mod.lora_B.weight)
    for name in rec.saved_modules:
        for pname, p in model.get_submodule(name).named_parameters():
            out[f"{PREFIX}{name}.{pname}"] = copy(p)
    return out


def save_adapter(model: nn.Module, out_dir, base_model_name_or_path: str | None = None, value=None) -> Path:
    """Write ``out_dir``/adapter_config.json and adapter_model.safetensors atomically (``models.hf_io.atomic_dir``:
    a temporary directory beside ``out_dir`` renamed into place, so a crash never leaves half an adapter). An
    existing ``out_dir`` is replaced when it holds nothing but those two files; else FileExistsError.
    ``value``: as ``adapter_state_dict``'s. ``base_model_name_or_path`` None: the model's own record
    (``model.chronicals_base``, which load_model sets), so that export, chat and eval --adapter find the base."""
    rec = _require_record(model, "save_adapter")
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "chronicals_base", None)
    out = Path(out_dir).expanduser()  # the path returned is the one written (it was "~/a")
    with atomic_dir(out, owned=(CONFIG_NAME, WEIGHTS_NAME)) as tmp:
        save_safetensors(adapter_state_dict(model, value), tmp / WEIGHTS_NAME)
        base = None if base_model_name_or_path is None else str(base_model_name_or_path)  # a Path: TypeError
        (tmp / CONFIG_NAME).write_text(json.dumps(adapter_config_dict(rec, base), indent=2))
    log.info("save_adapter: %d LoRA modules, %d full modules -> %s", len(rec.lora_modules),
             len(rec.saved_modules), out)
    return out


def read_adapter_config(adapter_dir) -> dict:
    """adapter_config.json of a PEFT LoRA adapter directory (``~`` expanded, as load_model and save_adapter do),
    checked: a field chronicals.lora cannot compute as PEFT does is a ValueError naming it."""
    adapter_dir = Path(adapter_dir).expanduser()  # '~/a' was 'no such directory' while save_adapter wrote there
    if adapter_dir.is_file():  # "x/adapter_config.json/adapter_config.json: not found" named no fix
        raise ValueError(f"{adapter_dir}: is a file; an adapter is the directory holding {CONFIG_NAME} and "
                         f"{WEIGHTS_NAME} (pass {adapter_dir.parent})")
    if not adapter_dir.exists():  # "nosuchdir/adapter_config.json: not found" hid the typo in the directory
        # a running train's keep_last pruning removed it (a concurrency walk: it was described as a PEFT adapter)
        missing_checkpoint(adapter_dir)
        raise FileNotFoundError(f"{adapter_dir}: no such directory; an adapter is the directory holding {CONFIG_NAME} "
                                f"and {WEIGHTS_NAME} (e.g. runs/demo/adapter)")
    path = adapter_dir / CONFIG_NAME
    missing = f"a PEFT adapter directory holds {CONFIG_NAME} and {WEIGHTS_NAME}"
    if (adapter_dir / "adapter" / CONFIG_NAME).is_file():  # --adapter runs/demo: the run's adapter is in it
        missing += f"; {adapter_dir} holds one in its adapter folder: pass {adapter_dir / 'adapter'}"
    elif (adapter_dir / "config.json").is_file():  # --adapter of a merged or full fine-tuned model
        missing = ("this is a model directory (config.json), not a LoRA adapter: pass it as --model (chat, eval, export), "
                   "without --adapter (export --model writes it out again; there is no adapter to merge)")
    elif steps := sorted(adapter_dir.glob("step-*/state.pt")) or sorted(adapter_dir.glob("checkpoints/step-*/state.pt")):
        # --adapter runs/x/checkpoints, or runs/x of a run with no adapter yet (still training)
        missing += (f"; {adapter_dir} holds a run's training checkpoints: pass one, e.g. {steps[-1].parent} (a LoRA "
                    "run's as --adapter, a full fine-tuning run's as --model; in Python, "
                    "chronicals.train.apply_checkpoint_adapter(model, path) or load_checkpoint_model(path))")
    elif (adapter_dir / "state.pt").is_file():  # load_adapter(model, runs/x/checkpoints/step-N): said nothing more
        missing += (f"; {adapter_dir} is a training checkpoint (state.pt), not a PEFT adapter: the commands take it "
                    "as --adapter (a LoRA run's) or --model (a full fine-tuning run's); in Python, "
                    "chronicals.train.apply_checkpoint_adapter(model, path) puts a LoRA run's adapter on its base, or "
                    "write its PEFT adapter with chronicals export --no-merge --adapter PATH --out DIR")
    elif adapter_dir.parent.name == "checkpoints" and adapter_dir.name.startswith("step-"):
        missing = (f"{adapter_dir} is a run's checkpoint directory without its state.pt (a removal or a write cut "
                   f"short): pass another of {adapter_dir.parent}'s checkpoints, or the run's adapter folder")
    cfg = read_json_object(path, CONFIG_NAME, "save the adapter again (save_adapter / PEFT's save_pretrained)",
                           missing=missing)
    # peft_type before the LoRA fields: a LoHa (alpha) or IA3 (no r) adapter was told it missed lora_alpha
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type={cfg['peft_type']!r}; only LORA adapters can be loaded: merge it with "
                         "PEFT first (merge_and_unload) and load the merged model")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}; a PEFT LoRA adapter_config.json has "
                         "r, lora_alpha and target_modules")
    targets, saved = cfg["target_modules"], cfg.get("modules_to_save")
    if not (isinstance(targets, str) or isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{path}: target_modules={targets!r} must be a list of module names (such as "
                         "[\"q_proj\", \"v_proj\"]) or one regular expression string")
    if saved is not None and not (isinstance(saved, list) and all(isinstance(t, str) for t in saved)):
        raise ValueError(f"{path}: modules_to_save={saved!r} must be a list of module names (such as "
                         "[\"lm_head\"]) or null")
    for key, same in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        pattern = cfg.get(key)
        if isinstance(pattern, dict) and pattern and all(v == cfg[same] for v in pattern.values()):
            cfg = {**cfg, key: {}}  # every listed module at the global value: it changes nothing
    for key, default in {**_UNSUPPORTED, **_VARIANTS}.items():
        val = cfg.get(key, default)
        if val not in (default, None) and not (isinstance(default, dict) and not val):
            raise ValueError(f"{path}: {key}={val!r} is not supported by chronicals.lora "
                             f"(supported: {key}={default!r}); merge it with PEFT first (merge_and_unload)")
    bias = cfg.get("bias", "none")
    if bias is not None and bias not in _BIAS_MODES:
        raise ValueError(f"{path}: bias={bias!r} is not one of PEFT's values ({', '.join(map(repr, _BIAS_MODES))})")
    init = cfg.get("init_lora_weights", True)
    if not (init is None or isinstance(init, bool) or isinstance(init, str) and init in _PLAIN_INITS):
        raise ValueError(f"{path}: init_lora_weights={init!r} is not supported by chronicals.lora (supported: true, "
                         f"false, {', '.join(map(repr, _PLAIN_INITS))}): PEFT's other initializations rewrite the "
                         "base weights (PiSSA, OLoRA, CorDA, LoRA-GA: W - s B0 A0; LoftQ: W quantized), so such an "
                         "adapter's A and B hold only on that changed base; convert it to a plain "
                         "LoRA adapter with PEFT (save_pretrained(..., path_initial_model_for_weight_conversion=<the "
                         "initial adapter>)) or merge it with PEFT first (merge_and_unload)")
    unknown = sorted(k for k in cfg if k not in _INERT and k not in _UNSUPPORTED and k not in _VARIANTS
                     and cfg[k] not in (None, False, "") and cfg[k] != {} and cfg[k] != [])
    if unknown:
        raise ValueError(f"{path}: {unknown[0]}={cfg[unknown[0]]!r} is not supported by chronicals.lora (a field it "
                         "does not know, perhaps a LoRA variant of a newer PEFT; unknown fields set: "
                         f"{', '.join(unknown)}); merge it with PEFT first (merge_and_unload), or remove the field "
                         "if it does not change what the adapter computes")
    return cfg


def _untie_if_partial(model: nn.Module, rec: LoraRecord, keys: set[str]) -> str | None:
    """PEFT saved only one of two tied modules (e.g. lm_head): it trained a private copy of that module.
    Do the same: give the saved module its own Parameter, leave the partner on the frozen base tensor. Returns
    the warning to give once the file is accepted (a refused one is undone: its warning would be wrong)."""
    in_file = [n for n in rec.saved_modules if any(k.startswith(f"{PREFIX}{n}.") for k in keys)]
    shared = {id(p) for n in in_file for p in model.get_submodule(n).parameters(recurse=False)}
    absent = [n for n in rec.saved_modules if n not in in_file
              and any(id(p) in shared for p in model.get_submodule(n).parameters(recurse=False))]
    if not absent:
        return None  # nothing tied is half-saved (a module missing for another reason fails the key check)
    present = [n for n in rec.saved_modules if n not in absent]
    for name in absent:
        for p in model.get_submodule(name).parameters(recurse=False):
            p.requires_grad_(False)
    for name in present:
        mod = model.get_submodule(name)
        for pname, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, pname, nn.Parameter(p.detach().clone(), requires_grad=True))
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    rec.saved_modules = present
    return f"load_adapter: the adapter trains {present} but not its tied partner(s) {absent}; untied them as PEFT does"


def saved_param_owners(model: nn.Module, rec: LoraRecord) -> dict[int, list[tuple[str, str]]]:
    """id(Parameter) -> [(module, parameter name)] over the saved modules' own parameters: a tied pair (lm_head,
    embed_tokens) shares one entry of two owners."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for name in rec.saved_modules:
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, pname))
    return owners


def _untie_if_different(model: nn.Module, rec: LoraRecord, tensors: dict[str, torch.Tensor]) -> str | None:
    """PEFT trains a private copy of each module of modules_to_save, tied or not: a file holding both tied
    partners (lm_head and embed_tokens) with different values trained two tensors. Loaded into the one shared
    Parameter, the last key read won and the other module ran with its partner's values (logits far from
    PEFT's). Give each its own Parameter then; equal values (save_adapter's) stay tied. Returns the warning, as
    _untie_if_partial."""
    owners = saved_param_owners(model, rec)
    untied = []
    for group in owners.values():
        keys = [f"{PREFIX}{n}.{pn}" for n, pn in group]
        if len(group) < 2 or not all(k in tensors for k in keys) or \
                all(torch.equal(tensors[keys[0]], tensors[k]) for k in keys[1:]):
            continue
        for name, pname in group[1:]:
            mod = model.get_submodule(name)
            setattr(mod, pname, nn.Parameter(getattr(mod, pname).detach().clone(), requires_grad=True))
        untied += [n for n, _ in group]
    if not untied:
        return None
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    return f"load_adapter: the adapter trains tied modules {untied} with different values; untied them as PEFT does"


def _check_bias(model: nn.Module, cfg: dict, path: Path) -> None:
    """PEFT's ``bias`` option trains base biases and saves them beside A and B: "all" every bias of the model,
    "lora_only" those of the LoRA target modules. chronicals.lora trains and saves none, so it loads such an adapter
    only where the option trains nothing: on a model without those biases (Llama, Mistral, SmolLM2; PEFT then saves
    none) it is "none" and loads. Refused before were adapters that differ from "none" in nothing."""
    bias = cfg.get("bias") or "none"
    if bias == "none":
        return
    targets = cfg["target_modules"] if isinstance(cfg["target_modules"], str) else tuple(cfg["target_modules"])
    trained = [f"{n}.bias" for n, m in model.named_modules() if isinstance(getattr(m, "bias", None), nn.Parameter)
               and (bias == "all" or isinstance(m, nn.Linear) and name_matches(n, targets))]
    if trained:
        raise ValueError(f"{path}: bias={bias!r} trains {len(trained)} bias(es) of this model (such as "
                         f"{trained[0]}), which chronicals.lora does not load or train (supported: bias='none', or "
                         "'all' / 'lora_only' on a model without those biases); merge it with PEFT first "
                         "(merge_and_unload)")


def _peft_modules_to_save(model: nn.Module, entries, saved_keys=(), warn: bool = True) -> tuple[str, ...]:
    """The full names of the modules PEFT trains for an adapter_config.json's ``modules_to_save``. PEFT <= 0.21
    matches an entry as a plain suffix of the module's name in the PeftModel (``key.endswith(entry)``): "norm" is
    model.norm and every layer's input_layernorm and post_attention_layernorm, whose saved tensors were 'unexpected
    keys' here. PEFT 0.22 matches at a dot (``_is_valid_match``): "norm" is model.norm alone. The file tells them
    apart: a module only the plain suffix matches is read as trained when ``saved_keys`` (the file's tensor names)
    hold a tensor of it, else the dot match is taken. An entry matching nothing is left out with a warning (unless
    ``warn`` is False: ``check_adapter``, which load_adapter follows), as PEFT skips it (a sequence-classification
    "score" in a causal LM's file); tensors saved under it stay unexpected keys."""
    names = [n for n, _ in model.named_modules() if n]

    def suffix(n: str, e: str) -> bool:  # PEFT <= 0.21
        return (PREFIX + n).endswith(e)

    def at_dot(n: str, e: str) -> bool:  # PEFT 0.22
        return (PREFIX + n) == e or (PREFIX + n).endswith("." + e)

    only_suffix = [n for n in names if any(suffix(n, e) for e in entries) and not any(at_dot(n, e) for e in entries)]
    in_file = any(k.startswith(f"{PREFIX}{n}.") for n in only_suffix for k in saved_keys)
    match = suffix if in_file or not only_suffix else at_dot
    out = [n for n in names if any(match(n, e) for e in entries)]
    unmatched = [e for e in entries if not any(match(n, e) for n in names)]
    if unmatched and warn:
        log.warning("load_adapter: modules_to_save entries %s match no module of this model; left out, as PEFT "
                    "does", unmatched)
    return tuple(out)


def loaded_adapter_dtype(model: nn.Module, adapter_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype of A and B for an adapter put on ``model`` to be used (load_adapter, a checkpoint's adapter):
    ``adapter_dtype`` when given, else float32 on a model with bf16 or fp16 weights, else None (the base's).

    float32 is PEFT's default there (``autocast_adapter_dtype=True``): the file's fp32 values are kept (a merge
    rounds W + s B A once, a save writes them back unchanged) and their branch runs in fp32
    (``LoRALinear.forward``). Rounded to bf16 when loaded (before), a merge gave other bits in 46% of the merged
    elements, and the logits' mean error against float64 was 1.23x PEFT's (1.36x on fp16), where it is now 1.01x
    (tests/lora/test_adapter_dtype.py)."""
    if adapter_dtype is not None:
        return adapter_dtype
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
    return torch.float32 if low else None


def _weights_file(adapter_dir: Path) -> Path:
    """``adapter_dir``'s adapter_model.safetensors; an error naming it and the fix when it is missing or a folder."""
    wpath = adapter_dir / WEIGHTS_NAME
    if wpath.is_dir():
        raise ValueError(f"{wpath}: is a directory, not a file; save the adapter again")
    if not wpath.is_file():
        bin_file = adapter_dir / "adapter_model.bin"  # PEFT has no converter command: say the two calls
        fix = (f"; {bin_file.name} is there: rewrite it as safetensors with PEFT, PeftModel.from_pretrained(base, "
               f"'{adapter_dir}') then .save_pretrained(OUT, safe_serialization=True)" if bin_file.is_file() else "")
        raise FileNotFoundError(f"{wpath}: not found (only safetensors adapters are read){fix}")
    return wpath


def _lora_arguments(model: nn.Module, cfg: dict, adapter_dir: Path, saved_keys, impl: str,
                    adapter_dtype: torch.dtype | None, warn: bool = True) -> dict:
    """apply_lora's keyword arguments for adapter_config.json ``cfg`` (read_adapter_config's) on ``model``, checked
    without changing it: PEFT's bias option (``_check_bias``), then apply_lora's checks (``check_lora``), whose
    errors are about the file's values and name it. ``saved_keys``: the weights file's tensor names
    (``_peft_modules_to_save``); ``warn``: its warning of entries left out."""
    _check_bias(model, cfg, adapter_dir / CONFIG_NAME)
    targets = cfg["target_modules"]
    arguments = dict(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                     target_modules=targets if isinstance(targets, str) else tuple(targets),
                     use_rslora=cfg.get("use_rslora", False),
                     modules_to_save=_peft_modules_to_save(model, cfg.get("modules_to_save") or (), saved_keys, warn),
                     impl=impl, adapter_dtype=loaded_adapter_dtype(model, adapter_dtype))
    try:
        check_lora(model, **arguments)
    except ValueError as e:
        said = str(e)
        if "LoRA on lm_head" in said or "not nn.Linear" in said:  # advice for training is no fix for a PEFT file
            said += ("; for this adapter file: merge it into its base with PEFT (PeftModel.from_pretrained(base, "
                     "dir).merge_and_unload(), then save_pretrained) and load the merged model")
        raise ValueError(f"{adapter_dir / CONFIG_NAME}: {said}") from None
    return arguments


def check_adapter(model: nn.Module, adapter_dir, *, impl: str = "fused",
                  adapter_dtype: torch.dtype | None = None) -> None:
    """The refusals ``load_adapter(model, adapter_dir)`` makes before it reads a tensor's values, made in its words
    and with ``model`` left as it is: adapter_config.json's fields (``read_adapter_config``), the weights file
    (there, and a readable safetensors header), PEFT's bias option and the names against the model's modules
    (``check_lora``), then the file's tensor names and shapes (from its header) against those LoRA puts on the model
    (``meta_lora_copy``: a copy on the meta device, adapted) with ``_file_fits``, load_adapter's own check. Module
    names, kinds and shapes are all it reads of ``model``: it may be the decoder built on the meta device from its
    config (``chronicals eval --adapter`` checks so before it reads its data and the weights load).
    Left to load_adapter: the tensors' values and dtypes."""
    adapter_dir = Path(adapter_dir).expanduser()
    cfg = read_adapter_config(adapter_dir)
    wpath = _weights_file(adapter_dir)
    shapes = safetensors_shapes(wpath)
    # warn=False: load_adapter, which follows, warns of entries it leaves out (once)
    arguments = _lora_arguments(model, cfg, adapter_dir, shapes, impl, adapter_dtype, warn=False)
    shadow = meta_lora_copy(model, **arguments)
    _untie_if_partial(shadow, shadow.lora_config, set(shapes))  # as _fill: its names are those the file must hold
    _file_fits(shadow, shadow.lora_config, shapes, wpath)


def load_adapter(model: nn.Module, adapter_dir, *, impl: str = "fused",
                 adapter_dtype: torch.dtype | None = None) -> LoraRecord:
    """Apply LoRA to ``model`` with the adapter's config and load its tensors (strictly: a missing or
    unexpected key, or a shape mismatch, raises). ``adapter_dtype``: A and B's dtype; None: float32 on a bf16 or
    fp16 model, as PEFT keeps them, else the base's (``loaded_adapter_dtype``)."""
    adapter_dir = Path(adapter_dir).expanduser()
    if getattr(model, "lora_config", None) is not None:  # apply_lora's own error named a call the user never made
        raise RuntimeError(f"load_adapter: this model already has LoRA adapters (model.lora_config); load "
                           f"{adapter_dir} into a model as loaded (chronicals.load_model), or merge_lora(model) first "
                           "to put it on the merged weights")
    cfg = read_adapter_config(adapter_dir)
    wpath = _weights_file(adapter_dir)
    tensors = load_safetensors(wpath)  # a truncated or corrupt file: ValueError naming it
    for key, t in tensors.items():  # an integer tensor was cast into the adapter silently
        if not t.is_floating_point():
            raise ValueError(f"{wpath}: tensor {key} is stored as {t.dtype}, not as floating point; save the "
                             "adapter again (a quantized adapter must be dequantized with PEFT first)")
        if not bool(torch.isfinite(t).all()):  # chat answered '' and export wrote a model of NaN, all with exit 0
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{wpath}: tensor {key} holds {bad} NaN or infinite value(s) of {t.numel()}; the "
                             "adapter is damaged (saved from a run that diverged?): use an earlier checkpoint of "
                             "its run, or train it again")
    arguments = _lora_arguments(model, cfg, adapter_dir, tensors, impl, adapter_dtype)  # checked: apply_lora takes them
    undo = _Undo(model)
    rec = apply_lora(model, **arguments)
    try:
        _fill(model, rec, tensors, wpath)
    except BaseException:
        undo(rec)
        raise
    log.info("load_adapter: %s -> %d LoRA modules, %d full modules", adapter_dir, len(rec.lora_modules),
             len(rec.saved_modules))
    return rec


def _fill(model: nn.Module, rec: LoraRecord, tensors: dict[str, torch.Tensor], wpath: Path) -> None:
    """Untie as PEFT does, check every key and shape, then copy: nothing is written unless all of them fit."""
    said = [_untie_if_partial(model, rec, set(tensors)), _untie_if_different(model, rec, tensors)]
    expected = _file_fits(model, rec, {k: tuple(t.shape) for k, t in tensors.items()}, wpath)
    for warning in filter(None, said):  # the file fits: the untying stays
        log.warning("%s", warning)
    with torch.no_grad():
        for key, p in expected.items():
            p.copy_(tensors[key])


def _file_fits(model: nn.Module, rec: LoraRecord, shapes: dict[str, tuple[int, ...]],
               wpath: Path) -> dict[str, nn.Parameter]:
    """The adapted ``model``'s parameters by PEFT key, once the file ``wpath``'s tensor names and ``shapes`` are
    checked against them: a missing or unexpected key, or a shape mismatch, is a ValueError naming the file.
    load_adapter checks the file so before it copies a tensor; check_adapter, with the shapes of its header, against
    a copy of the model on the meta device (``meta_lora_copy``) before the weights load."""
    expected = {}
    for name, mod in lora_modules(model):
        expected[f"{PREFIX}{name}.lora_A.weight"] = mod.lora_A.weight
        expected[f"{PREFIX}{name}.lora_B.weight"] = mod.lora_B.weight
    for name in rec.saved_modules:
        for pname, p in model.get_submodule(name).named_parameters():
            expected[f"{PREFIX}{name}.{pname}"] = p
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        # PEFT's save_embedding_layers=True (its "auto" after resize_token_embeddings) writes the whole embedding
        # and head outside modules_to_save: "a different model?" was the wrong diagnosis (a LoRA walk)
        layers = [k for k in unexpected if k.endswith(("embed_tokens.weight", "lm_head.weight"))
                  and k.removeprefix(PREFIX).rsplit(".", 1)[0] not in rec.saved_modules]
        if not missing and layers and len(layers) == len(unexpected):
            raise ValueError(f"load_adapter {wpath}: the adapter holds whole embedding layers outside its "
                             f"modules_to_save ({', '.join(layers)}): PEFT's save_pretrained(save_embedding_layers="
                             "True), or 'auto' after resize_token_embeddings. chronicals does not load these; save "
                             "the adapter again with the layers in modules_to_save (or save_embedding_layers=False "
                             "if the vocabulary was not resized), or merge it with PEFT and load the merged model")
        raise ValueError(f"load_adapter {wpath}: missing keys {missing[:4]} ({len(missing)}), unexpected keys "
                         f"{unexpected[:4]} ({len(unexpected)}); was it saved for a different model?")
    for key, p in expected.items():
        if tuple(shapes[key]) != tuple(p.shape):
            raise ValueError(f"load_adapter {wpath}: {key} has shape {tuple(shapes[key])}, the model expects "
                             f"{tuple(p.shape)} (r={rec.r}); was it saved for a different model?")
    return expected


class _Undo:
    """What load_adapter changes past apply_lora, recorded before it, so that a refused file leaves the model as it
    was. Left half-done, the model kept LoRA (a second load_adapter then said 'call merge_lora(model) first', which
    merged the refused file's adapter into W) and the modules_to_save tensors copied before the bad key (base
    weights, trained in full)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())  # the nn.Linear objects apply_lora replaces, on the same Parameters
        self.params = [(m, n, p) for m in model.modules() for n, p in m._parameters.items()]  # _untie_* rebinds
        self.flags = [(p, p.requires_grad) for _, _, p in self.params if p is not None]
        self.config = getattr(model, "config", None)
        self.tied = getattr(self.config, "tie_word_embeddings", None)

    @torch.no_grad()
    def __call__(self, rec: LoraRecord) -> None:
        unbind_groups(self.model)
        for name in rec.lora_modules:  # W leaves the [W | s B] or group buffer for a storage of its own
            lin = self.modules[name]
            _set_module(self.model, name, lin)
            lin.weight.data = lin.weight.data.clone(memory_format=torch.contiguous_format)
        for mod, pname, p in self.params:
            if mod._parameters.get(pname) is not p:
                setattr(mod, pname, p)
        for p, flag in self.flags:
            p.requires_grad_(flag)
        if self.tied is not None:
            self.config.tie_word_embeddings = self.tied
        self.model.__dict__.pop("lora_config", None)
