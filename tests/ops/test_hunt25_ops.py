"""Fixes from session 25's ops hunt: a strided norm weight, an input changed in place before recomputation,
transposed input under the reference's recomputation, H = 0, and packed documents that cross a row."""

import pytest
import torch

from chronicals.ops import attention, linear_cross_entropy, recompute, rms_norm
from chronicals.ops._impl import triton_interpreting

TRITON = torch.cuda.is_available() or triton_interpreting()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch"] + (["triton"] if TRITON else [])


def _norm64(x, w, eps):
    x64, w64 = x.double(), w.double()
    return w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weight", ["strided", "expanded"])
def test_rms_norm_reads_a_strided_weight(impl, weight):
    """The kernels read weight at unit stride: every other element of a (2H,) tensor, or one value expanded to
    (H,), gave outputs 2.5-12.8 off and a wrong dx."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=g).to(DEV).requires_grad_()
    base = torch.randn(48, generator=g).to(DEV).requires_grad_()
    w = base[::2] if weight == "strided" else base[:1].expand(24)
    y = rms_norm(x, w, 1e-6, impl=impl)
    dy = torch.randn(5, 24, generator=g).to(DEV)
    (y * dy).sum().backward()
    x64 = x.detach().double().requires_grad_()
    b64 = base.detach().double().requires_grad_()
    w64 = b64[::2] if weight == "strided" else b64[:1].expand(24)
    (_norm64(x64, w64, 1e-6) * dy.double()).sum().backward()
    torch.testing.assert_close(y.double(), _norm64(x64, w64, 1e-6).detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(base.grad.double(), b64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_input_changed_in_place_before_the_rebuild_raises(impl):
    """The recipe held x; changing x in place after the forward rebuilt a different y, and W's gradient came out
    off by 5-8 without a word. Autograd raises for a saved tensor changed in place; so does the rebuild."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=g).to(DEV)
    w = torch.randn(16, generator=g).to(DEV).requires_grad_()
    W = torch.randn(16, 8, generator=g).to(DEV).requires_grad_()
    with recompute.recompute_session():
        z = (rms_norm(x, w, 1e-6, impl=impl, recompute=True) @ W).sum()
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the forward"):
        z.backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_recompute_of_a_transposed_input_gives_the_same_gradients(impl):
    """The reference kept a transposed x's strides in y, which recompute.offer refused (a ValueError about
    offer, from rms_norm)."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(16, 6, generator=g).to(DEV)
    w = torch.randn(16, generator=g).to(DEV).requires_grad_()
    W = torch.randn(16, 8, generator=g).to(DEV).requires_grad_()
    grads = []
    for on in (False, True):
        w.grad = W.grad = None
        x = x0.t().requires_grad_()
        with recompute.recompute_session(on):
            (rms_norm(x, w, 1e-6, impl=impl, recompute=on) @ W).square().sum().backward()
        grads.append([x.grad.clone(), w.grad.clone(), W.grad.clone()])
    for a, b in zip(*grads):  # close, not equal: the GEMM reads y transposed in one run and contiguous in the other
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_hidden_size_is_a_clear_error(impl):
    with pytest.raises(ValueError, match=r"H >= 1"):
        rms_norm(torch.randn(3, 0, device=DEV), torch.randn(0, device=DEV), 1e-6, impl=impl)
    with pytest.raises(ValueError, match=r"H >= 1"):
        linear_cross_entropy(torch.randn(3, 0, device=DEV), torch.randn(7, 0, device=DEV),
                             torch.zeros(3, dtype=torch.long, device=DEV), impl=impl)


def test_the_reference_refuses_a_document_across_rows():
    """The CUDA kernels read the B rows as one stream, the reference masks each row: a document that ran past a
    row's end got two answers (3.3 apart on an H200). The collator never builds one; the reference refuses it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match=r"document 0 \(tokens 0\.\.7 of cu_seqlens\) runs across a row boundary"):
        attention(q, k, v, cu_seqlens=torch.tensor([0, 8, 12], dtype=torch.int32), impl="torch")
    inside = attention(q, k, v, cu_seqlens=torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32), impl="torch")
    assert inside.shape == q.shape and torch.isfinite(inside).all()
