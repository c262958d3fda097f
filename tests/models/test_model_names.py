"""How a model is named: dtype names with torch's prefix, relative paths recorded absolute, short names in any case,
and two equal names that point at no file."""

from __future__ import annotations

import os

import torch

import chronicals
from chronicals.models.loading import _check_dtype, recorded_name, resolve_path, same_model
from chronicals.train.resume import _adapter_diffs


def test_a_dtype_name_with_or_without_torch_prefix_is_taken():
    """``str(torch.bfloat16)`` is "torch.bfloat16", as configs written from Python hold it; float64 is a weight
    dtype too."""
    assert _check_dtype("torch.bfloat16") is torch.bfloat16
    assert _check_dtype(str(torch.float16)) is torch.float16
    assert _check_dtype("float64") is torch.float64


def test_a_relative_model_path_is_recorded_absolute(tmp_path, monkeypatch, tiny_hf_config):
    """A model loaded by a relative path records it absolute (``model.chronicals_base``, what an adapter saved from
    it names as its base), so an adapter exported from another directory names a base that is there."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**tiny_hf_config("llama2"))
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    assert recorded_name("base") == str((tmp_path / "base").resolve())
    assert recorded_name("~/../nonexistent-xyz") == "~/../nonexistent-xyz"  # a missing path: as given
    assert recorded_name("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    model, _ = chronicals.load_model("base", tokenizer=False)
    assert model.chronicals_base == str((tmp_path / "base").resolve())
    assert os.path.isabs(model.chronicals_base)


def test_equal_short_names_and_missing_paths_are_one_model():
    """Two equal strings that name no file (a short name, the default model; a path on another machine) are one
    model: comparing files only made them differ."""
    assert same_model("smollm2-135m-instruct", "smollm2-135m-instruct")
    assert same_model("/nowhere/base", "/nowhere/base")


def test_a_lora_checkpoint_on_the_embedded_model_resumes_on_it(tmp_path):
    """Otherwise a LoRA run on the default model could not resume: "model.path='smollm2-135m-instruct' (this run:
    'smollm2-135m-instruct')"."""
    cfg = {"lora": {"enabled": True, "rank": 4}, "model": {"path": "smollm2-135m-instruct"}}
    lora, diffs = _adapter_diffs(cfg, cfg, tmp_path / "step-1")
    assert lora and diffs == []


def test_a_short_name_in_the_models_own_spelling_resolves():
    """A short name is taken in any case ("SmolLM2-135M-Instruct", as the model card spells it)."""
    assert resolve_path("SmolLM2-135M-Instruct") == resolve_path("smollm2-135m-instruct")
    assert resolve_path("SmolLM2-135M-Instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
