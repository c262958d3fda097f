"""Session 24's model-I/O hunt: shapes checked from the safetensors header before any allocation, bf16 loads not
built in fp32 first, save_model into the working directory or with a bad max_shard_bytes refused, a tied model
saved under an untied config."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import chronicals
from chronicals.models import CausalLM, ModelConfig
from chronicals.models.hf_io import empty_model


def _llama_dir(path, tied=False, dtype=torch.float32):
    hf = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(hf).to(dtype).save_pretrained(path)
    return path


def test_a_config_whose_sizes_disagree_with_the_weights_is_refused_before_allocating(tmp_path, monkeypatch):
    d = _llama_dir(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 10 ** 9}))
    import chronicals.models.hf_io as hf_io

    monkeypatch.setattr(hf_io, "empty_model", lambda *a, **k: pytest.fail("allocated before the shape check"))
    with pytest.raises(ValueError, match=r"tensor .*\.weight has shape \(61, 32\) but config.json implies "
                                         r"\(1000000000, 32\)"):
        chronicals.load_model(d, tokenizer=False)


def test_a_bf16_model_is_allocated_in_bf16(monkeypatch):
    """empty_model allocated fp32 and then cast: both copies at once (2.3x the weights in RAM)."""
    cfg = ModelConfig.from_hf_dict(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2).to_dict())
    allocated = []
    real = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        allocated.extend(p.dtype for p in self.parameters())
        return real(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model = empty_model(cfg, torch.bfloat16, torch.device("cpu"))
    assert set(allocated) == {torch.bfloat16} and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.inv_freq.dtype == torch.float32


def test_save_model_refuses_the_working_directory_and_bad_shard_sizes(tmp_path, monkeypatch):
    model, _ = chronicals.load_model(_llama_dir(tmp_path / "m"), tokenizer=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for where in (".", "", str(work), str(tmp_path)):
        with pytest.raises(ValueError, match="is the working directory|the output path is empty"):
            chronicals.save_model(model, None, where)
    assert work.is_dir() and not any(work.iterdir())
    for bad in ("10KB", 0, -5, True):
        with pytest.raises(ValueError, match=rf"max_shard_bytes={bad!r}; expected a number of bytes >= 1"):
            chronicals.save_model(model, None, tmp_path / "out", max_shard_bytes=bad)
    assert not (tmp_path / "out").exists()


def test_a_tied_model_saved_under_an_untied_config_writes_both(tmp_path):
    """config.tie_word_embeddings set to False on a tied model: safetensors refused two names for one storage."""
    model, _ = chronicals.load_model(_llama_dir(tmp_path / "m", tied=True), tokenizer=False)
    model.config.tie_word_embeddings = False
    out = chronicals.save_model(model, None, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not hf.config.tie_word_embeddings
    torch.testing.assert_close(hf.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["1", None, -1, 1.5])
def test_a_bad_max_window_layers_names_the_field(value):
    """use_sliding_window with max_window_layers "1" or null gave a bare TypeError ('<' between str and int)."""
    d = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True).to_dict()
    d.pop("layer_types", None)
    d["max_window_layers"] = value
    with pytest.raises(ValueError, match=rf"max_window_layers={value!r} must be an integer >= 0"):
        ModelConfig.from_hf_dict(d)


def test_an_fp8_checkpoint_is_refused_as_quantized(tmp_path):
    """F8_E4M3 passed the float check (it starts with "F"): cast to bf16 without its scales."""
    from safetensors.torch import load_file, save_file

    d = _llama_dir(tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.weight is stored as F8_E4M3, not as F32, F16 or BF16.*FP8\) must "
                                         r"be dequantized first"):
        chronicals.load_model(d, tokenizer=False)


def test_a_full_disk_while_saving_is_an_oserror_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own SafetensorError: the CLI called it an internal error (exit 4)."""
    from safetensors import SafetensorError

    import chronicals.models.hf_io as hf_io
    from chronicals.cli import _failed
    from chronicals.lora import apply_lora, save_adapter

    model, _ = chronicals.load_model(_llama_dir(tmp_path / "m"), tokenizer=False)

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_io, "save_file", full)
    with pytest.raises(OSError, match=r"could not write .*model.safetensors \(.*No space left.*\); is its disk full") \
            as e:
        chronicals.save_model(model, None, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["m"]
    assert _failed(e.value) == 3 and "error: could not write" in capsys.readouterr().err
    # session 26: the message names the output, not the temporary directory that is gone when it is read
    assert f"could not write {tmp_path / 'out' / 'model.safetensors'} (" in str(e.value) and ".tmp-" not in str(e.value)
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    with pytest.raises(OSError, match=r"adapter_model.safetensors .*is its disk full"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_save_model_refuses_what_is_not_a_tokenizer_before_writing(tiny_hf_config, tmp_path):
    """save_model(model, "a/path", out): the string where the tokenizer goes wrote every weight, then failed with
    an AttributeError; now a TypeError that says the argument order, and nothing is written."""
    from chronicals import save_model
    from chronicals.models import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("llama3"))).init_weights(seed=0)
    with pytest.raises(TypeError, match=r"tokenizer is a str, not a tokenizer.*save_model\(model, tokenizer, out_dir\)"):
        save_model(model, str(tmp_path / "a"), tmp_path / "out")
    assert not list(tmp_path.iterdir())
