"""generate's context warnings and eos checks, and config readings (Qwen sliding windows left unset, a yarn ramp
at the last dimension, FLOPs per token), where a mutation walk found no test."""
from __future__ import annotations

import importlib
import json
import logging

import pytest
import torch

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.generate import generate, new_token_budget, stop_ids

generate_mod = importlib.import_module("chronicals.models.generate")  # the package's name is the function


def _model(tiny_hf_config, family="qwen3", **overrides) -> CausalLM:
    return CausalLM(ModelConfig.from_hf_dict(tiny_hf_config(family, **overrides))).init_weights(std=0.5, seed=0).eval()


def test_a_request_that_exactly_fills_the_context_is_not_warned_about(tiny_hf_config, caplog, monkeypatch):
    """A prompt + max_new_tokens == max_position_embeddings fits: no 'goes past the model's context' warning."""
    monkeypatch.setattr(generate_mod, "_warned", set())
    model = _model(tiny_hf_config)  # max_position_embeddings 128
    with caplog.at_level(logging.WARNING, logger="chronicals.generate"):
        assert new_token_budget(model, 100, 28) == 28
    assert "goes past" not in caplog.text


def test_a_prompt_that_fills_the_context_is_said_every_time(tiny_hf_config, caplog, monkeypatch):
    """The no-answer-at-all warning is per prompt (a chat loop's next prompt may fit), not once per process."""
    monkeypatch.setattr(generate_mod, "_warned", set())
    model = _model(tiny_hf_config)
    with caplog.at_level(logging.WARNING, logger="chronicals.generate"):
        for _ in range(2):
            assert new_token_budget(model, 128, 8) == 0
    assert caplog.text.count("the prompt alone fills the model's context") == 2


def test_the_past_context_warning_is_said_once_per_setting(tiny_hf_config, caplog, monkeypatch):
    """The 'goes past the model's context' warning is said once per process and (max_new_tokens, context), while the
    budget is cut every time (a chat loop asking the same max_new_tokens every turn is not warned every turn)."""
    monkeypatch.setattr(generate_mod, "_warned", set())
    model = _model(tiny_hf_config)  # max_position_embeddings 128
    with caplog.at_level(logging.WARNING, logger="chronicals.generate"):
        assert [new_token_budget(model, 100, 64) for _ in range(3)] == [28, 28, 28]
        assert new_token_budget(model, 100, 65) == 28  # another max_new_tokens: warned again
    assert caplog.text.count("goes past the model's context") == 2, caplog.text


@pytest.mark.parametrize("eos", [True, [2, False]])
def test_a_bool_eos_is_refused(tiny_hf_config, eos):
    """eos_token_id=True stopped at token 1 without a word (JSON/YAML true is no token id)."""
    model = _model(tiny_hf_config)
    with pytest.raises(ValueError, match="give a token id or a list of token ids"):
        generate(model, torch.tensor([5, 6, 7]), 2, eos_token_id=eos)


@pytest.mark.parametrize("eos", [2.5, "</s>", [4, "x"]])
def test_a_generation_config_eos_that_is_no_id_is_skipped(tiny_hf_config, eos):
    """generation_config.json's eos_token_id that is not an id or ids (a float, a string, a mixed list) is skipped,
    as an unreadable file is (transformers names that file when it loads it), leaving config.json's eos: a float
    raised a TypeError out of chat and eval."""
    model = _model(tiny_hf_config)
    model.config.eos_token_id = 3
    model.source_generation_config = json.dumps({"eos_token_id": eos}).encode()
    assert stop_ids(model, None) == {3}


def test_qwen_use_sliding_window_without_max_window_layers_takes_transformers_28():
    """Qwen use_sliding_window=true, no layer_types and no max_window_layers: transformers' default 28 >= 2 layers,
    so no layer slides (as transformers.Qwen2Config reads it)."""
    import transformers

    d = dict(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16)
    assert ModelConfig.from_hf_dict(d).sliding_window is None
    assert "sliding_attention" not in transformers.AutoConfig.for_model(**d).layer_types


def test_qwen_without_use_sliding_window_has_no_window():
    """Qwen use_sliding_window absent is transformers' False: no window, whatever sliding_window and
    max_window_layers say."""
    d = dict(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, sliding_window=16, max_window_layers=0)
    assert ModelConfig.from_hf_dict(d).sliding_window is None


def test_yarn_whose_ramp_reaches_the_last_dimension_matches_transformers():
    """Yarn: the ramp's upper end is clamped to dim - 1 as transformers clamps it (a small theta and a long original
    context put it past the last rotation)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from chronicals.models.config import rope_inv_freq

    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0, "original_max_position_embeddings": 65536,
            "beta_fast": 1000}
    d = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=56, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=262144, rope_parameters=rope)
    ours, attn = rope_inv_freq(ModelConfig.from_hf_dict(d))
    theirs, their_attn = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.for_model(**d), "cpu")
    assert torch.equal(ours, theirs.float()) and attn == their_attn


def test_flops_per_token_counts_causal_attention_once():
    """6 x matmul params + 12 * seq * q * layers / 2 (the causal half) - the MFU the trainer logs."""
    cfg = ModelConfig.from_hf_dict(dict(model_type="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    h, i, q, kv, L = 16, 32, 16, 8, 2
    matmul = L * (2 * h * q + 2 * h * kv + 3 * h * i) + 100 * h
    assert cfg.flops_per_token(64) == 6 * matmul + 6 * 64 * q * L


@pytest.mark.parametrize("window", [129, 4096])
def test_a_sliding_window_past_max_position_embeddings_leaves_that_limit(tiny_hf_config, monkeypatch, window):
    """A sliding window longer than max_position_embeddings (Mistral's default 4096 on a short model) leaves the
    context at max_position_embeddings: taking the window would decode past the positions the model was trained
    on, and the warning would name the wrong field."""
    monkeypatch.setattr(generate_mod, "_warned", set())
    model = _model(tiny_hf_config, "mistral", max_position_embeddings=128, sliding_window=window)
    assert generate_mod.context_length(model) == (128, "max_position_embeddings")
    assert new_token_budget(model, 120, 20) == 8
