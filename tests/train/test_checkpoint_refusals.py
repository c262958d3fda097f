"""Checkpoints edited or crafted by hand are refused naming the checkpoint and what is wrong, not a raw error later
or a silent resume; the config comparison behind the resume refusals takes keys and sections one side lacks as nothing to
compare."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from chronicals.train import checkpoint as ckpt
from chronicals.train.checkpoint_adapter import read_run_checkpoint
from chronicals.train.resume import check_same_adapter

from test_checkpoint import _trained as _parts


def _written(tmp_path, step, edit, **write):
    model, opt, sched = _parts(step)
    state = ckpt.snapshot(step, model, opt, sched, {"position": step})
    edit(state)
    return ckpt.write_checkpoint(tmp_path, state, **write)


def _misshapen_moment(state):
    """The first parameter's AdamW exp_avg replaced by one of another shape, (3,)."""
    state["optimizer"]["state"][0].update(exp_avg=torch.zeros(3))


def _first(state):
    return next(iter(state["model"]))


@pytest.mark.parametrize("step, edit, said", [
    (2, lambda s: s.update(format="2"), "has format '2'"),
    (1, lambda s: s.update(step=True), "its step is True"),
    (2, lambda s: s["model"].update({_first(s): [1.0, 2.0]}), "its model entry is not a dict of tensors"),
    (2, lambda s: s["model"].pop(_first(s)), "lacks trainable parameters of the model"),
    (2, lambda s: s["model"].update({"extra.weight": torch.zeros(2)}),
     "holds parameters the model lacks (['extra.weight']): it was written for another model or lora config"),
    (2, _misshapen_moment, "its optimizer state has exp_avg (3,) for a parameter"),
    (2, lambda s: s["optimizer"]["state"][0].pop("exp_avg_sq"), "has exp_avg_sq none"),
    (1, lambda s: s["optimizer"].update(state={}), "holds no AdamW moments at step 1"),
], ids=["format_string", "step_bool", "model_entry_list", "missing_parameter", "extra_parameter", "moment_shape", "moment_missing",
        "no_moments_after_a_step"])
def test_an_edited_checkpoint_is_refused_naming_it(tmp_path, step, edit, said):
    path = _written(tmp_path, step, edit)
    with pytest.raises(ValueError, match="checkpoint .*step-00000") as e:
        ckpt.load_checkpoint(path, *_parts())
    assert said in str(e.value)


def test_a_named_resume_with_a_misshapen_moment_points_to_the_checkpoint_before_it(tmp_path):
    """train.resume naming step-2 (auto=False) whose AdamW exp_avg has another shape is told to resume from the
    checkpoint before it, as for the other damage a named resume meets; resume=auto (auto=True) is told where it
    goes once step-2 is moved away. The named resume got resume=auto's hint."""
    _written(tmp_path, 1, lambda s: None)
    path = _written(tmp_path, 2, _misshapen_moment)
    with pytest.raises(ValueError, match="exp_avg") as e:
        ckpt.load_checkpoint(path, *_parts(), auto=False)
    assert f"resume from the checkpoint before it (train.resume={path.with_name('step-000001')})" in str(e.value)
    with pytest.raises(ValueError, match="exp_avg") as e:
        ckpt.load_checkpoint(path, *_parts(), auto=True)
    assert "train.resume=auto resumes from" in str(e.value)


def test_a_named_resume_of_a_damaged_checkpoint_is_pointed_before_it_not_past_it(tmp_path):
    """The run went on past a damaged step-2 (step-3 exists): the named resume is told step-1, the checkpoint
    before it; step-3, the newest other one, continues a later point of the run than the one asked for."""
    for step in (1, 2, 3):
        path = _written(tmp_path, step, _misshapen_moment if step == 2 else lambda s: None, keep_last=3)
    path = path.with_name("step-000002")
    with pytest.raises(ValueError, match="exp_avg") as e:
        ckpt.load_checkpoint(path, *_parts(), auto=False)
    assert f"(train.resume={path.with_name('step-000001')})" in str(e.value)


def test_a_named_resume_of_a_damaged_checkpoint_is_not_pointed_at_a_step_directory_without_its_state(tmp_path):
    """The checkpoint before a damaged step-3 is step-1 when step-2 lost its state.pt (a copy cut short):
    counted as a checkpoint, step-2 would be advised, and the resume the fix named would fail again."""
    _written(tmp_path, 1, lambda s: None)
    path = _written(tmp_path, 3, _misshapen_moment)
    (tmp_path / "checkpoints" / "step-000002").mkdir()  # after the write of step-3, whose pruning removes it
    with pytest.raises(ValueError, match="exp_avg") as e:
        ckpt.load_checkpoint(path, *_parts(), auto=False)
    assert f"(train.resume={path.with_name('step-000001')})" in str(e.value)


def test_a_newer_format_tells_a_reader_to_read_it_and_a_resume_to_resume_it_or_start_over(tmp_path):
    """A checkpoint of a newer format: a reader (chat, export: read_run_checkpoint) is told to read it with the
    chronicals version that wrote it; a resume, found by train.resume=auto or named by it, to resume it with that
    version or start over. The named resume got the reader's advice, without the start-over."""
    path = _written(tmp_path, 1, lambda s: s.update(format=ckpt.FORMAT + 1))
    with pytest.raises(ValueError, match="written by a newer chronicals") as e:
        read_run_checkpoint(path)
    assert str(e.value).endswith("read it with the chronicals version that wrote it")
    for auto in (True, False):
        with pytest.raises(ValueError, match="written by a newer chronicals") as e:
            ckpt.load_checkpoint(path, *_parts(), auto=auto)
        assert str(e.value).endswith("resume it with the chronicals version that wrote it, or start over "
                                     "(train.resume=none or another train.out_dir)"), (auto, str(e.value))


def test_a_file_named_like_a_step_is_not_a_checkpoint(tmp_path):
    path = _written(tmp_path, 2, lambda s: None)
    (tmp_path / "checkpoints" / "step-000009").write_bytes(b"not a directory")
    assert ckpt.latest_checkpoint(tmp_path) == path
    assert [d.name for d in ckpt.checkpoint_dirs(tmp_path)] == ["step-000002"]


def test_a_state_pt_without_model_optimizer_scheduler_is_not_a_checkpoint(tmp_path):
    d = tmp_path / "checkpoints" / "step-000001"
    d.mkdir(parents=True)
    torch.save({"step": 1, "data": {}, "rng": {}}, d / "state.pt")
    with pytest.raises(ValueError, match="not a chronicals checkpoint"):
        ckpt._read_state(d / "state.pt")


def test_a_resume_of_a_state_pt_without_its_optimizer_is_refused_as_not_a_checkpoint(tmp_path):
    """A state.pt with weights but no optimizer entry (another tool's, a hand edit) is no chronicals checkpoint,
    with the fix to move it away: read as one, the resume would say its optimizer state "does not fit this run" and
    send the user to the config it was written with."""
    path = _written(tmp_path, 1, lambda s: s.pop("optimizer"))
    with pytest.raises(ValueError, match="not a chronicals checkpoint") as e:
        ckpt.load_checkpoint(path, *_parts())
    assert f"move {path} away" in str(e.value)


def test_two_masters_claiming_one_weight_are_left_out():
    """A checkpoint from before masters were saved by name: a master is matched to its weight by value, and two
    masters that both round to one bf16 weight are ambiguous, so neither is taken (either could be half a bf16
    step off)."""
    w = torch.ones(4, dtype=torch.bfloat16)
    m1, m2 = torch.full((4,), 1.0001), torch.full((4,), 0.9999)
    assert ckpt._masters_by_value({"a": w, "c": torch.zeros(3, dtype=torch.bfloat16)}, [m1, m2]) == {}


def test_busy_is_false_once_the_background_write_has_finished(tmp_path, monkeypatch):
    """busy means a write still in flight: once the thread has published the checkpoint it is False, also before
    wait() (true until wait(), the loop's last_good() warned "waiting for the checkpoint being written" for
    nothing)."""
    finished = threading.Event()
    real = ckpt.write_checkpoint

    def write_then_tell(*a, **kw):
        try:
            return real(*a, **kw)
        finally:
            finished.set()
    monkeypatch.setattr(ckpt, "write_checkpoint", write_then_tell)
    writer = ckpt.CheckpointWriter(background=True)
    path = writer.save(tmp_path, 3, *_parts(1), {"position": 3})
    assert finished.wait(timeout=30) and writer._done.wait(timeout=30)
    assert path.is_dir() and not writer.busy
    writer.wait()
    assert not writer.busy


def test_a_checkpoint_is_removed_when_its_trash_name_is_taken(tmp_path):
    """A leftover directory at the name removal renames to first (a crash during an earlier removal) does not keep
    the checkpoint, which pruning would then keep for ever."""
    d = tmp_path / "checkpoints" / "step-000001"
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(b"x")
    taken = d.with_name(f".tmp-step-000001-{os.getpid()}")
    taken.mkdir()
    (taken / "leftover").write_bytes(b"y")
    ckpt.remove_checkpoint(d)
    assert not d.exists()


def test_a_key_the_checkpoint_predates_is_no_difference():
    """A checkpoint written before lora.rslora existed: no "rslora=None (this run: False)"."""
    saved = {"lora": {"enabled": True, "rank": 4}}
    now = {"lora": {"enabled": True, "rank": 4, "rslora": False}}
    assert ckpt.config_diffs(saved, now, {"lora": ("rank", "rslora")}) == []


def test_an_older_lora_checkpoint_without_a_newer_key_still_resumes(tmp_path):
    saved = {"model": {"path": "m"}, "lora": {"enabled": True, "rank": 4, "alpha": 8, "targets": ["q_proj"]}}
    now = {"model": {"path": "m"}, "lora": {"enabled": True, "rank": 4, "alpha": 8, "targets": ["q_proj"],
                                            "rslora": False, "modules_to_save": []}}
    check_same_adapter(saved, now, tmp_path)  # does not raise


def test_no_current_config_is_no_differences():
    assert ckpt.config_diffs({"model": {"path": "a"}}, None, {"model": None}) == []


def test_a_section_absent_on_either_side_compares_as_empty():
    assert ckpt.config_diffs({"model": {"path": "a"}}, {"model": {"path": "a"}},
                             {"schedule": None, "lora": ("rank",)}) == []
    assert ckpt.config_diffs({"model": {"path": "a"}}, {"other": {}}, {"model": None}) == \
        ["model.path='a' (this run: None)"]
