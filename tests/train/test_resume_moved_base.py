"""A LoRA run resumed on another model.path: its base moved or copied (the same files) or another model of the same
architecture warns, saying which; another architecture is refused. Each was refused by the path alone ("holds
LoRA adapters trained with model.path=..."), a byte-identical copy included, where a full fine-tune only warned."""

from __future__ import annotations

import logging
import shutil

import pytest
import transformers

from chronicals import load_model, save_model
from chronicals.models import CausalLM, ModelConfig
from chronicals.train import train

from train_helpers import VOCAB, SyntheticLoader, tiny_config, tiny_model

LORA = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__save_every=1)


def _base(where, seed: int = 0, **arch):
    """A tiny Llama saved as an HF directory (no tokenizer); ``arch``: LlamaConfig values that keep every shape."""
    if not arch:
        return save_model(tiny_model(seed=seed), None, where)
    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **arch)
    return save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=seed), None, where)


def _run(tmp_path, base, docs, **over):
    """A LoRA run on ``base`` loaded as the CLI loads model.path (model.chronicals_base: its files)."""
    model, _ = load_model(base, tokenizer=False)
    return train(tiny_config(tmp_path, model__path=str(base), **LORA, **over), model=model,
                 train_loader=SyntheticLoader(docs))


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("chronicals")]


@pytest.mark.parametrize("how", ["move", "copy"])
def test_a_moved_or_copied_base_resumes_with_a_warning_that_it_is_the_same_model(tmp_path, docs, caplog, how):
    base = _base(tmp_path / "tiny")
    _run(tmp_path, base, docs, train__max_steps=1)
    elsewhere = tmp_path / "tiny_moved"
    (shutil.move if how == "move" else shutil.copytree)(base, elsewhere)
    with caplog.at_level(logging.INFO, logger="chronicals.train"):
        result = _run(tmp_path, elsewhere, docs, train__max_steps=2, train__resume="auto")
    assert result.start_step == 1 and result.step == 2
    said = _said(caplog)
    assert any(f"model.path='{base}' (this run: '{elsewhere}'): the same files" in m and "moved or copied" in m
               for m in said), said


def test_other_weights_of_the_same_architecture_resume_with_a_warning_that_says_so(tmp_path, docs, caplog):
    base, other = _base(tmp_path / "tiny"), _base(tmp_path / "tuned", seed=1)
    _run(tmp_path, base, docs, train__max_steps=1)
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        assert _run(tmp_path, other, docs, train__max_steps=2, train__resume="auto").step == 2
    said = _said(caplog)
    assert any(f"(this run: '{other}'): the same architecture with other weights (model.safetensors differ)" in m
               for m in said), said


def test_another_architecture_of_the_same_shapes_is_refused_before_resumed_from_is_said(tmp_path, docs, caplog):
    """rope_theta changes no weight's shape, so the adapters load, and would compute something else."""
    base, other = _base(tmp_path / "tiny"), _base(tmp_path / "rope", rope_theta=500000.0)
    _run(tmp_path, base, docs, train__max_steps=1)
    with caplog.at_level(logging.INFO, logger="chronicals.train"), \
            pytest.raises(ValueError, match=r"trained on a model of another architecture .*rope_theta=10000.0 "
                                            r"\(this run: 500000.0\)"):
        _run(tmp_path, other, docs, train__max_steps=2, train__resume="auto")
    assert not [m for m in _said(caplog) if "resumed from" in m], _said(caplog)
