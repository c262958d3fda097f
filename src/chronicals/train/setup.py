"""Setting up a run from its config: device and dtype, the model (+ LoRA), and the data loaders."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from .._words import counted
from ..config import DEMO, DEMO_SYSTEM_PROMPT, ConfigError, TrainConfig
from ..models.loading import recorded_name
from . import qa as qa_mod

log = logging.getLogger("chronicals.train")


def resolve_device(name: str, key: str = "model.device") -> torch.device:
    """auto | cpu | cuda | cuda:N -> a device; ``key`` names the setting in errors (a config key, a CLI flag):
    a ConfigError (exit status 2), since a setting this machine cannot run is a bad value here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{key}={name} is not a device; use auto, cpu, cuda or cuda:N", key) from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{key}={name}: chronicals runs on cpu or cuda; use auto, cpu, cuda or cuda:N", key)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name} but no CUDA device is visible; use {key}=cpu", key)
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()  # else "CUDA error: invalid device ordinal" at the first move, exit 4
        raise ConfigError(f"{key}={name} but {n} CUDA device{'s are' if n > 1 else ' is'} visible "
                          f"(cuda:0{f'..cuda:{n - 1}' if n > 1 else ''}); use {key}=cuda or one of those", key)
    return dev


def packing_line(st: dict) -> str:
    """PackedLoader.stats in words: "packed into 44 rows: 10,274 tokens in 11,264 slots (91.2% full), 3,154 with
    loss (efficiency 28.0%)" (the demo's). It logged the dict, efficiency 0.2800071022727273 included."""
    # slots >= tokens >= 2: a kept document has a loss token, so 2 tokens at least (the plural nouns hold)
    return (f"packed into {counted(st['rows'], 'row')}: {st['tokens']:,} tokens in {st['slots']:,} slots "
            f"({st['fill']:.1%} full), {st['loss_tokens']:,} with loss (efficiency {st['efficiency']:.1%})")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 weights on CUDA (tensor cores, half the memory), fp32 on CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def prepare_model(model, cfg: TrainConfig, device: torch.device, dtype: torch.dtype):
    """Move to device/dtype, set impl and checkpointing, inject LoRA (or unfreeze all), compile layers."""
    from ..models.decoder import check_trains_as_transformers

    if getattr(model, "config", None) is not None:  # before the model is touched (its first step refused it)
        check_trains_as_transformers(model.config)
    if cfg.lora.enabled and getattr(model, "lora_config", None) is not None:
        _check_adapters_fit(model, cfg)  # before the model is touched
        _check_only_adapters_train(model)
    elif cfg.lora.enabled:
        _check_lora_fits(model, cfg)  # before the model is touched too (a model passed to train() is left as it was)
    model.to(device=device, dtype=dtype)
    model.set_impl(cfg.model.impl)
    n_layers = len(model.model.layers)
    if cfg.model.checkpoint_layers > n_layers:
        log.warning("model.checkpoint_layers=%d but the model has %d decoder layers: all of them are checkpointed",
                    cfg.model.checkpoint_layers, n_layers)
    if cfg.model.gate_up_layers > n_layers:  # as checkpoint_layers: silent before (a full fine-tuning walk)
        log.warning("model.gate_up_layers=%d but the model has %d decoder layers: all of them rebuild gate|up",
                    cfg.model.gate_up_layers, n_layers)
    model.set_checkpointing(cfg.model.checkpoint_setting)
    model.set_recompute(cfg.model.recompute, cfg.model.gate_up_layers)
    model.opts.loss_vocab_parts = cfg.model.loss_vocab_parts
    model.opts.attention = cfg.model.attention
    if cfg.lora.enabled:
        from ..lora.inject import apply_lora

        if getattr(model, "lora_config", None) is None:  # its names were checked above (_check_lora_fits)
            apply_lora(model, **_apply_lora_kwargs(cfg))
    else:
        from dataclasses import asdict

        from ..config import LoraSection

        if getattr(model, "lora_config", None) is not None:  # its frozen base would fail at the first step
            raise ConfigError("the model passed to train() has LoRA adapters (model.lora_config) but lora.enabled=false "
                              "asks for full fine-tuning; set lora.enabled=true to train the adapters, or merge them "
                              "first (chronicals.lora.merge_lora(model)) to fine-tune the merged model in full",
                              "lora.enabled")
        defaults = asdict(LoraSection())
        set_keys = [f"lora.{k}" for k, v in asdict(cfg.lora).items() if k != "enabled" and v != defaults[k]]
        if set_keys:  # a recipe switched to full fine-tuning, or a typo'd lora.enabled
            log.warning("%s set, but lora.enabled=false: full fine-tuning, no adapters; drop them or set "
                        "lora.enabled=true", ", ".join(set_keys))
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:  # they were unfrozen without a word (a full fine-tuning walk)
            log.warning("full fine-tuning trains every weight: %d parameter tensors frozen in the model passed "
                        "(e.g. %s) train too; for adapters only, set lora.enabled=true", len(frozen),
                        ", ".join(frozen[:3]))
        for p in model.parameters():
            p.requires_grad_(True)
    if cfg.model.compile:
        model.compile_layers()
        log.info("torch.compile on %d decoder layers (model.recompute off: the compiler plans recomputation)",
                 len(model.model.layers))
    model.train()
    return model


def _apply_lora_kwargs(cfg: TrainConfig) -> dict:
    """apply_lora's keyword arguments for the config's lora section (prepare_model applies them; the checks of
    ``_check_lora_fits`` are made with the same ones)."""
    return dict(r=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, target_modules=tuple(cfg.lora.targets),
                use_rslora=cfg.lora.rslora, seed=cfg.train.seed, group=cfg.lora.group,
                modules_to_save=tuple(cfg.lora.modules_to_save))


def _check_lora_fits(model, cfg: TrainConfig) -> None:
    """ConfigError naming the key when a lora.targets or lora.modules_to_save name matches no module of ``model`` (or
    one of the wrong kind): apply_lora's checks (``lora.inject.check_lora``), which read module names and kinds only,
    so ``model`` may be one built on the meta device from its config (``check_config_fits``, before the data)."""
    from ..lora.inject import check_lora, linear_names, unmatched_targets

    # a model built in the program records no base: the config's model.path (its default) was never loaded
    fitted = (f"model.path={cfg.model.path}" if getattr(model, "chronicals_base", None)
              else "the model passed to train()")
    # apply_lora, like PEFT, skips a listed name that matches nothing (an adapter file may list names of other
    # architectures), with a warning; a config's name is the user's own, so a typo is refused here
    unmatched = unmatched_targets(model, cfg.lora.targets)
    if unmatched and len(unmatched) < len(cfg.lora.targets):  # none matching: apply_lora says so
        raise ConfigError(f"config lora.targets does not fit {fitted}: {unmatched} match "
                          f"no module of the model; its linear layers are named {linear_names(model)}: fix "
                          "or drop them", "lora.targets")
    try:
        check_lora(model, **_apply_lora_kwargs(cfg))
    except ConfigError as e:  # a name no module of this model fits (the rest fails when the config is read)
        raise ConfigError(f"config {e.key} does not fit {fitted}: {e}", e.key) from None


def check_config_fits(cfg: TrainConfig, config):
    """The refusals of a run that the model's config alone decides, made before the data is read and the weights
    load (minutes at 8B), with the words they have when made on the loaded model (which makes them again:
    ``prepare_model``, ``guards.check_final_model``, the first training step): a lora.targets or
    lora.modules_to_save name that fits no module, a full fine-tune whose final model could not be saved (a GGUF's
    partial rope), a config.json whose attention_dropout a training step refuses. ``config``: the ModelConfig of
    model.path (``load_base_tokenizer``). The module names come from the decoder built on the meta device: no
    memory, no weights, milliseconds at 8B. Returns that decoder: the data's checks against the model's config
    (``guards.check_token_ids``, ``check_document_lengths``) take it before the weights load."""
    from ..models.decoder import check_trains_as_transformers
    from ..models.loading import meta_model
    from .guards import check_final_model

    model = meta_model(config)
    model.chronicals_base = recorded_name(cfg.model.path)  # as the loaded model records it: named in the messages
    check_final_model(cfg, model)
    check_trains_as_transformers(config)
    if cfg.lora.enabled:
        _check_lora_fits(model, cfg)
    return model


def _check_adapters_fit(model, cfg: TrainConfig) -> None:
    """A model passed to train() with LoRA adapters keeps them; a config asking for other ones trained the old ones
    without a word (a retry with another rank after a failed run had injected its own). A lora.* value set away from
    its default that differs from the adapters' is a ConfigError; one left at its default is named in a warning
    (the adapters' own value is what trains: a loaded PEFT adapter is trained on without restating its settings)."""
    from dataclasses import asdict

    from ..config import LoraSection
    from ..lora.inject import name_matches, tied_partners

    rec, lo, default = model.lora_config, cfg.lora, asdict(LoraSection())
    names, targets = list(rec.lora_modules), tuple(lo.targets)
    same_targets = all(name_matches(n, targets) for n in names) and \
        all(any(name_matches(n, (t,)) for n in names) for t in targets)
    on = sorted({n.rpartition(".")[2] for n in names})
    differ = [(key, f"lora.{key}={ours} (the adapters': {theirs})") for key, theirs, ours in
              (("rank", rec.r, lo.rank), ("alpha", float(rec.alpha), float(lo.alpha)),
               ("dropout", float(rec.dropout), float(lo.dropout)), ("rslora", bool(rec.use_rslora), lo.rslora))
              if theirs != ours]
    if not same_targets:
        differ.append(("targets", f"lora.targets={list(targets)} (the adapters are on {on})"))
    # modules_to_save: each asked for is one the adapters train, and each they train was asked for (or is the tied
    # partner apply_lora adds); it was not compared, and a config asking for embed_tokens trained none (a LoRA walk)
    asked = [n for n in rec.saved_modules if lo.modules_to_save and name_matches(n, tuple(lo.modules_to_save))]
    if any(not any(name_matches(n, (k,)) for n in rec.saved_modules) for k in lo.modules_to_save) or \
            set(rec.saved_modules) - set(asked) - set(tied_partners(model, asked)):
        differ.append(("modules_to_save", f"lora.modules_to_save={list(lo.modules_to_save)} (the adapters train "
                                          f"{rec.saved_modules or 'none'})"))
    said = [text for key, text in differ if getattr(lo, key) != default[key]]
    if said:
        raise ConfigError(f"the model passed to train() already has LoRA adapters (model.lora_config), which it "
                          f"trains as they are, but the config asks for others: {'; '.join(said)}. Set those keys to "
                          "the adapters' values to train these adapters, or pass a model without adapters "
                          "(chronicals.lora.merge_lora(model), or a fresh load_model) for new ones",
                          said[0].split("=", 1)[0])
    if differ:
        log.warning("the model passed to train() has its own LoRA adapters, trained as they are: %s (left at their "
                    "defaults in the config); set them to the adapters' values to silence this",
                    "; ".join(text for _, text in differ))


def _check_only_adapters_train(model) -> None:
    """ValueError naming the parameters of an adapted model passed to train() that would train but are no part of
    its adapter (not LoRA's A or B, not in a module of modules_to_save): unfrozen by hand after apply_lora or
    load_adapter, they trained and were then missing from adapter/ (their values lost; a LoRA walk)."""
    rec = model.lora_config
    mine = {id(p) for n in rec.saved_modules for p in model.get_submodule(n).parameters()}
    mine |= {id(p) for n in rec.lora_modules for part in ("lora_A", "lora_B")
             for p in getattr(model.get_submodule(n), part).parameters()}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in mine]
    if stray:
        more = f" and {len(stray) - 3} more" if len(stray) > 3 else ""
        raise ValueError(f"the model passed to train() has LoRA adapters and trainable parameters outside them: "
                         f"{stray[:3]}{more}; the adapter saves only LoRA's A and B and its modules_to_save, so "
                         "their training would be lost. Freeze them (p.requires_grad_(False)), or train their "
                         "modules in full with apply_lora(..., modules_to_save=[...]) on the base model")


def load_base_tokenizer(cfg: TrainConfig):
    """(tokenizer, ModelConfig) of model.path (HF dir, .gguf, or the embedded short name), read without its weights:
    the run checks data.max_seq_len against the config and reads and tokenizes the data with the tokenizer before
    ``load_base`` loads the weights (seconds for the embedded model, minutes at 8B), so a bad record is said first.
    A .gguf file's first use reads its config and tokenizer here without converting its weights (``load_base``
    converts them into the cache). A path that does not exist fails naming the key (guards.check_model_path)."""
    from ..models.loading import tokenizer_and_config
    from .guards import check_model_path

    check_model_path(cfg)
    return tokenizer_and_config(cfg.model.path)


def load_base(cfg: TrainConfig, device: torch.device, dtype: torch.dtype):
    """The model of model.path, without its tokenizer (``load_base_tokenizer`` read that, before the data)."""
    from .. import load_model
    from .guards import check_model_path

    check_model_path(cfg)
    return load_model(cfg.model.path, dtype=dtype, device=device, impl=cfg.model.impl, tokenizer=False)[0]


def _copy_path(out_dir: Path, name: str) -> Path:
    """``out_dir/data/name``, where a run writes its chat copy of the demo or held-out QA records; a file or folder
    in the way is said with the fix (it was a bare '[Errno 17] File exists' / '[Errno 21] Is a directory')."""
    path = out_dir / "data" / name
    if path.parent.exists() and not path.parent.is_dir():
        raise NotADirectoryError(f"{path.parent} is a file, not a directory: a run writes its copies of the demo and "
                                 "held-out data there; move it away or set another train.out_dir")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: a run writes its copy of the data to that file; move it away "
                                "or set another train.out_dir")
    return path


def data_files(cfg: TrainConfig, out_dir: Path) -> tuple[list[Path], Path | None, list[dict] | None]:
    """(training files, held-out chat file or None, held-out QA records or None).

    The packaged demo data (and any QA-format held-out file) is rewritten under ``out_dir/data`` as chat
    records with ``data.system_prompt`` first, the same system message the QA prompts use: without one
    SmolLM2's template injects its ~20-token default system prompt into every example. The user's own
    training records are read as they are: data.system_prompt does not reach them (a warning says so when
    it is set), and a QA held-out file next to them gets no system message unless data.system_prompt is set
    (qa.heldout_system_prompt), as records without one are rendered in training.
    """
    d = cfg.data
    qa_mod.warn_demo_shadows(d.path, "data.path")
    qa_mod.warn_demo_shadows(d.eval_path, "data.eval_path")
    if d.path == DEMO:
        recs = [json.loads(line) for line in qa_mod.demo_file("train.jsonl").read_text().splitlines() if line.strip()]
        train = [qa_mod.write_chat_jsonl(recs, _copy_path(out_dir, "train.jsonl"), d.system_prompt)]
    else:
        train = [Path(d.path)]
    eval_path = (DEMO if d.path == DEMO else "") if d.eval_path == "auto" else d.eval_path
    heldout_qa = qa_mod.read_qa(eval_path, d.on_error) if eval_path else None
    if heldout_qa is not None:
        # a QA file at the copy's own path is refused before the model loads (guards.check_data_paths)
        eval_file = qa_mod.write_chat_jsonl(heldout_qa, _copy_path(out_dir, "heldout.jsonl"),
                                            qa_mod.heldout_system_prompt(d))
    else:
        eval_file = Path(eval_path) if eval_path else None
    # '' (the recipes' value) means the template's default, which is what the user's records without one get already
    if d.path != DEMO and d.system_prompt not in (DEMO_SYSTEM_PROMPT, ""):
        log.warning("data.system_prompt=%r has no effect on your training records (data.path=%s): chat records keep "
                    "their own system message, and records without one get the chat template's default; it is "
                    "used only for the demo data and held-out QA questions%s. Put a system message in your "
                    "records instead", d.system_prompt, d.path,
                    " (which data.eval_path has)" if heldout_qa is not None else " (data.eval_path has none)")
    return train, eval_file, heldout_qa


def tokenization_cache_dir(setting: str) -> Path | None:
    """data.cache_dir -> the tokenization cache: '' = $CHRONICALS_CACHE/data (default ~/.cache/chronicals/data),
    'none' = no cache, anything else = that directory."""
    from ..models.gguf_io import cache_root

    if setting == "none":
        return None
    return Path(setting).expanduser() if setting else cache_root() / "data"


def _warn_rows_left_out(loader, d) -> None:
    """Data parallel: every rank takes the same number of batches, so the last global batches of an epoch
    that do not make a full round of ranks are not trained (PackedLoader's docstring draws it)."""
    rows, w, left = len(loader.rows), loader.world_size, loader.rows_left_out
    share = left / rows
    if d.tokens_per_batch:  # one row per batch: the batch count is the row count
        fix = (f"a data.tokens_per_batch that packs into a multiple of {w} batches, or a number of ranks that "
               f"divides {rows}")
    else:
        sizes = [b for b in range(1, 2 * d.batch_size + 1) if -(-rows // b) % w == 0]
        near = sorted(sizes, key=lambda b: (abs(b - d.batch_size), b))[:2]
        fix = (f"data.batch_size={' or '.join(map(str, sorted(near)))} (ceil({rows} / batch_size) a multiple of "
               f"{w} ranks)" if near else f"a data.batch_size that makes ceil({rows} / batch_size) a multiple of {w}")
        fix += f", or a number of ranks that divides the {counted(-(-rows // d.batch_size), 'batch', 'batches')}"
    log.warning("training data: %d of %d packed rows per epoch (about %s, %d loss tokens; %.1f%%) are "
                "not trained: each of the %d ranks takes the same number of batches, and with "
                "data.dp_remainder=drop the remainder batches are left out. The rows reshuffle each epoch, so other "
                "ones are left out each time (with train.epochs=1 they are never seen). To train them all use "
                "data.dp_remainder=train (a new run), or %s", left, rows,
                counted(round(share * len(loader.dataset)), "document"),
                round(share * loader.dataset.stats.loss_tokens), 100 * share,
                w, fix)


# load_dataset's options as this config names them, so its advice reads "set data.on_long=truncate"
DATA_OPTION_KEYS = {"format": "data.format", "max_seq_len": "data.max_seq_len", "loss_on": "data.train_on",
                    "on_error": "data.on_error", "overlong": "data.on_long", "num_proc": "data.num_proc"}


def _dataset_options(d, option_names: dict[str, str] = DATA_OPTION_KEYS) -> dict:
    """load_dataset's options from a DataSection ``d``, its advice worded in ``option_names`` (the config's keys)."""
    return dict(format=d.format, max_seq_len=d.max_seq_len, loss_on=d.train_on, on_error=d.on_error,
                overlong=d.on_long, cache_dir=tokenization_cache_dir(d.cache_dir), num_proc=d.num_proc or None,
                option_names=option_names)


def build_loaders(cfg: TrainConfig, tokenizer, out_dir: Path, rank: int = 0, world_size: int = 1):
    """(train loader, eval loader or None, held-out QA records or None) through chronicals.data.

    Data parallelism: the train loader yields this rank's share of the batches (``rank``, ``world_size``);
    the eval loader yields all of them on every rank (each rank evaluates the whole held-out set).
    """
    from ..data import PackedLoader, load_dataset

    d = cfg.data
    train_files, eval_file, heldout_qa = data_files(cfg, out_dir)
    ds = load_dataset([str(f) for f in train_files], tokenizer, **_dataset_options(d), name="the training set")
    # rows of max_seq_len, or one padding-free row of at most tokens_per_batch tokens per micro-batch
    shape = d.loader_shape(warn=rank == 0)  # warns when a data.batch_size beside tokens_per_batch goes unused
    train_loader = PackedLoader(ds, max_seq_len=d.max_seq_len, seed=cfg.train.seed, shuffle=True, rank=rank,
                                world_size=world_size, remainder=d.dp_remainder, **shape)
    log.info("training data: %s -> %s per epoch%s; %s", counted(len(ds), "example"),
             counted(len(train_loader), "batch", "batches"),
             f" per rank ({world_size} ranks)" if world_size > 1 else "", packing_line(train_loader.stats))
    if rank == 0 and train_loader.rows_left_out:
        _warn_rows_left_out(train_loader, d)
    if rank == 0 and train_loader.empty_batches:
        log.info("training data: the last round of each epoch fills %d of the %d ranks; the others "
                 "run an empty batch (no loss, no gradient: data.dp_remainder=train)",
                 world_size - train_loader.empty_batches, world_size)
    eval_loader = None
    if eval_file is not None:
        source = DEMO if d.eval_path == "auto" else d.eval_path  # auto with QA records: the demo's (data_files)
        name = (f"the held-out set (the QA records of {source}, rewritten as chat)" if heldout_qa is not None
                else "the held-out set")
        eval_loader = heldout_loader(d, tokenizer, eval_file, heldout_qa is not None, name, shape)
    return train_loader, eval_loader, heldout_qa


def heldout_loader(d, tokenizer, file: Path, from_qa: bool, name: str, shape: dict | None = None, *,
                   option_names: dict[str, str] = DATA_OPTION_KEYS):
    """An unshuffled loader over every batch of ``file`` (the held-out set: the trainer's, ``chronicals eval``'s),
    read with ``d`` (a DataSection); as chat when it holds QA records rewritten by ``qa.write_chat_jsonl`` (the
    training data's format does not apply then). ``name`` prefixes its errors; shape: ``d.loader_shape()``;
    ``option_names``: what its warnings and errors call load_dataset's options (chronicals eval: its flags)."""
    from ..data import DataError, PackedLoader, load_dataset

    opts = _dataset_options(d, option_names) | ({"format": "chat"} if from_qa else {})
    try:
        ds = load_dataset([str(file)], tokenizer, **opts, name=name)
    except DataError as e:  # say which data it is; record errors name only a file and line
        raise DataError(str(e) if name in str(e) else f"{name}: {e}") from None
    return PackedLoader(ds, max_seq_len=d.max_seq_len, seed=0, shuffle=False,
                        **(shape if shape is not None else d.loader_shape()))


def record_passed_model(cfg: TrainConfig, model) -> TrainConfig:
    """cfg with model.path set to a passed model's own base (``model.chronicals_base``, which load_model sets) when
    it names another: config.yaml and the checkpoints recorded the config's model.path (the embedded model's name
    when the dict set none), so `chronicals train out_dir/config.yaml` resumed the adapters on that other model
    without a word."""
    base = getattr(model, "chronicals_base", None) if model is not None else None
    if not base or recorded_name(cfg.model.path) == base:
        return cfg
    log.info("model.path=%s is not the model passed to train(): this run records %s (model.chronicals_base)",
             cfg.model.path, base)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=base))


def ready_model(cfg: TrainConfig, model, device: torch.device, dtype: torch.dtype):
    """A loaded or passed model made ready to train (``setup.prepare_model``), once ``check_final_model`` finds its
    final directory can be saved."""
    from .guards import check_final_model

    check_final_model(cfg, model)
    return prepare_model(model, cfg, device, dtype)
