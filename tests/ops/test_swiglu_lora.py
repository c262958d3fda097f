"""ops.swiglu_lora: the SwiGLU kernels with a LoRA down_proj's rank-r products folded in, against a float64
reference and against what the unfused path (SwiGLU kernel + cuBLAS GEMM) computes in the same dtype.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops._impl import triton_interpreting
from chronicals.ops.swiglu import swiglu_gate_up_backward, swiglu_gate_up_forward
from chronicals.ops.swiglu_lora import (MAX_RANK, fused_ok, swiglu_gate_up_backward_da,
                                        swiglu_gate_up_backward_da_ref, swiglu_gate_up_xa, swiglu_gate_up_xa_ref)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV != "cuda" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
DTYPES = [torch.float32, torch.bfloat16]


def assert_sum_tracks_torch(name, ours, torch_same_dtype, ref64, terms):
    """A K-term sum in another order than cuBLAS's: our error <= 2 x PyTorch's + eps x sqrt(K) x max|ref| (the
    rounding of K fp32 partial sums; in bf16 the output's own rounding, eps x max|ref|, dominates)."""
    err = (ours.double() - ref64).abs().max().item()
    torch_err = (torch_same_dtype.double() - ref64).abs().max().item()
    atol = torch.finfo(ours.dtype).eps * max(terms, 1) ** 0.5 * max(ref64.abs().max().item(), 1.0)
    assert err <= 2 * torch_err + atol, f"{name}: error {err:.3g} vs torch {torch_err:.3g} (atol {atol:.3g})"


def _inputs(n, i, r, dtype, seed, wide=0):
    """gu (n, 2i) (a column slice of an (n, 2i + wide) buffer when wide > 0), a (r, i), d_act (n, i), dyb (n, r)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gate, up = 3 * rnd(n, i), rnd(n, i)  # |gate| ~ 10: sigmoid's tails
    buf = torch.cat([gate, up, rnd(n, wide)], 1).to(dtype).to(DEV)
    gu = buf[:, :2 * i]
    return gu, (rnd(r, i) / i ** 0.5).to(dtype).to(DEV), rnd(n, i).to(dtype).to(DEV), rnd(n, r).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,i,r", [(1, 5, 1), (7, 96, 3), (33, 130, 32), (300, 40, 64), (65, 17, 16)])
@pytest.mark.parametrize("wide", [0, 6])
def test_forward_act_bits_and_xa_vs_float64(dtype, n, i, r, wide):
    gu, a, _, _ = _inputs(n, i, r, dtype, seed=n + i + r, wide=wide)
    act, xa = swiglu_gate_up_xa(gu, a)
    assert act.is_contiguous() and xa.shape == (n, r) and xa.dtype == dtype
    assert torch.equal(act, swiglu_gate_up_forward(gu))  # the plain kernel's bits: down_proj's GEMM input
    act64, xa64 = swiglu_gate_up_xa_ref(gu.double(), a.double())
    # xa is computed from the rounded act, as the unfused GEMM's is: compare both against float64 of the same
    assert_sum_tracks_torch("xa", xa, act @ a.t(), act.double() @ a.double().t(), i)
    assert_tracks_torch("act", act, act, act64, k=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,i,r", [(1, 5, 1), (7, 96, 3), (33, 130, 32), (300, 40, 64), (129, 70, 8)])
@pytest.mark.parametrize("in_place", [False, True])
def test_backward_dgu_bits_and_da_vs_float64(dtype, n, i, r, in_place):
    """d_gu equals the plain backward kernel's bit for bit; dA = dyb^T act tracks float64 as cuBLAS does.
    n = 300 and 129 at these widths take several row splits (partial sums added in a fixed order)."""
    gu, _, d_act, dyb = _inputs(n, i, r, dtype, seed=2 * n + i + r)
    act = torch.empty_like(d_act)
    want_dgu = swiglu_gate_up_backward(d_act, gu, act)
    gu_in = gu.clone()
    d_gu, da = swiglu_gate_up_backward_da(d_act, gu_in, dyb, in_place)
    assert (d_gu.data_ptr() == gu_in.data_ptr()) == in_place
    assert torch.equal(d_gu, want_dgu)
    if not in_place:
        assert torch.equal(gu_in, gu)  # untouched
    _, da64 = swiglu_gate_up_backward_da_ref(d_act.double(), gu.double(), dyb.double())
    assert da.shape == (r, i) and da.dtype == dtype
    assert_sum_tracks_torch("dA", da, dyb.t() @ act, dyb.double().t() @ act.double(), n)
    assert torch.equal(swiglu_gate_up_backward_da(d_act, gu.clone(), dyb, in_place)[1], da)  # deterministic
    d_gu64, _ = swiglu_gate_up_backward_da_ref(d_act.double(), gu.double(), dyb.double())
    assert_tracks_torch("d_gu", d_gu, want_dgu, d_gu64, k=1.0)


def test_backward_reads_a_strided_gu_and_writes_a_fresh_contiguous_d_gu():
    gu, _, d_act, dyb = _inputs(9, 24, 4, torch.float32, seed=5, wide=8)
    assert not gu.is_contiguous()
    d_gu, da = swiglu_gate_up_backward_da(d_act, gu, dyb, in_place=False)
    assert d_gu.is_contiguous() and torch.equal(d_gu, swiglu_gate_up_backward(d_act, gu))
    torch.testing.assert_close(da, dyb.t() @ swiglu_gate_up_forward(gu), rtol=1e-5, atol=1e-5)


def test_empty_rows():
    gu, a, d_act, dyb = _inputs(0, 8, 4, torch.float32, seed=0)
    act, xa = swiglu_gate_up_xa(gu, a)
    assert act.shape == (0, 8) and xa.shape == (0, 4)
    d_gu, da = swiglu_gate_up_backward_da(d_act, gu, dyb, in_place=False)
    assert d_gu.shape == (0, 16) and torch.equal(da, torch.zeros(4, 8, device=DEV))


def test_refusals_say_what_to_use():
    gu, a, d_act, dyb = _inputs(4, 8, 4, torch.float32, seed=1)
    assert fused_ok(gu, a)
    assert not fused_ok(gu, a.double()) and not fused_ok(gu, torch.zeros(MAX_RANK + 1, 8, device=DEV))
    assert not fused_ok(gu, a[:, :6])
    with pytest.raises(ValueError, match="use swiglu_gate_up_backward and a GEMM"):
        swiglu_gate_up_backward_da(d_act, gu, torch.zeros(4, MAX_RANK + 1, device=DEV), in_place=False)
    with pytest.raises(ValueError, match="one dtype"):
        swiglu_gate_up_backward_da(d_act, gu, dyb.double(), in_place=False)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_gate_up_backward_da(d_act.t().contiguous().t(), gu, dyb, in_place=False)
