"""Hostile output directories and checkpoints: a damaged, renamed, edited or newer-format state.pt, a step directory
without its state.pt, files where a run writes directories (checkpoints, data, loss.png) and the reverse
(metrics.jsonl a directory), a killed writer's half line in metrics.jsonl. Each is one error naming the file and
what to do, found before the first step, with the earlier run's outputs as they were. A full disk (or a failed plot)
while a resumed run rewrites config.yaml or loss.png keeps the earlier file whole, and a rerun after a failed final
save still draws loss.png."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch

from chronicals.train import train
from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs

from train_helpers import SyntheticLoader, full_disk_for, tiny_config, tiny_model


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
    # resumed silently with fresh AdamW moments and step counts at step 2 (a checkpoints walk)
    (lambda s: s["optimizer"].update(state={}), "its optimizer state holds no AdamW moments at step 2"),
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


def test_a_killed_writers_half_line_in_metrics_is_left_out(tmp_path, docs, caplog):
    """A run killed while appending a record left a line without its newline; the resume failed on it with a bare
    'Unterminated string' naming no file."""
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('\n{"kind": "train", "step": 3, "lo')
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=3, train__resume="auto")
    assert "metrics.jsonl:4: left out an unfinished record" in caplog.text
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("line, named", [
    ('{"kind": "tr', r"metrics.jsonl:2: not a JSON record \(Unterminated string"),
    ("[1, 2]", "metrics.jsonl:2: not a JSON object but list"),  # was AttributeError, exit 4
    ('{"kind": "train", "step": "2"}', "metrics.jsonl:2: its step is '2', not an integer"),  # was TypeError
])
def test_a_bad_line_in_metrics_names_its_file_and_line(tmp_path, docs, line, named):
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], line, *lines[1:]]) + "\n\n")  # a blank line is no record, not an error
    before = metrics.read_text()
    with pytest.raises(ValueError, match=named + ".*fix or delete that line, or move .*metrics.jsonl away"):
        _run(tmp_path, docs, train__max_steps=3, train__resume="auto")
    assert metrics.read_text() == before
    metrics.write_text("\n".join(lines) + "\n\n")
    assert _run(tmp_path, docs, train__max_steps=3, train__resume="auto").step == 3


def test_metrics_a_directory_is_refused_before_a_fresh_run_removes_the_old_checkpoints(tmp_path, docs):
    """A fresh run removed the earlier run's checkpoints at its first record, then failed on '[Errno 21] Is a
    directory' writing it."""
    _run(tmp_path, docs, train__max_steps=2)
    run = tmp_path / "run"
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(IsADirectoryError, match="metrics.jsonl is a directory: .*move it away"):
        _run(tmp_path, docs, train__max_steps=2)
    assert [d.name for d in checkpoint_dirs(run)] == ["step-000002"]


def test_metrics_kept_by_a_resume_are_replaced_whole(tmp_path, docs, monkeypatch):
    """The first record of a resumed run rewrote metrics.jsonl in place: a kill or a full disk in that write lost the
    earlier steps' records."""
    from train_helpers import full_disk_for

    _run(tmp_path, docs, train__max_steps=2, train__save_every=1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text()
    full_disk_for(monkeypatch, "metrics.jsonl")  # metrics.jsonl or its temporary: every write fails
    with pytest.raises(OSError, match="No space left"):
        _run(tmp_path, docs, train__max_steps=3, train__resume="auto")
    monkeypatch.undo()
    assert metrics.read_text() == before
    assert [p.name for p in metrics.parent.iterdir() if p.name.startswith(".")] == []


def test_a_loss_curve_that_cannot_be_written_warns_and_the_run_completes(tmp_path, docs, caplog):
    """loss.png a directory (or an unwritable one): the finished run, its checkpoint and metrics written, failed
    with exit status 3 at its last line."""
    (tmp_path / "run" / "loss.png").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="chronicals.train"):
        result = _run(tmp_path, docs, train__max_steps=1, logging__plot=True)
    assert result.status == "completed" and result.plot is None
    assert "could not write the loss curve" in caplog.text and "the losses are in" in caplog.text


def test_a_lora_resume_with_its_targets_in_another_order_resumes(tmp_path, docs):
    """[v_proj, q_proj] adapts the modules [q_proj, v_proj] does; the resume was refused as 'trained with
    lora.targets=['q_proj', 'v_proj'] (this run: ['v_proj', 'q_proj']): they would compute something else'."""
    lora = dict(lora__enabled=True, train__save_every=1)
    _run(tmp_path, docs, **lora, lora__targets=["q_proj", "v_proj"], train__max_steps=1)
    again = _run(tmp_path, docs, **lora, lora__targets=["v_proj", "q_proj"], train__max_steps=2, train__resume="auto")
    assert again.start_step == 1 and again.step == 2
    # as sets (sorted): the order is not what differs; said before the model loads (check_resume_adapter)
    with pytest.raises(ValueError, match=r"lora.targets=\['q_proj', 'v_proj'\] \(this run: \['k_proj', 'q_proj'\]"):
        _run(tmp_path, docs, **lora, lora__targets=["q_proj", "k_proj"], train__max_steps=3, train__resume="auto")
    # other words for the same modules (PEFT's suffix rule): refused as 'would compute something else' before
    again = _run(tmp_path, docs, **lora, lora__targets=["self_attn.v_proj", "q_proj"], train__max_steps=3,
                 train__resume="auto")
    assert again.start_step == 2 and again.step == 3
    with pytest.raises(ValueError, match=r"this run: \['k_proj', 'self_attn.q_proj'\]"):
        _run(tmp_path, docs, **lora, lora__targets=["self_attn.q_proj", "k_proj"], train__max_steps=4,
             train__resume="auto")


def test_a_lora_resume_that_adapts_or_saves_other_modules_names_the_key(tmp_path, docs):
    """modules_to_save [embed_tokens, norm] -> [embed_tokens] failed after the load as 'its optimizer state does not
    fit this run', naming no key; targets [layers.0.self_attn.q_proj, v_proj] -> [q_proj, v_proj] (more modules in
    words that match the old ones) is said by the modules this run's apply_lora picked, before the state loads."""
    lora = dict(lora__enabled=True, train__save_every=1)
    first = dict(lora__targets=["layers.0.self_attn.q_proj", "v_proj"], lora__modules_to_save=["embed_tokens", "norm"])
    _run(tmp_path, docs, **lora, **first, train__max_steps=1)
    again = dict(lora, train__max_steps=2, train__resume="auto")
    with pytest.raises(ValueError, match=r"lora.modules_to_save=\['embed_tokens', 'norm'\] \(this run: "
                                         r"\['embed_tokens'\]\): under this run's settings"):
        _run(tmp_path, docs, **again, lora__targets=first["lora__targets"], lora__modules_to_save=["embed_tokens"])
    with pytest.raises(ValueError, match=r"lora.targets=\['layers.0.self_attn.q_proj', 'v_proj'\] \(this run: "
                                         r"\['q_proj', 'v_proj'\]\)"):
        _run(tmp_path, docs, **again, lora__targets=["q_proj", "v_proj"], lora__modules_to_save=["embed_tokens", "norm"])
    done = _run(tmp_path, docs, **again, lora__targets=["layers.0.self_attn.q_proj", "self_attn.v_proj"],
                lora__modules_to_save=["model.norm", "embed_tokens"])
    assert done.start_step == 1 and done.step == 2


RECORD = {"lora_modules": [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")],
          "saved_modules": ["lm_head", "model.embed_tokens", "model.norm"]}  # lm_head tied: embed_tokens with it
OLD = {"targets": ["q_proj", "v_proj"], "modules_to_save": ["lm_head", "norm"]}


@pytest.mark.parametrize("key, names, now, same", [
    ("targets", ["self_attn.q_proj", "v_proj"], None, True),
    ("targets", r".*\.(q|v)_proj", None, True),
    ("targets", ["q_proj"], None, False),  # v_proj picked then, named by nothing now
    ("targets", ["q_proj", "v_proj", "o_proj"], None, False),  # o_proj: not picked then
    ("targets", ["layers.0.self_attn.q_proj", "v_proj"], None, False),
    ("targets", ["q_proj", "v_proj"], {"lora_modules": RECORD["lora_modules"][::-1]}, True),
    ("targets", ["q_proj", "v_proj"], {"lora_modules": RECORD["lora_modules"][:2]}, False),
    ("targets", r".*_proj", {"lora_modules": RECORD["lora_modules"] + ["model.layers.0.self_attn.o_proj"]}, False),
    ("modules_to_save", ["model.norm", "lm_head"], None, True),
    ("modules_to_save", ["embed_tokens", "norm"], None, True),  # the tied partner of lm_head: the model decides
    ("modules_to_save", ["lm_head"], None, False),  # norm no longer trained (was refused only as the optimizer's
    # state not fitting, after the load, naming no key)
    ("modules_to_save", ["lm_head", "norm"], {"saved_modules": ["lm_head", "model.norm"]}, False),  # untied now
    ("modules_to_save", [], None, False),
    ("modules_to_save", ["lm_head", "input_layernorm"], None, False),
])
def test_lora_names_that_pick_the_same_modules_are_the_same_setting(key, names, now, same):
    from chronicals.train.resume import PICKED, _picks_same

    picked_now = None if now is None else now[PICKED[key]]
    assert _picks_same(names, OLD[key], RECORD[PICKED[key]], picked_now) is same


@pytest.mark.parametrize("where, error, named", [
    ("data", NotADirectoryError, "data is a file, not a directory: a run writes its copies"),
    ("data/heldout.jsonl", IsADirectoryError, "heldout.jsonl is a directory: a run writes its copy"),
])
def test_a_file_or_folder_where_the_demo_data_copies_go_is_said_with_the_fix(tmp_path, where, error, named):
    """Was '[Errno 17] File exists: .../data' or '[Errno 21] Is a directory', naming neither cause nor fix."""
    from chronicals.train.setup import data_files

    out = tmp_path / "run"
    (out / where).parent.mkdir(parents=True, exist_ok=True)
    (out / where).mkdir() if where.endswith(".jsonl") else (out / where).write_text("notes")
    with pytest.raises(error, match=named + ".*move it away or set another train.out_dir"):
        data_files(tiny_config(tmp_path, data__path="demo", data__eval_path="auto"), out)


class _OpensAFile:
    """Pickled as a call to open(path, 'w'): what a crafted state.pt can make torch.load(weights_only=False) run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_crafted_state_runs_no_code_on_resume(tmp_path, docs, finished):
    """state.pt is loaded with weights_only=True: a pickled call (here open(marker, 'w')) is refused by name, not
    run (weights_only=False ran it before the run could say anything)."""
    marker = tmp_path / "ran"
    _edit(finished, lambda s: s["data"].update(payload=_OpensAFile(marker)))
    with pytest.raises(ValueError, match=r"step-000002.*holds objects other than tensors and plain values "
                                         r"\((builtins|_?io)\.open\).*add_safe_globals"):
        _run(tmp_path, docs, train__max_steps=4, train__resume="auto")
    assert not marker.exists()


def test_a_loader_state_with_numpy_values_is_named_with_the_way_to_allow_it(tmp_path, docs, finished):
    import numpy as np

    _edit(finished, lambda s: s["data"].update(order=np.arange(3)))
    with pytest.raises(ValueError, match=r"holds objects other than tensors and plain values \(numpy"):
        _run(tmp_path, docs, train__max_steps=4, train__resume="auto")


def test_a_full_disk_keeps_the_runs_config_yaml(tmp_path, docs, monkeypatch):
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1, data__system_prompt="MY SYSTEM PROMPT")
    cfg = tmp_path / "run" / "config.yaml"
    good = cfg.read_text()
    with monkeypatch.context() as m:
        full_disk_for(m, "config.yaml")
        with pytest.raises(OSError, match="No space left"):
            _run(tmp_path, docs, train__max_steps=4, train__save_every=1, train__resume="auto",
                 data__system_prompt="MY SYSTEM PROMPT")
    assert cfg.read_text() == good
    assert [p.name for p in cfg.parent.iterdir() if p.name.startswith(".config")] == []


def test_a_failed_plot_keeps_the_earlier_curve(tmp_path, docs, monkeypatch):
    import matplotlib.figure

    _run(tmp_path, docs, train__max_steps=2, logging__plot=True)
    png = tmp_path / "run" / "loss.png"
    good = png.read_bytes()

    def half_then_full(self, fname, *a, **k):
        fname.write(good[:1000])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_full)
    res = _run(tmp_path, docs, train__max_steps=3, train__resume="auto", logging__plot=True)
    assert res.status == "completed" and res.plot is None
    assert png.read_bytes() == good


def test_a_rerun_after_a_failed_final_save_draws_the_curve(tmp_path, docs, monkeypatch):
    import chronicals.train.loop as loop

    real = loop.save_final

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "save_final", full_disk)
    with pytest.raises(OSError):
        _run(tmp_path, docs, train__max_steps=2, train__save_final=True, logging__plot=True)
    monkeypatch.setattr(loop, "save_final", real)
    png = tmp_path / "run" / "loss.png"
    png.unlink(missing_ok=True)  # wherever the failed run stopped, the rerun must draw it
    res = _run(tmp_path, docs, train__max_steps=2, train__save_final=True, train__resume="auto", logging__plot=True)
    assert res.plot == png and png.read_bytes()[:4] == b"\x89PNG"
