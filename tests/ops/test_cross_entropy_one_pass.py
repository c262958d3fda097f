"""The loss head's one-pass row kernel (training forward of "mean" / "sum" without a weight gradient): w = exp(z -
target logit) written while it is summed, d_logits = rho[row] * w - gamma[row] * onehot(target). Checked against
the two-pass kernel and a float64 softmax on rows that take every branch: ordinary, confident (softmax of the
target near 1, where softmax - 1 cancels), a logit more than ONE_PASS_MAX_GAP above the target (the reference moves
up and the row's written tiles are rescaled), ignored, out of range, and a block with every row ignored. Runs on
CUDA, or on the CPU under TRITON_INTERPRET=1 (16 rows per program there).
"""

import math

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops import cross_entropy, linear_cross_entropy_ref
from chronicals.ops._impl import triton_interpreting
from chronicals.ops._linear_ce_kernels import ONE_PASS_MAX_GAP, lce_rows
from chronicals.ops.cross_entropy import linear_cross_entropy_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
IGNORE = -100


def chunk(c=53, v=1031, seed=0):
    """Raw logits (C, V) float64 and labels with one row of each kind (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(c, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (c,), generator=g)
    labels[3], labels[5], labels[33] = IGNORE, v + 3, IGNORE  # ignored, out of range, ignored in a later block
    z[1, labels[1]] += 30.0  # certain: 1 - softmax ~ 1e-11, below fp32's resolution at 1 (both kernels give 0)
    z[2, labels[2]] = 18.0  # confident: 1 - softmax ~ 1e-4
    # far above the target, in the last vocab tile (w = e^100 would overflow fp32): c moves up and the earlier tiles
    # are rescaled; row 20's in the middle, just past the gap
    labels[0], labels[20] = 0, 1
    z[0, v - 5] = z[0, 0] + 100.0
    z[20, v // 2] = z[20, 1] + ONE_PASS_MAX_GAP + 5
    labels[48:] = IGNORE  # the last program's rows (16 per program in the interpreter) are all ignored
    return z, labels


def d_logits64(z, labels, scale, softcap):
    """scale * d loss_row / d raw logit in float64; zero on ignored and out-of-range rows."""
    zc = z if softcap is None else softcap * torch.tanh(z / softcap)
    ok = (labels >= 0) & (labels < z.shape[1])
    d = torch.softmax(zc, -1)
    d[ok, labels[ok]] -= 1
    if softcap is not None:
        d *= 1 - torch.tanh(z / softcap) ** 2
    return torch.where(ok[:, None], d * scale, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,v", [(None, 1031), (None, 20000), (150.0, 20000)])
def test_one_pass_equals_two_passes(dtype, softcap, v):
    """V = 20,000: several vocab tiles (8,192 in the interpreter, 4,096 on CUDA), so a reference move rescales."""
    z, labels = chunk(v=v)
    c = z.shape[0]
    labels = labels.to(DEV)
    scale = torch.tensor([0.37], device=DEV)
    out = {}
    for name, one in (("two", False), ("one", True)):
        buf = z.to(dtype).to(DEV)
        loss, lse = torch.empty(c, device=DEV), torch.empty(c, device=DEV)
        rho, gamma = (torch.full((c,), float("nan"), device=DEV) if one else None for _ in range(2))
        lce_rows(buf, labels, 0, None, scale, loss, lse, ignore_index=IGNORE, softcap=softcap, compute_lse=True,
                 write_grad=True, rho=rho, gamma=gamma)
        d = buf.double()
        if one:
            d = rho.double()[:, None] * d
            ok = (labels >= 0) & (labels < z.shape[1])
            d[ok, labels[ok]] -= gamma.double()[ok]
            assert (gamma[~ok] == 0).all()
        out[name] = (loss.cpu(), lse.cpu(), d.cpu(), rho.cpu() if one else None)
    (loss2, lse2, d2, _), (loss1, lse1, d1, rho) = out["two"], out["one"]
    torch.testing.assert_close(loss1, loss2, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse1, lse2, rtol=1e-5, atol=1e-5)
    assert torch.isnan(loss1[5]) and loss1[3] == 0 and (loss1[48:] == 0).all()
    ref = d_logits64(z, labels.cpu(), 0.37, softcap)
    assert_tracks_torch("d_logits", d1, d2, ref, dtype=dtype)  # the two-pass kernel's error is the yardstick
    assert torch.isfinite(rho).all() and torch.isfinite(d1).all()
    # rho: 0 on rows without loss, scale * e^(c - lse) in (0, scale] on the others (lse >= c)
    assert rho[3] == 0 and rho[5] == 0 and rho[33] == 0 and (rho[48:] == 0).all()
    for i in set(range(48)) - {3, 5, 33}:
        assert 0 < rho[i] <= 0.37, i
    # the rows with a logit far above the target (0 and 20) moved their reference: every w is finite and <= e^40
    assert d1[[0, 20]].abs().max() <= 0.37 + 1e-6


def test_one_pass_keeps_the_confident_rows_gradient():
    """softmax - 1 of a target at probability ~ 1 - 1e-4: the one-pass kernel leaves w = 1 at the target (c is its
    logit) and the one-hot term to gamma, so rho * 1 - gamma is formed in fp32 by the consumer; rounding the
    probability to bf16 first would leave one bf16 ulp of 1 (2^-8), 40x the value."""
    z, labels = chunk()
    z[2] = z[2].to(torch.bfloat16).double()  # the reference sees the same bf16 logits
    buf = z.to(torch.bfloat16).to(DEV)
    c = z.shape[0]
    rho, gamma, loss, lse = (torch.empty(c, device=DEV) for _ in range(4))
    lce_rows(buf, labels.to(DEV), 0, None, torch.ones(1, device=DEV), loss, lse, ignore_index=IGNORE, softcap=None,
             compute_lse=True, write_grad=True, rho=rho, gamma=gamma)
    t = int(labels[2])
    assert float(buf[2, t]) == 1.0 and float(gamma[2]) == 1.0
    got = float(rho[2]) * float(buf[2, t]) - float(gamma[2])
    want = float(d_logits64(z, labels, 1.0, None)[2, t])
    assert -1e-3 < want < -1e-5 and abs(got - want) <= 0.02 * abs(want), (got, want)


def test_one_pass_moves_the_reference_for_any_gap_past_the_threshold():
    """A logit 76 above the target (between ONE_PASS_MAX_GAP and twice it; the chunk above only has gaps of 45 and
    100) moves c up: every w stays <= e^40, and with scale 1e-9 (the small end) rho * w - gamma * onehot is still
    scale * (softmax - onehot). A threshold of 2 x the gap let w reach e^76 and rho = scale * e^(c - lse) fall
    below fp32's normal range (denormal on the CPU, flushed to 0 on CUDA). Each claim is per row."""
    c, v, scale = 2, 64, 1e-9
    z = torch.zeros(c, v, dtype=torch.float64)
    labels = torch.tensor([3, 5])
    z[0, 40] = 1.9 * ONE_PASS_MAX_GAP  # 76: moves c
    z[1, 9] = ONE_PASS_MAX_GAP / 2  # 20: does not
    want = torch.softmax(z, -1) * scale
    want[torch.arange(c), labels] -= scale
    buf = z.float().to(DEV)
    rho, gamma, loss, lse = (torch.empty(c, device=DEV) for _ in range(4))
    lce_rows(buf, labels.to(DEV), 0, None, torch.tensor([scale], device=DEV), loss, lse, ignore_index=IGNORE,
             softcap=None, compute_lse=True, write_grad=True, rho=rho, gamma=gamma)
    assert (buf.amax(1) <= math.exp(ONE_PASS_MAX_GAP) * 1.0001).all(), buf.amax(1)
    d = rho.double().cpu()[:, None] * buf.double().cpu()
    d[torch.arange(c), labels] -= gamma.double().cpu()
    torch.testing.assert_close(d, want, rtol=1e-4, atol=1e-15)


def test_one_pass_rows_without_loss_write_zero_w_even_where_exp_overflows():
    """fp32 chunk, one-pass: an ignored row and an out-of-range row whose logits reach 200 (exp(200) is inf in fp32)
    get w = 0, rho = gamma = 0, not exp(z - 0): rho = 0 times an inf row of w @ W gave NaN d_hidden. The other
    rows keep their gradient. Per row: on CUDA (one row per program) the ignored row takes the all-ignored branch
    and the out-of-range row (not ignored, so the main branch) pins it; in the interpreter (16 rows per program)
    both share a program with valid rows."""
    g = torch.Generator().manual_seed(0)
    c, v = 4, 97
    z = torch.randn(c, v, generator=g, dtype=torch.float64)
    labels = torch.tensor([4, IGNORE, v + 3, 11])
    z[1, 5] = z[2, 6] = 200.0
    buf = z.float().to(DEV)
    rho, gamma, loss, lse = (torch.full((c,), float("nan"), device=DEV) for _ in range(4))
    lce_rows(buf, labels.to(DEV), 0, None, torch.ones(1, device=DEV), loss, lse, ignore_index=IGNORE,
             softcap=None, compute_lse=True, write_grad=True, rho=rho, gamma=gamma)
    buf, rho, gamma = buf.double().cpu(), rho.double().cpu(), gamma.double().cpu()
    assert (buf[[1, 2]] == 0).all() and (rho[[1, 2]] == 0).all() and (gamma[[1, 2]] == 0).all()
    d = rho[:, None] * buf
    d[[0, 3], labels[[0, 3]]] -= gamma[[0, 3]]
    assert torch.isfinite(d).all()
    torch.testing.assert_close(d, d_logits64(z, labels, 1.0, None), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [None, 16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_frozen_head_runs_one_pass_and_matches_the_reference(monkeypatch, reduction, chunk_rows):
    """bf16 head with a frozen weight (LoRA) and the kinds of rows above in the batch: the op takes the one-pass
    kernel and its loss and d_hidden track PyTorch's own bf16 error against float64. chunk_rows=16: the 53 rows in
    chunks 16, 16, 16, 5 (each chunk's rho, gamma and labels are read at its row offset; the default takes them in one
    chunk here, where the real head's 256 MB workspace holds ~880 rows of a 151,936 vocabulary)."""
    calls = []
    real = cross_entropy.lce_rows

    def spy(*a, **k):
        calls.append(k.get("rho") is not None)
        return real(*a, **k)

    monkeypatch.setattr(cross_entropy, "lce_rows", spy)
    g = torch.Generator().manual_seed(3)
    n, h, v = 53, 64, 1031
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h ** -0.5 * 2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3], labels[40:] = IGNORE, IGNORE
    w[labels[1]] = x[1] * 0.5  # a confident row (target logit ~ 0.5 |x|^2 = 32)
    w[(labels[0] + 7) % v] = x[0] * 1.5  # a logit ~ 96 above a ~0 target: its reference moves up
    xb = x.to(torch.bfloat16).to(DEV).requires_grad_()
    wb = w.to(torch.bfloat16).to(DEV)  # frozen
    labels = labels.to(DEV)
    grads = {}
    for name, fn in (("ours", lambda a: linear_cross_entropy_triton(a, wb, labels, ignore_index=IGNORE,
                                                                    reduction=reduction, chunk_rows=chunk_rows)),
                     ("torch", lambda a: linear_cross_entropy_ref(a, wb, labels, ignore_index=IGNORE,
                                                                  reduction=reduction)),
                     ("exact", lambda a: linear_cross_entropy_ref(a.double(), wb.double(), labels,
                                                                  ignore_index=IGNORE, reduction=reduction))):
        loss = fn(xb)
        grads[name] = [loss, *torch.autograd.grad(loss, [xb])]
    assert calls and all(calls), "the frozen head's training forward did not take the one-pass kernel"
    assert len(calls) == (1 if chunk_rows is None else -(-n // chunk_rows))
    for i, name in enumerate(("loss", "d_hidden")):
        assert_tracks_torch(name, grads["ours"][i], grads["torch"][i], grads["exact"][i], dtype=torch.bfloat16)


def test_one_pass_d_hidden_of_a_confident_bf16_row_is_formed_in_fp32():
    """bf16 frozen head, a row with target probability ~ 1 - 4e-4 whose logits are exact in bf16 (x is e_0): its
    d_hidden = sum_j p_j W_j - W_t is ~4e-4 |W|. The one-pass product w @ W must be accumulated and kept in fp32
    until dh_finish subtracts gamma * W_t: rounded to bf16 first (a bf16 accumulator, or a bf16 GEMM output), it
    carries one bf16 ulp of W_t (~2^-9 |W|), several times the value (relative error 0.075 against 0.007)."""
    g = torch.Generator().manual_seed(5)
    n, h, v, t = 3, 16, 300, 11
    w = torch.randn(v, h, generator=g).to(torch.bfloat16)
    w[t, 0] = 14.0
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    x[1] = 0
    x[1, 0] = 1.0
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = t
    dx = {}
    for name, fn, dt, dev in (("ours", linear_cross_entropy_triton, torch.bfloat16, DEV),
                              ("exact", linear_cross_entropy_ref, torch.float64, "cpu")):
        xs = x.to(dt).to(dev).requires_grad_()
        loss = fn(xs, w.to(dt).to(dev), labels.to(dev), ignore_index=IGNORE, reduction="sum")
        (dx[name],) = torch.autograd.grad(loss, [xs])
    err = ((dx["ours"][1].double().cpu() - dx["exact"][1]).abs().max() / dx["exact"][1].abs().max()).item()
    assert err < 0.03, err


@pytest.mark.parametrize("dtype,bias,reduction,frozen", [
    (torch.bfloat16, False, "mean", False), (torch.float16, False, "mean", True), (torch.bfloat16, True, "mean", True),
    (torch.bfloat16, False, "none", True)])
def test_two_passes_where_one_does_not_apply(monkeypatch, dtype, bias, reduction, frozen):
    """A weight gradient (rho would enter dW's contraction over rows), fp16 (w would overflow at e^11), a bias
    gradient (rho would enter the column sum) and "none" (its gradient is computed in backward from the stored lse,
    already one read and one write) keep two passes."""
    calls = []
    real = cross_entropy.lce_rows
    monkeypatch.setattr(cross_entropy, "lce_rows", lambda *a, **k: calls.append(k.get("rho")) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g).to(dtype).to(DEV).requires_grad_()
    w = (torch.randn(1000, 64, generator=g) * 0.25).to(dtype).to(DEV).requires_grad_(not frozen)
    b = torch.randn(1000, generator=g).to(dtype).to(DEV).requires_grad_() if bias else None
    labels = torch.randint(0, 1000, (9,), generator=g).to(DEV)
    loss = linear_cross_entropy_triton(x, w, labels, bias=b, reduction=reduction)
    loss.sum().backward()
    assert calls and all(r is None for r in calls)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dh_finish_is_the_formula_rounded_once(out_dtype):
    """dh_finish: out = rho * acc - gamma * W[label] per row, in fp32, rounded once to out's dtype; labels outside
    the vocabulary (gamma 0 there) read row 0, never past W. H = 1,100 runs two column blocks (1,024 + 76)."""
    from chronicals.ops._linear_ce_kernels import dh_finish

    g = torch.Generator().manual_seed(5)
    c, h, v, row0 = 7, 1100, 300, 2
    acc = torch.randn(c, h, generator=g).to(DEV)
    weight = torch.randn(v, h, generator=g).to(torch.bfloat16).to(DEV)
    labels = torch.randint(0, v, (row0 + c,), generator=g)
    labels[row0 + 1], labels[row0 + 4] = IGNORE, v + 9
    rho = torch.rand(row0 + c, generator=g).to(DEV)
    gamma = torch.rand(row0 + c, generator=g)
    gamma[row0 + 1] = gamma[row0 + 4] = 0
    gamma = gamma.to(DEV)
    out = torch.full((c, h), float("nan"), dtype=out_dtype, device=DEV)
    dh_finish(acc, weight, labels.to(DEV), row0, rho, gamma, out)
    lab = labels[row0:].clamp(0, v - 1).to(DEV)
    want = rho[row0:, None].double() * acc.double() - gamma[row0:, None].double() * weight[lab].double()
    # bf16: within one ulp (2^-7 relative at most) of the rounded formula; the interpreter's bf16 casts do not
    # always round to nearest
    tol = 1e-6 if out_dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.double(), want.to(out_dtype).double(), rtol=tol, atol=1e-6)


@pytest.mark.parametrize("misuse,match", [
    (dict(compute_lse=True, write_grad=False, col0=5, vocab=20), "needs the whole vocabulary"),
    (dict(compute_lse=False, write_grad=True, rho=0, gamma=0), "one-pass kernel needs"),
    (dict(compute_lse=True, write_grad=False, rho=0, gamma=0), "one-pass kernel needs"),
    (dict(compute_lse=False, write_grad=True, col0=5), "needs vocab="),
])
def test_lce_rows_refuses_misuse_before_the_kernel(misuse, match):
    """lce_rows' guards for its callers: the log-sum-exp over one vocabulary part (col0 > 0) ran silently over that
    part; rho/gamma without compute_lse and write_grad failed inside the kernel; a part without vocab= took its own
    width as the vocabulary (the wrong out-of-range rule), silently."""
    c = 3
    kw = dict(misuse, **{k: torch.empty(c, device=DEV) for k in ("rho", "gamma") if k in misuse})
    with pytest.raises(ValueError, match=match):
        lce_rows(torch.randn(c, 10, device=DEV), torch.tensor([0, 1, 2], device=DEV), 0, None,
                 torch.ones(1, device=DEV), torch.empty(c, device=DEV), torch.empty(c, device=DEV),
                 ignore_index=IGNORE, softcap=None, **kw)
