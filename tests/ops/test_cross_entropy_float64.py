"""The reference loss head keeps float64 inputs in float64 (model.dtype=float64 runs), and fp32 for the rest."""

import pytest
import torch

from chronicals.ops.cross_entropy import cross_entropy_ref, linear_cross_entropy

IGNORE = -100


def exact_nll(z, labels):
    """float64 per-row loss of logits z (N, V), 0 where ignored."""
    valid = labels != IGNORE
    nll = -torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid, nll, torch.zeros_like(nll))


def inputs(n=37, h=24, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h ** -0.5 * 3  # logits of std ~3
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = IGNORE
    return x, w, labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_logits_give_a_float64_loss(reduction):
    x, w, labels = inputs()
    z = x @ w.T
    got = cross_entropy_ref(z, labels, ignore_index=IGNORE, reduction=reduction)
    rows = exact_nll(z, labels)
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / (labels != IGNORE).sum()}[reduction]
    assert got.dtype == torch.float64
    # fp32 rounding of the logits alone moves the loss by ~1e-7; float64 agrees to ~1e-15
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_float64_head_loss_and_gradients_stay_float64():
    """linear_cross_entropy on CPU (impl auto -> the reference twin): the loss and the gradient into the
    network are float64, as exact as float64 allows (fp32 would be off by ~1e-7 relative)."""
    x, w, labels = inputs(seed=1)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(xs, ws, labels, ignore_index=IGNORE, impl="auto")
    assert loss.dtype == torch.float64
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    rows = exact_nll(xe @ we.T, labels)
    want = rows.sum() / (labels != IGNORE).sum()
    dx_want, dw_want = torch.autograd.grad(want, (xe, we))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, dw_want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precisions_still_compute_the_loss_in_fp32(dtype):
    x, w, labels = inputs(seed=2)
    z = (x @ w.T).to(dtype)
    got = cross_entropy_ref(z, labels, ignore_index=IGNORE)
    assert got.dtype == torch.float32
    want = exact_nll(z.double(), labels).sum() / (labels != IGNORE).sum()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
