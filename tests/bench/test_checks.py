"""Parity with transformers (full and LoRA), the learning and correctness verdicts and the gradient cosine, on the
tiny model on CPU."""

import math

import torch

from chronicals.bench import checks
from chronicals.bench.protocol import RunSpec


def test_parity_full_and_lora():
    res = checks.correctness(RunSpec("correctness", shape="tiny", rows=2, seq=16, device="cpu"))
    assert res["status"] == "ok", res
    for p in res["parity"]:
        assert p["grad_cos_ours"] > 0.999 and p["grad_norm_ours"] > 0
    lora = res["parity"][1]
    assert lora["method"] == "lora" and lora["params_compared"] == 2 * 7 * 2  # A and B of 7 projections x 2 layers


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


def test_correctness_fails_when_one_method_fails(monkeypatch):
    def fake(spec, method):
        ok = method == "full"
        return {"method": method, "status": "ok" if ok else "FAILED", "reason": "" if ok else "lora off"}

    monkeypatch.setattr(checks, "_parity", fake)
    res = checks.correctness(RunSpec("correctness", shape="tiny", rows=2, seq=16, device="cpu"))
    assert res["status"] == "FAILED" and "lora: lora off" in res["reason"]


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
    assert all(math.isnan(r["min_grad_norm"]) and "not finite in 1 steps" in r["reason"] for r in res["runs"])


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
