"""The Python API as a new user calls it: save_model / save_adapter / load_adapter / read_adapter_config with a
path under ~, load_model on a CUDA device without a GPU. Each pins what differed from the docstrings or from what
transformers / peft users expect."""

import pytest
import torch
import transformers

import chronicals
from chronicals.lora import apply_lora, load_adapter, read_adapter_config, save_adapter
from chronicals.models import CausalLM, ModelConfig

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def tiny_model(seed: int = 0) -> CausalLM:
    cfg = ModelConfig.from_hf_dict(transformers.LlamaConfig(**TINY).to_dict())
    return CausalLM(cfg, impl="torch").init_weights(std=0.1, seed=seed)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """``~`` is tmp_path/home for the test."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    return h


def test_save_model_returns_the_directory_it_wrote_under_home(home):
    # save_model("~/m") wrote $HOME/m but returned Path("~/m"), which names nothing (exists() is False)
    out = chronicals.save_model(tiny_model(), None, "~/m")
    assert out == home / "m" and (out / "config.json").is_file()
    model, tok = chronicals.load_model(out, tokenizer=False)
    assert tok is None and isinstance(model, CausalLM)


def test_adapter_round_trip_under_home(home):
    # save_adapter("~/a") wrote $HOME/a and returned Path("~/a"); load_adapter("~/a") and read_adapter_config said
    # "~/a: no such directory", while load_model("~/m") expands ~ (so did `chronicals chat --adapter=~/a`)
    model = tiny_model()
    apply_lora(model, r=2, alpha=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # B = 0 at init: make the adapter change the logits
    out = save_adapter(model, "~/a")
    assert out == home / "a" and (out / "adapter_config.json").is_file()
    assert read_adapter_config("~/a")["r"] == 2
    other = tiny_model()
    load_adapter(other, "~/a")
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(ids), model.eval()(ids), rtol=0, atol=0)


def test_load_model_cuda_without_a_gpu_is_a_value_error_before_reading(tmp_path, monkeypatch):
    # was torch's "AssertionError: Torch not compiled with CUDA enabled", after the checkpoint was read (and a .gguf
    # converted, minutes for a large one); a bad device string already was a ValueError naming the fix
    d = chronicals.save_model(tiny_model(), None, tmp_path / "m")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reads = []
    monkeypatch.setattr("chronicals.models.loading.load_hf_dir", lambda *a, **k: reads.append(a))
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        with pytest.raises(ValueError, match=r"load_model: device=.* but no CUDA device is visible; use device='cpu'"):
            chronicals.load_model(d, device=device, tokenizer=False)
    assert not reads


def test_chat_without_a_tokenizer_says_it_needs_one():
    # chat(model, None, ...) (a model loaded with tokenizer=False) said "model: the tokenizer has no chat template ...
    # use a chat (instruct) model": a tokenizer that was not there, and a fix that does not apply
    from chronicals.models import chat

    with pytest.raises(TypeError, match=r"chat\(model, tokenizer, prompt\) needs the model's tokenizer, got None "
                                        r"\(chronicals\.load_model\(path\) returns it"):
        chat(tiny_model(), None, "hi")


@pytest.mark.parametrize("path", [123, None, ["m"]])
def test_load_model_of_no_path_is_a_type_error_naming_what_it_takes(path):
    # load_model(123) said Path's "expected str, bytes or os.PathLike object, not int"
    with pytest.raises(TypeError, match=r"load_model: path must be a Hugging Face model directory, a \.gguf file or "
                                        r"a short name \(smollm2-135m-instruct\), got "):
        chronicals.load_model(path)


def test_load_adapter_onto_a_model_with_adapters_names_load_adapter(tmp_path):
    # it said "apply_lora: this model already has LoRA adapters; call merge_lora(model) first": a call the user never
    # made, and merging is one way only (a second adapter on a fresh model is the usual wish)
    model = tiny_model()
    apply_lora(model, r=2, alpha=4)
    out = save_adapter(model, tmp_path / "a")
    with pytest.raises(RuntimeError, match=r"^load_adapter: this model already has LoRA adapters \(model\.lora_config"
                                           r"\); load .*/a into a model as loaded \(chronicals\.load_model\), or "
                                           r"merge_lora\(model\) first"):
        load_adapter(model, out)
