"""``chronicals chat`` (and ``generate``, the same): answer prompts, greedy, with a base or fine-tuned model."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from ._cli_args import Parser
from ._words import counted
from .cli_models import (BASE_HELP, DTYPE_HELP, _base_for, _check_adapter_before_load, _load, _model_and_base,
                         _not_utf8, _setup_logging, _shown, _within_context, add_verbose)


def _run_system_prompt(path: str | None) -> str | None:
    """The system message of the held-out prompts of the run that wrote ``path`` (``train.out_dir``/adapter or
    /model, or one of the run's checkpoints): from the run's config.yaml beside it (the config in the checkpoint's
    state.pt), so chat asks as the run's held-out questions were asked. None when ``path`` is not in a run directory
    (or its config does not load)."""
    if not path:
        return None
    from .config import load_config
    from .config_schema import stored_config
    from .train.checkpoint_adapter import is_checkpoint_dir, read_run_checkpoint
    from .train.qa import heldout_system_prompt

    cfg_file = Path(path).expanduser().parent / "config.yaml"
    try:
        if is_checkpoint_dir(path):  # a run's checkpoint (LoRA or full) carries the run's config
            system, cfg_file = heldout_system_prompt(read_run_checkpoint(path).config.data), Path(path) / "state.pt"
        elif Path(path).name in ("adapter", "model") and cfg_file.is_file():
            with stored_config():
                system = heldout_system_prompt(load_config(cfg_file).data)
        else:
            return None
    except (ValueError, OSError):  # another tool's config.yaml, or one of an older version: not ours to judge
        return None
    shown = repr(system) if system else "none (the chat template's default)"
    print(f"--system not given: using {shown}, the system message of {cfg_file}'s held-out prompts", file=sys.stderr)
    return system


def cmd_chat(argv: list[str], prog: str = "chat") -> int:
    p = Parser(prog=f"chronicals {prog}",
               description="Answer prompts (greedy, or sampled with --temperature) with a base or "
                           "fine-tuned model; with no prompts, read one per line from stdin. In a "
                           "terminal the conversation goes on turn by turn (/reset starts over); "
                           "given or piped prompts are each asked on their own (--turns).")
    p.add_argument("prompts", nargs="*", help="user messages to answer")
    p.add_argument("--model", default=None, help="HF directory, .gguf, smollm2-135m-instruct, or a full fine-tuning "
                                                  "run's checkpoint (runs/x/checkpoints/step-N) (default: with "
                                                  "--adapter the base recorded in it, else smollm2-135m-instruct)")
    p.add_argument("--base", default=None, metavar="MODEL", help=BASE_HELP)
    p.add_argument("--adapter", default=None, help="LoRA adapter directory to apply (e.g. runs/demo/adapter), "
                                                         "or a LoRA run's checkpoint (runs/demo/checkpoints/step-N)")
    p.add_argument("--system", default=None, help="system message (default: the one the run that wrote --adapter "
                                                    "or --model used for its held-out prompts, read from the run's "
                                                    "config.yaml beside it, or from a checkpoint's state.pt; else "
                                                    "the one the demo trains with)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many tokens per answer (>= 1; "
                                                                   "default 128); fewer where prompt and answer would pass the "
                                                                   "model's context (said once)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help=DTYPE_HELP)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, the same answer every time; > 0: sample, higher is more varied")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature > 0, sample from the most likely tokens whose probability reaches this "
                        "(0 < p <= 1; default 1: from all)")
    p.add_argument("--seed", type=int, default=None,
                   help="with --temperature > 0, the sampling seed (same seed, prompts and model: same answers); "
                        "default: a fresh one each run")
    p.add_argument("--turns", default="auto", choices=["auto", "multi", "single"],
                   help="multi: each prompt follows the earlier prompts and answers (the oldest dropped when they "
                        "would not fit the context; a line '/reset' forgets them); single: each prompt asked on its "
                        "own; auto (default): multi in a terminal, single for given or piped prompts")
    add_verbose(p)
    a = p.parse_args(argv)
    if a.verbose:  # else answers (chat) or the summary (eval) only, and warnings
        _setup_logging()
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens {a.max_new_tokens}: an answer needs at least 1 new token")
    if not 0 <= a.temperature < float("inf"):  # NaN too
        p.error(f"--temperature {a.temperature}: expected a finite number >= 0 (0 = greedy)")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p {a.top_p}: expected a number in (0, 1] (1 = sample from every token)")
    if a.seed is not None and not -2**63 <= a.seed < 2**64:  # torch.Generator.manual_seed's range
        p.error(f"--seed {a.seed} must be in [-2**63, 2**64)")
    if not a.temperature and (a.top_p != 1 or a.seed is not None):
        p.error("--top-p and --seed shape sampling, and without --temperature > 0 answers are greedy; add "
                "--temperature (e.g. 0.7)")
    if any(not q.strip() for q in a.prompts):
        p.error("an empty prompt was given; pass the message text (or no prompts to read them from stdin)")
    for what, text in [("a prompt", q) for q in a.prompts] + [("--system", a.system or "")]:
        if (bad := _not_utf8(text)) is not None:
            p.error(f"{what} is not valid UTF-8 ({bad}); pass the text in UTF-8")
    from .train.setup import resolve_device

    try:
        dev = resolve_device(a.device, key="--device")
    except ValueError as e:
        p.error(str(e))
    a.model, ckpt_base, flag = _model_and_base(p, a)
    a.model = _base_for(a.adapter, a.model, flag)
    _check_adapter_before_load(a.model, a.adapter, ckpt_base)  # before stdin is read and the weights load
    from .config import DEMO_SYSTEM_PROMPT
    from .models import require_chat_template
    from .train.qa import TemplateRefused, answer

    prompts = a.prompts
    # a terminal: answers only, streamed; given or piped: "> prompt", then the whole answer
    interactive = not prompts and sys.stdin.isatty()
    multi = a.turns == "multi" or a.turns == "auto" and interactive
    refused = 0
    if not prompts and not interactive:  # piped: up to the first line to answer before the model loads (seconds
        # to minutes); one prompt per line, blank lines skipped, and a "/reset" before any turn has nothing to reset
        lines = (line.strip() for line in _stdin_lines())
        first = None
        for line in lines:
            if line and not (multi and line == "/reset"):
                if (bad := _not_utf8(line)) is None:
                    first = line
                    break
                _refuse_line(line, bad, interactive)
                refused += 1
        if first is None:
            return 3 if refused else _no_prompt(multi)
        prompts = itertools.chain([first], lines)
    model, tok = _load(a.model, a.adapter, dev, a.dtype, ckpt_base=ckpt_base)
    require_chat_template(tok)  # before any prompt is answered
    _within_context(p, model, a.model, ("--max-new-tokens", a.max_new_tokens))
    system = _run_system_prompt(a.adapter or a.model) if a.system is None else a.system
    fallback = system is None
    system = _system_the_template_takes(p, tok, DEMO_SYSTEM_PROMPT if fallback else system, a.system is not None,
                                        a.model)
    if fallback and system:  # said: another default (a run's, transformers' template's own) answers otherwise
        print(f"--system not given: using {system!r}, the demo's system message (no run's config.yaml beside the "
              "model or adapter names one)", file=sys.stderr)
    if interactive:
        print("type a message and press enter (Ctrl-D to quit" + ("; /reset starts the conversation over)" if multi
                                                                  else ")"), file=sys.stderr)
        prompts = _typed()
    sampler = None
    if a.temperature:  # one generator for the session: each answer draws on from where the last one stopped
        import torch

        sampler = torch.Generator(device=model.lm_head.weight.device)
        if a.seed is None:
            sampler.seed()
        else:
            sampler.manual_seed(a.seed)
    streamer = None
    if interactive:  # the answer shown as it is decoded, then a new line
        from transformers import TextStreamer

        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    history: list[tuple[str, str]] = []  # (prompt, answer) of the turns so far, oldest first (multi)
    capped = dropped = False
    for q in prompts:
        if not q:
            continue
        if multi and q == "/reset":
            history.clear()
            print("(the conversation starts over)", file=sys.stderr, flush=True)
            continue
        if (bad := _not_utf8(q)) is not None:  # a piped or typed line: said, and the next one is read
            _refuse_line(q, bad, interactive)
            refused += 1
            continue
        try:
            room, why = _answer_room(model, tok, q, system, a.max_new_tokens, a.model, history)
            best = _answer_room(model, tok, q, system, a.max_new_tokens, a.model)[0] if history else room
        except TemplateRefused as e:  # this conversation: said, and the next prompt is read
            print(f"error: {e}", file=sys.stderr, flush=True)
            refused += 1
            continue
        while history and room < best:  # the oldest turns give way to as long an answer as this prompt alone gets
            history.pop(0)
            room, why = _answer_room(model, tok, q, system, a.max_new_tokens, a.model, history)
            if not dropped:  # once a session
                print("note: earlier turns are dropped, oldest first, where they would shorten the answer (the "
                      "conversation and the answer share the model's context)", file=sys.stderr)
                dropped = True
        if not room:  # this prompt alone fills the context: said, and the next one is read
            print(f"error: {why}", file=sys.stderr, flush=True)
            refused += 1
            continue
        if why and not capped:  # once: in a long session every long prompt would repeat it
            print(f"note: {why}", file=sys.stderr)
            capped = True
        reply = answer(model, tok, q, system, room, a.temperature, a.top_p, sampler, history, streamer)
        if not interactive:
            print(f"> {q}\n{reply}", flush=True)
        if multi:
            history.append((q, reply))
    return 3 if refused else 0  # 3: bad input, as a data file's bad record


def _system_the_template_takes(p, tok, system: str, given: bool, name: str) -> str:
    """``system``, or '' where the chat template refuses a system message and takes none (Mistral-7B-Instruct
    v0.1/v0.2: "Conversation roles must alternate"): the default one is then left out, said; a given --system exits
    2 naming the fix. Checked once, before any prompt is answered: every prompt failed with jinja2's TemplateError,
    an "internal error" (exit 4) with its traceback, for the demo's default system message."""
    from .train.qa import TemplateRefused, prompt_ids

    if not system:
        return system
    try:
        prompt_ids(tok, "Hello", system)
        return system
    except TemplateRefused as e:
        try:
            prompt_ids(tok, "Hello", "")
        except TemplateRefused:
            raise ValueError(f"{name}: {e}, with or without a system message") from None
        if given:
            p.error(f"--system: {name}'s chat template takes no system message ({e}); pass --system '' to ask "
                    "without one")
        print(f"note: {name}'s chat template takes no system message ({e}): asking without one", file=sys.stderr)
        return ""


def _no_prompt(multi: bool) -> int:
    """Piped stdin held no prompt: said, exit 2 (not a silent success)."""
    skipped = "blank and /reset lines" if multi else "blank lines"
    print(f"error: no prompt: stdin held no line to answer ({skipped} are skipped); pass the message as an argument, "
          "or pipe one prompt per line", file=sys.stderr)
    return 2


def _refuse_line(q: str, bad: str, interactive: bool) -> None:
    """Say that a typed or piped line is not UTF-8 (it is skipped, and the session exits 3 at its end)."""
    where = "the typed" if interactive else "stdin"
    print(f"error: {where} line {_shown(q)!r} is not valid UTF-8 ({bad}); type or pipe UTF-8 text", file=sys.stderr,
          flush=True)


def _decoded(raw: bytes) -> str:
    """A line of stdin's bytes as text, undecodable bytes kept as surrogates (``_not_utf8`` names the line)."""
    return raw.decode(sys.stdin.encoding or "utf-8", errors="surrogateescape")


def _stdin_lines():
    """stdin's lines, each decoded apart: under PYTHONIOENCODING=utf-8 (strict) one bad byte stopped the session
    with a bare codec error before any line was answered (a generation walk); now that line is refused, said, and
    the next one is read, as under the default surrogateescape."""
    if not hasattr(sys.stdin, "buffer"):  # a StringIO put in its place (tests, embedding)
        yield from sys.stdin
        return
    for raw in sys.stdin.buffer:
        yield _decoded(raw)


def _typed():
    """The lines typed at a terminal, each after a "> " on stderr (stdout holds the answers only), to Ctrl-D."""
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = _decoded(sys.stdin.buffer.readline()) if hasattr(sys.stdin, "buffer") else sys.stdin.readline()
        if not line:
            print(file=sys.stderr)  # the shell's prompt on its own line after Ctrl-D
            return
        yield line.strip()


def _answer_room(model, tok, q: str, system: str, max_new_tokens: int, name: str,
                 history: list | tuple = ()) -> tuple[int, str | None]:
    """(new tokens ``q``'s answer may take, why fewer than ``max_new_tokens`` or None). The templated prompt
    (system message, the earlier turns ``history``, ``q``, the opened assistant turn) and its answer share the
    model's context (generate.context_length): 0 when the prompt fills it by itself."""
    from .models.generate import context_length
    from .train.qa import prompt_ids

    context, limit = context_length(model)
    if not context:
        return max_new_tokens, None
    used = len(prompt_ids(tok, q, system, history))
    if used < context:
        room = min(max_new_tokens, context - used)
        return room, None if room == max_new_tokens else (
            f"--max-new-tokens {max_new_tokens}: a prompt of {used} tokens (with the system message"
            f"{', earlier turns' if history else ''} and chat template) leaves room for {room} in the {context} "
            f"tokens {name} attends to ({limit}); answers to long prompts are cut there")
    shown = repr(q) if len(q) <= 60 else repr(q[:57] + "...")
    framing = len(prompt_ids(tok, "", system))  # the system message and the template around the message
    fix = ("the system message and template alone fill it: give a shorter --system" if framing >= context else
           f"shorten it by at least {counted(used - context + 1, 'token')}" + (" or give a shorter --system"
                                                                                 if framing >= context // 2 else ""))
    return 0, (f"the prompt {shown} takes {used} tokens ({framing} of them the system message and chat template), "
               f"and {name} attends to {context} ({limit}): no room for an answer; {fix}")
