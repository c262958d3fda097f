"""swiglu_gate_up (packed [gate | up] input) vs a float64 reference, vs swiglu on the halves (bit for bit),
and its two doors (eager autograd.Function, chronicals::swiglu_gate_up under torch.compile).

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it); the "torch" impl always runs.
"""

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops._impl import triton_interpreting
from chronicals.ops.swiglu import (swiglu, swiglu_gate_up, swiglu_gate_up_backward, swiglu_gate_up_backward_,
                                   swiglu_gate_up_ref, swiglu_ref)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_TRITON = DEV == "cuda" or triton_interpreting()
needs_triton = pytest.mark.skipif(not HAVE_TRITON,
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
IMPLS = [pytest.param("triton", marks=needs_triton), "torch"]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(lead, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate = 3 * torch.randn(*lead, i, generator=g, dtype=torch.float64)  # |gate| ~ 10: sigmoid's tails
    up = torch.randn(*lead, i, generator=g, dtype=torch.float64)
    dy = torch.randn(*lead, i, generator=g, dtype=torch.float64).to(dtype).double()
    return torch.cat([gate, up], -1).to(dtype).to(DEV), dy.to(DEV)


def _run(fn, gu, dy):
    gu = gu.detach().requires_grad_()
    y = fn(gu)
    (dgu,) = torch.autograd.grad((y.double() * dy).sum(), gu)
    return y, dgu


# I = 1031: past one column tile (BLOCK_C = 1024 in the interpreter; I = 4864 at the 0.5B shape takes 5), masked tail
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("i", [5, 96, 130, 1031])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, rows, i, impl):
    gu, dy = _inputs((rows,), i, dtype, seed=rows * 7919 + i)
    ref64 = _run(lambda t: swiglu_ref(*t.chunk(2, -1)), gu.double(), dy)
    theirs = _run(lambda t: swiglu_ref(*t.chunk(2, -1)), gu, dy)  # PyTorch in the same dtype
    ours = _run(lambda t: swiglu_gate_up(t, impl=impl), gu, dy)
    for name, o, t, e in zip(["y", "d_gu"], ours, theirs, ref64):
        assert o.dtype == dtype and o.shape == e.shape and o.is_contiguous(), name
        assert_tracks_torch(name, o, t, e)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bit_identical_to_swiglu_on_halves(dtype):
    """Same fp32 math as swiglu (shared @triton.jit helpers): equal bits, forward and both gradient halves."""
    gu, dy = _inputs((3, 7), 130, dtype, seed=11)
    dy = dy.to(dtype)
    gate, up = (t.contiguous().requires_grad_() for t in gu.chunk(2, -1))
    y_ref = swiglu(gate, up, impl="triton")
    dgate, dup = torch.autograd.grad(y_ref, [gate, up], dy)
    gu = gu.requires_grad_()
    y = swiglu_gate_up(gu, impl="triton")
    (dgu,) = torch.autograd.grad(y, gu, dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(dgu, torch.cat([dgate, dup], -1))


@needs_triton
def test_row_strided_input_and_one_gradient_node():
    """gu may be a row-strided view (a slice of a wider tensor); the backward hands the whole d_gu to the
    input's grad_fn from one node (no per-half slice backward)."""
    wide = torch.randn(4, 5, 2 * 40 + 3, device=DEV, requires_grad=True)
    gu = wide[..., 3:]  # (4, 5, 80), row stride 83
    y = swiglu_gate_up(gu, impl="triton")
    assert type(y.grad_fn).__name__ == "SwiGLUGateUpFunctionBackward"
    torch.testing.assert_close(y, swiglu_gate_up_ref(gu.detach()))
    dy = torch.randn_like(y)
    (g_ours,) = torch.autograd.grad(y, wide, dy)
    (g_ref,) = torch.autograd.grad(swiglu_gate_up_ref(gu), wide, dy)
    torch.testing.assert_close(g_ours, g_ref)


@needs_triton
def test_a_column_major_dy_gives_the_references_d_gu():
    """dy (N, I) that is a transposed (I, N) tensor (column stride N) is laid out at unit column stride before the
    backward kernel, which reads dy's columns contiguously; passed with its strides, d_gu was garbage."""
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(6, 2 * 20, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(20, 6, generator=g).to(DEV).t()  # (6, 20), strides (1, 6)
    (ours,) = torch.autograd.grad(swiglu_gate_up(gu, impl="triton"), gu, dy)
    (ref,) = torch.autograd.grad(swiglu_gate_up_ref(gu), gu, dy)
    torch.testing.assert_close(ours, ref)


@needs_triton
def test_a_row_strided_dy_gives_the_references_d_gu():
    """dy may arrive row-strided: when y feeds torch.cat, cat's backward hands y a column slice of the upstream
    gradient (row stride 49 here). The backward kernel reads dy at its own row stride; read at I, d_gu was
    garbage (every other dy in these tests is contiguous)."""
    g = torch.Generator().manual_seed(0)
    gu0 = torch.randn(6, 2 * 40, generator=g, dtype=torch.float64).to(DEV)
    other = torch.randn(6, 9, generator=g, dtype=torch.float64).to(DEV)
    up = torch.randn(6, 49, generator=g, dtype=torch.float64).to(DEV)
    grads = []
    for fn in (lambda t: swiglu_gate_up(t, impl="triton"), swiglu_gate_up_ref):
        gu = gu0.clone().requires_grad_()
        (d_gu,) = torch.autograd.grad(torch.cat([fn(gu), other], dim=-1), [gu], up)
        grads.append(d_gu)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)  # the kernel computes in fp32


@needs_triton
@pytest.mark.parametrize("i", [5, 130, 1031])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_backward_writes_the_same_bits_over_its_inputs(dtype, rows, i):
    """swiglu_gate_up_backward_ (the decoder MLP's default backward): d_gu over gu and act over dy, bit for bit the
    out-of-place kernel's outputs with act, which track the float64 reference (and act is the forward's bits)."""
    gu, dy = _inputs((rows,), i, dtype, seed=rows * 31 + i)
    ref64 = _run(lambda t: swiglu_ref(*t.chunk(2, -1)), gu.double(), dy)
    theirs = _run(lambda t: swiglu_ref(*t.chunk(2, -1)), gu, dy)  # PyTorch in the same dtype
    dy = dy.to(dtype)
    act = torch.empty_like(dy)
    dgu = swiglu_gate_up_backward(dy, gu, act)
    assert_tracks_torch("d_gu", dgu, theirs[1], ref64[1])
    assert_tracks_torch("act", act, theirs[0], ref64[0])
    assert torch.equal(act, swiglu_gate_up(gu, impl="triton"))
    gu2, dy2 = gu.clone(), dy.clone()
    dgu2, act2 = swiglu_gate_up_backward_(dy2, gu2)
    assert dgu2.data_ptr() == gu2.data_ptr() and act2.data_ptr() == dy2.data_ptr()
    assert torch.equal(dgu2, dgu) and torch.equal(act2, act)


@needs_triton
def test_in_place_backward_refuses_other_layouts():
    """A strided gu or dy, two dtypes, or a contiguous gu whose width is not 2I for dy (N, I) (the kernel assumes a
    row stride of 2I: without the shape check it wrote d_gu at the wrong offsets) raise before any kernel."""
    gu, dy = torch.randn(4, 20, device=DEV), torch.randn(4, 10, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_gate_up_backward_(dy, torch.randn(4, 23, device=DEV)[:, :20])
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_gate_up_backward_(dy.t().contiguous().t(), gu)
    with pytest.raises(ValueError, match="one dtype"):
        swiglu_gate_up_backward_(dy.double(), gu)
    for cols in (22, 18):
        with pytest.raises(ValueError, match=r"must be contiguous \(N, I\) and \(N, 2I\)"):
            swiglu_gate_up_backward_(dy, torch.randn(4, cols, device=DEV))


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_say_what_is_wrong(impl):
    with pytest.raises(ValueError, match="even dim 2I"):
        swiglu_gate_up(torch.randn(3, 9, device=DEV), impl=impl)
    with pytest.raises(ValueError, match=r"gu \(\) must end in an even dim 2I"):  # was a bare IndexError
        swiglu_gate_up(torch.tensor(2.0, device=DEV), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_column_major_gu_gives_a_contiguous_output(impl):
    """The output is (..., I) contiguous on both impls, whatever gu's strides (the reference's product of two
    column-major halves kept their layout)."""
    gu = torch.randn(10, 6, device=DEV).t()  # (6, 10), column stride 6
    y = swiglu_gate_up(gu, impl=impl)
    assert y.is_contiguous()
    torch.testing.assert_close(y, swiglu_gate_up_ref(gu.contiguous()))


@needs_triton
def test_registered_ops_pass_opcheck():
    gu = torch.randn(4, 66, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.chronicals.swiglu_gate_up.default, (gu,))
    dy = torch.randn(4, 33, device=DEV)
    torch.library.opcheck(torch.ops.chronicals.swiglu_gate_up_backward.default, (dy, gu.detach()))


@needs_triton
def test_eager_door_and_compiled_door_agree():
    """torch.compile sees chronicals::swiglu_gate_up as one node; its values and gradients equal the eager
    door's bit for bit."""
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(3, 7, 100, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(3, 7, 50, generator=g).to(DEV)
    y = swiglu_gate_up(gu, impl="triton")
    (d_eager,) = torch.autograd.grad(y, gu, dy)

    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    yc = torch.compile(lambda t: swiglu_gate_up(t, impl="triton"), backend=backend, fullgraph=True)(gu)
    (d_comp,) = torch.autograd.grad(yc, gu, dy)
    assert "chronicals.swiglu_gate_up" in targets and not any("autograd_function" in t for t in targets), targets
    assert torch.equal(y, yc) and torch.equal(d_eager, d_comp)
