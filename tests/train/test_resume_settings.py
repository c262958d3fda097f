"""A resume (train.resume=auto) under changed settings: this run's optimizer settings replace the checkpoint's,
and a checkpoint written over other data is warned about.

test_loop.py checks that a changed optim.lr applies and is named; these check the settings the checkpoint's
optimizer state also carries (betas, eps, weight decay), which a resume that restored only the lr would keep
from the old run while its warning says the new ones apply, and the data.path half of the data warning; and
the settings that change the loss without moving the data position (data.train_on, data.on_long,
data.system_prompt) or the weights (model.dtype), which resumed without a word.
"""

from __future__ import annotations

import logging

import pytest
import torch

from chronicals.train import train
from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs
from chronicals.train.resume import check_same_adapter, warn_data_changed, warn_loss_settings_changed

from train_helpers import SyntheticLoader, tiny_config, tiny_model


def test_resume_applies_this_runs_betas_eps_and_weight_decay(tmp_path, docs, caplog):
    """Steps after a resume run with this run's optim.beta1 / beta2 / eps / weight_decay: the optimizer state
    of the resumed run's checkpoint holds them (vectors still without decay), and the warning names them."""
    old = dict(optim__weight_decay=0.0, optim__beta1=0.8, optim__beta2=0.99, optim__eps=1e-6)
    new = dict(optim__weight_decay=0.1, optim__beta1=0.85, optim__beta2=0.98, optim__eps=1e-7)
    train(tiny_config(tmp_path, train__max_steps=2, **old), model=tiny_model(), train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=3, train__resume="auto", **new), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    named = ("optim.beta1=0.8 (this run: 0.85)", "optim.beta2=0.99 (this run: 0.98)",
             "optim.eps=1e-06 (this run: 1e-07)", "optim.weight_decay=0.0 (this run: 0.1)")
    assert all(s in caplog.text for s in named), caplog.text
    last = checkpoint_dirs(tmp_path / "run")[-1]
    assert last.name == "step-000003"
    state = torch.load(last / STATE_FILE, map_location="cpu", weights_only=False)
    groups = {g["name"]: g for g in state["optimizer"]["param_groups"]}
    assert (groups["matrices"]["weight_decay"], groups["vectors"]["weight_decay"]) == (0.1, 0.0)
    assert all(tuple(g["betas"]) == (0.85, 0.98) and g["eps"] == 1e-7 for g in groups.values())


def test_resume_over_another_data_path_warns(tmp_path, docs, caplog):
    """A checkpoint written over another data.path (resume=auto in a reused out_dir) is warned about: its data
    position points into other data. test_loop.py covers a changed data.batch_size only."""
    train(tiny_config(tmp_path, train__max_steps=1, data__path="a.jsonl"), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto", data__path="b.jsonl"),
              model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert "written with data.path='a.jsonl' (this run: 'b.jsonl'): its data position refers to other batches" \
        in caplog.text


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("chronicals")]


@pytest.mark.parametrize("key, old, new, named", [
    ("train_on", "assistant", "all", "data.train_on='assistant' (this run: 'all')"),
    ("on_long", "truncate", "drop", "data.on_long='truncate' (this run: 'drop')"),
    ("system_prompt", "Be terse.", "", "data.system_prompt='Be terse.' (this run: '')"),
])
def test_resume_with_other_loss_tokens_warns(tmp_path, caplog, key, old, new, named):
    """A resume under another data.train_on / on_long / system_prompt names the key, both values and what it
    changes; the batches are the same ones, so nothing refuses it."""
    saved = tiny_config(tmp_path, **{f"data__{key}": old}).to_dict()
    current = tiny_config(tmp_path, **{f"data__{key}": new}).to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        warn_data_changed(saved, current, tmp_path / "step-000001")  # the batches: the same
        warn_loss_settings_changed(saved, current, tmp_path / "step-000001")
    [msg] = warnings(caplog)
    assert f"written with {named}: from here on the run trains or evaluates on other tokens (data.{key}: " in msg
    assert "not comparable with the checkpoint's" in msg and "train.resume=none for a new run" in msg, msg


@pytest.mark.parametrize("old, new, named, cast", [
    (dict(dtype="float32"), dict(dtype="bfloat16"), "model.dtype='float32' (this run: 'bfloat16')",
     "float32 weights are rounded to bfloat16"),
    (dict(dtype="bfloat16"), dict(dtype="float32"), "model.dtype='bfloat16' (this run: 'float32')",
     "bfloat16 weights are loaded from its fp32 master weights where it kept them (optim.master_weights), else "
     "widened, as float32"),
    (dict(dtype="auto", device="cpu"), dict(dtype="bfloat16", device="cpu"),
     "model.dtype='auto' = float32 (this run: 'bfloat16')", "float32 weights are rounded to bfloat16"),
])
def test_resume_in_another_dtype_warns(tmp_path, caplog, old, new, named, cast):
    """A checkpoint's weights trained in float32 and resumed with model.dtype=bfloat16 are rounded: a warning
    with both values (auto as what it meant) and the way back, not a refusal (it is a legitimate choice)."""
    saved = tiny_config(tmp_path, **{f"model__{k}": v for k, v in old.items()}).to_dict()
    current = tiny_config(tmp_path, **{f"model__{k}": v for k, v in new.items()}).to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        check_same_adapter(saved, current, tmp_path / "step-000001")
    [msg] = warnings(caplog)
    assert f"written with {named}: the checkpoint's {cast}" in msg, msg
    assert f"set model.dtype={_resolved(old)} to continue its run" in msg and "train.resume=none" in msg, msg


def _resolved(model: dict) -> str:
    return "float32" if model["dtype"] == "auto" else model["dtype"]


@pytest.mark.parametrize("old, new", [({}, {}), (dict(model__dtype="auto"), dict(model__dtype="float32")),
                                      (dict(data__path="chats.jsonl"), dict(data__path="chats.jsonl",
                                                                            data__system_prompt=""))])
def test_resume_with_the_same_settings_warns_nothing(tmp_path, caplog, old, new):
    """An unchanged config, model.dtype=auto on the CPU over float32 (the same weights), or data.system_prompt from
    its default to '' beside the user's own data (both mean no system message of ours there): no warning."""
    saved = tiny_config(tmp_path, model__device="cpu", **old).to_dict()
    current = tiny_config(tmp_path, model__device="cpu", **new).to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        check_same_adapter(saved, current, tmp_path / "step-000001")
        warn_data_changed(saved, current, tmp_path / "step-000001")
        warn_loss_settings_changed(saved, current, tmp_path / "step-000001")
    assert warnings(caplog) == []


def test_train_resumed_with_other_train_on_and_dtype_warns(tmp_path, docs, caplog):
    """Through train(): a resume changing only train.max_steps names only that; data.train_on=all with
    model.dtype=bfloat16 over the float32 checkpoint names both."""
    over = dict(data__path="a.jsonl")
    train(tiny_config(tmp_path, train__max_steps=1, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))

    def resumed(**more) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.train"):
            train(tiny_config(tmp_path, train__resume="auto", **over, **more), model=tiny_model(),
                  train_loader=SyntheticLoader(docs))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.module == "resume"]

    assert resumed(train__max_steps=2) == ["resumed at step 1 with other settings than the checkpoint's run: "
                                           "train.max_steps=1 (this run: 2); they apply from step 2 on (the AdamW "
                                           "moments are kept)"]
    text = "\n".join(resumed(train__max_steps=3, data__train_on="all", model__dtype="bfloat16"))
    assert "data.train_on='assistant' (this run: 'all')" in text, text
    assert "model.dtype='float32' (this run: 'bfloat16'): the checkpoint's float32 weights are rounded" in text, text
    # the run is at its last step (3 of 3): nothing trains under another lr, so no 'they apply from step 4 on'
    assert resumed(train__max_steps=3, data__train_on="all", model__dtype="bfloat16", optim__lr=1e-4) == []


@pytest.mark.parametrize("old_tokens, new_tokens, warned", [(0, 0, True), (512, 512, False), (512, 0, True),
                                                             (0, 512, True)])
def test_a_batch_size_that_tokens_per_batch_overrides_moves_no_batch(tmp_path, caplog, old_tokens, new_tokens, warned):
    """data.batch_size picks the batches only without data.tokens_per_batch: beside it, another value is no
    change of data position (no warning, and no cause named if a position refusal comes). Only where both runs set
    it: where one did, batch_size shaped the other run's batches (left out then, it went unnamed)."""
    saved = tiny_config(tmp_path, data__batch_size=2, data__tokens_per_batch=old_tokens).to_dict()
    current = tiny_config(tmp_path, data__batch_size=3, data__tokens_per_batch=new_tokens).to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        warn_data_changed(saved, current, tmp_path / "step-000001")
    msgs = warnings(caplog)
    assert bool(msgs) == warned, msgs
    if warned:
        assert "data.batch_size=2 (this run: 3)" in msgs[0] and "data position refers to other batches" in msgs[0]


def test_a_data_parallel_checkpoint_from_before_dp_remainder_is_refused_with_the_fix(tmp_path):
    """Its loader dropped the epoch's last, incomplete round (1 batch per rank here); this run's trains it (2):
    the refusal names data.dp_remainder=drop, not the generic causes, and that setting resumes it."""
    import numpy as np

    from chronicals.data import PackedLoader
    from chronicals.data.dataset import DatasetStats, TokenizedDataset
    from chronicals.train.loop import _restore_position, _Stream

    stats = DatasetStats(records=30, documents=30, tokens=60, loss_tokens=30)
    ds = TokenizedDataset(np.arange(1, 61, dtype=np.int32), np.ones(60, bool), np.arange(0, 61, 2), 0, stats, 24)

    def loader(remainder):  # 30 documents of 2 tokens -> 3 rows of 24 -> 3 global batches over 2 ranks
        return PackedLoader(ds, batch_size=1, max_seq_len=24, world_size=2, remainder=remainder)

    saved = {k: v for k, v in loader("drop").state_dict().items() if k != "remainder"}
    restored = {"data": saved, "extra": {"config": tiny_config(tmp_path).to_dict()}}
    with pytest.raises(ValueError) as e:
        _restore_position(_Stream(loader("train")), restored, tiny_config(tmp_path).to_dict(), tmp_path / "step-1")
    msg = str(e.value)
    assert msg.startswith(f"cannot resume from {tmp_path / 'step-1'}: ") and "data.dp_remainder=drop" in msg
    assert "number of ranks" not in msg, msg
    _restore_position(_Stream(loader("drop")), restored, tiny_config(tmp_path).to_dict(), tmp_path / "step-1")


def test_a_bf16_checkpoint_resumed_in_float32_loads_its_masters(tmp_path):
    """The checkpoint holds fp32 masters (optim.master_weights), but a float32 resume widened the bf16 weights (up
    to half a bf16 step per weight of trained value lost), while export / eval --dtype float32 read the masters (a
    full fine-tuning walk). The resumed float32 weights are the masters now."""
    import torch

    from chronicals.train import train
    from chronicals.train.checkpoint import masters_by_name
    from train_helpers import SyntheticLoader, synthetic_docs, tiny_model

    docs = synthetic_docs(20, seed=1)
    over = dict(train__max_steps=2, train__save_every=2, optim__lr=1e-2, optim__master_weights="true")
    train(tiny_config(tmp_path, model__dtype="bfloat16", **over), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "state.pt", weights_only=False)
    masters = masters_by_name(state)
    assert masters and any(not torch.equal(m, state["model"][n].float()) for n, m in masters.items())
    model = tiny_model()
    train(tiny_config(tmp_path, model__dtype="float32", train__resume="auto", **over), model=model,
          train_loader=SyntheticLoader(docs))  # at its last step: loads and trains nothing
    params = dict(model.named_parameters())
    for n, m in masters.items():
        assert torch.equal(params[n].detach(), m), n


def test_a_resume_under_another_lr_shows_the_new_lr_at_once():
    """scheduler.get_last_lr() right after a resume under another optim.lr is the new run's lr, as the optimizer's
    param groups are (it showed the checkpoint's until the first step: a mutation walk)."""
    from chronicals.train import resume

    def opt_sched(lr):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.AdamW([p], lr=lr)
        return p, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))

    p, opt, sched = opt_sched(1e-3)
    for _ in range(2):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    _, opt2, sched2 = opt_sched(2e-3)
    fresh = resume.optimizer_settings(opt2, sched2)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    resume.apply_optimizer_settings(opt2, sched2, fresh, None, {}, 2)
    want = 2e-3 * 3 / 4
    assert opt2.param_groups[0]["lr"] == pytest.approx(want) and sched2.get_last_lr() == [pytest.approx(want)]


def _optimizer():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_resume_under_another_grad_accum_warns(tmp_path, caplog):
    """train.grad_accum changes the batch each step averages over: the settings warning names it."""
    from chronicals.train.resume import apply_optimizer_settings, optimizer_settings

    saved = tiny_config(tmp_path, train__grad_accum=1).to_dict()
    current = tiny_config(tmp_path, train__grad_accum=4).to_dict()
    opt, sched = _optimizer()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        apply_optimizer_settings(opt, sched, optimizer_settings(opt, sched), saved, current, step=1, total=5)
    assert any("train.grad_accum=1 (this run: 4)" in m for m in warnings(caplog)), warnings(caplog)


def test_resume_under_another_lora_plus_ratio_warns(tmp_path, caplog):
    """lora.plus_ratio sets B's learning rate against A's: the settings warning names it (it resumed unnamed)."""
    from chronicals.train.resume import apply_optimizer_settings, optimizer_settings

    saved = tiny_config(tmp_path, lora__enabled=True, lora__plus_ratio=16.0).to_dict()
    current = tiny_config(tmp_path, lora__enabled=True, lora__plus_ratio=4.0).to_dict()
    opt, sched = _optimizer()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        apply_optimizer_settings(opt, sched, optimizer_settings(opt, sched), saved, current, step=3, total=10)
    assert any("lora.plus_ratio=16.0 (this run: 4.0)" in m and "apply from step 4" in m for m in warnings(caplog)), \
        warnings(caplog)


@pytest.mark.parametrize("old, new, named", [
    (dict(train__seed=1), dict(train__seed=2), "train.seed=1 (this run: 2)"),
    (dict(data__dp_remainder="train"), dict(data__dp_remainder="drop"), "data.dp_remainder='train' (this run: 'drop')"),
    (dict(data__max_seq_len=64), dict(data__max_seq_len=128), "data.max_seq_len=64 (this run: 128)"),
])
def test_the_data_warning_names_the_seed_dp_remainder_and_max_seq_len(tmp_path, caplog, old, new, named):
    """Each decides which batches come after the checkpoint's position (data.max_seq_len how documents are cut
    and packed into rows: under another value the resume went on without a data warning)."""
    saved, current = tiny_config(tmp_path, **old).to_dict(), tiny_config(tmp_path, **new).to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        warn_data_changed(saved, current, tmp_path / "step-000001")
    assert any(named in m for m in warnings(caplog)), warnings(caplog)


def test_a_checkpoint_config_without_dtype_warns_nothing(tmp_path, caplog):
    """A checkpoint from before model.dtype was recorded has no dtype to compare."""
    saved = tiny_config(tmp_path, model__device="cpu").to_dict()
    del saved["model"]["dtype"]
    current = tiny_config(tmp_path, model__device="cpu", model__dtype="bfloat16").to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        check_same_adapter(saved, current, tmp_path / "step-000001")
    assert warnings(caplog) == []


@pytest.mark.parametrize("device, cuda, same, other", [("auto", True, "bfloat16", "float32"),
                                                       ("auto", False, "float32", "bfloat16"),
                                                       ("cuda:1", False, "bfloat16", "float32"),
                                                       ("cpu", True, "float32", "bfloat16")])
def test_auto_dtype_and_device_mean_what_the_machine_gave(tmp_path, caplog, monkeypatch, device, cuda, same, other):
    """model.dtype=auto with model.device=auto trained in bfloat16 on a GPU machine and in float32 on one without
    CUDA: resumed there in the same dtype nothing is said, in the other the warning names what auto meant. With
    model.device=cuda:N it ran on a GPU, so in bfloat16, also asked on a machine without CUDA (it was taken as
    float32); with model.device=cpu on the CPU, in float32, also asked on a machine with CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    saved = tiny_config(tmp_path, model__device=device, model__dtype="auto").to_dict()
    for dtype, warned in ((same, False), (other, True)):
        caplog.clear()
        current = tiny_config(tmp_path, model__device=device, model__dtype=dtype).to_dict()
        with caplog.at_level(logging.WARNING, logger="chronicals.train"):
            check_same_adapter(saved, current, tmp_path / "step-000001")
        said = f"model.dtype='auto' = {same} (this run: '{dtype}')"
        assert any(said in m for m in warnings(caplog)) == warned and bool(warnings(caplog)) == warned, warnings(caplog)


def test_lora_modules_in_another_order_are_the_same_adapter_without_records(tmp_path, caplog):
    """Without LoRA records (a checkpoint written before them, or check_same_adapter called without them)
    lora.modules_to_save is compared as a set, as lora.targets is: [norm, lm_head] adapts what [lm_head, norm]
    does (it was refused as another adapter)."""
    saved = tiny_config(tmp_path, lora__enabled=True, lora__targets=["q_proj", "v_proj"],
                        lora__modules_to_save=["lm_head", "norm"]).to_dict()
    current = tiny_config(tmp_path, lora__enabled=True, lora__targets=["v_proj", "q_proj"],
                          lora__modules_to_save=["norm", "lm_head"]).to_dict()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        check_same_adapter(saved, current, tmp_path / "step-000001")  # no refusal
    assert warnings(caplog) == []


def test_the_early_adapter_check_leaves_another_model_path_to_the_later_one(tmp_path, caplog):
    """check_resume_adapter (before the model loads) refuses a LoRA checkpoint under other adapter settings only:
    another model.path is check_same_adapter's to name after the load (a path that does not exist is the load's).
    Without a record of either base it warns (the shapes fit: load_checkpoint checked them); a moved or copied base
    was refused (test_lora_base.py has the records)."""
    from chronicals.train import checkpoint as ckpt
    from chronicals.train.resume import check_resume_adapter

    saved = tiny_config(tmp_path, lora__enabled=True, model__path="base-a").to_dict()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = ckpt.write_checkpoint(tmp_path / "run",
                                 ckpt.snapshot(0, model, opt, sched, {"position": 0}, extra={"config": saved}))
    current = tiny_config(tmp_path, lora__enabled=True, model__path="base-b", train__resume="auto")
    check_resume_adapter(current, tmp_path / "run")  # no refusal before the model loads
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        check_same_adapter(saved, current.to_dict(), path)
    assert any("model.path='base-a' (this run: 'base-b'): the adapters fit this model's shapes" in m
               for m in warnings(caplog)), warnings(caplog)


def test_a_fused_resume_of_an_unfused_checkpoint_gets_its_steps_where_the_fused_kernel_reads_them():
    """A checkpoint saved under optim.fused=false keeps each AdamW step as saved (on the CPU); resumed with
    fused=true, the fused kernel needs them as float32 on the parameter's device (on a GPU the first step failed).
    On the CPU the device is the same, so the saved step is given another dtype to tell the move apart."""
    from chronicals.train.resume import apply_optimizer_settings, optimizer_settings

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=False)
    p.grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()
    p2 = torch.nn.Parameter(torch.ones(3))
    new = torch.optim.AdamW([p2], lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(new, lambda s: 1.0)
    fresh = optimizer_settings(new, sched)
    new.load_state_dict(saved)
    new.state[p2]["step"] = new.state[p2]["step"].to(torch.float64)
    apply_optimizer_settings(new, sched, fresh, None, {}, step=1)
    step = new.state[p2]["step"]
    assert new.param_groups[0]["fused"] is True and step.dtype == torch.float32 and step.device == p2.device
    p2.grad = torch.ones(3)
    new.step()


def test_a_finished_run_rerun_with_other_settings_names_them_in_its_nothing_to_train_warning(tmp_path, docs, caplog):
    """A finished run and a new optim.lr exited 0 with "nothing to train" and no word of the lr: the list the
    unfinished run's resume gives ("resumed at step 4 with other settings ...") comes with the warning."""
    train(tiny_config(tmp_path, train__max_steps=2, optim__lr=1e-3), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        result = train(tiny_config(tmp_path, train__max_steps=2, optim__lr=5e-4, train__resume="auto"),
                       model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert result.start_step == result.step == 2
    said = [m for m in warnings(caplog) if "nothing to train" in m]
    assert len(said) == 1 and "optim.lr=0.001 (this run: 0.0005)" in said[0], warnings(caplog)
