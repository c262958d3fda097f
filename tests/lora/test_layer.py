"""LoRALinearFunction (the fused path) against the plain-autograd reference, every gradient, odd shapes."""

import math

import pytest
import torch
import torch.nn as nn

from chronicals.lora import LoRALinear, LoRALinearFunction, lora_linear, lora_linear_ref
from chronicals.lora.layer import draw_mask
from chronicals.ops import dropout as D

# (lead dims, in, out, r); in >= 2 out (5 -> 1, 40 -> 12) takes the one-GEMM dx = [dy | s dy B] @ [W ; A]
SHAPES = [((1, 7), 13, 11, 3), ((2, 5), 16, 24, 8), ((9,), 5, 1, 1), ((3, 3), 6, 21, 4), ((2, 9), 40, 12, 5)]


def _inputs(lead, fin, fout, r, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, fin, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(fout, fin, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(fout, generator=g, dtype=torch.float64).to(dtype) if bias else None
    a = torch.randn(r, fin, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    bb = torch.randn(fout, r, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return x, w, b, a, bb


def _draw(p, seed=1):
    """A seeded dropout draw (its mask is a function of the seed and each element's index), or None."""
    if p == 0:
        return None
    torch.manual_seed(seed)
    return D.draw(p, "cpu")


def _grads(impl, x, w, b, a, bb, s, draw, dy, concat=False):
    y = lora_linear(x, w, b, a, bb, s, draw, impl=impl, concat=concat)
    gx, ga, gb = torch.autograd.grad(y, (x, a, bb), dy)
    return y, gx, ga, gb


@pytest.mark.parametrize("lead,fin,fout,r", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("concat", [False, True])
def test_fused_matches_reference_float64(lead, fin, fout, r, bias, p, concat):
    x, w, b, a, bb = _inputs(lead, fin, fout, r, torch.float64, bias)
    draw, s = _draw(p), 1.7
    dy = torch.randn(*lead, fout, dtype=torch.float64)
    got = _grads("fused", x, w, b, a, bb, s, draw, dy, concat)
    want = _grads("torch", x, w, b, a, bb, s, draw, dy)  # lora_linear_ref with the draw's mask built in full
    for g_, w_, what in zip(got, want, ("y", "dx", "dA", "dB")):
        torch.testing.assert_close(g_, w_, rtol=1e-12, atol=1e-12, msg=what)
    if p > 0:  # the mask really drops: the result differs from the no-dropout one
        assert not torch.allclose(got[0], lora_linear_ref(x, w, b, a, bb, s))
        mask = draw_mask(draw, x.shape)
        assert 0 < mask.sum() < mask.numel()
        by_hand = lora_linear_ref(x, w, b, a, bb, s, mask, draw.p_applied)  # the mask the reference was given
        torch.testing.assert_close(got[0], by_hand, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("concat", [False, True])
def test_gradcheck(p, concat):
    x, w, b, a, bb = _inputs((2, 3), 6, 5, 2, torch.float64, bias=True)
    draw = _draw(p)
    fn = lambda x_, a_, b_: LoRALinearFunction.apply(x_, w, b, a_, b_, 0.8, draw, concat)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, a, bb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_low_precision_error_no_worse_than_reference(dtype, concat, wide):
    """Both paths in ``dtype`` against float64: the fused error is at most 2x the reference's (+ eps)."""
    lead, fin, fout, r, s = (3, 37), 64, 48, 8, 2.0
    if wide:  # down_proj-like: dx from one GEMM over [dy | s dy B] and [W ; A]
        fin, fout = 96, 40
    x64, w64, b64, a64, bb64 = _inputs(lead, fin, fout, r, torch.float64, True, seed=3)
    dy64 = torch.randn(*lead, fout, dtype=torch.float64)
    exact = _grads("torch", x64, w64, b64, a64, bb64, s, None, dy64)
    low = [t.detach().to(dtype).requires_grad_(t.requires_grad) if t is not None else None
           for t in (x64, w64, b64, a64, bb64)]
    fused = _grads("fused", *low, s, None, dy64.to(dtype), concat)
    ref = _grads("torch", *low, s, None, dy64.to(dtype))
    eps = torch.finfo(dtype).eps
    for f, rf, e, what in zip(fused, ref, exact, ("y", "dx", "dA", "dB")):
        err_f = (f.double() - e).abs().max().item()
        err_r = (rf.double() - e).abs().max().item()
        assert err_f <= 2 * err_r + 4 * eps * e.abs().max().item(), (what, err_f, err_r)


@pytest.mark.parametrize("concat", [False, True])
def test_saves_no_full_size_extra_activation(concat):
    """With dropout 0 the only (N, in)-sized saved tensor is x itself (same storage), not a copy."""
    x, w, b, a, bb = _inputs((4, 8), 32, 40, 4, torch.float32, bias=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        LoRALinearFunction.apply(x, w, b, a, bb, 2.0, None, concat).sum().backward()
    big = [t for t in saved if t.numel() >= x.numel() and t.data_ptr() != w.data_ptr()]
    assert [t.data_ptr() for t in big] == [x.data_ptr()]
    small = [t for t in saved if t.shape == (32, 4)]  # x A^T (N, r)
    assert len(small) == 1


def test_frozen_base_weight_required():
    x, w, b, a, bb = _inputs((2,), 4, 3, 2, torch.float32, bias=False)
    with pytest.raises(RuntimeError, match="must be frozen"):
        LoRALinearFunction.apply(x, w.requires_grad_(), b, a, bb, 1.0, None)


def test_layer_init_and_dropout_modes():
    torch.manual_seed(0)
    base = nn.Linear(20, 12)
    layer = LoRALinear(base, r=4, alpha=8, dropout=0.5, generator=torch.Generator().manual_seed(0))
    assert layer.weight is base.weight and layer.bias is base.bias
    assert layer.scaling == 2.0 and torch.count_nonzero(layer.lora_B.weight) == 0 and not layer.concat
    assert LoRALinear(nn.Linear(4, 8), r=2, alpha=2).concat  # out >= 2 in: concatenated GEMMs
    bound = 1 / math.sqrt(20)  # kaiming_uniform(a=sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in))
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.abs().max() > 0.5 * bound
    assert LoRALinear(base, r=16, alpha=8, use_rslora=True).scaling == 2.0  # alpha / sqrt(r)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 20)
    layer.eval()  # no dropout at eval: deterministic and equal to the reference
    torch.testing.assert_close(layer(x), lora_linear_ref(x, base.weight, base.bias, layer.lora_A.weight,
                                                         layer.lora_B.weight, 2.0))
    layer.train()
    torch.manual_seed(5)
    y1 = layer(x)
    torch.manual_seed(5)
    torch.testing.assert_close(layer(x), y1)  # same seed, same mask
    assert not torch.allclose(layer(x), y1)


def test_lora_linear_refuses_a_mask_where_a_draw_goes():
    """lora_linear took (mask, dropout) before it took a DropDraw: that old call failed with "impl=0.1 is not one
    of" (or an AttributeError on the mask's .seed); now the error names the argument and how to make one."""
    x, w, b, a, bb = _inputs((2, 3), 6, 5, 2, torch.float64, bias=False)
    mask = torch.rand(2, 3, 6) >= 0.1
    fix = r"draw must be an ops\.dropout\.DropDraw .*ops\.dropout\.draw\(p, device\)"
    with pytest.raises(TypeError, match=fix):
        lora_linear(x, w, b, a, bb, 1.0, mask, 0.1)
    for impl in ("fused", "torch"):
        with pytest.raises(TypeError, match=fix):
            lora_linear(x, w, b, a, bb, 1.0, mask, impl=impl)


def test_fused_direct_call_with_wider_adapters_says_what_to_pass():
    """fp32 A and B on a bf16 x (an adapter loaded as PEFT keeps it) failed inside torch.mm ("expected m1 and m2 to
    have the same dtype"); the reference computes that case, as LoRALinear does."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(6, 8, dtype=torch.bfloat16)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    with pytest.raises(ValueError, match=r"takes A and B in x's dtype \(torch.bfloat16\), got A torch.float32 .* "
                                         r"pass impl='torch'"):
        lora_linear(x, w, None, a, b, 0.5)
    assert lora_linear(x, w, None, a, b, 0.5, impl="torch").dtype == torch.bfloat16


def test_delta_weight_is_computed_without_autograd():
    """s B A for merging: no graph back to the adapters (merge_lora copies it into W)."""
    m = LoRALinear(nn.Linear(5, 3, dtype=torch.float64), r=2, alpha=4)
    assert m.lora_A.weight.requires_grad and not m.delta_weight().requires_grad
    assert m.delta_weight().dtype == torch.float64


@pytest.mark.parametrize("wide", ["A", "B"])
def test_delta_weight_is_float64_when_either_adapter_is(wide):
    """An fp32 layer with one float64 adapter matrix computes s B A in float64, not rounded through fp32."""
    g = torch.Generator().manual_seed(0)
    m = LoRALinear(nn.Linear(5, 3), r=2, alpha=4, generator=g)
    for mod, dt in ((m.lora_A, torch.float64 if wide == "A" else torch.float32),
                    (m.lora_B, torch.float64 if wide == "B" else torch.float32)):
        mod.weight = nn.Parameter(torch.randn(mod.weight.shape, generator=g, dtype=dt))
    want = m.scaling * (m.lora_B.weight.double() @ m.lora_A.weight.double())
    assert m.delta_weight().dtype == torch.float64
    torch.testing.assert_close(m.delta_weight(), want, rtol=1e-15, atol=0)


def test_the_layer_checks_impl_and_concat_as_apply_lora_does():
    """LoRALinear built directly: an unknown impl is refused (not silently the fused path), and concat other than
    'auto', True or False is refused (not read by truthiness)."""
    with pytest.raises(ValueError, match=r"LoRALinear: impl='triton' is not one of \('fused', 'torch'\)"):
        LoRALinear(nn.Linear(4, 3), r=2, alpha=2, impl="triton")
    for concat in ("yes", None, "false"):
        with pytest.raises(ValueError, match=rf"LoRALinear: concat={concat!r} must be 'auto', True or False"):
            LoRALinear(nn.Linear(4, 3), r=2, alpha=2, concat=concat)


def test_a_replaced_base_weight_is_used_by_the_concatenated_layout():
    """The concatenated layout keeps W inside a private [W | s B] buffer: a base weight replaced from outside
    (``weight.data = ...``, as a loader or a user may do) is what the next forward computes with."""
    g = torch.Generator().manual_seed(0)
    layer = LoRALinear(nn.Linear(4, 8, dtype=torch.float64), r=2, alpha=2, generator=g)
    assert layer.concat and layer._uses_wcat
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(8, 2, generator=g, dtype=torch.float64))
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    layer(x)  # the buffer is bound and used once
    layer.weight.data = torch.randn(8, 4, generator=g, dtype=torch.float64)
    want = lora_linear_ref(x, layer.weight, layer.bias, layer.lora_A.weight, layer.lora_B.weight, layer.scaling)
    torch.testing.assert_close(layer(x), want)


def test_a_merge_rounds_once_and_gives_w_its_own_storage():
    """float64 adapters on an fp32 layer merge in float64 and round once to W's dtype; a W that lived in the
    [W | s B] buffer gets a contiguous storage of its own (no view keeping the r extra columns alive)."""
    from chronicals.lora import apply_lora, merge_lora

    g = torch.Generator().manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 12), r=4, alpha=8, adapter_dtype=torch.float64, generator=g, concat=False)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(12, 4, generator=g, dtype=torch.float64))
    assert layer.delta_weight().dtype == torch.float64
    want = (layer.weight.double() + layer.scaling * (layer.lora_B.weight @ layer.lora_A.weight)).float()
    lin = layer.to_linear()
    assert lin.weight.dtype == torch.float32 and torch.equal(lin.weight, want)
    layer = LoRALinear(nn.Linear(4, 8), r=2, alpha=2)
    layer(torch.randn(3, 4))
    assert layer.concat and not layer.weight.is_contiguous()  # W is a view into [W | s B]
    lin = layer.to_linear()
    assert lin.weight.is_contiguous() and lin.weight.untyped_storage().nbytes() == 8 * 4 * 4
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 16))
    apply_lora(model, r=2, alpha=4, target_modules=["0", "2"], group=False)
    model(torch.randn(2, 4))
    merge_lora(model)
    assert all(p.is_contiguous() for p in model.parameters()) and model[0].weight.untyped_storage().nbytes() == 128


@pytest.mark.parametrize("trained", ["A", "B", "AB"])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("concat", [False, True])
def test_each_subset_of_x_a_b_gets_the_reference_gradient_float64(trained, x_grad, p, concat):
    """Only some of x, A and B needing a gradient (a first layer's input needs none; a frozen A or B): each one that
    does gets its float64 reference gradient, with and without dropout."""
    x, w, b, a, bb = _inputs((2, 3), 6, 5, 2, torch.float64, bias=True)
    x.requires_grad_(x_grad)
    a.requires_grad_("A" in trained)
    bb.requires_grad_("B" in trained)
    wrt = ([x] if x_grad else []) + ([a] if "A" in trained else []) + ([bb] if "B" in trained else [])
    draw = _draw(p)
    dy = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(lora_linear(x, w, b, a, bb, 1.7, draw, concat=concat), wrt, dy)
    want = torch.autograd.grad(lora_linear(x, w, b, a, bb, 1.7, draw, impl="torch"), wrt, dy)
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-12, atol=1e-12)


def test_fused_direct_call_with_only_b_wider_says_what_to_pass():
    """A in x's dtype and B wider (fp32 on bf16) is refused by name as wider A and B are, not left to torch.mm; the
    impl='torch' it names computes it, with A cast (exactly) to B's fp32."""
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    a, b = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(6, 2)
    with pytest.raises(ValueError, match=r"takes A and B in x's dtype \(torch.bfloat16\), got A torch.bfloat16 "
                                         r"and B torch.float32"):
        lora_linear(x, w, None, a, b, 0.5)
    got = lora_linear(x, w, None, a, b, 0.5, impl="torch")
    assert got.dtype == torch.bfloat16 and torch.equal(got, lora_linear_ref(x, w, None, a.float(), b, 0.5))
