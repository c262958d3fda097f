"""``chronicals train`` and ``chronicals eval`` on a GGUF file's first use (a cold conversion cache) with a malformed
data file: the data error is said before any weight is converted. The whole conversion ran first (SmolLM2-135M: 10 s
on two CPU cores and 540 MB written to the cache; an 8B file: minutes), and only then was the data read."""

from __future__ import annotations

import json

import pytest

from chronicals.cli import main
from chronicals.models import gguf_io

GOOD = {"messages": [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": "Answer."}]}


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_malformed_data_file_is_said_before_the_weights_are_converted(command, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cold_cache"
    monkeypatch.setenv("CHRONICALS_CACHE", str(cache))
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)
    converted = []
    monkeypatch.setattr(gguf_io, "gguf_tensor", lambda t, *a, **k: converted.append(t.name) or 1 / 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + '{"messages": [{"role": "user", "content": "Hi"}]\n')
    out = tmp_path / "run"
    args = (["train", "model.path=smollm2-135m-instruct", f"data.path={bad}", f"train.out_dir={out}",
             "model.device=cpu", "model.impl=torch", "train.max_steps=1", "data.cache_dir=none"]
            if command == "train" else
            ["eval", "--model", "smollm2-135m-instruct", str(bad), "--device", "cpu", "--cache-dir", "none"])
    assert main(args) == 3
    err = capsys.readouterr().err
    assert f"{bad}:2: invalid JSON" in err and "Traceback" not in err, err
    assert not converted and not list(cache.rglob("*.safetensors")) and not out.exists()


@pytest.mark.parametrize("command", ["chat", "export"])
def test_an_adapter_of_another_model_is_refused_before_the_weights_are_converted(command, tmp_path, monkeypatch,
                                                                                capsys, tiny_hf_config):
    """chat, generate and export check --adapter on the decoder built from the base's config.json before the weights
    load (cli_models._check_adapter_before_load; generate is chat's code, export --no-merge export's). On a cold cache
    that config.json came from the whole conversion: the embedded model's 540 MB were written to the cache (10 s on two
    CPU cores, minutes at 8B) before the refusal. Now it comes from the weightless conversion, as train's and eval's."""
    from chronicals.lora import apply_lora, save_adapter
    from chronicals.models import CausalLM, ModelConfig

    cache = tmp_path / "cold_cache"
    monkeypatch.setenv("CHRONICALS_CACHE", str(cache))
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)
    converted = []
    monkeypatch.setattr(gguf_io, "gguf_tensor", lambda t, *a, **k: converted.append(t.name) or 1 / 0)
    other = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("smollm2")))  # 2 layers, the base's 30
    apply_lora(other, r=2, alpha=4, target_modules=["q_proj"])
    adapter = save_adapter(other, tmp_path / "adapter", base_model_name_or_path="smollm2-135m-instruct")
    out = tmp_path / "out"
    args = {"chat": ["chat", "--adapter", str(adapter), "--device", "cpu", "Who founded Vellmora?"],
            "export": ["export", "--adapter", str(adapter), "--out", str(out)]}[command]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "error: load_adapter" in err and "was it saved for a different model?" in err and "Traceback" not in err, err
    assert not converted and not list(cache.rglob("*.safetensors")) and not out.exists()
