"""fp32 master weights for bf16 full fine-tuning (train/master_adamw.py, optim.master_weights).

References: a float64 AdamW written out here, fed the same bf16 gradients; torch.optim.AdamW on fp32 copies gives
the error budget (ours at most 2x torch's fp32 error, both against float64).
"""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from chronicals.train import accumulate_gradients, train
from chronicals.train.checkpoint import checkpoint_dirs
from chronicals.train.master_adamw import MasterWeightAdamW
from chronicals.train.optim import build_optimizer, full_ft_param_groups

from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model

CPU = torch.device("cpu")
# the kernel-level tests also run on CUDA (torch's CUDA fused AdamW kernel) where there is a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
LR, WD, STEPS = 5e-4, 0.1, 6  # lr x (Adam's |step| <= ~3.2) < half a bf16 step down from 1.0 (2^-9 = 0.00195)


def _bf16_model(device: str):
    """The tiny bf16 model; on CUDA with head_dim 8 (hidden 32, 4 heads): FlashAttention's varlen kernel refuses
    tiny_model's head_dim 6 (an H200 run at 0cb1ef7 failed there, before reaching the optimizer)."""
    if device == "cpu":
        return tiny_model(dtype=torch.bfloat16)
    import transformers

    from chronicals.models import CausalLM, ModelConfig
    from train_helpers import VOCAB

    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0).to(torch.bfloat16).to(device)


def _batches(n: int):
    return SyntheticLoader(synthetic_docs(12, seed=7), batch_size=1, row_len=23, shuffle=False).batches[:n]


def _record_grads(model, opt, batches, device=CPU) -> list[dict]:
    """Train ``model`` with ``opt`` one step per batch; -> each step's gradients {name: bf16 grad}."""
    seen = []
    for b in batches:
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, [b], torch.device(device))
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return seen


def _replay(model, opt, grads: list[dict]) -> None:
    """Steps of ``opt`` over ``model`` with given gradients (cast to the params' dtype)."""
    params = dict(model.named_parameters())
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].to(p.dtype)
        opt.step()


def _adamw_f64(w0: dict, grads: list[dict], decayed: set, lr=LR, wd=WD, b1=0.9, b2=0.999, eps=1e-8) -> dict:
    """Textbook AdamW (decoupled decay) in float64."""
    w = {n: t.double() for n, t in w0.items()}
    m = {n: torch.zeros_like(t) for n, t in w.items()}
    v = {n: torch.zeros_like(t) for n, t in w.items()}
    for t, g in enumerate(grads, start=1):
        for n in w:
            gd = g[n].double()
            w[n] *= 1 - lr * (wd if n in decayed else 0.0)
            m[n] = b1 * m[n] + (1 - b1) * gd
            v[n] = b2 * v[n] + (1 - b2) * gd * gd
            w[n] -= lr / (1 - b1 ** t) * m[n] / ((v[n] / (1 - b2 ** t)).sqrt() + eps)
    return w


def _rel_err(got: dict, ref: dict) -> float:
    return max(((got[n].double() - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_masters_keep_small_updates_and_match_float64(fused, device):
    """bf16 weights at lr=5e-4: plain AdamW leaves every RMSNorm weight at 1.0; the masters move all of them and
    match a float64 AdamW fed the same gradients to fp32 precision; each param is its master rounded to bf16."""
    model = _bf16_model(device)
    init = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    decayed = {n for n, p in model.named_parameters() if p.ndim >= 2}
    opt = MasterWeightAdamW(full_ft_param_groups(model, LR, WD), lr=LR, weight_decay=WD, fused=fused)
    grads = [{n: g.cpu() for n, g in step.items()} for step in _record_grads(model, opt, _batches(STEPS), device)]
    masters = {n: opt.state[p]["master"].cpu() for n, p in model.named_parameters()}
    model.cpu()

    plain = _bf16_model(device).cpu()  # the same architecture and initial weights as ``model``
    _replay(plain, torch.optim.AdamW(full_ft_param_groups(plain, LR, WD), lr=LR), grads)
    norms = [n for n in init if "norm" in n]
    assert len(norms) == 5 and all(torch.all(init[n] == 1.0) for n in norms)
    assert all(torch.equal(p, init[n]) for n, p in plain.named_parameters() if n in norms)  # the bug itself
    assert all(torch.all(masters[n] != 1.0) for n in norms)  # every element moved
    assert any(not torch.equal(p, init[n]) for n, p in model.named_parameters() if n in norms)  # some crossed a step

    for n, p in model.named_parameters():
        assert masters[n].dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(p, masters[n].to(torch.bfloat16)), n
    ref = _adamw_f64({n: t.float() for n, t in init.items()}, grads, decayed)
    fp32 = {n: t.float().requires_grad_() for n, t in init.items()}
    torch_fp32 = torch.optim.AdamW([{"params": [fp32[n] for n in decayed], "weight_decay": WD},
                                    {"params": [fp32[n] for n in init if n not in decayed], "weight_decay": 0.0}],
                                   lr=LR, foreach=False)
    for g in grads:
        for n, t in fp32.items():
            t.grad = g[n].float()
        torch_fp32.step()
    budget = _rel_err({n: t.detach() for n, t in fp32.items()}, ref)
    ours = _rel_err(masters, ref)
    assert 0 < budget < 1e-6 and ours <= 2 * budget, (ours, budget)
    assert _rel_err({n: p.detach() for n, p in model.named_parameters()}, ref) > 100 * budget  # bf16 could fail


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_found_inf_skips_everything_on_the_device(fused, device):
    """found_inf=1.0 (inf in the gradients) leaves params, masters, moments and step untouched; 0.0 applies the
    step exactly as without found_inf."""
    model, twin = _bf16_model(device), _bf16_model(device)
    opt = MasterWeightAdamW(full_ft_param_groups(model, LR, WD), lr=LR, weight_decay=WD, fused=fused)
    ref = MasterWeightAdamW(full_ft_param_groups(twin, LR, WD), lr=LR, weight_decay=WD, fused=fused)
    grads = _record_grads(model, opt, _batches(3), device)
    _replay(twin, ref, grads)

    def snap():
        return ([p.detach().clone() for p in model.parameters()],
                [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])

    before = snap()
    bad = {n: g.clone() for n, g in grads[0].items()}
    bad["model.norm.weight"][3] = float("inf")
    bad["lm_head.weight"][0, 0] = float("nan")
    opt.found_inf = torch.tensor(1.0, device=device)
    _replay(model, opt, [bad])
    after = snap()
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for sa, sb in zip(before[1], after[1]):
        assert sa.keys() == sb.keys() == {"master", "exp_avg", "exp_avg_sq", "step"}
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert float(after[1][0]["step"]) == 3.0

    opt.found_inf = torch.tensor(0.0, device=device)
    _replay(model, opt, grads[:1])
    _replay(twin, ref, grads[:1])  # no found_inf at all
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], ref.state[q]["master"])
        assert float(opt.state[p]["step"]) == 4.0
    assert not torch.equal(after[1][0]["master"], opt.state[next(model.parameters())]["master"])


def test_state_dict_round_trip_keeps_fp32_and_continues_bit_for_bit(tmp_path):
    """state_dict -> torch.save -> load_state_dict into a fresh optimizer: masters and moments fp32 and
    identical; continuing equals the uninterrupted run bit for bit. A plain AdamW state loads (masters from
    the params) and a plain AdamW drops masters it is given."""
    grads_model = tiny_model(dtype=torch.bfloat16)
    warm = MasterWeightAdamW(full_ft_param_groups(grads_model, LR, WD), lr=LR, weight_decay=WD)
    grads = _record_grads(grads_model, warm, _batches(6))
    straight = tiny_model(dtype=torch.bfloat16)
    opt = MasterWeightAdamW(full_ft_param_groups(straight, LR, WD), lr=LR, weight_decay=WD)
    _replay(straight, opt, grads[:3])
    buf = io.BytesIO()
    torch.save({"model": straight.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)

    resumed = tiny_model(dtype=torch.bfloat16, seed=9)  # other weights: the load must replace them
    resumed.load_state_dict(saved["model"])
    opt2 = MasterWeightAdamW(full_ft_param_groups(resumed, LR, WD), lr=LR, weight_decay=WD)
    opt2.load_state_dict(saved["opt"])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert opt2.state[q][k].dtype == torch.float32 and torch.equal(opt2.state[q][k], opt.state[p][k]), k
    assert any(not torch.equal(opt.state[p]["master"], p.float()) for p in straight.parameters())  # > bf16 bits
    _replay(straight, opt, grads[3:])
    _replay(resumed, opt2, grads[3:])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], opt2.state[q]["master"])

    old = tiny_model(dtype=torch.bfloat16)  # a checkpoint of a run with plain AdamW (bf16 moments)
    plain = torch.optim.AdamW(old.parameters(), lr=LR)
    _replay(old, plain, grads[:2])
    opt3 = MasterWeightAdamW(old.parameters(), lr=LR)
    opt3.load_state_dict(plain.state_dict())
    _replay(old, opt3, grads[2:3])
    p = next(old.parameters())
    assert opt3.state[p]["exp_avg"].dtype == torch.float32 and float(opt3.state[p]["step"]) == 3.0

    cfg = tiny_config(tmp_path, optim__master_weights="false")  # resumed with masters switched off
    plain2 = build_optimizer(resumed, cfg, CPU)
    plain2.load_state_dict(opt2.state_dict())
    assert all("master" not in st and st["exp_avg"].dtype == torch.bfloat16 for st in plain2.state.values())
    assert len(plain2.state) == len(list(resumed.parameters()))


def test_a_state_loaded_from_a_live_optimizer_is_not_shared_with_it():
    """load_state_dict copies the loaded masters and moments: an optimizer loaded from another live optimizer's
    state_dict() does not share its fp32 masters, so stepping one leaves the other's state (and the weights it
    writes at its next step) alone. torch.optim.AdamW aliases them; the trainer loads from torch.load either way."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    a, b = MasterWeightAdamW([p], lr=1e-2), MasterWeightAdamW([q], lr=1e-2)
    p.grad = torch.ones_like(p)
    a.step()
    b.load_state_dict(a.state_dict())
    before = {k: v.clone() for k, v in a.state[p].items()}
    q.grad = torch.ones_like(q)
    b.step()
    for k, v in before.items():
        assert torch.equal(a.state[p][k], v), k
        assert a.state[p][k] is not b.state[q][k], k


def test_step_runs_a_closure_with_grad_enabled():
    """step(closure) runs the closure with autograd on (step itself runs under no_grad), as torch optimizers do: a
    closure that calls backward works, its loss is returned and its gradient is the one stepped on."""
    w = torch.nn.Parameter(torch.full((3,), 2.0, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w.float() ** 2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 12.0
    assert torch.all(w.float() < 2.0)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_scheduler_lr_is_the_lr_used(fused):
    """The update uses param_groups' lr as the LambdaLR sets it (Adam's first step is lr x sign(g) where
    |g| >> eps), not the lr the optimizer was built with; lr = 0 leaves the masters as they are."""
    model = tiny_model(dtype=torch.bfloat16)
    opt = MasterWeightAdamW(model.parameters(), lr=2.0 ** -6, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [0.25, 0.0][s])
    w0 = model.lm_head.weight.detach().float()
    _record_grads(model, opt, _batches(1))
    sched.step()
    g = model.lm_head.weight.grad.float()
    big = g.abs() > 1e-3
    assert big.sum() > 100
    step = opt.state[model.lm_head.weight]["master"] - w0
    torch.testing.assert_close(step[big], -(2.0 ** -8) * g[big].sign(), rtol=1e-4, atol=0)
    master = opt.state[model.lm_head.weight]["master"].clone()
    assert opt.param_groups[0]["lr"] == 0.0
    _replay(model, opt, [{n: p.grad for n, p in model.named_parameters()}])
    assert torch.equal(opt.state[model.lm_head.weight]["master"], master)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_each_groups_own_eps_and_betas_and_a_large_decay_match_torch_adamw(fused):
    """Against torch.optim.AdamW on float32 weights, with settings large enough to tell the orderings apart: a group
    with its own eps and betas gets them (not the constructor's defaults: the config passes eps and betas as
    defaults, so no other test had a group of its own), decoupled decay w (1 - lr wd) comes before the Adam step,
    and eps is added after the bias correction of sqrt(v)."""
    torch.manual_seed(0)
    w0 = [torch.randn(4, 3), torch.randn(5)]
    grads = [[torch.randn(4, 3), torch.randn(5)] for _ in range(3)]

    def groups(ps):
        return [{"params": [ps[0]], "weight_decay": 0.5, "eps": 0.3, "betas": (0.5, 0.6)},
                {"params": [ps[1]], "weight_decay": 0.0}]

    ours_p = [torch.nn.Parameter(t.clone()) for t in w0]
    ref_p = [torch.nn.Parameter(t.clone()) for t in w0]
    ours = MasterWeightAdamW(groups(ours_p), lr=0.1, eps=1e-8, fused=fused)
    ref = torch.optim.AdamW(groups(ref_p), lr=0.1, eps=1e-8, foreach=False)
    for g in grads:
        for p, q, gi in zip(ours_p, ref_p, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_constructor_settings_of_a_plain_parameter_list_match_torch_adamw(fused, device):
    """Parameters passed without group dicts take lr, betas, eps and weight_decay from the constructor. fused=True
    runs torch's fused AdamW kernel: the masters of bf16 weights equal torch.optim.AdamW(fused=True) on float32 copies
    bit for bit; the foreach path matches torch.optim.AdamW to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    w0 = [torch.randn(4, 3, generator=g).bfloat16(), torch.randn(5, generator=g).bfloat16()]
    grads = [[torch.randn(4, 3, generator=g).bfloat16(), torch.randn(5, generator=g).bfloat16()] for _ in range(3)]
    kw = dict(lr=0.1, betas=(0.5, 0.6), eps=0.3, weight_decay=0.5)
    ours_p = [torch.nn.Parameter(t.to(device)) for t in w0]
    ref_p = [torch.nn.Parameter(t.to(device, torch.float32)) for t in w0]
    ours = MasterWeightAdamW(ours_p, fused=fused, **kw)
    ref = torch.optim.AdamW(ref_p, **kw, **({"fused": True} if fused else {"foreach": False}))
    for step in grads:
        for p, q, gi in zip(ours_p, ref_p, step):
            p.grad, q.grad = gi.to(device), gi.to(device, torch.float32)
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        if fused:
            assert torch.equal(ours.master(p), q.detach())
        else:
            torch.testing.assert_close(ours.master(p), q.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), q.detach().bfloat16())


def test_build_optimizer_chooses_and_says_why(tmp_path, caplog):
    """auto: masters for bf16 trainable weights (full fine-tuning and LoRA adapters), none for fp32; false on
    bf16 warns."""
    caplog.set_level(logging.INFO, logger="chronicals.train")
    cases = [({}, torch.bfloat16, MasterWeightAdamW), ({}, torch.float32, torch.optim.AdamW),
             ({"optim__master_weights": "false"}, torch.bfloat16, torch.optim.AdamW),
             ({"lora__enabled": True, "lora__targets": ["q_proj"]}, torch.bfloat16, MasterWeightAdamW),
             ({"lora__enabled": True, "lora__targets": ["q_proj"], "optim__master_weights": "false"}, torch.bfloat16,
              torch.optim.AdamW),
             ({"lora__enabled": True, "lora__targets": ["q_proj"]}, torch.float32, torch.optim.AdamW),
             ({"optim__master_weights": "true"}, torch.bfloat16, MasterWeightAdamW),  # untested: a mutation walk
             ({"optim__master_weights": "true"}, torch.float32, torch.optim.AdamW)]
    for over, dtype, kind in cases:
        caplog.clear()
        cfg = tiny_config(tmp_path, **over)
        model = tiny_model(dtype=dtype)
        if cfg.lora.enabled:
            from chronicals.lora.inject import apply_lora

            apply_lora(model, r=2, alpha=4, target_modules=("q_proj",))
        opt = build_optimizer(model, cfg, CPU)
        assert type(opt) is kind, over
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "rounded away" in r.message]
        assert bool(warned) == (over.get("optim__master_weights") == "false"), over
    with pytest.raises(ValueError, match="optim.master_weights='maybe' is invalid"):
        tiny_config(tmp_path, optim__master_weights="maybe")


@pytest.mark.parametrize("fused", ["false", "true"], ids=["every-step-read", "pipelined"])
def test_bf16_full_finetune_resume_equals_uninterrupted(tmp_path, docs, fused, caplog):
    """train() with model.dtype=bfloat16 and no LoRA picks MasterWeightAdamW (auto); SIGTERM after step 4 and
    resume=auto end bit for bit where the straight run does (masters restored from the checkpoint, fp32)."""
    import os
    import signal

    caplog.set_level(logging.INFO, logger="chronicals.train")
    over = dict(model__dtype="bfloat16", train__max_steps=8, optim__lr=1e-4, optim__fused=fused,
                optim__weight_decay=0.1)
    straight = tiny_model()
    train(tiny_config(tmp_path / "a", **over), model=straight, train_loader=SyntheticLoader(docs, seed=5))
    assert any("MasterWeightAdamW" in r.message for r in caplog.records)

    def stop_at_4(step, rec):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg_b = tiny_config(tmp_path / "b", train__resume="auto", **over)
    first = train(cfg_b, model=tiny_model(), train_loader=SyntheticLoader(docs, seed=5), on_step=stop_at_4)
    assert first.status == "interrupted" and first.step == 4
    ck = torch.load(checkpoint_dirs(tmp_path / "b" / "run")[-1] / "state.pt", weights_only=False)
    assert all(st["master"].dtype == torch.float32 for st in ck["optimizer"]["state"].values())
    resumed = tiny_model()
    second = train(cfg_b, model=resumed, train_loader=SyntheticLoader(docs, seed=5))
    assert second.status == "completed" and second.step == 8
    a, b = straight.state_dict(), resumed.state_dict()
    assert a["model.norm.weight"].dtype == torch.bfloat16
    for n in a:
        assert torch.equal(a[n], b[n]), n
    losses = [json.loads(x)["loss"] for x in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]
    assert len(losses) == 8 and all(loss == loss for loss in losses)


def test_a_lora_sized_lr_for_full_fine_tuning_warns(tmp_path, caplog):
    """Above 2e-4 (the top of the usual full fine-tuning range, not warned itself)."""
    for lr, warns in ((1e-3, True), (2e-5, False), (2e-4, False), (3e-4, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.train"):
            build_optimizer(tiny_model(), tiny_config(tmp_path, optim__lr=lr), CPU)
        assert ("the default 1e-3 is LoRA's" in caplog.text) == warns, lr


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_lora_run_writes_its_fp32_masters_as_the_adapter(tmp_path, docs, device):
    """The final adapter of a bf16 LoRA run held its bf16 weights: the fp32 masters rounded, so an update below
    half a bf16 step (most of lora_A's at a small lr) was lost from the file though the run had kept it. Now the
    file holds the masters, fp32 (PEFT's adapter dtype): rounded to bf16 they are the model's weights, and they are
    not all bf16 values. A resume that finds the run done writes the same file from the checkpoint's masters."""
    from safetensors.torch import load_file

    from chronicals.lora.peft_io import adapter_state_dict

    over = dict(model__dtype="bfloat16", lora__enabled=True, lora__rank=4, lora__alpha=8, train__max_steps=4,
                optim__lr=1e-4, train__save_final=True, train__resume="auto", model__device=device)
    fresh = (lambda: tiny_model()) if device == "cpu" else (lambda: _bf16_model(device))  # CUDA: graphs on (auto)
    model = fresh()
    result = train(tiny_config(tmp_path, **over), model=model, train_loader=SyntheticLoader(docs, seed=5))
    saved = load_file(str(result.final_dir / "adapter_model.safetensors"))
    weights = adapter_state_dict(model)
    assert saved.keys() == weights.keys() and len(saved) > 0
    between = 0
    for k, t in saved.items():
        assert t.dtype == torch.float32 and weights[k].dtype == torch.bfloat16, k
        assert torch.equal(t.to(torch.bfloat16), weights[k]), k
        between += int((t != t.to(torch.bfloat16).float()).sum())
    assert between > 0  # updates the bf16 weights do not show
    again = train(tiny_config(tmp_path, **over), model=fresh(), train_loader=SyntheticLoader(docs, seed=5))
    assert again.step == 4 and again.start_step == 4
    resaved = load_file(str(again.final_dir / "adapter_model.safetensors"))
    assert all(torch.equal(resaved[k], saved[k]) for k in saved)
    # the last checkpoint as an adapter (chat / eval / export --adapter runs/x/checkpoints/step-N): the same masters
    from chronicals.train.checkpoint_adapter import apply_checkpoint_adapter

    base = tiny_model(dtype=torch.bfloat16) if device == "cpu" else _bf16_model(device)
    from_ck = adapter_state_dict(apply_checkpoint_adapter(base, result.checkpoint))
    assert from_ck.keys() == saved.keys() and all(torch.equal(from_ck[k], saved[k]) for k in saved)


def test_a_checkpoint_without_its_parameter_names_still_gives_the_masters(tmp_path, docs):
    """Checkpoints written before 49b06ef lack ``optimizer_params``: used as an adapter they gave the bf16 weights
    (the masters rounded). Each master is now found by the one weight it rounds to."""
    from chronicals.train.checkpoint import masters_by_name
    from chronicals.train.checkpoint_adapter import apply_checkpoint_adapter

    over = dict(model__dtype="bfloat16", lora__enabled=True, lora__rank=4, lora__alpha=8, train__max_steps=2,
                optim__lr=1e-4, train__save_final=False)
    result = train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs, seed=5))
    file = result.checkpoint / "state.pt"
    state = torch.load(file, weights_only=True)
    named = masters_by_name(state)
    assert len(named) == len(state["model"]) > 0 and all(m.dtype == torch.float32 for m in named.values())
    del state["optimizer_params"]  # as an old checkpoint
    assert masters_by_name(state).keys() == named.keys()
    assert all(torch.equal(masters_by_name(state)[n], m) for n, m in named.items())
    torch.save(state, file)
    got = dict(apply_checkpoint_adapter(tiny_model(dtype=torch.bfloat16), result.checkpoint).named_parameters())
    assert all(got[n].dtype == torch.float32 and torch.equal(got[n], m) for n, m in named.items())
    # two weights a master rounds to (a duplicated tensor): ambiguous, left as stored
    state["model"]["copy"] = next(iter(state["model"].values())).clone()
    assert len(masters_by_name(state)) == len(named) - 1


def test_named_masters_are_taken_by_name_where_values_are_ambiguous():
    """With ``optimizer_params`` (the checkpoint's parameter names) each master goes to its named weight, even where
    two weights hold the same bf16 values (weights still at their init) and the by-value pairing of older
    checkpoints must leave both out as ambiguous: matched by value there, both lost their masters."""
    from chronicals.train.checkpoint import masters_by_name

    w = torch.ones(4, dtype=torch.bfloat16)
    m_a, m_b = torch.full((4,), 1.0001), torch.full((4,), 0.9999)  # both round to w
    state = {"model": {"a": w.clone(), "b": w.clone()}, "optimizer_params": ["a", "b"],
             "optimizer": {"state": {0: {"master": m_a}, 1: {"master": m_b}}, "param_groups": [{"params": [0, 1]}]}}
    got = masters_by_name(state)
    assert set(got) == {"a", "b"} and torch.equal(got["a"], m_a) and torch.equal(got["b"], m_b)
    del state["optimizer_params"]  # a checkpoint before 49b06ef: ambiguous, nothing taken
    assert masters_by_name(state) == {}


def test_mixed_trainable_dtypes_get_masters(tmp_path):
    """fp32 adapters beside a bf16 module to save (a norm trained whole): auto keeps fp32 masters for the bf16 one,
    whose small updates would otherwise round away ("all" trainables bf16 turned them off; a mutation walk)."""
    from chronicals.lora.inject import apply_lora

    model = tiny_model(dtype=torch.bfloat16)
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj",), modules_to_save=["norm"], adapter_dtype=torch.float32)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32, torch.bfloat16}
    cfg = tiny_config(tmp_path, lora__enabled=True, lora__targets=["q_proj"])
    assert type(build_optimizer(model, cfg, CPU)) is MasterWeightAdamW


def test_a_parameter_without_a_gradient_is_left_alone():
    """An unused parameter (no .grad) in a group: the step updates the others and leaves it and its state alone
    (untested: a mutation walk; without the check the step failed on None.dtype)."""
    a = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([a, b], lr=1e-2)
    a.grad = torch.ones_like(a)
    opt.step()
    assert not torch.equal(a, torch.ones_like(a))
    assert torch.equal(b, torch.ones_like(b)) and b not in opt.state


def test_a_sparse_gradient_is_refused():
    """A sparse gradient (nn.Embedding(sparse=True)) is refused by name at the step; without the check the foreach
    ops failed with a raw dispatcher error."""
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = MasterWeightAdamW(emb.parameters(), lr=1e-2)
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_master_adamw_refuses_bad_hyperparameters_and_takes_lr_zero():
    """The config checks these first; a Python caller gets the optimizer's own message, not NaN weights (eps=0 on a
    zero gradient, beta2=1 a bias correction of 0; three betas failed only unpacking them at the first step). lr=0 is
    allowed, as in torch.optim.AdamW."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="a tensor lr is not supported"):  # a 0-dim tensor passed lr >= 0
        MasterWeightAdamW(p, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match="eps=0.0 must be > 0"):
        MasterWeightAdamW(p, eps=0.0)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"):
        MasterWeightAdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"betas=\(0.9, 0.99, 0.5\) must be two numbers"):  # not at the first step
        MasterWeightAdamW(p, betas=(0.9, 0.99, 0.5))
    with pytest.raises(ValueError, match=r"betas=\(-0.1, 0.999\) must be two numbers in \[0, 1\)"):
        MasterWeightAdamW(p, betas=(-0.1, 0.999))  # as torch.optim.AdamW: a negative momentum is refused
    MasterWeightAdamW(p, lr=0.0)
    with pytest.raises(ValueError, match=r"lr=-0.001 must be a number >= 0"):  # a negative lr ascends the loss
        MasterWeightAdamW(p, lr=-1e-3)
    with pytest.raises(ValueError, match=r"weight_decay=-0.1 must be >= 0"):  # it grew each weight a step
        MasterWeightAdamW(p, weight_decay=-0.1)
    MasterWeightAdamW(p, weight_decay=0.0)


def test_fused_on_a_device_without_the_kernel_is_refused(monkeypatch):
    """fused=True on a device torch has no fused AdamW kernel for is refused at construction, naming the fix (CPU
    has the kernel, so the refusal is reached by taking CPU off torch's list)."""
    monkeypatch.setattr("chronicals.train.master_adamw._get_fused_kernels_supported_devices", lambda: ["cuda"])
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"no fused AdamW kernel on cpu; pass fused=False"):
        MasterWeightAdamW(p, fused=True)
    MasterWeightAdamW(p, fused=False)


def test_float32_parameters_are_their_own_master_and_updated_in_place():
    """Beside a bf16 parameter (which gets an fp32 master), a float32 one keeps no master copy (``master(p)`` is p)
    and is stepped where it is: a change made to its weight between steps (a resume loading weights, a user's edit)
    is what the next step starts from, not overwritten by a stale copy."""
    lo = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    hi = torch.nn.Parameter(torch.ones(4))
    opt = MasterWeightAdamW([lo, hi], lr=1e-2)
    for edit in (None, 5.0):
        if edit is not None:
            with torch.no_grad():
                hi.fill_(edit)
        for p in (lo, hi):
            p.grad = torch.ones_like(p)
        opt.step()
    assert "master" in opt.state[lo] and "master" not in opt.state[hi] and opt.master(hi) is hi
    # Adam's second step on a constant gradient moves by ~lr: 5.0 - 0.01, not 0.99 - 0.01
    torch.testing.assert_close(hi.detach(), torch.full((4,), 4.99), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_float16_weights_train_through_fp32_masters(fused):
    """float16 weights (like bf16 ones) get fp32 masters and their fp16 gradients are cast to fp32 before the
    update, on both paths: the first AdamW step moves the master by lr (m_hat / sqrt(v_hat) = 1) and the weight is
    the master rounded (every other test used bf16; fp16 failed with "expected scalar type Float but found Half")."""
    w = torch.nn.Parameter(torch.ones(5, dtype=torch.float16))
    opt = MasterWeightAdamW([w], lr=1e-3, fused=fused)
    w.grad = torch.full((5,), 0.5, dtype=torch.float16)
    opt.step()
    m = opt.master(w)
    assert m.dtype == torch.float32
    torch.testing.assert_close(m, torch.full((5,), 1 - 1e-3), rtol=0, atol=1e-6)
    assert torch.equal(w.detach(), m.half())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_float64_parameter_is_refused(fused):
    """A float64 parameter is refused, naming its dtype and torch.optim.AdamW: it would be updated from fp32
    gradients and fp32 moments, silently losing its precision."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dtype torch.float64 .*use torch.optim.AdamW"):
        MasterWeightAdamW([p], fused=fused)


def test_a_loaded_master_of_a_now_float32_parameter_is_dropped():
    """A state saved where a parameter was bf16 (its fp32 master in the state), loaded where it is float32 (a LoRA
    adapter_dtype changed between the runs): the saved master is dropped and the parameter's own weight is what
    the next step updates."""
    lo = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    first = MasterWeightAdamW([lo], lr=1e-2)
    lo.grad = torch.ones_like(lo)
    first.step()
    saved = first.state_dict()
    assert "master" in saved["state"][0]
    hi = torch.nn.Parameter(torch.full((4,), 3.0))
    second = MasterWeightAdamW([hi], lr=1e-2)
    second.load_state_dict(saved)
    assert "master" not in second.state[hi] and second.state[hi]["exp_avg"].dtype == torch.float32
    hi.grad = torch.ones_like(hi)
    second.step()
    torch.testing.assert_close(hi.detach(), torch.full((4,), 2.99), rtol=0, atol=1e-6)


def test_master_weights_false_warns_when_any_trainable_weight_is_bf16(tmp_path, caplog):
    """optim.master_weights=false with fp32 adapters beside a bf16 module to save (the norm trained whole): the bf16
    norm's small updates round away, so the warning is given although not every trainable weight is bf16."""
    from chronicals.lora import apply_lora

    model = tiny_model(dtype=torch.bfloat16)
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj",), modules_to_save=["norm"], adapter_dtype=torch.float32)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32, torch.bfloat16}
    cfg = tiny_config(tmp_path, lora__enabled=True, lora__targets=["q_proj"], optim__master_weights="false")
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        opt = build_optimizer(model, cfg, CPU)
    assert type(opt) is torch.optim.AdamW
    assert "rounded away" in caplog.text and "bfloat16/float32" in caplog.text, caplog.text


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_master_weight_messages_name_what_is_trained(tmp_path, caplog, lora):
    """The line saying why auto chose fp32 masters, and the warning of optim.master_weights=false on bf16 weights,
    name what trains: the LoRA adapters under LoRA, the weights of a full fine-tune otherwise."""
    from chronicals.lora import apply_lora

    over = {"lora__enabled": True, "lora__targets": ["q_proj"]} if lora else {}
    why = "LoRA adapters" if lora else "weights under full fine-tuning"
    warned = "LoRA adapters" if lora else "full fine-tuning"
    caplog.set_level(logging.INFO, logger="chronicals.train")
    for setting, said in (("auto", f"optim.master_weights=auto with bfloat16 {why} (+8 bytes"),
                          ("false", f"{warned} in bfloat16 without fp32 masters (optim.master_weights=false)")):
        caplog.clear()
        model = tiny_model(dtype=torch.bfloat16)
        if lora:
            apply_lora(model, r=2, alpha=4, target_modules=("q_proj",))
        build_optimizer(model, tiny_config(tmp_path, optim__lr=1e-4, optim__master_weights=setting, **over), CPU)
        assert said in caplog.text, caplog.text
        assert lora or "LoRA adapters" not in caplog.text, caplog.text
