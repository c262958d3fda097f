"""The command line: train (the demo path at a reduced size), export, chat, and config errors."""

from __future__ import annotations

import json

import pytest
import torch

from chronicals import load_tokenizer, save_model
from chronicals.cli import main
from chronicals.models import CausalLM, ModelConfig


def test_help_shows_every_field_doc(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: chronicals train" in out and "lora.plus_ratio" in out and "linear warmup over k steps" in out


def test_bad_value_fails_before_model_load(capsys):
    # the model path does not exist: reaching the loader would give another error
    assert main(["train", "model.path=/nonexistent/model", "optim.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr=-1.0 is invalid: expected a number in (0, 10]" in err


def test_override_given_twice_is_a_config_error(capsys):
    assert main(["train", "model.path=/nonexistent/model", "train.max_steps=3", "train.max_steps=4"]) == 2
    assert "train.max_steps given twice (train.max_steps=3 and train.max_steps=4); give it once" in \
        capsys.readouterr().err


def test_unknown_key_suggests(capsys):
    assert main(["train", "optim.learning_rat=1e-3"]) == 2
    assert "did you mean optim" in capsys.readouterr().err


def test_bad_input_found_while_running_is_an_error_line_not_a_traceback(tiny_base, tmp_path, capsys, monkeypatch):
    """Exit 3 with the file (and line, for data) when the data or the model is bad; CHRONICALS_TRACEBACK=1
    prints the traceback too, for debugging."""
    bad = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    bad.write_text(good + '\n{"messages": [{"role": "user"}]}\n')
    args = ["train", f"model.path={tiny_base}", f"data.path={bad}", f"train.out_dir={tmp_path / 'run'}",
            "train.max_steps=1", "logging.progress=false"]
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)
    assert main(args) == 3
    err = capsys.readouterr().err
    assert f"error: {bad}:2: messages[0] has no 'content'" in err and "Traceback" not in err
    assert "(CHRONICALS_TRACEBACK=1 shows where it was raised)" in err  # how to see where
    assert main(["train", f"model.path={tmp_path / 'missing'}", f"train.out_dir={tmp_path / 'run'}"]) == 3
    assert "no such file or directory" in capsys.readouterr().err
    monkeypatch.setenv("CHRONICALS_TRACEBACK", "1")  # the traceback too, with the error's own exit status
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and f"error: {bad}:2: messages[0] has no 'content'" in err
    assert "CHRONICALS_TRACEBACK=1 shows" not in err  # it is shown: no hint to show it
    monkeypatch.setenv("CHRONICALS_TRACEBACK", "0")  # off: "0" had turned it on (and exited 1, "diverged")
    assert main(args) == 3
    assert "Traceback" not in capsys.readouterr().err


def test_demo_path_reduced(tiny_base, tmp_path, capsys):
    """`chronicals train` on the packaged demo data with a tiny model: before/after report, adapter, export, chat."""
    out = tmp_path / "run"
    rc = main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "train.max_steps=3",
               "eval.qa_limit=3", "eval.max_new_tokens=4", "logging.progress=false", "data.batch_size=2",
               "data.cache_dir=" + str(tmp_path / "cache")])
    text = capsys.readouterr().out
    assert rc == 0, text
    for needle in ("== before training ==", "== after training ==", "held-out loss:", "Q: ",
                   "held-out answers with their keywords:", "loss tokens/s", "adapter (PEFT format)"):
        assert needle in text
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "loss.png").is_file() and (out / "config.yaml").is_file()
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3]
    assert {r["tag"] for r in recs if r["kind"] == "eval"} == {"before", "after"}
    # the held-out chat file carries the same system prompt the QA prompts use
    first = json.loads((out / "data" / "heldout.jsonl").read_text().splitlines()[0])
    assert first["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}

    merged = tmp_path / "merged"
    assert main(["export", "--base", str(tiny_base), "--adapter", str(out / "adapter"), "--out", str(merged)]) == 0
    capsys.readouterr()
    q = "Who founded Vellmora?"
    assert main(["chat", "--model", str(merged), "--max-new-tokens", "5", q]) == 0
    merged_reply = capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_base), "--adapter", str(out / "adapter"), "--max-new-tokens", "5",
                 q]) == 0
    assert capsys.readouterr().out == merged_reply and merged_reply.startswith(f"> {q}\n")


def test_batched_answers_equal_one_by_one(tiny_base):
    from chronicals import load_model
    from chronicals.models import generate
    from chronicals.train.qa import answer_many, prompt_ids

    model, tok = load_model(tiny_base, dtype=torch.float32)
    qs = ["What is the capital of Vellmora?", "Who founded it?", "What is Vellmora's capital city?", "Hi"]
    lengths = [len(prompt_ids(tok, q, "Be brief.")) for q in qs]
    assert len(set(lengths)) < len(lengths)  # at least one batch of several rows
    batched = answer_many(model, tok, qs, "Be brief.", 6)
    single = [tok.decode(generate(model, prompt_ids(tok, q, "Be brief."), 6, eos_token_id=tok.eos_token_id),
                         skip_special_tokens=True).strip() for q in qs]
    assert batched == single


@pytest.mark.slow
def test_embedded_demo_two_steps(tmp_path, capsys):
    """The real `chronicals train` defaults on the embedded SmolLM2-135M, cut to 2 small steps."""
    out = tmp_path / "demo"
    rc = main(["train", f"train.out_dir={out}", "train.max_steps=2", "data.batch_size=1", "data.max_seq_len=64",
               "eval.qa_limit=2", "eval.max_new_tokens=3", "logging.progress=false"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "held-out loss: " in text and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_with_packed_loader_is_exact(tiny_base, tmp_path):
    """SIGTERM mid-run, then resume=auto, with the real data pipeline (PackedLoader position, LoRA+ groups,
    dropout RNG): the adapter equals an uninterrupted run's, bit for bit."""
    import os
    import signal

    from safetensors.torch import load_file

    from chronicals.config import load_config
    from chronicals.train import train

    common = [f"model.path={tiny_base}", "train.max_steps=6", "train.grad_accum=2", "data.batch_size=2",
              "data.max_seq_len=128", "data.eval_path=", "eval.qa=false", "lora.dropout=0.1", "lora.rank=4",
              "logging.progress=false", "logging.plot=false", f"data.cache_dir={tmp_path / 'cache'}"]

    def kill_at_3(step, rec):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    straight = train(load_config(None, common + [f"train.out_dir={tmp_path / 'a'}"]))
    cfg_b = load_config(None, common + [f"train.out_dir={tmp_path / 'b'}"])
    assert train(cfg_b, on_step=kill_at_3).status == "interrupted"
    resumed = train(cfg_b)
    assert resumed.status == "completed" and resumed.step == straight.step == 6
    a = load_file(straight.final_dir / "adapter_model.safetensors")
    b = load_file(resumed.final_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_padding_free_batches_train_through_the_packed_path(tiny_base, tmp_path):
    """data.tokens_per_batch: one padding-free packed row per micro-batch (cu_seqlens, positions restarting
    per document); the run completes and its held-out loss falls."""
    from chronicals.config import load_config
    from chronicals.train import train
    from chronicals.train.setup import build_loaders

    args = [f"model.path={tiny_base}", "train.max_steps=8", "data.max_seq_len=128", "data.tokens_per_batch=384",
            "eval.qa=false", "lora.enabled=false", "optim.lr=3e-3", "logging.progress=false",
            "logging.plot=false", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'run'}"]
    cfg = load_config(None, args)
    loader, _, _ = build_loaders(cfg, load_tokenizer(str(tiny_base)), tmp_path / "run")
    batch = next(iter(loader))
    assert batch.input_ids.shape[0] == 1 and batch.input_ids.shape[1] <= 384 and batch.num_docs > 1
    result = train(cfg)
    assert result.status == "completed" and result.eval_loss_after < result.eval_loss_before


def test_tokens_per_batch_smaller_than_a_row_fails_before_loading():
    from chronicals.config import load_config

    with pytest.raises(ValueError, match=r"data.tokens_per_batch=100 is invalid: expected 0 \(rows\) or in "
                                         r"\[data.max_seq_len=256, 4194304\]"):
        load_config(None, ["data.tokens_per_batch=100"])


def test_lora_modules_to_save_from_the_config(tiny_base, tmp_path, capsys):
    """lora.modules_to_save=[lm_head]: the (tied) lm_head trains in full next to the adapters, goes into the PEFT
    adapter, and the merged export carries it; the frozen projections stay the base's."""
    from safetensors.torch import load_file

    from chronicals import load_model

    out = tmp_path / "run"
    rc = main(["train", f"model.path={tiny_base}", f"train.out_dir={out}", "train.max_steps=2", "eval.qa=false",
               "logging.progress=false", "data.batch_size=2", "lora.modules_to_save=[lm_head]", "optim.lr=0.01",
               "data.cache_dir=" + str(tmp_path / "cache")])
    assert rc == 0, capsys.readouterr().err
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["lm_head", "model.embed_tokens"]  # tied: PEFT loads both copies
    assert cfg["base_model_name_or_path"] == str(tiny_base.resolve())  # what export / chat default to
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert any("lm_head" in k for k in saved), sorted(saved)[:5]
    merged = tmp_path / "merged"
    assert main(["export", "--base", str(tiny_base), "--adapter", str(out / "adapter"), "--out", str(merged)]) == 0
    base, _ = load_model(tiny_base, tokenizer=False)
    tuned, _ = load_model(merged, tokenizer=False)
    assert not torch.equal(base.lm_head.weight, tuned.lm_head.weight)  # trained in full
    b, t = base.state_dict(), tuned.state_dict()
    assert not torch.equal(b["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(b["model.layers.0.input_layernorm.weight"], t["model.layers.0.input_layernorm.weight"])


def test_outputs_never_replace_foreign_files(tiny_base, tmp_path, capsys):
    """An output directory is replaced as a whole: one holding other files is refused before anything is written
    (they stay), a previous model directory is replaced, and export never writes over its own base or adapter."""
    from chronicals import load_model
    from chronicals.lora import apply_lora, save_adapter

    model, tok = load_model(tiny_base)
    out = tmp_path / "out"
    out.mkdir()
    (out / "MY_NOTES.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"holds files this save would delete \(MY_NOTES.txt\)"):
        save_model(model, tok, out)
    assert (out / "MY_NOTES.txt").read_text() == "keep me" and [p.name for p in out.iterdir()] == ["MY_NOTES.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temp directory left behind
    again = tmp_path / "model"
    save_model(model, tok, again)
    save_model(model, tok, again)  # a model directory (tokenizer files included) is replaced
    apply_lora(model, r=2, alpha=4)
    with pytest.raises(FileExistsError, match="MY_NOTES.txt"):
        save_adapter(model, out)
    adapter = tmp_path / "adapter"
    save_adapter(model, adapter)
    save_adapter(model, adapter)
    for bad in (tiny_base, adapter, tiny_base.parent):
        assert main(["export", "--base", str(tiny_base), "--adapter", str(adapter), "--out", str(bad)]) == 2
        assert "would replace" in capsys.readouterr().err


def test_an_adapter_goes_on_its_recorded_base(tiny_base, tmp_path, capsys):
    """export / chat without --base / --model take the base recorded in adapter_config.json; another base of the
    same shapes loads without error (and gives other outputs), so it is warned about."""
    import shutil

    from chronicals import load_model
    from chronicals.lora import apply_lora, save_adapter

    model, _ = load_model(tiny_base)
    apply_lora(model, r=2, alpha=4)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tiny_base))
    assert main(["export", "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    err = capsys.readouterr().err
    assert f"--base not given: using {tiny_base}, the base recorded in {adapter}/adapter_config.json" in err
    other = shutil.copytree(tiny_base, tmp_path / "other")
    assert main(["export", "--base", str(other), "--adapter", str(adapter), "--out", str(tmp_path / "m2")]) == 0
    assert f"warning: {adapter} was trained on {tiny_base}" in capsys.readouterr().err
    assert main(["export", "--base", str(tiny_base), "--adapter", str(adapter), "--out", str(tmp_path / "m3")]) == 0
    assert "warning" not in capsys.readouterr().err
    elsewhere = save_adapter(model, tmp_path / "a2", base_model_name_or_path="someone/not-here")
    assert main(["chat", "--adapter", str(elsewhere), "hi"]) == 3
    assert "was trained on someone/not-here (adapter_config.json base_model_name_or_path), which is not here; " \
           "pass --model" in capsys.readouterr().err


def test_chat_arguments_are_checked(tiny_base, capsys):
    for bad, says in ((["--max-new-tokens", "0", "hi"], "an answer needs at least 1 new token"),
                      (["  "], "an empty prompt was given")):
        with pytest.raises(SystemExit) as e:
            main(["chat", "--model", str(tiny_base), *bad])
        assert e.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["chat", "--model", str(tiny_base), "--device", "banana", "hi"])
    assert e.value.code == 2 and "--device=banana is not a device; use auto, cpu, cuda or cuda:N" in \
        capsys.readouterr().err


def test_an_unexpected_exception_is_exit_4_not_the_diverged_status(monkeypatch, capsys):
    import chronicals.cli as cli

    def boom(argv):
        raise KeyError("a bug")
    monkeypatch.setitem(cli.COMMANDS, "chat", boom)
    assert main(["chat", "x"]) == 4
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err and "internal error in chronicals" in err


def test_ctrl_c_before_training_is_130_without_a_traceback(monkeypatch, capsys):
    import chronicals.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.COMMANDS, "train", interrupted)
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (SIGINT): run the same command again to go on: train.resume=auto" in err and "Traceback" not in err
    assert "or starts over when there is none" in err

    def interrupted_inside_a_library(argv):  # a Ctrl-C that a library turned into another error
        import os
        import signal
        os.kill(os.getpid(), signal.SIGINT)
    def wrapped(argv):
        try:
            interrupted_inside_a_library(argv)
        except KeyboardInterrupt:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from None
    monkeypatch.setitem(cli.COMMANDS, "train", wrapped)
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (SIGINT): run the same command again to go on: train.resume=auto" in err and "internal error" not in err and "Traceback" not in err


def test_a_sigterm_under_torchrun_says_another_rank_may_have_failed(monkeypatch, capsys):
    """torchrun SIGTERMs the other ranks when one fails (a config error on rank 0): rank 1 then advised only to run
    again and resume, beside rank 0's real error (a data-parallel walk)."""
    import os
    import signal

    import chronicals.cli as cli

    def killed(argv):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setitem(cli.COMMANDS, "train", killed)
    assert main(["train"]) == 130
    assert "another rank failed" not in capsys.readouterr().err  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (SIGTERM)" in err and "under torchrun a SIGTERM also comes when another rank failed" in err


def test_a_ctrl_c_under_torchrun_does_not_blame_another_rank(monkeypatch, capsys):
    """The torchrun note ("a SIGTERM also comes when another rank failed") is for a SIGTERM only: a Ctrl-C (SIGINT)
    under torchrun is the user's own stop, and the note sent them looking for another rank's error."""
    import chronicals.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.COMMANDS, "train", interrupted)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (SIGINT)" in err and "another rank failed" not in err, err


def test_an_interrupted_train_under_torchrun_says_how_to_go_on_once(monkeypatch, capsys):
    """torchrun runs every rank's CLI: the "interrupted ... run the same command again" text came once per rank (a
    data-parallel walk). Rank 0 says it; another rank exits 130 quietly."""
    import chronicals.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.COMMANDS, "train", interrupted)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train"]) == 130
        assert ("interrupted (SIGINT): run the same command again" in capsys.readouterr().err) == says, rank


def test_chat_reads_piped_prompts_and_labels_each_answer(tiny_base, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("first question\n\nsecond one\n"))
    assert main(["chat", "--model", str(tiny_base), "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.count("> ") == 2 and "> first question\n" in out and "> second one\n" in out
    assert "type a message" not in err  # the hint is for a terminal only


def test_token_ids_past_the_models_vocabulary_are_refused(tmp_path, capsys):
    """A tokenizer that knows more tokens than the model has embedding rows: one error before any step (the
    loss head would otherwise read past its last row)."""
    import transformers

    tok = load_tokenizer("smollm2-135m-instruct")
    hf = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    small = save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0), tok, tmp_path / "m")
    rc = main(["train", f"model.path={small}", f"train.out_dir={tmp_path / 'run'}", "train.max_steps=1",
               "logging.progress=false", "eval.qa=false", "data.cache_dir=none"])
    err = capsys.readouterr().err
    assert rc == 3 and "but the model's vocabulary has 1000 entries" in err and "the model's own tokenizer" in err
    assert not (tmp_path / "run").exists()
    assert main(["chat", "--model", str(small), "--max-new-tokens", "1", "hello there"]) == 3
    assert "'hello there' tokenizes to id" in capsys.readouterr().err


def test_sigterm_outside_the_training_loop_unwinds_like_ctrl_c(monkeypatch, capsys):
    """SIGTERM while loading, evaluating or saving (the loop handles its own): exit 130 through the same clean-up
    as a Ctrl-C, not a bare kill (143) that leaves temporary outputs behind."""
    import os
    import signal

    import chronicals.cli as cli

    cleaned = []

    def saving(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            cleaned.append(True)  # what atomic_dir's clean-up does on the way out
    monkeypatch.setitem(cli.COMMANDS, "export", saving)
    assert main(["export"]) == 130 and cleaned == [True]
    err = capsys.readouterr().err  # export has no checkpoints to speak of
    assert "interrupted (SIGTERM): chronicals export stopped" in err and "train.resume" not in err
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler) or callable(
        signal.getsignal(signal.SIGTERM))


def test_a_cuda_index_past_the_visible_devices_is_a_config_error(capsys, monkeypatch):
    """model.device=cuda:7 on a one-GPU host raised 'CUDA error: invalid device ordinal' at the first move, exit 4
    (an internal error); chat and eval --device share the check."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["train", "model.device=cuda:7", "model.path=/nonexistent/model"]) == 2
    assert "model.device=cuda:7 but 1 CUDA device is visible (cuda:0); use model.device=cuda or one of those" in \
        capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_device_this_machine_lacks_is_a_config_error(capsys):
    """model.device=cuda without a GPU is a bad value for this machine: exit 2 (bad config), not 3 (bad input
    file), and before any model loads."""
    assert main(["train", "model.device=cuda", "model.path=/nonexistent/model"]) == 2
    assert "model.device=cuda but no CUDA device is visible; use model.device=cpu" in capsys.readouterr().err


def test_chat_asks_with_the_system_message_of_the_run_that_wrote_the_adapter(tmp_path, capsys):
    """chronicals chat without --system: the run's held-out prompts' system message (its config.yaml beside the
    adapter or model), so a model trained on your own data is not asked with the demo's system prompt."""
    from chronicals.cli import _run_system_prompt
    from chronicals.config import DEMO_SYSTEM_PROMPT, from_dict

    def run(name, data):
        d = tmp_path / name
        (d / "adapter").mkdir(parents=True)
        (d / "config.yaml").write_text(from_dict({"data": data}).to_yaml())
        return d

    assert _run_system_prompt(str(run("mine", {"path": "chats.jsonl"}) / "adapter")) == ""
    assert "none (the chat template's default)" in capsys.readouterr().err
    assert _run_system_prompt(str(run("terse", {"path": "chats.jsonl", "system_prompt": "Be terse."}) / "model")) \
        == "Be terse."
    assert _run_system_prompt(str(run("demo", {"path": "demo"}) / "adapter")) == DEMO_SYSTEM_PROMPT
    assert _run_system_prompt(str(tmp_path / "mine" / "elsewhere")) is None  # not a run's adapter / model
    (tmp_path / "broken" / "adapter").mkdir(parents=True)
    (tmp_path / "broken" / "config.yaml").write_text("data: {nope: 1}\n")
    assert _run_system_prompt(str(tmp_path / "broken" / "adapter")) is None
    assert _run_system_prompt(None) is None


def test_chat_with_nothing_on_stdin_says_so_before_the_model_loads(tiny_base, monkeypatch, capsys):
    """Piped stdin without a prompt (an empty file, blank lines) printed nothing and exited 0; then it was said, but
    only once the model had loaded (seconds for the embedded model, minutes for a large one)."""
    import io

    import chronicals.cli_chat as cli_chat

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded for a stdin without a prompt")

    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    monkeypatch.setattr(cli_chat, "_load", no_load)
    assert main(["chat", "--model", str(tiny_base), "--max-new-tokens", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no prompt: stdin held no line to answer (blank lines are skipped)" in err


def _no_load(monkeypatch):
    import chronicals.cli_chat as cli_chat

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded for a stdin without a line to answer")

    monkeypatch.setattr(cli_chat, "_load", no_load)


def test_chat_with_only_reset_lines_on_stdin_says_no_prompt_before_the_load(tiny_base, monkeypatch, capsys):
    """--turns multi takes "/reset" as a command, not a prompt: stdin of "/reset" lines alone is no prompt, said
    before the model loads (it was said after the load, as "no non-blank line")."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("/reset\n\n/reset\n"))
    _no_load(monkeypatch)
    assert main(["chat", "--model", str(tiny_base), "--max-new-tokens", "1", "--turns", "multi"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no line to answer (blank and /reset lines are skipped)" in err


def test_chat_with_only_undecodable_lines_on_stdin_exits_3_before_the_load(tiny_base, monkeypatch, capsys):
    """Each bad line is said; with no line left to answer the session ends (exit 3, bad input) without loading."""
    import io

    bad = b"caf\xe9".decode("utf-8", "surrogateescape")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{bad}\n\n{bad}!\n"))
    _no_load(monkeypatch)
    assert main(["chat", "--model", str(tiny_base), "--max-new-tokens", "1"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("is not valid UTF-8") == 2, err


def test_chat_says_which_system_message_it_falls_back_to(tiny_base, capsys):
    """A model outside a run directory (an export, a base) used the demo's system message unsaid, while an adapter
    of a run said its run's: the same fine-tuned weights answered differently merged and unmerged (a CLI walk)."""
    assert main(["chat", "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "1", "hi"]) == 0
    assert "--system not given: using 'You are a helpful assistant.', the demo's system message" in \
        capsys.readouterr().err
    assert main(["chat", "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "1", "--system", "", "hi"]) \
        == 0
    assert "--system not given" not in capsys.readouterr().err


def test_export_refuses_an_out_inside_the_base_or_the_adapter(tiny_base, tmp_path, capsys):
    """--out base/merged wrote a folder into the base directory, which later saves of the base refuse as foreign."""
    from chronicals import load_model
    from chronicals.lora import apply_lora, save_adapter

    model, _ = load_model(tiny_base)
    apply_lora(model, r=2, alpha=4)
    adapter = save_adapter(model, tmp_path / "adapter")
    for inside in (tiny_base / "merged", adapter / "sub" / "merged"):
        assert main(["export", "--base", str(tiny_base), "--adapter", str(adapter), "--out", str(inside)]) == 2
        assert "is inside --" in capsys.readouterr().err and not inside.exists()


def test_the_continue_command_of_an_interrupted_run_can_be_pasted_as_printed(tmp_path, monkeypatch, capsys):
    """A stopped run prints the command that continues it; an argument with a space (a system prompt, a path) was
    printed bare, so the pasted command split it into a config file name and failed."""
    import shlex

    import chronicals.train as train_pkg
    from chronicals.train.loop import TrainResult

    monkeypatch.setattr(train_pkg, "train", lambda cfg, report=None: TrainResult(
        status="interrupted", step=3, total_steps=8, out_dir=tmp_path, checkpoint=tmp_path / "step-000003"))
    argv = ["data.system_prompt=You are a bot", f"train.out_dir={tmp_path / 'my run'}", "train.resume=none"]
    assert main(["train", *argv]) == 130
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("continue with: "))
    assert shlex.split(line.removeprefix("continue with: ")) == ["chronicals", "train", *argv[:2], "train.resume=auto"]
    # under torchrun (rank 0 prints): the torchrun command; a mid-epoch checkpoint resumes only on as many ranks
    from chronicals.cli import _relaunch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shlex.split(_relaunch(["a=1"])) == ["torchrun", "--nproc-per-node", "2", "-m", "chronicals.cli", "train",
                                               "a=1"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _relaunch(["a=1"]).endswith("train a=1 (on each of the 4 nodes, as this run was launched)")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # set but empty (an env file's blank line): one process
        monkeypatch.setenv(name, "")
    assert _relaunch(["a=1"]) == "chronicals train a=1"


def test_bf16_export_rounds_each_merged_weight_once(tiny_base, tmp_path):
    """export --dtype bfloat16 merges fp32 A and B (as the adapter file holds them) into the bf16 base: each weight
    is W + s B A computed in fp32 and rounded once. With A and B first rounded to bf16, ~15% of the elements
    differed from that."""
    from safetensors.torch import load_file

    from chronicals import load_model
    from chronicals.lora import apply_lora, save_adapter

    base16, tok = load_model(tiny_base, dtype=torch.bfloat16)
    base16_dir = save_model(base16, tok, tmp_path / "base16")
    model, _ = load_model(base16_dir, dtype=torch.float32)
    apply_lora(model, r=4, alpha=8, seed=0, target_modules=["q_proj"])
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.lora_B.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base16_dir))
    assert main(["export", "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--dtype", "bfloat16"]) == 0
    got = load_file(str(tmp_path / "m" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    q = model.model.layers[0].self_attn.q_proj
    w = load_file(str(base16_dir / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    want = (w.float() + q.scaling * (q.lora_B.weight.float() @ q.lora_A.weight.float())).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # the default (auto) keeps the base checkpoint's dtype: it wrote a bf16 base out in fp32, at twice its size
    assert main(["export", "--adapter", str(adapter), "--out", str(tmp_path / "auto")]) == 0
    auto, bf16 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("auto", "m"))
    assert auto.keys() == bf16.keys() and all(torch.equal(auto[k], bf16[k]) for k in auto)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_warns(rank, tmp_path, monkeypatch, caplog):
    """Every torchrun rank said each warning ("config x.yaml sets nothing", the data's "3 of 5 records kept"):
    once per rank. Rank 0 speaks; the others say only errors."""
    import logging

    ours = logging.getLogger("chronicals")
    monkeypatch.setattr(ours, "level", ours.level)  # _setup_logging sets it for the process: put it back after
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun sets both; RANK alone is not data parallelism
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    caplog.set_level(logging.INFO)  # the root's: what reaches it is what our logger let through
    assert main(["train", str(empty), "train.max_steps=banana"]) == 2  # the warning comes first, then the error
    logging.getLogger("chronicals.data").info("3 of 5 records kept")
    logging.getLogger("chronicals.train").error("rank %s: CUDA error", rank)
    said = caplog.text
    assert ("sets nothing" in said) == (rank == "0"), said
    assert ("3 of 5 records kept" in said) == (rank == "0"), said
    assert f"rank {rank}: CUDA error" in said, said


def _small_chat_model(tok, positions: int, path, **init):
    """A 1-layer random Llama with the embedded tokenizer (its chat template) that attends to ``positions`` tokens,
    saved as an HF directory at ``path``; ``init``: init_weights' (std=0.5: answers of varied words, where the
    default init repeats the template's last newline)."""
    import transformers

    hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                  tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    return save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0, **init), tok, path)


def test_chat_fits_each_prompt_and_its_answer_in_the_models_context(tmp_path, monkeypatch, capsys):
    """chat checked --max-new-tokens against the context without the prompt: a 60-token answer to a 20-token prompt
    on a 64-position model was asked for, and a prompt past the context got an empty answer and exit 0. Now the
    answer is cut to fit (said once), and a prompt that fills the context alone is refused, naming it, and the
    next one is answered (exit 3 at the end)."""
    import io

    from chronicals.train import qa as qa_mod

    tok = load_tokenizer("smollm2-135m-instruct")
    small = _small_chat_model(tok, 64, tmp_path / "m")
    asked = []
    real = qa_mod.answer
    monkeypatch.setattr(qa_mod, "answer", lambda m, t, q, system, n, *sampling: asked.append(
        len(qa_mod.prompt_ids(t, q, system)) + n) or real(m, t, q, system, n, *sampling))
    long = "word " * 80
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hi\n{long}\nwhat is two plus two, in a few words?\n"))
    rc = main(["chat", "--model", str(small), "--system", "Be brief.", "--max-new-tokens", "60"])
    out, err = capsys.readouterr()
    assert rc == 3, err
    assert len(asked) == 2 and all(n <= 64 for n in asked) and max(asked) == 64, asked  # cut to fit, not below
    assert "> hi\n" in out and "> what is two plus two" in out and "word word" not in out, out
    assert err.count("note: --max-new-tokens 60: a prompt of ") == 1, err
    assert "in the 64 tokens" in err and "(max_position_embeddings)" in err, err
    assert "error: the prompt 'word word" in err and "no room for an answer; shorten it by at least" in err, err
    assert "Traceback" not in err
    # one that fits is answered in full, without a note
    asked.clear()
    assert main(["chat", "--model", str(small), "--system", "Be brief.", "--max-new-tokens", "4", "hi"]) == 0
    assert "note:" not in capsys.readouterr().err and asked and asked[0] < 64
    # a system message that fills the context by itself: the fix is --system, not the prompt
    assert main(["chat", "--model", str(small), "--system", "x " * 60, "--max-new-tokens", "4", "hi"]) == 3
    assert "alone fill it: give a shorter --system" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["export", "chat", "generate", "eval"])
def test_every_option_has_help(command, monkeypatch):
    """--help listed eval's --on-long and chat's and eval's --dtype with nothing but their choices."""
    import argparse

    parsers = []

    def spy(self, argv=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)  # as --help does, before the command runs

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    with pytest.raises(SystemExit):
        main([command])
    (parser,) = parsers
    bare = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not bare, f"chronicals {command} --help shows no text for {bare}"


@pytest.mark.parametrize("command", ["chat", "eval"])
def test_verbose_says_how_answers_are_decoded(command, tiny_base, tmp_path, monkeypatch, capsys, caplog):
    """chat and eval print answers / a summary only, so nothing said how an answer was decoded (the GPU smoke
    test could not see chat replay the captured decode step). -v turns the package's INFO log on."""
    import logging
    import sys

    gen = sys.modules["chronicals.models.generate"]  # the module: the package exports its generate function

    ours = logging.getLogger("chronicals")
    monkeypatch.setattr(ours, "level", logging.NOTSET)  # a fresh process's: warnings only, through the root
    monkeypatch.setattr(gen, "_logged", set())  # generate says its choice once per process
    caplog.set_level(logging.INFO)  # caplog's handler takes INFO ...
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)  # ... the root, as a fresh process's, not
    if command == "chat":
        argv = ["chat", "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "3", "hi"]
    else:
        data = tmp_path / "qa.jsonl"
        data.write_text(json.dumps({"question": "hi", "answer": "hello"}) + "\n")  # a QA record: answered
        argv = ["eval", str(data), "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "3",
                "--cache-dir", "none"]
    assert main(argv) == 0
    assert "generate:" not in caplog.text
    monkeypatch.setattr(gen, "_logged", set())
    assert main([*argv, "-v"]) == 0
    assert "generate: eager decoding on cpu" in caplog.text, caplog.text


def test_chat_samples_with_temperature_top_p_and_seed(tiny_base, capsys):
    """--temperature > 0 samples (nucleus with --top-p), reproducibly under --seed; flags that shape sampling
    without a temperature, or out of range, are refused before the model loads."""
    base = ["chat", "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "8", "hi"]
    for bad, says in ((["--top-p", "0.5"], "without --temperature > 0 answers are greedy; add --temperature"),
                      (["--seed", "3"], "without --temperature > 0 answers are greedy"),
                      (["--temperature", "-1"], "--temperature -1.0: expected a finite number >= 0"),
                      (["--temperature", "inf"], "--temperature inf: expected a finite number >= 0"),
                      (["--temperature", "1", "--top-p", "0"], "--top-p 0.0: expected a number in (0, 1]")):
        with pytest.raises(SystemExit) as e:
            main([*base, *bad])
        assert e.value.code == 2 and says in capsys.readouterr().err, bad
    answers = {}
    for name, extra in (("greedy", []), ("s1", ["--temperature", "1", "--seed", "1"]),
                        ("s1 again", ["--temperature", "1", "--seed", "1"]),
                        ("s2", ["--temperature", "1", "--top-p", "0.95", "--seed", "2"])):
        assert main([*base, *extra]) == 0
        answers[name] = capsys.readouterr().out
    assert answers["s1"] == answers["s1 again"]
    assert len({answers["greedy"], answers["s1"], answers["s2"]}) == 3, answers


def test_chat_turns_carry_the_conversation_and_reset_forgets_it(tmp_path, monkeypatch, capsys):
    """--turns multi (a terminal's default): each prompt follows the earlier turns, '/reset' forgets them, and the
    oldest turns are dropped (said once) where they would shorten the answer; given or piped prompts are asked on
    their own by default."""
    from chronicals.train import qa as qa_mod

    tok = load_tokenizer("smollm2-135m-instruct")
    small = _small_chat_model(tok, 96, tmp_path / "m")
    seen = []
    real = qa_mod.answer

    def spy(m, t, q, system, n, temperature, top_p, generator, history, streamer=None):
        seen.append([said for said, _ in history])
        ids = qa_mod.prompt_ids(t, q, system, history)
        assert all(said in t.decode(ids) for said, _ in history)  # the earlier turns are in the prompt
        return real(m, t, q, system, n, temperature, top_p, generator, history, streamer)
    monkeypatch.setattr(qa_mod, "answer", spy)
    common = ["chat", "--model", str(small), "--system", "Be brief.", "--max-new-tokens", "4"]
    assert main([*common, "--turns", "multi", "one", "two", "/reset", "three"]) == 0
    assert seen == [[], ["one"], []]
    assert "(the conversation starts over)" in capsys.readouterr().err
    seen.clear()
    assert main([*common, "one", "two"]) == 0  # given prompts: each on its own
    assert seen == [[], []]
    capsys.readouterr()
    seen.clear()  # 96 positions: ~25 tokens of framing, ~9 a turn, an answer of 30: the oldest turns give way
    assert main([*common[:-1], "30", "--turns", "multi", *[f"q{i}" for i in range(6)]]) == 0
    err = capsys.readouterr().err
    assert err.count("note: earlier turns are dropped, oldest first") == 1, err
    assert seen[1] == ["q0"] and seen[-1] and seen[-1][0] != "q0" and seen[-1][-1] == "q4", seen


def test_chat_in_a_terminal_streams_answers_and_keeps_the_conversation(tmp_path, monkeypatch, capsys):
    """In a terminal chat shows each answer as it is decoded (transformers' TextStreamer) and the conversation goes
    on turn by turn; the streamed text is the answer a piped prompt gets."""
    import io

    from chronicals.train import qa as qa_mod

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tok = load_tokenizer("smollm2-135m-instruct")
    small = _small_chat_model(tok, 128, tmp_path / "m", std=0.5)
    common = ["chat", "--model", str(small), "--system", "Be brief.", "--max-new-tokens", "6"]
    assert main([*common, "hello there"]) == 0
    alone = capsys.readouterr().out.split("\n", 1)[1].strip()  # after "> hello there"
    assert alone  # a test of streaming needs text to stream
    seen = []
    real = qa_mod.answer

    def spy(*args):
        seen.append((len(args[8]), args[9] is not None))  # (earlier turns, streamed)
        return real(*args)
    monkeypatch.setattr(qa_mod, "answer", spy)
    monkeypatch.setattr("sys.stdin", Terminal("hello there\nand then?\n"))
    assert main(common) == 0
    out, err = capsys.readouterr()
    assert seen == [(0, True), (1, True)]
    assert out.startswith(alone) and "> " not in out, out
    assert "/reset starts the conversation over" in err and err.count("> ") == 3  # before each line, and at Ctrl-D


def test_chat_reads_strictly_decoded_stdin_line_by_line(tiny_base, monkeypatch, capsys):
    """Under PYTHONIOENCODING=utf-8 stdin decodes strictly: one bad byte stopped the session with a bare codec
    error (exit 3) before any line was answered (a generation walk). Now the bad line is said and skipped."""
    import io

    stdin = io.TextIOWrapper(io.BytesIO(b"hi\n\xff\xfe bad\nok\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "2"]) == 3
    out, err = capsys.readouterr()
    assert "> hi\n" in out and "> ok\n" in out, out
    assert "error: stdin line" in err and "is not valid UTF-8 (byte 0xff" in err, err


def test_chat_prompts_that_are_not_utf8_are_bad_input_not_a_crash(tiny_base, monkeypatch, capsys):
    """A command line's undecodable byte reaches Python as a lone surrogate, which the tokenizer refused with a
    TypeError (exit 4). Given prompts and --system exit 2 naming the byte; a piped line is said and skipped (exit 3
    at the end, the other lines answered); eval's --system-prompt exits 2 instead of blaming the data file."""
    import io

    bad = b"caf\xe9".decode("utf-8", "surrogateescape")
    base = ["chat", "--model", str(tiny_base), "--device", "cpu", "--max-new-tokens", "2"]
    for extra, says in (([bad], "a prompt is not valid UTF-8 (byte 0xe9 at character 3)"),
                        (["--system", bad, "hi"], "--system is not valid UTF-8 (byte 0xe9 at character 3)")):
        with pytest.raises(SystemExit) as e:
            main([*base, *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err, extra
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{bad}\nhi\n"))
    assert main(base) == 3
    out, err = capsys.readouterr()
    assert "error: stdin line 'caf\ufffd' is not valid UTF-8 (byte 0xe9 at character 3)" in err, err
    assert "> hi\n" in out and "caf" not in out
    with pytest.raises(SystemExit) as e:
        main(["eval", "demo", "--model", str(tiny_base), "--system-prompt", bad])
    assert e.value.code == 2 and "--system-prompt is not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("error", ["cuda", "cpu", "python"])
def test_running_out_of_memory_says_what_to_lower(error, capsys, monkeypatch):
    """A batch too large for the card was 'internal error in chronicals ... please report it' (exit 4), with a
    traceback; it is the most common way a run fails. Now one line, exit 3, naming the settings to lower."""
    import torch

    import chronicals.train as train_pkg

    raised = {"cuda": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB"),
              "cpu": RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate "
                                  "memory: you tried to allocate 400000000000 bytes."),
              "python": MemoryError()}[error]

    def boom(*a, **k):
        raise raised

    monkeypatch.setattr(train_pkg, "train", boom)
    assert main(["train", "train.max_steps=1"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.startswith("error: out of memory (") and "lower data.batch_size, data.max_seq_len" in err, err


@pytest.mark.parametrize("rank, said", [("0", "THE SUMMARY\n"), ("1", "")])
def test_under_torchrun_only_rank_0_prints_the_run_summary(rank, said, monkeypatch, capsys):
    """The summary after a finished run is printed once, by rank 0; every rank printing it repeated the whole table
    once per GPU (a mutation walk)."""
    import logging
    import types

    import chronicals.train as train_pkg
    from chronicals.train.report import RunReport

    ours = logging.getLogger("chronicals")
    monkeypatch.setattr(ours, "level", ours.level)  # _setup_logging sets it for the process: put it back after
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_pkg, "train", lambda cfg, report: types.SimpleNamespace(status="done"))
    monkeypatch.setattr(RunReport, "summary", lambda self, result: "THE SUMMARY")
    assert main(["train", "train.max_steps=1"]) == 0
    assert capsys.readouterr().out == said
