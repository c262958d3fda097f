"""How a model is named: dtype names with torch's prefix, relative paths recorded absolute, short names in any case
(and only short names), two equal names that point at no file, and the source a GGUF's tokenizer names."""

from __future__ import annotations

import os

import pytest
import torch
from test_gguf_metadata import hf_model, write_gguf
from test_gguf_tokenizer import _SPM_TOKENS, _spm_tokenizer_metadata

import chronicals
from chronicals.models.loading import _check_dtype, recorded_name, require_chat_template, resolve_path, same_model
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
    assert recorded_name("base/../base") == str((tmp_path / "base").resolve())  # one spelling per directory
    assert recorded_name("~/../nonexistent-xyz") == "~/../nonexistent-xyz"  # a missing path: as given
    # a short name stays as it is, even beside a folder of its name (load_model takes the short name first: the
    # folder's absolute path was recorded as the base of a model that is the embedded one)
    for name in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct"):  # the short name in any case
        (tmp_path / name).mkdir()
        assert recorded_name(name) == name
    model, _ = chronicals.load_model("base", tokenizer=False)
    assert model.chronicals_base == str((tmp_path / "base").resolve())
    assert os.path.isabs(model.chronicals_base)


def test_equal_short_names_and_missing_paths_are_one_model():
    """Two equal strings that name no file (a short name, the default model; a path on another machine) are one
    model: comparing files only made them differ."""
    assert same_model("smollm2-135m-instruct", "smollm2-135m-instruct")
    assert same_model("/nowhere/base", "/nowhere/base")


def test_paths_that_differ_in_case_are_two_models(tmp_path):
    """Only a short name is taken in any case: /models/Llama and /models/llama are two models on a case-sensitive
    file system, so a resume or --adapter onto one from a run of the other is not waved through as the same base."""
    (tmp_path / "llama").mkdir()
    (tmp_path / "Llama").mkdir()
    assert not same_model(str(tmp_path / "llama"), str(tmp_path / "Llama"))
    assert not same_model("/nowhere/Model", "/nowhere/model")  # neither exists: still two names
    assert same_model("SmolLM2-135M-Instruct", "smollm2-135m-instruct")


def test_a_tilde_path_and_its_absolute_path_are_one_model(tmp_path, monkeypatch):
    """"~/base" and its absolute path name one model: without expanding ~ the first named no file, so a resume or
    --adapter check called the same base a different model."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "base").mkdir()
    assert same_model("~/base", str(tmp_path / "base"))
    assert not same_model("~/base", str(tmp_path / "other"))


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


@pytest.mark.parametrize("name", ["x.gguf", "x.GGUF"])
def test_a_gguf_suffix_in_any_case_is_a_gguf(tmp_path, name):
    """A truncated "x.GGUF" gets the GGUF reader's "truncated or corrupt, copy it again", as "x.gguf" does:
    with the suffix compared case-sensitively it was refused as neither a model directory nor a .gguf file,
    which hid the real cause."""
    p = tmp_path / name
    p.write_bytes(b"GGU")  # a download cut after three bytes: not even the magic is whole
    assert resolve_path(p) == p
    with pytest.raises(ValueError, match=r"not a readable GGUF file .*truncated or corrupt, copy it again"):
        chronicals.load_model(p)


def test_the_tokenizer_of_a_gguf_names_the_gguf_as_its_source(tmp_path):
    """load_model(x.gguf) loads the tokenizer from the path given, so its chronicals_source, which later errors name,
    is the .gguf file the user passed, not the conversion cache's directory."""
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "base.gguf"
    write_gguf(path, "llama", m, extra=_spm_tokenizer_metadata)  # no chat template
    _, tok = chronicals.load_model(path)
    assert tok.chronicals_source == str(path)
    with pytest.raises(ValueError, match=rf"^{path}: the tokenizer has no chat template"):
        require_chat_template(tok)


def test_a_short_name_and_the_file_it_names_are_one_model(tmp_path):
    """The embedded model's short name and the path of its .gguf in the package (what `chronicals eval --model
    <that file> --adapter runs/demo/adapter` passes, the adapter recording the short name) are one model: comparing
    the name as a path made them differ, and eval / chat / export warned "its outputs are right only if ... holds
    the same weights" of the very file the name loads (a walk of chronicals eval). Another file is still another."""
    gguf = resolve_path("smollm2-135m-instruct")
    assert same_model(str(gguf), "smollm2-135m-instruct")
    assert same_model("SmolLM2-135M-Instruct", str(gguf))
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF")
    assert not same_model(str(other), "smollm2-135m-instruct")
