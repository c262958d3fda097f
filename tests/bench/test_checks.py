"""Parity with transformers (full and LoRA), the learning and correctness verdicts and the gradient cosine, on the
tiny model on CPU."""

import math

import pytest
import torch

from chronicals.bench import checks
from chronicals.bench.protocol import RunSpec


def test_parity_full_and_lora(monkeypatch):
    """Also: LoRA parity sets PEFT's B non-zero (PEFT starts it at 0), so the adapters shape the loss and every A
    gets a gradient; with B left at 0 the A gradients were all 0 and the LoRA parity checked almost nothing."""
    real, grads = checks.first_step, []

    def first_step(*a):
        out = real(*a)
        grads.append(out[2])
        return out

    monkeypatch.setattr(checks, "first_step", first_step)
    res = checks.correctness(RunSpec("correctness", shape="tiny", rows=2, seq=16, device="cpu"))
    assert res["status"] == "ok", res
    for p in res["parity"]:
        assert p["grad_cos_ours"] > 0.999 and p["grad_norm_ours"] > 0
    lora = res["parity"][1]
    assert lora["method"] == "lora" and lora["params_compared"] == 2 * 7 * 2  # A and B of 7 projections x 2 layers
    a_grads = [g for step in grads for n, g in step.items() if "lora_A" in n]  # reference, transformers, ours
    assert len(a_grads) == 3 * 2 * 7 and all(float(g.abs().max()) > 0 for g in a_grads)


def _off_step(monkeypatch, loss_scale=1.0, grad_scale=1.0, shuffle=False):
    """Ours (checks.chronicals_step) made wrong in one quantity: its loss scaled, its gradients scaled, or the
    largest gradient's entries permuted (same norm, another direction)."""
    real = checks.chronicals_step

    def step(model, spec, device, *a, **k):
        prep, fb = real(model, spec, device, *a, **k)

        def off(batch):
            loss = fb(batch)
            with torch.no_grad():
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                for g in grads:
                    g.mul_(grad_scale)
                if shuffle:
                    flat = max(grads, key=lambda t: t.numel()).view(-1)
                    flat.copy_(flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))])
            return loss * loss_scale

        return prep, off

    monkeypatch.setattr(checks, "chronicals_step", step)


@pytest.mark.parametrize("off,status", [({}, "ok"), ({"loss_scale": 1.01}, "FAILED"), ({"grad_scale": 1.1}, "FAILED"),
                                        ({"shuffle": True}, "FAILED")])
def test_parity_fails_ours_off_in_loss_norm_or_direction(monkeypatch, off, status):
    """Each of the loss, the gradient norm and the gradient direction is checked on its own (the other two left
    exact): nothing made the parity FAIL before, so dropping the norm or the cosine condition, or a loss floor of
    10%, passed. Full fine-tune, 1 x 8 tokens."""
    _off_step(monkeypatch, **off)
    res = checks._parity(RunSpec("correctness", shape="tiny", rows=1, seq=8, device="cpu"), "full")
    assert res["status"] == status, res
    err = res["rel_err"]
    if "loss_scale" in off:
        assert err["loss_ours"] > 5e-3
    if "grad_scale" in off:
        assert err["norm_ours"] > 5e-3
    if "shuffle" in off:  # the norm is untouched, only the direction is wrong
        assert err["norm_ours"] < 2e-2 and res["grad_cos_ours"] < 0.99


def _tilt(grads: dict, t: float, seed: int) -> dict:
    """The gradients plus random noise of t x their total norm: about the same norm, 1 - cos ~ t^2 / 2."""
    gen = torch.Generator().manual_seed(seed)
    noise = {k: torch.randn(g.shape, generator=gen) for k, g in grads.items()}
    norm = torch.cat([g.flatten() for g in grads.values()]).norm()
    scale = t * norm / torch.cat([n.flatten() for n in noise.values()]).norm()
    return {k: g + scale * noise[k] for k, g in grads.items()}


def _skewed(monkeypatch, hf: dict, ours: dict):
    """checks.first_step runs the fp32 reference, transformers bf16, ours, in that order: the last two come back with
    their loss / grad norm scaled, or their gradients tilted, by the given amounts."""
    real, n = checks.first_step, []

    def first_step(*a):
        loss, norm, grads = real(*a)
        n.append(1)
        off = {2: hf, 3: ours}.get(len(n), {})
        if "tilt" in off:
            grads = _tilt(grads, off["tilt"], len(n))
        return loss * off.get("loss", 1.0), norm * off.get("norm", 1.0), grads

    monkeypatch.setattr(checks, "first_step", first_step)


@pytest.mark.parametrize("hf,ours,status", [  # (transformers' own error, ours, verdict)
    ({"loss": 1.01}, {"loss": 1.03}, "FAILED"),  # 3% > 2 x 1%
    ({"loss": 1.01}, {"loss": 1.015}, "ok"),  # 1.5% <= 2 x 1% (the 0.1% floor is not what passes it)
    ({"norm": 1.05}, {"norm": 1.15}, "FAILED"),  # 15% > 2 x 5%
    ({"norm": 1.05}, {"norm": 1.08}, "ok"),
    ({"tilt": 0.25}, {"tilt": 0.5}, "FAILED"),  # 1 - cos: ~0.1 > 2 x ~0.03
    ({"tilt": 0.25}, {"tilt": 0.3}, "ok"),  # ~0.04 <= 2 x ~0.03
    ({}, {"tilt": 0.25}, "FAILED"),  # ~0.03 > the 1e-2 cosine floor, transformers exact
    ({}, {"tilt": 0.1}, "ok"),  # ~0.005 under the floor
    ({}, {"loss": 1.005}, "FAILED"),  # 0.5% > the 1e-3 loss floor, transformers ~5e-5 off
    ({}, {"loss": 1.0008}, "ok"),  # under the floor
    ({}, {"loss": 0.99}, "FAILED"),  # too low is as wrong as too high
    ({}, {"norm": 0.9}, "FAILED")])  # a norm 10% short is off by 10%, not by -10%
def test_parity_allows_ours_twice_transformers_error_or_the_floor(monkeypatch, hf, ours, status):
    """Ours passes when its error against the fp32 reference is at most 2 x transformers' own bf16 error, in each of
    loss, grad norm and 1 - cosine, or under the floor (1e-3 for the loss, 1e-2 for 1 - cosine); an error is a
    distance, below the reference as above it. On the tiny CPU model transformers' error is under every floor, so
    the factor 2 was never exercised: 10 x passed, as did a cosine floor of 1e-1."""
    _skewed(monkeypatch, hf, ours)
    res = checks._parity(RunSpec("correctness", shape="tiny", rows=1, seq=8, device="cpu", impl="torch"), "full")
    assert res["status"] == status, (res["rel_err"], 1 - res["grad_cos_hf"], 1 - res["grad_cos_ours"])
    if "tilt" in ours:  # the tilt is in the direction only
        assert res["rel_err"]["norm_ours"] < 0.02


def test_the_parity_reference_runs_in_fp32(monkeypatch):
    """The reference is transformers in fp32 (the same bf16 weight values, fp32 arithmetic); transformers and ours
    run in bf16. Without .float() the 'reference' was transformers' own bf16 run, whose error is then 0."""
    real, dtypes = checks.first_step, []

    def first_step(fb, prepare, model, ids):
        dtypes.append({p.dtype for p in model.parameters()})
        return real(fb, prepare, model, ids)

    monkeypatch.setattr(checks, "first_step", first_step)
    res = checks._parity(RunSpec("correctness", shape="tiny", rows=1, seq=8, device="cpu", impl="torch"), "full")
    assert dtypes[0] == {torch.float32} and dtypes[1] == {torch.bfloat16}
    assert res["loss_ref"] != res["loss_hf"]


class _Peft(torch.nn.Module):
    """PEFT-style names: base_model.model.<module>.lora_A.default.weight."""

    def __init__(self, names):
        super().__init__()
        inner = torch.nn.Module()
        for n in names:
            m = torch.nn.Module()
            m.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 1, bias=False)})
            m.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(1, 2, bias=False)})
            inner.add_module(n, m)
        self.base_model = torch.nn.Module()
        self.base_model.model = inner


class _Ours(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        for n in names:
            m = torch.nn.Module()
            m.lora_A, m.lora_B = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(1, 2, bias=False)
            self.add_module(n, m)


def test_copy_adapters_copies_by_name_and_refuses_names_on_either_side_only():
    """PEFT's adapters and ours must match by canonical name both ways: an adapter PEFT has and ours lacks was left
    out of the copy silently (only ours-only names were refused), so the parity compared different models."""
    peft, ours = _Peft(["q", "k"]), _Ours(["q", "k"])
    assert checks.copy_adapters(peft, ours) == 4
    assert torch.equal(ours.k.lora_B.weight, peft.base_model.model.k.lora_B["default"].weight)
    with pytest.raises(RuntimeError, match=r"PEFT only \['v.lora_A.weight', 'v.lora_B.weight'\]"):
        checks.copy_adapters(_Peft(["q", "k", "v"]), _Ours(["q", "k"]))
    with pytest.raises(RuntimeError, match=r"ours only \['v.lora_A.weight'"):
        checks.copy_adapters(_Peft(["q"]), _Ours(["q", "v"]))


def test_canonical_names_and_cosine():
    assert checks.canonical("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") == \
        "model.layers.0.mlp.up_proj.lora_A.weight"
    a = {"w": torch.tensor([1.0, 0.0])}
    assert checks.cosine(a, {"w": torch.tensor([2.0, 0.0])}) == 1.0
    assert checks.cosine(a, {"v": torch.tensor([1.0, 0.0])}) != checks.cosine(a, a)  # name mismatch -> nan


def test_periodic_batch():
    x = checks.periodic_batch(3, 40, 512, 16, seed=0)
    assert x.shape == (3, 40) and torch.equal(x[:, :16], x[:, 16:32])
    assert all(len(set(r[:16].tolist())) == 16 for r in x)
    assert len({tuple(r[:16].tolist()) for r in x}) == 3  # each row its own block


def test_learning_loss_falls():
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=32, steps=8, device="cpu", lr=3e-3),
                          min_drop_lora=0.05)
    assert res["status"] == "ok", res
    full = res["runs"][0]
    assert full["losses"][-1] < 0.75 * full["losses"][0]


def test_learning_fails_a_loss_that_falls_less_than_min_drop():
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=32, steps=4, device="cpu", lr=3e-3),
                          min_drop_full=0.99, min_drop_lora=0.99)
    assert res["status"] == "FAILED"
    assert [r["status"] for r in res["runs"]] == ["FAILED", "FAILED"]
    assert all(r["losses"][-1] < r["losses"][0] for r in res["runs"])  # it fell, just not by 99%


def test_learning_fails_when_either_run_fails():
    """Each run has its own min_drop and the check is FAILED when either run fails: a passing full run carried a
    failing LoRA run (any instead of all)."""
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=16, steps=2, device="cpu", lr=3e-3),
                          min_drop_full=0.0, min_drop_lora=0.99)
    assert [r["status"] for r in res["runs"]] == ["ok", "FAILED"]
    assert res["status"] == "FAILED" and res["reason"] == "lora: loss did not fall by 99% of its first value"


def _scripted(monkeypatch, losses):
    """checks.train_step gives these losses (grad norm 1) step after step, from the start for each run."""
    seen = []

    def step(*a, **k):
        seen.append(1)
        return torch.tensor(losses[(len(seen) - 1) % len(losses)]), torch.tensor(1.0)

    monkeypatch.setattr(checks, "train_step", step)


def _scripted_learning(steps, **kw):
    return checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=8, steps=steps, device="cpu", impl="torch",
                                   lr=3e-3), **kw)


@pytest.mark.parametrize("losses,want", [([4.0, 3.0], ["ok", "ok"]), ([4.0, 2.0, 4.0], ["FAILED", "FAILED"])])
def test_learning_judges_the_last_loss_at_most_min_drop_below_the_first(monkeypatch, losses, want):
    """The LAST loss must be AT MOST (1 - min_drop) x the first: 4 -> 3 is exactly a 25% fall and passes (a strict
    < failed it); 4 -> 2 -> 4 fell on the way and came back, so FAILED (the lowest loss passed it)."""
    _scripted(monkeypatch, losses)
    res = _scripted_learning(len(losses), min_drop_full=0.25, min_drop_lora=0.25)
    assert [r["status"] for r in res["runs"]] == want, res


def test_learning_fails_a_loss_that_was_not_finite_on_the_way(monkeypatch):
    """First and last losses finite and fallen far enough, a NaN between them: FAILED, the NaN counted."""
    _scripted(monkeypatch, [4.0, math.nan, 2.0])
    res = _scripted_learning(3, min_drop_full=0.25, min_drop_lora=0.25)
    assert [(r["status"], r["reason"]) for r in res["runs"]] == [("FAILED", "loss not finite in 1 step")] * 2


@pytest.mark.parametrize("losses,want", [([4.0, 3.2], ["FAILED", "ok"]), ([4.0, 3.6], ["FAILED", "FAILED"]),
                                          ([4.0, 3.3], ["FAILED", "ok"]), ([4.0, 2.9], ["ok", "ok"])])
def test_learning_default_min_drops_are_25_and_15_percent(monkeypatch, losses, want):
    """The worker calls learning(spec) with the defaults: full must fall 25%, LoRA 15% (module docstring), with a
    period of 16; a 20% fall fails full and passes LoRA, a 10% fall fails both. Every other test passed its own."""
    _scripted(monkeypatch, losses)
    res = _scripted_learning(2)
    assert res["min_drop"] == {"full": 0.25, "lora": 0.15} and res["period"] == 16
    assert [r["status"] for r in res["runs"]] == want, res


def test_a_learning_run_that_raises_is_that_runs_error_row(monkeypatch):
    """An exception in the LoRA run is that run's "error" row; the full run stays and the check is FAILED with the
    error named. Re-raising it ended the worker without any row (the correctness check's twin is below)."""
    def boom(*a, **k):
        raise RuntimeError("apply_lora broke")

    monkeypatch.setattr(checks, "add_chronicals_lora", boom)
    res = _scripted_learning(1, min_drop_full=0.0)
    assert [r["status"] for r in res["runs"]] == ["ok", "error"]
    assert res["status"] == "FAILED" and res["reason"] == "lora: RuntimeError: apply_lora broke"


def test_learning_fails_a_zero_gradient_norm(monkeypatch):
    """A run whose gradient norm is 0 is not training: FAILED even when its loss fell (min_drop 0 here)."""
    real = checks.train_step
    monkeypatch.setattr(checks, "train_step", lambda *a, **k: (real(*a, **k)[0], torch.tensor(0.0)))
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=16, steps=2, device="cpu", lr=3e-3),
                          min_drop_full=0.0, min_drop_lora=0.0)
    assert [r["status"] for r in res["runs"]] == ["FAILED", "FAILED"]
    assert all(r["reason"] == "gradient norm 0" and r["min_grad_norm"] == 0.0 for r in res["runs"])


@pytest.mark.parametrize("lr,want", [(3e-3, 3e-3), (0.0, 3e-4)])
def test_learning_rates_full_at_spec_lr_lora_a_third_and_b_16x(monkeypatch, lr, want):
    """Full fine-tuning at spec.lr (3e-4 when 0); LoRA's A at a third of it and B at 16 x that (LoRA+), whatever the
    protocol's LR_LORA is. LoRA at the full lr, or every LoRA group at one lr (LoRA+ lost), passed."""
    real, made = checks.make_optimizer, []
    monkeypatch.setattr(checks, "make_optimizer", lambda *a: made.append(real(*a)) or made[-1])
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=8, steps=1, device="cpu", lr=lr))
    assert res["lr_full"] == want and res["lr_lora"] == pytest.approx(want / 3)
    full, lora = made
    assert [g["lr"] for g in full.param_groups] == [want]
    by_name = {g["name"]: g["lr"] for g in lora.param_groups}
    assert by_name["lora_A"] == pytest.approx(want / 3) and by_name["lora_B"] == pytest.approx(16 * want / 3)


def test_correctness_fails_when_one_method_fails(monkeypatch):
    def fake(spec, method):
        ok = method == "full"
        return {"method": method, "status": "ok" if ok else "FAILED", "reason": "" if ok else "lora off"}

    monkeypatch.setattr(checks, "_parity", fake)
    res = checks.correctness(RunSpec("correctness", shape="tiny", rows=2, seq=16, device="cpu"))
    assert res["status"] == "FAILED" and "lora: lora off" in res["reason"]


def test_a_parity_that_raises_is_that_methods_error_row(monkeypatch):
    """An exception inside one method's parity is that method's "error" row; the other row stays and the check is
    FAILED. Catching only ImportError let it end the whole correctness check."""
    def fake(spec, method):
        if method == "lora":
            raise RuntimeError("state dicts differ")
        return {"method": method, "status": "ok", "reason": ""}

    monkeypatch.setattr(checks, "_parity", fake)
    res = checks.correctness(RunSpec("correctness", shape="tiny", rows=1, seq=8, device="cpu"))
    assert [p["status"] for p in res["parity"]] == ["ok", "error"]
    assert res["status"] == "FAILED" and "lora: RuntimeError: state dicts differ" in res["reason"]


def test_cosine_is_nan_when_one_side_has_extra_parameters():
    a = {"w": torch.tensor([1.0, 0.0])}
    assert math.isnan(checks.cosine(dict(a, extra=torch.tensor([5.0])), a))  # not the cosine of the shared part


def test_learning_fails_a_non_finite_gradient_norm_after_the_first_step(monkeypatch):
    """min() over [1.0, nan] is 1.0: a NaN gradient norm after the first step passed the learning check with a
    finite min_grad_norm (a bench walk). Every norm must be finite, as for the table's rows."""
    real, calls = checks.train_step, []

    def nan_at_three(*a, **k):
        loss, gn = real(*a, **k)
        calls.append(1)
        return loss, (float("nan") if len(calls) % 8 == 3 else gn)

    monkeypatch.setattr(checks, "train_step", nan_at_three)
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=32, steps=8, device="cpu", lr=3e-3),
                          min_drop_lora=0.05)
    assert [r["status"] for r in res["runs"]] == ["FAILED", "FAILED"]
    assert all(math.isnan(r["min_grad_norm"]) and r["reason"] == "gradient norm not finite in 1 step"
               for r in res["runs"])


def test_learning_names_a_non_finite_loss_as_such(monkeypatch):
    """A run whose loss goes NaN while its gradient norms stay finite is FAILED with the reason the table's row check
    gives ("loss not finite"), not "loss did not fall by 25%", which read as slow learning."""
    real = checks.train_step
    monkeypatch.setattr(checks, "train_step", lambda *a, **k: (torch.tensor(float("nan")), real(*a, **k)[1]))
    res = checks.learning(RunSpec("learning", shape="tiny", rows=1, seq=16, steps=2, device="cpu", lr=3e-3))
    assert [(r["status"], r["reason"]) for r in res["runs"]] == [("FAILED", "loss not finite in 2 steps")] * 2


def test_correctness_without_peft_says_not_installed_not_failed(monkeypatch):
    """peft is a test extra: without it the LoRA parity row said FAILED (ModuleNotFoundError), read as 'wrong
    gradients' (a bench walk). It says what is missing, and the check's status is the full row's."""
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setattr(checks, "_parity", lambda spec, method: {"method": method, "status": "ok", "reason": ""})
    res = checks.correctness(RunSpec("correctness", shape="tiny", rows=2, seq=16, device="cpu"))
    assert res["status"] == "ok" and [p["status"] for p in res["parity"]] == ["ok", "not installed"]
    assert "needs peft" in res["reason"]
