"""The config schema: YAML + overrides, typed parsing, did-you-mean errors, every recipe under configs/."""

from __future__ import annotations

from pathlib import Path

import pytest

from chronicals.config import TrainConfig, all_keys, config_help, from_dict, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_defaults_are_the_demo():
    c = TrainConfig()
    assert c.model.path == "smollm2-135m-instruct" and c.data.path == "demo" and c.lora.enabled
    assert c.lora.plus_ratio > 1  # LoRA+


def test_overrides_are_typed():
    c = load_config(None, ["optim.lr=3e-4", "lora.rank=8", "model.checkpointing=true",
                           "lora.targets=[q_proj, v_proj]", "train.epochs=1", "data.system_prompt="])
    assert c.optim.lr == 3e-4 and isinstance(c.optim.lr, float)  # YAML alone reads 3e-4 as a string
    assert c.lora.rank == 8 and c.model.checkpointing is True
    assert c.lora.targets == ["q_proj", "v_proj"]
    assert c.train.epochs == 1.0 and c.data.system_prompt == ""


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 1.0e-4\ntrain:\n  max_steps: 7\n")
    c = load_config(p, ["train.max_steps=9"])
    assert c.optim.lr == 1e-4 and c.train.max_steps == 9
    assert from_dict(c.to_dict()) == c  # the resolved YAML a run writes reads back the same


@pytest.mark.parametrize("bad, message", [
    ("optim.lerning_rate=1", "did you mean optim.lr"),
    ("lora.rnak=4", "did you mean lora.rank"),
    ("trian.epochs=1", "did you mean train.epochs"),
])
def test_unknown_key_suggests(bad, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [bad])


def test_unknown_section_in_yaml_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optimizer:\n  lr: 1.0\n")
    with pytest.raises(ValueError, match=r"c\.yaml:1: unknown config key 'optimizer'; did you mean optim"):
        load_config(p)


@pytest.mark.parametrize("bad, message", [
    ("optim.lr=-1", r"optim.lr=-1.0 is invalid: expected a number > 0"),
    ("optim.lr=fast", r"optim.lr='fast' is invalid: expected a number"),
    ("lora.rank=0", r"lora.rank=0 is invalid"),
    ("lora.rank=2.5", r"expected an integer"),
    ("schedule.kind=step", r"cosine \| linear \| constant"),
    ("model.checkpointing=maybe", r"expected true or false"),
    ("data.train_on=prompt", r"assistant \| all"),
    ("train.grad_accum=0", r"an integer >= 1"),
    ("lora.dropout=1.5", r"\[0, 1\)"),
])
def test_bad_values_fail(bad, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [bad])


def test_help_lists_every_key_with_its_doc():
    text = config_help()
    for key in all_keys():
        assert key in text
    assert "LoRA+: lr(B) = plus_ratio x lr(A)" in text


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(p.parents[1])) for p in CONFIGS])
def test_every_recipe_parses(path):
    c = load_config(path)
    assert c.model.path and c.train.out_dir


def test_expected_recipes_exist():
    names = {str(p.relative_to(p.parents[1])) for p in CONFIGS}
    assert {"smollm2-135m/lora.yaml", "qwen2.5-0.5b/full.yaml", "qwen2.5-0.5b/lora.yaml",
            "llama-3-8b/lora.yaml"} <= names


def test_checkpoint_layers_overrides_the_switch_and_rejects_negatives():
    from chronicals.config import load_config

    assert load_config(None, ["model.checkpoint_layers=5"]).model.checkpoint_setting == 5
    assert load_config(None, ["model.checkpointing=true"]).model.checkpoint_setting is True
    assert load_config(None, []).model.checkpoint_setting is False
    with pytest.raises(ValueError, match="model.checkpoint_layers=-1 is invalid"):
        load_config(None, ["model.checkpoint_layers=-1"])


def test_gate_up_layers_needs_gate_up_and_reaches_the_model():
    from chronicals.config import load_config
    from chronicals.models import CausalLM, ModelConfig
    import torch

    from chronicals.train.setup import prepare_model

    c = load_config(None, ["model.recompute=[norm,swiglu,gate_up]", "model.gate_up_layers=3"])
    assert c.model.gate_up_layers == 3
    with pytest.raises(ValueError, match="model.gate_up_layers=3 is invalid.*add gate_up to model.recompute"):
        load_config(None, ["model.gate_up_layers=3"])
    with pytest.raises(ValueError, match="model.gate_up_layers=-1 is invalid"):
        load_config(None, ["model.recompute=[gate_up]", "model.gate_up_layers=-1"])
    c.lora.enabled = False
    cfg = ModelConfig.from_hf_dict(dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1))
    model = prepare_model(CausalLM(cfg), c, torch.device("cpu"), torch.float32)
    assert [model.opts.rebuilds_gate_up(i) for i in range(4)] == [True, True, True, False]


def test_file_errors_name_the_line_of_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\noptim:\n  weight_decay: 0.0\n  lr: -1\n")
    with pytest.raises(ValueError, match=r"c\.yaml:5: config optim\.lr=-1\.0 is invalid"):
        load_config(p)
    p.write_text("# recipe\ntrain:\n  max_step: 3\n")  # unknown key: its own line
    with pytest.raises(ValueError, match=r"c\.yaml:3: unknown config key 'train\.max_step'; did you mean"):
        load_config(p)
    p.write_text("lora:\n  rank: 8\noptimizer:\n  lr: 1.0\n")  # unknown section: the section's line
    with pytest.raises(ValueError, match=r"c\.yaml:3: unknown config key 'optimizer'"):
        load_config(p)
    p.write_text("train:\n  max_steps: 3\n")  # an override's bad value has no line in the file
    with pytest.raises(ValueError, match=r"c\.yaml: config train\.max_steps='x' is invalid"):
        load_config(p, ["train.max_steps=x"])
