"""Behaviour of the bench that mutation testing (session 27) showed unguarded: tokens/s over the timed steps only,
the L2 gradient norm, marked rows kept, the learning and correctness verdicts, FAILED bars hatched, OOM rows and
the model sweep's retry with checkpointing, the gradient cosine over mismatched names."""

from __future__ import annotations

import math

import pytest
import torch

from chronicals.bench import checks, cli, protocol, report, worker
from chronicals.bench.protocol import RunSpec, grad_norm, timed_run, validate_row


class _Built:
    """A contenders.Built stand-in: one parameter, loss = sum(p)."""

    def __init__(self):
        self.p = torch.nn.Parameter(torch.ones(2))
        self.params = [self.p]
        self.optimizer = torch.optim.SGD(self.params, lr=0.0)
        self.vocab_size = 7
        self.prepare = lambda ids: ids

    def forward_backward(self, batch):
        loss = self.p.sum()
        loss.backward()
        return loss.detach()


def test_tokens_per_s_counts_loss_tokens_of_timed_steps_only(monkeypatch):
    """rows * (seq - 1) loss tokens per timed step, over the timed window only (warm-up steps excluded)."""
    clock = iter([10.0, 12.0])  # t0, then the end of the timed window: 2 s
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: next(clock))
    spec = RunSpec("x", rows=3, seq=5, warmup=3, steps=4, device="cpu")
    out = timed_run(_Built(), spec, torch.device("cpu"))
    assert out["seconds"] == 2.0
    assert out["tokens_per_s"] == 3 * 4 * 4 / 2.0  # rows * (seq - 1) * steps / seconds
    assert len(out["grad_norms"]) == 4 and len(out["losses"]) == 3 + 4


def test_grad_norm_is_l2():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert float(grad_norm([a, b])) == pytest.approx(5.0)


@pytest.mark.parametrize("status", ["error", "not installed", "timeout", "crashed", "OOM"])
def test_validate_row_keeps_every_already_marked_row(status):
    row = {"contender": "x", "status": status, "reason": "why"}
    assert validate_row(dict(row)) == row


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


def test_chart_hatches_failed_rows_red(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    row = {"contender": "chronicals-full", "label": "chronicals", "method": "full", "tokens_per_s": 100.0}
    results = {"environment": {"gpu": "g", "date": "2026-01-01T00:00:00+00:00", "git_sha": "s"},
               "tables": [{"title": "t", "rows_data": [dict(row, status="ok"),
                                                      dict(row, contender="hf-sdpa", status="FAILED")]}]}
    report.plot_png(results, tmp_path / "x.png")
    bars = figs[0].axes[0].patches
    assert [b.get_hatch() for b in bars] == [None, "//"]


def test_an_out_of_memory_error_is_an_oom_row():
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as e:
        row = worker._error_row({"contender": "x"}, e)
    assert row["status"] == "OOM" and "out of memory" in row["reason"]


def test_model_sweep_retries_an_oom_row_with_checkpointing(monkeypatch):
    runs = []

    def fake_run(self, task, spec):
        runs.append((spec.contender, spec.checkpointing))
        if not spec.checkpointing:
            return {"contender": spec.contender, "status": "OOM", "reason": "out of memory"}
        return {"contender": spec.contender, "status": None, "grad_norms": [1.0], "losses": [2.0, 1.0],
                "tokens_per_s": 10.0}

    monkeypatch.setattr(cli.Runner, "run", fake_run)
    res = cli.run_plan(cli.parse_args(["--device", "cpu", "--tiny", "--model-sweep", "--contenders",
                                       "chronicals-lora"]))
    assert runs == [("chronicals-lora", False), ("chronicals-lora", True)]
    rows = res["tables"][0]["rows_data"]
    assert [(r["status"], r["checkpointing"]) for r in rows] == [("OOM", False), ("ok", True)]


def test_cosine_is_nan_when_one_side_has_extra_parameters():
    a = {"w": torch.tensor([1.0, 0.0])}
    assert math.isnan(checks.cosine(dict(a, extra=torch.tensor([5.0])), a))  # not the cosine of the shared part
