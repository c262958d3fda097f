"""The contenders: how each one builds its model, loss and optimizer on the protocol.

Each builder returns a ``Built``: ``prepare(input_ids (B, S))`` -> the contender's batch (built once,
outside the timed window), ``forward_backward(batch)`` -> the detached mean loss over the B * (S - 1)
next-token positions (labels = input ids, Hugging Face form) after its backward, the trainable
parameters and a fused AdamW over them.
transformers is imported inside the builders only: Unsloth must be imported before it, in its own
process (see ``unsloth_contender.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .protocol import LORA_PLUS_RATIO, LR_FULL, LR_LORA, RunSpec, make_optimizer
from .shapes import LORA_TARGETS, Shape, model_config


@dataclass
class Built:
    model: torch.nn.Module
    prepare: Callable[[torch.Tensor], object]
    forward_backward: Callable[[object], torch.Tensor]
    params: list  # trainable parameters (the grad norm is taken over these)
    optimizer: torch.optim.Optimizer
    vocab_size: int
    notes: list[str] = field(default_factory=list)


def hf_style(loss_of_ids: Callable[[torch.Tensor], torch.Tensor]):
    """(prepare, forward_backward) for a model called as ``loss_of_ids(input_ids)`` -> mean loss."""
    def forward_backward(ids):
        loss = loss_of_ids(ids)
        loss.backward()
        return loss.detach()

    return (lambda ids: ids), forward_backward


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    method: str  # "full" | "lora"
    build: Callable[[RunSpec, Shape, torch.device], Built]
    requires: tuple[str, ...] = ()  # importable modules it needs; missing -> row "not installed"
    in_default: bool = True  # part of the default table (others run when named with --contenders)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules directly in ``dtype`` (no fp32 copy; fp32 buffers such as rope's stay fp32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def missing_requirements(contender: Contender) -> list[str]:
    return [m for m in contender.requires if importlib.util.find_spec(m) is None]


# ---------------------------------------------------------------- chronicals
def build_chronicals_model(shape: Shape, device: torch.device, impl: str, seed: int):
    """Our CausalLM for ``shape``, random init directly on ``device`` in bf16."""
    from ..models import CausalLM

    torch.manual_seed(seed)
    with torch.device(device), default_dtype(torch.bfloat16):
        model = CausalLM(model_config(shape), impl=impl)
        model.init_weights()  # normal(0, 0.02) drawn on the device: seconds, not minutes, at the 8B shape
    return model.train()


def add_chronicals_lora(model, spec: RunSpec, group: bool = True, dropout: float = 0.0) -> list[dict]:
    """Inject LoRA on the 7 projections; return the LoRA+ parameter groups (B at 16 x the lr of A; A's lr: spec.lr,
    0 for the protocol's LR_LORA, as every contender reads it).
    group: q/k/v and gate/up adapters as one GEMM each (``lora.group``), as the trainer's default.
    dropout: LoRA dropout (the protocol's is 0; the -dropout contenders measure what masks cost)."""
    from ..lora import apply_lora, lora_plus_param_groups

    out = apply_lora(model, r=spec.lora_r, alpha=spec.lora_alpha, dropout=dropout, target_modules=list(LORA_TARGETS),
                     group=group)
    if isinstance(out, torch.nn.Module) and out is not model:
        raise RuntimeError("chronicals.lora.apply_lora returned a new module; the bench expects in-place injection")
    n_all = sum(1 for _ in model.parameters())
    n_train = sum(1 for p in model.parameters() if p.requires_grad)
    if n_train == n_all or n_train == 0:
        raise RuntimeError(f"apply_lora left {n_train} of {n_all} parameters trainable: base weights must be "
                           "frozen and adapters trainable")
    return lora_plus_param_groups(model, spec.lr or LR_LORA, ratio=LORA_PLUS_RATIO)


def rows_as_packed_batch(ids: torch.Tensor, layout: str):
    """input_ids (B, S) -> a PackedBatch of B documents, one per row, every next token a loss token.

    layout "rows": cu_seqlens None (dense causal attention per row); "packed": cu_seqlens [0, S, 2S, ..., BS]
    (the varlen path the trainer uses for packed data).
    """
    from ..data import PackedBatch
    from ..models import shift_labels_per_document

    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s).contiguous()
    labels = shift_labels_per_document(ids)
    cu = None if layout == "rows" else torch.arange(0, b * s + 1, s, device=ids.device, dtype=torch.int32)
    return PackedBatch(input_ids=ids, position_ids=pos, shift_labels=labels, cu_seqlens=cu, max_seqlen=s,
                       num_loss_tokens=b * (s - 1), num_tokens=b * s, num_docs=b)


def chronicals_step(model, spec: RunSpec, device: torch.device, graphs: bool = False):
    """(prepare, forward_backward) for our model: the trainer's step, or the bench's own call.

    graphs: the trainer's step replayed as CUDA graphs (``train.graphs.GraphedStep``, captured at the
    first call, i.e. in the warm-up steps); needs CUDA and step="trainer".
    """
    if spec.step == "trainer":
        from ..train.step import accumulate_gradients

        graphed = None
        if graphs:
            from ..train.graphs import GraphedStep

            graphed = GraphedStep(model, device)
        return ((lambda ids: rows_as_packed_batch(ids, spec.layout)),
                (lambda batch: accumulate_gradients(model, [batch], device, graphed)[0]))
    if graphs:
        raise ValueError("the CUDA-graph contenders run the trainer's step (step='trainer'); drop --step bench")

    def loss_of_ids(batch):
        return model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                     max_seqlen=batch.max_seqlen, shift_labels=batch.shift_labels, reduction="mean")

    _, fb = hf_style(loss_of_ids)
    return (lambda ids: rows_as_packed_batch(ids, spec.layout)), fb


def _chronicals(method: str, compile_layers: bool, graphs: bool = False, keep: bool = False,
                fused_swiglu: bool = True, group: bool = True, recompute: tuple | None = None,
                gate_up_layers: int = 0, in_place: bool = True, dropout: float = 0.0):
    """keep: no selective recomputation (``model.recompute=[]``): every activation stays saved.
    fused_swiglu: the SwiGLU backward kernel rebuilds the product (``RuntimeOptions.fused_swiglu_recompute``,
    the default); False: a second SwiGLU forward does (the offer).
    group: LoRA q/k/v and gate/up as one GEMM each (``lora.group``); False: one call per module.
    recompute: ``model.recompute`` names instead of the default (keep=True means ()); gate_up_layers: with
    "gate_up" among them, the first k layers only (``model.gate_up_layers``).
    in_place: the MLP backward writes its gradients over the saved gate|up output and d_act
    (``RuntimeOptions.swiglu_backward_in_place``, the default); False: fresh buffers.
    dropout: LoRA dropout (``lora.dropout``; the protocol's is 0)."""
    def build(spec: RunSpec, shape: Shape, device: torch.device) -> Built:
        model = build_chronicals_model(shape, device, spec.impl, spec.seed)
        model.set_checkpointing(spec.checkpointing)
        model.opts.fused_swiglu_recompute = fused_swiglu
        model.opts.swiglu_backward_in_place = in_place
        model.opts.attention = spec.attention
        if keep or recompute is not None:
            model.set_recompute(() if keep else recompute, gate_up_layers)
        notes = [f"impl={spec.impl}"]
        if method == "lora":
            groups = add_chronicals_lora(model, spec, group, dropout)
            notes.append(f"LoRA r={spec.lora_r} alpha={spec.lora_alpha}, LoRA+ ratio {LORA_PLUS_RATIO}"
                         + ("" if group else ", no LoRA groups (one call per module)")
                         + (f", LoRA dropout {dropout}" if dropout else ""))
        else:
            groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        if compile_layers:
            model.compile_layers()
            notes.append("decoder layers torch.compile'd")
        notes.append(f"recompute={list(model.opts.recompute)}"
                     + (f", gate_up in the first {gate_up_layers} layers" if gate_up_layers else "")
                     + ("" if fused_swiglu else " (SwiGLU product from a second forward)")
                     + ("" if in_place else ", MLP backward into fresh buffers"))
        params = [p for g in groups for p in g["params"]]
        opt = make_optimizer(groups, device, spec.lr or (LR_LORA if method == "lora" else LR_FULL))
        prepare, fb = chronicals_step(model, spec, device, graphs)
        notes.append(f"step={spec.step}, layout={spec.layout}"
                     + (f", attention={spec.attention}" if spec.layout == "packed" or spec.attention == "fa4" else "")
                     + (", CUDA graphs (fwd+bwd)" if graphs else ""))
        return Built(model, prepare, fb, params, opt, model.config.vocab_size, notes)

    return build


# ---------------------------------------------------------------- transformers (+ Liger, PEFT, compile)
def build_hf_model(shape: Shape, device: torch.device, seed: int, attn: str = "sdpa"):
    """transformers' model for ``shape``, random init (its own init) on ``device`` in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**shape.hf_config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    model.config.use_cache = False
    return model.train()


def apply_liger(model_type: str, fused_ce: bool) -> str:
    """Patch transformers' classes with Liger's kernels (before the model is built; this process only)."""
    import liger_kernel.transformers as lt

    fn = getattr(lt, f"apply_liger_kernel_to_{model_type}", None)
    if fn is None:
        raise RuntimeError(f"liger_kernel has no apply_liger_kernel_to_{model_type}")
    fn(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=fused_ce)
    return "Liger RMSNorm, SwiGLU, RoPE" + (", fused linear CE" if fused_ce else ", no fused CE")


def add_peft_lora(model, spec: RunSpec):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                     target_modules=list(LORA_TARGETS), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)  # PEFT's default keeps adapters in fp32 (autocast_adapter_dtype)


def _hf(method: str, compile_model: bool = False, liger: bool = False, liger_fused_ce: bool = True):
    def build(spec: RunSpec, shape: Shape, device: torch.device) -> Built:
        notes = []
        if liger:
            notes.append(apply_liger(shape.hf_config["model_type"], liger_fused_ce))
        model = build_hf_model(shape, device, spec.seed)
        if spec.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            notes.append("gradient checkpointing")
        if method == "lora":
            model = add_peft_lora(model, spec)
            notes.append(f"PEFT LoRA r={spec.lora_r} alpha={spec.lora_alpha}")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer([{"params": params}], device, spec.lr or (LR_LORA if method == "lora" else LR_FULL))
        fwd = torch.compile(model) if compile_model else model
        if compile_model:
            notes.append("torch.compile(model)")
        prepare, fb = hf_style(lambda ids: fwd(input_ids=ids, labels=ids, use_cache=False).loss)
        return Built(model, prepare, fb, params, opt, shape.hf_config["vocab_size"], notes)

    return build


def _unsloth(method: str):
    def build(spec: RunSpec, shape: Shape, device: torch.device) -> Built:
        from .unsloth_contender import build_unsloth

        return build_unsloth(spec, shape, device, method)

    return build


_ALL = [
    Contender("chronicals-full", "chronicals", "full", _chronicals("full", False)),
    Contender("chronicals-full-compile", "chronicals, layers compiled", "full", _chronicals("full", True),
              in_default=False),
    Contender("chronicals-lora", "chronicals LoRA (LoRA+ 16)", "lora", _chronicals("lora", False)),
    Contender("chronicals-full-graphs", "chronicals, CUDA graphs", "full", _chronicals("full", False, True),
              in_default=False),
    # in the default table: the shipped 0.5B LoRA recipe replays its step (configs/qwen2.5-0.5b/lora.yaml)
    Contender("chronicals-lora-graphs", "chronicals LoRA, CUDA graphs", "lora", _chronicals("lora", False, True)),
    Contender("chronicals-full-keep", "chronicals, no recompute", "full", _chronicals("full", False, keep=True),
              in_default=False),
    Contender("chronicals-full-offer", "chronicals, SwiGLU product rebuilt by a second forward", "full",
              _chronicals("full", False, fused_swiglu=False), in_default=False),
    Contender("chronicals-lora-graphs-offer", "chronicals LoRA, CUDA graphs, SwiGLU product rebuilt by a second forward",
              "lora", _chronicals("lora", False, True, fused_swiglu=False), in_default=False),
    Contender("chronicals-lora-nogroup", "chronicals LoRA, one call per projection", "lora",
              _chronicals("lora", False, group=False), in_default=False),
    Contender("chronicals-lora-graphs-nogroup", "chronicals LoRA, CUDA graphs, one call per projection", "lora",
              _chronicals("lora", False, True, group=False), in_default=False),
    # LoRA dropout 0.1 (PEFT recipes' 0.05-0.1): groups with per-member masks (402f157) vs one call per projection
    *(Contender(f"chronicals-lora{'-graphs' * graphs}{'-nogroup' * (not group)}-dropout",
                "chronicals LoRA" + ", CUDA graphs" * graphs + ", one call per projection" * (not group)
                + ", LoRA dropout 0.1", "lora", _chronicals("lora", False, graphs, group=group, dropout=0.1),
                in_default=False) for graphs in (False, True) for group in (True, False)),
    Contender("chronicals-full-gateup", "chronicals, gate/up output recomputed too", "full",
              _chronicals("full", False, recompute=("norm", "swiglu", "gate_up")), in_default=False),
    Contender("chronicals-lora-graphs-gateup", "chronicals LoRA, CUDA graphs, gate/up output recomputed too", "lora",
              _chronicals("lora", False, True, recompute=("norm", "swiglu", "gate_up")), in_default=False),
    # the MLP backward's gradients into fresh buffers instead of over gate|up and d_act (3 (N, I) tensors more)
    Contender("chronicals-full-graphs-fresh", "chronicals, CUDA graphs, MLP backward into fresh buffers", "full",
              _chronicals("full", False, True, in_place=False), in_default=False),
    Contender("chronicals-lora-graphs-fresh", "chronicals LoRA, CUDA graphs, MLP backward into fresh buffers", "lora",
              _chronicals("lora", False, True, in_place=False), in_default=False),
    Contender("chronicals-lora-graphs-keep", "chronicals LoRA, CUDA graphs, no recompute", "lora",
              _chronicals("lora", False, True, keep=True), in_default=False),
    Contender("chronicals-lora-compile", "chronicals LoRA, layers compiled", "lora", _chronicals("lora", True),
              in_default=False),
    Contender("hf-sdpa", "transformers, SDPA", "full", _hf("full")),
    Contender("hf-compile", "transformers + torch.compile", "full", _hf("full", compile_model=True)),
    Contender("hf-liger", "transformers + Liger", "full", _hf("full", liger=True), ("liger_kernel",)),
    Contender("hf-liger-nofce-compile", "transformers + Liger (no fused CE) + torch.compile", "full",
              _hf("full", compile_model=True, liger=True, liger_fused_ce=False), ("liger_kernel",), in_default=False),
    Contender("unsloth-full", "Unsloth (full_finetuning)", "full", _unsloth("full"), ("unsloth",)),
    Contender("hf-peft", "transformers + PEFT", "lora", _hf("lora"), ("peft",)),
    Contender("hf-peft-liger", "transformers + PEFT + Liger", "lora", _hf("lora", liger=True),
              ("peft", "liger_kernel")),
    Contender("hf-peft-compile", "transformers + PEFT + torch.compile", "lora", _hf("lora", compile_model=True),
              ("peft",)),
    Contender("unsloth-lora", "Unsloth (get_peft_model)", "lora", _unsloth("lora"), ("unsloth",)),
]
CONTENDERS: dict[str, Contender] = {c.name: c for c in _ALL}


# the memory dial: "chronicals-{full,lora}[-graphs]-gateup<k>" rebuilds the gate/up output in the first k layers
# (``model.gate_up_layers``): ~0.27 GiB and ~0.47 ms a layer at the 0.5B protocol (session 5, k = 10: 12.1 -> 9.4
# GiB); at 8B (4 x 2048) ~0.44 GiB a layer. Any k, so a sweep needs no new entry.
_GATE_UP_K = re.compile(r"chronicals-(full|lora)(-graphs)?-gateup([1-9][0-9]*)")


def _gate_up_contender(name: str) -> Contender | None:
    m = _GATE_UP_K.fullmatch(name)
    if m is None:
        return None
    method, graphs, k = m.group(1), m.group(2) is not None, int(m.group(3))
    what = ("chronicals LoRA" if method == "lora" else "chronicals") + (", CUDA graphs" if graphs else "")
    return Contender(name, f"{what}, gate/up output recomputed in {k} layer{'s' * (k > 1)}", method,
                     _chronicals(method, False, graphs, recompute=("norm", "swiglu", "gate_up"), gate_up_layers=k),
                     in_default=False)


def get_contender(name: str) -> Contender:
    c = CONTENDERS.get(name) or _gate_up_contender(name)
    if c is None:
        raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}, or "
                         "chronicals-{full,lora}[-graphs]-gateup<k> (gate/up rebuilt in the first k layers)")
    return c
