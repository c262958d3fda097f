"""The LoRA MLP path (SwiGLU product recomputed in backward) and partial activation checkpointing,
against the plain path in float64: outputs and every gradient, LoRA and non-LoRA."""

import os

import pytest
import torch
import torch.nn as nn

from chronicals.lora import LoRALinear, apply_lora, merge_lora
from chronicals.lora.layer import LoRALinearFunction, draw_mask, lora_linear
from chronicals.lora.mlp import LoRASwiGLUDownFunction
from chronicals.ops import dropout as D
from chronicals.ops.swiglu import swiglu_ref

from .conftest import randomize_lora_b, tiny_model

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the Triton cases run the real kernels where there is a GPU, else the interpreter on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = DEV == "cuda" or INTERPRETING


def _randn(g, *shape):
    """Standard normal numbers drawn on the CPU by generator g (the same on every machine), on DEV."""
    return torch.randn(*shape, generator=g).to(DEV)


def _old_mlp(mlp, x):
    """The path before forward_swiglu: down_proj's own forward on the materialized product."""
    return mlp.down_proj(swiglu_ref(mlp.gate_proj(x), mlp.up_proj(x)))


def _mlp_grads(mlp, x, dy, fn, seed=3):
    params = [p for p in mlp.parameters() if p.requires_grad]
    xs = x.clone().requires_grad_()
    torch.manual_seed(seed)  # the same dropout masks on both paths
    y = fn(mlp, xs)
    return [y, *torch.autograd.grad(y, [xs, *params], dy)]


@pytest.mark.parametrize("targets", [ALL7, ("down_proj",), ("gate_proj", "up_proj"), ("q_proj",)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("concat", ["auto", True])
def test_lora_mlp_matches_plain_path_float64(targets, dropout, concat):
    model = tiny_model(kind="qwen2").double().train()
    apply_lora(model, r=3, alpha=5, dropout=dropout, target_modules=targets, concat=concat)
    randomize_lora_b(model)
    mlp = model.model.layers[1].mlp
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    new = _mlp_grads(mlp, x, dy, lambda m, t: m(t))
    old = _mlp_grads(mlp, x, dy, _old_mlp)
    assert len(new) == 2 + 2 * sum(t in ("gate_proj", "up_proj", "down_proj") for t in targets)
    for i, (a, b) in enumerate(zip(new, old)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"output/grad {i}")
    assert isinstance(mlp.down_proj, LoRALinear) == ("down_proj" in targets)


def test_non_lora_mlp_unchanged_float64():
    """Full fine-tuning: a plain down_proj takes the old path; weights get their gradients too."""
    model = tiny_model().double().train()
    mlp = model.model.layers[0].mlp
    assert not hasattr(mlp.down_proj, "forward_swiglu")
    x = torch.randn(3, 4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(3, 4, 32, dtype=torch.float64)
    new, old = _mlp_grads(mlp, x, dy, lambda m, t: m(t)), _mlp_grads(mlp, x, dy, _old_mlp)
    assert len(new) == 2 + 3  # y, dx, dW of gate / up / down
    for a, b in zip(new, old):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _n_by_i_saved(mlp, x, fn):
    """How many (N, I) tensors' worth autograd saves for one MLP forward ``fn(mlp, x)``: distinct saved
    tensors of N x I elements count 1, packed (N, 2I) ones (gu of a LoRA group) count 2."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fn(mlp, x.requires_grad_())
    y.sum().backward()  # outside the hooks: what backward saves for itself is transient
    n_i = x[..., :1].numel() * mlp.gate_proj.out_features
    sizes = {t.data_ptr(): t.numel() // n_i for t in saved if t.numel() in (n_i, 2 * n_i)}
    return sum(sizes.values())


def test_lora_mlp_does_not_keep_the_swiglu_product():
    model = tiny_model().train()
    apply_lora(model, r=2, alpha=4)
    mlp, x = model.model.layers[0].mlp, torch.randn(2, 7, 32)
    # old path with the reference SwiGLU: gate, silu(gate), up (SwiGLU's autograd) and act (down's input)
    assert _n_by_i_saved(mlp, x.clone(), _old_mlp) == 4
    assert mlp.__dict__.get("lora_gate_up") is not None  # gate/up as one GEMM: gu (N, 2I) is what is saved
    assert _n_by_i_saved(mlp, x.clone(), lambda m, t: m(t)) == 2  # gu only
    mlp.down_proj.recompute_swiglu = False  # the switch the benchmark flips: the product kept again
    assert _n_by_i_saved(mlp, x.clone(), lambda m, t: m(t)) >= 3  # gu, act (and the SwiGLU autograd's own)


def test_down_proj_only_lora_trains_the_first_layer_whose_mlp_input_needs_no_grad(ids):
    """LoRA on down_proj only: in layer 0 gate and up need no gradient (embedding, attention, gate/up all frozen), so
    the backward must skip the SwiGLU backward there and still give lora_A / lora_B their gradients (it ran the
    SwiGLU backward on a gradient that was never computed: an AttributeError on None)."""
    model = tiny_model(kind="qwen2").train()
    apply_lora(model, r=2, alpha=4, target_modules=("down_proj",))
    randomize_lora_b(model)
    _, grads = _model_grads(model, ids)
    down = [g for n, g in grads.items() if n.startswith("model.layers.0.mlp.down_proj.")]
    assert len(down) == 2 and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in down)


SHAPES = [((1, 7), 11, 13, 3), ((2, 3), 24, 6, 4), ((5,), 1, 9, 1)]  # (lead dims, I, H, r)


@pytest.mark.parametrize("lead,fi,fo,r", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_function_matches_reference_float64(lead, fi, fo, r, bias, p, concat, packed):
    """packed: the function takes gu = [gate | up] (..., 2I) and returns d_gu whole."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gate, up, a, b = rnd(*lead, fi), rnd(*lead, fi), rnd(r, fi), rnd(fo, r)
    w, bi, dy = rnd(fo, fi), (rnd(fo) if bias else None), rnd(*lead, fo)
    torch.manual_seed(int(p * 100) + fi)
    draw = D.draw(p, "cpu") if p else None
    mask = None if draw is None else draw_mask(draw, (*lead, fi))
    ins = [t.requires_grad_() for t in (gate, up, a, b)]
    if packed:
        gu = torch.cat([gate, up], dim=-1).detach().requires_grad_()
        got_y = LoRASwiGLUDownFunction.apply(gu, None, w, bi, a, b, 1.3, draw, concat, None, "torch")
        dgu, da, db = torch.autograd.grad(got_y, [gu, a, b], dy)
        got = [got_y, dgu[..., :fi], dgu[..., fi:], da, db]
    else:
        got_y = LoRASwiGLUDownFunction.apply(gate, up, w, bi, a, b, 1.3, draw, concat, None, "torch")
        got = [got_y, *torch.autograd.grad(got_y, ins, dy)]
    act = swiglu_ref(gate, up)
    actd = act if mask is None else act * mask / (1 - draw.p_applied)
    want_y = nn.functional.linear(act, w, bi) + 1.3 * (actd @ a.t()) @ b.t()
    want = [want_y, *torch.autograd.grad(want_y, ins, dy)]
    for i, (x_, y_) in enumerate(zip(got, want)):
        torch.testing.assert_close(x_, y_, rtol=1e-12, atol=1e-12, msg=f"output/grad {i}")


def test_function_gradcheck():
    g = torch.Generator().manual_seed(1)
    gate, up, a, b = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
                      for s in ((2, 3, 5), (2, 3, 5), (2, 5), (4, 2)))
    w = torch.randn(4, 5, dtype=torch.float64)
    fn = lambda g_, u_, a_, b_: LoRASwiGLUDownFunction.apply(g_, u_, w, None, a_, b_, 0.7, None,  # noqa: E731
                                                              False, None, "torch")
    assert torch.autograd.gradcheck(fn, (gate, up, a, b))


@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_function_is_lora_linear_on_the_product_bit_for_bit(concat, p):
    """The function computes what down_proj's own LoRALinearFunction computes on act = silu(gate) * up, in the same
    GEMM layout (concat: [W | s B], built per call when none is passed; else W and the rank-r GEMMs apart): output and
    the gradients of gate, up, A and B are the same float32 bits, dropout included."""
    g = torch.Generator().manual_seed(6)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    fi, fo, r, lead = 24, 10, 4, (3, 5)
    gate0, up0, a0, b0, w, bi, dy = rnd(*lead, fi), rnd(*lead, fi), rnd(r, fi), rnd(fo, r), rnd(fo, fi), rnd(fo), \
        rnd(*lead, fo)
    torch.manual_seed(2)
    draw = D.draw(p, "cpu") if p else None

    def grads(fused_mlp):
        ins = [t.clone().requires_grad_() for t in (gate0, up0, a0, b0)]
        gate, up, a, b = ins
        if fused_mlp:
            y = LoRASwiGLUDownFunction.apply(gate, up, w, bi, a, b, 1.3, draw, concat, None, "torch")
        else:
            y = LoRALinearFunction.apply(swiglu_ref(gate, up), w, bi, a, b, 1.3, draw, concat, None)
        return [y, *torch.autograd.grad(y, ins, dy)]

    for i, (x_, y_) in enumerate(zip(grads(True), grads(False))):
        assert torch.equal(x_, y_), f"output/grad {i}"


def test_a_frozen_lora_a_skips_the_swiglu_recompute(swiglu_forwards):
    """Only dA reads the SwiGLU product in backward: with lora_A frozen (B trained) the backward does not rebuild it,
    one SwiGLU forward in all, and dgate, dup and dB are the float64 reference's."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gate, up, a, b, w, dy = rnd(2, 3, 5), rnd(2, 3, 5), rnd(2, 5), rnd(4, 2), rnd(4, 5), rnd(2, 3, 4)
    ins = [t.requires_grad_() for t in (gate, up, b)]
    got = torch.autograd.grad(LoRASwiGLUDownFunction.apply(gate, up, w, None, a, b, 1.3, None, False, None, "torch"),
                              ins, dy)
    assert len(swiglu_forwards) == 1
    act = swiglu_ref(gate, up)
    want = torch.autograd.grad(nn.functional.linear(act, w) + 1.3 * (act @ a.t()) @ b.t(), ins, dy)
    for x_, y_ in zip(got, want):
        torch.testing.assert_close(x_, y_, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("which", ["gate", "up"])
def test_function_with_only_gate_or_only_up_needing_a_gradient(which):
    """LoRA on up_proj (or gate_proj) and down_proj only: in layer 0 the other projection's output needs no
    gradient. The SwiGLU backward must still run for the one that does (keyed on gate alone, up got no gradient and
    autograd raised "not used in the graph"): its gradient and dA as the float64 reference's."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gate, up, a, b, w, dy = rnd(2, 3, 5), rnd(2, 3, 5), rnd(2, 5), rnd(4, 2), rnd(4, 5), rnd(2, 3, 4)
    t = (gate if which == "gate" else up).requires_grad_()
    a.requires_grad_()
    y = LoRASwiGLUDownFunction.apply(gate, up, w, None, a, b, 1.3, None, False, None, "torch")
    got = torch.autograd.grad(y, [t, a], dy)
    act = swiglu_ref(gate, up)
    want = torch.autograd.grad(nn.functional.linear(act, w) + 1.3 * (act @ a.t()) @ b.t(), [t, a], dy)
    for x_, y_ in zip(got, want):
        torch.testing.assert_close(x_, y_, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_triton_swiglu_inside_lora_mlp():
    """impl="triton": the recompute and the SwiGLU backward run the ops' kernels; fp32 vs the torch path."""
    model = tiny_model().train()
    apply_lora(model, r=2, alpha=4)
    randomize_lora_b(model)
    model.to(DEV)
    mlp = model.model.layers[0].mlp
    x, dy = torch.randn(2, 5, 32, device=DEV), torch.randn(2, 5, 32, device=DEV)
    ref = _mlp_grads(mlp, x, dy, lambda m, t: m(t))
    model.set_impl("triton")
    got = _mlp_grads(mlp, x, dy, lambda m, t: m(t))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def swiglu_forwards(monkeypatch):
    """A list that grows by one at every SwiGLU forward the LoRA MLP runs (its forward and any recompute)."""
    import chronicals.lora.mlp as mlp_mod

    calls = []
    real_fwd = mlp_mod.swiglu_for_impl
    monkeypatch.setattr(mlp_mod, "swiglu_for_impl", lambda *a, **k: calls.append(1) or real_fwd(*a, **k))
    return calls


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("concat", [False, True])
def test_packed_triton_backward_writes_act_in_the_swiglu_kernel(swiglu_forwards, p, concat, in_place):
    """Packed gu on Triton: the SwiGLU backward kernel also writes act for dA (no second SwiGLU forward).
    Gradients equal the recompute path's bit for bit, and track the float64 reference; the kernel that
    rebuilt act before must not run any more."""
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: _randn(g, *s)  # noqa: E731
    fi, fo, r, lead = 24, 10, 4, (3, 7)
    gu0, a0, b0 = rnd(*lead, 2 * fi), rnd(r, fi), rnd(fo, r)
    w, bi, dy = rnd(fo, fi), rnd(fo), rnd(*lead, fo)
    torch.manual_seed(2)
    draw = D.draw(p, DEV) if p else None

    def grads(dtype=torch.float32, impl="triton", fused=True):
        # a copy: in place, the backward writes d_gu over the gu it was given (the decoder's own GEMM output)
        gu, a, b = (t.to(dtype, copy=True).requires_grad_() for t in (gu0, a0, b0))
        y = LoRASwiGLUDownFunction.apply(gu, None, w.to(dtype), bi.to(dtype), a, b, 1.3, draw, concat, None,
                                         impl, fused, in_place and fused)
        return [y, *torch.autograd.grad(y, [gu, a, b], dy.to(dtype))]

    fused = grads()
    assert len(swiglu_forwards) == 1  # the forward's only
    plain = grads(fused=False)
    assert len(swiglu_forwards) == 3  # forward + the recompute in backward
    for i, (x_, y_) in enumerate(zip(fused, plain)):
        assert torch.equal(x_, y_), f"output/grad {i} differs from the recompute path"
    for i, (x_, y_) in enumerate(zip(fused, grads(torch.float64, "torch"))):
        torch.testing.assert_close(x_.double(), y_, rtol=1e-5, atol=1e-5, msg=f"output/grad {i}")


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_model_option_picks_the_swiglu_product_source(swiglu_forwards):
    """RuntimeOptions.fused_swiglu_recompute reaches a grouped LoRA MLP: True, the backward kernel writes the
    product (one SwiGLU forward per layer); False, a second forward rebuilds it. Same gradients."""
    model = tiny_model().train()
    apply_lora(model, r=2, alpha=4)  # gate/up form a group: the MLP passes packed gu to down_proj
    randomize_lora_b(model)
    model.set_impl("triton")
    model.to(DEV)
    mlp = model.model.layers[0].mlp
    x, dy = torch.randn(2, 5, 32, device=DEV), torch.randn(2, 5, 32, device=DEV)
    got = {}
    for fused in (True, False):
        model.opts.fused_swiglu_recompute = fused
        swiglu_forwards.clear()
        got[fused] = _mlp_grads(mlp, x, dy, lambda m, t: m(t))
        assert len(swiglu_forwards) == (1 if fused else 2)
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- checkpointing the first k layers


def _model_grads(model, ids):
    for p in model.parameters():
        p.grad = None
    loss = model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_k_layers_same_gradients(lora, ids):
    model = tiny_model().double().train()
    if lora:
        apply_lora(model, r=2, alpha=4)
        randomize_lora_b(model)
    calls = []
    for i, layer in enumerate(model.model.layers):
        # a pre-hook: the recompute stops early once it has what backward needs, before a post-hook would run
        layer.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    base_loss, base = _model_grads(model.set_checkpointing(False), ids)
    assert calls == [0, 1]
    for k, recomputed in ((1, [0]), (2, [0, 1]), (True, [0, 1]), (5, [0, 1]), (0, [])):
        calls.clear()
        loss, grads = _model_grads(model.set_checkpointing(k), ids)
        assert sorted(calls) == sorted([0, 1] + recomputed), (k, calls)  # checkpointed layers run twice
        assert torch.equal(loss, base_loss)
        for n, g in grads.items():
            torch.testing.assert_close(g, base[n], rtol=1e-13, atol=1e-13, msg=f"k={k} {n}")


def test_checkpointing_rejects_bad_values():
    model = tiny_model()
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="checkpointing="):
            model.set_checkpointing(bad)
    assert model.set_checkpointing(True).opts.checkpointed_layers(2) == 2
    assert model.set_checkpointing(1).opts.checkpointed_layers(2) == 1


# ---------------------------------------------------------------- the persistent [W | s B] buffer


def test_concat_buffer_is_w_itself_and_follows_b():
    torch.manual_seed(0)
    base = nn.Linear(4, 12, bias=True)
    w0 = base.weight.detach().clone()
    layer = LoRALinear(base, r=3, alpha=6)
    assert layer.concat and layer.weight is base.weight
    assert layer.weight.data_ptr() == layer._wcat.data_ptr() and torch.equal(layer.weight, w0)
    x = torch.randn(5, 4)
    for step in range(2):  # B changes in place (as an optimizer does): the next call sees it
        with torch.no_grad():
            layer.lora_B.weight.normal_()
        want = nn.functional.linear(x, w0, base.bias) + 2.0 * (x @ layer.lora_A.weight.t()) @ layer.lora_B.weight.t()
        torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)
    layer.double()  # a dtype move rebinds the buffer
    assert layer._wcat.dtype == torch.float64 and layer.weight.data_ptr() == layer._wcat.data_ptr()
    torch.testing.assert_close(layer(x.double()), want.double(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        layer.weight.data = w0.double().clone()  # replaced from outside: caught and rebound
    torch.testing.assert_close(layer(x.double()), want.double(), rtol=1e-6, atol=1e-6)
    assert layer.weight.data_ptr() == layer._wcat.data_ptr()
    lin = layer.to_linear()
    assert lin.weight.is_contiguous() and layer._wcat is None


class _MMCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (mm, addmm, addmm_) that run inside it, by output shape."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_rows_buffer_makes_x_a_in_the_base_gemm(p):
    """Without concat and bias, W is the first out rows of a private [W ; A] buffer, and a training call makes x A^T as
    r more output columns of the base GEMM (x read once; y a row-strided view): one product fewer in forward, the
    same output and gradients as the reference. With dropout x A^T needs drop(x): the separate GEMM stays. Without
    gradients y = x W^T is the base model's own GEMM (a zero B gives the base's outputs bit for bit)."""
    torch.manual_seed(0)
    base = nn.Linear(12, 5, bias=False)  # a wide input (in >= 2 out)
    w0 = base.weight.detach().clone()
    layer = LoRALinear(base, r=3, alpha=6, dropout=p).train()
    assert not layer.concat and layer._layout == "rows"
    assert layer.weight.data_ptr() == layer._wcat.data_ptr() and layer._wcat.shape == (5 + 3, 12)
    assert layer.weight.is_contiguous() and torch.equal(layer.weight, w0)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(2, 7, 12, requires_grad=True)
    with _MMCalls() as calls:
        torch.manual_seed(1)
        y = layer(x)
    assert calls.shapes == ([(14, 8), (14, 5)] if not p else [(14, 3), (14, 5), (14, 5)]), calls.shapes
    assert y.stride()[-2] == (8 if not p else 5)
    assert torch.equal(layer._wcat[5:], layer.lora_A.weight)  # the A rows follow A
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, layer.lora_A.weight, layer.lora_B.weight], dy)
    torch.manual_seed(1)
    draw = layer.dropout_draw(x)
    ref = lora_linear(x, w0, None, layer.lora_A.weight, layer.lora_B.weight, layer.scaling, draw, impl="torch")
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    for g, r_ in zip(got, torch.autograd.grad(ref, [x, layer.lora_A.weight, layer.lora_B.weight], dy)):
        torch.testing.assert_close(g, r_, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.lora_B.weight.zero_()
        layer.eval()
        assert torch.equal(layer(x), nn.functional.linear(x, w0))
    lin = layer.to_linear()  # a storage of its own, not the buffer's first rows
    assert lin.weight.untyped_storage().nbytes() == lin.weight.numel() * 4 and layer._wcat is None


def test_rows_buffer_serves_a_wide_input_s_backward(monkeypatch, ids):
    """A LoRA down_proj (in >= 2 out) gets dx from one GEMM over [dy | s dy B] and [W ; A]: its own buffer, not a
    per-call cat of W (117 MB at the 8B shape), in the decoder's MLP path; gradients as the torch path's."""
    import transformers

    from chronicals.models import CausalLM, ModelConfig

    hf = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0).train()  # I >= 2 H: a wide input
    apply_lora(model, r=2, alpha=4, target_modules=("down_proj",))
    randomize_lora_b(model)
    down = model.model.layers[1].mlp.down_proj
    assert down._layout == "rows"
    cats = []
    real = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: cats.append(tuple(ts[0].shape)) or real(ts, *a, **k))
    loss = model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="sum")
    loss.backward()
    assert (ids.numel(), 32) in cats, cats  # the wide input's [dy | s dy B] ran
    assert (32, 72) not in cats, cats  # and no [W ; A] was built per call
    got = down.lora_A.weight.grad.clone()
    monkeypatch.setattr(torch, "cat", real)
    model.zero_grad()
    model.set_impl("torch")
    model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="sum").backward()
    torch.testing.assert_close(got, down.lora_A.weight.grad, rtol=1e-5, atol=1e-6)


def test_concat_down_proj_passes_its_persistent_buffer(monkeypatch, ids):
    """A concat=True LoRA down_proj hands its persistent [W | s B] to the SwiGLU-down function: neither forward nor
    backward calls concat_weight (which built a new [W | s B], a copy of all of W, on every call)."""
    import chronicals.lora.mlp as mlp_mod

    model = tiny_model("llama").train()
    apply_lora(model, r=2, alpha=4, concat=True, target_modules=("down_proj",))
    randomize_lora_b(model)
    calls = []
    real = mlp_mod.concat_weight
    monkeypatch.setattr(mlp_mod, "concat_weight", lambda *a: calls.append(1) or real(*a))
    loss = model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="sum")
    loss.backward()
    assert calls == []
    assert model.model.layers[1].mlp.down_proj.lora_A.weight.grad.abs().sum() > 0


def test_merge_gives_contiguous_weights(ids):
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, concat=True)
    merge_lora(model)
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("packed, need_a", [(False, True), (True, False)])
def test_triton_backward_with_separate_gate_up_or_a_frozen_lora_a(packed, need_a):
    """The act-writing SwiGLU kernel serves packed gu with lora_A trained only: separate gate and up (down_proj
    adapted, gate/up not one group) go the plain way (the packed kernel would read gate as [gate | up]), and so
    does a frozen lora_A (nothing asks for act: the fused closure never ran, a KeyError). Gradients as the torch
    path's (neither case was tested: a mutation walk)."""
    g = torch.Generator().manual_seed(4)
    rnd = lambda *s: _randn(g, *s)  # noqa: E731
    fi, fo, r, lead = 24, 10, 4, (3, 5)
    gate0, up0, a0, b0 = rnd(*lead, fi), rnd(*lead, fi), rnd(r, fi), rnd(fo, r)
    w, dy = rnd(fo, fi), rnd(*lead, fo)

    def grads(dtype, impl):
        a, b = a0.to(dtype, copy=True).requires_grad_(need_a), b0.to(dtype, copy=True).requires_grad_()
        if packed:
            ins = [torch.cat([gate0, up0], -1).to(dtype).requires_grad_()]
            y = LoRASwiGLUDownFunction.apply(ins[0], None, w.to(dtype), None, a, b, 1.3, None, False, None, impl, True)
        else:
            ins = [gate0.to(dtype, copy=True).requires_grad_(), up0.to(dtype, copy=True).requires_grad_()]
            y = LoRASwiGLUDownFunction.apply(*ins, w.to(dtype), None, a, b, 1.3, None, False, None, impl, True)
        wrt = ins + ([a] if need_a else []) + [b]
        return [y, *torch.autograd.grad(y, wrt, dy.to(dtype))]

    for i, (x_, y_) in enumerate(zip(grads(torch.float32, "triton"), grads(torch.float64, "torch"))):
        torch.testing.assert_close(x_.double(), y_, rtol=1e-5, atol=1e-5, msg=f"output/grad {i}")


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_triton_packed_gu_needing_no_gradient_still_trains_the_adapters():
    """Packed gu with no gradient (gate/up adapters frozen) on Triton: d_act is never computed, so the backward must
    take the recompute path (the act-writing kernel ran on a None d_act: a TypeError). dA and dB as the torch path's."""
    g = torch.Generator().manual_seed(4)
    gu0, a0, b0 = _randn(g, 3, 5, 48), _randn(g, 4, 24), _randn(g, 10, 4)
    w, dy = _randn(g, 10, 24), _randn(g, 3, 5, 10)

    def grads(dtype, impl):
        a, b = a0.to(dtype, copy=True).requires_grad_(), b0.to(dtype, copy=True).requires_grad_()
        y = LoRASwiGLUDownFunction.apply(gu0.to(dtype), None, w.to(dtype), None, a, b, 1.3, None, False, None, impl,
                                         True)
        return torch.autograd.grad(y, [a, b], dy.to(dtype))

    for x_, y_ in zip(grads(torch.float32, "triton"), grads(torch.float64, "torch")):
        torch.testing.assert_close(x_.double(), y_, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("concat,p", [(False, 0.0), (True, 0.25)])
def test_triton_backward_with_strided_gate_up_or_d_act(concat, p):
    """The Triton SwiGLU backward reads flat contiguous memory: separate gate/up that are row-strided views of one
    wider tensor, and (concat with dropout) a d_act that is a view into lora_backward's (N, in + r) GEMM output, are
    made contiguous first. Passed as they are, dgate/dup came out wrong. Gradients as the torch path's."""
    g = torch.Generator().manual_seed(4)
    rnd = lambda *s: _randn(g, *s)  # noqa: E731
    fi, fo, r, lead = 24, 10, 4, (3, 5)
    gu0, a0, b0, w, dy = rnd(*lead, 2 * fi), rnd(r, fi), rnd(fo, r), rnd(fo, fi), rnd(*lead, fo)
    torch.manual_seed(1)
    draw = D.draw(p, DEV) if p else None

    def grads(dtype, impl):
        gu = gu0.to(dtype, copy=True).requires_grad_()
        a, b = a0.to(dtype, copy=True).requires_grad_(), b0.to(dtype, copy=True).requires_grad_()
        gate, up = gu[..., :fi], gu[..., fi:]  # row stride 2I
        y = LoRASwiGLUDownFunction.apply(gate, up, w.to(dtype), None, a, b, 1.3, draw, concat, None, impl)
        return [y, *torch.autograd.grad(y, [gu, a, b], dy.to(dtype))]

    for i, (x_, y_) in enumerate(zip(grads(torch.float32, "triton"), grads(torch.float64, "torch"))):
        torch.testing.assert_close(x_.double(), y_, rtol=1e-5, atol=1e-5, msg=f"output/grad {i}")


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_triton_fused_backward_with_a_column_strided_gu():
    """The act-writing kernel assumes unit column stride: a column-strided gu (a transpose) is laid out first.
    Passed as a plain reshape it gave wrong gradients. Output and gradients as the torch path's."""
    g = torch.Generator().manual_seed(5)
    base, a0, b0 = _randn(g, 48, 15), _randn(g, 4, 24), _randn(g, 10, 4)
    w, dy = _randn(g, 10, 24), _randn(g, 15, 10)

    def grads(dtype, impl):
        t = base.to(dtype, copy=True).requires_grad_()
        a, b = a0.to(dtype, copy=True).requires_grad_(), b0.to(dtype, copy=True).requires_grad_()
        y = LoRASwiGLUDownFunction.apply(t.t(), None, w.to(dtype), None, a, b, 1.3, None, False, None, impl, True)
        return [y, *torch.autograd.grad(y, [t, a, b], dy.to(dtype))]

    for i, (x_, y_) in enumerate(zip(grads(torch.float32, "triton"), grads(torch.float64, "torch"))):
        torch.testing.assert_close(x_.double(), y_, rtol=1e-5, atol=1e-5, msg=f"output/grad {i}")


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_packed_triton_backward_leaves_gu_alone_by_default():
    """in_place defaults to False: a caller that omits it keeps its gu (with True as the default, the fused backward
    wrote d_gu over it)."""
    g = torch.Generator().manual_seed(3)
    gu = _randn(g, 3, 7, 16).requires_grad_()
    a, b = _randn(g, 4, 8).requires_grad_(), _randn(g, 10, 4).requires_grad_()
    w = _randn(g, 10, 8)
    before = gu.detach().clone()
    y = LoRASwiGLUDownFunction.apply(gu, None, w, None, a, b, 1.3, None, False, None, "triton", True)
    y.sum().backward()
    assert torch.equal(gu.detach(), before)


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_separate_gate_and_up_run_the_triton_swiglu_kernels(monkeypatch):
    """impl="triton" with separate gate and up (an adapted down_proj whose gate/up are not one GEMM): the forward, the
    recompute for dA and the SwiGLU backward run the Triton kernels, not the torch reference; gradients as the float64
    torch path's."""
    import importlib

    import chronicals.lora.mlp as mlp_mod

    swiglu_mod = importlib.import_module("chronicals.ops.swiglu")  # the module (the package exports a function)
    launched = []
    fwd, bwd = swiglu_mod.swiglu_forward, mlp_mod.swiglu_backward
    monkeypatch.setattr(swiglu_mod, "swiglu_forward", lambda *a: launched.append("forward") or fwd(*a))
    monkeypatch.setattr(mlp_mod, "swiglu_backward", lambda *a: launched.append("backward") or bwd(*a))
    g = torch.Generator().manual_seed(4)
    rnd = lambda *s: _randn(g, *s)  # noqa: E731
    gate0, up0, a0, b0, w, dy = rnd(3, 5, 24), rnd(3, 5, 24), rnd(4, 24), rnd(10, 4), rnd(10, 24), rnd(3, 5, 10)

    def grads(dtype, impl):
        ins = [t.to(dtype, copy=True).requires_grad_() for t in (gate0, up0, a0, b0)]
        y = LoRASwiGLUDownFunction.apply(*ins[:2], w.to(dtype), None, *ins[2:], 1.3, None, False, None, impl)
        return [y, *torch.autograd.grad(y, ins, dy.to(dtype))]

    got = grads(torch.float32, "triton")
    assert launched == ["forward", "forward", "backward"]
    for i, (x_, y_) in enumerate(zip(got, grads(torch.float64, "torch"))):
        torch.testing.assert_close(x_.double(), y_, rtol=1e-5, atol=1e-5, msg=f"output/grad {i}")


@pytest.mark.skipif(not TRITON, reason="the Triton SwiGLU kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
def test_packed_triton_backward_in_place_writes_d_gu_into_gu(swiglu_forwards):
    """in_place=True (the decoder's default, RuntimeOptions.swiglu_backward_in_place) writes d_gu over the saved gu:
    the gradient comes back in gu's own memory, no (N, 2I) tensor beside it, with the bits of a backward that leaves
    gu alone. fused_act left out takes the act-writing kernel: one SwiGLU forward per call."""
    g = torch.Generator().manual_seed(3)
    base = _randn(g, 3, 7, 16)
    a, b = _randn(g, 4, 8).requires_grad_(), _randn(g, 10, 4).requires_grad_()
    w, dy = _randn(g, 10, 8), _randn(g, 3, 7, 10)
    y = LoRASwiGLUDownFunction.apply(base.clone().requires_grad_(), None, w, None, a, b, 1.3, None, False, None,
                                     "triton")  # fused_act and in_place at their defaults
    kept = torch.autograd.grad(y, [a], dy)
    assert len(swiglu_forwards) == 1
    gu = base.clone().requires_grad_() * 1.0  # a GEMM output's stand-in: nobody reads it after backward
    y = LoRASwiGLUDownFunction.apply(gu, None, w, None, a, b, 1.3, None, False, None, "triton", True, True)
    dgu_in_place, da = torch.autograd.grad(y, [gu, a], dy)
    assert dgu_in_place.data_ptr() == gu.data_ptr()
    leaf = base.clone().requires_grad_()
    y = LoRASwiGLUDownFunction.apply(leaf, None, w, None, a, b, 1.3, None, False, None, "triton", True, False)
    dgu, da_kept = torch.autograd.grad(y, [leaf, a], dy)
    assert torch.equal(dgu_in_place, dgu) and torch.equal(da, da_kept) and torch.equal(da, kept[0])
