"""A model with partial rotary (a GGUF whose rope.dimension_count is below head_dim) trains, but save_model refuses
to write it as a Hugging Face directory (transformers' code would rotate every dim). A full fine-tune with
train.save_final ran every step and only then failed at the final save; it is refused before the first step, with
the two ways that work. A LoRA run on the same base saves its adapter."""

from __future__ import annotations

import pytest
import torch

from chronicals.models import CausalLM, ModelConfig
from chronicals.train import train

from train_helpers import VOCAB, SyntheticLoader, synthetic_docs, tiny_config


def _partial_rope_model() -> CausalLM:
    hf = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
              rms_norm_eps=1e-6, partial_rotary_factor=0.5, tie_word_embeddings=False)
    model = CausalLM(ModelConfig.from_hf_dict(hf)).init_weights(seed=0)
    assert model.config.rotary_dim == 8
    return model


def test_full_fine_tune_of_a_partial_rope_model_is_refused_before_training(tmp_path):
    steps = []
    cfg = tiny_config(tmp_path, train__max_steps=3, train__save_final=True)
    with pytest.raises(ValueError, match=r"rotates 8 of its head_dim=16.*lora\.enabled=true.*train\.save_final=false"):
        train(cfg, model=_partial_rope_model(), train_loader=SyntheticLoader(synthetic_docs(20)),
              on_step=lambda step, rec: steps.append(step))
    assert steps == []  # before: 3 steps trained, then save_model's refusal
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_full_fine_tune_without_final_save_and_lora_with_one_train(tmp_path):
    docs = synthetic_docs(20)
    res = train(tiny_config(tmp_path / "full", train__max_steps=2), model=_partial_rope_model(),
                train_loader=SyntheticLoader(docs))
    assert res.status == "completed" and res.step == 2
    lora = tiny_config(tmp_path / "lora", train__max_steps=2, train__save_final=True, lora__enabled=True)
    res = train(lora, model=_partial_rope_model(), train_loader=SyntheticLoader(docs))
    assert res.final_dir is not None and (res.final_dir / "adapter_config.json").is_file()


def test_full_fine_tune_of_a_partial_rope_model_path_is_refused_before_the_data_and_the_weights(tmp_path,
                                                                                                 monkeypatch):
    """From model.path (a GGUF with partial rope: its converted config.json says so), the refusal came once the
    weights had loaded, after the data was read and tokenized; the config alone decides it, so it comes first."""
    import chronicals.train.loop as loop

    def refuse(*a, **k):
        raise AssertionError("the data was read or the weights loaded before the refusal")

    monkeypatch.setattr(loop, "load_base_tokenizer", lambda *a, **k: (object(), _partial_rope_model().config))
    monkeypatch.setattr(loop, "build_loaders", refuse)
    monkeypatch.setattr(loop, "load_base", refuse)
    cfg = tiny_config(tmp_path, train__save_final=True, model__path="partial.gguf")
    with pytest.raises(ValueError, match=r"^partial\.gguf rotates 8 of its head_dim=16 dims .*a GGUF file whose "
                                         r"rope\.dimension_count is below head_dim.*lora\.enabled=true"):
        train(cfg)
    assert not (tmp_path / "run").exists()
