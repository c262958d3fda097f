"""load_model refuses an impl it cannot run when called, not at the first forward, and a device or dtype name it
cannot use as a ValueError; CausalLM / set_impl refuse unknown names; save_model's docstring matches what it does with an existing directory; same_model tells two
spellings of one model directory from another model (LoRA resume and the base warnings read it)."""

from __future__ import annotations

import re

import pytest

import chronicals
from chronicals.models import CausalLM, ModelConfig
from chronicals.models.loading import same_model, save_model


@pytest.fixture
def saved(tmp_path, tiny_hf_config):
    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("llama2"))).init_weights(seed=0)
    return chronicals.save_model(model, None, tmp_path / "m")


@pytest.mark.parametrize("impl", ["cuda", "Triton", "", None])
def test_unknown_impl_is_refused_at_load(saved, impl):
    with pytest.raises(ValueError, match=rf"load_model: impl={impl!r} is not one of \('auto', 'triton', 'torch'\)"):
        chronicals.load_model(saved, tokenizer=False, impl=impl)


def test_impl_checked_before_the_path_is_read(tmp_path):
    with pytest.raises(ValueError, match="impl='cuda' is not one of"):
        chronicals.load_model(tmp_path / "missing", tokenizer=False, impl="cuda")


def test_triton_on_cpu_needs_the_interpreter(saved, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"load_model: impl='triton' needs a CUDA tensor \(got cpu\); use "
                                         r"impl='torch' \(model.impl=torch\) on CPU, or set TRITON_INTERPRET=1"):
        chronicals.load_model(saved, tokenizer=False, impl="triton", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, _ = chronicals.load_model(saved, tokenizer=False, impl="triton", device="cpu")
    assert model.opts.impl == "triton"
    model, _ = chronicals.load_model(saved, tokenizer=False, impl="torch")
    assert model.opts.impl == "torch"


@pytest.mark.parametrize("device", ["gpu", 1.5, ["cpu"]])
def test_bad_device_is_a_value_error(saved, device):
    """A device of a type torch.device refuses with a TypeError (a float, a list) is the same ValueError as a bad
    device string (it was torch's raw TypeError)."""
    with pytest.raises(ValueError, match=rf"(?s)load_model: device={re.escape(repr(device))} is not a device .*; "
                                         r"use 'cpu', 'cuda' or 'cuda:1'"):
        chronicals.load_model(saved, tokenizer=False, device=device)


@pytest.mark.parametrize("name", ["int8", "torch.int32", "bool", "float8_e4m3fn"])
def test_a_dtype_name_of_no_float_weight_dtype_is_refused_before_the_path_is_read(tmp_path, name):
    """A dtype given by name must name a float weight dtype: torch also has "int8", "bool", "float8_e4m3fn", and
    these went on as the weights' dtype, past the check that refuses torch.int32 itself."""
    with pytest.raises(ValueError, match=rf"load_model: dtype={name!r} is not a weight dtype; use None"):
        chronicals.load_model(tmp_path / "missing", tokenizer=False, dtype=name)


def test_set_impl_and_constructor_refuse_unknown_names(tiny_hf_config):
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama2"))
    with pytest.raises(ValueError, match=r"CausalLM: impl='fast' is not one of"):
        CausalLM(cfg, impl="fast")
    model = CausalLM(cfg, impl="torch")
    with pytest.raises(ValueError, match=r"set_impl: impl='foo' is not one of"):
        model.set_impl("foo")
    assert model.opts.impl == "torch"  # unchanged by the refused call


def test_save_model_docstring_says_when_a_directory_is_replaced(saved):
    doc = " ".join(save_model.__doc__.split())
    assert "replaced only when it holds nothing but a model's files" in doc and "FileExistsError" in doc
    (saved / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes.txt"):
        chronicals.save_model(chronicals.load_model(saved, tokenizer=False)[0], None, saved)
    assert (saved / "notes.txt").read_text() == "mine" and (saved / "config.json").is_file()


def test_two_spellings_of_one_model_are_the_same(tmp_path, monkeypatch):
    d = tmp_path / "base"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    monkeypatch.chdir(tmp_path)
    assert same_model("base", str(d)) and same_model(str(tmp_path / "link"), "./base")
    other = tmp_path / "other"
    other.mkdir()
    assert not same_model(str(d), str(other))
    assert not same_model("smollm2-135m-instruct", str(d)) and not same_model(None, str(d))
