"""The decoder's configuration, read from (and written back to) a Hugging Face ``config.json``.

One dataclass serves every supported family; a family difference is a field (q/k/v bias for Qwen2,
per-head q/k norms for Qwen3, llama3 rope scaling for Llama 3.x), not a subclass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .._jsonio import read_json_object

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # SmolLM2 ships as "llama"
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_parameters minus rope_theta, e.g. {"rope_type": "llama3", ...}
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o bias (Llama option); Qwen2 sets qkv_bias instead
    qkv_bias: bool = False  # Qwen2/2.5: bias on q, k, v only
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # the window when at least one layer uses sliding-window attention (Mistral; Qwen2/3 with use_sliding_window),
    # else None; we attend over the full causal window, so longer rows are refused
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # the rest of config.json, written back unchanged

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if (self.qkv_bias or self.attention_bias) else 0)
        mlp = 3 * h * i
        layer = attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def flops_per_token(self, seqlen: int) -> float:
        """Training FLOPs per token: 6 x matmul params (lm_head included) + causal attention."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        matmul = self.num_hidden_layers * (2 * h * q + 2 * h * kv + 3 * h * i) + self.vocab_size * h
        attn = 3 * 4 * seqlen * q * self.num_hidden_layers / 2
        return 6 * matmul + attn

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object of model settings, found {type(d).__name__}; "
                             "copy config.json from the original model again")
        if "model_type" not in d:
            raise ValueError(f"{source}: missing field 'model_type' (expected one of {SUPPORTED_MODEL_TYPES})")
        mt = d["model_type"]
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type {mt!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3)")
        bad = _bad_field(d)
        if bad:
            raise ValueError(f"{source}: {bad}; fix config.json (copy it from the original model)")
        if not d.get("head_dim") and d.get("hidden_size") and d.get("num_attention_heads") \
                and d["hidden_size"] % d["num_attention_heads"]:
            raise ValueError(f"{source}: hidden_size={d['hidden_size']} is not a multiple of num_attention_heads="
                             f"{d['num_attention_heads']} and no head_dim is given; config.json is wrong, or "
                             "names head_dim under another key")
        try:
            heads = d["num_attention_heads"]
            rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
            known = {
                "model_type": mt, "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
                "intermediate_size": d["intermediate_size"], "num_hidden_layers": d["num_hidden_layers"],
                "num_attention_heads": heads, "num_key_value_heads": d.get("num_key_value_heads") or heads,
                "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
                "rms_norm_eps": d.get("rms_norm_eps", 1e-6), "rope_theta": float(theta), "rope_scaling": rope,
                "partial_rotary_factor": d.get("partial_rotary_factor", 1.0),
                "max_position_embeddings": d.get("max_position_embeddings", 4096),
                "tie_word_embeddings": d.get("tie_word_embeddings", False),
                "attention_bias": mt in ("llama", "qwen3") and d.get("attention_bias", False),
                "qkv_bias": mt == "qwen2", "mlp_bias": d.get("mlp_bias", False), "qk_norm": mt == "qwen3",
                "sliding_window": _sliding_window(d, mt),
                "bos_token_id": d.get("bos_token_id"), "eos_token_id": d.get("eos_token_id"),
                "pad_token_id": d.get("pad_token_id"),
            }
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r} needed to build a {mt} decoder") from None
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
        extra = {k: v for k, v in d.items() if k not in known and k not in ("rope_parameters", "rope_scaling")}
        if known["sliding_window"] is None and d.get("sliding_window") is not None:
            extra["sliding_window"] = d["sliding_window"]  # unused by every layer: written back unchanged
        try:
            cfg = cls(**known, extra=extra)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        try:  # the rope parameters are checked here, where the file is known, not at the first forward
            rope_inv_freq(cfg)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {e}; chronicals cannot load this model (its rotary positions would "
                             "differ from transformers')") from None
        except KeyError as e:
            raise ValueError(f"{source}: rope_parameters of rope_type {rope.get('rope_type', rope.get('type'))!r} "
                             f"lacks field {e.args[0]!r}") from None
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        missing = "a Hugging Face model directory needs one"
        if (Path(path).parent / "adapter_config.json").is_file():  # --model runs/x/adapter: the PEFT file beside it
            missing = ("this is a LoRA adapter (adapter_config.json), not a model: pass it as --adapter (chat, eval, "
                       "export; from Python chronicals.lora.load_adapter), with its base as the model")
        run = Path(path).parent  # --model runs/x: a training run's directory holds its model/ or adapter/
        if (run / "model" / "config.json").is_file():
            missing += f"; {run} holds one in its model folder: pass {run / 'model'}"
        elif (run / "adapter" / "adapter_config.json").is_file():
            missing += (f"; {run} is a run directory holding a LoRA adapter: pass --adapter {run / 'adapter'} (its "
                        "base is then the model)")
        d = read_json_object(path, "config.json", "copy config.json from the original model again", missing=missing)
        return cls.from_hf_dict(d, source=str(Path(path)))

    def to_hf_dict(self) -> dict:
        d = dict(self.extra)
        d.update({k: v for k, v in asdict(self).items()
                  if k not in ("extra", "rope_scaling", "qkv_bias", "qk_norm", "rope_theta", "sliding_window")})
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:  # an older config.json names the type "type": rope_type "default" then hid it
            rope.update(self.rope_scaling, rope_type=self.rope_scaling.get("rope_type", self.rope_scaling.get("type")))
        d["rope_parameters"] = rope
        d["rope_theta"] = self.rope_theta
        if self.model_type == "qwen2":
            d.pop("attention_bias", None)
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            d["sliding_window"] = self.sliding_window if self.sliding_window is not None else \
                self.extra.get("sliding_window")
        d["hidden_act"] = "silu"
        d["architectures"] = [_ARCH[self.model_type]]
        return d


# config.json fields whose type is checked before any is used: a string "false" is truthy, "32" is no size
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float, not a bool (JSON's and YAML's true would pass isinstance(v, int))."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad_field(d: dict) -> str | None:
    """What is wrong with the type or range of one of config.json's fields we use, or None. None (null) stands for
    "not set" where HF's configs allow it (num_key_value_heads, head_dim, sliding_window)."""
    for k in _POSITIVE_INTS:
        if k not in d:
            continue  # a required one missing is named by from_hf_dict
        v = d[k]
        if v is None and k in _OPTIONAL_INTS or v == 0 and k in ("num_key_value_heads", "head_dim"):
            continue  # not set: the default (heads; hidden_size / heads)
        if not (_is_int(v) and v >= 1):
            return f"{k}={v!r} must be an integer >= 1"
    for k in _BOOLS:
        v = d.get(k)
        if v is not None and not isinstance(v, bool):
            return f"{k}={v!r} must be true or false (a JSON boolean, not a string or number)"
    for k, lo in (("rms_norm_eps", 0.0), ("rope_theta", None), ("partial_rotary_factor", None)):
        v = d.get(k)
        if v is not None and not (is_number(v) and (v >= lo if lo is not None else v > 0)):
            return f"{k}={v!r} must be a number {'>= 0' if lo is not None else '> 0'}"
    for k in ("rope_parameters", "rope_scaling"):
        v = d.get(k)
        if v is None:
            continue
        if not isinstance(v, dict):
            return f"{k}={v!r} must be an object (such as {{\"rope_type\": \"linear\", \"factor\": 2.0}}) or null"
        for rk in _ROPE_NUMBERS:  # the ones rope_inv_freq reads (other rope types are refused there)
            rv = v.get(rk)
            if rv is not None and not (is_number(rv) and rv > 0):
                return f"{k}.{rk}={rv!r} must be a number > 0"
    prf = d.get("partial_rotary_factor")
    if prf is not None and prf > 1:
        return f"partial_rotary_factor={prf!r} must be in (0, 1]"
    return None


def _sliding_window(d: dict, model_type: str) -> int | None:
    """The window of a config.json when at least one layer attends through it, else None; as transformers does.

    Mistral: every layer when ``sliding_window`` is set (its ``layer_types`` is ignored). Qwen2/Qwen3: only with
    ``use_sliding_window``, and then the layers marked "sliding_attention" in ``layer_types``, or without that
    list the layers i >= ``max_window_layers`` (default 28), so use_sliding_window=true with max_window_layers >=
    num_hidden_layers (e.g. 28 of 28) has none. Llama has no sliding window."""
    window = d.get("sliding_window")
    if window is None or model_type == "llama":
        return None
    if model_type == "mistral":
        return window
    if not d.get("use_sliding_window", False):
        return None
    layer_types = d.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if d.get("max_window_layers", 28) < d["num_hidden_layers"] else None


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rotary_dim / 2,) fp32 and the attention scaling, computed exactly as
    transformers does (same fp32 ops, so logits match to the last bit). Rope types: default, linear, llama3.
    """
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv, 1.0
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"], 1.0
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < hi_wl) * ~(wavelen > lo_wl)
        return torch.where(medium, smoothed, out), 1.0
    raise ValueError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
