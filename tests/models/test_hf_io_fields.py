"""What save_model writes besides the weights, which the round trips of test_checkpoint_io.py never read:
config.json's dtype (transformers' dtype="auto" follows it) and top-level rope_theta, the shard index's total_size,
and file modes."""

from __future__ import annotations

import json
import os

import torch
import transformers
from safetensors import safe_open
from test_decoder import _cfg

import chronicals
from chronicals.models import CausalLM, ModelConfig


def _model(cfg: dict, dtype=torch.float32) -> CausalLM:
    return CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(std=0.2, seed=0).to(dtype).eval()


def test_config_names_the_saved_dtype_and_transformers_loads_it(tmp_path, tiny_hf_config):
    """A bf16 model is saved with dtype "bfloat16" in config.json, so transformers' dtype="auto" loads it in
    bf16 (not fp32 at twice the memory)."""
    out = chronicals.save_model(_model(tiny_hf_config("qwen2"), torch.bfloat16), None, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").dtype == torch.bfloat16


def test_config_dtype_follows_the_embedding_not_the_norms(tmp_path, tiny_hf_config):
    """A bf16 model whose norms were kept in fp32 is written with dtype "bfloat16", the embedding's dtype that
    load_model's dtype=None and transformers read; taken from the final norm it said "float32"."""
    model = _model(tiny_hf_config("llama2"), torch.bfloat16)
    model.model.norm.float()
    out = chronicals.save_model(model, None, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_shard_index_total_size_is_the_bytes_of_every_tensor(tmp_path, tiny_hf_config):
    """model.safetensors.index.json's metadata.total_size is the byte count of all tensors over the shards, as
    transformers writes it (tools read it to size downloads and memory)."""
    out = chronicals.save_model(_model(tiny_hf_config("llama3"), torch.bfloat16), None, tmp_path / "m",
                                max_shard_bytes=10_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(out / shard, "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert len(set(index["weight_map"].values())) >= 2
    assert index["metadata"]["total_size"] == total > 0


class _TokenizerWithFolder:
    def save_pretrained(self, d):  # what transformers 5 writes for named chat templates
        os.mkdir(os.path.join(d, "additional_chat_templates"))
        with open(os.path.join(d, "additional_chat_templates", "tool_use.jinja"), "w") as f:
            f.write("{{ messages }}")
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            f.write("{}")


def test_saved_files_are_world_readable_under_a_strict_umask(tmp_path, tiny_hf_config):
    """Under umask 077 (some writers create 0600 files) the saved directory and the folders in it (a tokenizer's
    additional_chat_templates/, once 0700) are 0755 and every file 0644, so a model saved on a shared machine can
    be read by other users."""
    old = os.umask(0o077)
    try:
        out = chronicals.save_model(_model(tiny_hf_config("llama2")), _TokenizerWithFolder(), tmp_path / "m",
                                    max_shard_bytes=20_000)
    finally:
        os.umask(old)
    modes = {str(f.relative_to(out)): oct(f.stat().st_mode & 0o777) for f in out.rglob("*")}
    assert len(modes) >= 5 and "additional_chat_templates/tool_use.jinja" in modes
    assert modes == {name: "0o755" if (out / name).is_dir() else "0o644" for name in modes}
    assert oct(out.stat().st_mode & 0o777) == "0o755"


def test_saved_safetensors_files_say_format_pt(tmp_path, tiny_hf_config):
    """model.safetensors carries metadata {"format": "pt"}, as transformers' save_pretrained writes it: transformers
    4.x and other safetensors readers look for it (tests/lora/test_peft.py checks the adapter's file)."""
    out = chronicals.save_model(_model(tiny_hf_config("llama2")), None, tmp_path / "m")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_rope_scaling_named_by_the_older_type_key_survives_save(tmp_path, tiny_hf_config):
    """A config.json from before rope_type ({"type": "linear", "factor": 4.0}) was saved as rope_parameters
    {"rope_type": "default", "type": "linear", ...}: transformers and load_model both read "default", so the
    saved model lost its rope scaling (logits off by more than their size past the first positions)."""
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model = _model(tiny_hf_config("llama2", rope_scaling=scaling))
    out = chronicals.save_model(model, None, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    ids = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(0))
    again, _ = chronicals.load_model(out, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(again(ids), want)
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_config_json_has_rope_theta_at_the_top_level_too():
    """transformers 4.x (and converters that read it there) fall back to 10,000 without it: another model for
    Qwen's 1e6."""
    d = _cfg(model_type="qwen2", vocab_size=17, rope_theta=1e6, qkv_bias=True).to_hf_dict()
    assert d["rope_theta"] == 1e6 and d["rope_parameters"]["rope_theta"] == 1e6


def test_rope_parameters_per_layer_type_are_refused_not_read_as_plain_rope():
    """transformers 5's nested form ({"full_attention": {...}}) was read as plain rope with theta 10,000: its
    theta of 1e6 and any scaling were lost without a word (an architecture walk). Refused, naming the field."""
    import pytest

    d = dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             layer_types=["full_attention"] * 2,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"my/config.json: rope_parameters holds rope parameters per layer type "
                                         r"\('full_attention'\)"):
        ModelConfig.from_hf_dict(d, source="my/config.json")


def test_num_params_counts_every_bias():
    """The o_proj bias (Llama's attention_bias) and the MLP biases (mlp_bias) were left out of the count."""
    for extra in ({}, dict(attention_bias=True), dict(mlp_bias=True), dict(attention_bias=True, mlp_bias=True)):
        d = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)
        cfg = ModelConfig.from_hf_dict(d)
        assert cfg.num_params() == sum(p.numel() for p in CausalLM(cfg).parameters()), extra
    q = ModelConfig.from_hf_dict(dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert q.num_params() == sum(p.numel() for p in CausalLM(q).parameters())


def test_num_params_counts_tied_embeddings_once_and_qwen3_qk_norms():
    """A tied model's embedding and head are one matrix, counted once; Qwen3's q and k RMSNorms are counted."""
    for mt, tied in (("llama", True), ("qwen3", False), ("qwen3", True)):
        cfg = ModelConfig.from_hf_dict(dict(model_type=mt, vocab_size=300, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, tie_word_embeddings=tied))
        assert cfg.num_params() == sum(p.numel() for p in CausalLM(cfg).parameters()), (mt, tied)
