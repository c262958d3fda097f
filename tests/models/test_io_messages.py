"""Errors met while reading or writing models name the file the user gave and say what to do: an unsupported
rope type (config.json), a tokenizer without a chat template, a GGUF without tokenizer metadata, an output
path under a regular file."""

from __future__ import annotations

import json

import pytest
import transformers

import chronicals
from chronicals.models import CausalLM, ModelConfig
from chronicals.models.loading import load_tokenizer


def _save(tmp_path, tiny_hf_config, family="llama2", name="m"):
    cfg = tiny_hf_config(family)
    return chronicals.save_model(CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(seed=0), None, tmp_path / name)


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
     r"rope_type='longrope': .* supported: default, linear, llama3, yarn, dynamic; chronicals cannot load"),
    ({"rope_type": "llama3", "factor": 8.0}, r"rope_parameters of rope_type 'llama3' lacks field 'low_freq_factor'"),
])
def test_unsupported_rope_names_config_json(tmp_path, tiny_hf_config, rope, match):
    out = _save(tmp_path, tiny_hf_config)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{out / 'config.json'}: {match}"):
        chronicals.load_model(out, tokenizer=False)


def test_an_incomplete_rope_scaling_is_named_as_such(tiny_hf_config):
    """A config.json that sets rope_scaling (older transformers; "type" for rope_type) names that field."""
    d = tiny_hf_config("llama2", rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0})
    with pytest.raises(ValueError, match=r"^my/config\.json: rope_scaling of rope_type 'llama3' lacks field "
                                         r"'high_freq_factor'"):
        ModelConfig.from_hf_dict(d, source="my/config.json")


def _word_tokenizer():
    """A tokenizer built here (no hub): three words, no chat template."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "</s>": 1, "hi": 2}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                                eos_token="</s>")


def test_tokenizer_without_chat_template_names_the_model(tmp_path, tiny_hf_config):
    cfg = tiny_hf_config("llama2")
    out = chronicals.save_model(CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(seed=0), _word_tokenizer(),
                                tmp_path / "notemplate")
    model, tok = chronicals.load_model(out)
    assert tok.chronicals_source == str(out)
    with pytest.raises(ValueError, match=rf"{out}: the tokenizer has no chat template.*use a chat \(instruct\) "
                                         r"model.*chat_template\.jinja in a Hugging Face directory\)$"):
        chronicals.models.chat(model, tok, "hi", max_new_tokens=2)  # no "set data.format=text": chat trains nothing
    with pytest.raises(ValueError, match=r"directory\); or score text$"):  # the caller's own way around it
        chronicals.models.require_chat_template(tok, "or score text")
    tok.chat_template = ""  # blanked by an export: no template (taken as one, chat() failed in generate on 0 tokens)
    with pytest.raises(ValueError, match=rf"{out}: the tokenizer has no chat template"):
        chronicals.models.chat(model, tok, "hi", max_new_tokens=2)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    chronicals.models.require_chat_template(tok)  # a template: no complaint
    assert isinstance(chronicals.models.chat(model, tok, "hi", max_new_tokens=2), str)


@pytest.mark.parametrize("under", ["afile/sub", "afile/sub/deeper"])
def test_output_under_a_regular_file_says_so(tmp_path, tiny_hf_config, under):
    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("llama2"))).init_weights(seed=0)
    (tmp_path / "afile").write_text("a note")
    with pytest.raises(NotADirectoryError, match=rf"{tmp_path / 'afile'} is a file, not a directory, so "
                                                 rf"{tmp_path / under} cannot be created under it"):
        chronicals.save_model(model, None, tmp_path / under)
    assert (tmp_path / "afile").read_text() == "a note" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_missing_tokenizer_package_is_not_blamed_on_the_files(tmp_path, monkeypatch):
    """An ImportError from transformers (sentencepiece or protobuf not installed) reaches the user naming the
    package: wrapped as "the tokenizer files cannot be loaded ... copy them again", it blamed good files."""
    (tmp_path / "tokenizer_config.json").write_text("{}")

    def needs_sentencepiece(*a, **k):
        raise ImportError("this tokenizer requires the SentencePiece library: pip install sentencepiece")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", needs_sentencepiece)
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        load_tokenizer(tmp_path)
