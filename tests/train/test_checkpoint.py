"""Checkpoints written in a background thread (train.async_save): a snapshot taken at save() time, published
only when complete, errors raised in the training thread, and the same files as a synchronous save; train.keep_last
keeps exactly the newest checkpoints."""

from __future__ import annotations

import threading

import pytest
import torch

from chronicals.train import checkpoint as ckpt
from chronicals.train import train
from chronicals.train.checkpoint import checkpoint_dirs, write_checkpoint

from train_helpers import VOCAB, SyntheticLoader, tiny_config, tiny_model


def _trained(steps: int = 2):
    """A tiny model and an AdamW that has stepped (its moments exist), with a cosine-free constant schedule."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(steps):
        model(torch.randint(0, VOCAB, (1, 8)), labels=torch.randint(0, VOCAB, (1, 8))).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _held_writer(monkeypatch) -> threading.Event:
    """torch.save held back until the returned event is set: the test changes the state while the file is written."""
    release = threading.Event()
    real_save = torch.save

    def held_save(obj, path):
        release.wait(timeout=30)
        real_save(obj, path)
    monkeypatch.setattr(ckpt.torch, "save", held_save)
    return release


def test_background_save_holds_the_state_at_save_time(tmp_path, monkeypatch):
    """The write is held back until the weights and moments have changed: the file still holds save() time's."""
    model, opt, sched = _trained()
    expect = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    release = _held_writer(monkeypatch)
    writer = ckpt.CheckpointWriter(background=True)
    path = writer.save(tmp_path, 7, model, opt, sched, {"position": [1, 2]}, keep_last=2)
    assert path == tmp_path / "checkpoints" / "step-000007" and not path.exists()  # not published yet
    with torch.no_grad():  # "the next optimizer step" while the file is being written
        for p in model.parameters():
            p.add_(1.0)
    opt.state[next(iter(model.parameters()))]["exp_avg"].add_(1.0)
    release.set()
    writer.wait()
    state = torch.load(path / "state.pt", weights_only=False)
    for n, v in expect.items():
        assert torch.equal(state["model"][n], v), n
    for k, v in moments.items():
        assert torch.equal(state["optimizer"]["state"][k]["exp_avg"], v), k
    assert state["step"] == 7 and state["data"] == {"position": [1, 2]}


def test_a_background_save_holds_the_data_state_as_it_was(tmp_path, monkeypatch):
    """A loader whose state_dict returns its own list, reshuffled in place for the next epoch while the file is
    written, resumes from the position saved, not the one after."""
    release = _held_writer(monkeypatch)
    order = [3, 1, 2]
    data = {"order": order, "position": {"epoch": 0}}
    writer = ckpt.CheckpointWriter(background=True)
    path = writer.save(tmp_path, 1, *_trained(), data)
    order.reverse()
    data["position"]["epoch"] = 1
    release.set()
    writer.wait()
    assert torch.load(path / "state.pt", weights_only=False)["data"] == {"order": [3, 1, 2], "position": {"epoch": 0}}


def test_a_background_save_holds_extra_as_it_was(tmp_path, monkeypatch):
    release = _held_writer(monkeypatch)
    extra = {"config": {"train": {"max_steps": 5}}, "lora": {"lora_modules": ["a"]}}
    writer = ckpt.CheckpointWriter(background=True)
    path = writer.save(tmp_path, 1, *_trained(), {}, extra=extra)
    extra["config"]["train"]["max_steps"] = 9
    extra["lora"]["lora_modules"].append("b")
    release.set()
    writer.wait()
    st = torch.load(path / "state.pt", weights_only=False)
    assert st["extra"] == {"config": {"train": {"max_steps": 5}}, "lora": {"lora_modules": ["a"]}}


def test_a_failed_background_write_is_raised_and_leaves_nothing(tmp_path, monkeypatch):
    model, opt, sched = _trained(1)

    def full_disk(obj, path):
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    writer = ckpt.CheckpointWriter(background=True)
    writer.save(tmp_path, 3, model, opt, sched, {})
    with pytest.raises(OSError, match="No space left on device"):
        writer.wait()
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no step-000003, no .tmp-* left behind
    writer.wait()  # raised once


def test_a_ctrl_c_while_waiting_leaves_the_write_tracked_and_the_next_wait_publishes_it(tmp_path, monkeypatch):
    """A real SIGINT to the main thread while wait() blocks raises KeyboardInterrupt there; the write goes on and
    the next wait() waits for it. (Python 3.11's Thread.join, so interrupted, marked the thread finished: the next
    join returned at once, and the CLI exited under the writing thread with exit 134 and no checkpoint.)"""
    import os
    import signal

    model, opt, sched = _trained(1)
    release, entered = threading.Event(), threading.Event()
    real_save = ckpt.torch.save

    def held_save(obj, path):
        entered.set()
        release.wait(timeout=30)
        real_save(obj, path)
    monkeypatch.setattr(ckpt.torch, "save", held_save)
    writer = ckpt.CheckpointWriter(background=True)
    path = writer.save(tmp_path, 5, model, opt, sched, {})
    assert entered.wait(timeout=30) and writer.busy
    main = threading.main_thread().ident
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            writer.wait()
    finally:
        signal.signal(signal.SIGINT, old)
    assert writer.busy and not path.exists()  # still writing, still tracked
    threading.Timer(0.3, release.set).start()
    writer.wait()
    assert path.is_dir() and (path / "state.pt").exists() and not writer.busy


def test_training_with_background_saves_writes_what_synchronous_saves_write(tmp_path, docs):
    runs = {}
    for background in (True, False):
        cfg = tiny_config(tmp_path / str(background), train__save_every=2, train__max_steps=5, train__keep_last=3,
                          train__async_save=background)
        res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs, seed=1))
        dirs = ckpt.checkpoint_dirs(cfg.train.out_dir)
        # every 2 steps, and at the end (step 5)
        assert [d.name for d in dirs] == ["step-000002", "step-000004", "step-000005"] and res.checkpoint == dirs[-1]
        runs[background] = [torch.load(d / "state.pt", weights_only=False) for d in dirs]
    for a, b in zip(runs[True], runs[False]):
        assert a["step"] == b["step"] and a["data"] == b["data"] and a["scheduler"] == b["scheduler"]
        for n in a["model"]:
            assert torch.equal(a["model"][n], b["model"][n]), n
        for k, st in a["optimizer"]["state"].items():
            for name, t in st.items():
                assert torch.equal(t, b["optimizer"]["state"][k][name]), (k, name)


def test_a_failed_background_write_stops_training_with_its_error(tmp_path, docs, monkeypatch):
    def full_disk(out_dir, state, keep_last=2):
        raise OSError(28, "No space left on device", str(ckpt.checkpoint_path(out_dir, state["step"])))
    monkeypatch.setattr(ckpt, "write_checkpoint", full_disk)
    cfg = tiny_config(tmp_path, train__save_every=2, train__max_steps=6)
    with pytest.raises(OSError, match=r"No space left on device.*step-000002"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))


def test_a_full_disk_is_an_oserror_naming_the_checkpoint(tmp_path, monkeypatch, capsys):
    """torch.save reports a full disk or a file-size limit as a RuntimeError ("unexpected pos"): the CLI called it an
    internal error (exit 4, a traceback). It is an OSError naming the checkpoint and what to do: exit 3."""
    from chronicals.cli import _failed

    def full(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=r"could not write checkpoint .*step-000003 \(.*unexpected pos.*\); is the disk "
                                      r"of train.out_dir=.* full, or is the folder not writable\?") as e:
        ckpt.write_checkpoint(tmp_path, {"step": 3, "model": {}})
    assert not any((tmp_path / "checkpoints").iterdir())  # no half-written directory left
    assert _failed(e.value) == 3 and "error: could not write checkpoint" in capsys.readouterr().err


def test_a_folder_that_is_not_writable_is_an_oserror_naming_the_checkpoint(tmp_path, monkeypatch):
    """A checkpoints folder the run may not write fails at the write's lock file: the CLI printed only "error:
    [Errno 1] Operation not permitted: '.../.tmp-step-000002-26696.lock'" (a user walk). Named like a full disk."""
    import contextlib
    import errno

    @contextlib.contextmanager
    def refused(tmp):
        raise PermissionError(errno.EPERM, "Operation not permitted", f"{tmp}.lock")
        yield

    monkeypatch.setattr(ckpt, "writer_lock", refused)
    with pytest.raises(OSError, match=r"could not write checkpoint .*step-000002 \(\[Errno 1\] Operation not "
                                      r"permitted: .*\.lock'\); .*or is the folder not writable\? .*fix its "
                                      r"permissions, and resume with train.resume=auto"):
        ckpt.write_checkpoint(tmp_path, {"step": 2, "model": {}})


def test_a_failed_background_write_stops_the_run_at_the_next_step(tmp_path, docs, monkeypatch):
    """A background checkpoint write that fails stops training at the next step, not at the next save: with
    train.save_every=500 a failed write went unnoticed for 500 steps, all trained for nothing (a user walk)."""
    import threading

    def refused(out_dir, state, keep_last=2):
        raise OSError(13, "Permission denied", str(ckpt.checkpoint_path(out_dir, state["step"])))

    monkeypatch.setattr(ckpt, "write_checkpoint", refused)
    steps = []

    def on_step(step, rec):
        steps.append(step)
        for t in threading.enumerate():  # the write of step 3 has ended before step 4 could start
            if t.name == "checkpoint-step-3":
                t.join()

    cfg = tiny_config(tmp_path, train__save_every=3, train__max_steps=12, train__async_save=True)
    with pytest.raises(OSError, match=r"Permission denied.*step-000003"):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), on_step=on_step)
    assert steps == [1, 2, 3]


def test_keep_last_keeps_exactly_the_newest(tmp_path):
    for step in range(1, 6):
        write_checkpoint(tmp_path, {"step": step}, keep_last=2)
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-000004", "step-000005"]


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_a_keep_last_below_one_is_refused_before_anything_is_written(tmp_path, keep_last, background):
    """keep_last=0 from Python read as ``[-0:]`` and kept every checkpoint, the opposite of what it says (the config
    refuses train.keep_last < 1; the API did not). Refused by name before a write, by the caller's save in the
    background writer too (not later, from its thread), and the checkpoints there stay."""
    write_checkpoint(tmp_path, {"step": 1}, keep_last=1)
    with pytest.raises(ValueError, match=rf"keep_last={keep_last!r}: .* integer >= 1"):
        write_checkpoint(tmp_path, {"step": 2}, keep_last=keep_last)
    model, opt, sched = _trained(1)
    with pytest.raises(ValueError, match="keep_last="):
        ckpt.CheckpointWriter(background).save(tmp_path, 3, model, opt, sched, {}, keep_last=keep_last)
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-000001"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000001"]


def test_pruning_keeps_the_newest_checkpoints_that_hold_their_state(tmp_path):
    """A step directory without state.pt (an old kill mid-removal, a copy cut short) is not a checkpoint: it neither
    counts toward keep_last nor survives (counted, it pushed a resumable checkpoint out; a mutation walk)."""
    write_checkpoint(tmp_path, {"step": 2}, keep_last=2)
    (tmp_path / "checkpoints" / "step-000003").mkdir()  # no state.pt
    write_checkpoint(tmp_path, {"step": 4}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step-000002", "step-000004"]


def test_a_full_disk_at_fsync_is_an_oserror_naming_the_checkpoint(tmp_path, monkeypatch):
    """fsync is where a full disk or quota shows on NFS or ext4's delayed allocation, as a bare OSError naming no
    file: the CLI printed 'error: [Errno 28] No space left on device' (a checkpoint walk). Named like torch.save's."""
    import errno
    import os

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "_fsync", full)
    with pytest.raises(OSError, match=r"could not write checkpoint .*step-000003 \(\[Errno 28\] No space left on "
                                      r"device\); is the disk of train.out_dir=.* full, or is the folder not "
                                      r"writable\?"):
        ckpt.write_checkpoint(tmp_path, {"step": 3, "model": {}})
    assert not any((tmp_path / "checkpoints").iterdir())


# ---- unit gaps a mutation walk found (each test fails on its mutant) ----
def test_is_own_compares_resolved_paths(tmp_path, monkeypatch):
    """train.resume spelled another way than train.out_dir (absolute vs relative, or the state.pt file) is still this
    run's checkpoint: otherwise the resume removed every step directory of its own run, the one it resumed from
    too, as "another run's", and started its metrics over."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "run" / "checkpoints" / "step-000002"
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(b"x")
    assert ckpt.is_own(d, "run") and ckpt.is_own(d / "state.pt", "run")
    assert ckpt.is_own("run/checkpoints/step-000002", tmp_path / "run")
    assert not ckpt.is_own(d, tmp_path / "other")


def test_re_saving_a_step_replaces_its_checkpoint(tmp_path):
    """A signal right after a periodic save writes that step again: the new state replaces the old (os.replace onto
    the existing directory failed with "Directory not empty" and the stop's checkpoint was lost)."""
    write_checkpoint(tmp_path, {"step": 3, "model": {"w": torch.full((2,), 1.0)}})
    p = write_checkpoint(tmp_path, {"step": 3, "model": {"w": torch.full((2,), 2.0)}})
    assert torch.equal(torch.load(p / "state.pt", weights_only=True)["model"]["w"], torch.full((2,), 2.0))
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-000003"]


def test_trainable_state_holds_only_the_trainable_parameters():
    """A LoRA checkpoint holds the adapters, not the frozen base (59 MB, not ~600 MB, for SmolLM2-135M)."""
    from chronicals.lora import apply_lora

    model = tiny_model()
    apply_lora(model, r=2)
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    assert want and set(ckpt.trainable_state(model)) == want and len(want) < len(list(model.parameters()))


def test_rng_state_round_trips_python_and_torch():
    """Python's random state is restored too: a user's loader or collate drawing from it resumes exactly."""
    import random

    s = ckpt.rng_state()
    a, b = random.random(), torch.rand(3)
    random.random(), torch.rand(5)
    ckpt.set_rng_state(s)
    assert random.random() == a and torch.equal(torch.rand(3), b)


def test_latest_checkpoint_orders_by_step_number_not_by_name(tmp_path):
    """From step 1,000,000 the zero-padded names no longer sort as the steps do (nor hand-made step-5, step-10)."""
    for name in ("step-999999", "step-1000000", "step-5"):
        d = tmp_path / "checkpoints" / name
        d.mkdir(parents=True)
        (d / "state.pt").write_bytes(b"x")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-1000000"
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-5", "step-999999", "step-1000000"]


def test_a_cpu_checkpoint_resumes_where_cuda_is_available(monkeypatch):
    """A checkpoint written on a machine without CUDA has no "cuda" generator state: resumed on a GPU machine, the
    CUDA generators are left as they are instead of failing on the missing key (CPU cannot tell otherwise, so the
    GPU is faked; on a GPU machine the state's own "cuda" entry is dropped)."""
    state = {k: v for k, v in ckpt.rng_state().items() if k != "cuda"}
    assert set(state) == {"python", "torch"}
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", calls.append)
    ckpt.set_rng_state(state)
    ckpt.set_rng_state({**state, "cuda": ["saved"]})
    assert calls == [["saved"]]


def test_a_step_0_checkpoint_without_moments_loads(tmp_path):
    """A checkpoint at step 0 (written through the API before any optimizer step) holds no AdamW moments, rightly:
    it loads; only one at step N > 0 without any moments is refused as edited."""
    model, opt, sched = _trained(0)
    path = ckpt.write_checkpoint(tmp_path, ckpt.snapshot(0, model, opt, sched, {"position": 0}))
    assert path.name == "step-000000"
    restored = ckpt.load_checkpoint(path, *_trained(0))
    assert restored["step"] == 0 and restored["data"] == {"position": 0}


def test_a_lowered_keep_last_frees_the_older_checkpoints_before_the_write(tmp_path, monkeypatch):
    """A full disk's error says "lower train.keep_last ... and resume": the resumed run then still held keep_last=2's
    two checkpoints while writing the third, and failed at the same step again (a 100 MB tmpfs walk, 39 MB
    checkpoints). Those past the new keep_last go before the write needs their room."""
    for step in (1, 2):
        write_checkpoint(tmp_path, {"step": step}, keep_last=2)
    present = []
    real_save = torch.save

    def spying_save(obj, path):
        present.append([d.name for d in checkpoint_dirs(tmp_path)])
        real_save(obj, path)
    monkeypatch.setattr(ckpt.torch, "save", spying_save)
    write_checkpoint(tmp_path, {"step": 3}, keep_last=1)
    assert present == [["step-000002"]]  # the newest kept until the new one is whole
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-000003"]


def test_a_full_disk_says_the_checkpoints_size_and_the_free_space(tmp_path, monkeypatch):
    """torch's words for a full disk ("unexpected pos 25479040 vs 25478992") do not say it is full: the error says
    how large the checkpoint is and how much the disk had free before the write."""
    import collections
    import shutil

    def full(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 25479040 vs 25478992")
    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: collections.namedtuple("u", "total used free")(0, 0, 27_000_000))
    state = {"step": 1, "model": {"w": torch.zeros(1000, 1000)}, "optimizer": {"state": [torch.zeros(10)]}}
    with pytest.raises(OSError, match=r"step-000001 \(.*unexpected pos.*\); .*a write needs room for one checkpoint "
                                      r"beside the 2 kept\).*train.resume=auto \(the checkpoint takes ~4 MB; its "
                                      r"disk had 27 MB free when the write began\)$"):
        write_checkpoint(tmp_path, state, keep_last=2)
