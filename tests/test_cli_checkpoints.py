"""A run's training checkpoints used by `chronicals export / chat / eval`: a LoRA run's as its adapter (`--adapter
runs/x/checkpoints/step-N`), a full fine-tuning run's as its model (`--model ...`), so the model of a step before
the run's end can be merged, written, asked or scored without resuming the run. Also: export --no-merge records a
relative --base as an absolute path (chat / eval elsewhere find it), a resumed run's checkpoints and adapter still
read once its resume point is gone, and an adapter, run or checkpoint given where the other kind is expected says
what to pass."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from chronicals import load_model
from chronicals.cli import main
from chronicals.config import load_config
from chronicals.config_schema import stored_config
from chronicals.lora import apply_lora, save_adapter

RUN_ARGS = ["train.max_steps=2", "train.save_every=1", "train.keep_last=2", "eval.every=0", "eval.qa=false",
            "logging.progress=false", "data.batch_size=2"]
RUN = ["train.save_every=1", "eval.every=0", "eval.qa=false", "logging.progress=false", "data.batch_size=2",
       "lora.rank=4"]


@pytest.fixture(scope="module")
def run(tiny_base, tmp_path_factory):
    """A 2-step LoRA run on the tiny base (modules_to_save too) with a checkpoint at each step."""
    out = tmp_path_factory.mktemp("ckrun") / "run"
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "lora.rank=4",
                 "lora.modules_to_save=[norm]", "lora.dropout=0.1", *RUN_ARGS]) == 0
    return out


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def test_export_of_the_last_checkpoint_equals_the_runs_adapter(run, tmp_path, capsys):
    step2 = run / "checkpoints" / "step-000002"
    assert main(["export", "--adapter", str(step2), "--out", str(tmp_path / "from_ckpt")]) == 0
    err = capsys.readouterr().err
    assert f"the base recorded in {step2}/state.pt" in err  # the run's model.path
    assert main(["export", "--adapter", str(run / "adapter"), "--out", str(tmp_path / "from_adapter")]) == 0
    a, b = _weights(tmp_path / "from_ckpt"), _weights(tmp_path / "from_adapter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", "--adapter", str(run / "checkpoints" / "step-000001"), "--out", str(tmp_path / "s1")]) == 0
    s1 = _weights(tmp_path / "s1")
    assert not all(torch.equal(s1[k], b[k]) for k in b)  # step 1's adapter is another one


def test_chat_with_a_checkpoint_answers_as_with_the_runs_adapter(run, tiny_base, capsys):
    q = ["--max-new-tokens", "4", "Who founded Vellmora?"]
    step2 = run / "checkpoints" / "step-000002"
    assert main(["chat", "--adapter", str(step2), "--system", "Be brief.", *q]) == 0
    from_ckpt = capsys.readouterr().out
    assert main(["chat", "--adapter", str(run / "adapter"), "--system", "Be brief.", *q]) == 0
    assert capsys.readouterr().out == from_ckpt
    assert main(["chat", "--adapter", str(step2), *q]) == 0  # the system message of the run's held-out prompts
    assert f"the system message of {step2 / 'state.pt'}'s held-out prompts" in capsys.readouterr().err


@pytest.fixture(scope="module")
def full_run(tiny_base, tmp_path_factory):
    """A 2-step full fine-tuning run on the tiny base with a checkpoint at each step."""
    out = tmp_path_factory.mktemp("fullrun") / "full"
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "lora.enabled=false", "optim.lr=0.01",
                 *RUN_ARGS]) == 0
    return out


def test_a_full_fine_tuning_checkpoint_exports_as_the_model_of_its_step(full_run, tiny_base, tmp_path, capsys):
    """`export --model runs/x/checkpoints/step-N`: the model of that step as a Hugging Face directory. Only the run's
    last model was written (model/); a step before it could not be asked, scored or written without a resume. The
    last step's export equals model/ tensor for tensor; step 1's is another model, and neither is the base."""
    step1, step2 = (full_run / "checkpoints" / f"step-00000{i}" for i in (1, 2))
    assert main(["export", "--model", str(step2), "--out", str(tmp_path / "s2")]) == 0
    assert f"wrote {step2} as a Hugging Face directory" in capsys.readouterr().out
    a, b = _weights(tmp_path / "s2"), _weights(full_run / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "s2" / "tokenizer.json").is_file()  # the base's, as the run's model/ has it
    assert main(["export", "--model", str(step1), "--out", str(tmp_path / "s1")]) == 0
    s1, base = _weights(tmp_path / "s1"), _weights(tiny_base)
    assert not all(torch.equal(s1[k], b[k]) for k in b) and not all(torch.equal(s1[k], base[k]) for k in base)
    model, _ = load_model(tmp_path / "s1")  # a model directory again
    assert model.config.num_hidden_layers == 2


def test_a_bf16_runs_checkpoint_exports_in_bf16_as_its_model_dir(tiny_base, tmp_path, capsys):
    """A bf16 run from an fp32 base (CUDA's default; here model.dtype=bfloat16 on the CPU): --dtype auto wrote the
    base's fp32 with the fp32 masters, not what the run's model/ holds (found on the H200). The dtype the run trained
    in is the default now; --dtype float32 keeps the masters."""
    from chronicals.train.checkpoint_adapter import read_run_checkpoint

    out = tmp_path / "bf16"
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "lora.enabled=false", "optim.lr=0.01",
                 "model.dtype=bfloat16", "optim.master_weights=true", *RUN_ARGS]) == 0
    step2 = out / "checkpoints" / "step-000002"
    assert main(["export", "--model", str(step2), "--out", str(tmp_path / "auto")]) == 0
    a, b = _weights(tmp_path / "auto"), _weights(out / "model")
    assert all(t.dtype == torch.bfloat16 for t in b.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", "--model", str(step2), "--dtype", "float32", "--out", str(tmp_path / "fp32")]) == 0
    masters, f32 = read_run_checkpoint(step2).tensors, _weights(tmp_path / "fp32")
    assert masters and all(t.dtype == torch.float32 for t in masters.values())
    assert all(torch.equal(f32[n], t) for n, t in masters.items() if n in f32)
    # chat / eval --dtype auto on the CPU (float32): the weights the run trained with, as model/ holds them; the fp32
    # masters scored 10.7040 where model/ scored 10.7042 (found in a walk through the commands)
    capsys.readouterr()
    scores = []
    for model in (step2, out / "model"):
        assert main(["eval", "--model", str(model), "demo", "--qa-limit", "1"]) == 0
        scores.append(capsys.readouterr().out.splitlines()[1:])  # the first line names the model
    assert scores[0] == scores[1]


def test_a_full_fine_tuning_checkpoint_chats_and_scores_as_its_model(full_run, capsys):
    step2 = full_run / "checkpoints" / "step-000002"
    q = ["--max-new-tokens", "4", "Who founded Vellmora?"]
    assert main(["chat", "--model", str(step2), *q]) == 0
    out, err = capsys.readouterr()
    assert f"the system message of {step2 / 'state.pt'}'s held-out prompts" in err  # the run's, as for LoRA
    assert main(["chat", "--model", str(full_run / "model"), *q]) == 0
    assert capsys.readouterr().out == out
    assert main(["eval", "--model", str(step2), "demo", "--qa-limit", "1"]) == 0
    ck = capsys.readouterr().out
    assert main(["eval", "--model", str(full_run / "model"), "demo", "--qa-limit", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ck.splitlines()[1:]  # the first line names the model


def test_load_checkpoint_model_takes_the_masters_rounded_once(full_run):
    """From Python: the fp32 masters of the step (optim.master_weights) loaded in float32 are the optimizer's state
    itself, and rounded to bf16 they are the weights the run trained with."""
    from chronicals.train import load_checkpoint_model
    from chronicals.train.checkpoint_adapter import read_run_checkpoint

    step2 = full_run / "checkpoints" / "step-000002"
    model, tok = load_checkpoint_model(step2, dtype=torch.float32, tokenizer=False)
    assert tok is None and not model.training
    tensors = read_run_checkpoint(step2).tensors
    params = dict(model.named_parameters())
    assert set(tensors) <= set(params) and all(torch.equal(params[n], t.float()) for n, t in tensors.items())
    bf16, _ = load_checkpoint_model(step2, dtype=torch.bfloat16, tokenizer=False)
    assert all(torch.equal(p, params[n].to(torch.bfloat16)) for n, p in bf16.named_parameters())


def test_a_checkpoint_given_as_the_wrong_kind_names_the_flag_to_use(full_run, run, tmp_path, capsys):
    assert main(["export", "--adapter", str(full_run / "checkpoints" / "step-000002"), "--out", str(tmp_path / "m")]) == 3
    err = capsys.readouterr().err
    assert "is a full fine-tuning run's (lora.enabled false)" in err and "pass it as --model" in err
    assert main(["chat", "--model", str(run / "checkpoints" / "step-000002"), "hi"]) == 3
    err = capsys.readouterr().err
    assert "is a LoRA run's (lora.enabled true)" in err and "pass it as --adapter" in err
    for argv, said in ((["export"], "give --adapter"),
                       (["export", "--model", str(full_run / "checkpoints" / "step-000002"), "--no-merge"],
                        "no --adapter was given")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "m")])
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_full_checkpoint_whose_base_moved_says_where_it_was(tiny_base, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    out = tmp_path / "full"
    assert main(["train", f"model.path={base}", f"train.out_dir={out}", "lora.enabled=false", *RUN_ARGS]) == 0
    base.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["export", "--model", str(out / "checkpoints" / "step-000002"), "--out", str(tmp_path / "m")]) == 3
    assert f"was trained from {base}, which is not here" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    # --base names where it went (chat / eval had no way to, and export's --base was the same flag as --model: the
    # last one given won, and `--model CKPT --base X` wrote X untrained with exit 0)
    step2, moved = out / "checkpoints" / "step-000002", tmp_path / "moved"
    assert main(["export", "--model", str(step2), "--base", str(moved), "--out", str(tmp_path / "m")]) == 0
    assert "warning" not in capsys.readouterr().err  # the recorded base is gone: nothing to compare --base with
    a, b = _weights(tmp_path / "m"), _weights(out / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    q = ["--max-new-tokens", "3", "hi"]
    assert main(["chat", "--model", str(step2), "--base", str(moved), *q]) == 0
    said = capsys.readouterr().out
    shutil.move(str(moved), str(base))
    assert main(["chat", "--model", str(out / "model"), *q]) == 0 and capsys.readouterr().out == said
    assert main(["eval", "--model", str(step2), "--base", str(base), "demo", "--qa-limit", "1"]) == 0
    with pytest.raises(SystemExit) as e:  # its numbers are not written into the model
        main(["eval", "--model", str(step2), "--base", str(base), "demo", "--json", str(base / "e.json")])
    assert e.value.code == 2 and f"would write into --base {base}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--model", "{tiny}", "--base", "{tiny}"], "{tiny} is not a run's checkpoint (runs/x/checkpoints/step-N), and "
                                                "--base is only for one: leave --base out"),
    (["--model", "{full}/checkpoints/step-000009", "--base", "{tiny}"], "step-000009 does not exist"),
    (["--model", "{full}/checkpoints/step-000002/state.pt", "--base", "{tiny}"],
     "state.pt is a file: pass its checkpoint directory {full}/checkpoints/step-000002"),
    (["--model", "{adapter}", "--base", "{tiny}"], "is a LoRA adapter: pass it as --adapter"),
    (["--model", "{full}/checkpoints/step-000002", "--base", "{full}/checkpoints/step-000001"],
     "step-000001 is a run's training checkpoint; --base names the model a checkpoint (--model) was trained from: "
     "a model directory, .gguf or smollm2-135m-instruct"),
    (["--adapter", "{adapter}", "--base", "{full}/checkpoints/step-000001"],  # an adapter's base: a model too
     "step-000001 is a run's training checkpoint; --base names the model a checkpoint (--model) was trained from: "
     "a model directory, .gguf or smollm2-135m-instruct"),
    (["--base", "{tiny}"], "give the checkpoint as --model"),
    (["--adapter", "{adapter}", "--model", "{tiny}", "--base", "{other}"], "with --adapter, --model and --base both"),
])
@pytest.mark.parametrize("command", ["chat", "eval", "export"])
def test_model_and_base_that_do_not_go_together_are_refused(command, argv, said, tiny_base, run, full_run, tmp_path,
                                                            capsys):
    names = {"tiny": tiny_base, "adapter": run / "adapter", "other": tmp_path, "full": full_run}
    argv = [a.format(**names) for a in argv]
    rest = {"chat": ["hi"], "eval": ["demo"], "export": ["--out", str(tmp_path / "m")]}[command]
    if command == "export" and argv == ["--base", str(tiny_base)]:  # export's older name of --model: the model
        assert main(["export", *argv, *rest]) == 0
        return
    with pytest.raises(SystemExit) as e:
        main([command, *argv, *rest])
    assert e.value.code == 2 and said.format(**names) in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_checkpoint_exported_onto_its_own_base_is_refused(tiny_base, tmp_path, capsys):
    """`export --model CKPT --out <the base it records>` replaced the base with exit 0 (and --out base/sub wrote into
    it): the --out guard knew only the paths given on the command line."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    out = tmp_path / "full"
    assert main(["train", f"model.path={base}", f"train.out_dir={out}", "lora.enabled=false", *RUN_ARGS]) == 0
    before = {f.name: f.read_bytes() for f in base.iterdir()}
    step2 = out / "checkpoints" / "step-000002"
    for target, said in ((base, "would replace the base recorded in"), (base / "sub", "is inside the base recorded in")):
        capsys.readouterr()
        assert main(["export", "--model", str(step2), "--out", str(target)]) == 2
        assert f"{said} {step2} {base}" in capsys.readouterr().err
        # --base another model of its shapes: the recorded base was still replaced
        assert main(["export", "--model", str(step2), "--base", str(tiny_base), "--out", str(target)]) == 2
        assert f"{said} {step2} {base}" in capsys.readouterr().err
    assert main(["export", "--model", str(step2), "--out", str(base / "sub")]) == 2
    assert "the written model would become a folder of it" in capsys.readouterr().err  # nothing is merged
    # a LoRA run's adapter merged into another --base: its own base is kept too
    assert main(["train", f"model.path={base}", f"train.out_dir={tmp_path / 'lora'}", "lora.rank=4", *RUN_ARGS]) == 0
    capsys.readouterr()
    assert main(["export", "--adapter", str(tmp_path / "lora" / "adapter"), "--base", str(tiny_base),
                 "--out", str(base)]) == 2
    assert f"would replace the base recorded in {tmp_path / 'lora' / 'adapter'} {base}" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in base.iterdir()} == before


def test_with_an_adapter_the_base_warning_names_the_flag_given(run, full_run, tiny_base, tmp_path, capsys):
    """--base X with --adapter was warned about as 'not --model X' (eval) and --model X as 'not --base X' (export);
    --model and --base both naming the base, spelled apart, were refused as two models."""
    other = tmp_path / "other"
    shutil.copytree(tiny_base, other)
    from safetensors.torch import save_file

    w = _weights(other)
    save_file({k: v + 1 for k, v in w.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    adapter = run / "adapter"
    assert main(["eval", "--adapter", str(adapter), "--base", str(other), "demo", "--qa-limit", "1"]) == 0
    assert f"not --base {other}" in capsys.readouterr().err
    assert main(["export", "--adapter", str(adapter), "--model", str(other), "--out", str(tmp_path / "m")]) == 0
    assert f"not --model {other}" in capsys.readouterr().err
    assert main(["eval", "--adapter", str(adapter), "--base", str(tiny_base), "--model", f"{tiny_base}/",
                 "demo", "--qa-limit", "1"]) == 0
    # a full checkpoint on another --base: said once (export resolved the base twice and said it twice)
    step2 = full_run / "checkpoints" / "step-000002"
    capsys.readouterr()
    assert main(["export", "--model", str(step2), "--base", str(other), "--out", str(tmp_path / "f")]) == 0
    assert capsys.readouterr().err.count(f"was trained from {tiny_base} (recorded in its state.pt), not --base") == 1


def test_a_base_of_other_shapes_given_for_a_checkpoint_is_named(full_run, run, tmp_path, capsys):
    import transformers

    from chronicals import load_tokenizer, save_model
    from chronicals.models import CausalLM, ModelConfig

    tok = load_tokenizer("smollm2-135m-instruct")
    hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    other = save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0), tok, tmp_path / "b")
    step2 = full_run / "checkpoints" / "step-000002"
    assert main(["eval", "--model", str(step2), "--base", str(other), "demo"]) == 3
    assert f"does not fit --base {other}" in capsys.readouterr().err


def test_a_checkpoint_on_another_base_is_refused(run, tmp_path, capsys):
    import transformers

    from chronicals import load_tokenizer, save_model
    from chronicals.models import CausalLM, ModelConfig

    tok = load_tokenizer("smollm2-135m-instruct")
    hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    other = save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0), tok, tmp_path / "b")
    assert main(["export", "--base", str(other), "--adapter", str(run / "checkpoints" / "step-000002"),
                 "--out", str(tmp_path / "m")]) == 3
    assert "does not fit this base" in capsys.readouterr().err


def test_a_relative_model_path_is_recorded_as_the_model_that_run_loaded(tiny_base, tmp_path, monkeypatch, capsys):
    """model.path=base (relative): the config in state.pt keeps it as typed, so from another directory the checkpoint
    found no base, or a different model of that name. The checkpoint records the absolute path, as adapter/ does."""
    import shutil

    shutil.copytree(tiny_base, tmp_path / "start" / "base")
    monkeypatch.chdir(tmp_path / "start")
    assert main(["train", "model.path=base", "train.out_dir=run", "lora.rank=4", *RUN_ARGS]) == 0
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").mkdir()  # another "base" here: not the one trained
    step2 = tmp_path / "start" / "run" / "checkpoints" / "step-000002"
    assert main(["export", "--adapter", str(step2), "--out", str(tmp_path / "m")]) == 0
    assert f"using {tmp_path / 'start' / 'base'}, the base recorded in {step2}/state.pt" in capsys.readouterr().err


def test_a_model_passed_to_train_with_its_own_lora_exports_as_trained(tiny_base, tmp_path, capsys):
    """A model given to train() already adapted (alpha 4, scaling 1) keeps its LoRA; the checkpoint was rebuilt from
    the config's lora section (alpha 32) and merged 8x the update without a word. The applied settings are recorded
    now; a model passed without chronicals_base names no base, and the export asks for one instead of guessing.
    load_model records it (a run continued from a loaded model wrote base null: a LoRA walk)."""
    from chronicals import load_model
    from chronicals.lora import apply_lora
    from chronicals.train import train

    model, tok = load_model(tiny_base)
    assert model.chronicals_base == str(tiny_base.resolve())
    model.chronicals_base = None  # as a model built without load_model
    apply_lora(model, r=4, alpha=4, seed=0)
    out = tmp_path / "run"
    train({"train": {"out_dir": str(out), "max_steps": 2, "save_every": 1}, "lora": {"rank": 4},
           "optim": {"lr": 0.05}, "eval": {"every": 0, "qa": False}, "logging": {"progress": False},
           "data": {"batch_size": 2}}, model=model, tokenizer=tok)
    step2 = out / "checkpoints" / "step-000002"
    assert main(["export", "--adapter", str(step2), "--out", str(tmp_path / "x")]) == 3
    assert "does not name a base model that can be found from here" in capsys.readouterr().err
    for src, dst in ((step2, "from_ckpt"), (out / "adapter", "from_adapter")):
        assert main(["export", "--base", str(tiny_base), "--adapter", str(src), "--out", str(tmp_path / dst)]) == 0
    a, b = _weights(tmp_path / "from_ckpt"), _weights(tmp_path / "from_adapter")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_an_empty_state_pt_is_bad_input_not_a_crash(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "state.pt").write_bytes(b"")
    assert main(["export", "--adapter", str(tmp_path / "ck"), "--out", str(tmp_path / "m")]) == 3
    err = capsys.readouterr().err
    # what it is (torch said 'EOFError: ' or advised a re-save with _use_new_zipfile_serialization=True) and what to
    # do here, not a resume's advice (train.resume=none)
    assert "state.pt is empty (0 bytes); it is truncated or corrupt: use another checkpoint of that run" in err
    assert "train.resume" not in err


def test_a_damaged_checkpoint_names_what_the_run_has_instead(full_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    state = run / "checkpoints" / "step-000002" / "state.pt"
    state.write_bytes(b"\x80\x02garbage" * 100)
    for argv in (["eval", "--model", str(state.parent), "demo"], ["chat", "--model", str(state.parent), "hi"],
                 ["export", "--model", str(state.parent), "--out", str(tmp_path / "m")]):
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert f"{state} is not the zip archive torch.save writes; it is truncated or corrupt: use another of the " \
               f"run's checkpoints ({run / 'checkpoints' / 'step-000001'}) or the run's final model/ " \
               f"({run / 'model'})" in err, err


def test_a_long_error_is_cut_at_a_word_or_inside_one():
    from chronicals.train.checkpoint import _first_line

    assert _first_line(ValueError("word " * 100)) == ("word " * 32).rstrip() + " ..."
    assert _first_line(ValueError("x" * 300)) == "x" * 160 + " ..."
    assert _first_line(EOFError()) == "no message"


def test_the_checkpoints_folder_or_a_checkpoint_as_model_say_what_to_pass(run, capsys):
    assert main(["export", "--adapter", str(run / "checkpoints"), "--out", str(run.parent / "m")]) == 3
    assert f"holds a run's training checkpoints: pass one, e.g. {run / 'checkpoints' / 'step-000002'} (a LoRA " \
           "run's as --adapter" in capsys.readouterr().err
    assert main(["chat", "--model", str(run / "checkpoints"), "hi"]) == 3
    assert f"holds a run's training checkpoints: pass one, e.g. {run / 'checkpoints' / 'step-000002'} (a full " \
           "fine-tuning run's as --model" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="is a training checkpoint .state.pt., not a model directory: a full "
                                                "fine-tuning run.s loads with chronicals.train.load_checkpoint_model"):
        load_model(run / "checkpoints" / "step-000002")
    # load_adapter on one checkpoint said only that adapter_config.json is missing; its fix, in Python
    from chronicals.lora import load_adapter
    from chronicals.train import apply_checkpoint_adapter

    base, _ = load_model(load_config(str(run / "config.yaml")).model.path, tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"step-000002 is a training checkpoint \(state.pt\), not a PEFT "
                                                r"adapter: .*chronicals.train.apply_checkpoint_adapter\(model, path\)"):
        load_adapter(base, run / "checkpoints" / "step-000002")
    assert apply_checkpoint_adapter(base, run / "checkpoints" / "step-000002").lora_config.r == 4
    # and the other way round: the run, its checkpoints/ or its adapter/ where a checkpoint goes (was a bare
    # "[Errno 2] No such file or directory: '.../state.pt'")
    from chronicals.train import load_checkpoint_model

    for where, said in ((run, f"it holds a run's checkpoints: pass one, e.g. {run / 'checkpoints' / 'step-000002'}"),
                        (run / "checkpoints", "it holds a run's checkpoints: pass one"),
                        (run / "adapter", "it is a PEFT adapter: chronicals.lora.load_adapter(model, path)"),
                        (run / "nope", "no such directory")):
        with pytest.raises(FileNotFoundError, match="not a training checkpoint") as e:
            load_checkpoint_model(where)
        assert said in str(e.value), str(e.value)


def test_no_merge_writes_the_steps_adapter_that_peft_loads(run, tiny_base, tmp_path, capsys):
    """export --no-merge: the adapter of a step in PEFT's format. The last step's equals the run's adapter/ (tensors,
    r, alpha, targets, modules_to_save, dropout), records the same base, and peft loads it with our logits."""
    import json

    import peft
    import transformers

    from chronicals import load_model
    from chronicals.lora import load_adapter

    out = tmp_path / "a2"
    assert main(["export", "--no-merge", "--adapter", str(run / "checkpoints" / "step-000002"), "--out", str(out)]) == 0
    got, want = load_file(str(out / "adapter_model.safetensors")), load_file(str(run / "adapter" /
                                                                                 "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].float()) for k in want)
    cfg, run_cfg = (json.loads((d / "adapter_config.json").read_text()) for d in (out, run / "adapter"))
    assert cfg == run_cfg
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(tiny_base, tokenizer=False)
    load_adapter(ours, out)
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny_base), out)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(input_ids=ids).logits, ours.eval()(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trained", ["default", "bfloat16"])
def test_on_a_bf16_base_a_checkpoint_loads_as_the_runs_adapter(run, tiny_base, tmp_path, trained):
    """chat / eval --dtype bfloat16: a checkpoint's A and B go into float32 as load_adapter puts the run's adapter/
    (PEFT's default on a bf16 base): state.pt's fp32 masters where the run kept them (a bf16 run: the default on
    CUDA), else its weights; the same logits bit for bit. They were rounded to bf16 before, while load_adapter now
    keeps fp32 (tests/lora/test_adapter_dtype.py). This compared with the stored weights alone, which failed on
    CUDA, where the default run trains bf16 weights beside fp32 masters."""
    from chronicals import load_model
    from chronicals.lora import load_adapter
    from chronicals.train.checkpoint import _read_state, masters_by_name
    from chronicals.train.checkpoint_adapter import apply_checkpoint_adapter

    if trained == "bfloat16":  # the CUDA default's bf16 weights and fp32 masters, on any machine
        run = tmp_path / "run"
        assert main(["train", f"model.path={tiny_base}", f"train.out_dir={run}", "lora.rank=4", "model.dtype=bfloat16",
                     "lora.modules_to_save=[norm]", *RUN_ARGS]) == 0
    step2 = run / "checkpoints" / "step-000002"
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, loras = [], []
    for put in (lambda m: apply_checkpoint_adapter(m, step2), lambda m: load_adapter(m, run / "adapter")):
        model, _ = load_model(tiny_base, dtype=torch.bfloat16, tokenizer=False)
        put(model)
        loras.append({n: p for n, p in model.named_parameters() if ".lora_" in n})
        assert loras[-1] and all(p.dtype == torch.float32 for p in loras[-1].values())
        with torch.no_grad():
            logits.append(model.eval()(ids))
    state = _read_state(step2 / "state.pt")
    masters = masters_by_name(state)
    assert bool(masters) == (state["model"][next(iter(loras[0]))].dtype == torch.bfloat16)
    want = {**state["model"], **masters}
    assert all(torch.equal(p, want[n]) for n, p in loras[0].items())
    assert torch.equal(logits[0], logits[1])


def test_no_merge_records_a_relative_base_as_an_absolute_path(tiny_base, tmp_path, monkeypatch, capsys):
    model, _ = load_model(tiny_base, tokenizer=False)
    apply_lora(model, r=2, alpha=4)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tiny_base))
    monkeypatch.chdir(tiny_base.parent)
    out = tmp_path / "exported"
    assert main(["export", "--no-merge", "--base", tiny_base.name, "--adapter", str(adapter), "--out", str(out)]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_base.resolve())


def test_a_resumed_runs_checkpoints_read_after_its_resume_point_is_gone(tiny_base, tmp_path, monkeypatch, capsys):
    """B resumed from A's checkpoint by a relative path; once that path is gone (another directory, or A removed:
    keep_last rotates the same way), chat / eval / export of B failed: "its run config no longer reads
    (train.resume ... does not exist)", and chat fell back to the default system prompt without a word."""
    monkeypatch.chdir(tmp_path)
    base = [f"model.path={tiny_base}", *RUN, "data.system_prompt=Be terse."]
    assert main(["train", *base, "train.out_dir=runA", "train.max_steps=2"]) == 0
    assert main(["train", *base, "train.out_dir=runB", "train.max_steps=3",
                 "train.resume=runA/checkpoints/step-000002"]) == 0
    shutil.rmtree(tmp_path / "runA")
    capsys.readouterr()
    step3 = tmp_path / "runB" / "checkpoints" / "step-000003"
    assert main(["export", "--adapter", str(step3), "--no-merge", "--out", str(tmp_path / "ad")]) == 0
    assert (tmp_path / "ad" / "adapter_config.json").is_file()
    assert main(["chat", "--adapter", str(tmp_path / "runB" / "adapter"), "--max-new-tokens", "2", "hi"]) == 0
    assert "--system not given: using 'Be terse.'" in capsys.readouterr().err
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # export --out . is a usage error (exit 2), as --out <a file> is
    assert main(["export", "--adapter", str(tmp_path / "runB" / "adapter"), "--out", "."]) == 2
    assert "--out .:" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    # config.yaml continues runB (train.resume=auto), whatever runB started from (kept in a comment)
    text = (tmp_path / "runB" / "config.yaml").read_text()
    assert text.startswith("# train.resume is auto here, so that this file continues this run; it started with "
                           "train.resume='runA/checkpoints/step-000002'\n"), text[:200]
    assert load_config(tmp_path / "runB" / "config.yaml").train.resume == "auto"


def test_running_a_resumed_runs_config_again_continues_that_run(tiny_base, tmp_path, monkeypatch, caplog):
    """config.yaml stored train.resume as given: after B resumed from A's step 2 and trained to step 4, running
    `chronicals train runB/config.yaml train.max_steps=6` went back to A's step 2 and removed B's own step-000004
    and adapter/ as "another run's"."""
    monkeypatch.chdir(tmp_path)
    base = [f"model.path={tiny_base}", *RUN]
    assert main(["train", *base, "train.out_dir=runA", "train.max_steps=2"]) == 0
    assert main(["train", *base, "train.out_dir=runB", "train.max_steps=4",
                 "train.resume=runA/checkpoints/step-000002"]) == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="chronicals"):
        assert main(["train", str(tmp_path / "runB" / "config.yaml"), "train.max_steps=6"]) == 0
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "another run" in m], said
    assert any("resumed from" in m and "step-000004" in m for m in said), said
    steps = [json.loads(line).get("step") for line in (tmp_path / "runB" / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 6


def test_a_missing_adapter_directory_is_said_as_such(tmp_path):
    from chronicals.lora import read_adapter_config

    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path / 'nosuchdir'}: no such directory; an adapter is the "
                                                r"directory holding adapter_config\.json and") as e:
        read_adapter_config(tmp_path / "nosuchdir")
    assert "adapter_config.json: not found" not in str(e.value)


def test_an_adapter_directory_given_as_the_model_is_told_to_be_the_adapter(tmp_path):
    """Was "adapter/config.json: not found; a Hugging Face model directory needs one", no word of the adapter."""
    from chronicals.models import load_model

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    with pytest.raises(FileNotFoundError, match=rf"^{adapter / 'config.json'}: not found; this is a LoRA adapter "
                                                r"\(adapter_config\.json\), not a model: pass it as --adapter"):
        load_model(adapter)
    (adapter / "adapter_config.json").unlink()  # a plain folder without config.json: as before
    with pytest.raises(FileNotFoundError, match=r"config\.json: not found; a Hugging Face model directory needs one$"):
        load_model(adapter)


def test_a_run_directory_given_as_the_model_names_its_model_or_adapter(tmp_path):
    """--model runs/x said only "runs/x/config.json: not found; a Hugging Face model directory needs one"."""
    from chronicals.models import load_model

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    with pytest.raises(FileNotFoundError, match=rf"needs one; {run} is a run directory holding a LoRA adapter: "
                                                rf"pass --adapter {run / 'adapter'}"):
        load_model(run)
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError,
                       match=rf"needs one; {run} holds one in its model folder: pass {run / 'model'}"):
        load_model(run)


def test_a_pruned_checkpoint_and_a_run_without_its_adapter_yet_say_what_to_pass(run, tmp_path, capsys):
    """Pointed at a live run: a checkpoint that keep_last pruning removed was described as a PEFT adapter ("an
    adapter is the directory holding adapter_config.json"), and a run directory still training (checkpoints, no
    adapter/ yet) did not point at its checkpoints (a concurrency walk)."""
    import shutil

    gone = run / "checkpoints" / "step-000000"  # as keep_last pruning leaves a path read a moment before
    assert main(["export", "--no-merge", "--adapter", str(gone), "--out", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err
    assert f"{gone}: no such checkpoint; a run keeps only its newest train.keep_last checkpoints; the newest there " \
           f"now: {run / 'checkpoints' / 'step-000002'}" in err, err
    # a full fine-tuning run's step given as --model (or to load_model): said the same, not "no such file or
    # directory (expected a Hugging Face model directory, ...)" (a walk of export)
    for argv in (["export", "--model", str(gone), "--out", str(tmp_path / "o")], ["eval", "--model", str(gone), "demo"]):
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert f"{gone}: no such checkpoint; a run keeps only its newest train.keep_last checkpoints; the newest " \
               f"there now: {run / 'checkpoints' / 'step-000002'}" in err, (argv, err)
    live = tmp_path / "live"
    shutil.copytree(run / "checkpoints", live / "checkpoints")
    assert main(["export", "--no-merge", "--adapter", str(live), "--out", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err
    assert f"holds a run's training checkpoints: pass one, e.g. {live / 'checkpoints' / 'step-000002'}" in err, err
    assert not (tmp_path / "o").exists()


def test_eval_json_refuses_the_base_a_full_checkpoint_records(full_run, tiny_base, capsys):
    """eval --model runs/x/checkpoints/step-N (no --base) loads the base the checkpoint records: a --json there
    overwrote its config.json (exit 0; then neither the base nor the checkpoint loaded). Refused before the load, as
    with --base given and as export refuses it (a docs walk)."""
    step2 = full_run / "checkpoints" / "step-000002"
    inside = tiny_base / "eval.json"
    try:
        with pytest.raises(SystemExit) as e:
            main(["eval", "--model", str(step2), "demo", "--qa-limit", "1", "--json", str(inside)])
        err = capsys.readouterr().err
        assert e.value.code == 2, err
        assert f"--json {inside} would write into the base recorded in {step2}" in err, err
        assert not inside.exists()
    finally:
        inside.unlink(missing_ok=True)


def test_eval_says_a_checkpoint_adapter_on_another_base_before_the_data_and_the_weights(run, tmp_path, monkeypatch,
                                                                                      capsys):
    """A LoRA run's checkpoint as --adapter on a base with other modules (3 layers, where the run adapted 2): the
    names were compared once the data was read and the weights had loaded; the decoder built from the base's
    config.json on the meta device names them before either, in the same words."""
    import transformers

    import chronicals.cli_eval as cli_eval
    import chronicals.evaluate
    from chronicals import load_tokenizer, save_model
    from chronicals.models import CausalLM, ModelConfig

    tok = load_tokenizer("smollm2-135m-instruct")
    hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    other = save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0), tok, tmp_path / "b")
    monkeypatch.setattr(chronicals.evaluate, "read_eval_data", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(cli_eval, "_load", lambda *a, **k: 1 / 0)
    step = run / "checkpoints" / "step-000002"
    assert main(["eval", "--base", str(other), "--adapter", str(step), "demo", "--device", "cpu"]) == 3
    err = capsys.readouterr().err
    assert f"checkpoint {step} does not fit this base: its LoRA targets match other modules here (e.g. " \
           "model.layers.2." in err and "Traceback" not in err, err
