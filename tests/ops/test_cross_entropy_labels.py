"""Labels outside [0, V) that are not ignore_index: both impls give NaN for those rows (and for "mean"/"sum"),
read nothing out of bounds, and leave every other row's loss and all gradients equal to a float64 reference
computed with those rows ignored. Runs on CUDA or under TRITON_INTERPRET=1; ~3 s here.
"""

import pytest
import torch

from chronicals.ops import linear_cross_entropy
from chronicals.ops._impl import triton_interpreting
from chronicals.ops._linear_ce_kernels import lce_rows
from chronicals.ops.cross_entropy import linear_cross_entropy_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = DEV == "cuda" or triton_interpreting()
IGNORE = -100
N, H, V = 9, 17, 29
# label == V, a negative label != ignore_index, one far past V (an int32 pointer offset would wrap), ignored
BAD = {1: V, 4: -1, 6: 10 ** 6}


def inputs(bias: bool):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * H ** -0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = IGNORE
    clean = labels.clone()
    for i, lab in BAD.items():
        labels[i] = lab
        clean[i] = IGNORE
    return x, w, b, labels, clean


def exact_rows(x, w, b, labels, softcap):
    """float64 per-row loss, 0 where ignored (labels must be in range or IGNORE)."""
    z = x @ w.T + (0 if b is None else b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != IGNORE
    nll = -torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid, nll, torch.zeros_like(nll))


def impls():
    out = [("torch", {})]
    if HAS_TRITON:
        # default chunking; 4-row chunks; two vocabulary parts (the second pass reads labels with col0 > 0)
        out += [("triton", {}), ("triton", {"chunk_rows": 4}), ("triton", {"chunk_rows": 4, "vocab_parts": 2})]
    return out


def call(impl, kw, x, w, b, labels, reduction, softcap):
    if impl == "torch" or not kw:
        return linear_cross_entropy(x, w, labels, bias=b, ignore_index=IGNORE, reduction=reduction,
                                    softcap=softcap, impl=impl)
    return linear_cross_entropy_triton(x, w, labels, bias=b, ignore_index=IGNORE, reduction=reduction,
                                       softcap=softcap, **kw)


@pytest.mark.parametrize("impl,kw", impls(), ids=lambda p: str(p))
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("bias,softcap", [(False, None), (True, 5.0)])
def test_out_of_range_labels_give_nan_and_leave_other_rows_exact(impl, kw, reduction, bias, softcap):
    x64, w64, b64, labels, clean = inputs(bias)
    x, w = x64.float().to(DEV).requires_grad_(), w64.float().to(DEV).requires_grad_()
    b = None if b64 is None else b64.float().to(DEV).requires_grad_()
    loss = call(impl, kw, x, w, b, labels.to(DEV), reduction, softcap)

    # reference: float64, the bad rows ignored; "mean" still divides by every non-ignored label (bad ones too)
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    br = None if b64 is None else b64.clone().requires_grad_()
    ref_rows = exact_rows(xr, wr, br, clean, softcap)
    bad = torch.zeros(N, dtype=torch.bool)
    bad[list(BAD)] = True
    if reduction == "none":
        assert loss.shape == (N,)
        assert torch.isnan(loss.cpu()[bad]).all(), loss
        torch.testing.assert_close(loss.cpu()[~bad].double(), ref_rows[~bad], rtol=1e-5, atol=1e-5)
        g = torch.linspace(0.5, 1.5, N, dtype=torch.float64)  # nonzero on the bad rows too
        loss.backward(g.float().to(DEV))
        (ref_rows * g).sum().backward()
    else:
        assert torch.isnan(loss).item(), loss
        loss.backward()
        count = (labels != IGNORE).sum()
        (ref_rows.sum() / (count if reduction == "mean" else 1)).backward()
    for got, want in [(x.grad, xr.grad), (w.grad, wr.grad)] + ([(b.grad, br.grad)] if bias else []):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)
    assert (x.grad.cpu()[bad] == 0).all()  # a bad row contributes nothing, like an ignored one


@pytest.mark.skipif(not HAS_TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_ignored_rows_get_zero_lse_whichever_rows_share_their_program():
    """The forward's lse (and loss) is 0 on every ignored row, also where the row shares its program with valid rows
    (16 rows per program in the interpreter; on CUDA each row is its own program, so there only the all-ignored
    branch runs): the log-sum-exp computed for the block was stored on the ignored rows too, so their lse depended
    on the block layout. Valid rows get the logsumexp of their logits."""
    c, v = 5, 40
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(c, v, generator=g).to(DEV)
    labels = torch.tensor([3, IGNORE, 7, IGNORE, 1], device=DEV)
    loss, lse = (torch.full((c,), float("nan"), device=DEV) for _ in range(2))
    lce_rows(buf, labels, 0, None, torch.ones(1, device=DEV), loss, lse, ignore_index=IGNORE, softcap=None,
             compute_lse=True, write_grad=False)
    assert (lse[[1, 3]] == 0).all() and (loss[[1, 3]] == 0).all(), (lse, loss)
    torch.testing.assert_close(lse[[0, 2, 4]], torch.logsumexp(buf[[0, 2, 4]].double(), -1).float())


@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if HAS_TRITON else []))
def test_int32_labels_match_int64(impl):
    x64, w64, _, labels, clean = inputs(False)
    x, w = x64.float().to(DEV), w64.float().to(DEV)
    lab = clean.to(DEV)
    want = linear_cross_entropy(x, w, lab, reduction="none", impl=impl)
    got = linear_cross_entropy(x, w, lab.int(), reduction="none", impl=impl)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_reference_honours_ignore_index_and_gives_zero_when_all_are_ignored():
    """impl="torch" forwards a non-default ignore_index, as the fused path does; with every label ignored "mean" is
    0 with zero gradients, not 0/0 = NaN (the count clamp; a NaN stops a training run at its NaN check)."""
    from chronicals.ops import cross_entropy_ref

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    labels = torch.tensor([3, 7, 0, 7, 10])
    rows = linear_cross_entropy(x, w, labels, ignore_index=7, reduction="none", impl="torch")
    want = torch.nn.functional.cross_entropy(x @ w.T, labels, reduction="none")
    want[labels == 7] = 0
    torch.testing.assert_close(rows, want)
    torch.testing.assert_close(linear_cross_entropy(x, w, labels, ignore_index=7, impl="torch"), want.sum() / 3)
    x, w = x.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy(x, w, torch.full((5,), -100), impl="torch")
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(w.grad) == 0
    assert cross_entropy_ref(torch.randn(3, 5), torch.full((3,), 7), ignore_index=7).item() == 0.0


@pytest.mark.parametrize("reduction", ["avg", "Mean", None])
def test_cross_entropy_ref_refuses_an_unknown_reduction(reduction):
    """cross_entropy_ref is public (chronicals.ops): an unknown reduction is refused, not silently "mean"."""
    from chronicals.ops import cross_entropy_ref

    with pytest.raises(ValueError, match=r"reduction=.* is not one of \('mean', 'sum', 'none'\)"):
        cross_entropy_ref(torch.randn(3, 5), torch.tensor([0, 1, 2]), reduction=reduction)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_a_frozen_bias_asks_for_no_bias_gradient(monkeypatch):
    """A frozen bias (requires_grad False) asks the fused op for no bias gradient: no dbias accumulation, and a
    frozen head with a frozen bias keeps the one-pass row kernel (need_db is what forces two passes)."""
    from chronicals.ops import cross_entropy

    seen = []
    real = cross_entropy.linear_ce_chunked

    def spy(*a, **kw):
        seen.append((kw["need_dh"], kw["need_dw"], kw["need_db"]))
        return real(*a, **kw)

    monkeypatch.setattr(cross_entropy, "linear_ce_chunked", spy)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g).to(DEV).requires_grad_()
    w, b = torch.randn(29, 16, generator=g).to(DEV), torch.randn(29, generator=g).to(DEV)
    labels = torch.tensor([0, 3, -100, 28], device=DEV)
    linear_cross_entropy_triton(x, w, labels, bias=b).backward()
    assert seen == [(True, False, False)]
    ref = x.detach().clone().requires_grad_()
    cross_entropy.linear_cross_entropy_ref(ref, w, labels, bias=b).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if HAS_TRITON else []))
def test_the_public_op_passes_ignore_index_to_either_impl(impl):
    """ignore_index=3 through linear_cross_entropy: rows labelled 3 get no loss and count for no "mean", and rows
    labelled -100 (not ignored now) get a NaN, on both impls."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 16, generator=g).to(DEV), torch.randn(11, 16, generator=g).to(DEV)
    labels = torch.tensor([3, 7, 3, 0, 10], device=DEV)
    rows = torch.nn.functional.cross_entropy(x @ w.T, labels, reduction="none")
    per_row = linear_cross_entropy(x, w, labels, ignore_index=3, reduction="none", impl=impl)
    torch.testing.assert_close(per_row, torch.where(labels == 3, 0.0, rows))
    mean = linear_cross_entropy(x, w, labels, ignore_index=3, impl=impl)
    torch.testing.assert_close(mean, rows[labels != 3].mean())
    assert torch.isnan(linear_cross_entropy(x, w, torch.tensor([-100, 7, 3, 0, 10], device=DEV), ignore_index=3,
                                            reduction="none", impl=impl)[0])
