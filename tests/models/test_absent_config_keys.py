"""config.json without num_key_value_heads or head_dim reads as transformers 5 reads it: each family's class
default (Mistral 8 kv heads, Qwen2 / Qwen3 32, Qwen3 head_dim 128), not heads or hidden / heads as Llama derives
them (such directories used to be refused with "config.json and the weights disagree")."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from chronicals.models import ModelConfig
from chronicals.models.config import rope_inv_freq
from chronicals.models.hf_io import load_hf_dir

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, max_position_embeddings=64)


@pytest.mark.parametrize("model_type,kw,dropped", [
    ("mistral", dict(num_attention_heads=16, num_key_value_heads=8), ("num_key_value_heads",)),
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=128), ("head_dim",)),
    ("qwen3", dict(num_attention_heads=64, num_key_value_heads=32, head_dim=128), ("head_dim", "num_key_value_heads")),
    ("qwen2", dict(num_attention_heads=32, num_key_value_heads=32), ("num_key_value_heads",)),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=4), ("num_key_value_heads", "head_dim")),
])
def test_a_key_left_out_takes_transformers_default(tmp_path, model_type, kw, dropped):
    cfg = transformers.AutoConfig.for_model(model_type, **BASE, **kw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    for k in dropped:
        d.pop(k, None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_hf_dir(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_default_that_does_not_fit_the_heads_says_which_key_is_missing():
    """14 heads and no num_key_value_heads in a Qwen2 config: transformers' default 32 does not divide 14; the
    error names the absent key rather than only the arithmetic."""
    d = dict(model_type="qwen2", **{**BASE, "hidden_size": 56}, num_attention_heads=14)
    with pytest.raises(ValueError, match="config.json has no num_key_value_heads .transformers' qwen2 default, 32"):
        ModelConfig.from_hf_dict(d)
    assert ModelConfig.from_hf_dict({**d, "num_key_value_heads": None}).num_key_value_heads == 14  # null: derived


@pytest.mark.parametrize("family", ["llama2", "mistral", "qwen2"])
def test_zero_kv_heads_and_head_dim_are_derived_like_null(tiny_hf_config, family):
    """num_key_value_heads and head_dim written as 0 mean "not set", as null does, even in families whose absent key
    takes a class default (gguf_io relies on it for a head_count_kv of 0): one kv head per head, head_dim = hidden /
    heads. Such configs were refused as "num_key_value_heads=0 must be an integer >= 1"."""
    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family, num_key_value_heads=0, head_dim=0))
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 32 // 4)


@pytest.mark.parametrize("family,max_pos", [("llama2", 2048), ("qwen2", 32768)])
def test_null_max_positions_and_attention_dropout_read_and_save_as_their_defaults(tiny_hf_config, family, max_pos):
    """max_position_embeddings and attention_dropout written as null read as an absent key does (the family's
    transformers default: Llama 2048, Qwen2 32768; 0.0) and are saved so. A kept null gave generation and evaluation
    no context limit, failed a llama3 rope (no original context: None / float), and saved an attention_dropout of
    null, which transformers passes to its attention as the dropout probability in training."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family, max_position_embeddings=None, attention_dropout=None,
                                                  rope_scaling=rope))
    assert cfg.max_position_embeddings == cfg.rope_scaling["original_max_position_embeddings"] == max_pos
    assert cfg.attention_dropout == 0.0 and isinstance(cfg.attention_dropout, float)
    saved = cfg.to_hf_dict()
    assert (saved["max_position_embeddings"], saved["attention_dropout"]) == (max_pos, 0.0)


def test_a_negative_attention_dropout_is_refused(tiny_hf_config):
    """A negative attention_dropout is no probability (transformers' training forward fails on it): it is refused
    naming the field, where the check for training with attention dropout (> 0) let it pass as "no dropout"."""
    with pytest.raises(ValueError, match=r"^config\.json: attention_dropout=-0\.1 must be a number >= 0; fix "
                                         r"config\.json"):
        ModelConfig.from_hf_dict(tiny_hf_config("llama2", attention_dropout=-0.1))


def test_yarn_mscale_without_mscale_all_dim_takes_the_default_attention_factor(tiny_hf_config):
    """A yarn rope with mscale but no mscale_all_dim takes the default attention factor 0.1 ln(factor) + 1, as
    transformers does (the mscale ratio needs both keys); reading the ratio when either key was set divided by
    _yarn_mscale(factor, None) and refused a config transformers loads."""
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 2048,
            "mscale": 0.707}
    d = tiny_hf_config("llama2", rope_parameters=rope, max_position_embeddings=8192)
    inv, attn = rope_inv_freq(ModelConfig.from_hf_dict(d))
    assert attn == 0.1 * math.log(4.0) + 1.0
    hf = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    want_inv, want_attn = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    assert attn == want_attn and torch.equal(inv, want_inv)


def test_a_saved_qwen2_config_has_no_attention_bias(tiny_hf_config):
    """transformers' Qwen2Config writes no attention_bias (Qwen2 has q/k/v biases whatever such a key says; a
    "attention_bias": false beside them misdescribes the model to other readers): a Qwen2 config.json that carried
    the key is saved without it, and saved again reads back the same."""
    d = ModelConfig.from_hf_dict(tiny_hf_config("qwen2", attention_bias=False)).to_hf_dict()
    assert "attention_bias" not in d
    assert ModelConfig.from_hf_dict(d).to_hf_dict() == d


def test_weights_that_do_not_fit_the_default_name_the_absent_key(tmp_path):
    """A Mistral checkpoint with 16 kv heads whose config.json lost num_key_value_heads: transformers reads 8 and
    so do we; the shape error says the key is absent and which default was used."""
    cfg = transformers.AutoConfig.for_model("mistral", **BASE, num_attention_heads=16, num_key_value_heads=16)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    del d["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="disagree; config.json has no num_key_value_heads .transformers' mistral "
                                         "default, 8, was used.: add the model's own value"):
        load_hf_dir(tmp_path)
