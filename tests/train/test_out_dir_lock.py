"""One train.out_dir, one run at a time (an flock on out_dir/.chronicals.lock), and the entry point's other
contracts: a resume from another run's checkpoint takes that run's history, ~ in train.out_dir / train.resume /
data.eval_path, exit status 2 for bad train.out_dir / train.resume values, config.yaml a folder, and generation
stopping at the model's context."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chronicals.cli import main
from chronicals.config import ConfigError
from chronicals.train import train
from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs
from chronicals.train.guards import LOCK_FILE, out_dir_lock

from train_helpers import SyntheticLoader, spawn_ranks, synthetic_docs, tiny_config, tiny_model


def _run(tmp_path, docs, model_seed=0, **over):
    return train(tiny_config(tmp_path, **over), model=tiny_model(model_seed), train_loader=SyntheticLoader(docs),
                 eval_loader=SyntheticLoader(synthetic_docs(6, seed=5), shuffle=False))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---- generation stops at the model's context ----

def test_generation_stops_at_the_models_context_with_one_warning(caplog):
    from chronicals.models.generate import generate
    from chronicals.models.generate import greedy_rows

    model = tiny_model()  # max_position_embeddings=128
    prompt = torch.arange(100) % 50
    with caplog.at_level("WARNING", logger="chronicals.generate"):
        assert len(generate(model, prompt, 1000, eos_token_id=[])) == 28
        assert len(generate(model, prompt, 1000, eos_token_id=[])) == 28  # a chat loop: warned once
        outs = greedy_rows(model, torch.stack([prompt, prompt + 1]), 1000, set())
    assert [len(o) for o in outs] == [28, 28]
    assert caplog.text.count("goes past the model's context (max_position_embeddings=128)") == 1
    assert len(generate(model, prompt, 5, eos_token_id=[])) == 5


def test_a_prompt_that_fills_the_context_is_said_to_be_too_long_each_time(caplog):
    """A 721-token prompt to a 512-position model answered "" (chat: exit 0) with advice to lower max_new_tokens to
    "at most 512 minus the prompt's length", a negative number; a second such prompt got no word at all."""
    from chronicals.models.generate import generate

    model = tiny_model()  # max_position_embeddings=128
    with caplog.at_level("WARNING", logger="chronicals.generate"):
        assert len(generate(model, torch.arange(130) % 50, 3, eos_token_id=[])) == 0
        assert len(generate(model, torch.arange(140) % 50, 3)) == 0
    assert caplog.text.count("the prompt alone fills the model's context (max_position_embeddings=128)") == 2
    assert "130-token prompt" in caplog.text and "shorten the prompt" in caplog.text
    assert "minus the prompt's length" not in caplog.text


# ---- tilde: ~ is the home directory ----

def test_tilde_in_out_dir_resume_and_eval_path_is_home(tmp_path, docs, monkeypatch):
    """train.out_dir=~/x wrote a literal ./~ folder; train.resume=~/... was refused as missing; a held-out QA file
    under ~ was not read as QA."""
    from chronicals.train.setup import data_files

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = tiny_config(tmp_path, train__out_dir="~/run", train__max_steps=1)
    assert cfg.train.out_dir == str(tmp_path / "home" / "run")
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert not (work / "~").exists() and checkpoint_dirs(tmp_path / "home" / "run")
    cfg = tiny_config(tmp_path, train__out_dir="~/run", train__max_steps=2,
                      train__resume="~/run/checkpoints/step-000001")
    assert train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs)).start_step == 1
    (tmp_path / "home" / "held.jsonl").write_text('{"question": "Who?", "answer": "Ada"}\n')
    _, _, qa = data_files(tiny_config(tmp_path, data__path=str(work), data__eval_path="~/held.jsonl"), work / "o")
    assert qa and qa[0]["question"] == "Who?"


# ---- exit status 2 for bad train.out_dir / train.resume values ----

def test_bad_out_dir_and_resume_values_exit_2(tmp_path, docs, capsys):
    (tmp_path / "afile").write_text("x")
    args = [f"model.path={tmp_path / 'missing'}", "train.max_steps=1"]  # reaching the model load would be 3
    assert main(["train", f"train.out_dir={tmp_path / 'afile'}", *args]) == 2
    assert "afile is a file, not a directory" in capsys.readouterr().err
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1)
    run = tmp_path / "run"
    for resume in (tmp_path, run, run / "checkpoints"):  # no state.pt: 3 while a missing one was 2
        assert main(["train", f"train.out_dir={tmp_path / 'other'}", f"train.resume={resume}", *args]) == 2
        err = capsys.readouterr().err
        assert "holds no checkpoint (no state.pt)" in err
        if resume != tmp_path:  # a run's out_dir (or its checkpoints/) is answered with its newest checkpoint
            assert f"its newest checkpoint is train.resume={run / 'checkpoints' / 'step-000002'}" in err


def test_a_run_directory_given_as_resume_names_what_to_pass_for_it(tmp_path, capsys):
    """Was 'or set train.resume=auto' whatever the directory: auto looks in this run's out_dir, not the one given."""
    other, empty = tmp_path / "other", tmp_path / "empty"
    (other / "checkpoints" / "step-000002").mkdir(parents=True)
    (other / "checkpoints" / "step-000002" / STATE_FILE).write_bytes(b"")
    empty.mkdir()
    args = [f"model.path={tmp_path / 'missing'}", "train.max_steps=1"]  # reaching the model load would be 3
    newest = f"its newest checkpoint is train.resume={other / 'checkpoints' / 'step-000002'}; "
    for out_dir, hint in ((tmp_path / "me", f"or continue that run in its own directory with train.out_dir={other} "
                                            "train.resume=auto"), (other, "or set train.resume=auto")):
        for resume in (other, other / "checkpoints"):
            assert main(["train", f"train.out_dir={out_dir}", f"train.resume={resume}", *args]) == 2
            assert newest + hint in capsys.readouterr().err
        assert main(["train", f"train.out_dir={out_dir}", f"train.resume={empty}", *args]) == 2
        err = capsys.readouterr().err  # auto offered only where it finds a checkpoint, naming it
        assert ("or train.resume=auto" in err) == (out_dir == other)
        assert out_dir != other or f"(continues from {other / 'checkpoints' / 'step-000002'})" in err


# ---- config.yaml a folder ----

def test_config_yaml_a_folder_is_refused_before_training(tmp_path, docs):
    """Was a bare '[Errno 21] Is a directory' at the first record, after a fresh run removed the old checkpoints."""
    _run(tmp_path, docs, train__max_steps=2)
    run = tmp_path / "run"
    (run / "config.yaml").unlink()
    (run / "config.yaml").mkdir()
    with pytest.raises(IsADirectoryError, match="config.yaml is a directory: .*move it away or set another"):
        _run(tmp_path, docs, train__max_steps=2, train__resume="none")
    assert [d.name for d in checkpoint_dirs(run)] == ["step-000002"]


# ---- resume from another run's checkpoint ----

def test_a_resume_from_another_runs_checkpoint_takes_that_runs_history(tmp_path, docs, caplog):
    """runs/b resumed from runs/a/checkpoints/step-2 kept runs/b's own steps 1..2 (another model's) before step 3,
    and its "before" held-out loss."""
    a = _run(tmp_path / "a", docs, train__max_steps=4, train__save_every=2, train__keep_last=5)
    b_first = _run(tmp_path / "b", docs, model_seed=1, train__max_steps=2)
    assert b_first.eval_loss_before != a.eval_loss_before
    src = tmp_path / "a" / "run" / "checkpoints" / "step-000002"
    with caplog.at_level("INFO", logger="chronicals.train"):
        b = _run(tmp_path / "b", docs, train__max_steps=4, train__resume=str(src))
    assert "another run's checkpoint" in caplog.text
    recs = _records(tmp_path / "b" / "run")
    a_recs = _records(tmp_path / "a" / "run")
    assert recs[:3] == [r for r in a_recs if r["step"] <= 2 and r.get("tag") != "after"]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert b.eval_loss_before == a.eval_loss_before
    # a checkpoint copied out of its run: no history to take; this run's starts at step 3, said
    loose = tmp_path / "loose"
    import shutil

    shutil.copytree(src, loose)
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        c = _run(tmp_path / "b", docs, train__max_steps=4, train__resume=str(loose))
    assert "starts at step 3" in caplog.text
    assert [r["step"] for r in _records(tmp_path / "b" / "run") if r["kind"] == "train"] == [3, 4]
    assert c.eval_loss_before is None


# ---- the lock ----

def test_an_own_resume_from_step_1_without_metrics_jsonl_says_where_the_file_starts(tmp_path, docs, caplog):
    """As at step 2 (test_runs_in_one_out_dir): a resume of out_dir's step-1 checkpoint with metrics.jsonl gone
    restarts the file at step 2; the user is told step 1's records (and the 'before' loss) are gone."""
    _run(tmp_path, docs, train__max_steps=1)
    (tmp_path / "run" / "metrics.jsonl").unlink()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=2, train__resume="auto")
    assert "has no metrics.jsonl: it starts at step 2 (the records of steps 1..1" in caplog.text


def test_another_runs_unreadable_metrics_is_said_and_the_resume_goes_on(tmp_path, docs, caplog):
    """Resuming runs/b from runs/a's checkpoint while runs/a/metrics.jsonl has a damaged line: the resume goes on
    (that history is optional), with a warning naming the file and line; it did not fail the run."""
    _run(tmp_path / "a", docs, train__max_steps=2)
    a_metrics = tmp_path / "a" / "run" / "metrics.jsonl"
    a_metrics.write_text("not json\n" + a_metrics.read_text())
    src = tmp_path / "a" / "run" / "checkpoints" / "step-000002"
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path / "b", docs, train__max_steps=3, train__resume=str(src))
    assert f"{a_metrics} could not be read" in caplog.text and "metrics.jsonl:1:" in caplog.text
    assert [r["step"] for r in _records(tmp_path / "b" / "run") if r["kind"] == "train"] == [3]


def test_a_resume_from_another_runs_state_file_takes_that_runs_history(tmp_path, docs):
    """train.resume may name a checkpoint's state.pt instead of its step-N directory (load_checkpoint takes
    both): the history taken is the same, runs/a's steps 1..2, not none."""
    _run(tmp_path / "a", docs, train__max_steps=2)
    src = tmp_path / "a" / "run" / "checkpoints" / "step-000002" / STATE_FILE
    _run(tmp_path / "b", docs, train__max_steps=3, train__resume=str(src))
    assert [r["step"] for r in _records(tmp_path / "b" / "run") if r["kind"] == "train"] == [1, 2, 3]


IN_USE = "is in use by another chronicals run"


def _hold(out: Path):
    """The lock a running run holds, taken by this process: the file object (closing it releases the lock)."""
    out.mkdir(parents=True, exist_ok=True)
    fh = (out / LOCK_FILE).open("a")
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fh


def _contents(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() if p.is_file() else None for p in sorted(out.rglob("*"))}


def test_a_locked_out_dir_is_refused_at_once_not_waited_for(tmp_path):
    """A second run on an out_dir in use fails at once, not after waiting, silently, for the first run to finish
    (hours) to train over its out_dir. First of the lock tests: a lock that waits hangs those below (make test's -x
    stops at this failure instead)."""
    import threading

    out = tmp_path / "run"
    said = []

    def second():
        try:
            with out_dir_lock(out):
                said.append("locked")
        except ConfigError as e:
            said.append(str(e))

    first = _hold(out)
    t = threading.Thread(target=second, daemon=True)
    t.start()
    t.join(20)
    waited = t.is_alive()
    first.close()  # lets a waiting thread go
    t.join(20)
    assert not waited and len(said) == 1 and IN_USE in said[0]


def test_a_second_run_on_a_locked_out_dir_is_refused_at_once_and_leaves_it_alone(tmp_path, docs, capsys):
    """Both runs trained (every step twice in metrics.jsonl); one failing in setup removed the other's files."""
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1)
    out = tmp_path / "run"
    before = _contents(out)
    with _hold(out):
        with pytest.raises(ConfigError, match=f"train.out_dir={out} {IN_USE}.*set another train.out_dir"):
            _run(tmp_path, docs, train__max_steps=3, train__resume="none")
        with pytest.raises(ConfigError, match=IN_USE):  # one failing in setup (no batches) is refused the same way
            train(tiny_config(tmp_path, train__max_steps=3), model=tiny_model(), train_loader=SyntheticLoader([]))
        # the CLI: a bad argument (exit status 2), refused before the model loads (this one does not exist: 3)
        assert main(["train", f"train.out_dir={out}", f"model.path={tmp_path / 'missing'}", "train.max_steps=1"]) == 2
        err = capsys.readouterr().err
        assert f"error: train.out_dir={out} {IN_USE}" in err
        assert {k: v for k, v in _contents(out).items() if k != LOCK_FILE} == before
    assert _run(tmp_path, docs, train__max_steps=3, train__resume="auto").start_step == 2  # released: runs on


def test_the_lock_leaves_no_file_and_a_stale_one_is_no_obstacle(tmp_path, docs):
    out = tmp_path / "run"
    _run(tmp_path, docs, train__max_steps=1)
    assert not (out / LOCK_FILE).exists()
    (out / LOCK_FILE).write_text("12345\n")  # a killed run's (its flock went with it)
    assert _run(tmp_path, docs, train__max_steps=2, train__resume="auto").step == 2
    assert not (out / LOCK_FILE).exists()
    with pytest.raises(ValueError, match="no batches"):  # failed in setup in a fresh out_dir: no out_dir left
        train(tiny_config(tmp_path / "fresh"), model=tiny_model(), train_loader=SyntheticLoader([]))
    assert not (tmp_path / "fresh" / "run").exists()


_RUN_A = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model
from chronicals.train import train
tmp, started, go = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
def on_step(step, rec):
    if step == 1:
        started.touch()
        end = time.time() + 120
        while not go.exists() and time.time() < end:
            time.sleep(0.02)
train(tiny_config(tmp, train__max_steps=3, train__save_every=1, train__keep_last=5), model=tiny_model(),
      train_loader=SyntheticLoader(synthetic_docs(40, seed=1)), on_step=on_step)
"""


def test_two_processes_on_one_out_dir(tmp_path, docs):
    """A real second process: run A waits after its first step while run B starts on the same out_dir."""
    started, go = tmp_path / "started", tmp_path / "go"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    a = subprocess.Popen([sys.executable, "-c", _RUN_A, str(Path(__file__).parent), str(tmp_path), str(started),
                          str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.time() + 120
        while not started.exists():
            assert a.poll() is None, a.stdout.read()
            assert time.time() < end, "run A did not reach its first step"
            time.sleep(0.05)
        with pytest.raises(ConfigError, match=IN_USE):
            _run(tmp_path, docs, train__max_steps=3, train__resume="none")
    finally:
        go.touch()
        out, _ = a.communicate(timeout=120)
    assert a.returncode == 0, out
    run = tmp_path / "run"
    assert [r["step"] for r in _records(run)] == [1, 2, 3]  # A's steps, once each
    assert [d.name for d in checkpoint_dirs(run)] == ["step-000001", "step-000002", "step-000003"]
    assert not (run / LOCK_FILE).exists()


def _rank_worker(rank, tmp_path, port):
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        train(tiny_config(tmp_path, train__max_steps=1), model=tiny_model(),
              train_loader=SyntheticLoader(synthetic_docs(8, seed=rank)))
        outcome = "trained"
    except ConfigError as e:
        outcome = str(e)
    (tmp_path / f"rank{rank}").write_text(outcome)


def test_data_parallel_ranks_are_all_refused_when_rank_0_cannot_lock(tmp_path):
    """Rank 0 alone locks (it alone writes there); the others hear of its refusal instead of waiting for it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _hold(tmp_path / "run"):
        spawn_ranks(_rank_worker, args=(tmp_path, port), nprocs=2)
    assert IN_USE in (tmp_path / "rank0").read_text() and IN_USE in (tmp_path / "rank1").read_text()


def _rank(rank: int, others_refused: bool = False):
    """A data-parallel rank of two, its all-reduced flag answering as if another rank had been refused, and the
    flags it sent in ``sent``."""
    from types import SimpleNamespace

    sent = []

    def all_reduce_flag(value):
        sent.append(bool(value))
        return int(bool(value) or others_refused)

    return SimpleNamespace(is_main=rank == 0, enabled=True, all_reduce_flag=all_reduce_flag, sent=sent)


def test_a_rank_other_than_0_leaves_the_lock_to_rank_0(tmp_path):
    from chronicals.train.run_dir import _locked_out_dir

    out = tmp_path / "run"
    dp = _rank(1)
    with _hold(out), _locked_out_dir(out, dp):  # the lock rank 0 holds
        pass
    assert dp.sent == [False]


def test_rank_0_refused_tells_the_others_and_says_who_holds_the_lock(tmp_path):
    from chronicals.train.run_dir import _locked_out_dir

    out = tmp_path / "run"
    dp = _rank(0)
    with _hold(out), pytest.raises(ConfigError, match=rf"{IN_USE} \(it holds {out / LOCK_FILE}\)"):
        with _locked_out_dir(out, dp):
            pass
    assert dp.sent == [True]


def test_the_refusal_names_the_process_that_holds_the_lock_and_whether_it_runs(tmp_path):
    """It named only the lock file; the pid the holder writes there was left for the user to find (a walk)."""
    out = tmp_path / "run"
    with _hold(out) as fh:
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        with pytest.raises(ConfigError, match=rf"{IN_USE} \(process {os.getpid()}, running; it holds "
                                              rf"{out / LOCK_FILE}\); wait for it"):
            with out_dir_lock(out):
                pass
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()  # a pid whose process has exited
        fh.seek(0)
        fh.truncate()
        fh.write(f"{gone}\n")
        fh.flush()
        with pytest.raises(ConfigError, match=rf"\(process {gone}, which has exited; a process it started still "
                                              "holds the lock; it holds"):
            with out_dir_lock(out):
                pass


def test_a_rank_told_of_rank_0s_refusal_says_so_and_what_to_do(tmp_path):
    from chronicals.train.run_dir import _locked_out_dir

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"^train.out_dir={out} {IN_USE} \(rank 0 could not lock it\); wait for "
                                          "it to finish, or set another train.out_dir$"):
        with _locked_out_dir(out, _rank(1, others_refused=True)):
            pass

def test_an_out_dir_that_cannot_be_written_names_the_setting_and_the_fix(tmp_path, docs, monkeypatch, capsys):
    """A finished run's out_dir on a read-only file system (or another user's directory) gave a bare
    "error: [Errno 30] Read-only file system: '.../.chronicals.lock'" (a concurrency walk)."""
    import errno
    import os

    _run(tmp_path, docs, train__max_steps=1)
    out = tmp_path / "run"
    real = os.open

    def read_only(path, *a, **k):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    assert main(["train", f"train.out_dir={out}", f"model.path={tmp_path / 'missing'}", "train.max_steps=2"]) == 3
    err = capsys.readouterr().err
    assert f"error: train.out_dir={out} cannot be written (Read-only file system" in err, err
    assert "set train.out_dir to a folder you can write" in err and "Traceback" not in err


def test_a_lock_file_removed_before_it_was_locked_is_not_the_one_held(tmp_path, monkeypatch):
    """A run that opened out_dir/.chronicals.lock just as the run before removed it on its way out holds a lock on a
    file no path names: it locks the new file instead, or a third run locks that one and two runs train in one
    out_dir, mixing their checkpoints and metrics.jsonl."""
    out = tmp_path / "run"
    out.mkdir()
    real, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(op)
        if len(calls) == 1:  # the run before this one removes the file and lets its lock go, right now
            (out / LOCK_FILE).unlink()
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with out_dir_lock(out):
        assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        monkeypatch.setattr(fcntl, "flock", real)
        with pytest.raises(ConfigError, match=IN_USE):
            with out_dir_lock(out):
                pass
    assert not (out / LOCK_FILE).exists()


def test_a_lock_file_left_by_a_killed_run_names_only_the_run_that_holds_it(tmp_path):
    """A run killed with SIGKILL leaves its lock file (nothing unlinks it); the next run locks that file and writes
    its own pid over the old one's whole content, not over its first bytes ("4242\n" after "1234567890\n" read
    "4242\n67890\n", a pid a person would look for)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("1234567890123\n")
    with out_dir_lock(out):
        assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert not (out / LOCK_FILE).exists()


def test_a_file_system_without_flock_trains_unlocked_and_says_so(tmp_path, no_flock, caplog):
    """Where flock fails with another error than "held" (ENOLCK on some network mounts) the run goes on unlocked
    with a warning naming out_dir, and leaves no lock file behind (not a ConfigError saying the directory is in
    use: nothing else holds it)."""
    out = tmp_path / "run"
    out.mkdir()
    ran = []
    with caplog.at_level("WARNING", logger="chronicals"):
        with out_dir_lock(out):
            ran.append(True)
    assert ran == [True] and not (out / LOCK_FILE).exists()
    assert f"train.out_dir={out} is not locked against a second run" in caplog.text
    assert "No locks available" in caplog.text


def test_a_run_on_a_file_system_without_flock_writes_everything_and_resumes(tmp_path, no_flock):
    """Past the run lock's warning, every write still takes its writer's flock (config.yaml, metrics, checkpoints,
    model/): each goes on unlocked there, so the run trains, saves and resumes exactly as anywhere else."""
    docs = synthetic_docs(40)
    _run(tmp_path, docs, train__max_steps=2, train__save_every=2, train__save_final=True)
    out = tmp_path / "run"
    assert (out / "config.yaml").is_file() and (out / "model" / "config.json").is_file()
    (ck,) = checkpoint_dirs(out)
    assert ck.name == "step-000002" and (ck / STATE_FILE).is_file()
    _run(tmp_path, docs, train__max_steps=4, train__resume="auto")
    steps = [r["step"] for r in _records(out) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    assert not list(out.rglob("*.lock")) and not list(out.rglob(".*tmp*"))
