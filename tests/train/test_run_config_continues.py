"""A run's own config.yaml continues that run in the directory it sits in: from another working directory its
train.out_dir (as typed, relative) named another folder and the run started from scratch there, and in a copy of
the run (cp -r runs/A runs/Copy) it resumed and wrote into runs/A. Its relative model.path / data.path are recorded
absolute, so they name what the run read from anywhere."""

from __future__ import annotations

import logging
import shutil

import yaml

from chronicals.config import load_config
from chronicals.train import train
from chronicals.train.checkpoint import checkpoint_dirs
from chronicals.train.resume import data_position_diffs

from train_helpers import SyntheticLoader, tiny_config, tiny_model


def _first_run(tmp_path, docs, monkeypatch):
    """Run A, started in tmp_path/work with relative train.out_dir and data.path: 2 steps, a checkpoint each."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.jsonl").write_text('{"text": "hello"}\n')  # recorded only: the loader is passed
    monkeypatch.chdir(work)
    cfg = tiny_config(tmp_path, train__out_dir="runs/A", data__path="mine.jsonl", train__max_steps=2,
                      train__save_every=1)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    return work / "runs" / "A"


def _steps(run) -> list[str]:
    return [d.name for d in checkpoint_dirs(run)]


def test_a_runs_config_continues_it_from_another_working_directory(tmp_path, docs, monkeypatch, caplog):
    run = _first_run(tmp_path, docs, monkeypatch)
    stored = yaml.safe_load((run / "config.yaml").read_text())
    assert stored["data"]["path"] == str(tmp_path / "work" / "mine.jsonl")  # absolute: what this run read
    assert stored["train"]["out_dir"] == "runs/A"  # as typed; the file's own directory is the run's
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with caplog.at_level(logging.INFO, logger="chronicals"):
        cfg = load_config(run / "config.yaml", ["train.max_steps=3"])
        result = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert cfg.train.out_dir == str(run) and result.start_step == 2 and result.step == 3
    assert not (tmp_path / "elsewhere" / "runs").exists()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"config {run / 'config.yaml'} is the config.yaml of the run in {run}: continuing that run there "
               f"(it records train.out_dir=runs/A, which from {tmp_path / 'elsewhere'} is another directory)" in m
               for m in said), said
    assert not [m for m in said if "data.path" in m], said  # the same data file, however spelled
    assert _steps(run) == ["step-000002", "step-000003"]


def test_a_copied_runs_config_continues_the_copy_not_the_original(tmp_path, docs, monkeypatch, caplog):
    run = _first_run(tmp_path, docs, monkeypatch)
    copy = run.parent / "Copy"
    shutil.copytree(run, copy)
    with caplog.at_level(logging.INFO, logger="chronicals"):
        cfg = load_config("runs/Copy/config.yaml", ["train.max_steps=3"])
        assert train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs)).start_step == 2
    assert _steps(copy) == ["step-000002", "step-000003"] and _steps(run) == ["step-000001", "step-000002"]
    assert any("is the config.yaml of the run in runs/Copy: continuing that run there" in r.getMessage()
               for r in caplog.records)


def test_train_out_dir_given_wins_and_a_config_outside_a_run_is_read_as_written(tmp_path, docs, monkeypatch, caplog):
    run = _first_run(tmp_path, docs, monkeypatch)
    copy = run.parent / "Copy"
    shutil.copytree(run, copy)
    assert load_config(copy / "config.yaml", ["train.out_dir=runs/New"]).train.out_dir == "runs/New"
    # the same file as a recipe: no metrics.jsonl or checkpoints/ beside it, so not a run's own
    (tmp_path / "recipes").mkdir()
    shutil.copy(run / "config.yaml", tmp_path / "recipes" / "config.yaml")
    with caplog.at_level(logging.INFO, logger="chronicals"):
        assert load_config(tmp_path / "recipes" / "config.yaml").train.out_dir == "runs/A"
        assert load_config(run / "config.yaml").train.out_dir == "runs/A"  # it names its own directory: unchanged
    assert not [r for r in caplog.records if "continuing that run" in r.getMessage()]


def test_a_relative_data_path_and_its_absolute_spelling_are_one_data_path(tmp_path, monkeypatch):
    """A checkpoint written before runs recorded data.path absolute holds it as typed: the same file, no warning."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text("")
    saved = tiny_config(tmp_path, data__path="mine.jsonl").to_dict()
    assert data_position_diffs(saved, tiny_config(tmp_path, data__path=str(tmp_path / "mine.jsonl")).to_dict()) == []
    other = tiny_config(tmp_path, data__path=str(tmp_path / "other.jsonl")).to_dict()
    assert data_position_diffs(saved, other) == [f"data.path='mine.jsonl' (this run: '{tmp_path / 'other.jsonl'}')"]
