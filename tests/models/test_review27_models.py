"""Behaviour that mutation testing (session 27) showed no test would notice breaking: packed labels, inv_freq after a
cast, init_weights, dynamic rope's position limit, config.json's top-level rope_theta, a stored rotary inv_freq."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.config import rope_inv_freq
from chronicals.models.decoder import shift_labels_per_document
from chronicals.models.hf_io import load_hf_dir, save_hf_dir


def _cfg(**kw) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return ModelConfig(**{**base, **kw})


def test_the_last_token_of_each_packed_document_predicts_nothing():
    labels = torch.tensor([[10, 11, 12, 20, 21, 22]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert shift_labels_per_document(labels, pos).tolist() == [[11, 12, -100, 21, 22, -100]]


def test_a_packed_rows_loss_with_labels_is_the_sum_of_its_documents_losses():
    model = CausalLM(_cfg()).init_weights(seed=0).eval()
    a, b = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[7, 8, 9]])
    ids = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=4, labels=ids, reduction="sum")
        apart = model(a, labels=a, reduction="sum") + model(b, labels=b, reduction="sum")
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)


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


def test_config_json_has_rope_theta_at_the_top_level_too():
    """transformers 4.x (and converters that read it there) fall back to 10,000 without it: another model for
    Qwen's 1e6."""
    d = _cfg(model_type="qwen2", vocab_size=17, rope_theta=1e6, qkv_bias=True).to_hf_dict()
    assert d["rope_theta"] == 1e6 and d["rope_parameters"]["rope_theta"] == 1e6


def test_a_checkpoint_that_stores_rotary_inv_freq_loads(tmp_path):
    """Older Llama checkpoints store one per layer; they are recomputed, not refused as unexpected tensors."""
    model = CausalLM(_cfg(vocab_size=17)).init_weights(seed=0).eval()
    out = save_hf_dir(model, None, tmp_path / "m")
    sd = load_file(str(out / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(load_hf_dir(out)(ids), model(ids))
