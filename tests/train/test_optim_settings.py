"""The optimizer and schedule a config builds, and that the loop uses them: each optim / schedule / LoRA+ setting
reaches the torch objects, clipping changes the update, and each update runs at the lr its step records.

The trainer's other tests compare two runs of the same loop (resumed vs straight, pipelined vs every step), so a
setting dropped on the way to the optimizer shows in both and passes them; and "the loss goes down" holds with
swapped betas, no clipping or the wrong schedule. These tests read the built objects, or a run's update, directly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from chronicals.lora import apply_lora, lora_plus_param_groups
from chronicals.train import train
from chronicals.train.master_adamw import MasterWeightAdamW
from chronicals.train.optim import build_optimizer, build_scheduler, lr_factor, set_total_steps

from train_helpers import SyntheticLoader, tiny_config, tiny_model

CPU = torch.device("cpu")


def _lrs(tmp_path, total: int, **schedule) -> list[float]:
    """The lr of each of ``total`` steps that build_scheduler gives a peak lr of 1.0 under ``schedule``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, tiny_config(tmp_path, **{f"schedule__{k}": v for k, v in schedule.items()}), total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_schedule_warms_up_then_decays_from_the_peak_to_min_lr_ratio(tmp_path, kind):
    """schedule.kind and schedule.min_lr_ratio reach the schedule: warmup to the peak (1.0, not 1 + min_lr_ratio),
    the first decay step still at the peak, the last at min_lr_ratio (not 0), linear in equal steps. Catches
    min_lr_ratio or kind not passed to the schedule, a cosine that adds min_lr_ratio on top of the peak, and a
    linear decay that ignores min_lr_ratio (lr_factor's own test uses a nonzero ratio only at the last step,
    where these bugs cancel)."""
    lrs = _lrs(tmp_path, 10, kind=kind, warmup_steps=2, min_lr_ratio=0.2)
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert max(lrs) == 1.0 and lrs[-1] == pytest.approx(0.2)
    diffs = [a - b for a, b in zip(lrs[2:], lrs[3:])]
    if kind == "linear":
        assert all(d == pytest.approx(0.8 / 7) for d in diffs)
    else:  # cosine: slow, fast, slow
        assert diffs[0] < diffs[3] > diffs[-1]


def test_constant_schedule_holds_the_peak_after_warmup(tmp_path):
    """schedule.kind=constant keeps the peak lr after warmup (a schedule that always decays would pass a check
    of the warmup alone)."""
    assert _lrs(tmp_path, 8, kind="constant", warmup_steps=2, min_lr_ratio=0.2) == [0.5] + [1.0] * 7


def test_a_constant_schedule_without_warmup_is_the_peak_from_the_first_step(tmp_path):
    """schedule.kind=constant with warmup_steps=0 holds the peak lr from step 0: the constant case must not depend
    on a warmup (falling through to the decay code, it refused "constant" as an unknown kind at start-up)."""
    assert [lr_factor(s, 5, 0, "constant", 0.1) for s in range(5)] == [1.0] * 5
    assert _lrs(tmp_path, 4, kind="constant", warmup_steps=0) == [1.0] * 4


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_a_run_shorter_than_its_warmup_still_warms_up_and_decays(tmp_path, caplog, kind):
    """schedule.warmup_steps=20 (a recipe's) in a 15-step run: warmup over ceil(15 / 10) = 2 steps, the peak at
    step 2, then a decay to min_lr_ratio at the last step. Clamping the warmup to 14 steps (the earlier rule) put
    the peak at step 14 and ran the last step there, with no decay; an unclamped warmup ends at 15/20 of the lr.
    The warning names the key, both numbers, what it became and how to choose it."""
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        lrs = _lrs(tmp_path, 15, kind=kind, warmup_steps=20, min_lr_ratio=0.1)
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # falls at every step after the peak
    assert lrs[-1] == pytest.approx(0.1)
    assert ("schedule.warmup_steps=20 is not shorter than the run's 15 step(s)" in caplog.text
            and "warming up over 2 step(s) instead" in caplog.text
            and f"peak at step 2 and decays ({kind}) to schedule.min_lr_ratio=0.1 of it at step 15" in caplog.text
            and "set schedule.warmup_steps below 15" in caplog.text), caplog.text


@pytest.mark.parametrize("total, warmup_steps, expected", [
    (10, 20, [1.0]),         # ceil(10 / 10) = 1: the first step already at the peak
    (3, 3, [1.0]),           # a warmup as long as the run is not shorter either
    (30, 30, [1 / 3, 2 / 3, 1.0]),  # ceil(30 / 10) = 3, not 4 (30 * 0.1 is 3.0000000000000004 in floats)
    (2, 5, [1.0, 1.0]),      # too short to decay: the step after warmup is still the peak, as in every run
    (1, 5, [1.0]),
])
def test_short_run_warmup_is_a_tenth_of_the_run_rounded_up(tmp_path, total, warmup_steps, expected):
    """The warmup part of the lr trajectory of short runs, by run length."""
    lrs = _lrs(tmp_path, total, kind="cosine", warmup_steps=warmup_steps, min_lr_ratio=0.1)
    assert lrs[:len(expected)] == pytest.approx(expected)
    if total >= 3:
        assert lrs[-1] == pytest.approx(0.1)


def test_a_constant_short_run_warms_up_and_holds_the_peak(tmp_path, caplog):
    """kind=constant: the same shortened warmup, then the peak to the end, and a warning that says so."""
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        assert _lrs(tmp_path, 12, kind="constant", warmup_steps=12) == [0.5] + [1.0] * 11
    assert "peak at step 2 and holds it" in caplog.text


def test_a_warmup_shorter_than_the_run_is_kept_as_set_and_unwarned(tmp_path, caplog):
    """One step longer than the warmup is long enough: the rule leaves warmup_steps alone (19 warmup steps, the
    last at the peak, as set) and says nothing. The demo's warmup (3 of 22 steps) is one of these runs."""
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        lrs = _lrs(tmp_path, 20, kind="linear", warmup_steps=19, min_lr_ratio=0.2)
        demo = _lrs(tmp_path, 22, kind="cosine", warmup_steps=3, min_lr_ratio=0.1)
    assert lrs[:19] == pytest.approx([(i + 1) / 19 for i in range(19)]) and lrs[19] == 1.0
    assert demo[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0]) and demo[-1] == pytest.approx(0.1)
    assert "warmup_steps" not in caplog.text


def test_short_run_warmup_resumes_on_the_same_schedule(tmp_path):
    """A scheduler rebuilt at step 6 of a 15-step run from its state_dict (what a resume does) gives the same lrs
    as the uninterrupted one: the shortened warmup depends on the run's length and the config only."""
    cfg = tiny_config(tmp_path, schedule__warmup_steps=20)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg, 15)
    straight = []
    for i in range(15):
        straight.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if i == 5:
            saved = sched.state_dict(), opt.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_scheduler(opt2, cfg, 15)  # built fresh, then the checkpoint's states loaded, as train() does
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[0])
    resumed = []
    for _ in range(6, 15):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == straight[6:]


def test_set_total_steps_replans_every_param_group(tmp_path):
    """A resume under another run length (train.epochs, grad_accum) replans the lr of every param group, not only
    the first: a LoRA+ run's lora_B (at ratio x lr) and its other groups follow the new length too. The resume
    tests read the logged lr, which is group 0's."""
    cfg = tiny_config(tmp_path, lora__enabled=True, lora__plus_ratio=4.0, optim__lr=1e-3, schedule__kind="linear",
                      schedule__warmup_steps=1, schedule__min_lr_ratio=0.0)
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj",))
    opt = build_optimizer(model, cfg, CPU)
    assert len(opt.param_groups) >= 2
    base = [g["lr"] for g in opt.param_groups]
    sched = build_scheduler(opt, cfg, 20, warn=False)
    for _ in range(3):
        opt.step()
        sched.step()
    set_total_steps(sched, cfg, 6)
    opt.step()
    sched.step()  # step 4 of a 6-step run
    want = lr_factor(4, 6, 1, "linear", 0.0)
    assert want != pytest.approx(lr_factor(4, 20, 1, "linear", 0.0))
    for g, b in zip(opt.param_groups, base):
        assert g["lr"] == pytest.approx(b * want, rel=1e-9), g["name"]


def _groups(opt) -> dict:
    return {g["name"]: g for g in opt.param_groups}


def test_lora_optimizer_takes_lr_ratio_betas_eps_and_weight_decay_from_the_config(tmp_path):
    """A LoRA optimizer gets lora.plus_ratio (B's lr = ratio x A's, not the built-in 16), optim.beta1 / beta2 in
    that order, optim.eps, and optim.weight_decay on every matrix group (lora_A, lora_B and a modules_to_save
    matrix), none on vectors. The LoRA+ grouping test checks the decay of lora_A only."""
    cfg = tiny_config(tmp_path, lora__enabled=True, lora__plus_ratio=4.0, optim__lr=1e-3, optim__beta1=0.8,
                      optim__beta2=0.95, optim__eps=1e-7, optim__weight_decay=0.1)
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj", "down_proj"), modules_to_save=["embed_tokens", "norm"])
    groups = _groups(build_optimizer(model, cfg, CPU))
    assert {k: g["lr"] for k, g in groups.items()} == pytest.approx(
        {"lora_A": 1e-3, "lora_B": 4e-3, "full": 1e-3, "no_decay": 1e-3})
    assert {k: g["weight_decay"] for k, g in groups.items()} == {"lora_A": 0.1, "lora_B": 0.1, "full": 0.1,
                                                                 "no_decay": 0.0}
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7 for g in groups.values())


def test_lora_plus_leaves_empty_groups_out():
    """lora_plus_param_groups leaves empty groups out (its docstring): adapters on q_proj only and nothing else
    trainable give exactly the lora_A and lora_B groups, no empty "full" or "no_decay" group."""
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj",))
    groups = lora_plus_param_groups(model, lr=1e-3)
    assert [g["name"] for g in groups] == ["lora_A", "lora_B"]
    assert all(g["params"] for g in groups)


@pytest.mark.parametrize("trainable, named", [("norm", ["vectors"]), ("proj", ["matrices"])])
def test_full_finetune_leaves_empty_groups_out(tmp_path, trainable, named):
    """A full fine-tune whose trainable parameters are all vectors (only the norms unfrozen) or all matrices gets
    the one group that holds them, no empty "matrices" or "vectors" group beside it."""
    model = tiny_model()
    for n, p in model.named_parameters():
        p.requires_grad_(trainable in n)
    opt = build_optimizer(model, tiny_config(tmp_path, optim__lr=1e-4), CPU)
    assert [g["name"] for g in opt.param_groups] == named
    assert all(p.requires_grad for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["AdamW", "MasterWeightAdamW"])
def test_full_finetune_optimizer_takes_betas_eps_and_weight_decay_from_the_config(tmp_path, dtype):
    """Both optimizers build_optimizer picks (AdamW on fp32 weights, MasterWeightAdamW on bf16 ones) get
    optim.beta1 / beta2 in that order, optim.eps and optim.weight_decay (vectors without decay)."""
    cfg = tiny_config(tmp_path, optim__lr=1e-4, optim__beta1=0.8, optim__beta2=0.95, optim__eps=1e-7,
                      optim__weight_decay=0.1)
    opt = build_optimizer(tiny_model(dtype=dtype), cfg, CPU)
    assert isinstance(opt, MasterWeightAdamW) == (dtype == torch.bfloat16)
    groups = _groups(opt)
    assert (groups["matrices"]["weight_decay"], groups["vectors"]["weight_decay"]) == (0.1, 0.0)
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7 for g in groups.values())


def _update_norm(tmp_path, docs, clip: float) -> float:
    """The norm of the change of every weight over 2 training steps with optim.grad_clip=clip."""
    model = tiny_model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(tiny_config(tmp_path / f"clip{clip}", train__max_steps=2, optim__grad_clip=clip), model=model,
          train_loader=SyntheticLoader(docs, shuffle=False))
    return sum((p.detach() - w0[n]).norm() ** 2 for n, p in model.named_parameters()).sqrt().item()


def test_grad_clip_shrinks_the_update(tmp_path, docs):
    """optim.grad_clip is applied to the gradients the optimizer steps on. Adam's update barely depends on a
    uniform gradient scale, so a clip shows only once the clipped gradient is small against eps: a clip norm of
    1e-7 over ~10k parameters shrinks the update severalfold against no clipping (0)."""
    assert _update_norm(tmp_path, docs, 1e-7) < 0.5 * _update_norm(tmp_path, docs, 0.0)


def test_each_update_runs_at_the_lr_its_step_records(tmp_path, docs):
    """The optimizer steps before the schedule advances: step 1 of a 3-step warmup updates at lr / 3, the lr its
    metrics record (stepping the schedule first would update at 2 lr / 3 while still recording lr / 3). Adam's
    first update is lr x sign(g) where |g| >> eps, so the largest weight change is the lr used."""
    model = tiny_model()
    w0 = model.lm_head.weight.detach().clone()
    seen = {}

    def on_step(step, rec):
        if step == 1:
            seen["lr"], seen["dw"] = rec["lr"], (model.lm_head.weight.detach() - w0).abs().max().item()

    train(tiny_config(tmp_path, train__max_steps=4, schedule__warmup_steps=3, optim__weight_decay=0.0), model=model,
          train_loader=SyntheticLoader(docs), on_step=on_step)
    assert seen["lr"] == pytest.approx(3e-3 / 3)
    assert seen["dw"] == pytest.approx(seen["lr"], rel=1e-3)


def test_a_run_of_warmup_plus_two_steps_is_said_to_decay(tmp_path, caplog):
    """3 steps under warmup_steps=5: warmup 1, the peak at step 1, and the last step at min_lr_ratio: the warning
    says it decays (a mutation walk: "holds it" survived)."""
    from chronicals.train.optim import warn_short_warmup

    assert _lrs(tmp_path, 3, kind="cosine", warmup_steps=5, min_lr_ratio=0.1)[-1] == pytest.approx(0.1)
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        warn_short_warmup(tiny_config(tmp_path, schedule__warmup_steps=5), 3)
    assert "decays (cosine) to schedule.min_lr_ratio=0.1 of it at step 3" in caplog.text, caplog.text


def test_a_run_of_warmup_plus_one_step_is_said_to_hold_the_peak(tmp_path, caplog):
    """2 steps under warmup_steps=5: warmup 1, and the one step after it is still the peak (the decay's first step),
    so the lr never decays; the warning says it holds the peak (the other side of the test above)."""
    from chronicals.train.optim import warn_short_warmup

    assert _lrs(tmp_path, 2, kind="cosine", warmup_steps=5, min_lr_ratio=0.1) == pytest.approx([1.0, 1.0])
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        warn_short_warmup(tiny_config(tmp_path, schedule__warmup_steps=5, schedule__min_lr_ratio=0.1), 2)
    assert "peak at step 1 and holds it" in caplog.text and "decays" not in caplog.text, caplog.text


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_the_schedule_never_goes_below_min_lr_ratio(tmp_path, kind):
    """After a run's last step the scheduler steps once more (the lr the final checkpoint's optimizer stores): the
    decay stays at min_lr_ratio past the last step (linear ran on to -0.03 of the peak one step past a 10-step run
    at min_lr_ratio=0.1; cosine rose again)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = tiny_config(tmp_path, schedule__kind=kind, schedule__warmup_steps=2, schedule__min_lr_ratio=0.1)
    sched = build_scheduler(opt, cfg, 10)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert lr_factor(12, 10, 2, kind, 0.1) == pytest.approx(0.1)


def test_lr_factor_refuses_an_unknown_schedule_kind():
    """A kind lr_factor does not know (a typo past the config, "cosin") raises, naming the choices, instead of
    training the whole run at the peak lr as "constant" would; warmup steps still warm up."""
    assert lr_factor(0, 10, 2, "cosin", 0.1) == 0.5
    with pytest.raises(ValueError, match=r"schedule.kind='cosin' is not one of cosine \| linear \| constant"):
        lr_factor(5, 10, 2, "cosin", 0.1)


def test_nothing_trainable_is_named(tmp_path):
    """A model with every parameter frozen: our message, not torch's "optimizer got an empty parameter list"."""
    model = tiny_model()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, tiny_config(tmp_path), CPU)


def test_fused_auto_is_off_on_the_cpu(tmp_path):
    """optim.fused=auto: torch's fused AdamW on CUDA only (untested: a mutation walk)."""
    assert not build_optimizer(tiny_model(), tiny_config(tmp_path), CPU).defaults["fused"]
    assert build_optimizer(tiny_model(), tiny_config(tmp_path, optim__fused="true"), CPU).defaults["fused"]


def test_optim_fused_reaches_the_master_weight_optimizer(tmp_path):
    """bf16 weights get MasterWeightAdamW; optim.fused=true runs it on torch's fused kernel (which has a CPU build
    too), auto on the CPU does not."""
    for fused, want in (("true", True), ("auto", False)):
        opt = build_optimizer(tiny_model(dtype=torch.bfloat16), tiny_config(tmp_path, optim__fused=fused), CPU)
        assert isinstance(opt, MasterWeightAdamW) and opt.defaults["fused"] is want, fused


def test_lora_plus_refuses_a_ratio_or_lr_of_zero():
    """ratio 0 from Python would give every lora_B an lr of 0 (B never trains), lr 0 every group; the config refuses
    both first. A NaN or infinite lr or ratio (an inf ratio gives lora_B an lr of inf) is refused too."""
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj",))
    with pytest.raises(ValueError, match="must be positive"):
        lora_plus_param_groups(model, lr=1e-3, ratio=0)
    with pytest.raises(ValueError, match=r"lr=0.0 and ratio=16.0 must be positive"):
        lora_plus_param_groups(model, lr=0.0)
    for lr, ratio in ((float("nan"), 16.0), (1e-3, float("nan")), (float("inf"), 16.0),
                      (1e-3, float("inf"))):  # NaN weights, no message
        with pytest.raises(ValueError, match=r"must be positive and finite"):
            lora_plus_param_groups(model, lr=lr, ratio=ratio)
