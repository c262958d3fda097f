"""Row validation (an "ok" row checked again, other marks kept), FLOP counting, the worker's spec round trip, the
protocol's defaults and optimizer, and the timed run's tokens/s (over the timed steps only) and L2 gradient norm."""

import math

import pytest
import torch

from chronicals.bench import protocol
from chronicals.bench.contenders import get_contender
from chronicals.bench.protocol import RunSpec, grad_norm, make_batches, make_optimizer, timed_run, validate_row
from chronicals.bench.shapes import get_shape, matmul_params, model_config, train_flops_per_token
from chronicals.bench.worker import parse_args, spec_argv


def _row(norms, losses=None):
    return {"contender": "x", "status": None, "grad_norms": norms, "losses": losses or [1.0] * len(norms)}


def test_validate_row_ok_and_min_norm():
    row = validate_row(_row([0.5, 0.25, 2.0]))
    assert row["status"] == "ok" and row["min_grad_norm"] == 0.25


@pytest.mark.parametrize("marked", [None, "ok"])
@pytest.mark.parametrize("norms,why", [([1.0, 0.0, 1.0], "gradient norm 0"), ([1.0, math.nan], "not finite"),
                                       ([math.inf, 1.0], "not finite"), ([], "no timed steps")])
def test_validate_row_failed(norms, why, marked):
    """A row the worker already marked "ok" is checked again (bench.cli re-validates every worker row): keeping "ok"
    rows as they came let a worker's verdict stand unchecked."""
    row = validate_row(dict(_row(norms), status=marked))
    assert row["status"] == "FAILED" and why in row["reason"]


def test_validate_row_min_grad_norm_is_nan_when_a_norm_is_not_finite():
    """A FAILED row with one NaN norm among finite ones showed the smallest finite norm (0.5), a healthy-looking
    value beside FAILED; the table says nan."""
    row = validate_row(_row([1.0, math.nan, 0.5]))
    assert row["status"] == "FAILED" and math.isnan(row["min_grad_norm"])
    assert row["reason"] == "gradient norm not finite in 1 timed step"


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


def test_runspec_defaults_are_the_protocols():
    """The protocol of ANCHORS.md: 16 x 1024 tokens, 4 warm-up + 12 timed steps, 16 * 1023 loss tokens per step; a
    worker started without those flags uses the same values. Nothing pinned them (a warm-up of 2 passed)."""
    s = RunSpec("x")
    assert (s.rows, s.seq, s.warmup, s.steps, s.loss_tokens) == (16, 1024, 4, 12, 16_368)
    a = parse_args(["--json-out", "x.json"])
    assert (a.rows, a.seq, a.warmup, a.steps) == (16, 1024, 4, 12)
    assert RunSpec("x", step="bench").step == "bench"


def test_the_protocols_lora_is_the_shipped_recipes():
    """Every LoRA row trains rank 32, alpha 64, LoRA+ ratio 16: the shipped 0.5B LoRA recipe's adapters, so the bench
    times what that recipe trains (a worker started without the flags too)."""
    from pathlib import Path

    from chronicals.config import load_config

    recipe = load_config(Path(__file__).parents[2] / "configs" / "qwen2.5-0.5b" / "lora.yaml").lora
    s = RunSpec("x")
    assert (s.lora_r, s.lora_alpha, protocol.LORA_PLUS_RATIO) == (recipe.rank, recipe.alpha, recipe.plus_ratio)
    assert (s.lora_r, s.lora_alpha) == (32, 64)
    a = parse_args(["--json-out", "x.json"])
    assert (a.lora_r, a.lora_alpha) == (32, 64)


def test_the_protocols_optimizer_and_full_lr():
    """Every contender's optimizer is torch AdamW(betas=(0.9, 0.95), weight_decay=0, fused=True); lr=0 means the
    protocol's LR_FULL (1e-5) for a full fine-tune. None of these was pinned: other betas, a weight decay, an unfused
    AdamW or LR_FULL 1e-4 passed (LoRA's 1e-4 is test_runner's test_lora_groups_take_the_runs_lr)."""
    assert (protocol.LR_FULL, protocol.LR_LORA) == (1e-5, 1e-4)
    spec = RunSpec("chronicals-full", shape="tiny", rows=1, seq=8, device="cpu", impl="torch")
    opt = get_contender("chronicals-full").build(spec, get_shape("tiny"), torch.device("cpu")).optimizer
    assert isinstance(opt, torch.optim.AdamW) and [g["lr"] for g in opt.param_groups] == [pytest.approx(1e-5)]
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.0
    assert opt.defaults["fused"] is True
    p = torch.nn.Parameter(torch.ones(3))
    assert make_optimizer([{"params": [p]}], torch.device("cpu"), 2e-3).param_groups[0]["lr"] == pytest.approx(2e-3)


@pytest.mark.parametrize("bad,why", [({"seq": 1}, "seq >= 2"), ({"rows": 0}, "rows >= 1"), ({"steps": 0}, "steps >= 1"),
                                     ({"warmup": -1}, "warmup >= 0"), ({"layout": "padded"}, "layout"),
                                     ({"step": "fast"}, "step='fast' must be 'trainer' or 'bench'"),
                                     ({"attention": "sdpa"}, "attention='sdpa' must be one of"),
                                     ({"batch": 3}, "unknown keys")])
def test_runspec_rejects_bad_values(bad, why):
    """Refused in the parent, before a worker starts: rows=0 (no loss tokens), steps=0 (timed_run divided by zero
    after the whole warm-up), a negative warm-up, an attention kernel outside VARLEN_KERNELS (found only inside
    the worker) and an unknown step name were all accepted by a looser check."""
    with pytest.raises(ValueError, match=why):
        RunSpec.from_dict({"contender": "x", **bad})


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
    """rows * (seq - 1) loss tokens per timed step, over the timed window only (warm-up steps excluded); step_ms is
    that window per timed step (not the whole window)."""
    clock = iter([10.0, 12.0])  # t0, then the end of the timed window: 2 s
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: next(clock))
    spec = RunSpec("x", rows=3, seq=5, warmup=3, steps=4, device="cpu")
    out = timed_run(_Built(), spec, torch.device("cpu"))
    assert out["seconds"] == 2.0
    assert out["tokens_per_s"] == 3 * 4 * 4 / 2.0  # rows * (seq - 1) * steps / seconds
    assert out["step_ms"] == 2000.0 / 4
    assert len(out["grad_norms"]) == 4 and len(out["losses"]) == 3 + 4


def test_make_batches_follows_the_seed():
    """The same seed gives the same batches (every contender sees the same tokens) and another seed others; the
    seed was ignored (--seed did nothing) and no test noticed. Batches are distinct, int64 and in the vocabulary,
    its last id included (a range cut at vocab_size - 1 never drew it)."""
    a = make_batches(RunSpec("x", rows=2, seq=8, seed=0), 50, 2, "cpu")
    b = make_batches(RunSpec("y", rows=2, seq=8, seed=0), 50, 2, "cpu")
    c = make_batches(RunSpec("x", rows=2, seq=8, seed=1), 50, 2, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1]) and a[0].dtype == torch.int64 and a[0].shape == (2, 8)
    assert int(torch.cat(a).min()) >= 0 and int(torch.cat(a).max()) < 50
    (small,) = make_batches(RunSpec("x", rows=4, seq=64), 3, 1, "cpu")
    assert sorted(torch.unique(small).tolist()) == [0, 1, 2]


class _Recording(_Built):
    """_Built that keeps every batch it is fed."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward_backward(self, batch):
        self.seen.append(batch.clone())
        return super().forward_backward(batch)


@pytest.mark.parametrize("warmup,steps", [(2, 3), (1, 9)])
def test_timed_run_feeds_distinct_batches_in_order(warmup, steps):
    """Warm-up steps take make_batches' first batches and timed step i takes batch warmup + i, up to 8 distinct
    batches cycled: one batch reused for every step, or a timed window replaying the warm-up's batches, passed."""
    spec = RunSpec("x", rows=2, seq=6, warmup=warmup, steps=steps, device="cpu")
    built = _Recording()
    timed_run(built, spec, torch.device("cpu"))
    want = make_batches(spec, built.vocab_size, min(warmup + steps, 8), "cpu")
    assert len(built.seen) == warmup + steps
    assert all(torch.equal(s, want[i % len(want)]) for i, s in enumerate(built.seen))


def test_the_clock_is_read_after_a_synchronize_at_both_ends(monkeypatch):
    """sync, clock, timed steps, sync, clock: without the second sync a GPU run's clock stops while kernels are still
    queued and tokens/s is inflated (on CPU only the order of the calls shows it)."""
    events = []
    built = _Built()
    real_fb = built.forward_backward
    built.forward_backward = lambda b: (events.append("step"), real_fb(b))[1]
    monkeypatch.setattr(protocol, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: (events.append("clock"), float(len(events)))[1])
    timed_run(built, RunSpec("x", rows=1, seq=3, warmup=1, steps=2, device="cpu"), torch.device("cpu"))
    assert events == ["step", "sync", "clock", "step", "step", "sync", "clock"]


def test_synchronize_and_peak_reset_use_the_rows_device(monkeypatch):
    """On cuda:1 the clock waits for cuda:1 (not the current device) and the memory peak is reset on cuda:1; on CPU
    neither is called. A check on str(device) == 'cuda' skipped cuda:N, so its peak counted the build's memory."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(("sync", a)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append(("reset", a)))
    dev = torch.device("cuda", 1)
    protocol.synchronize(dev)
    protocol.reset_peak_memory(dev)
    protocol.synchronize(torch.device("cpu"))
    protocol.reset_peak_memory(torch.device("cpu"))
    assert calls == [("sync", (dev,)), ("reset", (dev,))]


def test_each_grad_norm_is_one_steps_own():
    """The gradients are cleared after each optimizer step; without that every recorded norm was a running sum over
    the steps so far. _Built's loss is sum(p) over 2 elements: each step's gradient norm is sqrt(2)."""
    built = _Built()
    out = timed_run(built, RunSpec("x", rows=1, seq=3, warmup=2, steps=3, device="cpu"), torch.device("cpu"))
    assert out["grad_norms"] == pytest.approx([math.sqrt(2.0)] * 3)
    assert built.p.grad is None


def test_grad_norm_is_l2():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert float(grad_norm([a, b])) == pytest.approx(5.0)


@pytest.mark.parametrize("status", ["error", "not installed", "timeout", "crashed", "OOM"])
def test_validate_row_keeps_every_already_marked_row(status):
    row = {"contender": "x", "status": status, "reason": "why"}
    assert validate_row(dict(row)) == row
