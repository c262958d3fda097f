"""What the config asks reaches the run: lora.rslora, lora.group, lora.dropout and lora.modules_to_save of a passed
model's adapters, train.seed (LoRA initialisation and batch order), model options, model.dtype=auto, the demo's
system prompt; what setup refuses before the first step, removes after a failed setup, and leaves alone; reruns of a
finished run."""

from __future__ import annotations

import json
import types

import pytest
import torch

from chronicals.config import TrainConfig
from chronicals.train import train
from chronicals.train.guards import check_ids_in_vocab, earlier_finals

from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model

LORA = dict(lora__enabled=True, lora__rank=4, lora__alpha=8.0, lora__targets=["q_proj", "v_proj"])


def test_lora_rslora_reaches_the_adapters(tmp_path):
    """lora.rslora=true trains and saves rank-stabilised adapters (scaling alpha/sqrt(r)), not plain ones (alpha/r)
    under a config that says rslora."""
    cfg = tiny_config(tmp_path, lora__rslora=True, train__max_steps=1, train__save_final=True, **LORA)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
    got = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert got["use_rslora"] is True, got


def test_a_final_adapter_path_that_is_a_file_is_refused_before_training(tmp_path):
    """A file at out_dir/adapter is refused before the first step, not found by save_final after the whole run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "adapter").write_text("my notes\n")
    cfg = tiny_config(tmp_path, train__max_steps=2, train__save_final=True, **LORA)
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
    assert (out / "adapter").read_text() == "my notes\n"
    assert not (out / "metrics.jsonl").exists() or "train" not in (out / "metrics.jsonl").read_text()


def test_a_rerun_at_the_last_step_under_save_final_false_writes_no_final_directory(tmp_path):
    """A rerun of a finished run (train.resume=auto finds its last checkpoint, nothing to train) under
    train.save_final=false writes no out_dir/adapter or out_dir/model, as the run itself did not."""
    for lora in (False, True):
        out = tmp_path / str(lora)
        over = dict(train__max_steps=2, train__save_every=1, train__save_final=False, **(LORA if lora else {}))
        train(tiny_config(out, **over), model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
        result = train(tiny_config(out, train__resume="auto", **over), model=tiny_model(),
                       train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
        assert result.start_step == result.step == 2
        assert not (out / "run" / "adapter").exists() and not (out / "run" / "model").exists()
        assert result.final_dir is None


def test_a_rerun_at_the_last_step_under_plot_false_draws_no_loss_curve(tmp_path):
    """A rerun of a finished run under logging.plot=false draws no out_dir/loss.png, as the run itself did not; the
    same rerun under logging.plot=true draws the curve the run is missing."""
    over = dict(train__max_steps=1, train__save_every=1, logging__plot=False)
    train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
    result = train(tiny_config(tmp_path, train__resume="auto", **over), model=tiny_model(),
                   train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
    assert result.start_step == result.step == 1
    assert result.plot is None and not (tmp_path / "run" / "loss.png").exists()
    over["logging__plot"] = True
    result = train(tiny_config(tmp_path, train__resume="auto", **over), model=tiny_model(),
                   train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))
    assert result.plot == tmp_path / "run" / "loss.png" and result.plot.is_file()


def test_the_demo_training_copy_carries_the_system_prompt_the_questions_are_asked_with(tmp_path):
    """The demo trains under the same system message its held-out questions are asked and scored with; without it
    SmolLM2's template puts its own default system prompt into every training example."""
    from chronicals.train.qa import heldout_system_prompt
    from chronicals.train.setup import data_files

    cfg = tiny_config(tmp_path, data__path="demo", data__eval_path="auto")
    train_files, eval_file, qa = data_files(cfg, tmp_path / "run")
    first = json.loads(train_files[0].read_text().splitlines()[0])["messages"][0]
    assert cfg.data.system_prompt and first == {"role": "system", "content": cfg.data.system_prompt}
    assert heldout_system_prompt(cfg.data) == cfg.data.system_prompt


def test_a_system_prompt_is_said_to_do_nothing_only_beside_ones_own_records(tmp_path, caplog):
    """data.system_prompt set to another text is warned to have no effect on the user's own training records, but
    not beside the demo data, whose training copy is written with it (demo users were told it did nothing)."""
    import logging

    from chronicals.train.setup import data_files

    cfg = tiny_config(tmp_path, data__path="demo", data__system_prompt="Answer in French.")
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        train_files, _, _ = data_files(cfg, tmp_path / "run")
    assert "has no effect" not in caplog.text, caplog.text
    first = json.loads(train_files[0].read_text().splitlines()[0])["messages"][0]
    assert first == {"role": "system", "content": "Answer in French."}
    own = tmp_path / "own.jsonl"
    own.write_text('{"text": "hello"}\n')
    cfg = tiny_config(tmp_path, data__path=str(own), data__eval_path="", data__system_prompt="Answer in French.")
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        data_files(cfg, tmp_path / "run2")
    assert "data.system_prompt='Answer in French.' has no effect on your training records" in caplog.text


def test_the_system_prompt_warning_says_whether_the_held_out_questions_use_it(tmp_path, caplog):
    """The warning that data.system_prompt does nothing for one's own training records says whether data.eval_path's
    QA questions use it: "(which data.eval_path has)" beside a QA held-out file, "(data.eval_path has none)" beside a
    text one or none (swapped, it told a user with QA questions that none use it)."""
    import logging

    from chronicals.train.setup import data_files

    own = tmp_path / "own.jsonl"
    own.write_text('{"text": "hello there"}\n')
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n')
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "held out"}\n')
    said = {}
    for name, eval_path in (("qa", qa), ("text", text), ("none", "")):
        caplog.clear()
        cfg = tiny_config(tmp_path, data__path=str(own), data__eval_path=str(eval_path),
                          data__system_prompt="Be kind.")
        with caplog.at_level(logging.WARNING, logger="chronicals.train"):
            data_files(cfg, tmp_path / "run")
        said[name] = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(said["qa"]) == 1 and "used only for the demo data and held-out QA questions (which data.eval_path " \
        "has). Put a system message" in said["qa"][0], said
    for name in ("text", "none"):
        assert len(said[name]) == 1 and "QA questions (data.eval_path has none). Put" in said[name][0], said


def test_eval_path_auto_beside_ones_own_data_is_no_held_out_set(tmp_path):
    """data.eval_path=auto holds out the demo's questions only under data.path=demo: beside one's own training
    records it is no held-out set (the demo's questions would score a model trained on other data)."""
    from chronicals.train.setup import data_files

    own = tmp_path / "own.jsonl"
    own.write_text('{"text": "hello there"}\n')
    cfg = tiny_config(tmp_path, data__path=str(own), data__eval_path="auto")
    assert data_files(cfg, tmp_path / "run") == ([own], None, None)


def test_a_directory_at_the_demo_copys_path_is_refused_with_the_fix(tmp_path):
    """A directory where a run writes its copy of the demo (out_dir/data/train.jsonl) is refused naming the fix
    (move it away or set another train.out_dir), not a bare '[Errno 21] Is a directory' from the write."""
    from chronicals.train.setup import data_files

    out = tmp_path / "run"
    (out / "data" / "train.jsonl").mkdir(parents=True)
    with pytest.raises(IsADirectoryError, match=r"train.jsonl is a directory: a run writes its copy of the data to "
                                                r"that file; move it away or set another train.out_dir"):
        data_files(tiny_config(tmp_path, data__path="demo"), out)


def test_a_passed_models_adapters_under_another_dropout_are_refused(tmp_path):
    """A model passed with adapters of dropout 0 under a config asking lora.dropout=0.1 is refused, not trained
    silently without the dropout asked for."""
    from chronicals.config import ConfigError
    from chronicals.lora import apply_lora

    model = tiny_model()
    apply_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), seed=0)
    cfg = tiny_config(tmp_path, train__max_steps=1, lora__dropout=0.1, **LORA)
    with pytest.raises(ConfigError, match=r"lora.dropout=0.1 \(the adapters': 0.0\)"):
        train(cfg, model=model, train_loader=SyntheticLoader(synthetic_docs(40, seed=1)))


def test_a_passed_models_adapters_without_rslora_under_lora_rslora_true_are_refused(tmp_path):
    """lora.rslora is compared with a passed model's adapters as rank, alpha and dropout are: adapters with plain
    alpha/r scaling under lora.rslora=true are refused naming lora.rslora, not trained under a config saying rslora."""
    from chronicals.config import ConfigError
    from chronicals.lora import apply_lora
    from chronicals.train.setup import prepare_model

    model = tiny_model()
    apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"), use_rslora=False)
    with pytest.raises(ConfigError, match=r"lora\.rslora=True \(the adapters': False\)") as e:
        prepare_model(model, tiny_config(tmp_path, lora__rslora=True, **LORA), torch.device("cpu"), torch.float32)
    assert e.value.key == "lora.rslora"


def test_a_passed_models_adapters_of_another_rank_are_refused_naming_lora_rank(tmp_path):
    """Adapters of rank 4 under lora.rank=8 are refused, not trained at rank 4 under a config saying 8."""
    from chronicals.config import ConfigError
    from chronicals.lora import apply_lora
    from chronicals.train.setup import prepare_model

    model = tiny_model()
    apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match=r"lora\.rank=8 \(the adapters': 4\)") as e:
        prepare_model(model, tiny_config(tmp_path, **dict(LORA, lora__rank=8)), torch.device("cpu"), torch.float32)
    assert e.value.key == "lora.rank"


def test_lora_dropout_reaches_new_adapters(tmp_path):
    """lora.dropout reaches the adapters setup injects (the dropout they train and save with)."""
    from chronicals.train.setup import prepare_model

    cfg = tiny_config(tmp_path, lora__dropout=0.1, **LORA)
    model = prepare_model(tiny_model(), cfg, torch.device("cpu"), torch.float32)
    assert model.lora_config.dropout == 0.1


def test_adapters_training_a_module_not_asked_for_are_refused(tmp_path, caplog):
    """A passed model whose adapters train lm_head and embed_tokens, under lora.modules_to_save=[lm_head], is refused
    naming lora.modules_to_save (it was trained silently, saving a module the config never asked for); with the key
    left at its default (none), the difference is a warning."""
    import logging

    from chronicals.config import ConfigError
    from chronicals.lora import apply_lora
    from chronicals.train.setup import _check_adapters_fit

    model = tiny_model()
    apply_lora(model, r=16, alpha=32, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"), modules_to_save=("lm_head", "embed_tokens"))
    assert sorted(model.lora_config.saved_modules) == ["lm_head", "model.embed_tokens"]
    cfg = tiny_config(tmp_path, lora__enabled=True, lora__modules_to_save=["lm_head"])
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save=\['lm_head'\] \(the adapters train ") as e:
        _check_adapters_fit(model, cfg)
    assert e.value.key == "lora.modules_to_save"
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        _check_adapters_fit(model, tiny_config(tmp_path, lora__enabled=True))
    assert "lora.modules_to_save=[] (the adapters train" in caplog.text


def test_adapters_saving_a_tied_lm_head_fit_modules_to_save_lm_head(tmp_path, caplog):
    """On a model with tied embeddings, adapters saving lm_head also save its tied partner model.embed_tokens
    (apply_lora adds it); a config asking for lora.modules_to_save=[lm_head] asks for exactly those adapters and
    trains them without an error or a warning. Counted as "a module not asked for", the tied partner got the model's
    own adapters refused under the very config they were made with."""
    import logging

    import transformers

    from chronicals.lora import apply_lora
    from chronicals.models import CausalLM, ModelConfig
    from chronicals.train.setup import prepare_model

    from train_helpers import VOCAB

    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  tie_word_embeddings=True)
    model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)
    apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"), modules_to_save=("lm_head",))
    assert sorted(model.lora_config.saved_modules) == ["lm_head", "model.embed_tokens"]
    with caplog.at_level(logging.WARNING, logger="chronicals"):
        prepare_model(model, tiny_config(tmp_path, lora__modules_to_save=["lm_head"], **LORA), torch.device("cpu"),
                      torch.float32)
    assert "LoRA adapters" not in caplog.text, caplog.text


def test_train_seed_sets_the_lora_initialisation(tmp_path):
    """Runs under other train.seed values start from other LoRA A matrices (a seed sweep was otherwise no sweep of
    the adapters' start)."""
    from chronicals.train.setup import prepare_model

    def lora_a(seed):
        cfg = tiny_config(tmp_path, train__seed=seed, **LORA)
        model = prepare_model(tiny_model(), cfg, torch.device("cpu"), torch.float32)
        return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "lora_A" in n])

    assert torch.equal(lora_a(1), lora_a(1)) and not torch.equal(lora_a(1), lora_a(2))


def test_train_seed_sets_the_training_batch_order(tmp_path):
    """train.seed shuffles the training batches (every seed gave seed 0's order without it)."""
    from smollm2_tokenizer import smollm2_tokenizer

    from chronicals.train.setup import build_loaders

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record number {i} " * 3}) + "\n" for i in range(40)))
    tok = smollm2_tokenizer()

    def order(seed):
        cfg = tiny_config(tmp_path, train__seed=seed, data__path=str(data), data__eval_path="", data__max_seq_len=32,
                          data__cache_dir="none")
        loader = build_loaders(cfg, tok, tmp_path / "run")[0]
        return [b.input_ids[0, :8].tolist() for b in loader]

    assert order(3) == order(3) and order(3) != order(4)


def test_data_num_proc_zero_reaches_load_dataset_as_auto():
    """data.num_proc=0 is "auto" (one process below 8 MB of data files, else up to 8): the trainer and chronicals
    eval pass load_dataset num_proc=None for it; 0 reads there as one process whatever the data's size."""
    from chronicals.config import DataSection
    from chronicals.train.setup import _dataset_options

    assert _dataset_options(DataSection())["num_proc"] is None
    assert _dataset_options(DataSection(num_proc=3))["num_proc"] == 3


def test_lora_group_false_gives_separate_adapters(tmp_path):
    """lora.group=false runs the projections as separate adapters."""
    from chronicals.train.setup import prepare_model

    def kinds(group):
        cfg = tiny_config(tmp_path, lora__group=group, **dict(LORA, lora__targets=["q_proj", "k_proj", "v_proj"]))
        model = prepare_model(tiny_model(), cfg, torch.device("cpu"), torch.float32)
        return sum(getattr(m, "lora_qkv", None) is not None for m in model.modules())  # the blocks' LoRAGroups

    assert kinds(True) == 2 and kinds(False) == 0


def test_model_loss_vocab_parts_and_attention_reach_the_model(tmp_path):
    """model.loss_vocab_parts and model.attention reach the model's options, not dropped for the defaults."""
    from chronicals.train.setup import prepare_model

    cfg = tiny_config(tmp_path, model__loss_vocab_parts=3, model__attention="flash")
    model = prepare_model(tiny_model(), cfg, torch.device("cpu"), torch.float32)
    assert model.opts.loss_vocab_parts == 3
    assert model.opts.attention == "flash"


def test_model_checkpoint_layers_reaches_the_model(tmp_path):
    """model.checkpoint_layers=k (model.checkpointing left false) checkpoints the first k layers; model.checkpointing
    =true all of them. Passed model.checkpointing alone, checkpoint_layers did nothing and the run kept every
    activation."""
    from chronicals.train.setup import prepare_model

    model = prepare_model(tiny_model(layers=2), tiny_config(tmp_path, model__checkpoint_layers=1),
                          torch.device("cpu"), torch.float32)
    assert model.opts.checkpointed_layers(2) == 1, model.opts.checkpointing
    model = prepare_model(tiny_model(layers=2), tiny_config(tmp_path, model__checkpointing=True),
                          torch.device("cpu"), torch.float32)
    assert model.opts.checkpointed_layers(2) == 2


def test_layer_counts_equal_to_the_models_layers_are_not_warned_of(tmp_path, caplog):
    """model.checkpoint_layers and model.gate_up_layers equal to the model's layer count are valid (every layer, as
    asked) and not warned of; only a count past the layers is ("all of them are checkpointed" / "all of them rebuild
    gate|up" was said for exactly the layer count)."""
    import logging

    from chronicals.train.setup import prepare_model

    gate_up = dict(model__recompute=["norm", "swiglu", "gate_up"])
    for key, over in (("checkpoint_layers", {}), ("gate_up_layers", gate_up)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals"):
            model = prepare_model(tiny_model(layers=2), tiny_config(tmp_path, **{f"model__{key}": 2}, **over),
                                  torch.device("cpu"), torch.float32)
        assert key not in caplog.text, caplog.text
        with caplog.at_level(logging.WARNING, logger="chronicals"):
            prepare_model(tiny_model(layers=2), tiny_config(tmp_path, **{f"model__{key}": 3}, **over),
                          torch.device("cpu"), torch.float32)
        assert f"model.{key}=3 but the model has 2 decoder layers" in caplog.text, caplog.text
    assert model.opts.gate_up_layers == 2


def test_model_compile_reaches_the_model(tmp_path, monkeypatch, caplog):
    """model.compile=true compiles the decoder layers (CausalLM.compile_layers, stubbed here) and says so; false
    leaves them alone. The setting was otherwise never exercised: ignored, the run trained eager."""
    import logging

    from chronicals.train.setup import prepare_model

    calls = []
    for compile_ in (False, True):
        model = tiny_model()
        monkeypatch.setattr(model, "compile_layers", lambda: calls.append(compile_))
        with caplog.at_level(logging.INFO, logger="chronicals.train"):
            prepare_model(model, tiny_config(tmp_path, model__compile=compile_), torch.device("cpu"), torch.float32)
    assert calls == [True]
    assert "torch.compile on 2 decoder layers" in caplog.text


def test_a_passed_model_takes_the_runs_impl_dtype_recompute_and_training_mode(tmp_path):
    """prepare_model sets on a model passed to train() what the config asks, not what the model came with:
    model.impl; the run's dtype as well as its device (adapters included); model.gate_up_layers beside gate_up in
    model.recompute (without it, 0: every layer rebuilds gate|up); and training mode (load_model returns a model in
    eval mode, so LoRA dropout and any other dropout were off for the whole run without a word)."""
    from chronicals.train.setup import prepare_model

    model = tiny_model(dtype=torch.float32).set_impl("triton").eval()
    cfg = tiny_config(tmp_path, model__impl="torch", model__dtype="float64", model__recompute=["norm", "gate_up"],
                      model__gate_up_layers=1, **dict(LORA, lora__dropout=0.1))
    prepare_model(model, cfg, torch.device("cpu"), torch.float64)
    assert model.opts.impl == "torch"
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert model.opts.gate_up_layers == 1 and "gate_up" in model.opts.recompute
    assert model.training and all(m.training for m in model.modules())


def test_full_fine_tuning_warns_only_of_the_lora_keys_set(tmp_path, caplog):
    """Full fine-tuning (lora.enabled=false) names the lora.* keys set away from their defaults, and only those:
    lora.enabled itself is never listed (the warning fired on every full fine-tuning run)."""
    import logging

    from chronicals.train.setup import prepare_model

    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        prepare_model(tiny_model(), tiny_config(tmp_path), torch.device("cpu"), torch.float32)
    assert "but lora.enabled=false" not in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        prepare_model(tiny_model(), tiny_config(tmp_path, lora__rank=4), torch.device("cpu"), torch.float32)
    assert "lora.rank set, but lora.enabled=false: full fine-tuning" in caplog.text, caplog.text


def test_full_fine_tuning_trains_the_frozen_weights_of_a_passed_model_and_says_so(tmp_path, caplog):
    """lora.enabled=false unfreezes every weight of the model passed, naming the frozen ones in a warning."""
    import logging

    from chronicals.train.setup import prepare_model

    model = tiny_model()
    model.model.norm.weight.requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        prepare_model(model, tiny_config(tmp_path), torch.device("cpu"), torch.float32)
    assert "1 parameter tensors frozen in the model passed (e.g. model.norm.weight) train too" in caplog.text
    assert all(p.requires_grad for p in model.parameters())


def test_trainable_parameters_outside_the_adapters_are_named_three_and_counted(tmp_path):
    """A passed adapted model with weights unfrozen outside its adapters is refused naming the first three and
    counting the rest."""
    from chronicals.lora import apply_lora
    from chronicals.train.setup import prepare_model

    model = tiny_model()
    apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    for p in norms:
        p.requires_grad_(True)
    assert len(norms) > 3
    with pytest.raises(ValueError, match=rf"outside them: \[[^]]*\] and {len(norms) - 3} more; the adapter saves"):
        prepare_model(model, tiny_config(tmp_path, **LORA), torch.device("cpu"), torch.float32)


def test_model_dtype_auto_is_float32_on_cpu_and_bfloat16_on_cuda():
    """model.dtype=auto: bf16 weights on CUDA, fp32 on CPU (bf16 matmuls are slow there, fp64 doubles the memory);
    any other value is the torch dtype of that name."""
    from chronicals.train.setup import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("float64", torch.device("cpu")) is torch.float64
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


def test_model_device_follows_the_visible_cuda_devices(monkeypatch):
    """model.device=auto (and eval/chat --device auto) is CUDA whenever a CUDA device is visible, else the CPU;
    cuda or cuda:0 with none visible is a ConfigError naming the setting and the fix, not a device that fails at the
    first move. The suite runs on CPU machines, where an auto that always answered cpu passed every other test."""
    from chronicals.config import ConfigError
    from chronicals.train.setup import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=rf"^model.device={name} but no CUDA device is visible; "
                                              r"use model.device=cpu$"):
            resolve_device(name)
    with pytest.raises(ConfigError, match=r"^--device=cuda but no CUDA device is visible; use --device=cpu$") as e:
        resolve_device("cuda", key="--device")
    assert e.value.key == "--device"


@pytest.mark.parametrize("name, said", [("mps", "chronicals runs on cpu or cuda"), ("meta", "chronicals runs on cpu or cuda"),
                                        ("gpu0", "is not a device")])
def test_a_device_other_than_cpu_or_cuda_is_refused_naming_the_setting(name, said):
    """A device torch knows but chronicals does not run on, or no device at all, is a ConfigError naming the
    setting it came from (a config key or a CLI flag) and the values that work."""
    from chronicals.config import ConfigError
    from chronicals.train.setup import resolve_device

    with pytest.raises(ConfigError, match=rf"^--device={name}:? {said}; use auto, cpu, cuda or cuda:N$") as e:
        resolve_device(name, key="--device")
    assert e.value.key == "--device"


def test_a_cuda_index_past_the_visible_devices_is_refused_naming_those_that_exist(monkeypatch):
    """cuda:N is refused from N = the number of visible devices on, naming the ones that exist (cuda:0..cuda:{n-1}):
    cuda:1 on a one-GPU host was accepted and failed at the first move as "invalid device ordinal" (exit 4), and a
    range ending at cuda:{n} named a device that does not exist as one to use."""
    from chronicals.config import ConfigError
    from chronicals.train.setup import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match=r"^model.device=cuda:1 but 1 CUDA device is visible \(cuda:0\); "):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1", key="--device") == torch.device("cuda:1")
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda:2", key="--device")
    assert str(e.value) == ("--device=cuda:2 but 2 CUDA devices are visible (cuda:0..cuda:1); use --device=cuda or "
                            "one of those"), str(e.value)
    assert e.value.key == "--device"


def test_a_failed_setup_keeps_an_out_dir_that_was_there_empty(tmp_path):
    """A run that fails while setting up removes only what it wrote; an out_dir the user had made (empty) stays."""
    from chronicals.train.guards import remove_setup_files

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("x")  # what the failed run wrote
    remove_setup_files(out, set())
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_rerun_of_a_finished_run_without_its_metrics_file_completes(tmp_path):
    """A rerun that finds the run's last checkpoint, with logging.plot on and metrics.jsonl and loss.png gone (moved
    away, as an error about a bad line advises), completes instead of failing on the missing file. A metrics.jsonl
    gone or unreadable counts as closed: the closing evaluation is not run again, and no metrics.jsonl holding a
    lone "after" record is written over the gap."""
    from chronicals.train.finish import _closed

    docs = synthetic_docs(40, seed=1)
    over = dict(train__max_steps=2, train__save_every=1, logging__plot=True)
    held = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=held())
    run = tmp_path / "run"
    assert _closed(run, 2) and not _closed(run, 3)
    (run / "metrics.jsonl").write_text('not a record\n{"kind": "train", "step": 1}\n')
    assert _closed(run, 2)
    (run / "metrics.jsonl").unlink()
    (run / "loss.png").unlink(missing_ok=True)
    result = train(tiny_config(tmp_path, train__resume="auto", **over), model=tiny_model(),
                   train_loader=SyntheticLoader(docs), eval_loader=held())
    assert result.status == "completed" and result.step == 2 and result.eval_loss_after is None
    assert not (run / "metrics.jsonl").exists()


def test_an_earlier_final_model_dir_holding_model_path_is_kept(tmp_path):
    """A final model/ that holds model.path (here a single weights file, e.g. a GGUF saved under a Hugging Face file
    name) is never deleted by a new run in that out_dir: it is the very model being trained."""
    out = tmp_path / "run"
    final = out / "model"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"GGUF....")
    cfg = TrainConfig()
    cfg.model.path = str(final / "model.safetensors")
    cfg.train.out_dir = str(out)
    cfg.lora.enabled = True
    assert earlier_finals(cfg, out, None) == []


def test_a_linked_final_directory_is_no_earlier_final_to_remove(tmp_path):
    """A link at out_dir/adapter to a folder elsewhere is not this out_dir's earlier final: it is not listed for
    removal (the loop would then say "removed" of it, and rmtree(ignore_errors) silently does nothing to a link)."""
    out = tmp_path / "run"
    out.mkdir()
    elsewhere = tmp_path / "kept"
    elsewhere.mkdir()
    (elsewhere / "adapter_config.json").write_text("{}")
    (out / "adapter").symlink_to(elsewhere, target_is_directory=True)
    cfg = TrainConfig()
    cfg.train.out_dir = str(out)
    cfg.lora.enabled = True
    assert earlier_finals(cfg, out, None) == []


def test_resuming_ones_own_checkpoint_keeps_only_ones_own_kind_of_final_directory(tmp_path):
    """A run that continues its own checkpoint keeps its own kind's final directory (its history wrote it) but not
    the other kind's: a LoRA run resumed in an out_dir that also holds an earlier full run's model/ lists that
    model/ for removal, or it would sit beside the LoRA run's config.yaml though this run never wrote it."""
    out = tmp_path / "run"
    own = out / "checkpoints" / "step-000002"
    own.mkdir(parents=True)
    (own / "state.pt").write_bytes(b"x")
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")
    cfg = TrainConfig()
    cfg.train.out_dir = str(out)
    cfg.lora.enabled = True
    assert earlier_finals(cfg, out, own) == [out / "model"]  # adapter/ is this run's; model/ an earlier full run's
    assert earlier_finals(cfg, out, None) == [out / "adapter", out / "model"]  # a fresh run continues neither
    cfg.lora.enabled = False
    assert earlier_finals(cfg, out, own) == [out / "adapter"]


def test_a_token_id_equal_to_the_vocabulary_size_is_refused():
    """Token id V of a V-row embedding has no row either; it is the one clear error, not an IndexError from the embedding
    (a device-side assert on CUDA)."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
    check_ids_in_vocab(model, 99, "the training data holds token id")
    with pytest.raises(ValueError, match="holds token id 100, but the model's vocabulary has 100 entries"):
        check_ids_in_vocab(model, 100, "the training data holds token id")
