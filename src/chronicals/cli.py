"""``chronicals train | export | chat | generate | eval | bench``: thin wrappers over library functions.

    chronicals train                                  # the embedded demo (LoRA+ on SmolLM2-135M)
    chronicals train configs/qwen2.5-0.5b/lora.yaml optim.lr=2e-4 train.max_steps=500
    chronicals export --base smollm2-135m-instruct --adapter runs/demo/adapter --out runs/demo/merged
    chronicals chat --model smollm2-135m-instruct --adapter runs/demo/adapter "Who founded Vellmora?"
    chronicals eval --adapter runs/demo/adapter demo --json runs/demo/eval.json
    chronicals bench --help
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import shlex
import signal
import sys
import threading
from pathlib import Path

from .cuda_alloc import allocator_env

USAGE = """usage: chronicals train [CONFIG.yaml] [section.key=value ...]

Fine-tune a decoder LLM. With no arguments: the embedded demo (LoRA+ on SmolLM2-135M-Instruct with the
packaged Vellmora facts; a few minutes on a laptop CPU). Values on the command line override the YAML
file (each key once), which overrides the defaults below. Exit status: 0 done, 1 diverged (NaN/inf), 2 bad config,
3 bad input found while running (a data, model or adapter file: the message names it, with the line for
data), 4 internal error (a bug in chronicals: the traceback says where; please report it), 130 stopped by
SIGINT/SIGTERM: during training after writing a checkpoint (run again with train.resume=auto); before the
first step with nothing kept; after the last one (the final evaluation or save) with the checkpoints kept.

keys:
"""


def _rank() -> int:
    """This process's rank under torchrun (0 without it)."""
    return int(os.environ.get("RANK", "0"))


def _setup_logging(verbose: bool = False) -> None:
    """The console log. Under torchrun every rank runs the same code and would say each line once per rank: rank 0
    tells the story (info and warnings), the others say only errors (what failed there, e.g. its GPU)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("chronicals").setLevel(logging.INFO if _rank() == 0 else logging.ERROR)


def _train_args_problem(paths: list[str]) -> str | None:
    """What is wrong with the train arguments that are not overrides, or None: one CONFIG.yaml at most."""
    for a in paths:
        if a.startswith("--config"):
            given = a.split("=", 1)[1] if "=" in a else next((p for p in paths if not p.startswith("-")), "CONFIG.yaml")
            return f"{a.split('=', 1)[0]} is not an option: give the config file itself, as in chronicals train {given}"
        if a.startswith("-"):
            return f"{a} is not an option: train takes [CONFIG.yaml] [section.key=value ...]"
        if not a.endswith((".yaml", ".yml")):
            return f"{a}: a config file must end in .yaml or .yml (an override is section.key=value)"
    if len(paths) > 1:
        return f"one CONFIG.yaml at most, got {' and '.join(paths)}; set other values as section.key=value"
    return None


def cmd_train(argv: list[str]) -> int:
    from .config import all_keys, config_help, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + config_help())
        return 0
    sections = {k.split(".", 1)[0] for k in all_keys()}
    # a key without '=' (optim.lr) goes to the overrides, whose error says key=value; an option is no override; an
    # existing .yaml file is the config even with '=' in its path (runs/lr=3e-4/x.yaml), unless its text before the
    # '=' names a key section (data.path=x.yaml sets data.path)
    def is_path(a: str) -> bool:
        if a.startswith("-"):
            return True
        if "=" in a:
            return a.endswith((".yaml", ".yml")) and a.split(".", 1)[0] not in sections and Path(a).is_file()
        return a.endswith((".yaml", ".yml")) or a.split(".", 1)[0] not in sections

    paths = [a for a in argv if is_path(a)]
    overrides = [a for a in argv if a not in paths]
    problem = _train_args_problem(paths)
    if problem:
        print(f"error: {problem}\n(see chronicals train --help)", file=sys.stderr)
        return 2
    _setup_logging()  # before the config loads: its warnings ("config x.yaml sets nothing") are rank 0's too
    try:
        cfg = load_config(paths[0] if paths else None, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .train import TrainingDiverged, train
    from .train.report import RunReport

    report = RunReport(cfg)
    try:
        result = train(cfg, report=report)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.status == "interrupted":
        if _rank() == 0:
            again = [a for a in argv if not a.startswith("train.resume=")] + ["train.resume=auto"]
            print(f"stopped at step {result.step}/{result.total_steps}; checkpoint {result.checkpoint}\n"
                  f"continue with: {shlex.join(['chronicals', 'train', *again])}")  # quoted: pasted as printed
        return 130
    if _rank() == 0:
        print(report.summary(result))
    return 0


EMBEDDED = "smollm2-135m-instruct"


def _recorded_base(adapter: str) -> str | None:
    """The base an adapter was trained on (adapter_config.json's base_model_name_or_path), or None."""
    from .lora.peft_io import read_adapter_config

    base = read_adapter_config(adapter).get("base_model_name_or_path")
    return base if base and isinstance(base, str) else None


def _here(model: str) -> bool:
    return model == EMBEDDED or Path(model).expanduser().exists()


def _base_for(adapter: str | None, given: str | None, flag: str) -> str:
    """The model an adapter goes on: ``given``, else the base recorded in the adapter, else the embedded model.
    A given base other than the recorded one is allowed (a copy, a re-save) but warned about: an adapter on a
    base of the same shapes loads without any error and gives wrong outputs."""
    from .models.loading import same_model

    recorded = _recorded_base(adapter) if adapter else None
    if given is None:
        if recorded is None:
            if adapter:
                print(f"{adapter}/adapter_config.json records no base model: using {EMBEDDED} (pass {flag} for "
                      "another)", file=sys.stderr)
            return EMBEDDED
        if not _here(recorded):
            raise FileNotFoundError(f"{adapter} was trained on {recorded} (adapter_config.json "
                                    f"base_model_name_or_path), which is not here; pass {flag} with that model's "
                                    "directory or .gguf")
        print(f"{flag} not given: using {recorded}, the base recorded in {adapter}/adapter_config.json",
              file=sys.stderr)
        return recorded
    if recorded and _here(recorded) and not same_model(given, recorded):
        print(f"warning: {adapter} was trained on {recorded} (adapter_config.json base_model_name_or_path), not "
              f"{flag} {given}; its outputs are right only if {given} holds the same weights", file=sys.stderr)
    return given


def _run_system_prompt(path: str | None) -> str | None:
    """The system message of the held-out prompts of the run that wrote ``path`` (``train.out_dir``/adapter or
    /model): from the run's config.yaml beside it, so chat asks as the run's held-out questions were asked. None
    when ``path`` is not in a run directory (or its config.yaml does not load)."""
    if not path:
        return None
    cfg_file = Path(path).expanduser().parent / "config.yaml"
    if Path(path).name not in ("adapter", "model") or not cfg_file.is_file():
        return None
    from .config import load_config
    from .train.qa import heldout_system_prompt

    try:
        system = heldout_system_prompt(load_config(cfg_file).data)
    except (ValueError, OSError):  # another tool's config.yaml, or one of an older version: not ours to judge
        return None
    shown = repr(system) if system else "none (the chat template's default)"
    print(f"--system not given: using {shown}, the system message of {cfg_file}'s held-out prompts", file=sys.stderr)
    return system


def _load(model_path: str, adapter: str | None, dev, dtype: str, adapter_dtype=None):
    """(model in eval mode, tokenizer) on ``dev`` (a resolved torch.device), with ``adapter`` applied (its A and B
    in ``adapter_dtype``; None: the base's)."""
    from . import load_model
    from .train.setup import resolve_dtype

    model, tok = load_model(model_path, dtype=resolve_dtype(dtype, dev), device=dev)
    if adapter:
        from .lora import load_adapter

        load_adapter(model, adapter, adapter_dtype=adapter_dtype)
    return model.eval(), tok


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chronicals export",
                                description="Merge a LoRA adapter into its base model and write a Hugging Face directory.")
    p.add_argument("--base", default=None, help="base model: HF directory, .gguf, or smollm2-135m-instruct "
                                                 "(default: the base recorded in the adapter, else the embedded one)")
    p.add_argument("--adapter", required=True, help="adapter directory (PEFT format, e.g. runs/demo/adapter)")
    p.add_argument("--out", required=True, help="output directory (replaced atomically if it exists and holds "
                                                "only a model's files)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the written weights; the base loads in it (bfloat16: half the memory), and each "
                        "W + s B A is computed in fp32 and rounded once (from an fp32 base checkpoint, float32 "
                        "avoids rounding W twice)")
    a = p.parse_args(argv)
    if not a.out.strip():  # Path("") is the working directory
        p.error("--out is empty; give the output directory")
    a.base = _base_for(a.adapter, a.base, "--base")
    out = Path(a.out).resolve()
    for name, given in (("--base", a.base), ("--adapter", a.adapter)):
        if Path(given).exists() and out in (Path(given).resolve(), *Path(given).resolve().parents):
            print(f"error: --out {a.out} would replace {name} {given} (the output directory is replaced as a "
                  "whole); choose another --out", file=sys.stderr)
            return 2
        if Path(given).is_dir() and Path(given).resolve() in out.parents:  # a foreign folder in it from then on
            print(f"error: --out {a.out} is inside {name} {given}: the merged model would become a folder of it, "
                  f"which a later save of {given} refuses to delete; choose an --out outside it", file=sys.stderr)
            return 2
    from .models.hf_io import MODEL_DIR_FILES, check_output_dir

    try:  # before the load and merge (minutes for an 8B model), not when the merged model is written
        check_output_dir(a.out, MODEL_DIR_FILES)
    except OSError as e:
        print(f"error: --out {a.out}: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    from . import save_model
    from .lora import merge_lora

    import torch

    from .train.setup import resolve_device

    # A and B as the file has them (fp32 from PEFT and from us): in the base's bf16 they were rounded before the
    # merge, and 14.8% of a bf16 merge's elements then differed from W + s B A rounded once
    model, tok = _load(a.base, a.adapter, resolve_device("cpu"), a.dtype, adapter_dtype=torch.float32)
    merge_lora(model)
    written = save_model(model, tok, a.out)
    print(f"merged {a.adapter} into {a.base}: {written}")
    return 0


def _within_context(p: argparse.ArgumentParser, model, name: str, *flags: tuple[str, int]) -> None:
    """Exit 2 for a (flag, tokens) past ``model``'s max_position_embeddings: positions past it were never trained
    (garbage, and slower at every token)."""
    context = model.config.max_position_embeddings
    for flag, value in flags:
        if value > context:
            p.error(f"{flag} {value} is more than {name} can attend to (max_position_embeddings={context}); "
                    f"use at most {context}")


DTYPE_HELP = "weights dtype: auto (bf16 on CUDA, fp32 on CPU, as train loads them) | float32 | bfloat16"


def cmd_chat(argv: list[str], prog: str = "chat") -> int:
    p = argparse.ArgumentParser(prog=f"chronicals {prog}",
                                description="Answer prompts (greedy) with a base or fine-tuned model; with no "
                                            "prompts, read one per line from stdin. Each prompt is asked on its own "
                                            "(no earlier turns), with the system message.")
    p.add_argument("prompts", nargs="*", help="user messages to answer")
    p.add_argument("--model", default=None, help="HF directory, .gguf, or smollm2-135m-instruct (default: with "
                                                  "--adapter the base recorded in it, else smollm2-135m-instruct)")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory to apply (e.g. runs/demo/adapter)")
    p.add_argument("--system", default=None, help="system message (default: the one the run that wrote --adapter "
                                                    "or --model used for its held-out prompts, read from the run's "
                                                    "config.yaml beside it; else the one the demo trains with)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many tokens per answer (>= 1); "
                                                                   "fewer where prompt and answer would pass the "
                                                                   "model's context (said once)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help=DTYPE_HELP)
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens {a.max_new_tokens}: an answer needs at least 1 new token")
    if any(not q.strip() for q in a.prompts):
        p.error("an empty prompt was given; pass the message text (or no prompts to read them from stdin)")
    from .train.setup import resolve_device

    try:
        dev = resolve_device(a.device, key="--device")
    except ValueError as e:
        p.error(str(e))
    a.model = _base_for(a.adapter, a.model, "--model")
    from .config import DEMO_SYSTEM_PROMPT
    from .models import require_chat_template
    from .train.qa import answer

    model, tok = _load(a.model, a.adapter, dev, a.dtype)
    require_chat_template(tok)  # before any prompt is read
    _within_context(p, model, a.model, ("--max-new-tokens", a.max_new_tokens))
    system = _run_system_prompt(a.adapter or a.model) if a.system is None else a.system
    if system is None:
        system = DEMO_SYSTEM_PROMPT
    prompts = a.prompts
    interactive = not prompts and sys.stdin.isatty()  # a terminal: answers only; piped or given: "> prompt" first
    if interactive:
        print("type a message and press enter (Ctrl-D to quit)", file=sys.stderr)
    if not prompts:
        prompts = (line.strip() for line in sys.stdin)  # one prompt per line; blank lines are skipped
    answered = refused = 0
    capped = False
    for q in prompts:
        if not q:
            continue
        room, why = _answer_room(model, tok, q, system, a.max_new_tokens, a.model)
        if not room:  # this prompt alone fills the context: said, and the next one is read
            print(f"error: {why}", file=sys.stderr, flush=True)
            refused += 1
            continue
        if why and not capped:  # once: in a long session every long prompt would repeat it
            print(f"note: {why}", file=sys.stderr)
            capped = True
        reply = answer(model, tok, q, system, room)
        print(reply if interactive else f"> {q}\n{reply}", flush=True)
        answered += 1
    if not answered and not refused and not interactive:  # piped stdin with no prompt in it: not a silent success
        print("error: no prompt: stdin held no non-blank line; pass the message as an argument, or pipe one "
              "prompt per line", file=sys.stderr)
        return 2
    return 3 if refused else 0  # 3: bad input, as a data file's bad record


def _answer_room(model, tok, q: str, system: str, max_new_tokens: int, name: str) -> tuple[int, str | None]:
    """(new tokens ``q``'s answer may take, why fewer than ``max_new_tokens`` or None). Each prompt is asked
    alone (no earlier turns), and the templated prompt (system message, ``q``, the opened assistant turn) and its
    answer share the model's context (generate.context_length): 0 when the prompt fills it by itself."""
    from .models.generate import context_length
    from .train.qa import prompt_ids

    context, limit = context_length(model)
    if not context:
        return max_new_tokens, None
    used = len(prompt_ids(tok, q, system))
    if used < context:
        room = min(max_new_tokens, context - used)
        return room, None if room == max_new_tokens else (
            f"--max-new-tokens {max_new_tokens}: a prompt of {used} tokens (with the system message and chat "
            f"template) leaves room for {room} in the {context} tokens {name} attends to ({limit}); answers to "
            "long prompts are cut there")
    shown = repr(q) if len(q) <= 60 else repr(q[:57] + "...")
    framing = len(prompt_ids(tok, "", system))  # the system message and the template around the message
    fix = ("the system message and template alone fill it: give a shorter --system" if framing >= context else
           f"shorten it by at least {used - context + 1} tokens" + (" or give a shorter --system"
                                                                     if framing >= context // 2 else ""))
    return 0, (f"the prompt {shown} takes {used} tokens ({framing} of them the system message and chat template), "
               f"and {name} attends to {context} ({limit}): no room for an answer; {fix}")


_DATA_FLAGS = ("format", "train_on", "max_seq_len", "system_prompt", "batch_size", "on_long", "on_error", "cache_dir")


def _as_flags(message: str) -> str:
    """A data error's ``data.max_seq_len`` / ``data.on_long=truncate`` as eval's flags ``--max-seq-len`` /
    ``--on-long=truncate`` (argparse takes both forms), and ``data.eval_path`` / ``data.path`` as its DATA argument."""
    import re

    message = re.sub(r"\bdata\.(eval_)?path\b", "the DATA argument", message)
    return re.sub(rf"\bdata\.({'|'.join(_DATA_FLAGS)})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def cmd_eval(argv: list[str]) -> int:
    from .config import DataSection, EvalSection

    d, e = DataSection(), EvalSection()  # the defaults of the config's data and eval sections
    p = argparse.ArgumentParser(prog="chronicals eval",
                                description="Score a base or fine-tuned model on a dataset without training: held-out "
                                            "loss (mean over loss tokens), perplexity, examples and loss tokens, and "
                                            "for question/answer/keywords records the keyword accuracy of greedy "
                                            "answers; the same numbers as train's held-out 'before'/'after'. The data "
                                            "options are the data section's keys (data.max_seq_len: --max-seq-len).")
    p.add_argument("data", help="file to score: .jsonl/.json/.parquet/.csv or a directory of them (as data.path), or "
                                "demo (the packaged held-out questions)")
    p.add_argument("--model", default=None, help="HF directory, .gguf, or smollm2-135m-instruct (default: with "
                                                  "--adapter the base recorded in it, else smollm2-135m-instruct)")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory to apply (PEFT format, e.g. "
                                                    "runs/demo/adapter)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the numbers (and each answer) to FILE as "
                                                                 "JSON, atomically")
    p.add_argument("--format", default=d.format, choices=["auto", "text", "chat", "alpaca", "prompt_completion",
                                                          "sharegpt"], help="record format (question/answer records "
                                                                            "are read as chat)")
    p.add_argument("--train-on", default=d.train_on, choices=["assistant", "all"],
                   help="which tokens carry loss (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="tokens per packed row (default: "
                                                                          "%(default)s); longer examples are cut (see "
                                                                          "--on-long)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="packed rows per forward (default: %(default)s)")
    p.add_argument("--system-prompt", default=None, help="system message of question/answer prompts (default: "
                                                         f"{d.system_prompt!r} for demo, else none, as train asks "
                                                         "its held-out questions beside your own data)")
    p.add_argument("--on-long", default=d.on_long, choices=["truncate", "drop"],
                   help="examples longer than --max-seq-len: cut to it or left out (default: %(default)s)")
    p.add_argument("--on-error", default=d.on_error, choices=["fail", "skip"],
                   help="malformed records: stop at the first, naming it (default), or skip and count them")
    p.add_argument("--cache-dir", default=d.cache_dir, help="tokenization cache ('' = the default, none = no cache)")
    p.add_argument("--qa-limit", type=int, default=e.qa_limit, help="questions to answer (0 = all, the default)")
    p.add_argument("--max-new-tokens", type=int, default=e.max_new_tokens,
                   help="tokens generated per answer (default: %(default)s, as train's eval.max_new_tokens)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help=DTYPE_HELP)
    a = p.parse_args(argv)
    for flag, value, least in (("--max-seq-len", a.max_seq_len, 8), ("--batch-size", a.batch_size, 1),
                               ("--qa-limit", a.qa_limit, 0), ("--max-new-tokens", a.max_new_tokens, 1)):
        if value < least:
            p.error(f"{flag} {value}: expected an integer >= {least}")
    if not a.data.strip():
        p.error("the data argument is empty; give the file to score (or demo)")
    if a.json is not None:
        out = Path(a.json).expanduser()
        if not a.json.strip() or out.is_dir():
            p.error(f"--json {a.json!r} is {'empty' if not a.json.strip() else 'a directory'}; give a file name")
        if not out.parent.is_dir():
            p.error(f"--json {a.json}: the folder {out.parent} does not exist; create it or choose another file")
    from .config import DEMO, ConfigError
    from .data.readers import glob_hint
    from .train.setup import DATA_OPTION_KEYS, resolve_device

    try:
        dev = resolve_device(a.device, key="--device")
        data = DataSection(path=a.data, format=a.format, train_on=a.train_on, max_seq_len=a.max_seq_len,
                           batch_size=a.batch_size, on_long=a.on_long, on_error=a.on_error, cache_dir=a.cache_dir,
                           system_prompt=d.system_prompt if a.system_prompt is None else a.system_prompt)
    except ConfigError as err:  # "config data.max_seq_len=... is invalid": here that key is a flag
        p.error(_as_flags(str(err).removeprefix("config ")))
    if a.data != DEMO and not Path(a.data).expanduser().exists():  # before the model loads
        where = "" if Path(a.data).is_absolute() else f" (relative paths are read from the working directory, " \
                                                       f"{Path.cwd()})"
        raise FileNotFoundError(f"{a.data}: no such file or directory{where}{glob_hint(a.data)}; give the data file "
                                "to score, or demo for the packaged held-out questions")
    a.model = _base_for(a.adapter, a.model, "--model")
    if a.json is not None:  # before the load and scoring, not when the numbers are written
        out = Path(a.json).expanduser().resolve()
        for name, given in (("DATA", a.data), ("--model", a.model), ("--adapter", a.adapter)):
            target = given and Path(given).expanduser().exists() and Path(given).expanduser().resolve()
            if target and (out == target or target in out.parents):
                p.error(f"--json {a.json} would {'overwrite' if out == target else 'write into'} {name} {given}; "
                        "choose a file outside it")
        import tempfile

        try:  # a read-only folder, /proc: said now, not after minutes of scoring
            tempfile.TemporaryFile(dir=out.parent).close()
        except OSError as err:
            p.error(f"--json {a.json}: cannot write in {out.parent} ({err.strerror or err}); choose another file")
    from .evaluate import evaluate, write_json  # no _setup_logging: a summary, as chat prints answers only

    model, tok = _load(a.model, a.adapter, dev, a.dtype)
    # a row also costs max_seq_len^2 memory on the CPU path
    _within_context(p, model, a.model, ("--max-seq-len", a.max_seq_len), ("--max-new-tokens", a.max_new_tokens))
    # the data's warnings and errors name these flags ("raise --max-seq-len or set --on-long=truncate")
    flags = {option: _as_flags(key) for option, key in DATA_OPTION_KEYS.items()}
    try:
        result = evaluate(model, tok, data, dev, qa_limit=a.qa_limit, max_new_tokens=a.max_new_tokens,
                          option_names=flags)
    except ValueError as err:  # another error naming data.<key> (data.cache_dir): a flag here (still exit 3)
        said = _as_flags(str(err))
        if isinstance(err, ConfigError) or said == str(err):
            raise
        raise ValueError(said) from err
    if result.system_prompt is None and a.system_prompt is not None:
        print(f"note: --system-prompt has no effect: {a.data} holds no question/answer records (chat records keep "
              "their own system message)", file=sys.stderr)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result.settings = {"model": a.model, "adapter": a.adapter, "device": str(dev), "dtype": dtype,
                       "format": a.format, "train_on": a.train_on, "max_seq_len": a.max_seq_len,
                       "batch_size": a.batch_size, "on_long": a.on_long}
    print(f"model: {a.model}" + (f" + adapter {a.adapter}" if a.adapter else ""))
    print(result.summary())
    if a.json is not None:
        try:
            written = write_json(a.json, result.as_dict())
        except OSError as err:
            raise OSError(f"--json {a.json}: cannot write it ({err.strerror or err}); the numbers are printed "
                          "above") from err
        print(f"numbers: {written}")
    return 0


def cmd_bench(argv: list[str]) -> int:
    from . import bench  # imported lazily: it pulls in the contenders' optional dependencies

    rc = bench.main(argv)
    return int(rc or 0)


COMMANDS = {"train": cmd_train, "export": cmd_export, "chat": cmd_chat,
            "generate": lambda argv: cmd_chat(argv, prog="generate"), "eval": cmd_eval, "bench": cmd_bench}


def _usage(argv: list[str]) -> int:
    if argv and argv[0] not in ("-h", "--help"):
        print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
    print("usage: chronicals {train,export,chat,generate,eval,bench} ...\n"
          "  train     fine-tune (no arguments: the embedded demo); chronicals train --help lists every key\n"
          "  export    merge a LoRA adapter into its base and write a Hugging Face directory\n"
          "  chat      answer prompts with a base or fine-tuned model (generate: the same)\n"
          "  eval      score a base or fine-tuned model on a dataset: held-out loss, perplexity, QA keywords\n"
          "  bench     the end-to-end benchmark table\n"
          "chronicals --version prints the version")
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("--version", "-V"):  # was "error: unknown command '--version'", exit 2
        from . import __version__

        print(f"chronicals {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        return _quiet_if_stdout_closes(_usage, argv)
    if argv[0] != "bench":  # before any CUDA allocation; bench sets it for its chronicals rows only (the anchors
        os.environ.update(allocator_env())  # run as their own users run them)
    # SIGINT / SIGTERM outside the training loop (which checkpoints and stops on its own): unwind as a Ctrl-C
    # does, so temporary outputs are removed; one that lands inside a library (an import, a tokenizer) can
    # surface as another error, still a stop
    interrupted = []
    old = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum, frame):
            interrupted.append(signum)
            raise KeyboardInterrupt
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _quiet_if_stdout_closes(COMMANDS[argv[0]], argv[1:])
    except KeyboardInterrupt:  # a signal outside the loop, or a second Ctrl-C within it
        interrupted = interrupted or [signal.SIGINT]
    except Exception as e:
        if not interrupted:
            if isinstance(e, (ValueError, OSError)) and os.environ.get("CHRONICALS_TRACEBACK"):
                raise
            return _failed(e)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    name = signal.Signals(interrupted[0]).name
    if argv[0] == "train":
        print(f"\ninterrupted ({name}) outside a training step: checkpoints already written stay, and the run "
              "continues from the newest with train.resume=auto", file=sys.stderr)
    else:  # eval, chat, export, bench keep no checkpoints: train.resume means nothing to them
        print(f"\ninterrupted ({name}): chronicals {argv[0]} stopped; run it again to redo it", file=sys.stderr)
    return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has exited (poll reports POLLERR on Linux, POLLHUP on BSD/macOS);
    a BrokenPipeError from another pipe or socket is an error like any other OSError."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is not a file descriptor
        return False


def _quiet_if_stdout_closes(command, argv: list[str]) -> int:
    """``command(argv)``, ended as a command killed by SIGPIPE would when stdout's reader goes away
    (`chronicals train --help | head -1`): no message, status 141 (128 + SIGPIPE, the shell's convention).
    stdout then writes to os.devnull, so the interpreter's exit flush of what is still buffered does not raise
    BrokenPipeError again. A BrokenPipeError from another pipe goes on to main's handler (exit status 3)."""
    try:
        rc = command(argv)
        if sys.stdout is not None:  # None without a console (pythonw); print() then writes nothing
            sys.stdout.flush()  # a reader gone early raises here, not in the interpreter's exit flush
        return rc
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def _failed(e: Exception) -> int:
    """Exit status and message for an exception out of a command: 2 for a config value found bad only once the run
    resolves it (a device this machine lacks, a lora.targets name no module of the loaded model matches), 3 for bad
    input (the messages name the file and line), 4 for anything else: a bug, with its own status, as 1 means
    "diverged" to train's callers."""
    from .config import ConfigError

    if isinstance(e, (ValueError, OSError)):
        print(f"error: {e}\n(CHRONICALS_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 3  # a setting this machine or model cannot take
    import traceback

    traceback.print_exception(e)
    print("error: internal error in chronicals (the traceback above says where); please report it with the "
          "command that ran", file=sys.stderr)
    return 4


if __name__ == "__main__":
    sys.exit(main())
