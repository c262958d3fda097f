"""The models ``chronicals export | chat | eval`` load: which base an adapter goes on, the load itself, and the
check of their token-count flags against the model's context. Shared by cli.py, cli_chat.py and cli_eval.py."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

EMBEDDED = "smollm2-135m-instruct"


def _rank() -> int:
    """This process's rank under torchrun (0 without it): ``train.distributed.env_rank`` once that is loaded; before
    (a Ctrl-C while a command starts), the same rule on the environment alone: importing it loads torch (2 s after
    the Ctrl-C, and a second one in them printed a traceback). A RANK that is no integer is env_rank's to refuse."""
    dist = sys.modules.get("chronicals.train.distributed")
    if dist is not None:
        return dist.env_rank()
    world, rank = (os.environ.get(k, "").strip() for k in ("WORLD_SIZE", "RANK"))
    return int(rank) if world.isdigit() and int(world) > 1 and rank.isdigit() else 0


def _setup_logging() -> None:
    """The console log. Under torchrun every rank runs the same code and would say each line once per rank: rank 0
    tells the story (info and warnings), the others say only errors (what failed there, e.g. its GPU). Other
    libraries' loggers say warnings and errors only (the root logger's WARNING)."""
    from .train.console import console_handler

    # stderr; basicConfig adds it only when the root logger has no handler yet
    logging.basicConfig(level=logging.WARNING, handlers=[console_handler()])
    logging.getLogger("chronicals").setLevel(logging.INFO if _rank() == 0 else logging.ERROR)


def _recorded(adapter: str) -> tuple[str | None, str, str, str | None]:
    """(the base an adapter was trained on or None, the file that records it, where in it (for messages), why a
    training checkpoint names none or None): adapter_config.json's base_model_name_or_path, or for a LoRA run's
    training checkpoint the base its state.pt records."""
    from .lora.peft_io import read_adapter_config
    from .train.checkpoint_adapter import is_checkpoint_dir, read_lora_checkpoint

    if is_checkpoint_dir(adapter):
        ck = read_lora_checkpoint(adapter)
        return ck.base, "state.pt", "recorded in its state.pt", ck.why_no_base
    base = read_adapter_config(adapter).get("base_model_name_or_path")
    return (base if base and isinstance(base, str) else None), "adapter_config.json", \
        "adapter_config.json base_model_name_or_path", None


def _here(model: str) -> bool:
    """A short name in any case (load_model's rule: a run records model.path as the user spelled it, such as the
    README's "SmolLM2-135M-Instruct"), or an existing path."""
    from .models.loading import SHORT_NAMES

    return model.lower() in SHORT_NAMES or Path(model).expanduser().exists()


def _base_for(adapter: str | None, given: str | None, flag: str) -> str:
    """The model an adapter goes on: ``given``, else the base recorded in the adapter, else the embedded model.
    A given base other than the recorded one is allowed (a copy, a re-save) but warned about: an adapter on a
    base of the same shapes loads without any error and gives wrong outputs."""
    from .models.loading import same_model

    recorded, file, where, why_none = _recorded(adapter) if adapter else (None, "", "", None)
    if given is None:
        if recorded is None and why_none is not None:  # the embedded model is no guess for a run's step
            raise FileNotFoundError(f"{adapter} does not name a base model that can be found from here "
                                    f"({why_none}); pass {flag} with the model that run trained")
        if recorded is None:
            if adapter:
                print(f"{adapter}/adapter_config.json records no base model: using {EMBEDDED} (pass {flag} for "
                      "another)", file=sys.stderr)
            return EMBEDDED
        if not _here(recorded):
            raise FileNotFoundError(f"{adapter} was trained on {recorded} ({where}), "
                                    f"which is not here; pass {flag} with that model's directory or .gguf")
        print(f"{flag} not given: using {recorded}, the base recorded in {adapter}/{file}",
              file=sys.stderr)
        return recorded
    if recorded and _here(recorded) and not same_model(given, recorded):
        print(f"warning: {adapter} was trained on {recorded} ({where}), not "
              f"{flag} {given}; its outputs are right only if {given} holds the same weights", file=sys.stderr)
    return given



BASE_HELP = ("the model a full fine-tuning run's checkpoint (--model runs/x/checkpoints/step-N) trained from, where "
             "it has moved (default: the one the checkpoint records); with --adapter: its base, as --model")


def _model_and_base(p: argparse.ArgumentParser, a: argparse.Namespace, base_alone_is_model: bool = False,
                    default_flag: str = "--model") -> tuple[str | None, str | None, str]:
    """(the model, or with --adapter its base; the base of a full fine-tuning checkpoint given as --model, else None;
    the flag that named the first, for messages: ``default_flag`` when neither did) from --model and --base. Both
    given named one thing before (export: the last won, and a checkpoint's step was written as its untrained base).
    ``base_alone_is_model``: export's --base without --model or --adapter is the model (its older name)."""
    from .models.loading import same_model
    from .train.checkpoint_adapter import is_checkpoint_dir

    model, base = a.model, a.base
    if base is None:
        return model, None, "--model" if model is not None else default_flag
    if is_checkpoint_dir(base) and (model is not None or a.adapter):
        p.error(f"--base {base} is a run's training checkpoint; --base names the model a checkpoint (--model) was "
                "trained from: a model directory, .gguf or smollm2-135m-instruct")
    if a.adapter:
        if model is not None and not same_model(model, base):
            p.error(f"with --adapter, --model and --base both name its base ({model} and {base}): give one")
        return base, None, "--base"
    if model is None:
        if base_alone_is_model:
            return base, None, "--base"
        p.error("--base names the model a full fine-tuning run's checkpoint was trained from: give the checkpoint as "
                "--model (runs/x/checkpoints/step-N), or the model itself as --model")
    if not is_checkpoint_dir(model):
        where = Path(model).expanduser()
        why = (f"--model {model} does not exist" if not where.exists() else
               f"--model {model} is a file: pass its checkpoint directory {where.parent}"
               if where.name == "state.pt" else
               f"--model {model} is a LoRA adapter: pass it as --adapter, its base as --model"
               if (where / "adapter_config.json").is_file() else
               f"--model {model} is not a run's checkpoint (runs/x/checkpoints/step-N), and --base is only for one: "
               "leave --base out")
        p.error(why)
    return model, base, "--model"


def _checkpoint_base(checkpoint: str, given: str | None) -> str:
    """The model a full fine-tuning run's ``checkpoint`` goes on: ``given`` (--base; warned about when the one it
    records is here and holds other weights), else the recorded one (FileNotFoundError naming it when gone)."""
    from .models.loading import same_model
    from .train.checkpoint_model import checkpoint_base, read_full_checkpoint

    if given is None:
        return checkpoint_base(checkpoint)
    recorded = read_full_checkpoint(checkpoint).base
    if recorded and _here(recorded) and not same_model(given, recorded):
        print(f"warning: {checkpoint} was trained from {recorded} (recorded in its state.pt), not --base {given}; "
              f"weights the run froze, the config and the tokenizer are taken from {given}", file=sys.stderr)
    return given


def _load(model_path: str, adapter: str | None, dev, dtype: str, adapter_dtype=None, tokenizer: bool = True,
          ckpt_base: str | None = None):
    """(model in eval mode, tokenizer or None) on ``dev`` (a resolved torch.device), with ``adapter`` applied (its
    A and B in ``adapter_dtype``; None: float32 on a bf16 or fp16 base, as PEFT keeps them, else the base's
    dtype: ``lora.peft_io.loaded_adapter_dtype``); ``tokenizer=False`` loads none. ``dtype``: a --dtype value,
    or "checkpoint" for the checkpoint's own. ``model_path`` may be a full fine-tuning run's training checkpoint
    (``train.checkpoint_model``): its base (``ckpt_base``, default the one it records) with that step's weights;
    under --dtype auto those are the weights the run trained with (a bf16 run's fp32 masters rounded to bf16 once,
    as its model/ holds them), computed in auto's dtype, so the last step scores as model/ does."""
    from . import load_model
    from .train.checkpoint_adapter import apply_checkpoint_adapter, is_checkpoint_dir
    from .train.setup import resolve_dtype

    dt = None if dtype == "checkpoint" else resolve_dtype(dtype, dev)
    if is_checkpoint_dir(model_path):  # runs/x/checkpoints/step-N of a full fine-tuning run: that step's model
        from .train.checkpoint_model import load_checkpoint_model

        model, tok = load_checkpoint_model(model_path, base=_checkpoint_base(model_path, ckpt_base), dtype=dt,
                                           device=dev, tokenizer=tokenizer, as_trained=dtype == "auto")
    else:
        model, tok = load_model(model_path, dtype=dt, device=dev, tokenizer=tokenizer)
    if adapter:
        from .lora import load_adapter

        if is_checkpoint_dir(adapter):  # runs/x/checkpoints/step-N: the adapter of that step
            apply_checkpoint_adapter(model, adapter, adapter_dtype=adapter_dtype)
        else:
            load_adapter(model, adapter, adapter_dtype=adapter_dtype)
    return model.eval(), tok


def _config_source(model_path: str, ckpt_base: str | None = None) -> str:
    """The model whose config.json and tokenizer ``_load(model_path, ..., ckpt_base=ckpt_base)`` reads: a full
    fine-tuning checkpoint's base (``ckpt_base``, else the one it records), else ``model_path`` itself."""
    from .train.checkpoint_adapter import is_checkpoint_dir
    from .train.checkpoint_model import checkpoint_base

    return (ckpt_base or checkpoint_base(model_path)) if is_checkpoint_dir(model_path) else model_path


def _tokenizer_first(model_path: str, ckpt_base: str | None = None):
    """(tokenizer, ModelConfig) of the model ``_load(model_path, ..., ckpt_base=ckpt_base)`` loads, read without its
    weights (a full fine-tuning checkpoint's from its base, as it loads them): eval checks its flags against the
    config and reads its data with the tokenizer before the weights load, so a bad record is said first."""
    from .models.loading import tokenizer_and_config

    return tokenizer_and_config(_config_source(model_path, ckpt_base))


def _check_adapter_first(model, adapter: str) -> None:
    """The refusals of ``adapter`` (a PEFT directory or a LoRA run's checkpoint) that ``_load`` would make once the
    weights had loaded and need none of them, in its words: its adapter_config.json (or checkpoint), its weights
    file, its names and tensor shapes against the modules of ``model`` (``models.loading.meta_model``). eval calls
    it on the decoder it builds for its data checks too; chat and export through ``_check_adapter_before_load``."""
    from .lora.peft_io import check_adapter
    from .train.checkpoint_adapter import check_checkpoint_adapter, is_checkpoint_dir

    if is_checkpoint_dir(adapter):
        check_checkpoint_adapter(model, adapter)
    else:
        check_adapter(model, adapter)


def _check_adapter_before_load(model_path: str, adapter: str | None, ckpt_base: str | None = None) -> None:
    """``_check_adapter_first`` (nothing without ``adapter``) on the decoder built on the meta device from the
    config.json of the model ``_load(model_path, adapter, ..., ckpt_base=ckpt_base)`` loads (``model_config``: a .gguf
    not yet in the conversion cache read without converting its weights, as eval reads it): chat and export refused
    an adapter of another model (names, shapes, config) only once the base weights had loaded (seconds for the
    embedded model, minutes at 8B), and now before, in the same words and exit status as eval."""
    from .models.loading import meta_model, model_config

    if adapter:
        _check_adapter_first(meta_model(model_config(_config_source(model_path, ckpt_base))), adapter)


def _within_context(p: argparse.ArgumentParser, model, name: str, *flags: tuple[str, int]) -> None:
    """Exit 2 for a (flag, tokens) past the max_position_embeddings of ``model`` (or of its config, read before the
    weights load): positions past it were never trained (garbage, and slower at every token)."""
    context = getattr(model, "config", model).max_position_embeddings
    for flag, value in flags:
        if value > context:
            p.error(f"{flag} {value} is more than {name} can attend to (max_position_embeddings={context}); "
                    f"use at most {context}")


DTYPE_HELP = ("weights dtype: auto (bf16 on CUDA, fp32 on CPU, as train loads them; a full fine-tuning run's checkpoint "
              "holds the weights as that run trained them, as its model/ does) | float32 (a checkpoint's fp32 "
              "masters as kept) | bfloat16")


def _not_utf8(text: str) -> str | None:
    """None for text that UTF-8 can hold; else which byte is not UTF-8. Python reads a command line's (and, in the
    C locale, stdin's) undecodable bytes as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        raw = text[e.start:e.end].encode("utf-8", "surrogateescape")
        return f"byte {' '.join(f'0x{b:02x}' for b in raw)} at character {e.start}"


def _shown(text: str) -> str:
    """``text`` for a message, its undecodable bytes as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def add_verbose(p: argparse.ArgumentParser) -> None:
    """chat's and eval's ``-v``: without it they print answers (chat) or the summary (eval), and warnings."""
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also log what the command does to stderr: the load, device and dtype, and how "
                        "answers are decoded (eager, or one CUDA-graph replay per token)")
