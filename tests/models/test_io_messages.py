"""Errors met while reading or writing models name the file the user gave and say what to do: an unsupported
rope type (config.json), a tokenizer without a chat template, a GGUF without tokenizer metadata, an output
path under a regular file."""

from __future__ import annotations

import json

import pytest

import chronicals
from chronicals.models import CausalLM, ModelConfig


def _save(tmp_path, tiny_hf_config, family="llama2", name="m"):
    cfg = tiny_hf_config(family)
    return chronicals.save_model(CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(seed=0), None, tmp_path / name)


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     r"rope type 'yarn' is not supported \(supported: default, linear, llama3\); chronicals cannot load"),
    ({"rope_type": "llama3", "factor": 8.0}, r"rope_parameters of rope_type 'llama3' lacks field 'low_freq_factor'"),
])
def test_unsupported_rope_names_config_json(tmp_path, tiny_hf_config, rope, match):
    out = _save(tmp_path, tiny_hf_config)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{out / 'config.json'}: {match}"):
        chronicals.load_model(out, tokenizer=False)
