"""``chronicals train | export | chat | generate | eval | bench``: thin wrappers over library functions.

    chronicals train                                  # the embedded demo (LoRA+ on SmolLM2-135M)
    chronicals train configs/qwen2.5-0.5b/lora.yaml optim.lr=2e-4 train.max_steps=500
    chronicals export --base smollm2-135m-instruct --adapter runs/demo/adapter --out runs/demo/merged
    chronicals chat --model smollm2-135m-instruct --adapter runs/demo/adapter "Who founded Vellmora?"
    chronicals eval --adapter runs/demo/adapter demo --json runs/demo/eval.json
    chronicals bench --help

Here: the dispatcher (exit statuses, signals, a closed stdout), train, export and bench; chat and generate are in
cli_chat.py, eval in cli_eval.py, and the model loading that export, chat and eval share in cli_models.py.
"""

from __future__ import annotations

import os
import select
import shlex
import signal
import sys
import threading
from pathlib import Path

from ._cli_args import Parser
from .cli_chat import _run_system_prompt, cmd_chat  # noqa: F401 (_run_system_prompt: chronicals.cli's before the split)
from .cli_eval import cmd_eval
from .cli_models import (_base_for, _check_adapter_before_load, _here, _load, _model_and_base, _rank, _recorded,
                         _setup_logging)
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


def _train_args_problem(paths: list[str]) -> str | None:
    """What is wrong with the train arguments that are not overrides, or None: one CONFIG.yaml at most."""
    for a in paths:
        if a.startswith("--config"):
            given = a.split("=", 1)[1] if "=" in a else next((p for p in paths if not p.startswith("-")), "CONFIG.yaml")
            return f"{a.split('=', 1)[0]} is not an option: give the config file itself, as in chronicals train {given}"
        if a.startswith("-"):
            return f"{a} is not an option: train takes [CONFIG.yaml] [section.key=value ...]"
        pipe = Path(a).exists() and not Path(a).is_file() and not Path(a).is_dir()  # <(...): /dev/fd/63
        if not a.endswith((".yaml", ".yml")) and not pipe:
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
        if "=" in a:  # a '/' before the '=' is in no key: a path, missing or not (then "not found", not a key)
            return a.endswith((".yaml", ".yml")) and a.split(".", 1)[0] not in sections and (
                Path(a).is_file() or "/" in a.split("=", 1)[0])
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
                  f"continue with: {_relaunch(again)}")
        return 130
    if _rank() == 0:
        print(report.summary(result))
    return 0


def _relaunch(args: list[str]) -> str:
    """The command that runs ``chronicals train ARGS`` as this process was launched, quoted to paste as printed:
    under torchrun, torchrun with as many processes (a checkpoint taken mid-epoch resumes only on as many ranks,
    and one process would train on half the global batch)."""
    world, local = (int(os.environ.get(k) or 1) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    if world <= 1:
        return shlex.join(["chronicals", "train", *args])
    cmd = shlex.join(["torchrun", "--nproc-per-node", str(local), "-m", "chronicals.cli", "train", *args])
    return cmd if local == world else f"{cmd} (on each of the {world // local} nodes, as this run was launched)"


def cmd_export(argv: list[str]) -> int:
    p = Parser(prog="chronicals export",
               description="Write a Hugging Face model directory: a LoRA adapter merged into its "
                           "base (--adapter), or a model as it is (--model without --adapter): a "
                           "full fine-tuning run's checkpoint, a .gguf file.")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="the model: HF directory, .gguf, smollm2-135m-instruct, or a full fine-tuning run's checkpoint "
                        "(runs/x/checkpoints/step-N); with --adapter its base (default: the base recorded in the "
                        "adapter, else the embedded one)")
    p.add_argument("--base", default=None, metavar="MODEL",
                   help="with --adapter: its base (as --model); with a full fine-tuning run's checkpoint as --model: "
                        "the model that run trained from, where it has moved (default: the one the checkpoint records)")
    p.add_argument("--adapter", default=None, help="adapter directory (PEFT format, e.g. runs/demo/adapter), or a LoRA "
                                                   "run's checkpoint (runs/demo/checkpoints/step-N), merged into the "
                                                   "base")
    p.add_argument("--out", required=True, help="output directory (replaced atomically if it exists and holds "
                                                "only a model's files)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype of the written weights: auto = the base checkpoint's own (a bf16 model stays bf16, "
                        "as transformers + PEFT merge it; a .gguf base is dequantized to float32); each W + s B A is "
                        "computed in fp32 and rounded once to it (bfloat16 from an fp32 or fp16 base: the base loads "
                        "in its own dtype or fp32, then the merged model is rounded); a full run's checkpoint: the "
                        "dtype it trained in, as its model/ is written (its fp32 masters rounded once; float32 keeps "
                        "them)")
    p.add_argument("--no-merge", action="store_true",
                   help="write the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors, fp32) "
                        "instead of the merged model: for a LoRA run's checkpoint, the adapter of that step, as "
                        "peft.PeftModel.from_pretrained loads it")
    a = p.parse_args(argv)
    if not a.out.strip():  # Path("") is the working directory
        p.error("--out is empty; give the output directory")
    a.base, ckpt_base, flag = _model_and_base(p, a, base_alone_is_model=True, default_flag="--base")
    if a.adapter is None and a.base is None:
        p.error("give --adapter (a LoRA adapter or a LoRA run's checkpoint, merged into its base) or --model (a model "
                "written as it is: a full fine-tuning run's checkpoint runs/x/checkpoints/step-N, a .gguf file)")
    if a.no_merge and a.adapter is None:
        p.error("--no-merge writes an adapter, and no --adapter was given; leave --no-merge out to write --model")
    if a.no_merge and a.dtype != "auto":  # the adapter is written in fp32 whatever --dtype says
        p.error(f"--dtype {a.dtype} applies to the merged model; --no-merge writes the adapter in fp32 (PEFT's own "
                "format): leave --dtype out")
    if a.adapter:
        a.base = _base_for(a.adapter, a.base, flag)
    from .train.checkpoint_adapter import is_checkpoint_dir

    tok_from = a.base  # where the config and tokenizer come from
    guarded = [(flag, a.base), ("--adapter", a.adapter)]
    if is_checkpoint_dir(a.base):  # a full fine-tuning run's step: its base holds the config and tokenizer
        from .train.checkpoint_model import checkpoint_base, read_full_checkpoint

        tok_from = ckpt_base or checkpoint_base(a.base)  # _load says once when --base is not the recorded one
        guarded += [("--base", ckpt_base), (f"the base recorded in {a.base}", read_full_checkpoint(a.base).base)]
    elif a.adapter:  # the model the adapter was trained on, whatever --base says: its run resumes on it
        guarded.append((f"the base recorded in {a.adapter}", _recorded(a.adapter)[0]))
    written = "the written model" if not a.adapter or a.no_merge else "the merged model"
    # '~' expanded as the load and the write expand it: --base=~/m --out=~/m (no shell expands '~' after '=')
    # passed these checks and the merged model replaced its own base
    out = Path(a.out).expanduser().resolve()
    for name, given in guarded:
        if given is None:
            continue
        where = Path(given).expanduser()
        if where.exists() and out in (where.resolve(), *where.resolve().parents):
            print(f"error: --out {a.out} would replace {name} {given} (the output directory is replaced as a "
                  "whole); choose another --out", file=sys.stderr)
            return 2
        if where.is_dir() and where.resolve() in out.parents:  # a foreign folder in it from then on
            print(f"error: --out {a.out} is inside {name} {given}: {written} would become a folder of it, "
                  f"which a later save of {given} refuses to delete; choose an --out outside it", file=sys.stderr)
            return 2
    from .lora.peft_io import CONFIG_NAME, WEIGHTS_NAME
    from .models.hf_io import MODEL_DIR_FILES, check_output_dir, has_tokenizer
    from .models.license_files import describe, license_files
    from .models.loading import SHORT_NAMES, hf_dir, recorded_name

    # the base's LICENSE / NOTICE files, or a .gguf's recorded license as a README.md model card: written with the
    # model (an adapter in PEFT's format, --no-merge, carries none, as PEFT's own save writes none). A base that is
    # not here is the load's to report, after --out's checks (a bad --out is said first, before any load)
    carried = license_files(tok_from) if not a.no_merge and _here(tok_from) else {}
    try:  # before the load and merge (minutes for an 8B model), not when the merged model is written
        check_output_dir(a.out, (CONFIG_NAME, WEIGHTS_NAME) if a.no_merge else MODEL_DIR_FILES, carried)
    except (OSError, ValueError) as e:  # ValueError: the working directory, an empty path (save_model's refusals)
        print(f"error: --out {a.out}: {e}", file=sys.stderr)
        return 2
    # a base saved by transformers' save_pretrained alone has no tokenizer files, and a merge needs none: it was
    # refused with "call load_model(..., tokenizer=False)", which the command line cannot do
    base_dir = None if tok_from.lower() in SHORT_NAMES else Path(tok_from).expanduser()  # a short name wins
    if base_dir is not None and base_dir.is_file():  # a .gguf: its cached conversion holds what tokenizer it carries
        base_dir = hf_dir(base_dir)
    # a model directory (config.json) only: any other folder is the load's to refuse, with no note before it
    no_tokenizer_files = base_dir is not None and (base_dir / "config.json").is_file() and not has_tokenizer(base_dir)
    note = None
    if no_tokenizer_files and not a.no_merge:
        what = "carries no tokenizer" if base_dir != Path(tok_from).expanduser() else \
            "has no tokenizer files (tokenizer.json / tokenizer_config.json)"
        note = f"note: {tok_from} {what}: {a.out} is written without them; copy them from the original model"
    _setup_logging()
    from . import save_model
    from .lora import merge_lora

    import torch

    from .train.setup import resolve_device

    # A and B as the file has them (fp32 from PEFT and from us): in the base's bf16 they were rounded before the
    # merge, and 14.8% of a bf16 merge's elements then differed from W + s B A rounded once
    load_dtype = "checkpoint" if a.dtype == "auto" else a.dtype
    if a.no_merge and _saves_modules(a.adapter):
        # the modules_to_save tensors (an lm_head, an embedding) are written from the model's parameters: on a bf16
        # base they were rounded to bf16 on the way, and the written adapter lost the file's fp32 bits (a walk).
        # Loaded in fp32 (exact for a bf16 or fp16 base), the adapter is written as the file or checkpoint holds it
        load_dtype = "float32"
    elif a.adapter and not a.no_merge and a.dtype == "bfloat16" and not is_checkpoint_dir(a.base):
        # the base in its own dtype, the merge in fp32, then one rounding to bf16: loaded in bf16, W was rounded
        # before W + s B A was, and 21% of the adapted elements of a SmolLM2 merge (fp32 base) differed from
        # W + s B A rounded once (a walk)
        load_dtype = "checkpoint"
    _check_adapter_before_load(a.base, a.adapter, ckpt_base)  # after --out's checks, before the weights load
    model, tok = _load(a.base, a.adapter, resolve_device("cpu"), load_dtype,
                       adapter_dtype=torch.float32, tokenizer=not (a.no_merge or no_tokenizer_files),
                       ckpt_base=ckpt_base)
    if note:  # once the model has loaded: a model refused by the load is not written at all (a user walk)
        print(note, file=sys.stderr)
    if a.no_merge:
        from .lora import save_adapter

        base = recorded_name(a.base)  # found from anywhere, as a run's adapter/ records it
        written = save_adapter(model, a.out, base_model_name_or_path=base)
        print(f"wrote the adapter of {a.adapter} (base {base}) in PEFT's format: {written}")
        return 0
    dtype = str(model.lm_head.weight.dtype).removeprefix('torch.')
    if not a.adapter:
        written = save_model(model, tok, a.out, extra_files=carried)
        print(f"wrote {a.base} as a Hugging Face directory: {written} ({dtype}){describe(carried, tok_from)}")
        return 0
    if a.dtype == "bfloat16" and model.lm_head.weight.dtype == torch.float16:
        model.float()  # exact: the merge then rounds W + s B A once, to bf16 below, not to fp16 first
    merge_lora(model)
    if a.dtype == "bfloat16" and model.lm_head.weight.dtype != torch.bfloat16:  # loaded in its own dtype (above)
        model.to(torch.bfloat16)
        dtype = "bfloat16"
    written = save_model(model, tok, a.out, extra_files=carried)
    print(f"merged {a.adapter} into {a.base}: {written} ({dtype}){describe(carried, tok_from)}")
    return 0


def _saves_modules(adapter: str) -> bool:
    """Whether the adapter (a PEFT adapter directory or a LoRA run's checkpoint) trains modules in full
    (modules_to_save), whose tensors a --no-merge export writes from the loaded model's parameters."""
    from .lora.peft_io import read_adapter_config
    from .train.checkpoint_adapter import is_checkpoint_dir, read_lora_checkpoint

    if is_checkpoint_dir(adapter):
        return bool(read_lora_checkpoint(adapter).lora.get("modules_to_save"))
    return bool(read_adapter_config(adapter).get("modules_to_save"))


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
          "  export    write a Hugging Face directory: a LoRA adapter merged into its base, a checkpoint's model\n"
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
    if argv[0] != "train" and _rank() != 0:
        return _left_to_rank_0(argv[0])
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
            return _failed(e, argv[0])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    name = signal.Signals(interrupted[0]).name
    if argv[0] == "train" and _rank() != 0:  # rank 0 says how to go on, once (torchrun runs every rank's CLI)
        return 130
    if argv[0] == "train":
        # the checkpoints in train.out_dir may be an earlier run's (this one stopped before its first save, under
        # train.resume=none or other data): resume=auto was advised and resumed that run, or failed on its data
        print(f"\ninterrupted ({name}): run the same command again to go on: train.resume=auto (the default) "
              "continues from the newest checkpoint in train.out_dir (steps after it are trained again; past the "
              "last step, only the closing evaluation and final save are left to run), or starts over when there is "
              "none", file=sys.stderr)
        if name == "SIGTERM" and "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun stops the others when one fails
            print("(under torchrun a SIGTERM also comes when another rank failed: if one printed an error above, "
                  "fix that first)", file=sys.stderr)
    else:  # eval, chat, export, bench keep no checkpoints: train.resume means nothing to them
        print(f"\ninterrupted ({name}): chronicals {argv[0]} stopped; run it again to redo it", file=sys.stderr)
    return 130


def _left_to_rank_0(command: str) -> int:
    """Exit status 0, after one line, for a rank other than 0 under torchrun running a command that is one job:
    export, eval, chat, generate, bench. Only train is data parallel; the others ran whole on every rank (two
    evals, two exports writing one --out in turn, two chats reading one stdin: rank 1 found no line, failed, and
    torchrun stopped rank 0 before it answered). Rank 0 runs it as one process would, so the job is done once, as
    asked; a refusal on every rank would make the user run it again. The other ranks read no stdin and load
    nothing, and torchrun's status is rank 0's."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    print(f"rank {_rank()} of {world}: chronicals {command} runs once, on rank 0 (only train is data parallel; run "
          f"{command} without torchrun)", file=sys.stderr)
    return 0


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


def _traceback_wanted() -> bool:
    """CHRONICALS_TRACEBACK set to anything but '', 0, false, no or off (0 had turned it on)."""
    return os.environ.get("CHRONICALS_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no", "off")


def _lost_rank(e: Exception) -> bool:
    """A collective's failure under torchrun (WORLD_SIZE > 1): torch.distributed's DistError, or gloo's / NCCL's
    RuntimeError for a peer that went away."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or not isinstance(e, RuntimeError):
        return False
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    peer_gone = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
                 "Timed out waiting", "collective operation timeout")  # gloo's, NCCL's watchdog: a peer stuck
    return (dist_error is not None and isinstance(e, dist_error)) or any(m in str(e) for m in peer_gone)


# what to lower when a command runs out of memory, by command
_MEMORY_FIX = {
    "train": "lower data.batch_size, data.max_seq_len or data.tokens_per_batch, set model.checkpointing=true or add "
             "gate_up to model.recompute, or lower lora.rank; checkpoints already written stay (train.resume=auto "
             "continues from the last)",
    "eval": "lower --batch-size or --max-seq-len",
    "chat": "lower --max-new-tokens or shorten the prompt",
}


def _out_of_memory(e: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    import torch

    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e))


def _failed(e: Exception, command: str = "") -> int:
    """Exit status and message for an exception out of a command: 2 for a config value found bad only once the run
    resolves it (a device this machine lacks, a lora.targets name no module of the loaded model matches), 3 for bad
    input (the messages name the file and line) or a run that does not fit in memory, 4 for anything else: a bug,
    with its own status, as 1 means "diverged" to train's callers."""
    from .config import ConfigError

    if _lost_rank(e):  # another rank died (killed, out of memory): this one's collective failed, no bug of ours
        print(f"error: another process of this data-parallel job failed or was lost ({type(e).__name__}: "
              f"{str(e).strip().splitlines()[0][:300]}); its own output says why. Checkpoints already written stay: "
              "start the job again with train.resume=auto", file=sys.stderr)
        return 3
    if _out_of_memory(e):  # the most common way a run fails, and no bug: it was "internal error ... report it"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        fix = _MEMORY_FIX.get(command, "use a smaller model, batch or sequence")
        print(f"error: out of memory ({first}); {fix}", file=sys.stderr)
        return 3
    if isinstance(e, (ValueError, OSError)):
        shown = _traceback_wanted()
        if shown:  # the exit status stays the error's (1 means "diverged")
            import traceback

            traceback.print_exception(e)
        print(f"error: {e}" + ("" if shown else "\n(CHRONICALS_TRACEBACK=1 shows where it was raised)"),
              file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 3  # a setting this machine or model cannot take
    import traceback

    traceback.print_exception(e)
    print("error: internal error in chronicals (the traceback above says where); please report it with the "
          "command that ran", file=sys.stderr)
    return 4


if __name__ == "__main__":
    sys.exit(main())
