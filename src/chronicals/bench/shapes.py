"""Model shapes the bench runs (random init: throughput does not depend on the weights' values).

Each shape is a plain Hugging Face ``config.json`` dict, so our ``ModelConfig.from_hf_dict`` and
transformers' ``AutoConfig.for_model`` build the same architecture from one source.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lora.inject import DEFAULT_TARGETS as LORA_TARGETS  # noqa: F401  (the 7 projections: every LoRA row's targets)
from ..train.metrics import matmul_params, train_flops_per_token  # noqa: F401  (one MFU formula for train and bench)


def _qwen2(hidden, inter, layers, heads, kv_heads, vocab=151936, tied=True) -> dict:
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": tied,
            "max_position_embeddings": 32768, "hidden_act": "silu", "use_sliding_window": False,
            "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 1}


def _llama(hidden, inter, layers, heads, kv_heads, vocab=128256) -> dict:
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 1}


@dataclass(frozen=True)
class Shape:
    """A named architecture plus the batch the protocol trains it with."""
    name: str
    hf_config: dict
    rows: int  # sequences per optimizer step
    seq: int  # tokens per sequence (no padding)
    methods: tuple[str, ...]  # "full" and/or "lora": what the default table runs at this shape
    note: str = ""


SHAPES: dict[str, Shape] = {
    # ANCHORS.md protocol: Qwen2.5-0.5B architecture, 16 x 1024 tokens per step.
    "0.5b": Shape("0.5b", _qwen2(896, 4864, 24, 14, 2), 16, 1024, ("full", "lora"), "Qwen2.5-0.5B architecture"),
    "1.5b": Shape("1.5b", _qwen2(1536, 8960, 28, 12, 2), 4, 2048, ("lora",), "Qwen2.5-1.5B architecture"),
    "3b": Shape("3b", _qwen2(2048, 11008, 36, 16, 2), 4, 2048, ("lora",), "Qwen2.5-3B architecture"),
    # ANCHORS.md second table: Llama-3-8B shape, LoRA r=32, 4 x 2048 tokens per step.
    "8b": Shape("8b", _llama(4096, 14336, 32, 32, 8), 4, 2048, ("lora",), "Llama-3-8B architecture"),
    # CPU tests: same code paths, a model that trains in milliseconds.
    "tiny": Shape("tiny", _qwen2(64, 128, 2, 4, 2, vocab=512), 2, 32, ("full", "lora"), "tiny Qwen2 for CPU tests"),
}


def get_shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}") from None


def model_config(shape: Shape):
    """Our ``ModelConfig`` for a shape."""
    from ..models import ModelConfig

    return ModelConfig.from_hf_dict(dict(shape.hf_config), source=f"bench shape {shape.name}")
