"""A Ctrl-C (or SIGTERM) while the end-of-run checkpoint is written: it was outside the loop's stop flag, so the CLI's
KeyboardInterrupt landed in the background writer's join. The write was abandoned (no checkpoint: resume=auto then
trained from step 0 over metrics.jsonl) and the interpreter's exit killed the writer thread (SIGABRT). Now the
write finishes, the run returns "interrupted", and resume=auto finds it done and writes the final adapter."""

import os
import signal
import time

import pytest
import torch

import chronicals.train.checkpoint as ckpt
from chronicals.train import train
from chronicals.train.checkpoint import checkpoint_dirs

from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model


@pytest.mark.parametrize("async_save", [True, False])
def test_a_signal_during_the_last_checkpoint_keeps_it(tmp_path, monkeypatch, async_save):
    real = torch.save
    sent = []

    def save_then_signal(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 3 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, while it waits for this write
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_then_signal)
    over = dict(lora__enabled=True, lora__targets=["q_proj"], train__max_steps=3, train__save_final=True,
                train__async_save=async_save, train__resume="auto")
    docs = synthetic_docs(30, seed=1)
    result = train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert sent and result.status == "interrupted" and result.step == 3
    run = tmp_path / "run"
    assert [d.name for d in checkpoint_dirs(run)] == ["step-000003"] and not (run / "adapter").exists()
    monkeypatch.setattr(torch, "save", real)
    again = train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert again.status == "completed" and again.start_step == 3 and (run / "adapter").is_dir()


def test_a_second_sigterm_finishes_the_step_and_a_second_ctrl_c_stops_at_once():
    """Only a second Ctrl-C aborts the step in flight (KeyboardInterrupt, as the log line promises); a repeated SIGTERM
    (supervisors resend it) keeps "finish this step, checkpoint, exit". The handlers are restored on exit."""
    from chronicals.train.stop import StopFlag

    before = signal.getsignal(signal.SIGINT)
    try:
        with StopFlag() as stop:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes: room to land inside the block
                pass
    except KeyboardInterrupt:  # (escaping, it would end the whole pytest session, not fail this test)
        pytest.fail("a second SIGTERM raised KeyboardInterrupt: the step in flight would not be checkpointed")
    assert stop.signum == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        with StopFlag() as stop:
            os.kill(os.getpid(), signal.SIGINT)  # the first: a flag only
            assert stop.signum == signal.SIGINT
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
    assert signal.getsignal(signal.SIGINT) is before


def test_a_sigterm_after_ctrl_c_keeps_the_first_stop_and_says_so_once(caplog):
    """SIGINT, then SIGTERM: the stop the first one began goes on (the run still says "stopped by SIGINT"), and the
    second is noted as such, not announced as a new stop with the same "finishing this step" line (a user walk)."""
    from chronicals.train.stop import StopFlag

    with caplog.at_level("WARNING", logger="chronicals.train"):
        with StopFlag() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    assert stop.signum == signal.SIGINT
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("received SIGINT: finishing this step"), said
    assert said[1].startswith("received SIGTERM while already stopping (SIGINT): still finishing this step"), said


def test_under_torchrun_a_sigterm_after_ctrl_c_is_the_second_ctrl_c(monkeypatch):
    """torchrun alone gets the terminal's Ctrl-C and passes the second one on to the ranks as SIGTERM: there it stops
    without finishing the step, as "Ctrl-C again" promises (the step went on to the end; a data-parallel walk)."""
    from chronicals.train.stop import StopFlag

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(KeyboardInterrupt):
        with StopFlag():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    with StopFlag() as stop:  # a SIGTERM first (a scheduler's, or torchrun's own stop) is a stop, not an abort
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
    assert stop.signum == signal.SIGTERM


@pytest.mark.parametrize("save_every", [0, 2], ids=["stop-save", "save_every-step"])
def test_a_second_ctrl_c_during_the_stops_checkpoint_write_stops_once_it_is_written(tmp_path, monkeypatch,
                                                                                     save_every):
    """A SIGTERM at step 2, then a Ctrl-C while the stop's checkpoint (its own, or the save_every step's in flight) is
    written: the write finishes (step-000002 is published) and train() raises KeyboardInterrupt, with the handlers
    restored. Waited for only after the loop, under the late-signal flag, the second Ctrl-C was taken for a first
    one and train() returned "interrupted" as if nothing more had been asked."""
    real = ckpt.write_checkpoint

    def ctrl_c_during_the_write(*a, **k):
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # the second signal: the first was the SIGTERM below
        time.sleep(0.2)
        return real(*a, **k)
    monkeypatch.setattr(ckpt, "write_checkpoint", ctrl_c_during_the_write)

    def sigterm_at_step_2(step, rec):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    cfg = tiny_config(tmp_path, train__max_steps=6, train__save_every=save_every, train__async_save=True)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40, seed=1)),
              on_step=sigterm_at_step_2)
    assert signal.getsignal(signal.SIGINT) is before
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-000002"


def test_the_stop_flag_works_in_a_worker_thread():
    """train() in a worker thread (a notebook's or a server's): signal.signal() works only in the main thread, so the
    stop flag installs no handlers there (and changes none) instead of failing with "signal only works in main
    thread"."""
    import threading

    from chronicals.train.stop import StopFlag

    before = signal.getsignal(signal.SIGTERM)
    got = {}

    def run():
        try:
            with StopFlag() as stop:
                got["signum"] = stop.signum
        except BaseException as e:  # noqa: BLE001 - reported below
            got["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert got == {"signum": None}, got
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_error_after_a_checkpoint_publishes_it_before_it_is_raised(tmp_path, monkeypatch):
    """Training fails (an on_step callback raises) while a background checkpoint write is in flight: the checkpoint is
    published before the error leaves train(), so resume=auto finds it at once and no write goes on after train()
    (and its out_dir lock) are gone."""
    real = ckpt.write_checkpoint

    def slow(*a, **k):
        time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(ckpt, "write_checkpoint", slow)

    def on_step(step, rec):
        if step == 2:
            raise RuntimeError("callback failed")
    with pytest.raises(RuntimeError, match="callback failed"):
        train(tiny_config(tmp_path, train__max_steps=4, train__save_every=1, train__async_save=True),
              model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40, seed=1)), on_step=on_step)
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-000002"
