"""Putting LoRA into a model (``apply_lora``) and taking it out again (``merge_lora``).

Module names follow PEFT's matching rules, so the same ``target_modules`` mean the same modules here and in
PEFT: a list entry matches a module whose full name equals it or ends with ``"." + entry`` (``"q_proj"`` matches
``model.layers.3.self_attn.q_proj``); a single string is a regular expression that must match the full name.
Every module a target matches must be an nn.Linear (PEFT refuses other kinds, and would adapt an nn.Embedding,
which we do not). ``modules_to_save`` entries match here the same way, at a dot; PEFT matches them as a plain
suffix ("norm" is also every layer's input_layernorm), so ``load_adapter`` resolves a PEFT file's entries by
PEFT's rule, and ``save_adapter`` writes full names, which mean the same modules under either rule.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .._numbers import is_int, is_number
from .._words import counted
from ..config import LORA_PROJECTIONS, LORA_VALUE_RULES, ConfigError, lora_names_problem
from .group import bind_groups, unbind_groups
from .layer import IMPLS, LoRALinear

log = logging.getLogger("chronicals.lora")

DEFAULT_TARGETS = LORA_PROJECTIONS  # the 7 projections: lora.targets' default in the config too


@dataclass
class LoraRecord:
    """What ``apply_lora`` did; kept on the model as ``model.lora_config`` for saving and LoRA+."""
    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool
    scaling: float
    lora_modules: list[str] = field(default_factory=list)  # full names of the LoRALinear modules
    # full names of modules trained in full and saved with the adapter (tied partners included)
    saved_modules: list[str] = field(default_factory=list)
    trainable_params: int = 0
    total_params: int = 0

    def __repr__(self) -> str:
        """The settings and counts, with a few module names: the dataclass repr listed all of them (210 lines' worth
        for SmolLM2's 30 layers x 7 projections), which is what a REPL prints for ``apply_lora(...)``'s result."""
        def names(xs: list[str]) -> str:
            return "[]" if not xs else f"[{xs[0]!r}, ... {len(xs)} in all]" if len(xs) > 2 else repr(xs)

        return (f"LoraRecord(r={self.r}, alpha={self.alpha}, dropout={self.dropout}, "
                f"target_modules={self.target_modules!r}, use_rslora={self.use_rslora}, scaling={self.scaling:g}, "
                f"lora_modules={names(self.lora_modules)}, saved_modules={names(self.saved_modules)}, "
                f"trainable_params={self.trainable_params:,}, total_params={self.total_params:,})")


def name_matches(name: str, keys) -> bool:
    """PEFT's rule: a str is a full-match regex; a list/tuple entry matches the name or a dotted suffix."""
    if isinstance(keys, str):
        return re.fullmatch(keys, name) is not None
    return any(name == k or name.endswith("." + k) for k in keys)


def unmatched_targets(model: nn.Module, target_modules) -> list[str]:
    """The names of a list of targets that match no module of ``model`` ([] for a regular expression)."""
    if isinstance(target_modules, str):
        return []
    names = [n for n, _ in model.named_modules() if n]
    return [t for t in target_modules if not any(name_matches(n, (t,)) for n in names)]


def linear_names(model: nn.Module) -> list[str]:
    """The last name parts of the model's nn.Linear layers but lm_head, sorted (what targets can name)."""
    return sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and n.rpartition(".")[2] != "lm_head"})


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def tied_partners(model: nn.Module, module_names: list[str]) -> list[str]:
    """Names of other modules owning a Parameter object that one of ``module_names`` also owns."""
    owners: dict[int, set[str]] = {}
    for mname, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(mname)
    out = set()
    for n in module_names:
        for p in model.get_submodule(n).parameters(recurse=False):
            out |= owners[id(p)]
    return sorted(out - set(module_names))


def _check_lora_args(r, alpha, dropout, target_modules, use_rslora, modules_to_save, impl, adapter_dtype, seed,
                     concat, group) -> None:
    """apply_lora's scalar arguments, checked before anything of the model changes (a failed call leaves the
    model as it was: no frozen parameters, no replaced modules). What a valid rank, alpha, dropout and list of
    names is, config.py decides (LORA_VALUE_RULES, lora_names_problem: a config is checked with them when read);
    an argument a config key sets fails as a ConfigError with that key."""
    for name, arg, value, typed in (("rank", "r", r, is_int(r)),
                                    ("alpha", "alpha", alpha, is_number(alpha)),
                                    ("dropout", "dropout", dropout, is_number(dropout))):
        ok, expected = LORA_VALUE_RULES[name]
        if not typed or not ok(value):
            raise ConfigError(f"apply_lora: {arg}={value!r} must be {expected} (in a config: lora.{name})",
                              f"lora.{name}")
    if isinstance(target_modules, str):
        try:
            re.compile(target_modules)
        except re.error as e:
            raise ConfigError(f"apply_lora: target_modules={target_modules!r} is a string, read as a regular "
                              f"expression over full module names, and does not compile ({e}); pass a list of "
                              "names such as ['q_proj', 'v_proj'] instead", "lora.targets") from None
    problem = lora_names_problem(target_modules, (modules_to_save,) if isinstance(modules_to_save, str)
                                 else modules_to_save)
    if problem:
        key, expected = problem
        arg, given = (("target_modules", target_modules) if key == "lora.targets" else
                      ("modules_to_save", modules_to_save))
        raise ConfigError(f"apply_lora: {arg}={given!r} must be {expected} (in a config: {key})", key)
    if not isinstance(use_rslora, bool):
        raise ConfigError(f"apply_lora: use_rslora={use_rslora!r} must be True or False (lora.rslora)", "lora.rslora")
    if impl not in IMPLS:
        raise ValueError(f"apply_lora: impl={impl!r} is not one of {IMPLS} (fused: the custom autograd path; "
                         "torch: the reference)")
    if adapter_dtype is not None and not (isinstance(adapter_dtype, torch.dtype) and adapter_dtype.is_floating_point):
        raise ValueError(f"apply_lora: adapter_dtype={adapter_dtype!r} must be None (the base weight's dtype) or a "
                         "floating torch.dtype such as torch.float32")
    if seed is not None and not is_int(seed):
        raise ConfigError(f"apply_lora: seed={seed!r} must be an integer or None (torch's global RNG; in a config: "
                          "train.seed)", "train.seed")
    if concat not in ("auto", True, False):
        raise ValueError(f"apply_lora: concat={concat!r} must be 'auto', True or False")
    if not isinstance(group, bool):
        raise ConfigError(f"apply_lora: group={group!r} must be True or False (lora.group)", "lora.group")


# PEFT's target_modules="all-linear": every nn.Linear but the output layer (a list ["all-linear"] names a module)
ALL_LINEAR = "all-linear"


def check_lora(model: nn.Module, *, r: int = 16, alpha: float = 32, dropout: float = 0.0,
               target_modules=DEFAULT_TARGETS, use_rslora: bool = False, modules_to_save=(),
               impl: str = "fused", adapter_dtype: torch.dtype | None = None, seed: int | None = 0,
               concat: bool | str = "auto", group: bool = True) -> tuple[tuple[str, ...] | str, list[str], list[str]]:
    """Every check ``apply_lora`` makes of these arguments against ``model``, raising its errors, with ``model`` left
    as it is. -> (target_modules as apply_lora records them, the full names of the nn.Linear modules it adapts, those
    of the modules it trains in full before their tied partners join them).

    It reads module names and kinds only, never a weight: ``model`` may be built on the meta device from its
    ModelConfig (``with torch.device("meta"): CausalLM(config)``: no memory, milliseconds at 8B), which is how train
    and eval refuse a config's or an adapter's names before the data is read and the weights load.
    """
    if isinstance(target_modules, (set, frozenset)):  # PEFT keeps its names as a set: taken as the sorted list
        target_modules = sorted(target_modules)
    if isinstance(modules_to_save, (set, frozenset)):
        modules_to_save = sorted(modules_to_save)
    _check_lora_args(r, alpha, dropout, target_modules, use_rslora, modules_to_save, impl, adapter_dtype, seed,
                     concat, group)
    if getattr(model, "lora_config", None) is not None:
        raise RuntimeError("apply_lora: this model already has LoRA adapters; call merge_lora(model) first")
    if isinstance(target_modules, list):
        target_modules = tuple(target_modules)
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:  # PEFT's shorthand, as a string
        target_modules = tuple(linear_names(model))
    modules_to_save = (modules_to_save,) if isinstance(modules_to_save, str) else tuple(modules_to_save)
    matched = [(n, m) for n, m in model.named_modules() if n and name_matches(n, target_modules)]
    targets = [n for n, m in matched if isinstance(m, nn.Linear)]
    # PEFT puts LoRA on an nn.Embedding and refuses any other kind: skipping them trained no embed_tokens adapter
    # for ["q_proj", "embed_tokens"], and saved a regex that PEFT then refuses to load
    others = [f"{n} ({type(m).__name__})" for n, m in matched if not isinstance(m, nn.Linear)]
    if others:
        raise ConfigError(f"apply_lora: target_modules={target_modules!r} matches {len(others)} module(s) that are "
                          f"not nn.Linear, such as {others[:3]}; LoRA adapts nn.Linear layers only: drop them from the "
                          "targets (a regular expression must match only projections, e.g. r'.*\\.(q|v)_proj'), and "
                          "train an embedding or norm in full with modules_to_save (in a config: lora.targets, "
                          "lora.modules_to_save)", "lora.targets")
    if not targets:
        leaves = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        regex = ""
        if isinstance(target_modules, str):  # "q_proj" full-matches no full name (model.layers.0.self_attn.q_proj)
            regex = (f"; a string is one regular expression matched against full module names such as "
                     f"{next(n for n, m in model.named_modules() if isinstance(m, nn.Linear))!r}: for names, pass "
                     f"a list, e.g. target_modules=[{target_modules!r}]")
        raise ConfigError(f"apply_lora: target_modules={target_modules!r} matched no nn.Linear; the model's "
                          f"linear layers are named {leaves}: name some of them but lm_head (in a config: "
                          f"lora.targets){regex}", "lora.targets")
    if "lm_head" in targets:  # matched by a regular expression (a list naming lm_head is refused before)
        raise ConfigError("apply_lora: LoRA on lm_head is not supported: CausalLM's loss reads lm_head.weight "
                          "directly (fused linear cross-entropy); train it with modules_to_save=('lm_head',) "
                          "(in a config: lora.modules_to_save=[lm_head])", "lora.targets")
    saved = [n for n, _ in model.named_modules() if n and modules_to_save and name_matches(n, modules_to_save)]
    missing = [k for k in modules_to_save if not any(name_matches(n, (k,)) for n in saved)]
    if missing:
        raise ConfigError(f"apply_lora: modules_to_save entries {missing} match no module of the model; name its "
                          "modules such as lm_head or embed_tokens, or a dotted path ending in one (in a config: "
                          "lora.modules_to_save)", "lora.modules_to_save")
    overlap = sorted(set(saved) & set(targets))
    if overlap:
        raise ConfigError(f"apply_lora: {overlap} are both LoRA targets and modules_to_save; pick one (in a config: "
                          "lora.targets, lora.modules_to_save)", "lora.modules_to_save")
    # a parent trained in full would unfreeze the base weights under its adapters: the first step then failed
    # ("the base weight and bias must be frozen")
    holding = {s: [t for t in targets if t.startswith(s + ".")] for s in saved}
    holding = {s: ts for s, ts in holding.items() if ts}
    if holding:
        first, names = next(iter(holding)), list(holding)  # model order: layers.0, 1, 2 (sorted put 10 before 2)
        # self_attn matches one module per layer: all 30 of SmolLM2's made a 900-character message
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ConfigError(f"apply_lora: modules_to_save {names[:3]}{more} hold LoRA targets (such as "
                          f"{holding[first][0]}); a module is either adapted or trained in full: name the modules "
                          "inside them to train in full, or leave their projections out of target_modules (in a "
                          "config: lora.modules_to_save, lora.targets)", "lora.modules_to_save")
    return target_modules, targets, saved


def apply_lora(model: nn.Module, *, r: int = 16, alpha: float = 32, dropout: float = 0.0,
               target_modules=DEFAULT_TARGETS, use_rslora: bool = False, modules_to_save=(),
               impl: str = "fused", adapter_dtype: torch.dtype | None = None, seed: int | None = 0,
               concat: bool | str = "auto", group: bool = True) -> LoraRecord:
    """Replace each targeted nn.Linear of ``model`` in place by a LoRALinear and freeze the rest.

    ``target_modules``: module names as PEFT's list form matches them (a list, tuple or set), a regular
    expression (a string) full-matched against full module names, or the string "all-linear" (PEFT's shorthand:
    every nn.Linear but lm_head).
    scaling = alpha / r, or alpha / sqrt(r) with ``use_rslora``. Every parameter is frozen except the
    adapters (A, B) and the parameters of ``modules_to_save`` (e.g. "lm_head", "embed_tokens"), which
    are trained in full. Tied embeddings share one Parameter: naming either of lm_head / embed_tokens
    trains the shared tensor, and both are saved with the adapter (PEFT then loads the same values into
    both copies). ``impl``: "fused" (custom autograd) or "torch" (reference). ``adapter_dtype``: dtype of
    A and B (default: the base weight's; fp32 on a bf16 base computes their branch in fp32, as PEFT does, through
    the reference: no fused layout or group, and autograd keeps an fp32 copy of each adapted input for dA; the
    trainer instead keeps bf16 adapters with fp32 masters in the optimizer). ``seed``: generator seed for A (None:
    torch's global RNG).
    ``concat``: how the fused path joins the rank-r GEMMs ("auto" by shape; see LoRALinearFunction).
    ``group``: q/k/v and gate/up adapters of one block run as one GEMM each (``lora.group.LoRAGroup``) when
    they qualify; False keeps one call per module.
    Returns a LoraRecord, also stored as ``model.lora_config``. Every argument and name is checked before
    the model changes: a call that raises leaves it as it was.
    """
    target_modules, targets, saved = check_lora(
        model, r=r, alpha=alpha, dropout=dropout, target_modules=target_modules, use_rslora=use_rslora,
        modules_to_save=modules_to_save, impl=impl, adapter_dtype=adapter_dtype, seed=seed, concat=concat, group=group)
    unmatched = unmatched_targets(model, target_modules)
    if unmatched:  # left out, as PEFT leaves them (an adapter may list another architecture's names): said, as a typo
        log.warning("apply_lora: target_modules entries %s match no module of this model and are left out; its linear "
                    "layers are named %s", unmatched, linear_names(model))
    rec = _put_lora(model, (target_modules, targets, saved), r=r, alpha=alpha, dropout=dropout, use_rslora=use_rslora,
                    impl=impl, adapter_dtype=adapter_dtype, seed=seed, concat=concat)
    tied = [n for n in rec.saved_modules if n not in saved]
    if tied:
        log.info("apply_lora: %s share weights with %s (tied); the shared tensor is trained and both are saved",
                 saved, tied)
    wide = sorted({f"{m.adapter_dtype} adapters on {m.weight.dtype} weights" for _, m in lora_modules(model)
                   if m.wide})
    if wide:
        log.info("apply_lora: %s: each branch runs in the adapters' dtype (lora_linear_ref, PEFT's computation), "
                 "not in the fused layouts or groups", ", ".join(wide))
    if group:
        log.info("apply_lora: %s (q/k/v, gate/up) run as one GEMM each", counted(bind_groups(model), "LoRA group"))
    log.info("apply_lora: r=%d alpha=%g scaling=%g on %s (%s), impl=%s; trainable %d of %d parameters",
             r, alpha, rec.scaling, counted(len(targets), "module"), target_modules, impl, rec.trainable_params,
             rec.total_params)
    return rec


def _put_lora(model: nn.Module, checked: tuple, *, r: int, alpha: float, dropout: float, use_rslora: bool,
              impl: str, adapter_dtype: torch.dtype | None, seed: int | None, concat: bool | str) -> LoraRecord:
    """What apply_lora changes in ``model`` once ``checked`` (check_lora's result for these arguments) holds, without
    its logs or LoRA groups: base weights frozen, a LoRALinear per target, the modules to save (and their tied
    partners) trainable, ``model.lora_config`` set."""
    target_modules, targets, saved = checked
    tied = tied_partners(model, saved)
    if tied:
        saved = sorted(set(saved) | set(tied))
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name in targets:
        base = model.get_submodule(name)
        layer = LoRALinear(base, r, alpha, dropout, use_rslora, impl, adapter_dtype, gen, concat)
        _set_module(model, name, layer.train(base.training))  # keep eval mode: no dropout at eval
    for name in saved:
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(True)
    rec = LoraRecord(r=r, alpha=alpha, dropout=dropout, target_modules=target_modules, use_rslora=use_rslora,
                     scaling=alpha / r ** 0.5 if use_rslora else alpha / r, lora_modules=targets,
                     saved_modules=saved,
                     trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                     total_params=sum(p.numel() for p in model.parameters()))
    model.lora_config = rec
    return rec


def meta_lora_copy(model: nn.Module, **kwargs) -> nn.Module:
    """A copy of ``model`` on the meta device with LoRA as ``apply_lora(model, **kwargs)`` puts it: the names and
    shapes of its adapters and of the modules it trains in full (``model.lora_config``), with no memory, no weight
    read, none of apply_lora's logs and no LoRA groups (they change no name or shape); ``model`` is left as it is and
    apply_lora's checks raise as apply_lora's. ``lora.peft_io.check_adapter`` compares an adapter file's tensor names
    and shapes with it before the weights load."""
    bound = inspect.signature(apply_lora).bind(model, **kwargs)  # apply_lora's defaults for those not given
    bound.apply_defaults()
    given = {k: v for k, v in bound.arguments.items() if k != "model"}
    checked = check_lora(model, **given)
    settings = {k: given[k] for k in ("r", "alpha", "dropout", "use_rslora", "impl", "adapter_dtype", "seed", "concat")}
    # each Parameter and buffer copied as a meta tensor of its shape and dtype (a shared one stays shared: tied
    # lm_head / embed_tokens), so a loaded model's copy copies no weight
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    shadow = copy.deepcopy(model, memo)
    with torch.device("meta"):  # A's kaiming draw on meta too: r x in floats per module left undrawn
        _put_lora(shadow, checked, **settings)
    return shadow


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(full name, module) of every LoRALinear in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """W += s B A for every LoRALinear (computed in fp32, stored in W's dtype), put back plain nn.Linear
    modules on the same Parameters, and drop ``model.lora_config``: the state dict is a plain HF one again.

    requires_grad flags are left as apply_lora set them (base weights frozen).
    """
    mods = lora_modules(model)
    if not mods:
        raise ValueError("merge_lora: the model has no LoRA adapters (apply_lora or load_adapter first)")
    unbind_groups(model)
    for name, mod in mods:
        _set_module(model, name, mod.to_linear())
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model
