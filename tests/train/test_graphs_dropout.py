"""LoRA dropout on CUDA (bf16, Triton ops): grouped and ungrouped adapters train alike, and a replayed CUDA graph
draws new masks at every replay (a graph that froze its masks would train one fixed sub-network).

GPU only; written in session 19 without a GPU (run them on the GPU machine: ``pytest tests/train/test_graphs_dropout.py``).
"""

from __future__ import annotations

import pytest
import torch

from chronicals.bench.contenders import build_chronicals_model, rows_as_packed_batch
from chronicals.bench.shapes import get_shape
from chronicals.lora import apply_lora
from chronicals.train.graphs import GraphedStep
from chronicals.train.step import accumulate_gradients

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton path need a GPU")
DEV = torch.device("cuda")


def _model(group: bool, dropout: float = 0.1, recompute=None):
    model = build_chronicals_model(get_shape("tiny"), DEV, "auto", seed=0).to(torch.bfloat16)
    if recompute is not None:
        model.set_recompute(recompute)
    apply_lora(model, r=4, alpha=8, dropout=dropout, group=group)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 would make every mask invisible in the loss
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


def _batch(layout: str = "rows"):
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    return rows_as_packed_batch(ids, layout)


@cuda
@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("recompute", [None, ("norm", "swiglu", "gate_up")])
def test_grouped_and_ungrouped_dropout_agree_on_cuda(layout, recompute):
    out = []
    for group in (True, False):
        model = _model(group, recompute=recompute)
        torch.manual_seed(5)
        loss, _ = accumulate_gradients(model, [_batch(layout)], DEV)
        out.append((loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()
                                          if p.grad is not None}))
    (la, ga), (lb, gb) = out
    assert la == pytest.approx(lb, rel=2e-3)
    for n in ga:  # bf16 GEMMs summed in other blocks: a few bf16 ulps apart, not a different mask (~100%)
        assert ((ga[n] - gb[n]).norm() / gb[n].norm()).item() < 0.05, n


@cuda
@pytest.mark.parametrize("group", [True, False])
def test_replayed_graphs_draw_new_masks(group):
    """The same batch, no optimizer step: every call's loss differs (new masks), graphed as eager."""
    batch = _batch()
    model = _model(group)
    graphs = GraphedStep(model, DEV)
    losses = []
    for _ in range(8):  # 3 eager warm-up calls, a capture, then replays
        loss, _ = accumulate_gradients(model, [batch], DEV, graphs)
        losses.append(loss.float().item())
        for p in model.parameters():
            p.grad = None
    assert graphs.captured()
    replays = losses[4:]
    assert len(set(replays)) == len(replays), losses
    frozen = _model(group, dropout=0.0)
    same = [accumulate_gradients(frozen, [batch], DEV)[0].float().item() for _ in range(2)]
    assert same[0] == same[1]  # without dropout the loss repeats: the differences above are the masks


def _lora_grads(model) -> dict:
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@cuda
@pytest.mark.parametrize("group", [True, False])
def test_first_graphed_step_draws_the_masks_an_eager_step_draws(group):
    """The capture's warm-up runs draw seeds too; they must not shift the stream. After ``manual_seed``, the first
    graphed step (warm-up, capture, replay) and an eager step draw the same masks: the same loss and gradients to a
    few bf16 ulps, where other masks move the LoRA gradients by tens of percent."""
    batch = _batch()
    model = _model(group)
    torch.manual_seed(5)
    want, _ = accumulate_gradients(model, [batch], DEV)
    eager = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    other, _ = accumulate_gradients(model, [batch], DEV)  # the next masks: the yardstick for "different"
    moved = _lora_grads(model)
    model.zero_grad(set_to_none=True)

    graphs = GraphedStep(model, DEV)
    torch.manual_seed(5)
    got, _ = accumulate_gradients(model, [batch], DEV, graphs)
    assert graphs.captured()  # the loss came from a replay
    graphed = _lora_grads(model)
    assert got.float().item() == pytest.approx(want.float().item(), rel=1e-3)
    for n in eager:
        err = ((graphed[n] - eager[n]).norm() / eager[n].norm()).item()
        apart = ((moved[n] - eager[n]).norm() / eager[n].norm()).item()
        assert err < 0.02 and apart > 0.1, (n, err, apart, other.item())


@cuda
def test_graphed_run_with_lora_dropout_resumes_like_a_straight_one(tmp_path):
    """train.cuda_graphs with LoRA dropout, stopped after step 3 and resumed: the resumed process captures its graphs
    after restoring the checkpoint's generator, the straight one captured before step 1. Same losses and adapters."""
    import json
    import os
    import signal

    from train_helpers import SyntheticLoader, synthetic_docs, tiny_config

    from chronicals.train import train

    def sigterm_at(k):
        def on_step(step, rec):
            if step == k:
                os.kill(os.getpid(), signal.SIGTERM)
        return on_step

    docs = synthetic_docs(48, seed=2)
    over = dict(model__device="cuda", model__dtype="bfloat16", model__impl="auto", lora__enabled=True, lora__rank=4,
                lora__alpha=8, lora__dropout=0.2, train__max_steps=6, train__grad_accum=2, train__cuda_graphs=True,
                optim__fused=False)

    def run(name, **kw):
        cfg = tiny_config(tmp_path / name, train__resume="auto", **over)
        model = build_chronicals_model(get_shape("tiny"), DEV, "auto", seed=0)
        res = train(cfg, model=model, train_loader=SyntheticLoader(docs, shuffle=False), **kw)
        lines = (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
        return res, model, [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]

    _, straight, want = run("a")
    stopped, _, _ = run("b", on_step=sigterm_at(3))
    assert (stopped.status, stopped.step) == ("interrupted", 3)
    torch.manual_seed(999)  # the generator at restart must not matter: the checkpoint's is restored
    done, resumed, got = run("b")
    assert done.step == 6 and len(got) == len(want) == 6
    assert got == pytest.approx(want, rel=1e-4)
    ends = dict(resumed.named_parameters())
    for n, p in straight.named_parameters():
        if "lora_" in n:  # other masks from step 4 on leave B ~10-30% elsewhere
            err = ((ends[n].float() - p.float()).norm() / p.float().norm()).item()
            assert err < 1e-2, (n, err)
