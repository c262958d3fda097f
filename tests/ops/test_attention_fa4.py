"""model.attention=fa4 (``ops.attention_fa4``): FlashAttention-4's kernels for unpacked and packed rows.

On the CPU: what the wrapper hands FA4's interface (a stand-in module that holds FA4's documented contract and
computes with the float64 reference), its refusals, and the dispatch. On a GPU with flash-attn-4 installed: the
kernels against float64, as tests/ops/test_attention.py checks FA2's and cuDNN's."""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest
import torch

from chronicals.ops import attention_fa4
from chronicals.ops.attention import attention, attention_ref


def _fake_interface(calls: list):
    """A ``flash_attn.cute.interface`` that checks each call against FA4's documented layout (dense: (B, S, H, D);
    varlen: (T, H, D) with cu_seqlens_q is cu_seqlens_k, int bounds) and returns (out, lse) from the reference."""
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kw):
        assert causal and not kw and q.dim() == 4 and isinstance(softmax_scale, float)
        calls.append(("dense", tuple(q.shape), softmax_scale))
        return attention_ref(q.double(), k.double(), v.double(), scale=softmax_scale).to(q.dtype), None

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               softmax_scale=None, causal=False, **kw):
        assert causal and not kw and q.dim() == 3 and cu_seqlens_q is cu_seqlens_k
        assert type(max_seqlen_q) is int and max_seqlen_q == max_seqlen_k and isinstance(softmax_scale, float)
        assert max_seqlen_q >= int(cu_seqlens_q.diff().max())
        calls.append(("varlen", tuple(q.shape), softmax_scale, max_seqlen_q))
        t, h, d = q.shape
        out = attention_ref(*(x.double().view(1, t, x.shape[1], d) for x in (q, k, v)), cu_seqlens=cu_seqlens_q,
                            scale=softmax_scale)
        return out.view(t, h, d).to(q.dtype), None

    cute = types.ModuleType("flash_attn.cute")
    cute.interface = types.SimpleNamespace(flash_attn_func=flash_attn_func,
                                           flash_attn_varlen_func=flash_attn_varlen_func)
    return cute


@pytest.fixture
def fake_fa4(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fake_interface(calls))
    return calls


def _joint_qkv(b, s, hq, hk, d, gen):
    """q / k / v as the decoder passes them: views of one (B, S, Hq + 2 Hk, D) projection output."""
    qkv = torch.randn(b, s, hq + 2 * hk, d, generator=gen, dtype=torch.float64).bfloat16()
    return qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_wrapper_hands_fa4_the_layout_it_documents(fake_fa4, packed):
    """Views of a joint projection, GQA 6 / 2, an odd row length: dense rows go whole, packed rows as one stream of
    B * S tokens with the caller's bound (train.graphs passes S); the default scale is 1 / sqrt(D)."""
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hk, d = 2, 37, 6, 2, 16
    q, k, v = _joint_qkv(b, s, hq, hk, d, gen)
    cu = torch.tensor([0, 10, 37, 40, 60, 74], dtype=torch.int32) if packed else None
    out = attention_fa4.attention_fa4(q, k, v, cu, s if packed else None)
    ref = attention_ref(q.double(), k.double(), v.double(), cu_seqlens=cu)
    assert out.shape == (b, s, hq, d) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-2)
    assert fake_fa4 == ([("varlen", (b * s, hq, d), d ** -0.5, s)] if packed else [("dense", (b, s, hq, d), d ** -0.5)])


def test_packed_rows_without_a_bound_take_the_longest_document(fake_fa4):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _joint_qkv(1, 30, 4, 4, 8, gen)
    attention_fa4.attention_fa4(q, k, v, torch.tensor([0, 7, 30], dtype=torch.int32), None, 0.25)
    assert fake_fa4 == [("varlen", (30, 4, 8), 0.25, 23)]


def test_without_flash_attn_4_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn... -> ImportError
    attention_fa4.available.cache_clear()
    try:
        assert not attention_fa4.available()
        with pytest.raises(ImportError, match=r"model.attention=fa4 needs .*pip install flash-attn-4"):
            attention_fa4.fa4_interface()
    finally:
        attention_fa4.available.cache_clear()


@pytest.mark.parametrize("dtype,d,error,match", [
    (torch.float32, 64, TypeError, "take bfloat16/float16 q/k/v .got torch.float32"),
    (torch.bfloat16, 12, ValueError, "multiple of 8 from 8 to 256 .got 12"),
    (torch.bfloat16, 264, ValueError, "multiple of 8 from 8 to 256 .got 264"),
])
def test_inputs_fa4_cannot_take_are_refused_before_its_call(fake_fa4, dtype, d, error, match):
    q = torch.zeros(1, 4, 2, d, dtype=dtype)
    with pytest.raises(error, match=match):
        attention_fa4.attention_fa4(q, q, q)
    assert not fake_fa4


def test_fa4_off_cuda_runs_the_reference_and_says_so(fake_fa4, caplog, monkeypatch):
    """model.attention=fa4 with impl=triton on the CPU (Triton's interpreter): unpacked and packed rows run the SDPA
    reference (FA4 is not called), each said once. (impl=torch and auto there take the reference before any kernel
    choice, and train says that model.attention=fa4 does nothing on the CPU: guards.check_impl.)"""
    monkeypatch.setattr(importlib.import_module("chronicals.ops.attention"), "_logged_notes", set())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="chronicals"):
        for _ in range(2):
            torch.testing.assert_close(attention(q, k, v, impl="triton", varlen="fa4"), attention_ref(q, k, v))
            torch.testing.assert_close(attention(q, k, v, cu_seqlens=cu, impl="triton", varlen="fa4"),
                                       attention_ref(q, k, v, cu_seqlens=cu))
    assert not fake_fa4
    assert caplog.text.count("unpacked rows (model.attention=fa4) on cpu") == 1
    assert caplog.text.count("packed rows on cpu") == 1


def _fa4_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and attention_fa4.available()


@pytest.mark.skipif(not _fa4_ok(), reason="needs CUDA, a Hopper or newer GPU and flash-attn-4")
@pytest.mark.parametrize("hq,hk,d", [(14, 2, 64), (4, 4, 64), (8, 2, 128)])
def test_fa4_unpacked_rows_match_float64_as_closely_as_sdpa(hq, hk, d):
    """bf16 FA4 within 2x (+ a floor) of bf16 SDPA's own error against float64: out, dq, dk, dv; q / k / v views of
    one projection, an odd row length."""
    gen = torch.Generator().manual_seed(4)
    b, s = 2, 257
    qkv = torch.randn(b, s, hq + 2 * hk, d, generator=gen).cuda()
    parts = lambda t: (t[:, :, :hq], t[:, :, hq:hq + hk], t[:, :, hq + hk:])  # noqa: E731
    leaves = [qkv.to(dt).requires_grad_() for dt in (torch.float64, torch.bfloat16, torch.bfloat16)]
    g = torch.randn(b, s, hq, d, generator=gen).cuda()
    outs = [attention_ref(*parts(leaves[0])), attention(*parts(leaves[1]), impl="triton", varlen="fa4"),
            attention_ref(*parts(leaves[2]))]
    for o in outs:
        o.backward(g.to(o.dtype))
    for a, c, r in ((outs[1], outs[2], outs[0]), (leaves[1].grad, leaves[2].grad, leaves[0].grad)):
        assert (a.double() - r).abs().max() <= 2 * (c.double() - r).abs().max() + 1e-3
