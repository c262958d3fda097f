"""The training loop's setup on a tiny random decoder: what a run refuses or says before it trains (paths, lengths,
settings that do nothing, kernels this machine lacks), and models passed to train() ready-made."""

from __future__ import annotations

import pytest
import torch

from chronicals.config import ConfigError
from chronicals.train import train

from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model


def test_max_seq_len_past_the_model_context_is_refused(tmp_path, docs, caplog):
    """As chronicals eval --max-seq-len: it was a warning, and data.max_seq_len=100000 (a typo) on a 512-token model
    was killed for memory on the CPU with no error line (found in a walk through the commands)."""
    from chronicals.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.max_seq_len=256 is more than the model can attend to "
                                          r"\(max_position_embeddings=128\).*use at most 128, or.*config.json") as e:
        train(tiny_config(tmp_path, train__max_steps=1, data__max_seq_len=256), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert e.value.key == "data.max_seq_len"
    # the embedded model (a .gguf, named by its short name) has no config.json to edit: the message says how to get one
    assert "chronicals export --model smollm2-135m-instruct --out DIR; then model.path=DIR" in str(e.value)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"in {str(hf_dir / 'config.json')}$"):
        train(tiny_config(tmp_path / "c", train__max_steps=1, data__max_seq_len=256, model__path=str(hf_dir)),
              model=tiny_model(), train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path / "b", train__max_steps=1, data__max_seq_len=128), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert "max_position_embeddings" not in caplog.text


def test_a_final_directory_holding_other_files_is_refused_before_training(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=1, train__save_final=True)
    final = tmp_path / "run" / "model"
    final.mkdir(parents=True)
    (final / "notes.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"model exists and holds files this save would delete \(notes.md\)"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
    assert (final / "notes.md").read_text() == "mine"


def test_a_missing_model_path_names_the_key(tmp_path, monkeypatch):
    """model.path that does not exist: the error names the key and where a relative path was looked for, as
    data.path's does (load_model alone said only the path)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(FileNotFoundError, match=rf"model.path=no/model: no such file or directory \(relative paths "
                                                rf"are read from the working directory, {tmp_path}\); set model.path"):
        train(tiny_config(tmp_path, data__path="train.jsonl", model__path="no/model"))
    with pytest.raises(FileNotFoundError, match=r"model.path=/no/model: no such file or directory; set model.path .*"
                                                r"smollm2-135m-instruct"):
        train(tiny_config(tmp_path, data__path="train.jsonl", model__path="/no/model"))


def test_a_missing_data_path_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """data.path / data.eval_path that do not exist: one error naming the key, before any model loading
    (minutes at 8B) and without creating train.out_dir."""
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the data path was checked")
    monkeypatch.setattr("chronicals.train.loop.load_base", no_loading)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"data.path=nope.jsonl: no such file or directory \(relative paths "
                                                rf"are read from the working directory, {tmp_path}\); fix data.path"):
        train(tiny_config(tmp_path, data__path="nope.jsonl"))
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(FileNotFoundError, match=r"data.eval_path=/no/held.jsonl: no such file or directory; fix"):
        train(tiny_config(tmp_path, data__path="train.jsonl", data__eval_path="/no/held.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"data.path=/data/\*.jsonl: no such file or directory; glob patterns "
                                                r"are not expanded: give the directory that holds the files; fix"):
        train(tiny_config(tmp_path, data__path="/data/*.jsonl"))
    # "auto" means something for data.eval_path only: data.path=auto is a path like any other (it went unchecked)
    with pytest.raises(FileNotFoundError, match=r"data.path=auto: no such file or directory .*; fix data.path"):
        train(tiny_config(tmp_path, data__path="auto"))
    assert not (tmp_path / "run").exists()
    not_a_checkpoint = tmp_path / "elsewhere"
    not_a_checkpoint.mkdir()
    with pytest.raises(ConfigError, match=r"train.resume=.*elsewhere holds no checkpoint \(no state.pt\)"):
        train(tiny_config(tmp_path, data__path="train.jsonl", train__resume=str(not_a_checkpoint)))
    with pytest.raises(ConfigError, match=r"train.resume=.*train.jsonl is a file, not a checkpoint; give a "
                                          r"checkpoint directory \(out_dir/checkpoints/step-N\) or its state.pt"):
        train(tiny_config(tmp_path, data__path="train.jsonl", train__resume=str(tmp_path / "train.jsonl")))
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match=r"train.out_dir=.*/data/run is inside data.path=data, whose files are all "
                                         r"read as data; put train.out_dir outside data"):
        train(tiny_config(tmp_path, data__path="data", train__out_dir=str(tmp_path / "data" / "run")))


class _NoBatches(SyntheticLoader):
    def __len__(self):
        return 0


def test_a_run_that_fails_while_setting_up_leaves_out_dir_as_it_found_it(tmp_path, docs):
    """A failure before the first step removes what the run wrote (config.yaml, metrics.jsonl, data copies)
    and the out_dir it created; what was there before stays, and a refused resume keeps the run's config.yaml."""
    with pytest.raises(ValueError, match="yields no batches"):
        train(tiny_config(tmp_path), model=tiny_model(), train_loader=_NoBatches(docs))
    assert not (tmp_path / "run").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.md").write_text("mine")
    with pytest.raises(ValueError, match="yields no batches"):
        train(tiny_config(tmp_path), model=tiny_model(), train_loader=_NoBatches(docs))
    assert sorted(p.name for p in run.iterdir()) == ["notes.md"]
    over = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__save_every=1, train__max_steps=1)
    train(tiny_config(tmp_path, lora__rank=4, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    written = (run / "config.yaml").read_text()
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"lora.rank=4 \(this run: 8\)"):
        train(tiny_config(tmp_path, lora__rank=8, **dict(over, train__resume="auto", train__max_steps=2)),
              model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert (run / "config.yaml").read_text() == written and "rank: 4" in written
    assert (run / "metrics.jsonl").read_text() == metrics and (run / "notes.md").read_text() == "mine"


def test_a_run_that_fails_while_setting_up_removes_the_folders_it_created_above_out_dir(tmp_path, docs):
    """train.out_dir=fresh/deeper/run failing in setup removed run/ and left the empty fresh/deeper/ it had made;
    a folder above that holds something stays."""
    out = tmp_path / "fresh" / "deeper" / "run"
    with pytest.raises(ValueError, match="yields no batches"):
        train(tiny_config(tmp_path, train__out_dir=str(out)), model=tiny_model(), train_loader=_NoBatches(docs))
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="yields no batches"):
        train(tiny_config(tmp_path, train__out_dir=str(out)), model=tiny_model(), train_loader=_NoBatches(docs))
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["keep.txt"]


def test_an_out_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    for out in ("afile", "afile/sub"):
        with pytest.raises(ConfigError, match=rf"train.out_dir=.*{out}: .*afile is a file, not a directory"):
            train(tiny_config(tmp_path, train__out_dir=str(tmp_path / out)))


def test_settings_that_do_nothing_are_named(tmp_path, docs, caplog):
    """lora.* keys under full fine-tuning and more checkpointed layers than the model has: a warning each."""
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=1, lora__rank=8, lora__modules_to_save=["lm_head"],
                          model__checkpoint_layers=5),
              model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert "lora.rank, lora.modules_to_save set, but lora.enabled=false" in caplog.text
    assert "model.checkpoint_layers=5 but the model has 2 decoder layers" in caplog.text


def test_overlap_grad_reduce_in_one_process_is_named(tmp_path, docs, caplog):
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=1, train__overlap_grad_reduce=True), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert "train.overlap_grad_reduce=true does nothing in one process" in caplog.text


def test_eval_every_without_held_out_data_is_named(tmp_path, docs, caplog):
    """eval.every=2 with no held-out set (data.eval_path='', or auto beside your own data) evaluated nothing, unsaid."""
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=4, eval__every=2), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert "eval.every=2 does nothing: the run has no held-out data" in caplog.text
    assert "data.eval_path" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="model.device=auto resolves to the GPU here")
def test_cuda_graphs_true_where_they_cannot_run_is_refused_before_loading(tmp_path, monkeypatch):
    """train.cuda_graphs=true with model.device=auto on a machine without a GPU failed only at the first step,
    after the model and data had loaded (model.device=cpu is refused when the config is read)."""
    import chronicals.train.loop as loop

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the setting was checked")

    monkeypatch.setattr(loop, "load_base", no_load)
    with pytest.raises(ValueError, match=r"train.cuda_graphs=true needs CUDA, but this run's device is cpu"):
        train(tiny_config(tmp_path, train__cuda_graphs="true", model__device="auto"),
              train_loader=SyntheticLoader(synthetic_docs(4)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_passed_adapted_model_trains_its_adapters_and_saved_modules_only(tmp_path, docs):
    """A config asking for lora.modules_to_save=[embed_tokens] on adapters that save nothing trained none, without
    a word; a parameter unfrozen by hand after apply_lora trained and was missing from adapter/ (a LoRA walk). The
    first is refused naming the key, the second naming the parameter; the adapters' own saved modules (with the
    tied partner apply_lora adds) pass."""
    from chronicals.lora import apply_lora

    over = dict(lora__enabled=True, lora__rank=4, lora__alpha=8, train__max_steps=1)
    model = tiny_model()
    apply_lora(model, r=4, alpha=8, seed=0)
    with pytest.raises(ConfigError, match=r"lora.modules_to_save=\['embed_tokens'\] \(the adapters train none\)"):
        train(tiny_config(tmp_path, lora__modules_to_save=["embed_tokens"], **over), model=model,
              train_loader=SyntheticLoader(docs))
    model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"trainable parameters outside them: \['model.norm.weight'\]"):
        train(tiny_config(tmp_path, **over), model=model, train_loader=SyntheticLoader(docs))
    saving = tiny_model()
    apply_lora(saving, r=4, alpha=8, seed=0, modules_to_save=["lm_head"])
    res = train(tiny_config(tmp_path / "ok", lora__modules_to_save=["lm_head"], **over), model=saving,
                train_loader=SyntheticLoader(docs))
    assert res.status == "completed"


def test_a_passed_model_needs_a_tokenizer_and_its_adapters_must_fit_the_config(tmp_path, docs, caplog):
    """train(cfg, model=m) without a tokenizer said 'needs a fast tokenizer; got NoneType' after it had injected
    LoRA into m; a retry with another rank then trained the first rank's adapters without a word. The tokenizer is
    asked for before anything changes, and adapters that do not fit lora.* are refused naming the keys."""
    from chronicals.lora import apply_lora

    model = tiny_model()
    with pytest.raises(TypeError, match=r"train\(config, model=\.\.\.\) needs tokenizer=\.\.\. too"):
        train(tiny_config(tmp_path, lora__enabled=True), model=model)
    assert getattr(model, "lora_config", None) is None and not (tmp_path / "run").exists()
    apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    over = dict(lora__enabled=True, train__max_steps=1)
    with pytest.raises(ConfigError, match=r"already has LoRA adapters .* asks for others: lora.rank=8 \(the "
                                          r"adapters': 4\); lora.targets=\['q_proj', 'k_proj', 'v_proj'\] \(the "
                                          r"adapters are on \['q_proj', 'v_proj'\]\)\. Set those keys") as e:
        train(tiny_config(tmp_path, lora__rank=8, lora__alpha=8, lora__targets=["q_proj", "k_proj", "v_proj"], **over),
              model=model, train_loader=SyntheticLoader(docs))
    assert e.value.key == "lora.rank"
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    res = train(tiny_config(tmp_path, lora__rank=4, lora__alpha=8, lora__targets=["q_proj", "v_proj"], **over),
                model=model, train_loader=SyntheticLoader(docs))
    assert res.step == 1 and res.status == "completed"
    # lora.* left at the defaults (a loaded PEFT adapter trained on): the adapters' own settings, named in a warning
    with caplog.at_level("WARNING", logger="chronicals.train"):
        res = train(tiny_config(tmp_path / "b", **over), model=model, train_loader=SyntheticLoader(docs))
    assert res.status == "completed" and model.lora_config.r == 4
    assert "has its own LoRA adapters, trained as they are: lora.rank=16 (the adapters': 4); lora.alpha=32.0 (the " \
           "adapters': 8.0); lora.targets=" in caplog.text


def test_a_trainconfig_changed_after_it_was_built_is_checked_again(tmp_path, docs):
    """The checks live in each section's __post_init__: c.train.grad_accum = 0 after building reached the loop and
    failed there as a ZeroDivisionError (a Python-API walk); train() checks the config again."""
    cfg = tiny_config(tmp_path)
    cfg.train.grad_accum = 0
    with pytest.raises(ConfigError, match=r"train.grad_accum=0 is invalid: expected an integer >= 1"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert not (tmp_path / "run").exists()


def test_a_train_loader_built_for_two_ranks_is_refused_in_one_process(tmp_path, docs):
    """A train_loader sharded for world_size=2 in a one-process run would train half the data as if it were all
    of it (nothing refused it): train() refuses it with the fix before any step runs."""
    loader = SyntheticLoader(docs)
    loader.world_size = 2
    with pytest.raises(ValueError, match=r"train_loader has world_size=2 but the job runs 1 ranks; build it with "
                                         r"PackedLoader\(rank=RANK, world_size=WORLD_SIZE\)"):
        train(tiny_config(tmp_path, train__max_steps=2), model=tiny_model(), train_loader=loader)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_passed_models_own_base_is_what_the_run_records(tmp_path, docs):
    """train(cfg, model=m) recorded cfg's model.path (the embedded model's name when the dict set none) in
    config.yaml and its checkpoints, so `chronicals train out_dir/config.yaml` resumed the adapters on that other
    model without a word. The passed model's own base (model.chronicals_base) is recorded now."""
    import yaml

    model = tiny_model()
    model.chronicals_base = str(tmp_path / "my-base")
    train(tiny_config(tmp_path, train__max_steps=1), model=model, train_loader=SyntheticLoader(docs))
    stored = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert stored["model"]["path"] == str(tmp_path / "my-base")


def test_full_fine_tuning_says_it_unfreezes_a_passed_models_frozen_weights(tmp_path, docs, caplog):
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    with caplog.at_level("WARNING", logger="chronicals"):
        train(tiny_config(tmp_path, train__max_steps=1), model=model, train_loader=SyntheticLoader(docs))
    assert "full fine-tuning trains every weight: 1 parameter tensors frozen in the model passed " \
           "(e.g. model.embed_tokens.weight) train too" in caplog.text
    assert model.model.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("kernel, needs", [("cudnn", "NVIDIA's cuDNN Python frontend"),
                                           ("fa4", "FlashAttention-4's .*pip install flash-attn-4")])
def test_model_attention_kernels_are_checked_before_the_model_loads(tmp_path, caplog, monkeypatch, kernel, needs):
    """model.attention=cudnn (or fa4) without its package failed at the first step's forward on CUDA (an ImportError,
    exit 4) and did nothing, silently, on the CPU (a full fine-tuning walk) or with model.impl=torch."""
    from chronicals.ops import attention_cudnn, attention_fa4
    from chronicals.train.guards import check_impl

    cfg = tiny_config(tmp_path, model__attention=kernel, model__impl="auto")
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(cfg, torch.device("cpu"))
    assert f"model.attention={kernel} does nothing on cpu" in caplog.text
    with caplog.at_level("WARNING", logger="chronicals"):  # the reference everywhere: no kernel choice
        check_impl(tiny_config(tmp_path, model__attention=kernel, model__impl="torch"), torch.device("cuda"))
    assert f"model.attention={kernel} does nothing with model.impl=torch" in caplog.text
    monkeypatch.setattr(attention_cudnn if kernel == "cudnn" else attention_fa4, "available", lambda: False)
    with pytest.raises(ConfigError, match=f"model.attention={kernel} needs {needs}"):
        check_impl(cfg, torch.device("cuda"))


def test_loss_vocab_parts_on_the_reference_head_is_said(tmp_path, caplog, monkeypatch):
    """model.loss_vocab_parts=4 on the CPU (the reference head, which materializes the logits) did nothing, without
    a word (session 33's note)."""
    from chronicals.train.guards import check_impl

    cfg = tiny_config(tmp_path, model__loss_vocab_parts=4, model__impl="auto")
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(cfg, torch.device("cpu"))
    assert "model.loss_vocab_parts=4 does nothing on cpu" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton head in the interpreter has the parts
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(tiny_config(tmp_path, model__loss_vocab_parts=4, model__impl="triton"), torch.device("cpu"))
    assert "loss_vocab_parts" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(tiny_config(tmp_path, model__loss_vocab_parts=4, model__impl="torch"), torch.device("cuda"))
    assert "model.loss_vocab_parts=4 does nothing with model.impl=torch" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(tiny_config(tmp_path, model__loss_vocab_parts=4, model__impl="auto"), torch.device("cuda"))
    assert "loss_vocab_parts" not in caplog.text


def test_gate_up_layers_past_the_layer_count_is_said(tmp_path, docs, caplog):
    cfg = tiny_config(tmp_path, train__max_steps=1, model__recompute=["norm", "swiglu", "gate_up"],
                      model__gate_up_layers=9)
    with caplog.at_level("WARNING", logger="chronicals"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert "model.gate_up_layers=9 but the model has 2 decoder layers: all of them rebuild gate|up" in caplog.text


def _hand_untied_model():
    """A tied config whose lm_head was made its own Parameter in code (same values at first)."""
    from chronicals.models import CausalLM, ModelConfig
    from train_helpers import VOCAB

    hf = dict(model_type="llama", vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    model = CausalLM(ModelConfig.from_hf_dict(hf)).init_weights(seed=0)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    return model


def test_a_hand_untied_head_on_a_tied_config_is_refused_before_a_full_fine_tune(tmp_path):
    """It trained every step, then save_model refused the final save (the head had moved away from the embedding;
    a full fine-tuning walk)."""
    steps = []
    with pytest.raises(ValueError, match=r"tie_word_embeddings is true, but lm_head.weight is another tensor.*"
                                         r"tie_word_embeddings = False"):
        train(tiny_config(tmp_path, train__max_steps=2, train__save_final=True), model=_hand_untied_model(),
              train_loader=SyntheticLoader(synthetic_docs(20)), on_step=lambda step, rec: steps.append(step))
    assert steps == [] and not (tmp_path / "run" / "checkpoints").exists()
    model = _hand_untied_model()
    model.config.tie_word_embeddings = False  # the fix the message names
    res = train(tiny_config(tmp_path / "b", train__max_steps=2, train__save_final=True), model=model,
                train_loader=SyntheticLoader(synthetic_docs(20)))
    assert res.status == "completed" and (res.final_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("config", [None, 123, ["optim.lr=1e-4"], b"lora.yaml"])
def test_a_config_that_is_no_config_is_a_type_error_naming_what_train_takes(config, tmp_path, monkeypatch):
    """train(123) / train(["optim.lr=1e-4"]) said 'expected str, bytes or os.PathLike object, not int' (Path's
    words), and train(None) trained the demo's 22 steps into runs/demo: None is no config either."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("chronicals.train.loop._train", lambda *a, **k: pytest.fail("it trained"))
    with pytest.raises(TypeError, match=r"train\(config\): expected a TrainConfig, a dict of sections "
                                        r"\(\{'optim': \{'lr': 0\.0001\}\}\) or a YAML file's path, got "):
        train(config)
    assert not any(tmp_path.iterdir())


def test_lora_targets_that_miss_a_passed_model_name_that_model_not_the_default_path(tmp_path, docs):
    """A model built in the program (no model.chronicals_base) with a mistyped lora.targets: the error said "does not
    fit model.path=smollm2-135m-instruct", the config's default, which was never loaded."""
    for targets in (["q_prj"], ["q_proj", "q_prj"]):
        with pytest.raises(ConfigError, match=r"^config lora\.targets does not fit the model passed to train\(\): "):
            train(tiny_config(tmp_path, lora__enabled=True, lora__targets=targets), model=tiny_model(),
                  train_loader=SyntheticLoader(docs))
