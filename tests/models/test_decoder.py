"""The decoder (models/decoder.py) on tiny configs: the rope frequencies stay exact float32 when the model is cast,
init_weights' values, and dynamic rope's position limit."""

from __future__ import annotations

import pytest
import torch

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.config import rope_inv_freq


def _cfg(**kw) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return ModelConfig(**{**base, **kw})


def test_inv_freq_stays_exact_fp32_when_the_model_is_cast_to_bf16():
    """In bf16 the fastest rotation would be ~4 rad off at position 1,000 (decoder._apply's comment)."""
    cfg = _cfg()
    model = CausalLM(cfg).to(torch.bfloat16)
    assert model.model.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.inv_freq, rope_inv_freq(cfg)[0])


def test_init_weights_sets_norms_to_one_biases_to_zero_and_matrices_to_the_std():
    cfg = _cfg(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, head_dim=16, qk_norm=True,
               qkv_bias=True)
    model = CausalLM(cfg).init_weights(std=0.02, seed=0)
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 5  # input / post-attention, q / k norms, the final norm
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert 0.015 < p.std().item() < 0.025, name


def test_dynamic_rope_refuses_positions_past_the_limit_by_one():
    """A full-length row whose positions start at 1 reaches position 8 with max_position_embeddings 8."""
    model = CausalLM(_cfg(vocab_size=17, max_position_embeddings=8,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})).init_weights(seed=0).eval()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        model(ids, position_ids=torch.arange(0, 8)[None])  # positions 0..7: within the limit
        with pytest.raises(ValueError, match=r"position_ids up to 8 \(9 positions\)"):
            model(ids, position_ids=torch.arange(1, 9)[None])
