"""A Ctrl-C (or SIGTERM) while the end-of-run checkpoint is written: it was outside the loop's stop flag, so the CLI's
KeyboardInterrupt landed in the background writer's join. The write was abandoned (no checkpoint: resume=auto then
trained from step 0 over metrics.jsonl) and the interpreter's exit killed the writer thread (SIGABRT). Now the
write finishes, the run returns "interrupted", and resume=auto finds it done and writes the final adapter."""

import os
import signal

import pytest
import torch

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
