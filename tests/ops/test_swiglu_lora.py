"""ops.swiglu_lora (SwiGLU on packed gate|up fused with a LoRA down_proj's x A^T and dA) vs a float64 reference,
vs PyTorch's error in the same dtype, and bit for bit vs the plain SwiGLU kernels where it shares their outputs.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops import swiglu_lora as sl
from chronicals.ops._impl import triton_interpreting
from chronicals.ops.swiglu import swiglu_gate_up_backward, swiglu_gate_up_forward

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (DEV == "cuda" or triton_interpreting()),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(n, i, r, dtype, seed):
    """gu (N, 2I) with |gate| ~ 3 (sigmoid's tails), A (r, I), d_act (N, I), dyb (N, r): float64 values that are
    exact in ``dtype``, on DEV."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).to(DEV)  # noqa: E731
    gu = rnd(n, 2 * i)
    gu[:, :i] *= 3
    return gu, rnd(r, i), rnd(n, i), rnd(n, r)


# N 300 with I 130: more than one row share in the backward (partial dA added), masked row and column tails;
# r 1, 7 pad to 16 columns of the products; r 128 is MAX_RANK
@pytest.mark.parametrize("n, i, r", [(1, 5, 1), (7, 96, 4), (33, 1031, 7), (300, 130, 32), (20, 64, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_float64_and_the_swiglu_kernel(dtype, n, i, r):
    gu, a, _, _ = _inputs(n, i, r, dtype, seed=n * 131 + i + r)
    act, xa = sl.swiglu_gate_up_xa(gu, a)
    act64, xa64 = sl.swiglu_gate_up_xa_ref(gu.double(), a.double())
    act_t, xa_t = sl.swiglu_gate_up_xa_ref(gu, a)  # PyTorch in the same dtype
    assert act.shape == (n, i) and xa.shape == (n, r) and act.dtype == xa.dtype == dtype
    assert torch.equal(act, swiglu_gate_up_forward(gu))  # the plain kernel's bits
    assert_tracks_torch("act", act, act_t, act64)
    assert_tracks_torch("xa", xa, xa_t, xa64)


@pytest.mark.parametrize("n, i, r", [(1, 5, 1), (7, 96, 4), (33, 1031, 7), (300, 130, 32), (20, 64, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_matches_float64_and_the_swiglu_kernel(dtype, n, i, r):
    gu, _, d_act, dyb = _inputs(n, i, r, dtype, seed=n * 7 + i + r)
    d_gu, da, _ = sl.swiglu_gate_up_backward_da(d_act, gu, dyb)
    d_gu64, da64, _ = sl.swiglu_gate_up_backward_da_ref(d_act.double(), gu.double(), dyb.double())
    _, da_t, _ = sl.swiglu_gate_up_backward_da_ref(d_act, gu, dyb)
    assert d_gu.shape == gu.shape and da.shape == (r, i) and d_gu.dtype == da.dtype == dtype
    assert torch.equal(d_gu, swiglu_gate_up_backward(d_act, gu))  # the plain kernel's bits
    # dA sums N products in fp32 (PyTorch's bf16 GEMM too): our error against PyTorch's in the same dtype
    assert_tracks_torch("dA", da, da_t, da64)
    torch.testing.assert_close(d_gu.double(), d_gu64, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_the_backward_adds_the_row_shares_of_da():
    """300 rows over 3 shares of 128 (the CPU's 4 'SMs' ask for 8 programs from 2 column blocks): every share's
    partial dA counts; a kernel that kept one share's (or added one twice) is off by whole rows' products."""
    gu, _, d_act, dyb = _inputs(300, 130, 5, torch.float64, seed=1)
    gu, d_act, dyb = gu.float(), d_act.float(), dyb.float()
    blocks = -(-130 // sl._BWD_BLOCK_C)
    assert sl._splits(300, blocks, gu.device) > 1
    _, da, _ = sl.swiglu_gate_up_backward_da(d_act, gu, dyb)
    torch.testing.assert_close(da.double(), sl.swiglu_gate_up_backward_da_ref(d_act, gu, dyb)[1].double(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n, i, r_g, r_u", [(1, 5, 1, 2), (33, 1031, 7, 7), (300, 130, 32, 16), (20, 64, 128, 3)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gate_up_db_matches_float64_and_the_gemms(dtype, n, i, r_g, r_u):
    """With the gate/up pair's xa (here a column slice of a wider tensor, row stride r_g + r_u + 3), the kernel's
    s_g d_gate^T xa_g and s_u d_up^T xa_u track the float64 reference as PyTorch's GEMMs on the rounded d_gu do;
    d_gu and dA are the bits of the call without them."""
    gu, _, d_act, dyb = _inputs(n, i, 5, dtype, seed=n + i + r_g)
    g = torch.Generator().manual_seed(n)
    wide = torch.randn(n, r_g + r_u + 3, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    xa = wide[:, 3:]
    spec = (xa, r_g, r_u, 0.75, 2.0)
    d_gu, da, (db_g, db_u) = sl.swiglu_gate_up_backward_da(d_act, gu, dyb, gate_up_xa=spec)
    d_gu0, da0, none = sl.swiglu_gate_up_backward_da(d_act, gu, dyb)
    assert none is None and torch.equal(d_gu, d_gu0) and torch.equal(da, da0)
    assert db_g.shape == (i, r_g) and db_u.shape == (i, r_u) and db_g.dtype == db_u.dtype == dtype
    # the GEMMs read the rounded d_gu: the reference takes those values (their rounding is d_gu's test's business)
    d_gate, d_up = d_gu.double().chunk(2, dim=-1)
    ref = (0.75 * (d_gate.t() @ xa[:, :r_g].double()), 2.0 * (d_up.t() @ xa[:, r_g:].double()))
    theirs = (0.75 * (d_gu[:, :i].t() @ xa[:, :r_g]), 2.0 * (d_gu[:, i:].t() @ xa[:, r_g:]))
    for name, o, t, e in zip(("dB_gate", "dB_up"), (db_g, db_u), theirs, ref):
        assert_tracks_torch(name, o, t, e)
    _, _, ref_dbs = sl.swiglu_gate_up_backward_da_ref(d_act.double(), gu.double(), dyb.double(),
                                                      (xa.double(), r_g, r_u, 0.75, 2.0))
    for o, e in zip((db_g, db_u), ref_dbs):  # and the reference twin, end to end, to the dtype's rounding of d_gu
        torch.testing.assert_close(o.double(), e, rtol=0.05 if dtype == torch.bfloat16 else 1e-5,
                                   atol=0.05 * e.abs().max().item() if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_backward_writes_d_gu_over_gu_with_the_same_bits(dtype):
    gu, _, d_act, dyb = _inputs(70, 96, 8, dtype, seed=5)
    d_gu, da, _ = sl.swiglu_gate_up_backward_da(d_act, gu, dyb)
    own = gu.clone()
    d_gu2, da2, _ = sl.swiglu_gate_up_backward_da(d_act, own, dyb, in_place=True)
    assert d_gu2.data_ptr() == own.data_ptr() and torch.equal(d_gu2, d_gu) and torch.equal(da2, da)


def test_row_strided_gu_and_d_act():
    """gu and d_act may be row-strided views (unit column stride): read at their own row strides."""
    gu, a, d_act, dyb = _inputs(9, 40, 4, torch.float32, seed=2)
    wide_gu = torch.zeros(9, 2 * 40 + 6, device=DEV)
    wide_gu[:, 6:] = gu
    wide_d = torch.zeros(9, 40 + 3, device=DEV)
    wide_d[:, :40] = d_act
    act, xa = sl.swiglu_gate_up_xa(wide_gu[:, 6:], a)
    assert torch.equal(act, sl.swiglu_gate_up_xa(gu, a)[0]) and torch.equal(xa, sl.swiglu_gate_up_xa(gu, a)[1])
    d_gu, da, _ = sl.swiglu_gate_up_backward_da(wide_d[:, :40], wide_gu[:, 6:], dyb)
    d_gu_c, da_c, _ = sl.swiglu_gate_up_backward_da(d_act, gu, dyb)
    assert torch.equal(d_gu, d_gu_c) and torch.equal(da, da_c)


def test_no_rows():
    gu, a, d_act, dyb = _inputs(0, 8, 3, torch.float32, seed=0)
    act, xa = sl.swiglu_gate_up_xa(gu, a)
    assert act.shape == (0, 8) and xa.shape == (0, 3)
    d_gu, da, _ = sl.swiglu_gate_up_backward_da(d_act, gu, dyb)
    assert d_gu.shape == (0, 16) and torch.equal(da, torch.zeros(3, 8, device=DEV))


@pytest.mark.parametrize("case", ["rank", "dtype", "a_shape", "col_stride", "in_place_strided", "xa_rank", "xa_dtype"])
def test_bad_layouts_are_refused_with_what_they_need(case):
    gu, a, d_act, dyb = _inputs(4, 8, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match="swiglu_lora: .*lay the tensors out"):
        if case == "rank":
            sl.swiglu_gate_up_xa(gu, torch.zeros(sl.MAX_RANK + 1, 8, device=DEV))
        elif case == "dtype":
            sl.swiglu_gate_up_backward_da(d_act, gu, dyb.double())
        elif case == "a_shape":
            sl.swiglu_gate_up_xa(gu, a[:, :7].contiguous())
        elif case == "col_stride":
            sl.swiglu_gate_up_xa(gu.t().contiguous().t(), a)
        elif case == "in_place_strided":
            sl.swiglu_gate_up_backward_da(d_act, torch.zeros(4, 20, device=DEV)[:, :16], dyb, in_place=True)
        elif case == "xa_rank":
            sl.swiglu_gate_up_backward_da(d_act, gu, dyb, gate_up_xa=(dyb, 2, 2, 1.0, 1.0))  # 3 columns for 2 + 2
        else:
            sl.swiglu_gate_up_backward_da(d_act, gu, dyb, gate_up_xa=(dyb.double(), 1, 1, 1.0, 1.0))
