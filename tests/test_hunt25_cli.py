"""Fixes from session 25's config / CLI hunt."""

import json
import logging
import shutil

import pytest

from chronicals.cli import main
from chronicals.config import load_config
from chronicals.config_schema import stored_config

RUN = ["train.save_every=1", "eval.every=0", "eval.qa=false", "logging.progress=false", "data.batch_size=2",
       "lora.rank=4"]


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
    with pytest.raises(ValueError, match="does not exist"):  # a config about to train still needs it
        load_config(tmp_path / "runB" / "config.yaml")
    with stored_config():
        assert load_config(tmp_path / "runB" / "config.yaml").train.resume == "runA/checkpoints/step-000002"


def test_a_heldout_file_where_the_run_writes_its_copy_is_refused_not_overwritten(tiny_base, tmp_path, monkeypatch,
                                                                                  capsys):
    from chronicals.train.qa import demo_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copy(demo_file("heldout.jsonl"), tmp_path / "data" / "heldout.jsonl")
    before = (tmp_path / "data" / "heldout.jsonl").read_bytes()
    assert main(["train", f"model.path={tiny_base}", *RUN, "train.max_steps=1", "train.out_dir=.",
                 "data.eval_path=data/heldout.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "data.eval_path=data/heldout.jsonl is" in err and "would overwrite it" in err
    assert (tmp_path / "data" / "heldout.jsonl").read_bytes() == before
    assert "keywords" in json.loads(before.splitlines()[0])


def test_out_dir_that_is_the_model_directory_is_refused(tiny_base, capsys):
    listing = sorted(p.name for p in tiny_base.iterdir())
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={tiny_base}", *RUN, "train.max_steps=1"]) == 2
    assert "is model.path" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_base.iterdir()) == listing


@pytest.mark.parametrize("override,said", [
    ("optim.lr=1" + "0" * 400, "expected a number"),
    ("lora.targets=[q_proj", "an unclosed bracket"),
    ("model.recompute=null", "expected a list such as [norm, swiglu]"),
])
def test_config_values_that_were_tracebacks_or_misread(override, said, capsys):
    assert main(["train", override]) == 2
    assert said in capsys.readouterr().err


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


@pytest.mark.parametrize("argv,said", [
    (["chat", "--temperature", "1", "--seed", str(2**64), "hi"], "--seed 18446744073709551616 must be in"),
    (["export", "--adapter", "a", "--out", "o", "--no-merge", "--dtype", "bfloat16"], "--no-merge writes the adapter"),
])
def test_argument_errors_before_any_load(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_a_tilde_on_the_command_line_is_the_home_directory(monkeypatch, tmp_path):
    """YAML reads a bare ~ as null, so train.out_dir=~ was refused as '' and data.eval_path=~ turned held-out
    evaluation off without a word; the shell does not expand ~ after '='."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(None, ["train.out_dir=~"]).train.out_dir == str(tmp_path)
    assert load_config(None, ["data.eval_path=~"]).data.eval_path == "~"  # expanded where it is read
    assert load_config(None, ["data.system_prompt=null"]).data.system_prompt == ""  # null stays null


@pytest.mark.parametrize("world,rc", [("2", 3), ("1", 4)])
def test_a_lost_rank_is_said_as_such_not_as_our_bug(monkeypatch, capsys, world, rc):
    """kill -9 of one rank: the other's gloo collective raised 'Connection reset by peer', which the CLI reported
    as an internal error of chronicals (exit 4, 'please report it')."""
    from chronicals import cli

    monkeypatch.setenv("WORLD_SIZE", world)
    e = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    assert cli._failed(e) == rc
    err = capsys.readouterr().err
    assert ("another process of this data-parallel job failed or was lost" in err) == (world == "2")


def test_the_heldout_copy_clash_is_said_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """Session 26: the refusal above came after the model had loaded (minutes at 8B); a model path that does not
    load shows it now comes first."""
    from chronicals.train.qa import demo_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copy(demo_file("heldout.jsonl"), tmp_path / "data" / "heldout.jsonl")
    loads = []
    monkeypatch.setattr("chronicals.train.loop.load_base", lambda *a, **k: loads.append(a) or 1 / 0)
    assert main(["train", *RUN, "train.max_steps=1", "train.out_dir=.", "data.eval_path=data/heldout.jsonl"]) == 2
    assert "would overwrite it" in capsys.readouterr().err and not loads
