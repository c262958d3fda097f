"""The decoder (models/decoder.py) on tiny configs: the rope frequencies stay exact float32 when the model is cast,
init_weights' values, dynamic rope's position limit, gate_up_layers' type, and KV caches under checkpointing."""

from __future__ import annotations

import pytest
import torch

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.config import rope_inv_freq
from chronicals.models.decoder import KVCache, RuntimeOptions, check_gate_up_layers


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


@pytest.mark.parametrize("std", [0.02, 0.5])
def test_init_weights_sets_norms_to_one_biases_to_zero_and_matrices_to_the_std(std):
    """Matrices and embeddings get the std asked for (a fixed 0.02 passed at the default std alone)."""
    cfg = _cfg(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, head_dim=16, qk_norm=True,
               qkv_bias=True)
    model = CausalLM(cfg).init_weights(std=std, seed=0)
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 5  # input / post-attention, q / k norms, the final norm
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert 0.75 * std < p.std().item() < 1.25 * std, (name, p.std().item())


def test_dynamic_rope_refuses_positions_past_the_limit_by_one():
    """A full-length row whose positions start at 1 reaches position 8 with max_position_embeddings 8."""
    model = CausalLM(_cfg(vocab_size=17, max_position_embeddings=8,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})).init_weights(seed=0).eval()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        model(ids, position_ids=torch.arange(0, 8)[None])  # positions 0..7: within the limit
        with pytest.raises(ValueError, match=r"position_ids up to 8 \(9 positions\)"):
            model(ids, position_ids=torch.arange(1, 9)[None])
        empty = torch.zeros(1, 0, dtype=torch.long)  # no position to take the largest of
        assert model(empty, position_ids=empty).shape == (1, 0, 17)


@pytest.mark.parametrize("k", [True, False])
def test_gate_up_layers_refuses_a_bool(k):
    """gate_up_layers is a layer count: True is the int 1 in Python, so ``gate_up_layers: true`` (meant as "on")
    silently limited the gate_up recompute to the first layer."""
    with pytest.raises(ValueError, match=rf"gate_up_layers={k}: use a layer count k >= 0"):
        check_gate_up_layers(k, ("gate_up",))
    with pytest.raises(ValueError, match=rf"gate_up_layers={k}: use a layer count"):
        RuntimeOptions(recompute=("gate_up",), gate_up_layers=k)
    with pytest.raises(ValueError, match=rf"gate_up_layers={k}: use a layer count"):
        CausalLM(_cfg()).set_recompute(("gate_up",), gate_up_layers=k)
    assert check_gate_up_layers(1, ("gate_up",)) == 1


@pytest.mark.parametrize("train", [False, True], ids=["eval-no-grad", "train-grad"])
def test_a_forward_with_kv_caches_fills_every_layers_cache_under_checkpointing(train):
    """A checkpointed layer takes no cache, so checkpointing must not apply to a forward with kv_caches: with
    set_checkpointing(True), a prompt forward fills every layer's KVCache and the next decode step's logits equal
    those with checkpointing off, in eval / no grad (generation) and in train mode with grad. A train-mode forward
    with grad checkpointed its first layers anyway: they attended over the new tokens alone and left their caches
    empty, silently."""
    model = CausalLM(_cfg(num_hidden_layers=2)).init_weights(std=0.5, seed=0).train(train)
    ids = torch.randint(0, 31, (1, 7), generator=torch.Generator().manual_seed(0))

    def next_step_logits(checkpointing):
        model.set_checkpointing(checkpointing)
        caches = [KVCache() for _ in model.model.layers]
        with torch.set_grad_enabled(train):
            model(ids[:, :6], kv_caches=caches)
            assert [c.length for c in caches] == [6, 6], checkpointing
            return model(ids[:, 6:], kv_caches=caches).detach()

    torch.testing.assert_close(next_step_logits(True), next_step_logits(False), rtol=0, atol=0)


@pytest.mark.parametrize("setting,layers", [(True, 3), (False, 0), (0, 0), (2, 2), (3, 3), (9, 3)])
def test_checkpointing_counts_the_leading_layers_up_to_the_models(setting, layers):
    assert RuntimeOptions(checkpointing=setting).checkpointed_layers(3) == layers


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None])
def test_set_checkpointing_refuses_what_is_not_a_layer_count_when_set(bad):
    """At the call, not at the next training step's forward, and the setting before it stays."""
    model = CausalLM(_cfg(num_hidden_layers=2)).set_checkpointing(1)
    with pytest.raises(ValueError, match=rf"checkpointing={bad!r}: use True \(every layer\), False, or a layer count"):
        model.set_checkpointing(bad)
    assert model.opts.checkpointing == 1
