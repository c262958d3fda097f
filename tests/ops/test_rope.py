"""QK-RoPE Triton kernel vs a float64 reference, with PyTorch's own error in the same dtype as the yardstick.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops import rope_cos_sin, rope_qk, rope_qk_ref
from chronicals.ops._impl import triton_interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (Hq, Hk, D, R): Hq * D spans the hidden sizes 64, 576, 896, 1000, 4864; odd head counts, GQA, partial
# rotary with a half (25) that is no power of two, and 38 query heads (not a power of two either)
HEADS = [(1, 1, 64, 64), (9, 3, 64, 64), (14, 2, 64, 64), (10, 2, 100, 50), (38, 2, 128, 128)]


def packed_positions(batch, seqlen, gen):
    """(B, S) positions restarting at 0 at document starts inside each row (packed rows): always one at
    S // 2, plus random ones. Row b's first document starts at position 1000 * b (large angles too)."""
    pos = torch.empty(batch, seqlen, dtype=torch.int64)
    for b in range(batch):
        starts = torch.zeros(seqlen, dtype=torch.bool)
        starts[torch.randint(0, seqlen, (seqlen // 5,), generator=gen)] = True
        starts[seqlen // 2] = seqlen > 1
        starts[0] = True
        doc_start = torch.cummax(torch.where(starts, torch.arange(seqlen), 0), 0).values
        pos[b] = torch.arange(seqlen) - doc_start + torch.where(doc_start == 0, 1000 * b, 0)
    return pos


def _run(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    loss = (qo.double() * dq).sum() + (ko.double() * dk).sum()
    return [qo, ko, *torch.autograd.grad(loss, [q, k])]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("seqlen", [1, 7, 123])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, seqlen, heads):
    hq, hk, d, r = heads
    batch = 2
    g = torch.Generator().manual_seed(seqlen * 31 + hq * d)
    pos = packed_positions(batch, seqlen, g)
    if seqlen > 1:
        assert (pos[:, 1:] == 0).any(-1).all(), "every row must restart its positions mid-row"
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    cos, sin = rope_cos_sin(pos, inv_freq, dtype=dtype)  # the decoder builds them in the activations' dtype
    cos, sin = cos.to(DEV), sin.to(DEV)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)

    q, k = rnd(batch, seqlen, hq, d), rnd(batch, seqlen, hk, d)
    dq, dk = rnd(batch, seqlen, hq, d).double(), rnd(batch, seqlen, hk, d).double()
    ref64 = _run(rope_qk_ref, q.double(), k.double(), cos.double(), sin.double(), dq, dk)
    theirs = _run(rope_qk_ref, q, k, cos, sin, dq, dk)
    ours = _run(lambda *a: rope_qk(*a, impl="triton"), q, k, cos, sin, dq, dk)
    for name, o, t, e in zip(["q", "k", "dq", "dk"], ours, theirs, ref64):
        assert o.dtype == dtype and o.shape == e.shape, name
        assert_tracks_torch(name, o, t, e)


def test_strided_inputs_and_broadcast_cos():
    """q/k as transposed views of (B, H, S, D) and cos/sin of shape (1, S, R) broadcast over the batch."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 9, 32, generator=g).to(DEV).transpose(1, 2).requires_grad_()  # (B, S, 4, 32)
    k = torch.randn(3, 2, 9, 32, generator=g).to(DEV).transpose(1, 2).requires_grad_()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    cos, sin = rope_cos_sin(torch.arange(9)[None], inv_freq)
    _triton_matches_reference(q, k, cos.to(DEV), sin.to(DEV), g)


def _triton_matches_reference(q, k, cos, sin, g):
    """The Triton rope_qk's outputs and q / k gradients (under a random upstream gradient) equal rope_qk_ref's."""
    ours, ref = rope_qk(q, k, cos, sin, impl="triton"), rope_qk_ref(q, k, cos, sin)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    w = [torch.randn(t.shape, generator=g).to(DEV) for t in ref]
    got = torch.autograd.grad(sum((a * b).sum() for a, b in zip(ours, w)), [q, k])
    want = torch.autograd.grad(sum((a * b).sum() for a, b in zip(ref, w)), [q, k])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_cos_contiguous_and_sin_broadcast_over_the_batch():
    """The kernel reads cos and sin at one set of strides: when they differ (cos (B, S, R) contiguous, sin an
    expanded (1, S, R)) the launcher lays both out alike first. Without that, sin was read at cos's batch stride
    (past its one row of storage for b >= 1): wrong outputs and gradients."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 5, 2, 16, generator=g).to(DEV).requires_grad_()
    k = torch.randn(3, 5, 1, 16, generator=g).to(DEV).requires_grad_()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    cos, sin = (t.to(DEV) for t in rope_cos_sin(torch.arange(5)[None], inv_freq))  # (1, 5, 16)
    cos, sin = cos.expand(3, 5, 16).contiguous(), sin.expand(3, 5, 16)  # sin: stride 0 over the batch
    assert cos.stride() != sin.stride()
    _triton_matches_reference(q, k, cos, sin, g)


@pytest.mark.parametrize("d,r", [(16, 16), (20, 12)])
def test_cos_and_sin_with_unequal_halves_match_the_reference(d, r):
    """rope_qk takes any (B, S, R) cos/sin and rotates with both halves of each, like rope_qk_ref, forward and
    backward, full and partial rotary. rope_cos_sin builds equal halves, so a kernel that read the first half of
    cos or sin twice (or swapped the halves in backward) passed every other test."""
    g = torch.Generator().manual_seed(d + r)
    q = torch.randn(2, 5, 3, d, generator=g).to(DEV).requires_grad_()
    k = torch.randn(2, 5, 1, d, generator=g).to(DEV).requires_grad_()
    cos, sin = (torch.randn(2, 5, r, generator=g).to(DEV) for _ in range(2))
    _triton_matches_reference(q, k, cos, sin, g)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_zero_rotary_dims_leave_q_and_k_unchanged(impl):
    """R = 0 passes the argument checks (even, <= D): every dim passes through, forward and backward. The launcher's
    BLOCK_HALF = next_power_of_2(max(R // 2, 1)) keeps the kernel's tile non-empty (without the max the
    interpreter raised from tl.arange(0, 0))."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 2, 8, generator=g).to(DEV).requires_grad_()
    k = torch.randn(2, 3, 1, 8, generator=g).to(DEV).requires_grad_()
    cos = torch.empty(2, 3, 0, device=DEV)
    qo, ko = rope_qk(q, k, cos, cos, impl=impl)
    assert torch.equal(qo, q) and torch.equal(ko, k)
    (qo.sum() + 2 * ko.sum()).backward()
    assert torch.equal(q.grad, torch.ones_like(q)) and torch.equal(k.grad, 2 * torch.ones_like(k))


def test_cos_and_sin_are_fp32_angles_scaled_and_cast_for_any_inv_freq_dtype():
    """rope_cos_sin takes its angles in fp32 whatever inv_freq's dtype (a float64 model's buffer too), as transformers
    does; both tables are multiplied by attention_scaling and returned in the dtype asked for."""
    pos = torch.arange(4096).reshape(2, 2048)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # (R/2,), R = 16
    freqs = pos.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = rope_cos_sin(pos, inv_freq, attention_scaling=0.5, dtype=torch.float64)
    assert cos.dtype == sin.dtype == torch.float64 and cos.shape == (2, 2048, 16)
    assert torch.equal(cos, (emb.cos() * 0.5).double()) and torch.equal(sin, (emb.sin() * 0.5).double())


def test_bad_inputs_say_what_is_wrong():
    q, k = torch.randn(1, 4, 2, 16, device=DEV), torch.randn(1, 4, 1, 16, device=DEV)
    cos = torch.randn(1, 4, 16, device=DEV)
    with pytest.raises(ValueError, match="does not differentiate cos/sin"):
        rope_qk(q, k, cos.requires_grad_(), cos.detach(), impl="triton")
    with pytest.raises(ValueError, match="does not differentiate cos/sin"):  # sin too: it got no gradient
        rope_qk(q, k, cos.detach(), cos.detach().clone().requires_grad_(), impl="triton")
    with pytest.raises(ValueError, match="must be even and <= head_dim"):
        rope_qk(q, k, torch.randn(1, 4, 18, device=DEV), torch.randn(1, 4, 18, device=DEV), impl="triton")
    with pytest.raises(ValueError, match="expected q"):
        rope_qk(q[0], k, cos.detach(), cos.detach(), impl="triton")


def test_registered_op_passes_opcheck_and_compiles():
    q = torch.randn(2, 3, 4, 16, device=DEV, requires_grad=True)
    k = torch.randn(2, 3, 2, 16, device=DEV, requires_grad=True)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # partial: R = 8 of 16
    cos, sin = (t.to(DEV) for t in rope_cos_sin(torch.arange(3).repeat(2, 1), inv_freq))
    torch.library.opcheck(torch.ops.chronicals.rope_qk.default, (q, k, cos, sin))

    def f(q_, k_):
        qo, ko = rope_qk(q_, k_, cos, sin, impl="triton")
        return qo.square().sum() + ko.sum()

    def f_ref(q_, k_):
        qo, ko = rope_qk_ref(q_, k_, cos, sin)
        return qo.square().sum() + ko.sum()

    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k), [q, k])
    want = torch.autograd.grad(f_ref(q, k), [q, k])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_eager_door_and_compiled_door_agree():
    """Eager calls take RopeQKFunction (no custom-op dispatch); torch.compile sees chronicals::rope_qk as one
    node; both match the custom op's outputs and gradients, including a k whose output is unused."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 5, 3, 16, generator=g).to(DEV).requires_grad_()
    k = torch.randn(2, 5, 1, 16, generator=g).to(DEV).requires_grad_()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    cos, sin = (t.to(DEV) for t in rope_cos_sin(torch.arange(5).repeat(2, 1), inv_freq))
    qo, ko = rope_qk(q, k, cos, sin, impl="triton")
    assert type(qo.grad_fn).__name__ == "RopeQKFunctionBackward"
    qw, kw = torch.ops.chronicals.rope_qk(q, k, cos, sin)
    torch.testing.assert_close((qo, ko), (qw, kw), rtol=0, atol=0)
    got = torch.autograd.grad(qo.square().sum(), [q, k])
    want = torch.autograd.grad(qw.square().sum(), [q, k], allow_unused=True, materialize_grads=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)

    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(lambda a, b: rope_qk(a, b, cos, sin, impl="triton"), backend=backend, fullgraph=True)(q, k)
    targets = [t.removesuffix(".default") for t in targets]
    assert "chronicals.rope_qk" in targets and not any("autograd_function" in t for t in targets), targets


@pytest.mark.parametrize("heads", [(9, 3, 64, 64), (10, 2, 100, 50), (1, 1, 8, 8)], ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_qkv_matches_the_split_and_rope_qk_and_its_gradient_is_theirs(dtype, heads):
    """rope_qkv rotates q and k out of one GEMM's (B, S, Hq + 2 Hk, D) output and copies v; backward writes dq, dk
    (the rotation's kernel, into their heads) and dv into one gradient: the same bits as split + rope_qk + cat, and
    float64's values to the dtype's rounding."""
    from chronicals.ops import rope_qkv

    hq, hk, d, r = heads
    g = torch.Generator().manual_seed(hq * d + r)
    pos = packed_positions(2, 13, g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    cos, sin = (t.to(DEV) for t in rope_cos_sin(pos, inv_freq, dtype=dtype))
    wide = torch.randn(2, 13, hq + 2 * hk + 1, d, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    qkv0 = wide[:, :, 1:]  # strided: a token stride of (Hq + 2 Hk + 1) D, as a column block of a wider GEMM output
    dq, dk, dv = (torch.randn(2, 13, h, d, generator=g, dtype=torch.float64).to(DEV) for h in (hq, hk, hk))

    def run(fn, qkv):
        qkv = qkv.detach().requires_grad_()
        q, k, v = fn(qkv)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        loss = (q.double() * dq).sum() + (k.double() * dk).sum() + (v.double() * dv).sum()
        return [q, k, v, torch.autograd.grad(loss, qkv)[0]]

    def split(impl, c=cos, s_=sin):
        def fn(qkv):
            q, k, v = qkv.split([hq, hk, hk], dim=2)
            return (*rope_qk(q, k, c, s_, impl=impl), v.contiguous())
        return fn

    got = run(lambda qkv: rope_qkv(qkv, cos, sin, hq, hk, impl="triton"), qkv0)
    for a, b in zip(got, run(split("triton"), qkv0)):
        assert torch.equal(a, b)
    exact = run(split("torch", cos.double(), sin.double()), qkv0.double())
    for a, b in zip(got, exact):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-6 if dtype == torch.float32 else 3e-2)
    assert got[3].is_contiguous()


def test_rope_qkv_refuses_a_head_count_its_tensor_does_not_have():
    from chronicals.ops import rope_qkv

    cos = sin = torch.ones(1, 3, 8, device=DEV)
    with pytest.raises(ValueError, match=r"must be \(B, S, nq \+ 2 nkv = 6, D\)"):
        rope_qkv(torch.zeros(1, 3, 5, 8, device=DEV), cos, sin, 4, 1)
