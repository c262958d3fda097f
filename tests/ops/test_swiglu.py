"""SwiGLU Triton kernel vs a float64 reference, with PyTorch's own error in the same dtype as the yardstick.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

import pytest
import torch
import torch.nn.functional as F
from ops_tolerance import assert_tracks_torch

from chronicals.ops import swiglu, swiglu_ref
from chronicals.ops._impl import triton_interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(fn, gate, up, dy):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    y = fn(gate, up)
    return [y, *torch.autograd.grad((y.double() * dy).sum(), [gate, up])]


@pytest.mark.parametrize("hidden", [64, 576, 896, 1000, 4864])
@pytest.mark.parametrize("rows", [1, 7, 123])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * 7919 + hidden)
    # 3x wider than N(0, 1) so sigmoid's tails (|gate| ~ 10) are in play
    gate = (3 * torch.randn(rows, hidden, generator=g, dtype=torch.float64)).to(dtype).to(DEV)
    up = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    dy = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).double().to(DEV)
    ref64 = _run(swiglu_ref, gate.double(), up.double(), dy)  # F.silu in float64 is exact enough
    theirs = _run(swiglu_ref, gate, up, dy)
    ours = _run(lambda a, b: swiglu(a, b, impl="triton"), gate, up, dy)
    for name, o, t, e in zip(["y", "dgate", "dup"], ours, theirs, ref64):
        assert o.dtype == dtype and o.shape == e.shape, name
        assert_tracks_torch(name, o, t, e)


def test_non_contiguous_and_3d():
    """(B, S, I) views with odd strides (gate/up as halves of one fused projection) are handled."""
    fused = torch.randn(2, 5, 2 * 40, device=DEV, requires_grad=True)
    gate, up = fused[..., :40], fused[..., 40:]
    y = swiglu(gate, up, impl="triton")
    torch.testing.assert_close(y, swiglu_ref(gate, up))
    (g_ours,) = torch.autograd.grad(y.sum(), fused)
    (g_ref,) = torch.autograd.grad(swiglu_ref(gate, up).sum(), fused)
    torch.testing.assert_close(g_ours, g_ref)


def test_the_registered_op_takes_strided_halves_too():
    """The compiled door (chronicals::swiglu) reads gate and up as views of one fused projection, as the eager door
    does: the kernels see contiguous copies, so outputs and gradients match the reference."""
    fused = torch.randn(2, 5, 2 * 40, device=DEV, requires_grad=True)
    gate, up = fused[..., :40], fused[..., 40:]
    y = torch.ops.chronicals.swiglu(gate, up)
    torch.testing.assert_close(y, swiglu_ref(gate, up))
    (g_ours,) = torch.autograd.grad(y.sum(), fused)
    (g_ref,) = torch.autograd.grad(swiglu_ref(gate, up).sum(), fused)
    torch.testing.assert_close(g_ours, g_ref)


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(torch.randn(3, 8, device=DEV), torch.randn(3, 8, device=DEV).double(), impl="triton")


def test_registered_op_passes_opcheck_and_compiles():
    gate = torch.randn(4, 33, device=DEV, requires_grad=True)
    up = torch.randn(4, 33, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.chronicals.swiglu.default, (gate, up))

    def f(a, b):
        return (swiglu(a, b, impl="triton") * 3).sum()

    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(gate, up), [gate, up])
    want = torch.autograd.grad((F.silu(gate) * up * 3).sum(), [gate, up])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_eager_door_and_compiled_door_agree():
    """Eager calls take SwiGLUFunction (no custom-op dispatch); torch.compile sees chronicals::swiglu as one
    node; both match the custom op's outputs and gradients."""
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(3, 7, 50, generator=g).to(DEV).requires_grad_()
    up = torch.randn(3, 7, 50, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(3, 7, 50, generator=g).to(DEV)
    y = swiglu(gate, up, impl="triton")
    assert type(y.grad_fn).__name__ == "SwiGLUFunctionBackward"
    yo = torch.ops.chronicals.swiglu(gate, up)
    torch.testing.assert_close(y, yo, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad((y * dy).sum(), [gate, up]), torch.autograd.grad((yo * dy).sum(), [gate, up])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(lambda a, b: swiglu(a, b, impl="triton"), backend=backend, fullgraph=True)(gate, up)
    targets = [t.removesuffix(".default") for t in targets]
    assert "chronicals.swiglu" in targets and not any("autograd_function" in t for t in targets), targets
