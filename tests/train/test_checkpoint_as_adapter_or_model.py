"""A run's checkpoint read as an adapter or a model (export / chat / eval --adapter or --model
runs/x/checkpoints/step-N): the run's LoRA scaling, the base it names (short names, '~' paths), what is not a
checkpoint, records it cannot hold, and a checkpoint rewritten in the same process read again."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from chronicals.config import TrainConfig
from chronicals.lora import apply_lora
from chronicals.train import checkpoint as ckpt
from chronicals.train.checkpoint_adapter import (apply_checkpoint_adapter, is_checkpoint_dir, lora_settings,
                                                 read_run_checkpoint)
from chronicals.train.checkpoint_model import apply_checkpoint_weights, checkpoint_base

from train_helpers import tiny_model


def _write(out, extra=None, *, model=None, tensor=None, config=None, model_path=None, step=1, keep_last=2):
    """A run's checkpoint at step ``step`` in out/checkpoints. ``model_path``: one from before the base was recorded
    (no extra["base"]), whose config's model.path names it."""
    if config is None:
        config = TrainConfig().to_dict()
    if model is None:
        model = {"model.norm.weight": torch.ones(4) if tensor is None else tensor}
    if model_path is not None:
        config["model"]["path"] = model_path
    recorded = {} if model_path is not None else {"base": None}
    state = {"format": 1, "step": step, "model": model, "optimizer": {}, "scheduler": {}, "data": {}, "rng": {},
             "extra": {"config": config, **recorded, **(extra or {})}}
    return ckpt.write_checkpoint(out, state, keep_last=keep_last)


def test_an_rslora_runs_checkpoint_is_applied_with_its_scaling(tmp_path):
    """A run trained with lora.rslora=true: its checkpoint as the adapter scales by alpha / sqrt(r), as it trained,
    not alpha / r (every output of export, chat and eval would be off)."""
    torch.manual_seed(0)
    model = tiny_model()
    rec = apply_lora(model, r=4, alpha=8, use_rslora=True)
    cfg = TrainConfig().to_dict()
    cfg["lora"].update(enabled=True, rank=4, alpha=8, rslora=True)
    path = _write(tmp_path / "run", {"lora": lora_settings(model)}, model=ckpt.trainable_state(model), config=cfg)
    torch.manual_seed(0)
    again = apply_checkpoint_adapter(tiny_model(), path)
    assert again.lora_config.scaling == rec.scaling == 8 / 4 ** 0.5


@pytest.mark.parametrize("layers", [3, 1])
def test_an_older_checkpoint_on_a_base_of_other_depth_is_refused(tmp_path, layers):
    """A checkpoint from before the adapter record (its lora section alone rebuilds the adapter) given a base of the
    same widths and another depth (--base a sibling model): every tensor in both fits, only the names differ. It is
    refused as "does not fit this base": a deeper base kept its extra layers unadapted, and export / chat / eval
    answered with a model never trained, without a word; a shallower one gave a raw KeyError."""
    torch.manual_seed(0)
    model = tiny_model()
    apply_lora(model, r=4, alpha=8)
    cfg = TrainConfig().to_dict()
    cfg["lora"].update(enabled=True, rank=4, alpha=8)
    path = _write(tmp_path / "run", model=ckpt.trainable_state(model), config=cfg)
    with pytest.raises(ValueError, match="does not fit this base"):
        apply_checkpoint_adapter(tiny_model(layers=layers), path)


def test_a_master_of_another_shape_is_not_taken(tmp_path):
    """A master weight whose shape is not its weight's (a damaged or mismatched optimizer_params list) is not read as
    the weight's fp32 value."""
    state = {"format": 1, "step": 1, "model": {"model.norm.weight": torch.full((4,), 2.0)},
             "optimizer": {"param_groups": [{"params": [0]}], "state": {0: {"master": torch.ones(3)}}},
             "optimizer_params": ["model.norm.weight"], "scheduler": {}, "data": {}, "rng": {},
             "extra": {"config": TrainConfig().to_dict(), "base": None}}
    path = ckpt.write_checkpoint(tmp_path / "run", state)
    assert torch.equal(read_run_checkpoint(path).tensors["model.norm.weight"], torch.full((4,), 2.0))


def test_a_master_of_the_weights_shape_is_read_as_its_value(tmp_path):
    """A run with optim.master_weights: the checkpoint's tensor is the weight's fp32 master, not the bf16 weight it
    rounds to; the dtype the run trained in is kept beside it."""
    master = torch.full((4,), 2.001)
    state = {"format": 1, "step": 1, "model": {"model.norm.weight": master.to(torch.bfloat16)},
             "optimizer": {"param_groups": [{"params": [0]}], "state": {0: {"master": master}}},
             "optimizer_params": ["model.norm.weight"], "scheduler": {}, "data": {}, "rng": {},
             "extra": {"config": TrainConfig().to_dict(), "base": None}}
    ck = read_run_checkpoint(ckpt.write_checkpoint(tmp_path / "run", state))
    assert torch.equal(ck.tensors["model.norm.weight"], master) and ck.trained_dtype == torch.bfloat16

def test_no_path_is_no_checkpoint_dir():
    assert not is_checkpoint_dir(None) and not is_checkpoint_dir("")


def test_a_model_directory_given_as_a_checkpoint_is_named_as_one(tmp_path):
    """A model directory (config.json, no state.pt) where a run checkpoint goes is refused saying what it is and what
    loads it, not only "not a training checkpoint"."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="not a training checkpoint") as e:
        read_run_checkpoint(tmp_path / "model")
    assert "it is a model directory: chronicals.load_model(path) loads it" in str(e.value), str(e.value)


def test_a_damaged_checkpoint_names_the_runs_latest_other_one(tmp_path):
    """A damaged checkpoint of a run with several others names the latest as the one to use instead, not the oldest
    (which throws away the most training; with two checkpoints the two are the same)."""
    run = tmp_path / "run"
    first, _, third = (_write(run, step=step, keep_last=3) for step in (1, 2, 3))
    (first / ckpt.STATE_FILE).write_bytes(b"\x80\x02garbage" * 100)
    with pytest.raises(ValueError) as e:
        read_run_checkpoint(first)
    assert f"use another of the run's checkpoints ({third})" in str(e.value), str(e.value)


def test_a_peft_adapter_dir_with_a_state_pt_is_no_checkpoint_dir(tmp_path):
    (tmp_path / "state.pt").write_bytes(b"x")
    assert is_checkpoint_dir(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    assert not is_checkpoint_dir(tmp_path)


def test_a_config_that_is_not_a_dict_is_refused(tmp_path):
    with pytest.raises(ValueError, match="records no run config"):
        read_run_checkpoint(_write(tmp_path / "run", config="model: x"))


def test_an_integer_tensor_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not as floating point"):
        read_run_checkpoint(_write(tmp_path / "run", tensor=torch.ones(4, dtype=torch.int64)))


def _full_config():
    config = TrainConfig().to_dict()
    config["lora"]["enabled"] = False
    return config


def test_a_full_checkpoint_of_the_default_model_names_it_by_its_short_name(tmp_path, monkeypatch):
    """The default model's short name is no path here, and still the base: not refused as "which is not here"."""
    monkeypatch.chdir(tmp_path)
    assert checkpoint_base(_write(tmp_path / "run", {"base": "smollm2-135m-instruct"},
                                          config=_full_config())) == "smollm2-135m-instruct"


def test_a_full_checkpoint_names_a_short_name_base_in_any_case(tmp_path, monkeypatch):
    """A recorded short-name base spelled in other case (SmolLM2-135M-Instruct; the loader takes short names in any
    case) is named, not refused as a path "which is not here"."""
    monkeypatch.chdir(tmp_path)
    assert checkpoint_base(_write(tmp_path / "run", {"base": "SmolLM2-135M-Instruct"},
                                  config=_full_config())) == "SmolLM2-135M-Instruct"


def test_a_home_relative_base_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "base").mkdir()
    assert checkpoint_base(_write(tmp_path / "run", {"base": "~/base"}, config=_full_config())) == "~/base"


def test_an_older_checkpoint_with_a_home_relative_model_path_names_it(tmp_path, monkeypatch):
    """A checkpoint from before the base was recorded names model.path of its config, a '~' path here."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "base").mkdir()
    ck = read_run_checkpoint(_write(tmp_path / "run", model_path="~/base"))
    assert ck.base == "~/base" and ck.why_no_base == ""


def test_an_older_checkpoint_names_a_short_name_base_in_any_case(tmp_path, monkeypatch):
    """model.path a short name spelled in other case (SmolLM2-135M-Instruct; the loader takes short names in any
    case) is the base of a checkpoint from before the base was recorded: it was refused as "relative to the
    directory that run started in"."""
    monkeypatch.chdir(tmp_path)
    ck = read_run_checkpoint(_write(tmp_path / "run", model_path="SmolLM2-135M-Instruct"))
    assert ck.base == "SmolLM2-135M-Instruct" and ck.why_no_base == ""


def test_a_rewritten_checkpoint_is_read_again(tmp_path):
    """The same step saved again (a signal right after a save) in one process: the memoized read sees the new file."""
    p = _write(tmp_path / "run", tensor=torch.full((4,), 1.0))
    assert torch.equal(read_run_checkpoint(p).tensors["model.norm.weight"], torch.full((4,), 1.0))
    assert _write(tmp_path / "run", tensor=torch.full((4,), 2.0)) == p
    os.utime(p / "state.pt", ns=(time.time_ns(), time.time_ns() + 10**9))  # a coarse mtime: make it differ
    assert torch.equal(read_run_checkpoint(p).tensors["model.norm.weight"], torch.full((4,), 2.0))


def test_a_full_checkpoint_of_a_model_given_in_python_says_to_pass_base(tmp_path):
    """train(cfg, model=...) records no base: the checkpoint as --model says to pass --base, not an AttributeError
    on None."""
    with pytest.raises(FileNotFoundError, match="does not name a base model.*--base"):
        checkpoint_base(_write(tmp_path / "run", config=_full_config()))


def test_a_full_checkpoint_without_a_base_says_why_none_is_known(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not name a base model that can be found from here \(the run "
                                                r"was given its model in Python"):
        checkpoint_base(_write(tmp_path / "python", config=_full_config()))
    with pytest.raises(FileNotFoundError, match=r"does not name a base model that can be found from here \(its "
                                                r"model\.path 'models/mine' is relative"):
        checkpoint_base(_write(tmp_path / "older", config=_full_config(), model_path="models/mine"))


def test_an_older_checkpoint_with_a_relative_model_path_names_no_base(tmp_path):
    """A relative model.path is relative to where that run started, not to here: not taken as the base, and why is
    said."""
    ck = read_run_checkpoint(_write(tmp_path / "run", model_path="models/mine"))
    assert ck.base is None and "relative to the directory that run started in" in ck.why_no_base


def test_a_tensor_of_a_name_the_model_lacks_is_refused_by_name_before_any_copy(tmp_path):
    """A full checkpoint holding a tensor the model has no parameter of that name for (another base) is refused with
    the ValueError naming it, before anything is copied; it was a KeyError out of the copy loop with the model half
    overwritten."""
    model = tiny_model()
    norm = dict(model.named_parameters())["model.norm.weight"]
    before = norm.detach().clone()
    path = _write(tmp_path / "run", config=_full_config(),
                  model={"model.norm.weight": torch.full_like(before, 7.0), "model.not_there.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"does not fit this model \(1 tensor of another name or shape, e\.g\. "
                                         r"model\.not_there\.weight"):
        apply_checkpoint_weights(model, path)
    assert torch.equal(norm, before)


def test_a_checkpoint_that_does_not_fit_the_base_given_names_it_and_says_to_pass_the_moved_one(tmp_path):
    path = _write(tmp_path / "run", {"base": "/gone/base"}, config=_full_config(),
                  model={"model.not_there.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"does not fit --base other/base \(1 tensor .*trained from /gone/base; pass "
                                         r"that model, or where it has moved to, as --base$"):
        apply_checkpoint_weights(tiny_model(), path, given="other/base")


def test_a_home_relative_checkpoint_dir_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = _write(tmp_path / "run")
    assert is_checkpoint_dir(f"~/{path.relative_to(tmp_path)}")


def test_a_damaged_latest_checkpoint_names_the_one_before_it_and_the_runs_adapter(tmp_path):
    run = tmp_path / "run"
    first, second = (_write(run, step=step) for step in (1, 2))
    (run / "adapter").mkdir()
    (second / ckpt.STATE_FILE).write_bytes(b"\x80\x02garbage" * 100)
    with pytest.raises(ValueError) as e:
        read_run_checkpoint(second)
    assert f"use another of the run's checkpoints ({first}) or the run's final adapter/ ({run / 'adapter'})" \
        in str(e.value), str(e.value)


def test_a_damaged_checkpoint_copied_out_of_its_run_names_nothing_beside_it(tmp_path):
    """A checkpoint copied out of its run (saved/step-N) has no run around it: the adapter/ two levels up is another
    folder's, not that run's final adapter, and is not offered in its place."""
    copy = tmp_path / "saved" / "step-000001"
    shutil.copytree(_write(tmp_path / "run"), copy)
    (tmp_path / "adapter").mkdir()
    (copy / ckpt.STATE_FILE).write_bytes(b"\x80\x02garbage" * 100)
    with pytest.raises(ValueError) as e:
        read_run_checkpoint(copy)
    assert "use another checkpoint of that run" in str(e.value) and str(tmp_path / "adapter") not in str(e.value)
