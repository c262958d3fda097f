"""What the commands exit with, and say, where the input is at fault: 2 for a bad flag or value, a setting this
machine cannot run, or an output that would overwrite an input (before any model loads), 3 for bad input met
while running (an unwritable GGUF cache) or a lost data-parallel rank (not 4, which asks for a bug report), and 0
for --version."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch

from chronicals.cli import main

RUN = ["train.save_every=1", "eval.every=0", "eval.qa=false", "logging.progress=false", "data.batch_size=2",
       "lora.rank=4"]


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


def test_the_heldout_copy_clash_is_said_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """The refusal above came after the model had loaded (minutes at 8B); a model path that does not load shows it
    now comes first."""
    from chronicals.train.qa import demo_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copy(demo_file("heldout.jsonl"), tmp_path / "data" / "heldout.jsonl")
    loads = []
    monkeypatch.setattr("chronicals.train.loop.load_base", lambda *a, **k: loads.append(a) or 1 / 0)
    assert main(["train", *RUN, "train.max_steps=1", "train.out_dir=.", "data.eval_path=data/heldout.jsonl"]) == 2
    assert "would overwrite it" in capsys.readouterr().err and not loads


def test_out_dir_that_is_the_model_directory_is_refused(tiny_base, capsys):
    listing = sorted(p.name for p in tiny_base.iterdir())
    assert main(["train", f"model.path={tiny_base}", f"train.out_dir={tiny_base}", *RUN, "train.max_steps=1"]) == 2
    assert "is model.path" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_base.iterdir()) == listing


@pytest.mark.skipif(torch.cuda.is_available(), reason="model.device=auto resolves to the GPU here")
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_model_impl_triton_on_a_cpu_exits_2_before_the_model_loads(device, tmp_path, monkeypatch, capsys):
    """model.impl=triton on a CPU was load_model's ValueError ("load_model: impl='triton' needs a CUDA tensor"),
    raised after the model had loaded and reported as bad input (exit 3); the README says a value this machine
    cannot run exits 2, before any model is loaded."""
    import chronicals.train.loop as loop

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before model.impl was checked")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(loop, "load_base", no_load)
    out = tmp_path / "run"
    assert main(["train", "model.impl=triton", f"model.device={device}", f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "model.impl=triton needs CUDA" in err and "model.impl=auto" in err, err
    assert "load_model" not in err and "Traceback" not in err, err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv,said", [
    (["chat", "--temperature", "1", "--seed", str(2**64), "hi"], "--seed 18446744073709551616 must be in"),
    (["export", "--adapter", "a", "--out", "o", "--no-merge", "--dtype", "bfloat16"], "--no-merge writes the adapter"),
    (["export", "--adapter", "a", "--out", "  "], "--out is empty; give the output directory"),  # not a folder "  "
    # a device torch names but chronicals does not run on: the flags are checked here alone (model.device when read)
    (["eval", "--model", "no-model", "no-data.jsonl", "--device", "mps"], "--device=mps: chronicals runs on cpu or "
                                                                          "cuda; use auto, cpu, cuda or cuda:N"),
    (["chat", "--model", "no-model", "--device", "meta", "hi"], "--device=meta: chronicals runs on cpu or cuda"),
    # a value option given twice (the last one won, unsaid), as the config refuses a key given twice
    (["eval", "--model", "a", "--model=b", "demo"], "--model was given twice; give it once"),
    (["chat", "--max-new-tokens", "3", "--max-new-tokens", "4", "hi"], "--max-new-tokens was given twice"),
    (["export", "--adapter", "a", "--out", "o", "--out", "p"], "--out was given twice"),
    (["bench", "--shape", "0.5b", "--shape", "8b"], "--shape was given twice"),
])
def test_argument_errors_before_any_load(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["chat", "--max-new-tokens", "3", "--max-new-tokens", "4", "--help"],
                                  ["eval", "--help", "--model", "a", "--model", "b"]])
def test_help_wins_over_an_option_given_twice_wherever_it_stands(argv, capsys):
    """The repeat is refused once the parse is done, so a --help after it still prints the help (exit 0)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: chronicals ")


@pytest.mark.parametrize("layout", ["cache is a file", "gguf/ is a file"])
def test_a_gguf_cache_that_cannot_be_written_names_chronicals_cache(layout, tmp_path, monkeypatch, capsys):
    """A .gguf model with $CHRONICALS_CACHE (or ~/.cache/chronicals) not writable: a read-only home, a file in the
    way. It was a bare "error: [Errno 20] Not a directory: '.../gguf'" naming neither the setting nor the fix."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # never read: the cache folder fails first
    cache = tmp_path / "cache"
    if layout == "cache is a file":
        cache.write_text("")
    else:
        cache.mkdir()
        (cache / "gguf").write_text("")
    monkeypatch.setenv("CHRONICALS_CACHE", str(cache))
    assert main(["chat", "--model", str(model), "--device", "cpu", "hi"]) == 3
    err = capsys.readouterr().err
    assert f"{model}: cannot write its conversion" in err and "set CHRONICALS_CACHE to a writable directory" in err, err
    assert "[Errno" not in err and "Traceback" not in err, err


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


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag(flag, capsys):
    """`chronicals --version`, what a user of any pip-installed CLI tries first, was "unknown command", exit 2."""
    import chronicals

    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == f"chronicals {chronicals.__version__}"


def test_a_diverged_run_exits_1_with_one_error_line(monkeypatch, capsys):
    """USAGE promises exit 1 for a run that diverged (NaN/inf), kept apart from 4 (our bug) so a sweep script can
    retry with a lower lr; no test held the status the CLI returns for TrainingDiverged."""
    import chronicals.train as train_pkg
    from chronicals.train import TrainingDiverged

    def diverged(cfg, report=None):
        raise TrainingDiverged("loss is nan at step 3")
    monkeypatch.setattr(train_pkg, "train", diverged)
    assert main(["train", "train.max_steps=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: loss is nan at step 3") and "Traceback" not in err, err


@pytest.mark.parametrize("name", ["lr=3e-4.yaml", "my.yml"])
def test_an_existing_config_file_is_the_config(tmp_path, monkeypatch, name):
    """The first argument naming a config file in the working directory is the CONFIG: lr=3e-4.yaml (a sweep's
    naming; without the is_file() check it was taken for an override 'lr=3e-4.yaml' and the run refused with an
    unknown key) and my.yml (USAGE and the refusal "a config file must end in .yaml or .yml" promise .yml; no test
    gave train one, so a check of .yaml alone would have refused it)."""
    import chronicals.config as config

    (tmp_path / name).write_text("optim:\n  lr: 3.0e-4\n")
    monkeypatch.chdir(tmp_path)
    seen = []

    def load_config(path, overrides):
        seen.append((path, list(overrides)))
        raise ValueError("stop here")
    monkeypatch.setattr(config, "load_config", load_config)
    assert main(["train", name, "train.max_steps=2"]) == 2
    assert seen == [(name, ["train.max_steps=2"])]


def test_a_joined_config_flag_names_the_file_to_give(capsys):
    """`chronicals train --config=runs/x.yaml` (the joined form of a flag other tools take) is refused, exit 2, with
    the hint naming the file to give instead, as the separate `--config runs/x.yaml` is; a check of the separate
    form alone gave the joined one the generic "--config=runs/x.yaml is not an option" without the file."""
    assert main(["train", "--config=runs/x.yaml", "optim.lr=1e-4"]) == 2
    err = capsys.readouterr().err
    assert ("error: --config is not an option: give the config file itself, as in chronicals train runs/x.yaml"
            in err), err


def test_an_unknown_command_exits_2_and_help_exits_0(capsys):
    """A typo'd command (chronicals trian) prints the usage and must fail (exit 2) so a script stops there; with
    the status dropped it exited 0 and a pipeline went on as if training had run."""
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "error: unknown command 'trian'" in err
    assert main([]) == 0 and main(["--help"]) == 0


def test_help_after_other_train_arguments_still_prints_the_keys(capsys):
    """`chronicals train my.yaml --help` (help asked for at the end of a typed command) prints the usage and every
    key, exit 0; checked at argv[0] only, it was refused as "--help is not an option", exit 2."""
    assert main(["train", "my.yaml", "optim.lr=1e-4", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: chronicals train") and "optim.lr" in out


def test_short_help_prints_the_usage_and_keys(capsys):
    """`chronicals train -h` prints the usage and every key, exit 0, as --help does (the usual short form of any
    CLI); with -h left out of the check it was refused as "-h is not an option", exit 2."""
    assert main(["train", "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: chronicals train") and "optim.lr" in out


def test_main_puts_the_callers_signal_handlers_back(capsys):
    """main() installs its own SIGINT/SIGTERM handlers while a command runs and puts the caller's back when it
    returns, whatever the outcome (a return, an argparse SystemExit): a program or test calling main() in-process
    keeps its own handlers. Without the restore, a later SIGTERM in the caller raised KeyboardInterrupt."""
    def mine(signum, frame):
        pass

    old = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["train", "--help"]) == 0
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(SystemExit):  # an argument error: argparse exits from inside the command
            main(["chat", "--max-new-tokens", "0", "hi"])
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_CTRL_C_AT_TORCH = """
import os, signal, sys

class CtrlC:  # the user's Ctrl-C while torch is being imported: the first 2 s of every command
    fired = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" and not cls.fired:
            cls.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC)
from chronicals.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["train", "train.max_steps=1"], ["eval", "demo"], ["chat", "hi"],
                                  ["export", "--model", "x", "--out", "OUT"]])
def test_a_ctrl_c_while_a_command_starts_is_one_line_and_130(argv, tmp_path):
    """`import chronicals.cli` imported torch (through chronicals/__init__) before main() took over SIGINT: a Ctrl-C
    in those 2 s printed a 25-line KeyboardInterrupt traceback ending in torch/_meta_registrations.py. Run in a
    process of its own, whose startup is the one under test."""
    import os
    import subprocess
    import sys

    argv = [str(tmp_path / "o") if a == "OUT" else a for a in argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _CTRL_C_AT_TORCH, *argv], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 130 and len(lines) == 1 and lines[0].startswith("interrupted (SIGINT): "), done.stderr
    assert not list(tmp_path.iterdir())  # nothing written
