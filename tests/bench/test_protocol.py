"""Row validation (rows already marked are kept), FLOP counting, the worker's spec round trip, and the timed run's
tokens/s (over the timed steps only) and L2 gradient norm (no model runs)."""

import math

import pytest
import torch

from chronicals.bench import protocol
from chronicals.bench.protocol import RunSpec, grad_norm, timed_run, validate_row
from chronicals.bench.shapes import get_shape, matmul_params, model_config, train_flops_per_token
from chronicals.bench.worker import parse_args, spec_argv


def _row(norms, losses=None):
    return {"contender": "x", "status": None, "grad_norms": norms, "losses": losses or [1.0] * len(norms)}


def test_validate_row_ok_and_min_norm():
    row = validate_row(_row([0.5, 0.25, 2.0]))
    assert row["status"] == "ok" and row["min_grad_norm"] == 0.25


@pytest.mark.parametrize("norms,why", [([1.0, 0.0, 1.0], "gradient norm 0"), ([1.0, math.nan], "not finite"),
                                       ([math.inf, 1.0], "not finite"), ([], "no timed steps")])
def test_validate_row_failed(norms, why):
    row = validate_row(_row(norms))
    assert row["status"] == "FAILED" and why in row["reason"]


def test_validate_row_failed_on_nan_loss_and_keeps_errors():
    assert validate_row(_row([1.0], [math.nan]))["status"] == "FAILED"
    err = {"contender": "x", "status": "OOM", "reason": "out of memory"}
    assert validate_row(dict(err)) == err


def test_flops_match_anchors():
    """ANCHORS.md: 3.10 GFLOP per token for the 0.5B shape at seq 1024 (full), 31.6 for 8B LoRA at 2048."""
    cfg = model_config(get_shape("0.5b"))
    assert train_flops_per_token(cfg, 1024, "full") == pytest.approx(3.10e9, rel=2e-3)
    assert cfg.num_params() == pytest.approx(494e6, rel=2e-3)  # Qwen2.5-0.5B: 494M parameters
    cfg8 = model_config(get_shape("8b"))
    assert train_flops_per_token(cfg8, 2048, "lora") == pytest.approx(31.6e9, rel=2e-3)
    # lora = full - 2 x matmul params, and attention is counted in both
    assert train_flops_per_token(cfg8, 2048, "full") - train_flops_per_token(cfg8, 2048, "lora") == 2 * matmul_params(cfg8)
    with pytest.raises(ValueError, match="not 'full' or 'lora'"):
        train_flops_per_token(cfg, 1024, "qlora")


def test_spec_round_trip_through_worker_flags():
    spec = RunSpec("hf-peft", shape="tiny", rows=3, seq=17, warmup=0, steps=5, device="cpu", checkpointing=True,
                   lr=2.5e-3, layout="packed")
    args = parse_args(["--task", "contender", "--json-out", "x.json", *spec_argv(spec)])
    assert RunSpec(**{k: getattr(args, k) for k in spec.to_dict()}) == spec
    assert spec.loss_tokens == 3 * 16


def test_runspec_rejects_bad_values():
    with pytest.raises(ValueError, match="seq >= 2"):
        RunSpec("x", seq=1)
    with pytest.raises(ValueError, match="layout"):
        RunSpec("x", layout="padded")
    with pytest.raises(ValueError, match="unknown keys"):
        RunSpec.from_dict({"contender": "x", "batch": 3})


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
