"""Selective recomputation (ops.recompute): same gradients bit for bit, and the graph really lets go.

The decoder offers its RMSNorm outputs and the SwiGLU product; with a session open, the nodes that save
them (q/k/v, gate/up, down_proj) hold a recipe instead, and backward rebuilds the tensor once. An input changed
in place before the rebuild raises, and a transposed input rebuilds to the same gradients.
"""

import functools
import gc
import weakref

import numpy as np
import pytest
import torch
import transformers

from chronicals.lora import apply_lora
from chronicals.models import CausalLM, ModelConfig
from chronicals.ops import recompute, rms_norm
from chronicals.ops._impl import triton_interpreting

TRITON = torch.cuda.is_available() or triton_interpreting()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch"] + (["triton"] if TRITON else [])
TINY = dict(vocab_size=89, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)


def _model(impl, recompute_names, lora=False, gate_up_layers=0):
    cfg = ModelConfig.from_hf_dict(transformers.Qwen2Config(**TINY).to_dict())  # q/k/v bias, GQA, tied
    model = CausalLM(cfg, impl=impl).init_weights(std=0.1, seed=0).to(DEV)
    model.set_recompute(recompute_names, gate_up_layers)
    if lora:
        apply_lora(model, r=4, alpha=8, seed=0)
        with torch.no_grad():  # non-zero B, so the adapters change the output and get real gradients
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator(DEV).manual_seed(1))
    return model.train()


def _grads(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=g).to(DEV)
    pos = torch.cat([torch.arange(6), torch.arange(5)]).repeat(2, 1).to(DEV)  # two documents per row
    labels = torch.randint(0, TINY["vocab_size"], (2, 11), generator=g).to(DEV)
    model.zero_grad(set_to_none=True)
    loss = model(ids, position_ids=pos, shift_labels=labels, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("names,gate_up_layers", [(("norm", "swiglu"), 0), (("norm", "swiglu", "gate_up"), 0),
                                                 (("gate_up",), 0), (("norm", "swiglu", "gate_up"), 1)])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_bit_identical(impl, lora, names, gate_up_layers):
    loss0, g0 = _grads(_model(impl, False, lora))
    loss1, g1 = _grads(_model(impl, names, lora, gate_up_layers))
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def _watch(model):
    """Weak references to the first layer's input-norm output and down_proj input, taken in forward."""
    refs = {}

    def keep(key, t):
        base = t if t._base is None else t._base
        refs[key] = weakref.ref(base)

    layer = model.model.layers[0]
    h1 = layer.input_layernorm.register_forward_hook(lambda m, i, o: keep("norm", o))
    h2 = layer.mlp.down_proj.register_forward_pre_hook(lambda m, i: keep("act", i[0]))
    return refs, (h1, h2)


@pytest.mark.parametrize("names,freed", [((), set()), (("norm",), {"norm"}), (("norm", "swiglu"), {"norm", "act"})])
def test_graph_does_not_hold_offered_tensors(names, freed):
    model = _model("torch", names)
    refs, hooks = _watch(model)
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    loss = model(ids, position_ids=torch.arange(9, device=DEV)[None], shift_labels=ids, reduction="sum")
    gc.collect()
    alive = {k for k, r in refs.items() if r() is not None}
    assert alive == {"norm", "act"} - freed  # without recompute the graph keeps both alive
    loss.backward()  # and backward still works from the recipes
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("names,gate_up_layers,kept", [(("norm", "swiglu"), 0, [True, True]),
                                                      (("norm", "swiglu", "gate_up"), 0, [False, False]),
                                                      (("norm", "swiglu", "gate_up"), 1, [False, True])])
def test_gate_up_output_is_let_go(monkeypatch, impl, lora, names, gate_up_layers, kept):
    """With "gate_up" the graph keeps no reference to the packed gate|up GEMM output (full: the SwiGLU
    product's recipe rebuilds it through gu's own recipe; LoRA: the down_proj function saves gu); with
    gate_up_layers=1 only the first layer's is let go."""
    from chronicals.models import decoder

    refs, real = [], decoder.gate_up_proj

    def watch(mlp, x):
        gu = real(mlp, x)
        refs.append(weakref.ref(gu if gu._base is None else gu._base))
        return gu

    monkeypatch.setattr(decoder, "gate_up_proj", watch)
    model = _model(impl, names, lora, gate_up_layers)
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    loss = model(ids, position_ids=torch.arange(9, device=DEV)[None], shift_labels=ids, reduction="sum")
    gc.collect()
    assert len(refs) == TINY["num_hidden_layers"]
    assert [r() is not None for r in refs] == kept
    loss.backward()


def test_set_recompute_checks_gate_up_layers():
    model = _model("torch", ("norm",))
    with pytest.raises(ValueError, match='has no "gate_up": add it'):
        model.set_recompute(("norm",), 2)
    with pytest.raises(ValueError, match="layer count k >= 0"):
        model.set_recompute(("gate_up",), -1)
    model.set_recompute(("gate_up",), 1)
    assert model.compile_layers().opts.gate_up_layers == 0  # compiled layers turn every recompute off


def test_eval_and_no_grad_are_untouched():
    model = _model("torch", ("norm", "swiglu")).eval()
    ids = torch.randint(0, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, 7, TINY["vocab_size"]) and not recompute.is_active()


@pytest.mark.skipif(not TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
@pytest.mark.parametrize("h", [7, 96, 1100])  # 1100 > the interpreter's 1024 block: the column loop
def test_rms_norm_apply_rebuilds_forward_bit_for_bit(h):
    from chronicals.ops.rms_norm import RMSNormFunction

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, h, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    w = torch.randn(h, generator=g).to(DEV)
    with recompute.recompute_session():
        y, s = RMSNormFunction.apply(x, w, r, 1e-6, True)
        entry = recompute._offers[recompute._key(y)]
        rebuilt = entry.fn()
    assert rebuilt.dtype == y.dtype and torch.equal(rebuilt, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_swiglu_offer_of_separate_gate_and_up_rebuilds_the_product(monkeypatch, impl):
    """gate_proj / up_proj that cannot share one GEMM (a forward hook on up_proj) take the MLP's separate path, which
    offers the SwiGLU product with a recipe that runs swiglu again on the gate and up its backward keeps: it runs once
    per layer in backward, and the gradients equal those of the run that keeps the product, bit for bit."""
    from chronicals.models import decoder

    calls = []
    real = decoder.swiglu
    monkeypatch.setattr(decoder, "swiglu", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, counts = {}, {}
    for names in ((), ("swiglu",)):
        model = _model(impl, names)
        for layer in model.model.layers:
            layer.mlp.up_proj.register_forward_hook(lambda m, i, o: None)  # not fusable: the separate path
        calls.clear()
        out[names] = _grads(model)
        counts[names] = len(calls)
    layers = TINY["num_hidden_layers"]
    assert counts == {(): layers, ("swiglu",): 2 * layers}  # the forward's, and with the offer its recipe's
    (l0, g0), (l1, g1) = out[()], out[("swiglu",)]
    assert torch.equal(l0, l1) and g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_offer_rejects_a_view_and_bad_names():
    with recompute.recompute_session():
        base = torch.randn(4, 6)
        with pytest.raises(ValueError, match="owns its whole storage"):
            recompute.offer(base[1:], lambda: base[1:].clone())
    with pytest.raises(ValueError, match="choose from"):
        _model("torch", ("norms",))
    y = rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, impl="torch", recompute=True)  # no session: plain
    assert y.shape == (2, 4) and not recompute._offers


def test_compiled_layers_turn_recompute_off():
    model = _model("torch", ("norm", "swiglu")).compile_layers()  # lazy: nothing compiles until a forward
    assert model.opts.recompute == ()


@pytest.mark.parametrize("lora", [False, True])
def test_with_checkpointed_layers(lora):
    """Checkpointed layers save through checkpoint's own hooks (inner ones win): the session leaves them be."""
    def run(names):
        model = _model("torch", names, lora).set_checkpointing(1)
        return _grads(model)

    (l0, g0), (l1, g1) = run(()), run(("norm", "swiglu"))
    assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)


@pytest.mark.skipif(not TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
@pytest.mark.parametrize("lora", [False, True])
def test_swiglu_backward_in_place_by_default(monkeypatch, lora):
    """The default MLP backward (full and LoRA) writes d_gu over the saved gu and act over d_act, once per layer;
    RuntimeOptions.swiglu_backward_in_place=False uses fresh buffers. Same bits either way."""
    from chronicals.models import fused_proj

    calls = []
    real = fused_proj.swiglu_gate_up_backward_
    monkeypatch.setattr(fused_proj, "swiglu_gate_up_backward_", lambda *a: calls.append(1) or real(*a))
    model = _model("triton", ("norm", "swiglu"), lora)
    assert model.opts.swiglu_backward_in_place
    loss, g = _grads(model)
    assert len(calls) == TINY["num_hidden_layers"]
    calls.clear()
    model.opts.swiglu_backward_in_place = False
    loss_fresh, g_fresh = _grads(model)
    assert not calls
    assert torch.equal(loss, loss_fresh) and g.keys() == g_fresh.keys() and len(g) > 0
    for n in g:
        assert torch.equal(g[n], g_fresh[n]), n


@pytest.mark.skipif(not TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
@pytest.mark.parametrize("lora", [False, True])
def test_in_place_backward_under_layer_checkpointing(lora):
    """Checkpointed layers run their forward again in backward; the in-place MLP backward then overwrites the
    recomputed gate|up output: the same gradients as without checkpointing, bit for bit."""
    model = _model("triton", ("norm", "swiglu"), lora)
    loss, g = _grads(model)
    model.set_checkpointing(True)
    loss_ck, g_ck = _grads(model)
    assert torch.equal(loss, loss_ck) and g.keys() == g_ck.keys() and len(g) > 0
    for n in g:
        assert torch.equal(g[n], g_ck[n]), n


@pytest.mark.skipif(not TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
@pytest.mark.parametrize("lora", [False, True])
def test_second_backward_after_in_place_raises_and_the_option_allows_it(lora):
    """The first backward overwrote the saved gate|up output: a second one through the same forward must say so
    (not return wrong gradients); with the option off it gives the first one's gradients again."""
    model = _model("triton", ("norm", "swiglu"), lora)
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0)).to(DEV)
    for in_place in (True, False):
        model.opts.swiglu_backward_in_place = in_place
        model.zero_grad(set_to_none=True)
        loss = model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="sum")
        loss.backward(retain_graph=True)
        first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if in_place:
            with pytest.raises(RuntimeError, match="swiglu_backward_in_place = False"):
                loss.backward()
            continue
        model.zero_grad(set_to_none=True)
        loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                assert torch.equal(p.grad, first[n]), n


@pytest.mark.skipif(not TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
def test_fused_swiglu_recompute_rebuilds_the_product_in_its_backward_kernel(monkeypatch):
    from chronicals.models import fused_proj

    calls = []
    real = fused_proj.SwiGLUDownFunction.apply
    monkeypatch.setattr(fused_proj.SwiGLUDownFunction, "apply", lambda *a: calls.append(1) or real(*a))
    loss_keep, g_keep = _grads(_model("triton", ()))
    model = _model("triton", ("swiglu",))
    loss, g = _grads(model)
    assert len(calls) == TINY["num_hidden_layers"]  # the default: the backward kernel rebuilds it
    assert torch.equal(loss, loss_keep) and all(torch.equal(g[n], g_keep[n]) for n in g_keep)
    calls.clear()
    model.opts.fused_swiglu_recompute = False  # a second SwiGLU forward (the offer)
    loss, g = _grads(model)
    assert not calls
    assert torch.equal(loss, loss_keep) and all(torch.equal(g[n], g_keep[n]) for n in g_keep)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_input_changed_in_place_before_the_rebuild_raises(impl):
    """The recipe held x; changing x in place after the forward rebuilt a different y, and W's gradient came out
    off by 5-8 without a word. Autograd raises for a saved tensor changed in place; so does the rebuild."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=g).to(DEV)
    w = torch.randn(16, generator=g).to(DEV).requires_grad_()
    W = torch.randn(16, 8, generator=g).to(DEV).requires_grad_()
    with recompute.recompute_session():
        z = (rms_norm(x, w, 1e-6, impl=impl, recompute=True) @ W).sum()
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the forward"):
        z.backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_recompute_of_a_transposed_input_gives_the_same_gradients(impl):
    """The reference kept a transposed x's strides in y, which recompute.offer refused (a ValueError about
    offer, from rms_norm)."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(16, 6, generator=g).to(DEV)
    w = torch.randn(16, generator=g).to(DEV).requires_grad_()
    W = torch.randn(16, 8, generator=g).to(DEV).requires_grad_()
    grads = []
    for on in (False, True):
        w.grad = W.grad = None
        x = x0.t().requires_grad_()
        with recompute.recompute_session(on):
            (rms_norm(x, w, 1e-6, impl=impl, recompute=on) @ W).square().sum().backward()
        grads.append([x.grad.clone(), w.grad.clone(), W.grad.clone()])
    for a, b in zip(*grads):  # close, not equal: the GEMM reads y transposed in one run and contiguous in the other
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

def test_offer_refuses_a_prefix_of_a_larger_storage():
    """offset 0 and contiguous is not enough: base[:2] shares base's storage, and a rebuilt (2, 4) tensor
    could not stand in for saves of that storage's other bytes."""
    with recompute.recompute_session():
        base = torch.randn(4, 6)
        with pytest.raises(ValueError, match="owns its whole storage"):
            recompute.offer(base[:2], lambda: base[:2].clone())


def test_offer_refuses_a_transposed_tensor_that_owns_its_storage():
    """offset 0 and the whole storage are not enough either: a transposed t (strides (1, 4)) would have its saves
    re-read at its own strides from a contiguous rebuild, i.e. the wrong elements; without the contiguity check
    offer accepted it."""
    with recompute.recompute_session():
        t = torch.randn(4, 3).t()
        assert t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        with pytest.raises(ValueError, match="owns its whole storage"):
            recompute.offer(t, lambda: t.contiguous())


def _offered(src):
    """src * 2, offered with its recipe (the tests of the offer table below)."""
    t = src * 2
    return recompute.offer(t, functools.partial(torch.mul, src, 2))


def test_rebuilt_value_is_released_after_the_last_unpack():
    """the shared rebuilt tensor lives until the last saver unpacked it, then the offer drops it (the memory
    recompute saves would otherwise come back in backward and stay)."""
    with recompute.recompute_session():
        src = torch.randn(3, 4)
        w = torch.randn(3, 4, requires_grad=True)
        t = _offered(src)
        entry = recompute._offers[recompute._key(t)]
        loss = (t * w).sum()  # mul saves t for w's gradient
        assert entry.packs == 1
        loss.backward()
        assert entry.unpacks == 1 and entry.value is None
        torch.testing.assert_close(w.grad, src * 2)


def test_the_recipe_runs_once_under_no_grad():
    """Two nodes saving t share one rebuild (the recipe runs once, not per unpack), and the recipe runs under
    torch.no_grad() even in a create_graph backward, where grad mode is on."""
    seen = []
    src = torch.randn(3, 4)

    def fn():
        seen.append(torch.is_grad_enabled())
        return src * 2

    with recompute.recompute_session():
        t = recompute.offer(src * 2, fn)
        w1, w2 = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
        loss = (t * w1).sum() + (t * w2).sum()
    g1, g2 = torch.autograd.grad(loss, [w1, w2], create_graph=True)
    assert seen == [False]
    torch.testing.assert_close(g1, src * 2)
    torch.testing.assert_close(g2, src * 2)


def test_a_rebuilder_call_shares_the_graphs_rebuild_and_counts_no_unpack():
    """``rebuilder(t)()`` returns the rebuilt value without counting an unpack: the graph's own unpack of t reuses
    it (the recipe runs once) and the value is let go after that last unpack. Counted as an unpack, the value was
    dropped before the graph's unpack, which ran the recipe a second time."""
    calls = []
    src = torch.randn(3, 4)

    def fn():
        calls.append(1)
        return src * 2

    with recompute.recompute_session():
        t = recompute.offer(src * 2, fn)
        entry = recompute._offers[recompute._key(t)]
        w = torch.randn(3, 4, requires_grad=True)
        loss = (t * w).sum()
        torch.testing.assert_close(recompute.rebuilder(t)(), src * 2)
        assert entry.unpacks == 0 and entry.value is not None
        loss.backward()
        assert len(calls) == 1 and entry.unpacks == 1 and entry.value is None
    torch.testing.assert_close(w.grad, src * 2)


def test_rebuilder_matches_dtype_too():
    """a reinterpretation of the offered storage in another dtype is not the offered tensor."""
    with recompute.recompute_session():
        t = _offered(torch.randn(3, 4))
        assert recompute.rebuilder(t) is not None
        assert recompute.rebuilder(t.view(torch.int32)) is None


def test_a_save_of_the_storage_in_another_dtype_keeps_its_values():
    """A node that saves the offered storage viewed as bf16 gets those bf16 values back; it was handed the fp32
    recipe's output at bf16 geometry, and backward raised from as_strided. fp32 bytes read as bf16 can be NaN
    (about 4% of draws), so the values come from a local generator and NaNs compare equal."""
    g = torch.Generator().manual_seed(0)
    with recompute.recompute_session():
        t = _offered(torch.randn(3, 4, generator=g))
        tb = t.view(torch.bfloat16)  # (3, 8) over the same bytes
        want = tb.clone()
        w = torch.randn(3, 8, generator=g, dtype=torch.bfloat16, requires_grad=True)
        loss = (tb * w).float().sum()
    loss.backward()
    torch.testing.assert_close(w.grad, want, rtol=0, atol=0, equal_nan=True)


def test_a_larger_storage_at_the_offered_address_keeps_its_values():
    """Saves are matched by storage address and size: two numpy prefix views give two storages that start at one
    address, and a save of the larger one keeps its own values. Matched by address alone it was rebuilt from the
    smaller tensor's recipe at the larger geometry (as_strided out of bounds)."""
    a = np.arange(24, dtype=np.float32)
    big = torch.from_numpy(a).view(4, 6)
    small = torch.from_numpy(a[:12]).view(3, 4)
    assert big.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
    with recompute.recompute_session():
        recompute.offer(small, lambda: torch.zeros(3, 4))
        w = torch.randn(4, 6, requires_grad=True)
        loss = (big * w).sum()
    loss.backward()
    assert torch.equal(w.grad, big)


def test_a_sparse_save_passes_through_while_an_offer_is_open():
    """With an offer in the table, a node that saves a sparse tensor (torch.sparse.mm) still works: it has no
    strided storage to look up (the lookup raised NotImplementedError from SparseTensorImpl)."""
    with recompute.recompute_session():
        t = _offered(torch.randn(3, 4))  # kept alive: the offer stays
        assert recompute._offers
        s = torch.randn(3, 3).to_sparse()
        w = torch.randn(3, 2, requires_grad=True)
        loss = torch.sparse.mm(s, w).sum()
    loss.backward()
    torch.testing.assert_close(w.grad, s.to_dense().t() @ torch.ones(3, 2))
    del t


def test_inner_session_exit_keeps_the_outer_sessions_offers():
    """closing a nested session leaves the open outer one's offers in place."""
    with recompute.recompute_session():
        t = _offered(torch.randn(3, 4))
        with recompute.recompute_session():
            pass
        assert recompute.rebuilder(t) is not None


def test_closing_the_session_clears_offers_of_live_tensors():
    """offers (and the tensors their recipes hold) do not outlive the session, even while t lives on."""
    with recompute.recompute_session():
        t = _offered(torch.randn(3, 4))
        assert recompute._offers
    assert not recompute._offers
    del t


def test_an_exception_inside_a_session_closes_it():
    """An error raised inside ``with recompute_session()`` still closes the session: afterwards it is not active,
    the table is empty and offers are ignored. Left open, every later offer registered and the table kept the
    recipes (and the tensors they hold)."""
    try:
        with pytest.raises(KeyError):
            with recompute.recompute_session():
                recompute.offer(torch.randn(3, 4) * 2, lambda: torch.zeros(3, 4))
                raise KeyError("boom")
        assert not recompute.is_active() and not recompute._offers
        recompute.offer(torch.randn(2, 2), lambda: torch.zeros(2, 2))
        assert not recompute._offers
    finally:  # a session left open must not leak into the next tests
        recompute._active = 0
        recompute._offers.clear()


def test_offers_outside_an_enabled_session_are_ignored():
    """offer is a no-op outside a session and in recompute_session(enabled=False) (not active either): nothing is
    registered, so a later session's saves of t keep t itself. An offer that stayed in the table had a later
    session's save of t rebuilt by that stale recipe (wrong gradients)."""
    src = torch.randn(3, 4)
    t = src * 2
    assert recompute.offer(t, lambda: torch.zeros(3, 4)) is t
    assert not recompute._offers
    with recompute.recompute_session(enabled=False):
        assert not recompute.is_active()
        assert recompute.offer(t, lambda: torch.zeros(3, 4)) is t
        assert not recompute._offers
    w = torch.randn(3, 4, requires_grad=True)
    with recompute.recompute_session():
        loss = (t * w).sum()
    loss.backward()
    torch.testing.assert_close(w.grad, src * 2)


def test_under_torch_compile_no_session_opens_and_offers_are_ignored(monkeypatch):
    """While torch.compile traces (torch.compiler.is_compiling()), offer and rebuilder are no-ops even inside a
    session opened in eager code, and recompute_session does not open. Without the checks the offer registered
    under tracing, and the session opened (is_active) inside a compiled region."""
    with recompute.recompute_session():
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        t = torch.randn(3, 4) * 2
        assert recompute.offer(t, lambda: torch.zeros(3, 4)) is t
        assert not recompute._offers and recompute.rebuilder(t) is None
        monkeypatch.undo()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    try:
        with recompute.recompute_session():
            assert not recompute.is_active()
    finally:  # a session left open must not leak into the next tests
        recompute._active = 0
        recompute._offers.clear()


def test_an_offer_goes_with_its_tensor():
    """An offer lives as long as the offered tensor: once that is freed its entry is dropped inside the session, so a
    later tensor in the same memory never matches the stale recipe."""
    with recompute.recompute_session():
        t = torch.randn(16)
        key = recompute._key(t)
        recompute.offer(t, lambda: torch.zeros(16))
        assert key in recompute._offers
        del t
        gc.collect()
        assert key not in recompute._offers


def test_a_stale_finalizer_does_not_drop_a_newer_offer_of_the_same_storage():
    """two tensor objects over one storage, each offered: the first one's death must not remove the second's
    offer (the finalizer checks that the table still holds its own entry)."""
    with recompute.recompute_session():
        t = _offered(torch.randn(3, 4))
        t2 = t.detach()
        assert t2._base is None and recompute._key(t2) == recompute._key(t)
        recompute.offer(t2, lambda: torch.zeros(3, 4))
        del t
        gc.collect()
        assert recompute.rebuilder(t2) is not None


@pytest.mark.parametrize("container", [list, tuple])
def test_in_place_change_of_a_recipe_list_or_tuple_input_raises(container):
    """partial(torch.cat, [a, b]) holds its tensors in a list, partial(torch.cat, (a, b)) in a tuple; their versions
    are checked as well (with lists alone, the tuple's changed a was silently used by the rebuild)."""
    with recompute.recompute_session():
        a, b = torch.randn(2, 4), torch.randn(2, 4)
        t = recompute.offer(torch.cat(container((a, b))), functools.partial(torch.cat, container((a, b))))
        w = torch.randn(4, 4, requires_grad=True)
        loss = (t * w).sum()
        a.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an in-place operation"):
            loss.backward()


@pytest.mark.parametrize("held", ["partial keyword", "closure"])
def test_in_place_change_of_a_keyword_or_closure_input_raises(held):
    """partial(torch.mul, a, other=b) holds b as a keyword argument, and a lambda holds b in a closure cell; both
    are version-checked like positional arguments (without it the rebuild silently used the changed b)."""
    with recompute.recompute_session():
        a, b = torch.randn(3, 4), torch.randn(3, 4)
        fn = functools.partial(torch.mul, a, other=b) if held == "partial keyword" else (lambda: a * b)
        t = recompute.offer(a * b, fn)
        w = torch.randn(3, 4, requires_grad=True)
        loss = (t * w).sum()
    b.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        loss.backward()


@pytest.mark.parametrize("held", ["empty closure cell", "inference tensor"])
def test_recipe_inputs_without_a_version_are_accepted(held):
    """The version check skips what it cannot read: a closure cell still empty at the offer (a name the enclosing
    function binds later) and an inference-mode tensor (no version counter). Both are offered and rebuild the
    right gradient; offer raised "Cell is empty" or "Inference tensors do not track version counter"."""
    if held == "empty closure cell":
        src = torch.randn(3, 4)

        def fn():
            return src * 2 if later is None else None
    else:
        with torch.inference_mode():
            src = torch.randn(3, 4)
        fn = functools.partial(torch.mul, src, 2)
    with recompute.recompute_session():
        t = recompute.offer(src * 2, fn)
        w = torch.randn(3, 4, requires_grad=True)
        loss = (t * w).sum()
    later = None
    loss.backward()
    torch.testing.assert_close(w.grad, src * 2)


def test_a_saved_view_with_an_offset_is_rebuilt_at_its_offset():
    """a node that saved t[1:] (storage offset 4) gets those elements back from the rebuilt tensor."""
    with recompute.recompute_session():
        src = torch.randn(3, 4)
        t = _offered(src)
        w = torch.randn(2, 4, requires_grad=True)
        (t[1:] * w).sum().backward()
        torch.testing.assert_close(w.grad, src[1:] * 2)
