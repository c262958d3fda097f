"""Our decoder for the Llama family (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3).

Module and parameter names are exactly Hugging Face's (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``), so HF checkpoints and PEFT adapters map one to one with no renaming.

Shapes: input_ids (B, S) -> hidden (B, S, H) -> logits (B, S, V) or a loss.
Packed rows: ``position_ids`` restart at 0 per document and ``cu_seqlens`` / ``max_seqlen`` describe the
documents (see ``chronicals.ops.attention``); the model passes them through untouched. Restarting position_ids
without cu_seqlens are read as packed documents too, as transformers does (a host read of the positions).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

from .._numbers import is_int
from ..ops import attention, linear_cross_entropy, recompute, rms_norm, rope_cos_sin, rope_qk, swiglu
from ..ops._impl import check_impl
from ..ops.attention import attention_ref
from ..ops.swiglu import swiglu_gate_up
from .config import ModelConfig, rope_inv_freq
from .forward_args import IGNORE_INDEX, check_forward_args, documents_from_positions, mask_padding
from .fused_proj import gate_up_proj, grad_spare, norm_spare, qkv_proj, qkv_rope, swiglu_down


@dataclass
class RuntimeOptions:
    """Options shared by every module of one model (one object, referenced everywhere)."""
    impl: str = "auto"  # "auto" (Triton on CUDA, PyTorch on CPU) | "triton" | "torch"
    # packed rows' attention kernel on CUDA (ops.attention ``varlen``): "auto" | "cudnn" | "flash" | "fa4" (FA4 for
    # unpacked rows too)
    attention: str = "auto"
    # activation checkpointing: True = every decoder layer, False / 0 = none, an int k = the first k layers
    # (recompute them in backward; the first ones, because their backward runs last, when the later
    # layers' activations are already freed, so the peak drops by k layers' saved activations)
    checkpointing: bool | int = False
    # tensors rebuilt in backward instead of kept (see ops.recompute): "norm" = RMSNorm outputs (from the
    # norm's own saved input and rstd; 1.31 GiB at the Qwen2.5-0.5B protocol for ~0.7 ms per step), "swiglu" =
    # the SwiGLU product down_proj saves (from gate and up; 3.56 GiB there for ~2.6 ms), "gate_up" = the
    # packed gate|up GEMM output (from the MLP's input: ~6.5 GiB there for one more GEMM per layer, ~10 ms;
    # opt-in). Gradients are bit-identical either way.
    recompute: tuple[str, ...] = ("norm", "swiglu")
    # with "gate_up" in recompute: rebuild it in the first k decoder layers only (0 = every layer). Each layer
    # is ~0.25 GiB less at the Qwen2.5-0.5B protocol for one more (N x H x 2I) GEMM, ~0.47 ms on an H200 (the
    # whole-model switch measured 6.1 GiB for 11.4 ms a step, git b9e5c15). The first layers, because their
    # backward runs last: the rebuilt (N, 2I) output then never meets the later layers' saved activations.
    gate_up_layers: int = 0
    # how "swiglu" rebuilds the product on the Triton path with plain gate/up/down: True = the SwiGLU backward
    # kernel writes it as a third output (models.fused_proj.SwiGLUDownFunction: ~1.9 ms less GPU per 0.5B
    # step; a LoRA down_proj's dA input likewise); False = a second SwiGLU forward (the offer). One H200 run,
    # eager, 0.5B protocol (git 6faf856): 138.1k tok/s vs 136.7k, both 13.7 GiB. Same gradients either way
    # (bit for bit).
    fused_swiglu_recompute: bool = True
    # with fused_swiglu_recompute on the Triton path: that kernel writes the gate|up gradient over the saved
    # gate|up output and the product over d_act (models.fused_proj.swiglu_backward_owned), so the MLP
    # backward's transients are 3 (N, I) tensors fewer (0.45 GiB at the Qwen2.5-0.5B protocol, 0.66 GiB at the
    # 8B LoRA shape, where the step's peak is the first MLP backward). Same bits. False: fresh buffers, for
    # more than one backward through one forward (retain_graph=True), which raises otherwise.
    swiglu_backward_in_place: bool = True
    # the loss head's vocab_parts (ops.linear_cross_entropy): k > 1 keeps no fp32 weight-gradient accumulator
    # beyond dW itself (0.79 -> 0.56 GiB at Qwen2.5-0.5B) for a second pass over part of the vocabulary (k = 2:
    # 29.7 -> 33.9 ms for the head on an H200, git 638f39e)
    loss_vocab_parts: int = 1

    def __post_init__(self):
        self.recompute = check_recompute(self.recompute)
        check_gate_up_layers(self.gate_up_layers, self.recompute)

    def rebuilds_gate_up(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (0-based) offers its gate|up GEMM output for recomputation."""
        return "gate_up" in self.recompute and (self.gate_up_layers == 0 or layer_idx < self.gate_up_layers)

    def checkpointed_layers(self, num_layers: int) -> int:
        """How many leading layers to checkpoint out of ``num_layers``."""
        c = self.checkpointing
        if isinstance(c, bool):  # bool before int: True is an int (1), but means "every layer"
            return num_layers if c else 0
        if not isinstance(c, int) or c < 0:
            raise ValueError(f"checkpointing={c!r}: use True (every layer), False, or a layer count k >= 0")
        return min(c, num_layers)


RECOMPUTABLE = ("norm", "swiglu", "gate_up")


def check_recompute(names) -> tuple[str, ...]:
    """A list / tuple of names from RECOMPUTABLE (or True = all, False / None = none) -> a tuple."""
    if names is True:
        return RECOMPUTABLE
    if names is None or names is False:
        return ()
    if isinstance(names, str):
        names = [names]
    bad = [n for n in names if n not in RECOMPUTABLE]
    if bad:
        raise ValueError(f"recompute={list(names)!r}: unknown {bad}; choose from {list(RECOMPUTABLE)}")
    return tuple(names)


def check_gate_up_layers(k, names: tuple[str, ...]) -> int:
    """``gate_up_layers`` k: an int >= 0, and k > 0 only with "gate_up" among the recompute ``names``."""
    if not is_int(k) or k < 0:
        raise ValueError(f"gate_up_layers={k!r}: use a layer count k >= 0 (0 = every layer)")
    if k and "gate_up" not in names:
        raise ValueError(f"gate_up_layers={k} limits the \"gate_up\" recompute to the first {k} layers, but "
                         f"recompute={list(names)} has no \"gate_up\": add it, or set gate_up_layers to 0")
    return k


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, opts: RuntimeOptions):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.opts = eps, opts

    def forward(self, x, residual=None, spare: int = 0, grad_spare: int = 0):
        """x (..., D) -> y; with ``residual`` returns (norm(x + residual), x + residual). ``spare``: columns left
        free after each row of y for its consumer (``ops.rms_norm``, ``fused_proj.norm_spare``); ``grad_spare``: the
        same after each row of x's gradient, for x's producer (``fused_proj.grad_spare``)."""
        return rms_norm(x, self.weight, self.eps, residual=residual, impl=self.opts.impl,
                        recompute="norm" in self.opts.recompute, spare=spare, grad_spare=grad_spare)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: RuntimeOptions):
        super().__init__()
        self.nq, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, qkv_bias = cfg.hidden_size, cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(h, self.nq * self.d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.nq * self.d, h, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, opts)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, opts)
        self.qk_norm, self.opts = cfg.qk_norm, opts

    def forward(self, x, cos, sin, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        b, s, _ = x.shape
        # (B, S, Hq, D), (B, S, Hk, D) x 2: views of one GEMM's output when q/k/v are plain nn.Linear (one dx
        # GEMM in backward instead of three plus two adds, one bias reduction instead of three)
        if self.qk_norm:
            q, k, v = qkv_proj(self, x)
            q, k = rope_qk(self.q_norm(q), self.k_norm(k), cos, sin, impl=self.opts.impl)
        else:  # rotated out of the joint GEMM's output by one op: its backward writes dq | dk | dv whole
            q, k, v = qkv_rope(self, x, cos, sin)
        if kv_cache is None:
            o = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, impl=self.opts.impl,
                          varlen=self.opts.attention)
        else:  # generation: one row, keys/values of earlier steps appended
            o = kv_cache.attend(q, k, v)
        return self.o_proj(o.reshape(b, s, self.nq * self.d))


def _swiglu_gate_up_of(src, impl: str) -> torch.Tensor:
    """swiglu_gate_up(src()) for a recipe: ``src`` rebuilds gu (``ops.recompute.rebuilder``)."""
    return swiglu_gate_up(src(), impl=impl)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: RuntimeOptions, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # for RuntimeOptions.rebuilds_gate_up
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.opts = opts

    def forward(self, x):
        # one GEMM x @ [Wg; Wu]^T when gate/up are plain nn.Linear or a LoRA group (lora.group), else None
        gu = gate_up_proj(self, x)  # (B, S, 2I) or None
        # A down_proj offering ``forward_swiglu(gate, up, impl)`` (LoRALinear) computes
        # down_proj(swiglu(gate, up)) while saving only gate and up (or gu): the product (B, S, I), which a plain
        # Linear keeps as its input, is recomputed in backward (235 MB per layer at 4 x 2048 tokens, I = 14336).
        lora_down = getattr(self.down_proj, "forward_swiglu", None)
        if gu is not None:
            if lora_down is not None:
                return lora_down(gu, None, impl=self.opts.impl, fused_act=self.opts.fused_swiglu_recompute,
                                 in_place=self.opts.swiglu_backward_in_place)
            recomputing = "swiglu" in self.opts.recompute and recompute.is_active()
            # not the session: a checkpointed layer's forward runs again in backward outside it, and must save
            # what its first run saved (torch.utils.checkpoint compares them): the training forward's own test
            if ("swiglu" in self.opts.recompute and self.training and torch.is_grad_enabled()
                    and self.opts.fused_swiglu_recompute):
                y = swiglu_down(self, gu)  # None off the Triton path: then the offer below
                if y is not None:
                    return y
            act = swiglu_gate_up(gu, impl=self.opts.impl)  # (B, S, I); backward writes d_gu in one kernel
            if recomputing:
                # from gu's own recipe when gu is offered too ("gate_up"): a closure over gu would keep it alive
                src = recompute.rebuilder(gu)
                fn = (functools.partial(swiglu_gate_up, gu, impl=self.opts.impl) if src is None else
                      functools.partial(_swiglu_gate_up_of, src, self.opts.impl))
                recompute.offer(act, fn)
            return self.down_proj(act)
        gate, up = self.gate_proj(x), self.up_proj(x)  # (B, S, I) each
        if lora_down is not None:
            return lora_down(gate, up, impl=self.opts.impl)
        act = swiglu(gate, up, impl=self.opts.impl)  # (B, S, I), saved by down_proj for its weight gradient
        if "swiglu" in self.opts.recompute and recompute.is_active():
            recompute.offer(act, functools.partial(swiglu, gate, up, impl=self.opts.impl))
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: RuntimeOptions, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts)
        self.self_attn = Attention(cfg, opts)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts)
        self.mlp = MLP(cfg, opts, layer_idx)

    def forward(self, h, residual, cos, sin, cu_seqlens=None, max_seqlen=None, kv_cache=None, h_grad_spare=0):
        """h: the previous block's output, residual: the stream before it (None for layer 0).

        The residual add is fused into the norms: norm(h + residual) and the new stream in one pass.
        h_grad_spare: columns for h's producer after each row of h's gradient (``fused_proj.grad_spare``).
        """
        spare = norm_spare(self.self_attn)  # a LoRA q/k/v group's x A^T columns
        if residual is None:
            x, residual = self.input_layernorm(h, spare=spare, grad_spare=h_grad_spare), h
        else:
            x, residual = self.input_layernorm(h, residual, spare=spare, grad_spare=h_grad_spare)
        h = self.self_attn(x, cos, sin, cu_seqlens, max_seqlen, kv_cache)
        # under torch.compile rms_norm makes dx its own way: the property reads would only be traced
        o_spare = (grad_spare(self.self_attn) if self.training and torch.is_grad_enabled()
                   and not torch.compiler.is_compiling() else 0)
        x, residual = self.post_attention_layernorm(h, residual, spare=norm_spare(self.mlp), grad_spare=o_spare)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: RuntimeOptions):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, opts, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts)
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.opts, self._cfg = opts, cfg

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round inv_freq to 8 mantissa bits: at position 1000 the
        # fastest rotation would be off by ~4 rad. Recompute it in fp32 on the new device instead.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self._cfg)[0].to(self.inv_freq.device)
        return self

    def forward(self, input_ids, position_ids, cu_seqlens=None, max_seqlen=None, kv_caches=None):
        training = self.training and torch.is_grad_enabled()
        with recompute.recompute_session(training and bool(self.opts.recompute)):
            return self._forward(input_ids, position_ids, cu_seqlens, max_seqlen, kv_caches, training)

    def _forward(self, input_ids, position_ids, cu_seqlens, max_seqlen, kv_caches, training):
        try:
            h = self.embed_tokens(input_ids)  # (B, S, H)
        except IndexError:  # the CPU's bare "index out of range in self" (CUDA: a device-side assert)
            raise IndexError(f"input_ids hold ids outside [0, {self.embed_tokens.num_embeddings}), the model's "
                             "vocab_size: were they made by a tokenizer of another model, or one with added tokens? "
                             "Use the model's own tokenizer, or grow the embedding for the new tokens") from None
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, self.attention_scaling, dtype=h.dtype)
        residual = None
        # not with caches: a checkpointed layer took none (it attended over the new tokens alone and left its cache
        # empty), and a recompute in backward would append the same keys twice (a mutation walk)
        n_ckpt = self.opts.checkpointed_layers(len(self.layers)) if training and kv_caches is None else 0
        spare = 0  # columns after each row of h's gradient for the block that made h (its LoRA down_proj's)
        for i, layer in enumerate(self.layers):
            cache = None if kv_caches is None else kv_caches[i]
            if i < n_ckpt:
                h, residual = ckpt.checkpoint(layer, h, residual, cos, sin, cu_seqlens, max_seqlen, None, spare,
                                              use_reentrant=False)
            else:
                h, residual = layer(h, residual, cos, sin, cu_seqlens, max_seqlen, cache, spare)
            spare = grad_spare(layer.mlp) if training else 0
        return self.norm(h, residual, grad_spare=spare)[0]


def _host_readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values may be read on the host now: not while torch.compile traces or a CUDA graph is
    captured (a read there breaks the graph or fails the capture)."""
    return not torch.compiler.is_compiling() and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def shift_labels_per_document(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """labels (B, S) in Hugging Face form (token t's own id) -> targets (B, S): token t predicts t + 1.

    The last token of each row, and of each document in a packed row (where the next position id
    restarts at 0), predicts nothing (IGNORE_INDEX): no position predicts another document's token.
    """
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        out[:, :-1].masked_fill_(position_ids[:, 1:] == 0, IGNORE_INDEX)
    return out


# Compaction pays when at least this share of the rows carries no loss: it costs a sort of the N labels and a
# gather + scatter of (N, H) (~0.05 ms at 16k x 896 on an H200) and saves that share of the loss head's three
# N x H x V GEMMs (~20 ms at 16k x 896 x 151,936). Chat fine-tuning with prompts masked ignores 50-90%.
COMPACT_MIN_IGNORED = 0.1


def loss_rows(hidden: torch.Tensor, targets: torch.Tensor, num_loss_tokens: int | None):
    """hidden (N, H), targets (N,) -> the rows that carry a loss, in order: (n, H), (n,) with n = num_loss_tokens.

    The count comes from the host (the collator counted it), so nothing waits on the device: the rows are
    picked with a stable sort of the "ignored" flags (loss rows first) and a gather; the gather's backward
    scatters the gradient back (zero on ignored rows, which is what they get anyway). A device-side assert
    checks the count. Returns the inputs unchanged when the count is None or fewer than
    ``COMPACT_MIN_IGNORED`` of the rows are ignored, and under torch.compile / CUDA-graph capture, where
    shapes must not depend on the batch; also when none carries a loss (a data-parallel rank's empty batch): the
    head then runs over rows that are all ignored (loss 0, zero gradients) rather than over none.
    """
    n = targets.shape[0]
    if num_loss_tokens is None:
        return hidden, targets
    if not 0 <= num_loss_tokens <= n:
        raise ValueError(f"num_loss_tokens={num_loss_tokens} is outside [0, {n}] for {n} target positions; pass "
                         "the count of shift_labels != -100 (PackedBatch.num_loss_tokens) or None")
    if num_loss_tokens == 0 or n - num_loss_tokens < COMPACT_MIN_IGNORED * n or torch.compiler.is_compiling():
        return hidden, targets
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return hidden, targets
    ignored = targets == IGNORE_INDEX
    torch._assert_async((n - ignored.sum()) == num_loss_tokens,
                        "num_loss_tokens differs from the count of targets != -100 in shift_labels")
    keep = torch.argsort(ignored.to(torch.int8), stable=True)[:num_loss_tokens]
    return hidden.index_select(0, keep), targets.index_select(0, keep)


def judged_length(seq_len: int, cu_seqlens=None, max_seqlen: int | None = None, longest_doc: int | None = None) -> int:
    """The length a sliding window or a dynamic rope limits (``CausalLM.check_sequence_length``): a row's
    ``seq_len``; for packed rows (``cu_seqlens``) their longest real document, else ``max_seqlen`` (which counts a
    row's padding segment), else ``seq_len``."""
    if cu_seqlens is None:
        return seq_len
    return next((n for n in (longest_doc, max_seqlen) if n is not None), seq_len)


def check_trains_as_transformers(cfg: ModelConfig) -> None:
    """ValueError when a training step of a model of ``cfg`` would compute something other than transformers' (an
    attention_dropout, which chronicals' attention does not apply). The forward pass refuses such a step; the trainer
    asks before it reads the data and loads the weights (``train.setup.check_config_fits``), from config.json alone."""
    if cfg.attention_dropout:
        raise ValueError(
            f"config.json sets attention_dropout={cfg.attention_dropout}: transformers drops that share of "
            "the attention probabilities in training, and chronicals' attention has no dropout, so this training "
            "step would differ from transformers'. Set attention_dropout to 0.0 in the model's config.json to "
            "fine-tune without it (evaluation and generation are unaffected: model.eval() runs as is)")


class CausalLM(nn.Module):
    """The decoder plus its loss head. ``model(input_ids)`` -> logits (B, S, V)."""

    def __init__(self, cfg: ModelConfig, impl: str = "auto"):
        super().__init__()
        self.config = cfg
        # the bytes of generation_config.json of the HF directory this model was loaded from (None otherwise):
        # save_model writes it back unchanged, so a fine-tuned or merged model keeps its sampling defaults
        self.source_generation_config: bytes | None = None
        self.opts = RuntimeOptions(impl=check_impl("CausalLM", impl))
        self.model = DecoderModel(cfg, self.opts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- options ----
    def set_impl(self, impl: str) -> "CausalLM":
        """Pick the op implementations: "auto" (Triton on CUDA, PyTorch on CPU), "triton" or "torch"."""
        self.opts.impl = check_impl("set_impl", impl)  # the value now; whether it runs on a device at the call
        return self

    def set_checkpointing(self, on: bool | int) -> "CausalLM":
        """Activation checkpointing: True (every decoder layer), False, or k (the first k layers)."""
        replace(self.opts, checkpointing=on).checkpointed_layers(len(self.model.layers))  # a bad value fails here,
        self.opts.checkpointing = on  # not at the next step, and leaves the setting as it was
        return self

    def set_recompute(self, names, gate_up_layers: int = 0) -> "CausalLM":
        """Tensors to rebuild in backward instead of keeping: a subset of RECOMPUTABLE, True (all) or False;
        ``gate_up_layers`` k > 0 limits "gate_up" to the first k layers (``RuntimeOptions.gate_up_layers``)."""
        names = check_recompute(names)
        self.opts.gate_up_layers = check_gate_up_layers(gate_up_layers, names)
        self.opts.recompute = names
        return self

    def compile_layers(self) -> "CausalLM":
        """torch.compile each decoder layer (one graph reused by every layer: a fast warm-up). Turns
        ``recompute`` off: inside compiled code the offers are no-ops (the compiler plans its own
        recomputation), so the session's saved-tensor hooks would only add work around the graphs."""
        for layer in self.model.layers:
            layer.compile()
        self.opts.recompute, self.opts.gate_up_layers = (), 0
        return self

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "CausalLM":
        """Random init like transformers: normal(0, std) for matrices and embeddings, zeros for biases."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std))
        return self

    # ---- forward ----
    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, kv_caches=None,
                      longest_doc: int | None = None):
        """input_ids (B, S) -> final-norm hidden states (B, S, H). ``longest_doc``: see ``forward``. position_ids
        that restart at 0 inside a row without cu_seqlens are packed documents (``documents_from_positions``: read
        on the host; not while compiling or capturing a CUDA graph, where cu_seqlens must be given)."""
        if position_ids is not None and position_ids.shape[0] != input_ids.shape[0]:
            # (1, S): every row alike. Read as documents unexpanded, cu_seqlens covered row 0's S tokens only and
            # the other rows attended across their documents (transformers expands them too)
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        if cu_seqlens is None and position_ids is not None and kv_caches is None and _host_readable(position_ids):
            cu_seqlens, max_seqlen = documents_from_positions(position_ids)
        longest = judged_length(input_ids.shape[1], cu_seqlens, max_seqlen, longest_doc)
        if kv_caches is not None:
            longest += kv_caches[0].length
        self.check_sequence_length(longest, position_ids if cu_seqlens is None else None)
        if self.config.attention_dropout and self.training and torch.is_grad_enabled():
            check_trains_as_transformers(self.config)
        if position_ids is None:
            if cu_seqlens is not None:
                raise ValueError("packed rows (cu_seqlens) need position_ids that restart at 0 per document")
            start = 0 if kv_caches is None else kv_caches[0].length
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        return self.model(input_ids, position_ids, cu_seqlens, max_seqlen, kv_caches)

    def check_sequence_length(self, seqlen: int, position_ids=None) -> None:
        """ValueError when a sequence of ``seqlen`` tokens is past what this model computes as transformers does
        (a sliding window, a dynamic rope's limit). Host ints (and, for a dynamic rope, ``position_ids``' largest);
        the trainer calls it per batch before replaying a captured step, which runs no Python."""
        self._check_sliding_window(seqlen)
        self._check_dynamic_rope(seqlen, position_ids)

    def _check_sliding_window(self, seqlen: int) -> None:
        """Sliding-window attention (in every layer for Mistral, in some for Qwen2/3) equals full causal attention
        up to the window; past it we would compute something else, so refuse (a host-side int check: no device
        sync). The message serves chat and generation as well as training."""
        w = self.config.sliding_window
        if w is not None and seqlen > w:
            raise ValueError(
                f"a sequence of {seqlen} tokens is longer than this {self.config.model_type} model's sliding_window="
                f"{w}: sequences longer than {w} tokens need sliding-window attention, which chronicals does not "
                f"implement (it attends over the full causal window, which differs past {w} tokens). Keep prompt "
                f"plus generated tokens within {w}; for training set data.max_seq_len <= {w} (or use documents of "
                f"at most {w} tokens).")

    def _check_dynamic_rope(self, seqlen: int, position_ids=None) -> None:
        """Dynamic (NTK) rope equals the plain one up to max_position_embeddings; past it transformers recomputes
        the frequencies from each batch's longest position, which we do not: refuse. A host-side int check, and for
        explicit ``position_ids`` (not packed rows, whose positions restart within their length) a read of their
        largest, on dynamic-rope models only and not while a CUDA graph is captured or torch.compile traces."""
        rs, n = self.config.rope_scaling, self.config.max_position_embeddings
        if not rs or rs.get("rope_type", rs.get("type")) != "dynamic":
            return
        what = f"a sequence of {seqlen} tokens is longer"
        if position_ids is not None and position_ids.numel() and _host_readable(position_ids):
            top = int(position_ids.max())  # transformers rescales from the largest position
            if top + 1 > seqlen:
                seqlen, what = top + 1, f"position_ids up to {top} ({top + 1} positions) are more"
        if seqlen > n:
            raise ValueError(
                f"{what} than this model's max_position_embeddings={n}, and its "
                f"rope_type is 'dynamic': past {n} tokens transformers rescales the rotary frequencies to the "
                f"sequence's length, which chronicals does not implement. Keep prompt plus generated tokens within "
                f"{n}; for training set data.max_seq_len <= {n}.")

    def forward(self, input_ids, *, position_ids=None, cu_seqlens=None, max_seqlen=None, labels=None,
                shift_labels=None, reduction: str = "mean", kv_caches=None, num_loss_tokens: int | None = None,
                attention_mask=None, longest_doc: int | None = None):
        """Logits (B, S, V) when no labels are given; otherwise the loss, never building the logits.

        labels: (B, S) Hugging Face form, shifted here per document (a position whose ``position_ids`` entry
        restarts at 0 begins a new document: the token before it predicts nothing). shift_labels: (B, S) targets
        already aligned (what the data collator produces). reduction: "mean" | "sum" | "none" (then (B, S)); with
        every target -100, "mean" is 0 (not NaN: torch's cross_entropy gives NaN there) and the
        gradients are zero.
        num_loss_tokens: the host-side count of targets != -100 (the collator's ``PackedBatch.num_loss_tokens``),
        or None. With it, "mean" / "sum" run the loss head on the loss rows only (see ``loss_rows``).
        attention_mask: (B, S) 1 for tokens, 0 for padding, as a tokenizer returns it; right padding only (see
        ``forward_args.mask_padding``): padding predicts nothing and is never a target.
        longest_doc: packed rows (``cu_seqlens``): their longest real document (``PackedBatch.longest_doc``), which
        the sliding-window and dynamic-rope checks read instead of ``max_seqlen``: that one bounds the attention
        kernels and counts a row's padding segment (under CUDA graphs it is the row length).
        input_ids, position_ids and labels / shift_labels are int64 or int32 (B, S); shapes and dtypes are checked
        first (host metadata only, no device sync; an attention_mask is read on the host). Targets must be in
        [0, V) or -100: others give a NaN loss.
        """
        check_forward_args(input_ids, labels, shift_labels, reduction, position_ids, attention_mask)
        if torch.is_autocast_enabled(input_ids.device.type):  # else errors from inside rope / attention on mixed dtypes
            raise RuntimeError("chronicals' decoder does not run under torch.autocast: its fused ops take one dtype; "
                               "load or move the model to it instead (chronicals.load_model(path, "
                               "dtype=torch.bfloat16) or model.to(torch.bfloat16)) and call it outside autocast")
        if attention_mask is not None:
            labels, shift_labels = mask_padding(attention_mask, labels, shift_labels, cu_seqlens=cu_seqlens,
                                                kv_caches=kv_caches, num_loss_tokens=num_loss_tokens)
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen, kv_caches, longest_doc)
        if labels is None and shift_labels is None:
            return self.lm_head(h)
        if shift_labels is None:
            shift_labels = shift_labels_per_document(labels, position_ids)
        h2, y = h.reshape(-1, h.shape[-1]), shift_labels.reshape(-1)
        if reduction != "none":
            h2, y = loss_rows(h2, y, num_loss_tokens)
        loss = linear_cross_entropy(h2, self.lm_head.weight, y, ignore_index=IGNORE_INDEX, reduction=reduction,
                                    impl=self.opts.impl, vocab_parts=self.opts.loss_vocab_parts)
        return loss.view(shift_labels.shape) if reduction == "none" else loss


class KVCache:
    """Keys and values of earlier steps for one layer, for generation of a single row."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def attend(self, q, k, v):
        """q (1, s, Hq, D), k/v (1, s, Hk, D): append, then attend causally over everything so far."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        if q.shape[1] == self.k.shape[1]:
            return attention_ref(q, self.k, self.v)
        if q.shape[1] != 1:
            raise ValueError("KVCache: after the prompt, feed one token at a time")
        qt, kt, vt = q.transpose(1, 2), self.k.transpose(1, 2), self.v.transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=qt.shape[1] != kt.shape[1])
        return out.transpose(1, 2)
