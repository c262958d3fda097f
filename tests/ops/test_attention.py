"""Attention for packed rows: the block-diagonal masked SDPA (CPU) and the CUDA varlen flash path; the reference
refuses a document that runs across a row."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from chronicals.ops import attention_cudnn, attention_fa4
from chronicals.ops.attention import attention, attention_ref, packed_causal_mask


def per_document(q, k, v, cu):
    """Plain causal SDPA on each document separately, float64, GQA by repeating heads."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    qf, kf, vf = (t.reshape(b * s, t.shape[2], d).double() for t in (q, k, v))
    out = torch.empty(b * s, hq, d, dtype=torch.float64)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd = qf[lo:hi].transpose(0, 1)
        kd = kf[lo:hi].repeat_interleave(rep, 1).transpose(0, 1)
        vd = vf[lo:hi].repeat_interleave(rep, 1).transpose(0, 1)
        out[lo:hi] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1)
    return out.view(b, s, hq, d)


def random_cu(b, s, gen):
    """Random document boundaries inside each row of s tokens (rows never share a document)."""
    cuts = [0]
    for r in range(b):
        inner = sorted(torch.randperm(s - 1, generator=gen)[:3].add(1).tolist())
        cuts += [r * s + c for c in inner] + [(r + 1) * s]
    return torch.tensor(cuts, dtype=torch.int32)


def test_mask_is_block_diagonal_causal():
    cu = torch.tensor([0, 3, 5, 9, 10], dtype=torch.int32)
    m = packed_causal_mask(cu, 2, 5)[:, 0].int()
    assert m[0].tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert m[1].tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]]


@pytest.mark.parametrize("b,s,hq,hk,d", [(1, 7, 2, 2, 8), (2, 33, 6, 2, 16), (3, 19, 4, 1, 12)])
def test_packed_reference_matches_per_document(b, s, hq, hk, d):
    gen = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, s, hq, d, generator=gen, requires_grad=True)
    k = torch.randn(b, s, hk, d, generator=gen, requires_grad=True)
    v = torch.randn(b, s, hk, d, generator=gen, requires_grad=True)
    cu = random_cu(b, s, gen)
    out = attention(q, k, v, cu_seqlens=cu, max_seqlen=int(cu.diff().max()), impl="torch")
    want = per_document(q, k, v, cu)
    assert (out.double() - want).abs().max() < 1e-5
    g = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), g)
    want_grads = torch.autograd.grad(want, (q, k, v), g.double())
    for got, ref in zip(grads, want_grads):
        assert (got.double() - ref).abs().max() < 1e-4


def test_no_attention_across_documents():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = attention_ref(q, k, v, cu_seqlens=cu)
    k2, v2 = k.clone(), v.clone()
    k2[:, :5] += 3.0  # change document 0 only
    v2[:, :5] -= 2.0
    out2 = attention_ref(q, k2, v2, cu_seqlens=cu)
    assert torch.equal(out[:, 5:], out2[:, 5:]) and not torch.allclose(out[:, :5], out2[:, :5])


@pytest.mark.parametrize("packed", [False, True])
def test_scale_is_honoured_on_unpacked_and_packed_rows(packed):
    """scale=c is softmax(c * q k^T): the same as the default 1/sqrt(D) with q * c * sqrt(D), through the reference and
    attention(impl='torch'). Dropping scale= from either SDPA call went unseen (no test passed a scale)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32) if packed else None
    want = attention_ref(q * (0.9 * 8 ** 0.5), k, v, cu_seqlens=cu)
    assert not torch.allclose(want, attention_ref(q, k, v, cu_seqlens=cu))  # the scale makes a difference
    torch.testing.assert_close(attention_ref(q, k, v, cu_seqlens=cu, scale=0.9), want)
    torch.testing.assert_close(attention(q, k, v, cu_seqlens=cu, scale=0.9, impl="torch"), want)


def test_shapes_attention_cannot_take_are_refused_by_name():
    """A key head dim other than the query's, and a 2-D cu_seqlens, get attention's own ValueError naming the expected
    shape (without the checks: SDPA's 'bmm batch2' RuntimeError, and 'Boolean value of Tensor ... ambiguous')."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 2, 8, generator=g)
    k = torch.randn(2, 6, 2, 16, generator=g)
    with pytest.raises(ValueError, match=r"expected q \(B, S, Hq, D\) and k, v \(B, S, Hk, D\)"):
        attention(q, k, k, impl="torch")
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32 \(num_docs \+ 1,\).*\(1, 5\)"):
        attention(q, q, q, cu_seqlens=torch.tensor([[0, 2, 6, 9, 12]], dtype=torch.int32), impl="torch")


@pytest.mark.parametrize("hq, d, dtype, cu_dtype, error, match", [
    (2, 264, torch.bfloat16, torch.int32, ValueError, r"multiple of 8 and at most 256 \(got 264\)"),
    (2, 8, torch.bfloat16, torch.int64, ValueError, r"cu_seqlens must be int32 \(got torch.int64\)"),
    (3, 8, torch.bfloat16, torch.int32, ValueError, r"Hq=3 is not a multiple of Hk=2"),
    (2, 8, torch.float32, torch.int32, TypeError, r"needs bfloat16/float16 q/k/v"),
    (2, 8, torch.float64, torch.int32, TypeError, r"needs bfloat16/float16 q/k/v"),
])
def test_the_varlen_flash_door_refuses_what_its_kernels_cannot_take(hq, d, dtype, cu_dtype, error, match):
    """attention_varlen_flash, called directly (attention() checks some of these first), refuses a head dim over 256,
    a cu_seqlens that is not int32, Hq not a multiple of Hk, and fp32/fp64, by name before any kernel; on the CPU
    they reached the aten op's NotImplementedError instead."""
    att = importlib.import_module("chronicals.ops.attention")  # the package attribute of that name is the function
    q = torch.zeros(1, 4, hq, d, dtype=dtype)
    k = torch.zeros(1, 4, 2, d, dtype=dtype)
    with pytest.raises(error, match=match):
        att.attention_varlen_flash(q, k, k, torch.tensor([0, 2, 4], dtype=cu_dtype), max_seqlen=2)


def _cudnn_ok() -> bool:
    return torch.cuda.is_available() and attention_cudnn.available() and torch.cuda.get_device_capability()[0] >= 9


def _skip_unless_installed(varlen: str) -> None:
    """cudnn needs nvidia-cudnn-frontend and fa4 flash-attn-4, both on a Hopper or newer GPU."""
    if varlen == "cudnn" and not _cudnn_ok():
        pytest.skip("needs nvidia-cudnn-frontend, cuDNN >= 9.6 and a Hopper GPU")
    if varlen == "fa4" and not (attention_fa4.available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("needs flash-attn-4 and a Hopper or newer GPU")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels need CUDA")
@pytest.mark.parametrize("hq,hk,d", [(14, 2, 64), (4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize("varlen", ["flash", "cudnn", "fa4"])
def test_varlen_kernels_match_reference_on_cuda(hq, hk, d, varlen):
    _skip_unless_installed(varlen)
    gen = torch.Generator().manual_seed(1)
    b, s = 3, 257
    cu = random_cu(b, s, gen).cuda()
    qkv = [torch.randn(b, s, h, d, generator=gen).cuda() for h in (hq, hk, hk)]
    ref = [t.double().requires_grad_() for t in qkv]
    fast = [t.bfloat16().requires_grad_() for t in qkv]
    low = [t.bfloat16().requires_grad_() for t in qkv]
    g = torch.randn(b, s, hq, d, generator=gen).cuda()
    outs = [attention_ref(*ref, cu_seqlens=cu),
            attention(*fast, cu_seqlens=cu, max_seqlen=int(cu.diff().max()), impl="triton", varlen=varlen),
            attention_ref(*low, cu_seqlens=cu)]
    for o, t in zip(outs, (ref, fast, low)):
        o.backward(g.to(o.dtype))
    # bf16 varlen flash within 2x (+ a floor) of bf16 masked SDPA's own error, both against float64
    for i in range(3):
        a = ([outs[1]] + [t.grad for t in fast])[i].double()
        c = ([outs[2]] + [t.grad for t in low])[i].double()
        r = ([outs[0]] + [t.grad for t in ref])[i]
        assert (a - r).abs().max() <= 2 * (c - r).abs().max() + 1e-3


def _varlen_error_ratio(rows: int, s: int, cuts: list[int], hq: int, hk: int, d: int, varlen: str,
                        upstream: str, dtype: torch.dtype = torch.bfloat16, scale: float | None = None) -> float:
    """Worst of out / dq / dk / dv error, varlen kernel (``dtype``) against float64, over ``dtype`` masked SDPA's own
    error (+ a floor): documents ``cuts`` (cu_seqlens over rows * s tokens); ``upstream``: "dense" (a random
    gradient), "sum" (o.sum(): an expanded, stride-0 gradient) or "transposed" (a random one whose last two dims are
    swapped)."""
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor(cuts, dtype=torch.int32).cuda()
    qkv = [torch.randn(rows, s, h, d, generator=gen).cuda() for h in (hq, hk, hk)]
    ref, fast, low = ([t.to(dt).requires_grad_() for t in qkv] for dt in (torch.float64, dtype, dtype))
    outs = [attention_ref(*ref, cu_seqlens=cu, scale=scale),
            attention(*fast, cu_seqlens=cu, max_seqlen=int(cu.diff().max()), impl="triton", varlen=varlen,
                      scale=scale),
            attention_ref(*low, cu_seqlens=cu, scale=scale)]
    g = torch.randn(rows, s, d, hq, generator=gen).cuda().transpose(-1, -2)  # (rows, s, hq, d), not contiguous
    g = g.contiguous() if upstream == "dense" else g
    for o in outs:
        if upstream == "sum":
            o.sum().backward()
        else:
            o.backward(g.to(o.dtype))
    worst = 0.0
    for i in range(4):
        r, a, c = (([o] + [t.grad for t in ts])[i].double() for o, ts in zip(outs, (ref, fast, low)))
        worst = max(worst, float((a - r).abs().max() / (2 * (c - r).abs().max() + 1e-3)))
    return worst


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels need CUDA")
@pytest.mark.parametrize("varlen", ["flash", "cudnn", "fa4"])
def test_varlen_kernels_fit_each_batch_documents_and_tokens(varlen):
    """cuDNN's graphs are built per shape key: a batch with the same document bucket and length bound but 3x the
    tokens gets a plan of its own (the backward's token bound), and a single document longer than half the bound
    is covered by it; an upstream gradient that is not contiguous (o.sum(): stride 0; a transposed one) is read
    as it is laid out. Heads 6 / 3 of 64: a key no other test builds first."""
    _skip_unless_installed(varlen)
    hq, hk, d = 6, 3, 64
    cases = [
        (1, 300, [0, 200, 300], "dense"),  # 300 tokens: built first
        (3, 300, [0, 200, 300, 500, 600, 800, 900], "dense"),  # same bucket and bound, 900 tokens
        (1, 300, [0, 300], "dense"),  # one document of 300: above half its bound (512)
        (2, 96, [0, 40, 96, 192], "sum"),
        (2, 96, [0, 40, 96, 192], "transposed"),
    ]
    for case in cases:
        assert _varlen_error_ratio(*case[:3], hq, hk, d, varlen, case[3]) <= 1, case


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels need CUDA")
@pytest.mark.parametrize("varlen", ["flash", "cudnn", "fa4"])
def test_varlen_kernels_take_fp16_and_a_given_scale(varlen):
    """fp16 q/k/v and a scale other than 1/sqrt(D), each after a batch of the same shape without it: cuDNN's plan
    for the one is not reused for the other (its key holds dtype and scale), and both reach the kernel."""
    _skip_unless_installed(varlen)
    case = (2, 80, [0, 30, 80, 160], 4, 2, 64, varlen, "dense")  # heads 4 / 2 of 64 over 160 tokens: this test's key
    for dtype, scale in ((torch.bfloat16, None), (torch.float16, None), (torch.float16, 0.3)):
        assert _varlen_error_ratio(*case, dtype=dtype, scale=scale) <= 1, (dtype, scale)


@pytest.mark.skipif(not _cudnn_ok(), reason="needs CUDA, nvidia-cudnn-frontend, cuDNN >= 9.6 and a Hopper GPU")
def test_cudnn_batches_of_short_documents_share_one_plan():
    """The plan key holds max_seqlen rounded up to a power of two of at least 64 (MIN_SEQ), so batches of one token
    count whose longest documents are 9, 33 and 64 tokens build one pair of graphs, not three (each build is host
    work the step waits for); 65 is the next bucket. Each batch's result is still right. Heads 10 / 5 of 64 over 128
    tokens: a key no other test builds."""
    before = set(attention_cudnn._plans)
    case = (1, 128)  # one row of 128 tokens
    heads = (10, 5, 64, "cudnn", "dense")
    for cuts in ([*range(0, 127, 9), 128], [0, 33, 66, 99, 128], [0, 64, 128]):  # longest 9, 33, 64
        assert _varlen_error_ratio(*case, cuts, *heads) <= 1, cuts
    def bounds():  # the length bound (key[3]) of each plan this test built
        return sorted(k[3] for k in attention_cudnn._plans if k not in before)

    assert attention_cudnn.MIN_SEQ == 64 and bounds() == [64]
    assert _varlen_error_ratio(*case, [0, 65, 128], *heads) <= 1
    assert bounds() == [64, 128]


def test_cudnn_ragged_meta_pads_documents_and_scales_offsets():
    """cu_seqlens [0, 3, 5, 9] padded to a 4-document bucket: the extra document is empty, offsets in elements."""
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    m = attention_cudnn.ragged_meta(cu, cap=4, hq=6, hk=2, d=8)
    assert m["seq_q"].flatten().tolist() == [3, 2, 4, 0] and m["seq_q"].dtype == torch.int32
    assert m["off_q"].flatten().tolist() == [0, 144, 240, 432, 432]  # x Hq * D = 48
    assert m["off_k"].flatten().tolist() == [0, 48, 80, 144, 144]  # x Hk * D = 16
    assert m["off_stats"].flatten().tolist() == [0, 18, 30, 54, 54]  # x Hq
    assert m["off_q"].dtype == torch.int64 and m["off_q"].shape == (5, 1, 1, 1)
    assert [attention_cudnn.bucket(n, 16) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


def test_cudnn_path_without_the_frontend_says_what_to_install(monkeypatch):
    """Also through resolve_varlen: model.attention=cudnn resolves to cudnn without probing the GPU, then imports the
    frontend at once, so the ImportError says what to pip install (not a failure later, inside the first cuDNN call)."""
    monkeypatch.setitem(__import__("sys").modules, "cudnn", None)  # import cudnn -> ImportError
    with pytest.raises(ImportError, match="pip install 'nvidia-cudnn-frontend"):
        attention_cudnn.cudnn_frontend()
    att = importlib.import_module("chronicals.ops.attention")  # the package's attribute is the function
    with pytest.raises(ImportError, match="pip install 'nvidia-cudnn-frontend"):
        att.resolve_varlen("cudnn", torch.device("cuda", 0), tokens=1024, docs=1)


def test_unknown_varlen_kernel_is_refused():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="varlen='fa3' is not one of"):
        attention(q, q, q, varlen="fa3")


def test_auto_picks_cudnn_for_documents_of_128_tokens_or_more(monkeypatch):
    """model.attention=auto: cuDNN's ragged kernels where they are installed and measured faster (mean document
    >= 128 tokens), FA2 otherwise; explicit choices are taken as they are."""
    att = importlib.import_module("chronicals.ops.attention")  # the package's attribute is the function

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention_cudnn, "cudnn_frontend", lambda: None)
    monkeypatch.setattr(att, "_hopper", lambda device: True)
    monkeypatch.setattr(attention_cudnn, "available", lambda: True)
    assert att.resolve_varlen("auto", cuda, tokens=16 * 1024, docs=128) == "cudnn"  # 128 tokens a document
    assert att.resolve_varlen("auto", cuda, tokens=16 * 1024, docs=129) == "flash"
    assert att.resolve_varlen("flash", cuda, tokens=16 * 1024, docs=1) == "flash"
    assert att.resolve_varlen("cudnn", cuda, tokens=16, docs=16) == "cudnn"
    monkeypatch.setattr(att, "_hopper", lambda device: False)
    assert att.resolve_varlen("auto", cuda, tokens=16 * 1024, docs=1) == "flash"
    monkeypatch.setattr(att, "_hopper", lambda device: True)
    monkeypatch.setattr(attention_cudnn, "available", lambda: False)
    assert att.resolve_varlen("auto", cuda, tokens=16 * 1024, docs=1) == "flash"
    # under torch.compile auto takes FA2 (the cuDNN frontend's call would break the graph); explicit cudnn stands
    monkeypatch.setattr(attention_cudnn, "available", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert att.resolve_varlen("auto", cuda, tokens=16 * 1024, docs=1) == "flash"
    assert att.resolve_varlen("cudnn", cuda, tokens=16 * 1024, docs=1) == "cudnn"


def test_shapes_cudnn_cannot_run_fall_back_to_flash_only_under_auto(caplog):
    att = importlib.import_module("chronicals.ops.attention")

    def unsupported():
        raise attention_cudnn.Unsupported("attention: cuDNN 91900 has no ragged attention kernel for 8 query / 2 key "
                                          "heads of 512")

    with caplog.at_level("WARNING", logger="chronicals.ops"):
        assert att.cudnn_or_flash("auto", unsupported, lambda: "flash ran") == "flash ran"
    assert "heads of 512; model.attention=auto runs FA2" in caplog.text
    with pytest.raises(attention_cudnn.Unsupported, match="heads of 512"):
        att.cudnn_or_flash("cudnn", unsupported, lambda: "flash ran")
    assert att.cudnn_or_flash("auto", lambda: "cudnn ran", lambda: "flash ran") == "cudnn ran"


def test_attention_notes_are_logged_once(monkeypatch, caplog):
    """Each call is one layer of one step: the cuDNN-fallback warning (flash still runs each time), the note that
    packed rows off CUDA run the masked reference, and resolve_varlen's choice are each logged once, not per call."""
    att = importlib.import_module("chronicals.ops.attention")
    monkeypatch.setattr(att, "_logged_notes", set())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(attention_cudnn, "cudnn_frontend", lambda: None)
    monkeypatch.setattr(attention_cudnn, "available", lambda: True)
    monkeypatch.setattr(att, "_hopper", lambda device: True)

    def unsupported():
        raise attention_cudnn.Unsupported("attention: no ragged kernel for these heads")

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32)
    with caplog.at_level("INFO", logger="chronicals.ops"):
        for _ in range(3):
            assert att.cudnn_or_flash("auto", unsupported, lambda: "flash ran") == "flash ran"
            attention(q, k, v, cu_seqlens=cu, impl="triton")
            assert att.resolve_varlen("auto", torch.device("cuda", 0), tokens=16 * 1024, docs=1) == "cudnn"
    lines = [r.getMessage() for r in caplog.records]
    for note in ("no ragged kernel", "packed rows on cpu", "packed rows use cudnn"):
        assert sum(note in line for line in lines) == 1, note


def test_unpacked_rows_take_sdpa_without_a_packed_rows_note(monkeypatch, caplog):
    """Rows without cu_seqlens run SDPA's causal kernels on every impl, before any packed-rows dispatch: impl="triton"
    off CUDA gives the reference's output and logs nothing about packed rows."""
    att = importlib.import_module("chronicals.ops.attention")
    monkeypatch.setattr(att, "_logged_notes", set())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with caplog.at_level("INFO", logger="chronicals.ops"):
        out = attention(q, k, v, impl="triton")
    assert torch.equal(out, att.attention_ref(q, k, v))
    assert not any("packed rows" in r.getMessage() for r in caplog.records)


def test_the_reference_refuses_a_document_across_rows():
    """The CUDA kernels read the B rows as one stream, the reference masks each row: a document that ran past a
    row's end got two answers (3.3 apart on an H200). The collator never builds one; the reference refuses it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match=r"document 0 \(tokens 0\.\.7 of cu_seqlens\) runs across a row boundary"):
        attention(q, k, v, cu_seqlens=torch.tensor([0, 8, 12], dtype=torch.int32), impl="torch")
    q3, k3, v3 = (torch.randn(3, 4, 2, 8, generator=g) for _ in range(3))  # two crossing documents: the first is named
    with pytest.raises(ValueError, match=r"document 0 \(tokens 0\.\.5 of cu_seqlens\) runs across a row boundary"):
        attention(q3, k3, v3, cu_seqlens=torch.tensor([0, 6, 10, 12], dtype=torch.int32), impl="torch")
    inside = attention(q, k, v, cu_seqlens=torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32), impl="torch")
    assert inside.shape == q.shape and torch.isfinite(inside).all()


def test_empty_documents_at_a_row_boundary_are_not_a_crossing():
    """CUDA-graph runs pad cu_seqlens by repeating its last value (B * S): empty documents at the end of the last row,
    and an empty one may sit at any row boundary. They hold no token, so they cross no row: the reference gives the
    unpadded answer (without the ends > starts test it raised 'runs across a row boundary')."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(3))
    want = attention_ref(q, k, v, cu_seqlens=torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32))
    for cu in ([0, 2, 6, 9, 12, 12, 12], [0, 2, 6, 6, 9, 12], [0, 0, 2, 6, 9, 12]):
        got = attention(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32), impl="torch")
        assert torch.equal(got, want), cu
