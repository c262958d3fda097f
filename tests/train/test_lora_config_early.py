"""A bad LoRA setting is a bad config (exit 2): one that no model can take fails when the config is read, before any
model loads (minutes at 8B), naming the file, line and key; one that does not fit this model (a lora.targets name
that matches none of its modules) fails once its config.json is read, on the decoder built from it on the meta device,
before the data is read and the weights load, still as exit 2, naming the key and model.path. The rules live once, in
config.py (LORA_VALUE_RULES, lora_names_problem), and apply_lora checks its arguments with them (lora.inject.check_lora,
which a model passed to train() meets too)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from train_helpers import tiny_config, tiny_model

import chronicals.train.loop as loop
from chronicals.cli import main
from chronicals.config import LORA_VALUE_RULES, ConfigError, LoraSection, load_config
from chronicals.lora import apply_lora, load_adapter, save_adapter
from chronicals.train.setup import prepare_model


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the LoRA settings were checked")

    monkeypatch.setattr(loop, "load_base", refuse)
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)


# (override, key named, words of the fix); the last four passed the config and failed after the model load (exit 3)
NO_MODEL_TAKES = [
    ("lora.rank=0", "lora.rank=0", "an integer >= 1"),
    ("lora.rank=abc", "lora.rank='abc'", "expected an integer"),
    ("lora.alpha=-1", "lora.alpha=-1.0", "a finite number > 0"),
    ("lora.alpha=nan", "lora.alpha=nan", "a finite number"),
    ("lora.dropout=1.5", "lora.dropout=1.5", "a number in [0, 1)"),
    ("lora.dropout=x", "lora.dropout='x'", "expected a number"),
    ("lora.plus_ratio=0", "lora.plus_ratio=0.0", "a number > 0"),
    ("lora.targets=[]", "lora.targets=[]", "a non-empty list of module names"),
    ("lora.targets=[q_proj, lm_head]", "lora.targets=['q_proj', 'lm_head']",
     "train it in full with lora.modules_to_save=[lm_head]"),
    ("lora.modules_to_save=[v_proj]", "lora.modules_to_save=['v_proj']",
     "['v_proj'] also in lora.targets; a module is either adapted or trained in full"),
    ("lora.modules_to_save=[lm_head, 'layers.*']", "lora.modules_to_save=['lm_head', 'layers.*']",
     "regular expressions are not read"),
    ("lora.modules_to_save=['']", "lora.modules_to_save=['']", "module names such as [lm_head]"),
]


@pytest.mark.parametrize("override, key, fix", NO_MODEL_TAKES, ids=[o for o, _, _ in NO_MODEL_TAKES])
def test_a_lora_value_no_model_takes_exits_2_before_the_model_loads(override, key, fix, tmp_path, no_model_load,
                                                                    capsys):
    assert main(["train", override, f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"error: command line: config {key} is invalid" in err and fix in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_yaml_file_names_the_line_of_the_lora_key(tmp_path, no_model_load, capsys):
    cfg = tmp_path / "lora.yaml"
    cfg.write_text("lora:\n  rank: 8\n  targets: [q_proj, v_proj]\n  modules_to_save: [q_proj]\n"
                   f"train:\n  out_dir: {tmp_path / 'run'}\n")
    assert main(["train", str(cfg)]) == 2
    assert f"error: {cfg}:4: config lora.modules_to_save=['q_proj'] is invalid" in capsys.readouterr().err
    cfg.write_text("lora:\n  rank: 0\n")
    assert main(["train", str(cfg)]) == 2
    assert f"error: {cfg}:2: config lora.rank=0 is invalid: expected an integer >= 1" in capsys.readouterr().err


TINY = ["data.max_seq_len=128"]  # tiny_model's max_position_embeddings


def _tiny_loads(monkeypatch, data: bool = True) -> list:
    """model.path=tiny: loop loads tiny_model() (its config first, with the embedded SmolLM2 tokenizer, which reads
    the demo data before the weights load); returns a list that holds "weights" for each weights load and "data" for
    each read of the data. ``data=False``: reading the data fails the test."""
    from smollm2_tokenizer import smollm2_tokenizer

    loaded = []
    real = loop.build_loaders

    def build_loaders(*a, **k):
        loaded.append("data")
        assert data, "the data was read before the config was checked against the model"
        return real(*a, **k)

    monkeypatch.setattr(loop, "load_base_tokenizer", lambda *a, **k: (smollm2_tokenizer(), tiny_model().config))
    monkeypatch.setattr(loop, "load_base", lambda *a, **k: loaded.append("weights") or tiny_model())
    monkeypatch.setattr(loop, "build_loaders", build_loaders)
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)
    return loaded


# (lora overrides, key, words of apply_lora's message): names only the loaded model can refuse
DOES_NOT_FIT = [
    (["lora.targets=[nope_proj]"], "lora.targets", "matched no nn.Linear"),
    (["lora.targets=[q_proj, embed_tokens]"], "lora.targets", "that are not nn.Linear"),
    (["lora.modules_to_save=[nope]"], "lora.modules_to_save", "entries ['nope'] match no module of the model"),
    (["lora.modules_to_save=[self_attn]"], "lora.modules_to_save", "hold LoRA targets"),
]


@pytest.mark.parametrize("overrides, key, words", DOES_NOT_FIT, ids=[o[0] for o, _, _ in DOES_NOT_FIT])
def test_a_lora_name_that_does_not_fit_the_model_exits_2_before_the_data_and_the_weights(overrides, key, words,
                                                                                        tmp_path, monkeypatch, capsys):
    """Only the model knows its module names, and its config.json tells them: the decoder built from it on the meta
    device takes apply_lora's checks. Refused as the config's fault (exit 2, was 3), before the data is read and the
    weights load (it was after both: minutes at 8B)."""
    loaded = _tiny_loads(monkeypatch, data=False)
    assert main(["train", *overrides, "model.path=tiny", *TINY, f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"error: config {key} does not fit model.path=tiny: apply_lora: " in err and words in err, err
    assert f"in a config: {key}" in err and "Traceback" not in err and "internal error" not in err
    assert loaded == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, key, words", DOES_NOT_FIT, ids=[o[0] for o, _, _ in DOES_NOT_FIT])
def test_a_lora_name_that_does_not_fit_the_model_keeps_the_key_apply_lora_named(overrides, key, words, tmp_path):
    """prepare_model re-raises apply_lora's refusal as the config's fault with apply_lora's key (ConfigError.key),
    lora.modules_to_save for a modules_to_save entry; it was lora.targets for every refusal, the text still saying
    lora.modules_to_save."""
    cfg = load_config(None, ["model.device=cpu", "model.impl=torch", "lora.enabled=true", *overrides])
    model = tiny_model()
    model.chronicals_base = "tiny"  # as load_model records it; a model built in the program is named as passed
    with pytest.raises(ConfigError, match=rf"^config {key} does not fit model.path=") as e:
        prepare_model(model, cfg, torch.device("cpu"), torch.float64)
    assert e.value.key == key and words in str(e.value)
    # refused before the model is touched: a model passed to train() is left as it was (it was moved to the dtype)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())


def test_a_peft_adapter_whose_names_do_not_fit_is_still_bad_input_not_a_config_error(tmp_path):
    """load_adapter names its adapter_config.json (chat / export exit 3: a bad file), not a config key."""
    model = tiny_model()
    apply_lora(model, r=2, target_modules=["q_proj"])
    save_adapter(model, tmp_path / "adapter")
    conf = tmp_path / "adapter" / "adapter_config.json"
    conf.write_text(json.dumps(dict(json.loads(conf.read_text()), target_modules=["nope_proj"])))
    with pytest.raises(ValueError, match=r"adapter_config.json: apply_lora: target_modules=.*matched no") as e:
        load_adapter(tiny_model(), tmp_path / "adapter")
    assert not isinstance(e.value, ConfigError)


@pytest.mark.parametrize("name, arg, bad", [("rank", "r", 0), ("alpha", "alpha", 0.0), ("alpha", "alpha", -2.0),
                                            ("dropout", "dropout", 1.0), ("dropout", "dropout", -0.5)])
def test_the_config_and_apply_lora_refuse_the_same_values_in_the_same_words(name, arg, bad):
    expected = LORA_VALUE_RULES[name][1]
    with pytest.raises(ConfigError, match=rf"lora\.{name}=.* is invalid: expected {re.escape(expected)}") as c:
        LoraSection(**{name: bad})
    with pytest.raises(ConfigError, match=rf"apply_lora: {arg}=.* must be {re.escape(expected)}") as a:
        apply_lora(tiny_model(), **{arg: bad})
    assert c.value.key == a.value.key == f"lora.{name}"


def test_apply_lora_refuses_names_no_model_takes_before_touching_the_model():
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"target_modules=\['lm_head'\] must be module names other than lm_head"):
        apply_lora(model, target_modules=["lm_head"])
    with pytest.raises(ConfigError, match=r"modules_to_save=\('q_proj',\) must be names that are not LoRA targets"):
        apply_lora(model, target_modules=["q_proj"], modules_to_save=("q_proj",))
    assert all(p.requires_grad for p in model.parameters()) and getattr(model, "lora_config", None) is None
    rec = apply_lora(model, target_modules=r".*\.q_proj", modules_to_save="lm_head")  # a regex: the model decides
    assert rec.lora_modules and "lm_head" in rec.saved_modules


def test_good_lora_settings_still_load():
    c = load_config(None, ["lora.targets=all-linear", "lora.modules_to_save=[embed_tokens, lm_head]", "lora.rank=1",
                           "lora.dropout=0", "lora.plus_ratio=1"])
    assert c.lora.modules_to_save == ["embed_tokens", "lm_head"] and len(c.lora.targets) == 7


def test_a_misspelled_target_beside_good_ones_exits_2_before_the_data_and_the_weights(tmp_path, monkeypatch,
                                                                                     capsys):
    """lora.targets=[q_proj, gate_porj]: the typo matched nothing and the run trained q_proj alone (exit 0), its
    adapter_config.json recording gate_porj as a target; every name the config lists must match a module. The
    refusal lists the model's linear layers to pick from, without lm_head (it named lm_head, which apply_lora
    refuses as a target). Said from the config, before the data and the weights (it was after both)."""
    loaded = _tiny_loads(monkeypatch, data=False)
    assert main(["train", "lora.targets=[q_proj, gate_porj]", "model.path=tiny", *TINY,
                 f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert loaded == [], loaded
    assert "error: config lora.targets does not fit model.path=tiny: " in err and "['gate_porj']" in err, err
    assert "Traceback" not in err and not (tmp_path / "run" / "adapter").exists()
    # the names to pick from are the decoder's projections; lm_head is no LoRA target (lora.modules_to_save is)
    named = re.search(r"its linear layers are named (\[.*?\])", err)
    assert named and named.group(1) == str(["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                            "v_proj"]), err


def test_a_lora_model_under_lora_disabled_is_a_config_error_before_any_step(tmp_path, docs):
    """Session 26: a model with adapters passed to train() with lora.enabled=false had every parameter unfrozen, and
    the first step failed inside the LoRA autograd function ("the base weight and bias must be frozen"), naming
    neither the setting nor the fix. Merged first, it fine-tunes in full."""
    from train_helpers import SyntheticLoader, tiny_config

    from chronicals.lora import merge_lora
    from chronicals.train import train

    model = tiny_model(0)
    apply_lora(model, r=2, alpha=4)
    with pytest.raises(ConfigError, match="has LoRA adapters .* lora.enabled=false .* set lora.enabled=true") as e:
        train(tiny_config(tmp_path, train__max_steps=1), model=model, train_loader=SyntheticLoader(docs))
    assert e.value.key == "lora.enabled"
    res = train(tiny_config(tmp_path, train__max_steps=1), model=merge_lora(model), train_loader=SyntheticLoader(docs))
    assert res.status == "completed"


def test_a_lora_model_under_lora_disabled_is_refused_as_such_whatever_lora_keys_are_set(tmp_path, caplog):
    """The lora.enabled refusal of an adapted model under full fine-tuning holds with lora.* keys set beside it: the
    comparison of the config's lora values with the adapters' is for lora.enabled=true only. Run under
    lora.enabled=false too, it refused with "asks for others: lora.rank=8" and advised the adapters' values, which
    still fail."""
    model = tiny_model()
    apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    for over in ({"lora__rank": 8}, {}):
        with caplog.at_level("WARNING", logger="chronicals"), pytest.raises(ConfigError) as e:
            prepare_model(model, tiny_config(tmp_path, **over), torch.device("cpu"), torch.float32)
        assert "but lora.enabled=false asks for full fine-tuning; set lora.enabled=true" in str(e.value), str(e.value)
        assert e.value.key == "lora.enabled"
    assert "has its own LoRA adapters" not in caplog.text


RUN = ["eval.every=0", "eval.qa=false", "logging.progress=false", "data.batch_size=2", "train.save_every=1"]


@pytest.mark.parametrize("again, said", [
    (["lora.rank=8"], "holds LoRA adapters trained with lora.rank=4 (this run: 8)"),
    (["lora.alpha=64"], "holds LoRA adapters trained with lora.alpha=32.0 (this run: 64.0)"),
    (["lora.enabled=false"], "was written by a LoRA run (lora.enabled true), and this run is a full fine-tuning run "
                             "(lora.enabled false): its weights are not this run's trainable ones; set "
                             "lora.enabled=true to resume it"),
])
def test_a_resume_under_other_adapter_settings_exits_before_the_model_loads(again, said, tiny_base, tmp_path,
                                                                           monkeypatch, capsys):
    """lora.rank was refused by load_checkpoint's shape check, other adapter settings by the check after it: both
    after the model loaded and the data was tokenized. The checkpoint's config is read before either now."""
    out = tmp_path / "run"
    first = {"lora.rank": "4", "lora.alpha": "32"}
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "train.max_steps=1", *RUN,
                 *(f"{k}={v}" for k, v in first.items())]) == 0
    capsys.readouterr()

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the checkpoint's settings were compared")

    monkeypatch.setattr(loop, "load_base", refuse)
    monkeypatch.setattr(loop, "build_loaders", refuse)
    kept = [f"{k}={v}" for k, v in first.items() if not any(a.startswith(k + "=") for a in again)]
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "train.max_steps=2", "train.resume=auto",
                 *RUN, *kept, *again]) == 3
    assert said in capsys.readouterr().err
