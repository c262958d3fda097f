"""The loss head on the loss rows only (``num_loss_tokens``): same loss and gradients as on every row."""

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.decoder import IGNORE_INDEX, loss_rows
from chronicals.ops._impl import triton_interpreting

TRITON = torch.cuda.is_available() or triton_interpreting()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(vocab_size=89, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)


def _batch(ignored_share: float):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 17), generator=g)
    targets = torch.randint(0, TINY["vocab_size"], (2, 17), generator=g)
    targets[torch.rand(2, 17, generator=g) < ignored_share] = IGNORE_INDEX  # prompt-like masked rows
    return ids.to(DEV), targets.to(DEV), int((targets != IGNORE_INDEX).sum())


def _loss_and_grads(model, ids, targets, count, reduction):
    model.zero_grad(set_to_none=True)
    loss = model(ids, shift_labels=targets, reduction=reduction, num_loss_tokens=count)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if TRITON else []))
def test_same_loss_and_gradients_as_all_rows(impl, reduction):
    cfg = ModelConfig.from_hf_dict(transformers.Qwen2Config(**TINY).to_dict())
    model = CausalLM(cfg, impl=impl).init_weights(std=0.1, seed=0).to(DEV)
    ids, targets, count = _batch(0.6)
    assert 0 < count < 0.9 * targets.numel()  # the compacted path runs
    ref_loss, ref = _loss_and_grads(model, ids, targets, None, reduction)
    loss, got = _loss_and_grads(model, ids, targets, count, reduction)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_rows_in_order_and_identity_below_threshold():
    h = torch.arange(10.0).repeat_interleave(3).view(10, 3)
    y = torch.tensor([IGNORE_INDEX, 4, IGNORE_INDEX, 7, 1, IGNORE_INDEX, IGNORE_INDEX, 2, IGNORE_INDEX, 5])
    h2, y2 = loss_rows(h, y, 5)
    assert y2.tolist() == [4, 7, 1, 2, 5] and h2[:, 0].tolist() == [1, 3, 4, 7, 9]
    h = torch.randn(20, 3)
    y_dense = torch.arange(20)
    y_dense[0] = IGNORE_INDEX  # 1 of 20 ignored: below COMPACT_MIN_IGNORED (10%), nothing moves
    h3, y3 = loss_rows(h, y_dense, 19)
    assert h3 is h and y3 is y_dense
    assert loss_rows(h, y, None)[0] is h
    y_none = torch.full((20,), IGNORE_INDEX)  # a data-parallel rank's empty batch: the head keeps its rows
    h4, y4 = loss_rows(h, y_none, 0)
    assert h4 is h and y4 is y_none
    y_all = torch.arange(20)  # no target ignored: count == n, the closed range's end, and nothing moves
    h5, y5 = loss_rows(h, y_all, 20)
    assert h5 is h and y5 is y_all


def test_per_token_losses_keep_their_shape_with_a_loss_token_count():
    """reduction="none" with num_loss_tokens gives the (B, S) per-token losses, as without the count, 0 where
    ignored: the loss-row compaction is for "mean" / "sum" only (compacted, the n values could not take the
    (B, S) view, and a per-token eval forwarding the collator's count failed)."""
    cfg = ModelConfig.from_hf_dict(transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 1}).to_dict())
    model = CausalLM(cfg, impl="torch").init_weights(std=0.1, seed=0).to(DEV).eval()
    ids, targets, count = _batch(0.6)
    assert 0 < count < 0.9 * targets.numel()  # compaction would run
    with torch.no_grad():
        ref = model(ids, shift_labels=targets, reduction="none")
        got = model(ids, shift_labels=targets, reduction="none", num_loss_tokens=count)
    assert got.shape == targets.shape
    torch.testing.assert_close(got, ref)
    assert torch.all(got[targets == IGNORE_INDEX] == 0)


def test_wrong_count_is_caught_and_all_ignored_gives_zero():
    h = torch.randn(8, 3)
    y = torch.full((8,), IGNORE_INDEX)
    y[2] = 1
    with pytest.raises(RuntimeError, match="num_loss_tokens differs"):
        loss_rows(h, y, 3)
    with pytest.raises(ValueError, match="outside"):
        loss_rows(h, y, 9)
    cfg = ModelConfig.from_hf_dict(transformers.Qwen2Config(**TINY).to_dict())
    model = CausalLM(cfg, impl="torch").init_weights(std=0.1, seed=0)
    ids = torch.randint(0, TINY["vocab_size"], (1, 6))
    none = torch.full((1, 6), IGNORE_INDEX)
    loss = model(ids, shift_labels=none, reduction="mean", num_loss_tokens=0)
    loss.backward()
    assert loss.item() == 0.0 and all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())
