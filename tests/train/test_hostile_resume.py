"""Hostile output directories and checkpoints: a damaged, renamed, edited or newer-format state.pt, a step directory
without its state.pt, files where a run writes directories (checkpoints, data, loss.png) and the reverse
(metrics.jsonl a directory), a killed writer's half line in metrics.jsonl. Each is one error naming the file and
what to do, found before the first step, with the earlier run's outputs as they were."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from chronicals.train import train
from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs

from train_helpers import SyntheticLoader, tiny_config, tiny_model


def _run(tmp_path, docs, **over):
    return train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))


@pytest.fixture
def finished(tmp_path, docs):
    """A finished 2-step run at tmp_path/run (checkpoints step-1 and step-2) and its state.pt at step 2."""
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1)
    return tmp_path / "run" / "checkpoints" / "step-000002" / STATE_FILE


def _edit(file, fn):
    state = torch.load(file, weights_only=False)
    fn(state)
    torch.save(state, file)


@pytest.mark.parametrize("edit, named", [
    (lambda s: s.pop("rng"), "it lacks the rng entry"),
    (lambda s: s.pop("data"), "it lacks the data entry"),
    (lambda s: s.update(step="2"), "its step is '2', not an integer >= 0"),
    (lambda s: s.update(step=-3), "its step is -3"),  # trained 5 steps, then pruned the checkpoint it came from
    (lambda s: s.update(step=1), "it holds step 1 but its directory is named step-000002"),
    (lambda s: s.update(scheduler={}), "its learning-rate schedule state does not fit this run (KeyError"),
    (lambda s: s["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)), "its random number generator state"),
    (lambda s: s["optimizer"].update(param_groups=s["optimizer"]["param_groups"][:1]),
     "its optimizer state does not fit this run (ValueError: loaded state dict has a different number"),
    (lambda s: [st.pop("exp_avg") for st in s["optimizer"]["state"].values()],
     "its optimizer state has exp_avg none for a parameter"),
])
def test_an_edited_checkpoint_is_one_error_naming_it(tmp_path, docs, finished, edit, named):
    """These were KeyError / TypeError / RuntimeError tracebacks (exit 4), an error naming no file, or (step -3) a
    silent run of 5 steps that removed the checkpoint it resumed from."""
    _edit(finished, edit)
    with pytest.raises(ValueError, match="checkpoint .*step-000002") as e:
        _run(tmp_path, docs, train__max_steps=4, train__save_every=1, train__resume="auto")
    assert named in str(e.value)
    assert "step-000001" in str(e.value) or "train.resume=none" in str(e.value)  # what to do
    assert [d.name for d in checkpoint_dirs(tmp_path / "run")] == ["step-000001", "step-000002"]


def test_a_checkpoint_of_a_newer_format_is_refused_by_its_version(tmp_path, docs, finished):
    """A later layout (renamed entries) was reported as a checkpoint 'written for another model or lora config'."""
    assert torch.load(finished, weights_only=False)["format"] == 1
    _edit(finished, lambda s: s.update(format=2, model={"v2." + k: v for k, v in s["model"].items()}))
    with pytest.raises(ValueError, match="has format 2, written by a newer chronicals .*reads format 1"):
        _run(tmp_path, docs, train__max_steps=4, train__resume="auto")


def test_a_checkpoint_without_extra_resumes(tmp_path, docs, finished):
    _edit(finished, lambda s: s.pop("extra"))  # was KeyError: 'extra'
    assert _run(tmp_path, docs, train__max_steps=3, train__resume="auto").start_step == 2


@pytest.mark.parametrize("older", [False, True])
def test_a_step_directory_without_its_state_is_reported_not_skipped(tmp_path, docs, finished, older):
    """resume=auto silently resumed from an older checkpoint, or (the only one) started over and rewrote the run's
    metrics.jsonl; now it names the directory, and the checkpoint resume=auto would take without it."""
    run = tmp_path / "run"
    if older:
        shutil.rmtree(run / "checkpoints" / "step-000001")
    finished.unlink()
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(FileNotFoundError, match=f"step-000002 holds no {STATE_FILE}") as e:
        _run(tmp_path, docs, train__max_steps=4, train__resume="auto")
    assert ("train.resume=none to start over" if older else "train.resume=auto resumes from") in str(e.value)
    assert (run / "metrics.jsonl").read_text() == metrics


def test_checkpoints_a_file_is_refused_before_training(tmp_path, docs):
    """The run trained to its end, then failed to write its checkpoint with a bare '[Errno 17] File exists'."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("notes")
    steps = []
    with pytest.raises(NotADirectoryError, match="checkpoints is a file, not a directory: .*move it away"):
        train(tiny_config(tmp_path, train__max_steps=2), model=tiny_model(), train_loader=SyntheticLoader(docs),
              on_step=lambda step, rec: steps.append(step))
    assert steps == [] and (tmp_path / "run" / "checkpoints").read_text() == "notes"
