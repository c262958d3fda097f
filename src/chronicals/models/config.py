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
from .._numbers import is_int, is_number

# written by gguf_io into each conversion-cache entry (gguf_cache.CACHE_ENTRY): the directory is our GGUF conversion
GGUF_CONVERSION_RECORD = "gguf_cache_entry.json"

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
    mlp_bias: bool = False  # Llama option; transformers' Mistral/Qwen2/Qwen3 MLPs have none whatever config.json says
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # the window when at least one layer uses sliding-window attention (Mistral; Qwen2/3 with use_sliding_window),
    # else None; we attend over the full causal window, so longer rows are refused
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # transformers applies it to the attention probabilities in training; we have no attention dropout, so a
    # training forward with it > 0 is refused (eval / generation equal transformers' either way)
    attention_dropout: float = 0.0
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
        attn += h if self.attention_bias else 0  # o_proj's bias (Llama's attention_bias; Qwen2's qkv_bias has none)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
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
            fix = ("the file's metadata is damaged (the HF name of its field is given): convert the model again "
                   "with llama.cpp's convert_hf_to_gguf.py" if str(source).lower().endswith(".gguf")
                   else "fix config.json (copy it from the original model)")
            raise ValueError(f"{source}: {bad}; {fix}")
        if not _absent_default(d, mt, "head_dim") and d.get("hidden_size") and d.get("num_attention_heads") \
                and d["hidden_size"] % d["num_attention_heads"]:
            raise ValueError(f"{source}: hidden_size={d['hidden_size']} is not a multiple of num_attention_heads="
                             f"{d['num_attention_heads']} and no head_dim is given; config.json is wrong, or "
                             "names head_dim under another key")
        try:
            heads = d["num_attention_heads"]
            max_pos = d.get("max_position_embeddings") or _MAX_POSITIONS[mt]
            rope, theta = _rope_dict(d, max_pos, source)
            known = {
                "model_type": mt, "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
                "intermediate_size": d["intermediate_size"], "num_hidden_layers": d["num_hidden_layers"],
                "num_attention_heads": heads,
                "num_key_value_heads": _absent_default(d, mt, "num_key_value_heads") or heads,
                "head_dim": _absent_default(d, mt, "head_dim") or d["hidden_size"] // heads,
                "rms_norm_eps": d.get("rms_norm_eps", 1e-6), "rope_theta": float(theta), "rope_scaling": rope,
                "partial_rotary_factor": d.get("partial_rotary_factor", 1.0),
                "max_position_embeddings": max_pos,
                "tie_word_embeddings": d.get("tie_word_embeddings", False),
                "attention_bias": mt in ("llama", "qwen3") and d.get("attention_bias", False),
                "qkv_bias": mt == "qwen2", "mlp_bias": mt == "llama" and d.get("mlp_bias", False),
                "qk_norm": mt == "qwen3",
                "sliding_window": _sliding_window(d, mt),
                "bos_token_id": d.get("bos_token_id"), "eos_token_id": d.get("eos_token_id"),
                "pad_token_id": d.get("pad_token_id"), "attention_dropout": d.get("attention_dropout") or 0.0,
            }
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r} needed to build a {mt} decoder") from None
        act = d.get("hidden_act", "silu")
        if act not in _SILU_NAMES:
            raise ValueError(f"{source}: hidden_act={act!r}: chronicals' MLP computes silu(gate) * up (SwiGLU) and "
                             f"no other activation, so this {mt} model's MLP cannot run here; hidden_act must be "
                             "'silu' (or its alias 'swish'). Use transformers for this model")
        extra = {k: v for k, v in d.items() if k not in known and k not in ("rope_parameters", "rope_scaling")}
        if known["sliding_window"] is None and d.get("sliding_window") is not None:
            extra["sliding_window"] = d["sliding_window"]  # unused by every layer: written back unchanged
        try:
            cfg = cls(**known, extra=extra)
        except ValueError as e:
            raise ValueError(f"{source}: {e}{absent_defaults_note(d)}") from None
        try:  # the rope parameters are checked here, where the file is known, not at the first forward
            rope_inv_freq(cfg)
        except (ValueError, TypeError, ZeroDivisionError) as e:
            raise ValueError(f"{source}: {e}; chronicals cannot load this model (its rotary positions would "
                             "differ from transformers')") from None
        except KeyError as e:
            key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
            raise ValueError(f"{source}: {key} of rope_type {rope.get('rope_type', rope.get('type'))!r} lacks field "
                             f"{e.args[0]!r}; copy config.json from the original model again") from None
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
        elif (run / "state.pt").is_file():  # load_model(runs/x/checkpoints/step-N)
            missing = (f"{run} is a training checkpoint (state.pt), not a model directory: a full fine-tuning run's "
                       "loads with chronicals.train.load_checkpoint_model (on the command line: --model), a LoRA "
                       "run's is an adapter (--adapter)")
        elif steps := sorted(run.glob("step-*/state.pt")):  # --model runs/x/checkpoints
            missing += (f"; {run} holds a run's training checkpoints: pass one, e.g. {steps[-1].parent} (a full "
                        "fine-tuning run's as --model, a LoRA run's as --adapter)")
        d = read_json_object(path, "config.json", "copy config.json from the original model again", missing=missing)
        cfg = cls.from_hf_dict(d, source=str(Path(path)))
        prf = hf_partial_rotary_factor(d)
        # from_hf_dict builds it; transformers does not. A GGUF file with rope.dimension_count < head_dim converts to
        # such a config (gguf_io lays its rows out for our rotation), and its cache entry says so.
        converted = (Path(path).parent / GGUF_CONVERSION_RECORD).is_file()
        if prf is not None and prf != 1 and not converted:
            raise ValueError(
                f"{path}: partial_rotary_factor={prf!r}, but transformers' {cfg.model_type} code has no partial "
                f"rotary: with plain rope it rotates all head_dim={cfg.head_dim} dims (ignoring the field), with a "
                "scaled rope type it fails, so it is unclear which model these weights are. If the model was trained "
                "with full rotary embeddings (what transformers computes), remove partial_rotary_factor from "
                "config.json; a directory converted from a GGUF file with partial rope loads through "
                "load_model('<that file>.gguf')")
        return cfg

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


# transformers' defaults where config.json has no max_position_embeddings (LlamaConfig, MistralConfig, Qwen2Config,
# Qwen3Config): dynamic rope and yarn without a factor read it
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
# transformers' class defaults where config.json has no such key (MistralConfig, Qwen2Config, Qwen3Config in
# transformers 5): not hidden / heads or heads, as Llama derives them. A key written as null (or 0) is derived.
_ABSENT_DEFAULTS = {"mistral": {"num_key_value_heads": 8}, "qwen2": {"num_key_value_heads": 32},
                    "qwen3": {"num_key_value_heads": 32, "head_dim": 128}}


def _absent_default(d: dict, model_type: str, key: str):
    """config.json's value of ``key``; where the key is absent, transformers' default for the family (None: derive)."""
    return d[key] if key in d else _ABSENT_DEFAULTS.get(model_type, {}).get(key)


def absent_defaults_note(d: dict) -> str:
    """For an error about shapes: which of config.json's keys were absent and took transformers' family default
    (a Mistral config without num_key_value_heads has 8, as transformers reads it); '' when none was."""
    taken = [f"{k} (transformers' {d.get('model_type')} default, {v}, was used)"
             for k, v in _ABSENT_DEFAULTS.get(d.get("model_type"), {}).items() if k not in d]
    return f"; config.json has no {' and no '.join(taken)}: add the model's own value" if taken else ""


_SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN maps both to nn.SiLU
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def _rope_dict(d: dict, max_pos: int, source: str = "config.json") -> tuple[dict | None, float]:
    """config.json -> (rope parameters without rope_theta, or None for plain rope; rope_theta), read as
    transformers 5 does: ``rope_scaling`` wins over ``rope_parameters`` when both are set, ``rope_type`` over the
    older ``type``, a ``rope_theta`` inside the dict over the top-level one; llama3 / yarn / longrope take
    ``original_max_position_embeddings`` from the top level when it is there, else from the dict, else
    max_position_embeddings."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:  # transformers 5's per-layer-type form; read as plain rope it lost its theta and scaling
        field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        raise ValueError(f"{source}: {field} holds rope parameters per layer type ({', '.join(map(repr, nested))}): "
                         "chronicals computes one rope for every layer; give the one set of parameters directly "
                         f"(e.g. {field}={{\"rope_type\": \"default\", \"rope_theta\": ...}})")
    theta = rope.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta") or 10000.0
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("llama3", "yarn", "longrope"):
        if d.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", max_pos)
    return (None if kind == "default" else rope), theta


def hf_partial_rotary_factor(d: dict) -> float | None:
    """The partial_rotary_factor of a config.json, top level or inside its rope parameters (where transformers 5
    writes it), or None."""
    rope = d.get("rope_scaling") or d.get("rope_parameters")
    inner = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return inner if inner is not None else d.get("partial_rotary_factor")


# config.json fields whose type is checked before any is used: a string "false" is truthy, "32" is no size
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def _bad_field(d: dict) -> str | None:
    """What is wrong with the type or range of one of config.json's fields we use, or None. None (null) stands for
    "not set" where HF's configs allow it (num_key_value_heads, head_dim, sliding_window)."""
    for k in _POSITIVE_INTS:
        if k not in d:
            continue  # a required one missing is named by from_hf_dict
        v = d[k]
        if v is None and k in _OPTIONAL_INTS or v == 0 and k in ("num_key_value_heads", "head_dim"):
            continue  # not set: the default (heads; hidden_size / heads)
        if not (is_int(v) and v >= 1):
            return f"{k}={v!r} must be an integer >= 1"
    for k in _BOOLS:
        v = d.get(k)
        if v is not None and not isinstance(v, bool):
            return f"{k}={v!r} must be true or false (a JSON boolean, not a string or number)"
    # read only to place a sliding window (use_sliding_window without layer_types: see _sliding_window)
    if (d.get("use_sliding_window") and d.get("layer_types") is None and "max_window_layers" in d
            and not (is_int(d["max_window_layers"]) and d["max_window_layers"] >= 0)):
        return f"max_window_layers={d['max_window_layers']!r} must be an integer >= 0"
    for k, lo in (("rms_norm_eps", 0.0), ("rope_theta", None), ("partial_rotary_factor", None),
                  ("attention_dropout", 0.0)):
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
    num_hidden_layers (e.g. 28 of 28) has none. Llama has no sliding window. A config.json without the key gets
    transformers' default window, 4096 (MistralConfig, Qwen2Config, Qwen3Config); null means none."""
    window = d.get("sliding_window", 4096)
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
    """Inverse frequencies (rotary_dim / 2,) fp32 and the attention scaling (cos and sin are multiplied by it),
    computed exactly as transformers does (same fp32 ops, so logits match to the last bit). Rope types: default,
    linear, llama3, yarn, and dynamic (NTK) within max_position_embeddings, where transformers' dynamic rope
    equals the plain one; ``CausalLM`` refuses longer sequences, for which transformers rescales per batch.
    """
    dim, theta = cfg.rotary_dim, cfg.rope_theta
    rs = cfg.rope_scaling
    kind = rs.get("rope_type", rs.get("type")) if rs else "default"
    if kind == "dynamic":  # transformers' init at seq_len = max_position_embeddings: the base times 1.0 ** x
        factor, n = rs["factor"], cfg.max_position_embeddings
        theta = theta * ((factor * n / n) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind in ("default", "dynamic"):
        return inv, 1.0
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
    if kind == "yarn":
        return _yarn_inv_freq(rs, dim, theta, cfg.max_position_embeddings)
    fix = ("rope type 'longrope' switches between two frequency sets at original_max_position_embeddings (Phi-3 "
           "style), which chronicals does not implement" if kind == "longrope" else "no such rope type is known")
    raise ValueError(f"rope_type={kind!r}: {fix}; supported: {', '.join(ROPE_TYPES)}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rs: dict, dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): the fast rotations (more than beta_fast turns over the original context) are kept,
    the slow ones (under beta_slow turns) divided by ``factor``, a linear ramp between; cos and sin are scaled by
    0.1 ln(factor) + 1 unless ``attention_factor`` (or mscale / mscale_all_dim) says otherwise."""
    old = rs["original_max_position_embeddings"]
    factor = rs.get("factor")
    if factor is None:  # transformers: the context extension max_position_embeddings / original
        factor = max_pos / old
    attn = rs.get("attention_factor")
    if attn is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)) if mscale and mscale_all
                else _yarn_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(turns):  # the (fractional) dimension index whose wavelength fits ``turns`` times into ``old``
        return (dim * math.log(old / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (dim / 2,)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor (interpolation)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, attn
