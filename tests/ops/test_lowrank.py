"""ops.lowrank.lowrank_update_ (y += alpha x @ w, small K): the Triton kernel against a float64 reference, with
PyTorch's own addmm_ in the same dtype as the yardstick, over odd shapes and strided operands.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops.lowrank import lowrank_update_, lowrank_update_ref
from chronicals.ops._impl import triton_interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
# (M, N, K): 1 x 1 x 1, tails of every tile, K past one 64-wide K block (96, 150), a LoRA-like 300 x 96 x 32
SHAPES = [(1, 1, 1), (37, 50, 5), (100, 130, 33), (70, 20, 96), (33, 200, 150), (300, 96, 32)]


def _operands(m, n, k, dtype, layout, gen):
    """y (M, N), x (M, K), w (K, N) in ``layout``: "dense", or "strided" (y a column block of a wider buffer, x a
    transposed view, w = B^T of a (N, K) B, as LoRA passes them); returns (y's buffer, y, x, w)."""
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(DEV, dtype)
    if layout == "dense":
        buf = rnd(m, n)
        return buf, buf, rnd(m, k), rnd(k, n)
    buf = rnd(m, n + 9)
    return buf, buf[:, 4:4 + n], rnd(k, m).t(), rnd(n, k).t()


@pytest.mark.parametrize("layout", ["dense", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_the_float64_reference_and_writes_only_y(m, n, k, dtype, layout):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    buf, y, x, w = _operands(m, n, k, dtype, layout, gen)
    before = buf.clone()
    ref64 = y.double() + 0.375 * (x.double() @ w.double())
    torch_same = lowrank_update_ref(y.clone(), x, w, 0.375)
    out = lowrank_update_(y, x, w, 0.375, impl="triton")
    assert out is y
    assert_tracks_torch(f"y {dtype} {layout}", y, torch_same, ref64)
    if layout == "strided":  # the buffer's columns beside y are left as they were
        assert torch.equal(buf[:, :4], before[:, :4]) and torch.equal(buf[:, 4 + n:], before[:, 4 + n:])


def test_alpha_one_and_zero_and_empty_operands():
    gen = torch.Generator().manual_seed(0)
    _, y, x, w = _operands(40, 30, 8, torch.float32, "dense", gen)
    y0 = y.clone()
    lowrank_update_(y, x, w, 0.0, impl="triton")
    assert torch.equal(y, y0)
    lowrank_update_(y, x, w, impl="triton")
    torch.testing.assert_close(y, y0 + x @ w, rtol=1e-5, atol=1e-5)
    e = torch.zeros(0, 30, device=DEV)
    assert lowrank_update_(e, x[:0], w, impl="triton").shape == (0, 30)


def test_auto_on_the_cpu_and_float64_take_addmm():
    """impl="auto": the kernel on CUDA, addmm_ elsewhere; float64 always takes addmm_ (the kernel sums in fp32), and
    asking the kernel for it says so."""
    gen = torch.Generator().manual_seed(1)
    _, y, x, w = _operands(20, 12, 4, torch.float64, "dense", gen)
    want = y.clone().addmm_(x, w, alpha=2.0)
    assert torch.equal(lowrank_update_(y, x, w, 2.0), want)  # bit for bit: the same addmm_
    with pytest.raises(ValueError, match="float64 takes impl='torch'"):
        lowrank_update_(y, x, w, impl="triton")
    if DEV == "cpu":
        _, y, x, w = _operands(20, 12, 4, torch.float32, "dense", gen)
        assert torch.equal(lowrank_update_(y.clone(), x, w, 0.5), y.clone().addmm_(x, w, alpha=0.5))


@pytest.mark.parametrize("args,said", [
    (((4, 5), (4, 3), (2, 5)), "does not fit"),
    (((4, 5), (3, 3), (3, 5)), "does not fit"),
    (((4, 5, 1), (4, 3), (3, 5)), "does not fit"),
])
def test_shapes_that_do_not_fit_are_named(args, said):
    ys, xs, ws = args
    with pytest.raises(ValueError, match=said):
        lowrank_update_(torch.zeros(ys, device=DEV), torch.zeros(xs, device=DEV), torch.zeros(ws, device=DEV))


def test_mixed_dtypes_are_named():
    with pytest.raises(ValueError, match="share a dtype"):
        lowrank_update_(torch.zeros(4, 5, device=DEV), torch.zeros(4, 3, device=DEV, dtype=torch.bfloat16),
                        torch.zeros(3, 5, device=DEV))
