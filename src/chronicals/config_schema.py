"""The training config schema: one typed dataclass per section, each field with its one-line doc.

The defaults ARE the embedded demo: LoRA+ on SmolLM2-135M-Instruct with the packaged demo data, sized
to finish in under 5 minutes on a 2-core CPU. Each field's one-line doc lives in its metadata
(``doc``) and is what ``chronicals train --help`` prints. Checks live in ``__post_init__`` so a bad
value fails before any model is loaded.

``chronicals.config`` fills these from YAML and ``key=value`` overrides and re-exports every name here:
import them from there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import logging
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ._numbers import is_int
from ._words import counted

log = logging.getLogger("chronicals.config")  # one logger for the whole config, whichever module warns

# set while a config that a run stored is read (its config.yaml, a checkpoint's copy): that run's train.resume named
# a checkpoint that existed then, which keep_last or the user may have removed since; the record stays readable
_STORED: contextvars.ContextVar[bool] = contextvars.ContextVar("chronicals_stored_config", default=False)


@contextlib.contextmanager
def stored_config():
    """Read a run's stored config: its train.resume is not required to exist (chat, eval and export read a
    resumed run's config.yaml and checkpoints, whose resume path may be relative to another directory, or
    rotated away; they failed with "its run config no longer reads")."""
    token = _STORED.set(True)
    try:
        yield
    finally:
        _STORED.reset(token)
DEMO = "demo"  # data.path / data.eval_path value meaning "the packaged demo data"
DEMO_SYSTEM_PROMPT = "You are a helpful assistant."
# data.max_seq_len / data.tokens_per_batch at most this: 16x the longest row trained (262,144 tokens, --max-context
# in README), and packing's index stays 2^24 list slots (128 MB); 10^20 overflowed it with a traceback (exit 4)
MAX_ROW_TOKENS = 2 ** 22


# ops.attention.VARLEN_KERNELS (config imports nothing of ours; a test ties the two)
ATTENTION_KERNELS = ("auto", "cudnn", "flash", "fa4")


def _f(default, doc: str, **kw):
    """A dataclass field with its one-line doc (shown by ``--help``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


# the words a YAML value or a command-line override may use for a boolean
BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _auto_bool(value, key: str) -> str:
    """An auto | true | false setting as one of those words: YAML true/on/1 arrive as bool or int, the command
    line's 'on'/'1' as strings; they take the same words as boolean keys (BOOL_WORDS)."""
    word = str(value).lower()
    word = str(BOOL_WORDS[word]).lower() if word in BOOL_WORDS else word
    _check(word in ("auto", "true", "false"), key, value, "auto, true or false (or yes/no, on/off, 1/0)")
    return word


class ConfigError(ValueError):
    """A bad config value or key; ``key`` (dotted, or a section name) lets ``load_config`` name the YAML line."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


_SHOWN = reprlib.Repr()  # keyword arguments need Python 3.12
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict, _SHOWN.maxset = 2, 8, 8, 8, 8
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 200, 200, 80


def shown(value) -> str:
    """repr(value) cut to a readable size: a 498-byte YAML of nested aliases is a list of 10^9 items, whose full
    repr in an error message ran out of memory (exit 4)."""
    return _SHOWN.repr(value)


def _check(cond: bool, key: str, value, expected: str):
    if not cond:
        raise ConfigError(f"config {key}={shown(value)} is invalid: expected {expected}", key)


def _check_finite(section) -> None:
    """Every float field of a section is finite: inf passes ``lr > 0`` and ``epochs > 0`` (epochs=inf then
    overflowed int() in the loop), nan fails them with a misleading range; one check, first, for all."""
    name = next(n for n, cls in SECTION_TYPES.items() if isinstance(section, cls))
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float):  # ints cannot be inf/nan; str/bool fields are not numbers
            _check(math.isfinite(v), f"{name}.{f.name}", v, "a finite number")


class _Keys:
    """Only the schema's fields can be set on a section or a TrainConfig: ``cfg.optim.learning_rate = 1e-4``
    (transformers' name) made a new attribute that ``to_dict`` and so ``train()`` left out, and the run trained
    at the default lr without a word. Now it is an AttributeError with the config's "did you mean"."""

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        if name not in self.__dataclass_fields__:
            section = next((s for s, cls in SECTION_TYPES.items() if isinstance(self, cls)), None)
            key, choices = (f"{section}.{name}", [f"{section}.{f}" for f in self.__dataclass_fields__]) if section \
                else (name, list(SECTION_TYPES))
            raise AttributeError(str(_unknown(key, choices)))
        cls = SECTION_TYPES.get(name) if isinstance(self, TrainConfig) else None
        if cls is not None and not isinstance(value, cls):  # cfg.lora = None trained LoRA: asdict's None is no section
            first, a = dataclasses.fields(cls)[0].name, "an" if cls.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"TrainConfig.{name} must be {a} {cls.__name__} (e.g. {cls.__name__}({first}=...), or "
                            f"set one key: cfg.{name}.{first} = ...), got {shown(value)}")
        super().__setattr__(name, value)


@dataclass
class ModelSection(_Keys):
    path: str = _f("smollm2-135m-instruct", "local HF directory, .gguf file, or 'smollm2-135m-instruct' (embedded)")
    dtype: str = _f("auto", "weights dtype: auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float32 | "
                              "float64 (CPU reference runs with impl=torch; slow; RMSNorm's statistics and the RoPE "
                              "angles stay fp32, as transformers computes them)")
    device: str = _f("auto", "auto (cuda if available) | cpu | cuda | cuda:N")
    impl: str = _f("auto", "op implementations: auto (Triton on CUDA) | triton | torch")
    attention: str = _f("auto", "packed rows' attention kernel on CUDA: cudnn (cuDNN's ragged Hopper kernels, needs "
                                "pip install nvidia-cudnn-frontend) | flash (PyTorch's varlen FlashAttention-2) | "
                                "auto (cudnn where it is installed, the GPU is Hopper or newer and the batch's "
                                "documents average >= 128 tokens, else flash) | fa4 (FlashAttention-4's kernels for "
                                "unpacked and packed rows, needs pip install flash-attn-4; its Python launch is "
                                "slow: with train.cuda_graphs)")
    checkpointing: bool = _f(False, "activation checkpointing: recompute each decoder layer in backward")
    checkpoint_layers: int = _f(0, "checkpoint only the first k decoder layers (0 = as model.checkpointing says); "
                                   "the fewest recomputed layers that fit memory")
    compile: bool = _f(False, "torch.compile each decoder layer")
    recompute: list = _f(["norm", "swiglu"], "tensors rebuilt in backward instead of kept, bit-identical gradients: "
                         "norm (RMSNorm outputs, ~1.3 GiB less at Qwen2.5-0.5B x 16k tokens for ~0.6% time), "
                         "swiglu (the SwiGLU product, ~3.6 GiB less for ~2%), gate_up (the gate/up GEMM output, "
                         "6.2 GiB less for one more GEMM per layer, ~10% slower; opt-in); [] keeps everything (under LoRA the "
                         "down_proj adapter still takes the SwiGLU product from the SwiGLU backward); off with "
                         "model.compile")
    gate_up_layers: int = _f(0, "with gate_up in model.recompute: rebuild it in the first k decoder layers only "
                                "(0 = every layer); ~0.3 GiB less per layer at Qwen2.5-0.5B x 16k tokens for "
                                "~0.6% time each (LoRA, k = 7: 11.7 -> 9.8 GiB for 4%): the finer memory dial")
    loss_vocab_parts: int = _f(1, "the loss head in k vocabulary parts: k > 1 keeps no fp32 weight-gradient "
                                  "accumulator beyond dW (1.04 -> 0.56 GiB at Qwen2.5-0.5B) for a second pass "
                                  "over part of the vocabulary (k = 2: ~28% slower head, the least extra work); "
                                  "acts when lm_head trains (full fine-tuning, or LoRA modules_to_save) on the "
                                  "Triton path (CUDA); the PyTorch reference (CPU) builds the logits")

    def __post_init__(self):
        _check_finite(self)
        _check(self.dtype in ("auto", "bfloat16", "float32", "float64"), "model.dtype", self.dtype,
               "auto | bfloat16 | float32 | float64")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "model.device",
               self.device, "auto | cpu | cuda | cuda:N")
        _check(self.impl in ("auto", "triton", "torch"), "model.impl", self.impl, "auto | triton | torch")
        _check(self.attention in ATTENTION_KERNELS, "model.attention", self.attention, " | ".join(ATTENTION_KERNELS))
        _check(bool(self.path), "model.path", self.path, "a model directory, .gguf file or short name")
        _check(is_int(self.checkpoint_layers) and self.checkpoint_layers >= 0, "model.checkpoint_layers",
               self.checkpoint_layers, "an integer >= 0")
        _check(is_int(self.loss_vocab_parts) and self.loss_vocab_parts >= 1, "model.loss_vocab_parts",
               self.loss_vocab_parts, "an integer >= 1")
        _check(all(n in ("norm", "swiglu", "gate_up") for n in self.recompute), "model.recompute", self.recompute,
               "a list drawn from [norm, swiglu, gate_up], or []")
        _check(is_int(self.gate_up_layers) and self.gate_up_layers >= 0, "model.gate_up_layers",
               self.gate_up_layers, "an integer >= 0 (0 = every layer)")
        _check(not self.gate_up_layers or "gate_up" in self.recompute, "model.gate_up_layers", self.gate_up_layers,
               "0, or add gate_up to model.recompute (it limits that recompute to the first k layers)")

    @property
    def checkpoint_setting(self) -> bool | int:
        """What ``CausalLM.set_checkpointing`` takes: k layers when given, else the boolean switch."""
        return self.checkpoint_layers or self.checkpointing


@dataclass
class DataSection(_Keys):
    path: str = _f(DEMO, "training data: a .jsonl/.json/.parquet/.arrow/.csv file, a directory of them (read "
                         "recursively, dot-files skipped) or a datasets.save_to_disk directory; 'demo' = packaged demo "
                         "set")
    format: str = _f("auto", "record format of data.path and of data.eval_path: auto | text | chat (messages) | "
                             "alpaca | prompt_completion | sharegpt (held-out question/answer records are read as chat)")
    eval_path: str = _f("auto", "held-out data for the eval loss (and QA when its records are question/answer/"
                        "keywords, .jsonl or .json; keywords default to the answer): auto (the packaged held-out questions when "
                        "data.path=demo, else none) | demo (those questions) | '' | a path")
    system_prompt: str = _f(DEMO_SYSTEM_PROMPT, "system message of the demo data and of held-out QA prompts "
                            "('' = the chat template's default; beside your own data.path, QA gets it only when set to "
                            "another text than this default, else the template's default, as your records without "
                            "one); put your own in your records")
    max_seq_len: int = _f(256, "tokens per packed row; longer examples are truncated, dropped or split (see on_long)")
    batch_size: int = _f(4, "packed rows per micro-batch")
    tokens_per_batch: int = _f(0, "padding-free batches: one packed row of at most this many tokens per "
                                  "micro-batch instead of batch_size rows (0 = rows); >= max_seq_len")
    dp_remainder: str = _f("train", "data parallel, an epoch's last batches that do not make a full round of ranks: "
                                    "train (ranks past the end run an empty batch: no loss, no gradient) | drop "
                                    "(not trained that epoch; what checkpoints from before this setting need)")
    on_long: str = _f("truncate", "examples longer than max_seq_len: truncate | drop | split (into documents of "
                                  "max_seq_len, for text corpora: a chat's later pieces lose its earlier turns)")
    on_error: str = _f("fail", "malformed records: fail (with file:line) | skip (and count)")
    train_on: str = _f("assistant", "which tokens carry loss: assistant (completion/output) | all")
    cache_dir: str = _f("", "tokenization cache directory ('' = $CHRONICALS_CACHE/data, default "
                            "~/.cache/chronicals/data; 'none' = no cache)")
    num_proc: int = _f(0, "processes that tokenize the data the first time (0 = auto: 1 below 8 MB of data files, else "
                          "min(8, cpus)); each holds a share of the records in memory")

    def __post_init__(self):
        _check_finite(self)
        _check(8 <= self.max_seq_len <= MAX_ROW_TOKENS, "data.max_seq_len", self.max_seq_len,
               f"an integer in [8, {MAX_ROW_TOKENS}] (tokens per packed row)")
        _check(self.batch_size >= 1, "data.batch_size", self.batch_size, "an integer >= 1")
        _check(self.num_proc >= 0, "data.num_proc", self.num_proc, "an integer >= 0 (0 = auto)")
        _check(self.on_long in ("truncate", "drop", "split"), "data.on_long", self.on_long, "truncate | drop | split")
        _check(self.dp_remainder in ("train", "drop"), "data.dp_remainder", self.dp_remainder, "train | drop")
        _check(self.on_error in ("fail", "skip"), "data.on_error", self.on_error, "fail | skip")
        _check(self.train_on in ("assistant", "all"), "data.train_on", self.train_on, "assistant | all")
        _check(self.format in ("auto", "text", "chat", "alpaca", "prompt_completion", "sharegpt"),
               "data.format", self.format, "auto | text | chat | alpaca | prompt_completion | sharegpt")
        _check(bool(self.path), "data.path", self.path, "a data file or directory, or 'demo'")
        if self.path == DEMO and self.format not in ("auto", "chat"):  # was exit 3 blaming the run's demo copy
            raise ConfigError(f"config data.format={self.format!r} does not fit data.path={DEMO}: the demo data is "
                              "chat records (messages); use data.format=auto or chat, or point data.path at your "
                              f"own {self.format} data", "data.format")
        _check(self.tokens_per_batch == 0 or self.max_seq_len <= self.tokens_per_batch <= MAX_ROW_TOKENS,
               "data.tokens_per_batch", self.tokens_per_batch, f"0 (rows) or in [data.max_seq_len={self.max_seq_len}, "
               f"{MAX_ROW_TOKENS}] (a document must fit in the one row of a micro-batch)")

    def loader_shape(self, warn: bool = True) -> dict:
        """The batch shape PackedLoader takes: ``{"tokens_per_batch": n}`` when that is set (> 0), else
        ``{"batch_size": n}``. A batch_size other than its default beside tokens_per_batch does nothing: the one
        call that builds the loaders says so (``warn``: False on the ranks but the first)."""
        if not self.tokens_per_batch:
            return {"batch_size": self.batch_size}
        default = next(f.default for f in dataclasses.fields(self) if f.name == "batch_size")
        if warn and self.batch_size != default:
            log.warning("data.batch_size=%d is not used: data.tokens_per_batch=%d makes each micro-batch "
                        "one padding-free row of at most that many tokens; leave data.batch_size at its default "
                        "(%d) to silence this, or set data.tokens_per_batch=0 for %s of data.max_seq_len",
                        self.batch_size, self.tokens_per_batch, default, counted(self.batch_size, "row"))
        return {"tokens_per_batch": self.tokens_per_batch}


# lora.targets' default and all-linear; lora.inject.DEFAULT_TARGETS is this tuple (lora imports config, not back)
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")

# The LoRA values no model can take, decided here once: LoraSection checks a config with them when it is read (exit
# 2, before any model loads), apply_lora (lora.inject) its arguments with the same tests and words. Each test takes
# a number: a config's numbers are typed and finite (config._coerce, _check_finite), apply_lora checks its own first
# with _numbers.is_number.
LORA_VALUE_RULES = {
    "rank": (lambda v: v >= 1, "an integer >= 1, the adapter rank (8-64 is usual)"),
    "alpha": (lambda v: v > 0, "a finite number > 0; the update is scaled by alpha / r (2 r is usual)"),
    "dropout": (lambda v: 0 <= v < 1, "a number in [0, 1) (0 is usual for fine-tuning; 0.05-0.1 on small data)"),
    "plus_ratio": (lambda v: v > 0, "a number > 0; LoRA+ trains B at plus_ratio x the learning rate of A "
                                    "(1 = plain LoRA, 16 is usual)"),
}


def lora_names_problem(targets, modules_to_save) -> tuple[str, str] | None:
    """(config key, what it must be) for the first LoRA target / modules_to_save list no model can take, or None.

    Checked on the names alone (LoraSection, and apply_lora before it matches them against a model); a name that
    matches no module of one model is apply_lora's to say, as is what apply_lora's other form of ``targets``, one
    regular expression string, matches. A name in both lists would be adapted and trained in full at once, and an
    adapter on lm_head is refused (the loss reads lm_head.weight itself): both whatever the model.
    """
    if not isinstance(targets, str) and (not isinstance(targets, (list, tuple)) or not targets
                                         or not all(isinstance(t, str) for t in targets)):
        return "lora.targets", "a non-empty list of module names such as [q_proj, v_proj]"
    names = () if isinstance(targets, str) else targets
    if "lm_head" in names:
        return "lora.targets", ("module names other than lm_head: LoRA on lm_head is not supported (the loss reads "
                                "lm_head.weight directly: fused linear cross-entropy); train it in full with "
                                "lora.modules_to_save=[lm_head] instead")
    if not isinstance(modules_to_save, (list, tuple)) or not all(isinstance(m, str) for m in modules_to_save):
        return "lora.modules_to_save", "a list of module names such as [lm_head]"
    both = [m for m in modules_to_save if m in names]
    if both:
        return "lora.modules_to_save", (f"names that are not LoRA targets too: {both} also in lora.targets; a module "
                                        "is either adapted or trained in full: drop them from one of the two lists")
    return None


@dataclass
class LoraSection(_Keys):
    enabled: bool = _f(True, "train LoRA adapters (true) or every weight (false: full fine-tuning)")
    rank: int = _f(16, "LoRA rank r")
    alpha: float = _f(32.0, "LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rslora)")
    dropout: float = _f(0.0, "dropout on the LoRA branch input, a mask per adapter call as in PEFT, rebuilt from "
                             "a seed where applied, never stored (p rounded to a multiple of 2^-16); 0 skips it")
    targets: list = _f(list(LORA_PROJECTIONS), "module names that get adapters (a name matches it and any dotted "
                                               "path ending in it, as in PEFT's list form; every match must be an "
                                               "nn.Linear other than lm_head); all-linear = the 7 projections")
    modules_to_save: list = _f([], "modules trained in full next to the adapters and saved with them in the "
                                   "adapter (PEFT modules_to_save), e.g. [lm_head] or [embed_tokens, lm_head]; "
                                   "names match as in lora.targets, and none may hold a LoRA target")
    rslora: bool = _f(False, "rank-stabilized scaling alpha / sqrt(r)")
    plus_ratio: float = _f(16.0, "LoRA+: lr(B) = plus_ratio x lr(A); 1 = plain LoRA")
    group: bool = _f(True, "run the q/k/v and the gate/up adapters of a block as one GEMM each "
                           "(lora.group; with any dropout; needs the fused path, else one call per module)")

    def __post_init__(self):
        _check_finite(self)
        for name, (ok, expected) in LORA_VALUE_RULES.items():
            _check(ok(getattr(self, name)), f"lora.{name}", getattr(self, name), expected)
        if self.targets == ["all-linear"]:  # PEFT's shorthand: every linear layer but the output head
            self.targets = list(LORA_PROJECTIONS)
        problem = lora_names_problem(self.targets, self.modules_to_save)
        if problem:
            key, expected = problem
            _check(False, key, getattr(self, key.split(".")[1]), expected)
        # a regular expression (PEFT's single-string form) would be cut at its commas by the list syntax
        _check(all(_MODULE_NAME.match(t) for t in self.targets), "lora.targets", self.targets,
               "module names such as [q_proj, v_proj] or all-linear; regular expressions are not read from the "
               "config: list the names (a name also matches every dotted path ending in it)")
        _check(all(_MODULE_NAME.match(m) for m in self.modules_to_save), "lora.modules_to_save",
               self.modules_to_save, "module names such as [lm_head] or [embed_tokens, lm_head] (a name also "
               "matches every dotted path ending in it; regular expressions are not read)")


@dataclass
class OptimSection(_Keys):
    lr: float = _f(1e-3, "peak learning rate (of the LoRA A matrices under LoRA+)")
    weight_decay: float = _f(0.0, "AdamW weight decay (never on biases and norms)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.999, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)")
    fused: str = _f("auto", "fused AdamW: auto (on CUDA) | true | false")
    master_weights: str = _f("auto", "fp32 master weights for bf16 trainable weights: auto (on when they are bf16: "
                                     "full fine-tuning and LoRA adapters on CUDA) | true | false; without them AdamW "
                                     "updates below half a bf16 step are rounded away; costs 8 bytes per trainable "
                                     "parameter (fp32 master 4, fp32 instead of bf16 moments 4): 4 GB for a full "
                                     "Qwen2.5-0.5B, ~70 MB for its r=16 adapters")

    def __post_init__(self):
        _check_finite(self)
        # AdamW moves each weight by up to ~lr a step; from 3.4e37 its step size lr / (1 - beta1) overflowed float32
        # inside the optimizer (exit 4), and values far below that diverge at once
        _check(0 < self.lr <= 10, "optim.lr", self.lr, "a number in (0, 10] (AdamW moves each weight by up to ~lr "
               "a step; fine-tuning takes 1e-5 to 1e-3)")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a number >= 0")
        _check(0 <= self.beta1 < 1, "optim.beta1", self.beta1, "a number in [0, 1)")
        _check(0 <= self.beta2 < 1, "optim.beta2", self.beta2, "a number in [0, 1)")
        _check(self.eps > 0, "optim.eps", self.eps, "a number > 0 (AdamW divides by sqrt(v) + eps)")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "a number >= 0 (0 = off)")
        self.fused = _auto_bool(self.fused, "optim.fused")  # train/optim.py maps the three words
        self.master_weights = _auto_bool(self.master_weights, "optim.master_weights")  # read in train/optim.py


@dataclass
class ScheduleSection(_Keys):
    kind: str = _f("cosine", "learning-rate decay after warmup: cosine | linear | constant")
    warmup_steps: int = _f(3, "linear warmup over k steps: step i (1-based) runs at i / k of the peak lr, "
                              "so step k at the peak; a run of <= k steps warms up over a tenth of its "
                              "steps instead (rounded up), so that it has steps left to decay")
    min_lr_ratio: float = _f(0.1, "the last step's lr as a fraction of the peak (cosine and linear): the decay runs "
                                  "from the peak at the first step after warmup to this at the last, so a run with "
                                  "one step after warmup (a 2-step run, or max_steps = warmup_steps + 1) ends at "
                                  "the peak")

    def __post_init__(self):
        _check_finite(self)
        _check(self.kind in ("cosine", "linear", "constant"), "schedule.kind", self.kind, "cosine | linear | constant")
        _check(self.warmup_steps >= 0, "schedule.warmup_steps", self.warmup_steps, "an integer >= 0")
        _check(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")


@dataclass
class TrainSection(_Keys):
    epochs: float = _f(2.0, "passes over the training data (ignored when max_steps > 0); a fraction trains that share "
                            "of the next pass's batches, rounded up")
    max_steps: int = _f(0, "optimizer steps to run (0 = derive from epochs)")
    grad_accum: int = _f(1, "micro-batches per optimizer step (loss normalized by the step's loss tokens; "
                              "a step never spans two epochs: an epoch's last step may take fewer)")
    seed: int = _f(0, "seed for init, shuffling and dropout")
    out_dir: str = _f("runs/demo", "output directory: adapter or model, checkpoints, metrics, plots, config, "
                                   "tensorboard/ (when installed), and data/ (the demo and held-out QA data as the run "
                                   "used them); a run's own config.yaml given as CONFIG continues the run in the "
                                   "directory it sits in, unless train.out_dir is given")
    save_every: int = _f(0, "write a resumable checkpoint every N optimizer steps (0 = only at the end/on signal)")
    keep_last: int = _f(2, "resumable checkpoints to keep")
    async_save: bool = _f(True, "write periodic checkpoints in a background thread: training waits only for the "
                                "CPU copy of the state (the file appears when written; checkpoints at a stop, the "
                                "end or an error are waited for)")
    resume: str = _f("auto", "auto (latest checkpoint in out_dir if any) | none (start over: out_dir's earlier "
                             "checkpoints and final adapter/model are removed once this run writes) | a checkpoint "
                             "directory or its state.pt (out_dir's later ones are removed likewise; another run's "
                             "also removes out_dir's own and its final adapter/model, and brings that run's "
                             "metrics.jsonl records up to its step)")
    save_final: bool = _f(True, "write the final adapter (LoRA) or HF model directory (full)")
    cuda_graphs: str = _f("auto", "capture forward+backward in CUDA graphs and replay them: auto (on for CUDA "
                                  "processes, data parallel included, without activation checkpointing; the "
                                  "choice is logged) | "
                                  "true | false. Cuts per-step launch overhead (0.5B LoRA on an H200: eager "
                                  "140.6k -> 181.5k tokens/s, git bbd9a19; the gain moves with the host)")
    overlap_grad_reduce: bool = _f(False, "data parallel: all-reduce the gradients in flat buckets during the last "
                                          "backward (train/grad_buckets.py) instead of after it. Off by default: "
                                          "on 2 H200s at 0.5B it gave ~1% (full eager 258.0k -> 258.9k tokens/s "
                                          "for +0.93 GiB peak; with CUDA graphs full 263.0k -> 265.9k, LoRA "
                                          "335.1k -> 335.3k)")

    def __post_init__(self):
        _check_finite(self)
        _check(self.epochs > 0 or (self.max_steps > 0 and self.epochs == 0), "train.epochs", self.epochs,
               "a number > 0 (0 only beside train.max_steps > 0)" if self.max_steps > 0 else
               "a number > 0, or set train.max_steps > 0")  # -5 beside max_steps passed, and stayed in config.yaml
        _check(self.max_steps >= 0, "train.max_steps", self.max_steps, "an integer >= 0")
        _check(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, "an integer >= 1")
        _check(0 <= self.seed < 2 ** 64, "train.seed", self.seed, "an integer in [0, 2^64) (numpy seeds the data "
               "order with it, torch.manual_seed the rest: past 2^64 - 1 it fails with an overflow naming no setting)")
        _check(self.save_every >= 0, "train.save_every", self.save_every, "an integer >= 0")
        _check(self.keep_last >= 1, "train.keep_last", self.keep_last, "an integer >= 1")
        self.cuda_graphs = _auto_bool(self.cuda_graphs, "train.cuda_graphs")
        _check(bool(self.out_dir), "train.out_dir", self.out_dir, "a directory path")
        # ~ expanded once, here: train() wrote to a literal ./~ folder while its checks looked under $HOME, and an
        # explicit checkpoint under ~ was refused as missing (data.path, data.eval_path and model.path are
        # expanded where read, so a checkpoint compares them as written)
        self.out_dir = os.path.expanduser(self.out_dir)
        if self.resume not in ("auto", "none"):
            self.resume = os.path.expanduser(self.resume)
        # Unlike data.path / model.path (a config may be written on one machine for another), an explicit
        # checkpoint that is not here can never resume: say so now, not after the model and data load.
        if self.resume not in ("auto", "none"):
            _check(bool(self.resume), "train.resume", self.resume,
                   "auto | none | a checkpoint directory such as runs/demo/checkpoints/step-000008")
        if self.resume not in ("auto", "none") and not _STORED.get():  # a stored config's may be gone since
            _check(Path(self.resume).exists(), "train.resume", self.resume,
                   f"auto | none | an existing checkpoint directory; {self.resume} does not exist (auto resumes "
                   "from the latest under train.out_dir, none starts over)")


@dataclass
class EvalSection(_Keys):
    every: int = _f(0, "held-out loss every N optimizer steps (0 = only before and after training)")
    qa: bool = _f(True, "answer the held-out questions before and after (greedy) and score keywords")
    qa_limit: int = _f(0, "held-out questions to answer (0 = all)")
    max_new_tokens: int = _f(24, "tokens generated per held-out answer (the demo answers take <= 17)")

    def __post_init__(self):
        _check_finite(self)
        _check(self.every >= 0, "eval.every", self.every, "an integer >= 0")
        _check(self.qa_limit >= 0, "eval.qa_limit", self.qa_limit, "an integer >= 0")
        _check(self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens, "an integer >= 1")


@dataclass
class LoggingSection(_Keys):
    progress: bool = _f(True, "show a progress bar (loss, tokens/s, MFU, memory, ETA)")
    tensorboard: bool = _f(True, "also log to TensorBoard when the tensorboard package is installed")
    plot: bool = _f(True, "write loss.png (training and held-out loss) at the end")
    peak_tflops: float = _f(0.0, "peak TFLOP/s for MFU (0 = measure a bf16 matmul once on CUDA; on CPU MFU is logged only when set)")

    def __post_init__(self):
        _check_finite(self)
        _check(self.peak_tflops >= 0, "logging.peak_tflops", self.peak_tflops, "a number >= 0")


@dataclass
class TrainConfig(_Keys):
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: LoraSection = field(default_factory=LoraSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self):
        if self.train.cuda_graphs == "true":  # device "auto": checked once resolved, before loading (train.guards)
            _check(self.model.device != "cpu", "train.cuda_graphs", True, "false with model.device=cpu "
                   "(CUDA graphs need a GPU)")
            _check(not self.model.checkpoint_setting, "train.cuda_graphs", True, "false with model.checkpointing=true "
                   "(checkpoint reads the CUDA RNG state during capture); turn one of them off")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# section name -> its dataclass, in TrainConfig's order (the order of --help and of the YAML a run writes)
SECTION_TYPES = {"model": ModelSection, "data": DataSection, "lora": LoraSection, "optim": OptimSection,
                 "schedule": ScheduleSection, "train": TrainSection, "eval": EvalSection, "logging": LoggingSection}


def all_keys() -> list[str]:
    """Every dotted key of the schema, e.g. ``optim.lr``."""
    return [f"{s}.{f.name}" for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)]


# names transformers' TrainingArguments, PEFT's LoraConfig and axolotl use for our keys: a user coming from them
# types these first, and spelling alone ranked e.g. optim.weight_decay above optim.lr for "learning_rate"
KNOWN_ELSEWHERE = {
    "learning_rate": "optim.lr", "lr_scheduler_type": "schedule.kind", "warmup_steps": "schedule.warmup_steps",
    "max_grad_norm": "optim.grad_clip", "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    "adam_epsilon": "optim.eps", "num_train_epochs": "train.epochs", "num_epochs": "train.epochs",
    "gradient_accumulation_steps": "train.grad_accum", "output_dir": "train.out_dir", "save_steps": "train.save_every",
    "save_total_limit": "train.keep_last", "resume_from_checkpoint": "train.resume",
    "per_device_train_batch_size": "data.batch_size", "micro_batch_size": "data.batch_size",
    "max_seq_length": "data.max_seq_len", "sequence_len": "data.max_seq_len", "max_length": "data.max_seq_len",
    "dataset": "data.path", "datasets": "data.path", "train_file": "data.path", "eval_steps": "eval.every",
    "gradient_checkpointing": "model.checkpointing", "torch_compile": "model.compile", "torch_dtype": "model.dtype",
    "r": "lora.rank", "lora_r": "lora.rank", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets", "lora_target_modules": "lora.targets", "use_rslora": "lora.rslora",
    "loraplus_lr_ratio": "lora.plus_ratio", "base_model": "model.path", "model_name_or_path": "model.path",
    "warmup_ratio": "schedule.warmup_steps", "bf16": "model.dtype", "fp16": "model.dtype",
    "report_to": "logging.tensorboard",
}


def _unknown(key, choices: list[str]) -> ValueError:
    """An unknown section or dotted key (any YAML scalar: ``5:`` or ``~:`` arrive as int / None) with suggestions."""
    name = key if isinstance(key, str) else str(key)  # difflib compares strings only
    if name in all_keys() and name not in choices:  # optim.lr: 1 at the top of a YAML file
        section, field_name = name.split(".", 1)
        return ConfigError(f"config key {name!r} is dotted: in a YAML file write it under its section, "
                           f"'{section}:' on one line and '  {field_name}: VALUE' below it", name)
    # the same field name under another section (train.lr, or lr alone) first, then spellings alike
    last = name.rsplit(".", 1)[-1].lower()
    same = [KNOWN_ELSEWHERE[last]] if last in KNOWN_ELSEWHERE else []
    same += [k for k in all_keys() if k.split(".", 1)[1] == last and k != name]
    near = list(dict.fromkeys(same + difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.5)))[:3]
    hint = f"; did you mean {' or '.join(near)}?" if near else f"; known: {', '.join(choices)}"
    return ConfigError(f"unknown config key {key!r}{hint}", name)
