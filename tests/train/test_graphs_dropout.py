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
