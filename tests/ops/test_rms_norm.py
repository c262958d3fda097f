"""RMSNorm Triton kernel vs a float64 reference, with PyTorch's own error in the same dtype as the yardstick; a
strided or expanded weight is read at its strides.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

from importlib import import_module

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops import rms_norm, rms_norm_ref
from chronicals.ops._impl import triton_interpreting

rms_mod = import_module("chronicals.ops.rms_norm")  # the package attribute of that name is the function

TRITON = torch.cuda.is_available() or triton_interpreting()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch"] + (["triton"] if TRITON else [])
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 7, 123]
HIDDEN = [64, 576, 896, 1000, 4864]


def _exact(x, w, r, eps=1e-6):
    """float64 all the way (rms_norm_ref itself upcasts to float32 only, so it is no fp64 reference)."""
    s = x if r is None else x + r
    y = w * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return y if r is None else (y, s)


def _run(fn, x, w, r, dy, ds):
    """Forward + backward; returns outputs then gradients of x, w (and residual)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    r = None if r is None else r.detach().requires_grad_()
    out = fn(x, w, r)
    if r is None:
        loss = (out.double() * dy).sum()
        outs = [out]
    else:
        loss = (out[0].double() * dy).sum() + (out[1].double() * ds).sum()
        outs = list(out)
    grads = torch.autograd.grad(loss, [t for t in (x, w, r) if t is not None])
    return outs + list(grads)


def _cases():
    """The full dtype x rows x hidden grid with the fused residual (the decoder's path; it checks y, s and all
    three gradients), except that 123 x 4864 (the slowest in the interpreter, ~8 s each) runs in bf16 only;
    without the residual, a thinner grid that still covers one-block, multi-row and looped rows."""
    for dtype in DTYPES:
        for rows in ROWS:
            for hidden in HIDDEN:
                if not (rows == 123 and hidden == 4864 and dtype != torch.bfloat16):
                    yield dtype, rows, hidden, True
                if (rows, hidden) in ((1, 64), (123, 1000), (7, 4864), (123, 576)):
                    yield dtype, rows, hidden, False


@pytest.mark.parametrize("dtype,rows,hidden,residual", list(_cases()),
                         ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, bool) else
                         ("residual" if v else "plain"))
def test_matches_reference(dtype, rows, hidden, residual):
    g = torch.Generator().manual_seed(rows * 10007 + hidden)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(dtype).to(DEV)
    r = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).to(DEV) if residual else None
    # upstream gradients representable in ``dtype``, so all three runs see the same values
    dy = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).double().to(DEV)
    ds = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).double().to(DEV)

    def ref(x_, w_, r_):
        return rms_norm_ref(x_, w_, 1e-6, r_)

    ref64 = _run(_exact, x.double(), w.double(), None if r is None else r.double(), dy, ds)
    theirs = _run(ref, x, w, r, dy, ds)
    ours = _run(lambda x_, w_, r_: rms_norm(x_, w_, 1e-6, residual=r_, impl="triton"), x, w, r, dy, ds)
    names = ["y", "s", "dx", "dweight", "dresidual"] if residual else ["y", "dx", "dweight"]
    for name, o, t, e in zip(names, ours, theirs, ref64):
        assert o.dtype == dtype and o.shape == e.shape, name
        assert_tracks_torch(name, o, t, e)


def test_leading_dims_and_strided_rows():
    """(B, S, H) inputs, and a row-strided view (a slice of a wider tensor), give the reference's answer."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(2, 5, 200, generator=g).to(DEV)
    x = big[..., :96]  # row stride 200, not contiguous
    w = torch.randn(96, generator=g).to(DEV)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, impl="triton"), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("hidden", [96, 2 * 1024 + 3])  # one block, and (interpreter) looped column blocks
def test_row_strided_upstream_gradients(hidden):
    """dy and ds may arrive row-strided (a LoRA group's dx is a column slice of its [dx | ...] GEMM output, which the
    norm's backward reads without a copy): the same dx, dweight and dresidual bits as from contiguous copies."""
    g = torch.Generator().manual_seed(hidden + 1)
    x, r = (torch.randn(7, hidden, generator=g).bfloat16().to(DEV) for _ in range(2))
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).bfloat16().to(DEV)
    dy_wide, ds_wide = (torch.randn(7, hidden + 5, generator=g).bfloat16().to(DEV) for _ in range(2))
    dy, ds = dy_wide[:, 2:hidden + 2], ds_wide[:, 1:hidden + 1]  # row stride hidden + 5

    def grads(dy_, ds_):
        xs, rs, ws = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
        y, s = rms_norm(xs, ws, 1e-6, residual=rs, impl="triton")
        torch.autograd.backward([y, s], [dy_, ds_])
        return xs.grad, ws.grad, rs.grad

    for a, b in zip(grads(dy, ds), grads(dy.contiguous(), ds.contiguous())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["row-strided x", "column-major dy"])
def test_strided_x_or_dy_without_residual_get_the_references_gradients(layout):
    """Without a residual the backward kernel reads the saved x and dy as contiguous (N, H) rows: the eager door saves
    x.contiguous() and lays dy out row-major. A column slice of a wider x (row stride 50 for H = 24) saved as it was,
    or a transposed (H, N) dy (as a y.t() consumer hands back) passed as it was, gave wrong dx and dweight."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 50, generator=g).to(DEV)
    w0 = (1 + 0.3 * torch.randn(24, generator=g)).to(DEV)
    dy = torch.randn(24, 6, generator=g).to(DEV).t()  # (6, 24), strides (1, 6)
    if layout == "row-strided x":
        dy = dy.contiguous()
    out = []
    for fn in (lambda x, w: rms_norm(x, w, 1e-6, impl="triton"), lambda x, w: rms_norm_ref(x, w, 1e-6)):
        b, w = big.clone().requires_grad_(), w0.clone().requires_grad_()
        x = b[:, 3:27] if layout == "row-strided x" else b[:, :24].contiguous()
        out.append(torch.autograd.grad(fn(x, w), [b, w], dy))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", [False, True])
def test_zero_rows_give_a_zero_weight_gradient_on_both_impls(residual):
    """An empty batch (0 rows) still reaches the weight: its gradient is zeros of weight's shape on both impls (the
    triton launcher's early return for 0 rows handed back None, so w.grad stayed None under triton only)."""
    grads = {}
    for impl in IMPLS:
        x = torch.randn(0, 8, device=DEV, requires_grad=True)
        w = torch.randn(8, device=DEV, requires_grad=True)
        r = torch.randn(0, 8, device=DEV, requires_grad=True) if residual else None
        out = rms_norm(x, w, 1e-6, residual=r, impl=impl)
        (sum(o.sum() for o in out) if residual else out.sum()).backward()
        grads[impl] = w.grad
    for impl, g in grads.items():
        assert g is not None and torch.equal(g, torch.zeros(8, device=DEV)), impl


def test_weight_promotion_like_reference():
    """bf16 activations with an fp32 weight: the reference returns fp32 (weight * y.to(bf16)); so do we."""
    x = torch.randn(3, 64, device=DEV).bfloat16()
    w = torch.randn(64, device=DEV)
    y = rms_norm(x, w, 1e-6, impl="triton")
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_rows_whose_squares_overflow_fp16_still_normalize(impl):
    """The mean of squares is taken in fp32 on both impls, as transformers does: 300^2 = 90,000 is past fp16's
    65,504, so squares taken in fp16 made the row's rsqrt 0 and y all zeros."""
    x = torch.full((2, 8), 300.0, device=DEV, dtype=torch.float16)
    y = rms_norm(x, torch.ones(8, device=DEV, dtype=torch.float16), 1e-6, impl=impl)
    assert torch.equal(y, torch.ones(2, 8, device=DEV, dtype=torch.float16))


def test_bad_inputs_say_what_is_wrong():
    x = torch.randn(3, 64, device=DEV)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(32, device=DEV), 1e-6, impl="triton")
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64, device=DEV), 1e-6, residual=x.double(), impl="triton")


def test_registered_op_passes_opcheck_and_compiles():
    """torch.library checks (schema, fake tensor, autograd registration) and a fullgraph compile."""
    x = torch.randn(5, 96, device=DEV, requires_grad=True)
    w = torch.randn(96, device=DEV, requires_grad=True)
    r = torch.randn(5, 96, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.chronicals.rms_norm.default, (x, w, r, 1e-6))
    torch.library.opcheck(torch.ops.chronicals.rms_norm.default, (x, w, None, 1e-6))

    def f(x_, w_, r_):
        y, s = rms_norm(x_, w_, 1e-6, residual=r_, impl="triton")
        return (y * 2 + s).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, w, r), [x, w, r])
    want = torch.autograd.grad(f(x, w, r), [x, w, r])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_registered_op_fake_promotes_y_like_the_kernel():
    """bf16 x with an fp32 weight: the fake that torch.compile plans with gives y in fp32, as the kernel does."""
    x = torch.randn(5, 96, device=DEV).bfloat16()
    w = torch.randn(96, device=DEV)
    for r in (None, torch.randn(5, 96, device=DEV).bfloat16()):
        torch.library.opcheck(torch.ops.chronicals.rms_norm.default, (x, w, r, 1e-6), test_utils=("test_faketensor",))


@pytest.mark.parametrize("impl", IMPLS)
def test_recompute_flag_offers_y_to_an_open_session(impl):
    """rms_norm(recompute=True) inside an ops.recompute session registers y to be rebuilt, and the rebuild equals y
    bit for bit; without the flag nothing is offered."""
    from chronicals.ops import recompute

    x = torch.randn(5, 24, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(24, device=DEV)
    with recompute.recompute_session():
        y = rms_norm(x, w, 1e-6, impl=impl, recompute=True)
        rebuild = recompute.rebuilder(y)
        assert rebuild is not None and torch.equal(rebuild(), y)
        assert recompute.rebuilder(rms_norm(x, w, 1e-6, impl=impl)) is None


def test_wide_rows_loop_over_blocks():
    """H above one block is looped over, never truncated (the block is MAX_BLOCK_H wide)."""
    h = 2 * rms_mod.MAX_BLOCK_H + 3
    x = torch.randn(3, h, device=DEV, dtype=torch.float64)
    w = torch.randn(h, device=DEV, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, impl="triton"), rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden", [96, 2 * 1024 + 3])  # one block, and (interpreter) looped column blocks
def test_eps_is_added_inside_the_rsqrt(hidden):
    """rstd = rsqrt(mean(x^2) + eps), in the one-block and the looped forward, for large eps and small x, and an
    all-zero row gives 0, not NaN. With the grid's eps = 1e-6 and |x| ~ 1, a dropped eps (or one added outside
    the rsqrt) moved y by ~1e-6 relative, inside the tolerance."""
    g = torch.Generator().manual_seed(hidden)
    x = 0.05 * torch.randn(3, hidden, generator=g)
    x[1] = 0.0
    x = x.to(DEV)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(DEV)
    for eps in (1e-2, 0.5):
        y = rms_norm(x, w, eps, impl="triton")
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, rms_norm_ref(x, w, eps), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [96, 2 * 1024 + 3])
def test_residual_output_normalizes_the_stored_stream(hidden, dtype):
    """With a residual, y normalizes the stream s as stored (x + r rounded to x's dtype), like the reference: y
    equals s * rstd * w bit for bit as the apply kernel rebuilds it from the saved rstd. Normalizing the unrounded fp32 sum
    moved some outputs by an ulp, which the reference grid's tolerance let through (only the recompute apply
    kernel's bit check noticed). Not compared with rms_norm(s): on CUDA the residual and plain kernels are tuned
    apart (HAS_RESIDUAL is in the key), and another warp count sums x^2 in another order (an H100 picked two
    that moved rstd, and so y, by an ulp at H = 2051 fp16)."""
    g = torch.Generator().manual_seed(hidden + 7)
    x, r = (torch.randn(5, hidden, generator=g).to(dtype).to(DEV) for _ in range(2))
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    y, s, rstd = rms_mod.rms_norm_forward(x, w, r, 1e-6)
    assert torch.equal(y, rms_mod.rms_norm_apply(s, rstd, w, dtype))  # not torch's cast: the interpreter's truncates
    y_op, s_op = rms_norm(x, w, 1e-6, residual=r, impl="triton")  # the public op launches the same kernel
    assert torch.equal(y_op, y) and torch.equal(s_op, s)


def _graph_targets(fn, *args):
    """The call targets of the graph Dynamo captures for ``fn`` (fullgraph), to see which door it took."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets


def test_eager_door_and_compiled_door_agree():
    """Eager calls take RMSNormFunction (no custom-op dispatch); torch.compile sees chronicals::rms_norm as
    one node; both give the custom op's own outputs and gradients, with and without the residual (and
    with the stream s as the only output used, so dy is absent)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 160, generator=g).to(DEV).requires_grad_()
    w = torch.randn(160, generator=g).to(DEV).requires_grad_()
    r = torch.randn(6, 2, 160, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(6, 2, 160, generator=g).to(DEV)

    y, s = rms_norm(x, w, 1e-6, residual=r, impl="triton")
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "RMSNormFunctionBackward"  # under the (B, S) view
    got = torch.autograd.grad((y * dy).sum() + (s * s).sum(), [x, w, r])
    yo, so, _ = torch.ops.chronicals.rms_norm(x.view(-1, 160), w, r.view(-1, 160), 1e-6)
    want = torch.autograd.grad((yo.view_as(x) * dy).sum() + (so * so).sum(), [x, w, r])
    torch.testing.assert_close(y, yo.view_as(x), rtol=0, atol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    (dr_only,) = torch.autograd.grad(rms_norm(x, w, 1e-6, residual=r, impl="triton")[1].sum(), [r])
    torch.testing.assert_close(dr_only, torch.ones_like(r))

    def f(x_, w_):
        return (rms_norm(x_, w_, 1e-6, impl="triton") * dy).sum()

    targets = [t.removesuffix(".default") for t in _graph_targets(f, x, w)]
    assert "chronicals.rms_norm" in targets and not any("autograd_function" in t for t in targets), targets
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for a, b in zip(torch.autograd.grad(compiled(x, w), [x, w]), torch.autograd.grad(f(x, w), [x, w])):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("hidden", [96, 2 * 1024 + 3])  # one block, and (interpreter) looped column blocks
def test_frozen_weight_gets_no_gradient_and_the_same_dx(hidden, monkeypatch):
    """A weight that needs no gradient (LoRA freezes the norms) gets none: the kernel skips its dW partials
    and their sum; dx and dresidual are bit-identical to the run that computes dW."""
    g = torch.Generator().manual_seed(hidden)
    x, r, dy, ds = (torch.randn(37, hidden, generator=g).bfloat16().to(DEV) for _ in range(4))
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).bfloat16().to(DEV)

    def grads(train_w):
        xs, rs, ws = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_(train_w)
        y, s = rms_norm(xs, ws, 1e-6, residual=rs, impl="triton")
        torch.autograd.backward([y, s], [dy, ds])
        return xs.grad, rs.grad, ws.grad

    dx_full, dr_full, dw_full = grads(True)
    sums = []
    monkeypatch.setattr(rms_mod, "_rms_norm_bwd_kernel", _Spy(rms_mod._rms_norm_bwd_kernel, sums))
    dx, dr, dw = grads(False)
    assert dw is None and dw_full is not None
    assert sums == [False]  # one launch, with HAS_DW off
    if _tuned_warps(hidden) <= 1:
        assert torch.equal(dx, dx_full) and torch.equal(dr, dr_full)
    else:  # CUDA tuned HAS_DW on and off to other warp counts: x-hat . w dy summed in another order
        for a, b in ((dx, dx_full), (dr, dr_full)):
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-6)  # one bf16 ulp


def _tuned_warps(hidden):
    """How many warp counts the backward kernel's autotuner chose across its keys for this H: 0 or 1 means every
    launch summed rows in one order (the interpreter and CHRONICALS_AUTOTUNE=first tune nothing, so 0)."""
    cache = getattr(rms_mod._rms_norm_bwd_kernel, "cache", {})
    return len({cfg.num_warps for key, cfg in cache.items() if key[0] == hidden})


class _Spy:
    """Records the HAS_DW flag of each launch of the wrapped Triton kernel."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.seen.append(kw["HAS_DW"])
            return launch(*args, **kw)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


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


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("hidden", [96, 2 * 1024 + 3])  # one block, and (interpreter) looped column blocks
def test_grad_spare_writes_dx_into_the_first_columns_of_a_wider_buffer(hidden, residual):
    """grad_spare=R: the backward kernel writes dx into a new (N, H + R) buffer (row stride H + R) that
    ``grad_spare_columns`` hands to x's producer (a LoRA down_proj writes s dy B there): same dx bits as without."""
    if not TRITON:
        pytest.skip("the Triton kernel's backward")
    g = torch.Generator().manual_seed(hidden)
    x, r, dy, ds = (torch.randn(7, hidden, generator=g).bfloat16().to(DEV) for _ in range(4))
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).bfloat16().to(DEV)

    def grads(spare):
        xs = x.clone().requires_grad_()
        seen = []
        x1 = xs * 1  # a non-leaf: its hook sees the norm's dx itself (a leaf's .grad is a contiguous copy)
        x1.register_hook(seen.append)
        out = rms_norm(x1, w, 1e-6, residual=r if residual else None, impl="triton", grad_spare=spare)
        if residual:
            torch.autograd.backward(list(out), [dy, ds])
        else:
            out.backward(dy)
        return xs.grad, seen[0]

    base, dx0 = grads(0)
    got, dx = grads(5)
    assert torch.equal(base, got)
    full = rms_mod.grad_spare_columns(dx, hidden + 5)
    assert full is not None and full.shape == (7, hidden + 5) and torch.equal(full[:, :hidden], dx)
    assert dx.stride() == (hidden + 5, 1) and dx0.is_contiguous()
    assert rms_mod.grad_spare_columns(dx, hidden + 4) is None  # another width: not this buffer
    assert rms_mod.grad_spare_columns(dx0, hidden + 5) is None  # no spare asked: a plain tensor
    assert rms_mod.grad_spare_columns(full[1:, :hidden], hidden + 5) is None  # not the buffer's own rows
    plain = torch.zeros(7, hidden + 5, dtype=torch.bfloat16, device=DEV)
    assert rms_mod.grad_spare_columns(plain[:, :hidden], hidden + 5) is None  # a strided view of an unmarked tensor


def test_grad_spare_is_checked_and_the_torch_impl_makes_its_own_dx():
    x = torch.randn(3, 16, device=DEV, requires_grad=True)
    w = torch.ones(16, device=DEV)
    with pytest.raises(ValueError, match="grad_spare=-1 must be an int >= 0"):
        rms_norm(x, w, 1e-6, grad_spare=-1)
    seen = []
    x1 = x * 1
    x1.register_hook(seen.append)
    rms_norm(x1, w, 1e-6, impl="torch", grad_spare=4).sum().backward()
    assert rms_mod.grad_spare_columns(seen[0], 20) is None
