"""The config schema: YAML + overrides, typed parsing, did-you-mean errors, every recipe under configs/, and the
defaults every run (and the demo's numbers in the README) rely on."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from chronicals.config import (MAX_ROW_TOKENS, ConfigError, TrainConfig, all_keys, config_help, from_dict,
                                load_config)
from chronicals.config_schema import stored_config

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
    with pytest.raises(ValueError, match=r"expected an integer"):
        from_dict({"train": {"max_steps": True}})


def test_override_text_is_read_as_written():
    """An override splits at its first '=' only; its value is stripped (a quoted one loses its quotes); YAML's null
    in any spelling but '~' (the home directory) empties a string key; a list given as text drops empty items
    (an empty module name would reach the model code); bool words given as strings are case-blind."""
    c = load_config(None, ["data.system_prompt=a=b=c", "train.out_dir=runs/lr=1e-4"])
    assert c.data.system_prompt == "a=b=c" and c.train.out_dir == "runs/lr=1e-4"
    c = load_config(None, ["data.system_prompt= 'quoted' ", "train.out_dir= runs/x "])
    assert c.data.system_prompt == "quoted" and c.train.out_dir == "runs/x"
    for null in ("Null", "NULL"):  # not a file named NULL
        c = load_config(None, [f"data.eval_path={null}", f"data.system_prompt={null}"])
        assert (c.data.eval_path, c.data.system_prompt) == ("", "")
    assert load_config(None, ["model.recompute="]).model.recompute == []
    assert load_config(None, ["lora.targets=q_proj,v_proj,"]).lora.targets == ["q_proj", "v_proj"]
    assert load_config(None, {"lora.modules_to_save": "[]"}).lora.modules_to_save == []
    c = load_config(None, {"model.compile": "True", "model.checkpointing": "YES"})
    assert c.model.compile is True and c.model.checkpointing is True
    assert load_config(None, ["lora.rslora=tRUE"]).lora.rslora is True
    assert from_dict({"logging": {"plot": "Off"}}).logging.plot is False


@pytest.mark.parametrize("null", ["null", "~", "Null"])
def test_a_null_string_key_in_a_file_is_empty_not_its_spelling(tmp_path, null):
    """A string key written as YAML null in a file is '' (eval_path: null = no held-out data), not the text 'null'
    (a file that does not exist)."""
    p = tmp_path / "c.yaml"
    p.write_text(f"data:\n  eval_path: {null}\n  system_prompt: {null}\n")
    c = load_config(p)
    assert (c.data.eval_path, c.data.system_prompt) == ("", "")


@pytest.mark.parametrize("text", ["train:\n  out_dir: [a, b]\n", "data:\n  system_prompt: {role: x}\n"])
def test_a_string_key_given_a_list_or_mapping_in_yaml_is_refused_at_its_line(tmp_path, text):
    """A string key written as a YAML list or mapping fails naming the file, the key's line and the key; it became
    the path or prompt "['a', 'b']"."""
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=r"c\.yaml:2: config \w+\.\w+=.* is invalid: expected a string"):
        load_config(p)


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


@pytest.mark.parametrize("bad, first", [
    ("optim.learning_rate=1", "optim.lr"),  # spelling alone put optim.weight_decay first
    ("train.num_train_epochs=1", "train.epochs"),
    ("lora.lora_r=4", "lora.rank"),
    ("lora.target_modules=[q_proj]", "lora.targets"),
    ("train.per_device_train_batch_size=2", "data.batch_size"),
    ("schedule.warmup_ratio=0.1", "schedule.warmup_steps"),  # spelling alone offered lora.plus_ratio
    # spelling alone offers train.save_final, train.grad_accum, train.epochs and train.seed for these
    ("train.save_total_limit=2", "train.keep_last"),
    ("train.max_grad_norm=1", "optim.grad_clip"),
    ("train.torch_dtype=bf16", "model.dtype"),
    ("train.base_model=x", "model.path"),
    ("optim.Learning_Rate=1", "optim.lr"),  # looked up in any case
    ("optim.LEARNING_RATE=1", "optim.lr"),
])
def test_names_from_transformers_and_peft_suggest_our_key_first(bad, first):
    with pytest.raises(ValueError, match=rf"did you mean {re.escape(first)}( or|\?)"):
        load_config(None, [bad])


def test_every_name_from_elsewhere_points_at_a_key():
    from chronicals.config import KNOWN_ELSEWHERE

    assert set(KNOWN_ELSEWHERE.values()) <= set(all_keys())



def test_unknown_section_in_yaml_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optimizer:\n  lr: 1.0\n")
    with pytest.raises(ValueError, match=r"c\.yaml:1: unknown config key 'optimizer'; did you mean optim"):
        load_config(p)


@pytest.mark.parametrize("bad, message", [
    ("optim.lr=-1", r"optim.lr=-1.0 is invalid: expected a number in \(0, 10\]"),
    # lr=0 is the open lower edge: a run that never moves a weight
    ("optim.lr=0", r"^command line: config optim\.lr=0\.0 is invalid: expected a number in \(0, 10\]"),
    ("optim.lr=fast", r"optim.lr='fast' is invalid: expected a number"),
    ("lora.rank=0", r"lora.rank=0 is invalid"),
    ("lora.rank=2.5", r"expected an integer"),
    ("schedule.kind=step", r"cosine \| linear \| constant"),
    ("model.checkpointing=maybe", r"expected true or false"),
    ("data.train_on=prompt", r"assistant \| all"),
    ("train.grad_accum=0", r"an integer >= 1"),
    ("lora.dropout=1.5", r"\[0, 1\)"),
    # bool is an int subclass: true/yes/on for an integer key became 1
    ("train.max_steps=true", r"train.max_steps=True is invalid: expected an integer"),
    ("train.save_every=yes", r"expected an integer"),
    ("lora.rank=on", r"expected an integer"),
    ("lora.targets=[q_proj", r"^command line: config .* is invalid: an unclosed bracket"),
    ("model.recompute=norm]", r"^command line: config .* is invalid: an unclosed bracket"),
    ("lora.modules_to_save=[lm_head", r"an unclosed bracket; expected a list such as \[embed_tokens, lm_head\]"),
    # a name the model does not rebuild (attn) is refused, not passed on to it
    ("model.recompute=[norm,attn]", r"^command line: config model\.recompute=\['norm', 'attn'\] is invalid: "
                                    r"expected a list drawn from \[norm, swiglu, gate_up\], or \[\]$"),
    # a device that merely contains "cuda" is no CUDA device
    ("model.device=xcuda", r"model.device='xcuda' is invalid: expected auto \| cpu \| cuda \| cuda:N"),
    ("model.device=gpu-cuda:0", r"model.device='gpu-cuda:0' is invalid: expected auto \| cpu \| cuda"),
    ("model.loss_vocab_parts=0", r"model.loss_vocab_parts=0 is invalid: expected an integer >= 1"),
    ("data.num_proc=-1", r"data.num_proc=-1 is invalid: expected an integer >= 0 \(0 = auto\)"),
    ("data.max_seq_len=4194305", r"data.max_seq_len=4194305 is invalid: expected an integer in \[8, 4194304\]"),
    # the values just past each check
    ("data.dp_remainder=keep", r"data\.dp_remainder='keep' is invalid: expected train \| drop"),
    ("data.on_error=ignore", r"data\.on_error='ignore' is invalid: expected fail \| skip"),
    ("train.max_steps=-1", r"train\.max_steps=-1 is invalid: expected an integer >= 0"),
    ("train.save_every=-1", r"train\.save_every=-1 is invalid: expected an integer >= 0"),
    ("eval.every=-1", r"eval\.every=-1 is invalid: expected an integer >= 0"),
    ("eval.qa_limit=-1", r"eval\.qa_limit=-1 is invalid: expected an integer >= 0"),
    ("lora.alpha=0", r"lora\.alpha=0\.0 is invalid: expected a finite number > 0"),
    ("lora.dropout=1", r"lora\.dropout=1\.0 is invalid: expected a number in \[0, 1\)"),
])
def test_bad_values_fail(bad, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [bad])


def test_help_lists_every_key_with_its_doc():
    text = config_help()
    for key in all_keys():
        assert key in text
    assert "LoRA+: lr(B) = plus_ratio x lr(A)" in text
    # a list key's default comes from its default_factory
    assert "lora.modules_to_save (list, default [])" in text
    assert "lora.targets (list, default ['q_proj', 'k_proj'," in text


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
    p.write_text("train:\n  max_steps: 3\n")  # an override's bad value is the command line's, not the file's
    with pytest.raises(ValueError, match=r"^command line: config train\.max_steps='x' is invalid"):
        load_config(p, ["train.max_steps=x"])


# ---- YAML files a new user broke (non-string keys, duplicates, syntax errors, a directory) ----

@pytest.mark.parametrize("text, message", [
    ("{optim: {lr: 1e-3}, 5: {a: 1}}", r"c\.yaml:1: unknown config key 5; known: model"),
    ("optim:\n  lr: 1e-3\n  5: 1\n", r"c\.yaml:3: unknown config key 'optim\.5'"),
    ("optim:\n  lr: 1e-3\n~:\n  a: 1\n", r"c\.yaml:3: unknown config key None"),
])
def test_non_string_keys_are_unknown_keys(tmp_path, text, message):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):  # was a TypeError from difflib
        load_config(p)


@pytest.mark.parametrize("text, message", [
    ("optim:\n  lr: abc\n  lr: 1e-3\n", r"c\.yaml:3: duplicate key optim\.lr \(also at line 2\)"),
    ("optim:\n  lr: 1e-3\n  lr: abc\n", r"c\.yaml:3: duplicate key optim\.lr \(also at line 2\)"),
    ("optim:\n  lr: 1e-3\ntrain:\n  epochs: 1\noptim:\n  eps: 1e-6\n", r"c\.yaml:5: duplicate key optim \(also at line 1\)"),
])
def test_duplicate_keys_fail_at_the_second(tmp_path, text, message):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):  # was: the last one silently won
        load_config(p)


def test_override_given_twice_fails_like_a_yaml_duplicate(tmp_path):
    with pytest.raises(ValueError, match=r"^command line: train\.max_steps given twice \(train\.max_steps=3 and "
                                         r"train\.max_steps=4\); give it once$"):  # was: the last one silently won
        load_config(None, ["train.max_steps=3", "train.max_steps=4"])
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 2\n")  # the file's value is overridden once, not a duplicate
    assert load_config(p, ["train.max_steps=3"]).train.max_steps == 3
    with pytest.raises(ValueError, match=r"^command line: optim\.lr given twice"):
        load_config(p, ["optim.lr=1e-3", "optim.lr = 1e-3"])


@pytest.mark.parametrize("text, message", [
    # the problem's own position, then where the unclosed construct began
    ("optim:\n  lr: 1e-3\ntrain:\n  max_steps: [1\n",
     r"^\S*c\.yaml:5:1: invalid YAML: expected ',' or ']', but got '<stream end>' "
     r"\(while parsing a flow sequence at 4:14\)$"),
    ("optim:\n\tlr: 1\n", r"^\S*c\.yaml:2:1: invalid YAML: found character '\\t' that cannot start any token.*"
                           r"indent with spaces, not tabs"),
    ("optim:\n  lr: !!python/name:os.system\n", r"^\S*c\.yaml:2:7: invalid YAML: could not determine a constructor"),
    ("optim:\n  lr: 1.0e-3\n---\ntrain:\n  epochs: 1\n",
     r"^\S*c\.yaml:3:1: invalid YAML: expected a single document in the stream \(from 1:1\), but found another"),
])
def test_yaml_syntax_errors_say_file_line_column(tmp_path, text, message):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        load_config(p)
    assert "unicode string" not in str(e.value)


def test_config_path_that_is_a_directory(tmp_path):
    d = tmp_path / "d.yaml"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match=r"d\.yaml is a directory, not a YAML file"):  # the CLI: exit 2
        load_config(d)
    with pytest.raises(FileNotFoundError, match=r"config file \S*nope\.yaml not found"):
        load_config(tmp_path / "nope.yaml")


def test_merge_key_is_not_a_duplicate(tmp_path):
    p = tmp_path / "c.yaml"  # '<<' has no constructor of its own: naming it must not fail
    p.write_text("optim:\n  <<: {lr: 2.0e-3}\n  eps: 1.0e-6\n")
    c = load_config(p)
    assert c.optim.lr == 2e-3 and c.optim.eps == 1e-6


# ---- numeric ranges checked when the config is read, not when torch meets the value ----

FLOAT_KEYS = [k for k in all_keys() if isinstance(getattr(TrainConfig(), k.split(".")[0]).__dict__[k.split(".")[1]],
                                                   float)]


def test_float_keys_are_found():
    assert {"optim.lr", "optim.eps", "lora.alpha", "train.epochs", "schedule.min_lr_ratio"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["inf", "-inf", ".nan"])
def test_every_float_key_must_be_finite(key, value):
    shown = {"inf": "inf", "-inf": "-inf", ".nan": "nan"}[value]
    with pytest.raises(ValueError, match=rf"config {key}={shown} is invalid: expected a finite number"):
        load_config(None, [f"{key}={value}", "train.max_steps=5"])  # max_steps: epochs alone may not decide


def test_sections_built_directly_check_finiteness():
    from chronicals.config import OptimSection

    with pytest.raises(ValueError, match=r"optim\.grad_clip=inf is invalid: expected a finite number"):
        OptimSection(grad_clip=float("inf"))


@pytest.mark.parametrize("bad, message", [
    ("optim.eps=-1", r"optim\.eps=-1\.0 is invalid: expected a number > 0"),
    ("optim.eps=0", r"optim\.eps=0\.0 is invalid: expected a number > 0"),
    ("optim.beta1=1", r"optim\.beta1=1\.0 is invalid: expected a number in \[0, 1\)"),
    ("optim.beta2=-0.1", r"optim\.beta2=-0\.1 is invalid: expected a number in \[0, 1\)"),
    ("optim.weight_decay=-0.01", r"optim\.weight_decay=-0\.01 is invalid: expected a number >= 0"),
    ("optim.grad_clip=-1", r"optim\.grad_clip=-1\.0 is invalid"),
    ("schedule.warmup_steps=-1", r"schedule\.warmup_steps=-1 is invalid: expected an integer >= 0"),
    ("schedule.min_lr_ratio=1.5", r"schedule\.min_lr_ratio=1\.5 is invalid: expected a number in \[0, 1\]"),
    ("schedule.min_lr_ratio=-0.1", r"schedule\.min_lr_ratio=-0\.1 is invalid"),
    ("train.seed=-1", r"train\.seed=-1 is invalid: expected an integer in \[0, 2\^64\)"),
    ("train.seed=18446744073709551616", r"train\.seed=18446744073709551616 is invalid: expected an integer in "
                                        r"\[0, 2\^64\).*torch\.manual_seed"),
    ("logging.peak_tflops=-1", r"logging\.peak_tflops=-1\.0 is invalid"),
    ("lora.plus_ratio=0", r"lora\.plus_ratio=0\.0 is invalid"),
])
def test_optimizer_and_schedule_ranges(bad, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [bad])


def test_range_errors_name_the_line_of_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  beta1: 0.9\n  beta2: 1.0\n")
    with pytest.raises(ValueError, match=r"c\.yaml:3: config optim\.beta2=1\.0 is invalid"):
        load_config(p)


@pytest.mark.parametrize("path", [None, "c.yaml"])
def test_override_errors_name_the_command_line(tmp_path, path):
    if path:
        (tmp_path / path).write_text("train:\n  max_steps: 3\noptim:\n  lr: 1.0e-3\n")
        path = tmp_path / path
    with pytest.raises(ValueError, match=r"^command line: unknown config key 'trian\.epochs'; did you mean"):
        load_config(path, ["trian.epochs=1"])
    with pytest.raises(ValueError, match=r"^command line: config optim\.lr=-1\.0 is invalid"):
        load_config(path, ["optim.lr=-1"])
    with pytest.raises(ValueError, match=r"^overrides: config optim\.lr=-1\.0 is invalid"):
        load_config(path, {"optim.lr": -1.0})  # a dict from Python is not a command line
    with pytest.raises(ValueError, match=r"^command line: override 'optim\.lr' is not key=value"):
        load_config(path, ["optim.lr"])
    with pytest.raises(ValueError, match=r"^command line: config optim\.lr=-1\.0 is invalid"):
        load_config(path, [" optim.lr =-1"])  # the key as the override gives it, spaces around it


def test_file_error_keeps_its_line_next_to_other_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 3\noptim:\n  lr: -1\n")
    with pytest.raises(ValueError, match=r"^\S*c\.yaml:4: config optim\.lr=-1\.0 is invalid"):
        load_config(p, ["train.max_steps=4"])


# ---- train.resume: auto | none | a checkpoint that exists (a missing one can never resume) ----

def test_resume_must_be_auto_none_or_an_existing_path(tmp_path, monkeypatch):
    ck = tmp_path / "run" / "checkpoints" / "step-000004"
    ck.mkdir(parents=True)
    assert load_config(None, [f"train.resume={ck}"]).train.resume == str(ck)
    assert load_config(None, ["train.resume=none"]).train.resume == "none"
    monkeypatch.chdir(tmp_path)  # a relative path is read from the working directory, as the trainer reads it
    assert load_config(None, ["train.resume=run/checkpoints/step-000004"]).train.resume
    with pytest.raises(ValueError, match=r"^command line: config train\.resume='bogus' is invalid: expected auto \| "
                                         r"none \| an existing checkpoint directory; bogus does not exist"):
        load_config(None, ["train.resume=bogus"])
    with pytest.raises(ValueError, match=r"train\.resume='' is invalid: expected auto \| none \| a checkpoint"):
        load_config(None, ["train.resume="])
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  out_dir: elsewhere\n  resume: gone/step-1\n")
    with pytest.raises(ValueError, match=r"c\.yaml:3: config train\.resume='gone/step-1' is invalid"):
        load_config(p)


def test_a_stored_configs_missing_resume_is_taken_only_inside_its_block(tmp_path):
    """stored_config() lets a run's stored config name a checkpoint that is gone, for its block only: after the block
    (left normally or by an exception) a missing train.resume is refused again. Without the reset, one chat/eval/export
    read of a stored config let every later config in the process name a missing checkpoint."""
    gone = str(tmp_path / "checkpoints" / "step-000003")
    with stored_config():
        assert load_config(None, [f"train.resume={gone}"]).train.resume == gone
    with pytest.raises(ValueError, match=r"train\.resume=.* is invalid: expected auto \| none \| an existing"):
        load_config(None, [f"train.resume={gone}"])
    with pytest.raises(RuntimeError, match="boom"):
        with stored_config():
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match=r"train\.resume=.* does not exist"):
        load_config(None, [f"train.resume={gone}"])


def test_data_and_model_paths_need_not_exist_here():
    c = load_config(None, ["data.path=/elsewhere/train.jsonl", "model.path=/elsewhere/model", "data.eval_path=/x.jsonl"])
    assert c.data.path == "/elsewhere/train.jsonl" and c.model.path == "/elsewhere/model"


# ---- help and checks agree ----

def _help_of(key: str) -> str:
    """The help entry of one key: its '  key (type, default)' line and the doc lines under it."""
    entries = re.split(r"\n(?=\S|  \S)", config_help())
    return next(e for e in entries if e.startswith(f"  {key} ("))


def test_every_dtype_the_check_accepts_is_in_the_help():
    doc = _help_of("model.dtype")
    for dtype in ("auto", "bfloat16", "float32", "float64"):
        assert load_config(None, [f"model.dtype={dtype}"]).model.dtype == dtype
        assert dtype in doc, (dtype, doc)
    with pytest.raises(ValueError, match=r"model\.dtype='float16' is invalid: expected auto \| bfloat16 \| float32 \| "
                                         r"float64"):
        load_config(None, ["model.dtype=float16"])


@pytest.mark.parametrize("given, resolved", [
    ("1", "true"), ("on", "true"), ("yes", "true"), ("true", "true"), ("True", "true"),
    ("0", "false"), ("off", "false"), ("no", "false"), ("false", "false"), ("auto", "auto"), ("AUTO", "auto"),
])
def test_optim_fused_takes_the_boolean_words(given, resolved):
    assert load_config(None, [f"optim.fused={given}"]).optim.fused == resolved  # the words boolean keys take


def test_optim_fused_from_yaml_and_its_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  fused: on\n")  # YAML 1.1: a bool
    assert load_config(p).optim.fused == "true"
    with pytest.raises(ValueError, match=r"optim\.fused='sometimes' is invalid: expected auto, true or false"):
        load_config(None, ["optim.fused=sometimes"])


def test_out_dir_help_mentions_the_data_copies():
    assert "data/" in _help_of("train.out_dir")


def test_a_batch_size_beside_tokens_per_batch_is_named_as_unused(caplog):
    from chronicals.config import DataSection

    default = DataSection.__dataclass_fields__["batch_size"].default
    cases = [(["data.batch_size=8"], {"batch_size": 8}, False),
             (["data.tokens_per_batch=512"], {"tokens_per_batch": 512}, False),
             ([f"data.batch_size={default}", "data.tokens_per_batch=512"], {"tokens_per_batch": 512}, False),
             (["data.batch_size=8", "data.tokens_per_batch=512"], {"tokens_per_batch": 512}, True),
             (["data.batch_size=1", "data.tokens_per_batch=512"], {"tokens_per_batch": 512}, True)]
    for overrides, shape, warned in cases:
        n = int(overrides[0].split("=")[1])
        caplog.clear()
        with caplog.at_level("WARNING", logger="chronicals.config"):
            assert load_config(None, overrides).data.loader_shape() == shape
        assert [r.getMessage() for r in caplog.records] == warned * [
            f"data.batch_size={n} is not used: data.tokens_per_batch=512 makes each micro-batch one "
            f"padding-free row of at most that many tokens; leave data.batch_size at its default ({default}) to "
            f"silence this, or set data.tokens_per_batch=0 for {n} row{'s' * (n != 1)} of data.max_seq_len"], overrides
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.config"):
        load_config(None, ["data.batch_size=8", "data.tokens_per_batch=512"]).data.loader_shape(warn=False)
    assert not caplog.records


def test_format_help_says_it_applies_to_the_heldout_file():
    assert "data.eval_path" in _help_of("data.format")  # the held-out file is read in that format too


def test_lora_targets_take_names_and_all_linear_but_no_regex():
    """A regular expression would be cut at its commas by the list syntax and then match nothing (PEFT reads a
    single string as one): refused at config time; all-linear is the 7 projections, lora.inject's defaults."""
    from chronicals.config import LORA_PROJECTIONS, ConfigError, LoraSection
    from chronicals.lora.inject import DEFAULT_TARGETS

    assert LORA_PROJECTIONS == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert LoraSection(targets=["all-linear"]).targets == list(DEFAULT_TARGETS)
    assert LoraSection(targets=["q_proj", "model.layers.0.mlp.down_proj"]).targets[1] == "model.layers.0.mlp.down_proj"
    for bad in ([r".*\.(q|v)_proj"], ["q_proj", "v_proj$"]):
        with pytest.raises(ConfigError, match="regular expressions are not read from the config: list the names"):
            LoraSection(targets=bad)


def test_model_attention_takes_the_ops_kernel_names():
    from chronicals.config import ATTENTION_KERNELS, ConfigError, ModelSection
    from chronicals.ops.attention import VARLEN_KERNELS

    assert ATTENTION_KERNELS == VARLEN_KERNELS
    assert ModelSection(attention="cudnn").attention == "cudnn"
    with pytest.raises(ConfigError, match="model.attention='sdpa' is invalid: expected auto | cudnn | flash"):
        ModelSection(attention="sdpa")


def test_documented_training_defaults():
    cfg = from_dict({})
    assert cfg.optim.grad_clip == 1.0  # "clip the global gradient norm to this"
    assert cfg.schedule.warmup_steps == 3 and cfg.schedule.kind == "cosine" and cfg.schedule.min_lr_ratio == 0.1
    assert cfg.data.train_on == "assistant"  # loss on replies only
    assert cfg.train.keep_last == 2 and cfg.train.grad_accum == 1


def test_keep_last_zero_is_refused():
    with pytest.raises(ConfigError, match="train.keep_last"):
        from_dict({}, ["train.keep_last=0"])


def test_a_config_given_through_a_pipe_is_read(tmp_path):
    import os

    r, w = os.pipe()
    os.write(w, b"train:\n  max_steps: 7\n")
    os.close(w)
    try:
        assert load_config(f"/dev/fd/{r}").train.max_steps == 7  # bash's <(...) gives such a path
    finally:
        os.close(r)


def test_settings_that_do_nothing_are_said_once_by_the_run_not_by_the_config(caplog):
    """lora.* under lora.enabled=false and eval.every without held-out data are said when the run sets up
    (train.setup, train.loop: tests/train/test_loop.py); reading the config says nothing, so a run says each once."""
    with caplog.at_level(logging.WARNING):
        load_config(None, ["lora.enabled=false", "lora.rank=8", "lora.dropout=0.1"])
        load_config(None, ["data.path=mine.jsonl", "eval.every=5"])
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_tilde_on_the_command_line_is_the_home_directory(monkeypatch, tmp_path):
    """YAML reads a bare ~ as null, so train.out_dir=~ was refused as '' and data.eval_path=~ turned held-out
    evaluation off without a word; the shell does not expand ~ after '='."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(None, ["train.out_dir=~"]).train.out_dir == str(tmp_path)
    assert load_config(None, ["data.eval_path=~"]).data.eval_path == "~"  # expanded where it is read
    assert load_config(None, ["data.system_prompt=null"]).data.system_prompt == ""  # null stays null


@pytest.mark.parametrize("model", [{"checkpointing": True}, {"checkpoint_layers": 3}])
def test_cuda_graphs_true_with_any_activation_checkpointing_is_refused(model):
    """model.checkpoint_layers=k is activation checkpointing too (checkpoint_setting): with
    train.cuda_graphs=true it is refused when read, as model.checkpointing=true is, rather than capturing a
    checkpointed step that reads the CUDA RNG state."""
    with pytest.raises(ConfigError, match="checkpoint reads the CUDA RNG state"):
        from_dict({"model": {"device": "cuda", **model}, "train": {"cuda_graphs": "true"}})


def test_cuda_graphs_true_on_the_cpu_device_is_refused_when_read():
    """train.cuda_graphs=true beside model.device=cpu is refused when the config is read (exit 2, naming
    train.cuda_graphs and the fix; YAML's `on` is true too), not only later by the run's device check once setup has
    begun; auto and false are accepted on the CPU."""
    with pytest.raises(ValueError, match=r"^command line: config train.cuda_graphs=True is invalid: expected false "
                                         r"with model.device=cpu \(CUDA graphs need a GPU\)"):
        load_config(None, ["model.device=cpu", "train.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="CUDA graphs need a GPU") as e:
        from_dict({"model": {"device": "cpu"}, "train": {"cuda_graphs": "on"}})
    assert e.value.key == "train.cuda_graphs"
    for ok in ("auto", "false"):
        assert load_config(None, ["model.device=cpu", f"train.cuda_graphs={ok}"]).train.cuda_graphs == ok


def test_a_tilde_in_train_resume_is_the_home_directory(tmp_path, monkeypatch):
    """train.resume=~/runs/x/checkpoints/step-000004 names the checkpoint under $HOME (as train.out_dir's ~
    does): it was refused as "does not exist" (Path('~/...') is looked up literally)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ck" / "step-000004").mkdir(parents=True)
    c = from_dict({}, ["train.resume=~/ck/step-000004"])
    assert c.train.resume == str(tmp_path / "ck" / "step-000004")


@pytest.mark.parametrize("value", [-1, -512])
def test_a_negative_tokens_per_batch_is_refused(value):
    """data.tokens_per_batch is 0 (rows) or in [max_seq_len, 2^22]; a negative value passed the config and
    reached the loader as a batch of -1 tokens (loader_shape returns it: it is not 0)."""
    with pytest.raises(ConfigError, match=r"data.tokens_per_batch=-\d+ is invalid") as e:
        from_dict({"data": {"tokens_per_batch": value}})
    assert e.value.key == "data.tokens_per_batch"


def test_tokens_per_batch_equal_to_max_seq_len_is_accepted():
    """data.tokens_per_batch is documented as ">= max_seq_len": one row of exactly max_seq_len tokens per
    micro-batch (the smallest padding-free batch) must be accepted, not refused as out of range."""
    c = from_dict({"data": {"max_seq_len": 256, "tokens_per_batch": 256}})
    assert c.data.loader_shape(warn=False) == {"tokens_per_batch": 256}


def test_the_edges_of_the_model_and_data_ranges_are_accepted():
    """The smallest or largest value each range allows is itself a valid setting: data.max_seq_len and
    data.tokens_per_batch at MAX_ROW_TOKENS (2^22; a bound written `<` refused the documented maximum),
    model.loss_vocab_parts=1, data.num_proc=0 (auto) and a numbered CUDA device."""
    c = load_config(None, [f"data.max_seq_len={MAX_ROW_TOKENS}", f"data.tokens_per_batch={MAX_ROW_TOKENS}",
                           "model.loss_vocab_parts=1", "data.num_proc=0", "model.device=cuda:1"])
    assert c.data.max_seq_len == c.data.tokens_per_batch == MAX_ROW_TOKENS == 2 ** 22
    assert (c.model.loss_vocab_parts, c.data.num_proc, c.model.device) == (1, 0, "cuda:1")


def test_a_batch_size_of_zero_is_refused_when_read():
    """data.batch_size=0 fails when the config is read (exit 2, naming the key), not after the model and data
    load, in the loader."""
    with pytest.raises(ConfigError, match=r"data.batch_size=0 is invalid: expected an integer >= 1") as e:
        from_dict({"data": {"batch_size": 0}})
    assert e.value.key == "data.batch_size"


@pytest.mark.parametrize("value", [1, 7])
def test_max_seq_len_below_eight_is_refused(value):
    """data.max_seq_len is in [8, 2^22]: a row of 1..7 tokens holds no chat example (the template alone is
    longer), so every record was truncated away after the model loaded."""
    with pytest.raises(ConfigError, match=rf"data.max_seq_len={value} is invalid: expected an integer in \[8, "):
        from_dict({"data": {"max_seq_len": value}})


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_min_lr_ratio_zero_decays_to_zero(kind):
    """schedule.min_lr_ratio is in [0, 1]; 0 (decay to zero, the usual cosine schedule) must be accepted."""
    assert from_dict({"schedule": {"kind": kind, "min_lr_ratio": 0}}).schedule.min_lr_ratio == 0


def test_the_demo_format_mismatch_names_the_format_line(tmp_path):
    """data.format=text beside data.path=demo (the default) fails naming the YAML line of data.format, the
    value to change, not data.path's (absent here) or the section's."""
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 2\ndata:\n  max_seq_len: 64\n  format: text\n")
    with pytest.raises(ValueError, match=rf"^{p}:5: config data.format='text' does not fit data.path=demo"):
        load_config(p, [])


def test_max_new_tokens_zero_is_refused():
    """eval.max_new_tokens=0 generates no answer at all: every held-out question scores 0, silently."""
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens=0 is invalid: expected an integer >= 1"):
        from_dict({"eval": {"max_new_tokens": 0}})


def test_a_fractional_loss_vocab_parts_is_refused_from_python():
    """the YAML path types model.loss_vocab_parts as an integer; a config built in Python
    (ModelSection(loss_vocab_parts=1.5), chronicals.config's documented API) must be refused by the section itself,
    not reach the loss head as a number of parts that is not a count."""
    from chronicals.config import ModelSection

    with pytest.raises(ConfigError, match="model.loss_vocab_parts=1.5 is invalid: expected an integer >= 1"):
        ModelSection(loss_vocab_parts=1.5)


def test_configs_do_not_share_their_default_lists():
    """each config gets its own copy of a list default (model.recompute, lora.targets, lora.modules_to_save):
    a program that edits one config's list in place (a sweep adding gate_up) changed every later config's default."""
    a = TrainConfig()
    a.model.recompute.append("gate_up")
    a.lora.modules_to_save.append("lm_head")
    b = TrainConfig()
    assert b.model.recompute == ["norm", "swiglu"] and b.lora.modules_to_save == []


@pytest.mark.parametrize("setting", [
    "data.max_seq_len=8", "data.on_long=split", "data.on_error=skip", "data.dp_remainder=drop",
    "optim.beta1=0", "optim.grad_clip=0", "schedule.min_lr_ratio=1", "schedule.warmup_steps=0",
    f"train.seed={2 ** 64 - 1}",
])
def test_the_edge_and_word_each_check_allows_is_accepted(setting):
    key, value = setting.split("=")
    section, name = key.split(".")
    got = getattr(getattr(load_config(None, [setting]), section), name)
    assert str(got) == value or got == float(value)


def test_the_demo_data_takes_the_chat_format():
    assert load_config(None, ["data.format=chat"]).data.format == "chat"


def test_a_data_file_takes_the_sharegpt_format():
    assert load_config(None, ["data.format=sharegpt", "data.path=mine.jsonl"]).data.format == "sharegpt"


def test_a_module_both_adapted_and_trained_in_full_is_refused():
    with pytest.raises(ValueError, match=r"lora\.modules_to_save=\['q_proj'\] is invalid: .*also in lora\.targets"):
        load_config(None, ["lora.modules_to_save=[q_proj]"])


def test_a_fractional_gate_up_layers_is_refused_from_python():
    from chronicals.config import ModelSection

    with pytest.raises(ConfigError, match=r"model\.gate_up_layers=1\.5 is invalid: expected an integer >= 0"):
        ModelSection(recompute=["gate_up"], gate_up_layers=1.5)


@pytest.mark.parametrize("key, expected", [
    ("model.path", "a model directory, .gguf file or short name"),
    ("data.path", "a data file or directory, or 'demo'"),
    ("train.out_dir", "a directory path"),
])
def test_an_empty_path_is_refused(key, expected):
    with pytest.raises(ValueError, match=rf"config {re.escape(key)}='' is invalid: expected {re.escape(expected)}$"):
        load_config(None, [f"{key}="])


def test_lm_head_as_a_lora_target_is_refused():
    with pytest.raises(ValueError, match=r"lora\.targets=\['q_proj', 'lm_head'\] is invalid: .*lora\.modules_to_save"):
        load_config(None, ["lora.targets=[q_proj,lm_head]"])


def test_modules_to_save_take_names_but_no_regex():
    with pytest.raises(ValueError, match=r"lora\.modules_to_save=\['lm_\.\*'\] is invalid: .*regular expressions"):
        load_config(None, ["lora.modules_to_save=[lm_.*]"])


def test_modules_to_save_that_are_not_names_are_a_config_error_from_python():
    from chronicals.config import LoraSection

    with pytest.raises(ConfigError, match=r"lora\.modules_to_save=\[1\] is invalid: expected a list of module names") as e:
        LoraSection(modules_to_save=[1])
    assert e.value.key == "lora.modules_to_save"


@pytest.mark.parametrize("kw", [dict(checkpoint_layers=True), dict(checkpoint_layers=1.5),
                                dict(loss_vocab_parts=True), dict(recompute=["gate_up"], gate_up_layers=True)])
def test_a_layer_or_part_count_built_in_python_must_be_an_integer_not_a_bool(kw):
    from chronicals.config import ModelSection

    key = [k for k in kw if k != "recompute"][0]
    with pytest.raises(ConfigError, match=rf"model\.{key}={kw[key]} is invalid: expected an integer >= [01]") as e:
        ModelSection(**kw)
    assert e.value.key == f"model.{key}"


def test_every_bad_key_and_value_is_said_at_once(tmp_path):
    """Three bad values, an unknown key and a bad override: one error naming them all, each at its line, in the
    file's order, then the command line's (the first alone was said, so a user fixed and reran once per value)."""
    p = tmp_path / "c.yaml"
    p.write_text("lora:\n  rank: -4\noptim:\n  lr: -1\ndata:\n  max_seq_len: 0\ntrain:\n  max_stepz: 3\n")
    with pytest.raises(ValueError) as e:
        load_config(p, ["model.dtype=float17"])
    lines = str(e.value).splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"{p}:2", f"{p}:4", f"{p}:6", f"{p}:8", "command line"]
    assert "lora.rank=-4" in lines[0] and "optim.lr=-1.0" in lines[1] and "data.max_seq_len=0" in lines[2]
    assert "unknown config key 'train.max_stepz'" in lines[3] and "model.dtype='float17'" in lines[4]


def test_a_value_of_the_wrong_type_is_not_judged_again_by_its_default():
    """A section with a value of the wrong type is not built: its checks would have met the default standing in for
    that value (tokens_per_batch=512 'below data.max_seq_len=2048' while max_seq_len was set to 'abc')."""
    with pytest.raises(ConfigError) as e:
        from_dict({"data": {"max_seq_len": "abc", "tokens_per_batch": 512}, "optim": {"lr": 0}})
    assert len(e.value.errors) == 2, str(e.value)
    assert "data.max_seq_len='abc' is invalid: expected an integer" in str(e.value)
    assert "tokens_per_batch" not in str(e.value) and "optim.lr=0.0 is invalid" in str(e.value)
    assert e.value.key == "data.max_seq_len"
    with pytest.raises(ConfigError) as one:  # one error: the ConfigError itself, as before
        from_dict({"optim": {"lr": 0}})
    assert not hasattr(one.value, "errors") and one.value.key == "optim.lr"


@pytest.mark.parametrize("target, name, message", [
    ("optim", "learning_rate", r"unknown config key 'optim\.learning_rate'; did you mean optim\.lr"),
    ("train", "max_step", r"unknown config key 'train\.max_step'; did you mean train\.max_steps"),
    ("config", "optimizer", r"unknown config key 'optimizer'; did you mean optim"),
])
def test_a_config_attribute_that_is_no_key_is_refused_when_set(target, name, message):
    """cfg.optim.learning_rate = 1e-4 (transformers' name) made a new attribute that to_dict, and so train(),
    left out: the run trained at the default lr without a word. Fields set as usual still work."""
    cfg = TrainConfig()
    obj = cfg if target == "config" else getattr(cfg, target)
    with pytest.raises(AttributeError, match=message):
        setattr(obj, name, 1e-4)
    assert name not in vars(obj)
    cfg.optim.lr = 1e-4
    cfg.train = type(cfg.train)(max_steps=3)
    assert from_dict(cfg.to_dict()).optim.lr == 1e-4 and from_dict(cfg.to_dict()).train.max_steps == 3


@pytest.mark.parametrize("value", [None, {"enabled": False}, "off"])
def test_a_config_section_set_to_another_type_is_refused(value):
    """cfg.lora = None (meaning "no LoRA") reached train() as the section's defaults: a LoRA run, without a word."""
    from chronicals.config import LoraSection

    with pytest.raises(TypeError, match=r"TrainConfig\.lora must be a LoraSection \(e\.g\. LoraSection\("
                                        r"enabled=\.\.\.\), or set one key: cfg\.lora\.enabled = \.\.\.\), got "):
        TrainConfig().lora = value
    with pytest.raises(TypeError, match=r"TrainConfig\.lora must be a LoraSection"):
        TrainConfig(lora=value)
    cfg = TrainConfig()
    cfg.lora = LoraSection(enabled=False)
    assert from_dict(cfg.to_dict()).lora.enabled is False
