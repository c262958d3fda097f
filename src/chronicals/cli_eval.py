"""``chronicals eval``: score a base or fine-tuned model on a dataset without training (held-out loss,
perplexity, QA keyword accuracy), with the data section's keys as flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._cli_args import Parser
from .cli_models import (BASE_HELP, DTYPE_HELP, _base_for, _check_adapter_first, _load, _model_and_base, _not_utf8,
                         _setup_logging, _tokenizer_first, _within_context, add_verbose)


_DATA_FLAGS = ("format", "train_on", "max_seq_len", "system_prompt", "batch_size", "on_long", "on_error", "cache_dir",
               "num_proc")


def _as_flags(message: str) -> str:
    """A data error's ``data.max_seq_len`` / ``data.on_long=truncate`` as eval's flags ``--max-seq-len`` /
    ``--on-long=truncate`` (argparse takes both forms), and ``data.eval_path`` / ``data.path`` as its DATA argument."""
    import re

    message = re.sub(r"\bdata\.(eval_)?path\b", "the DATA argument", message)
    return re.sub(rf"\bdata\.({'|'.join(_DATA_FLAGS)})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def cmd_eval(argv: list[str]) -> int:
    from .config import DataSection, EvalSection

    d, e = DataSection(), EvalSection()  # the defaults of the config's data and eval sections
    p = Parser(prog="chronicals eval",
               description="Score a base or fine-tuned model on a dataset without training: held-out "
                           "loss (mean over loss tokens), perplexity, examples and loss tokens, and "
                           "for question/answer/keywords records the keyword accuracy of greedy "
                           "answers; the same numbers as train's held-out 'before'/'after'. The data "
                           "options are the data section's keys (data.max_seq_len: --max-seq-len).")
    p.add_argument("data", help="file to score: .jsonl/.json/.parquet/.arrow/.csv, a directory of them or a "
                                "datasets.save_to_disk directory (as data.path), or "
                                "demo (the packaged held-out questions)")
    p.add_argument("--model", default=None, help="HF directory, .gguf, smollm2-135m-instruct, or a full fine-tuning "
                                                  "run's checkpoint (runs/x/checkpoints/step-N) (default: with "
                                                  "--adapter the base recorded in it, else smollm2-135m-instruct)")
    p.add_argument("--base", default=None, metavar="MODEL", help=BASE_HELP)
    p.add_argument("--adapter", default=None, help="LoRA adapter directory to apply (PEFT format, e.g. "
                                                    "runs/demo/adapter), or a LoRA run's checkpoint "
                                                    "(runs/demo/checkpoints/step-N)")
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
                                                         "its held-out questions beside your own data; given, "
                                                         "it is used as given, '' for none)")
    p.add_argument("--on-long", default=d.on_long, choices=["truncate", "drop", "split"],
                   help="examples longer than --max-seq-len: cut to it, left out, or split into documents of it "
                        "(default: %(default)s)")
    p.add_argument("--on-error", default=d.on_error, choices=["fail", "skip"],
                   help="malformed records: stop at the first, naming it (default), or skip and count them")
    p.add_argument("--cache-dir", default=d.cache_dir, help="tokenization cache ('' = the default, none = no cache)")
    p.add_argument("--num-proc", type=int, default=d.num_proc,
                   help="processes that tokenize DATA (0 = auto: 1 below 8 MB of files, else min(8, cpus))")
    p.add_argument("--qa-limit", type=int, default=e.qa_limit, help="questions to answer (0 = all, the default)")
    p.add_argument("--max-new-tokens", type=int, default=e.max_new_tokens,
                   help="tokens generated per answer (default: %(default)s, as train's eval.max_new_tokens)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help=DTYPE_HELP)
    add_verbose(p)
    a = p.parse_args(argv)
    if a.verbose:  # else answers (chat) or the summary (eval) only, and warnings
        _setup_logging()
    for flag, value, least in (("--max-seq-len", a.max_seq_len, 8), ("--batch-size", a.batch_size, 1),
                               ("--qa-limit", a.qa_limit, 0), ("--max-new-tokens", a.max_new_tokens, 1)):
        if value < least:
            p.error(f"{flag} {value}: expected an integer >= {least}")
    if not a.data.strip():
        p.error("the data argument is empty; give the file to score (or demo)")
    if a.system_prompt is not None and (bad := _not_utf8(a.system_prompt)) is not None:
        p.error(f"--system-prompt is not valid UTF-8 ({bad}); pass the text in UTF-8")
    if a.json is not None:
        out = Path(a.json).expanduser()
        if not a.json.strip() or out.is_dir():
            p.error(f"--json {a.json!r} is {'empty' if not a.json.strip() else 'a directory'}; give a file name")
        if not out.parent.is_dir():
            p.error(f"--json {a.json}: the folder {out.parent} does not exist; create it or choose another file")
    from .config import DEMO, ConfigError
    from .data.files import glob_hint
    from .train.guards import where_read
    from .train.setup import DATA_OPTION_KEYS, resolve_device

    try:
        dev = resolve_device(a.device, key="--device")
        data = DataSection(path=a.data, format=a.format, train_on=a.train_on, max_seq_len=a.max_seq_len,
                           batch_size=a.batch_size, on_long=a.on_long, on_error=a.on_error, cache_dir=a.cache_dir,
                           num_proc=a.num_proc,
                           system_prompt=d.system_prompt if a.system_prompt is None else a.system_prompt)
    except ConfigError as err:  # "config data.max_seq_len=... is invalid": here that key is a flag
        p.error(_as_flags(str(err).removeprefix("config ")))
    from .train.qa import warn_demo_shadows

    warn_demo_shadows(a.data, "DATA")
    if a.data != DEMO and not Path(a.data).expanduser().exists():  # before the model loads
        where = where_read(Path(a.data).expanduser())
        raise FileNotFoundError(f"{a.data}: no such file or directory{where}{glob_hint(a.data)}; give the data file "
                                "to score, or demo for the packaged held-out questions")
    if a.data != DEMO and Path(a.data).expanduser().is_dir():  # as train's check_data_paths: a directory is read
        from .train.guards import lies_in  # whole, so the cache's meta.json became a record next time
        from .train.setup import tokenization_cache_dir

        cache = tokenization_cache_dir(data.cache_dir)
        if cache is not None and lies_in(cache, a.data):
            p.error(f"--cache-dir {cache} is inside DATA {a.data}, whose files are all read as data; put the cache "
                    "outside it")
    a.model, ckpt_base, flag = _model_and_base(p, a)
    a.model = _base_for(a.adapter, a.model, flag)
    if a.json is not None:  # before the load and scoring, not when the numbers are written
        out = Path(a.json).expanduser().resolve()
        guarded = [("DATA", None if a.data == DEMO else a.data),  # the packaged data, not ./demo: nothing to guard
                   ("--model", a.model), ("--adapter", a.adapter), ("--base", ckpt_base)]
        if ckpt_base is None:  # a full fine-tuning checkpoint loads the base it records: its config.json was
            guarded.append((f"the base recorded in {a.model}", _recorded_base(a.model)))  # overwritten, exit 0
        for name, given in guarded:
            target = given and Path(given).expanduser().exists() and Path(given).expanduser().resolve()
            if target and (out == target or target in out.parents):
                p.error(f"--json {a.json} would {'overwrite' if out == target else 'write into'} {name} {given}; "
                        "choose a file outside it")
        if out.exists() and not _earlier_result(out):  # another run's adapter_config.json, config.yaml, ...
            p.error(f"--json {a.json} exists and is not an earlier chronicals eval result (a JSON object with "
                    "'data' and 'loss'), which is all eval writes over; choose another file, or remove it first")
        from ._jsonio import temp_beside

        try:  # a read-only folder, /proc, a name too long: said now, not after minutes of scoring
            tmp = temp_beside(out)
            tmp.open("w").close()  # the very file the write makes first
            tmp.unlink()
        except OSError as err:
            p.error(f"--json {a.json}: cannot write in {out.parent} ({err.strerror or err}); choose another file")
    # no _setup_logging: a summary, as chat prints answers
    from .evaluate import check_read_ids, evaluate, read_eval_data, write_json
    from .models.loading import meta_model

    # the tokenizer and config.json, then the data, then the weights (seconds for the embedded model, minutes at 8B):
    # a length past the model's context (exit 2) and a bad record (exit 3) are said before the weights load
    tok, config = _tokenizer_first(a.model, ckpt_base)
    # a row also costs max_seq_len^2 memory on the CPU path
    _within_context(p, config, a.model, ("--max-seq-len", a.max_seq_len), ("--max-new-tokens", a.max_new_tokens))
    shell = meta_model(config)  # the model's modules and config, no weights
    if a.adapter:  # its config, weights file and names against the model's modules: before the data too
        _check_adapter_first(shell, a.adapter)
    # the data's warnings and errors name these flags ("raise --max-seq-len or set --on-long=truncate")
    flags = {option: _as_flags(key) for option, key in DATA_OPTION_KEYS.items()}
    read = _said_in_flags(read_eval_data, tok, data, flags, a.system_prompt)  # a given system prompt as given
    _said_in_flags(check_read_ids, shell, read, data)  # ids past config.json's vocab_size: before the weights too
    model, _ = _load(a.model, a.adapter, dev, a.dtype, tokenizer=False, ckpt_base=ckpt_base)
    result = _said_in_flags(evaluate, model, tok, data, dev, qa_limit=a.qa_limit, max_new_tokens=a.max_new_tokens,
                            read=read)
    if result.system_prompt is None and a.system_prompt is not None:
        print(f"note: --system-prompt has no effect: {a.data} holds no question/answer records (chat records keep "
              "their own system message)", file=sys.stderr)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result.settings = {"model": a.model, "adapter": a.adapter, "device": str(dev), "dtype": dtype,
                       "format": a.format, "train_on": a.train_on, "max_seq_len": a.max_seq_len,
                       "batch_size": a.batch_size, "on_long": a.on_long}
    if result.system_prompt is not None:  # QA: the answers and their accuracy depend on these (a generation walk)
        result.settings.update(max_new_tokens=a.max_new_tokens, qa_limit=a.qa_limit)
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


def _said_in_flags(call, *args, **kwargs):
    """``call(*args, **kwargs)``, its ValueError that names a data.<key> (data.cache_dir) raised again naming eval's
    flag (still exit 3; a ConfigError as it is)."""
    from .config import ConfigError

    try:
        return call(*args, **kwargs)
    except ValueError as err:
        said = _as_flags(str(err))
        if isinstance(err, ConfigError) or said == str(err):
            raise
        raise ValueError(said) from err


def _recorded_base(model: str | None) -> str | None:
    """The base a full fine-tuning run's checkpoint ``model`` records, else None (not a checkpoint, or one the load
    will refuse with its own error)."""
    from .train.checkpoint_adapter import is_checkpoint_dir
    from .train.checkpoint_model import read_full_checkpoint

    if model is None or not is_checkpoint_dir(model):
        return None
    try:
        return read_full_checkpoint(model).base
    except (OSError, ValueError):
        return None


def _earlier_result(path: Path) -> bool:
    """``path`` holds what eval --json writes (a JSON object with "data" and "loss"): a rerun may replace it."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and {"data", "loss"} <= obj.keys()
