"""qkv_proj / gate_up_proj (one GEMM over concatenated weights) vs the separate Hugging Face modules.

Tiny random decoders: Qwen2 (q/k/v bias, GQA 4q/2kv heads), Llama 3 (no bias), Llama with attention and MLP
biases, Qwen3 (q/k norm on the strided q/k views). Values and every gradient (x, each weight and bias) equal
the separate path's; LoRA and subclassed modules take the separate path; inside a recompute session the
graph does not keep the concatenated weight; the functions trace under torch.compile(fullgraph=True).
"""

import collections
import functools
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from chronicals.lora import apply_lora
from chronicals.models import CausalLM, ModelConfig
from chronicals.models import fused_proj
from chronicals.models.fused_proj import fusable, gate_up_proj, qkv_proj
from chronicals.ops import attention, rope_cos_sin, rope_qk
from chronicals.ops._impl import triton_interpreting
from chronicals.ops import recompute
from chronicals.ops.recompute import recompute_session
from chronicals.ops.swiglu import swiglu_gate_up

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float64: dict(atol=1e-13, rtol=1e-12)}
# Triton kernels (rope, swiglu) run on CUDA or in the interpreter; otherwise the reference ops
OP_IMPL = "triton" if triton_interpreting() else "torch"  # CPU tensors: Triton only under the interpreter


def _model(tiny_hf_config, family, dtype=torch.float32):
    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config(family, num_hidden_layers=1)))
    model.init_weights(std=0.1, seed=0).to(dtype)
    with torch.no_grad():  # init_weights zeroes biases: give them values so a bias bug shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    layer = model.model.layers[0]
    return model, layer.self_attn, layer.mlp


def _x(hidden, dtype, seed=3):
    return torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(seed), dtype=dtype).requires_grad_()


def _separate(attn, mlp, x):
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, attn.nq, attn.d)
    k = attn.k_proj(x).view(b, s, attn.nkv, attn.d)
    v = attn.v_proj(x).view(b, s, attn.nkv, attn.d)
    return q, k, v, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)


def _fused(attn, mlp, x):
    return (*qkv_proj(attn, x), gate_up_proj(mlp, x))


def _outputs_and_grads(fn, attn, mlp, x):
    """Outputs of fn, and the gradients of x and of every q/k/v/gate/up parameter under a random scalar."""
    outs = fn(attn, mlp, x)
    g = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    params = {f"{n}.{pn}": p for n, m in [("attn", attn), ("mlp", mlp)] for pn, p in m.named_parameters()
              if "o_proj" not in pn and "down_proj" not in pn and "norm" not in pn}
    grads = torch.autograd.grad(loss, [x, *params.values()])
    return [o.detach() for o in outs], dict(zip(["x", *params], grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("family", ["qwen2", "llama3", "llama_bias"])
def test_matches_separate_modules(tiny_hf_config, family, dtype):
    _, attn, mlp = _model(tiny_hf_config, family, dtype)
    x = _x(attn.q_proj.in_features, dtype)
    q, k, v, gu = _fused(attn, mlp, x)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # one GEMM really ran
    assert v.is_contiguous() and v.untyped_storage().nbytes() == v.numel() * v.element_size()  # v owns its bytes
    assert q.shape == (2, 5, 4, 8) and k.shape == v.shape == (2, 5, 2, 8) and gu.shape == (2, 5, 2 * 56)
    want, want_grads = _outputs_and_grads(_separate, attn, mlp, x)
    got, got_grads = _outputs_and_grads(_fused, attn, mlp, x)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=name)
    torch.testing.assert_close(got[3], want[3], **TOL[dtype], msg="gu")
    n_params = 3 * (1 + (attn.q_proj.bias is not None)) + 2 * (1 + (mlp.gate_proj.bias is not None))
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 1 + n_params
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], **TOL[dtype], msg=name)


def test_without_gradients_the_weights_are_not_concatenated(tiny_hf_config, monkeypatch):
    """Evaluation and generation run the modules separately: the joint GEMM only pays in backward, and its
    concatenation copied the q/k/v and gate/up weights at every generated token. Same outputs either way."""
    model, attn, mlp = _model(tiny_hf_config, "qwen2")
    x = _x(attn.q_proj.in_features, torch.float32).detach()
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: cats.append(len(ts)) or real_cat(ts, *a, **k))
    with torch.no_grad():
        q, k, v = qkv_proj(attn, x)
        assert gate_up_proj(mlp, x) is None  # the MLP calls gate_proj and up_proj itself
        want = _separate(attn, mlp, x)
    assert cats == [2]  # _separate's own cat of gate and up; no weight was concatenated
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()  # three GEMMs ran
    for a, b in zip((q, k, v), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        logits_eval = model(x.new_zeros(1, 4, dtype=torch.long) + 3)
    logits_grad = model(x.new_zeros(1, 4, dtype=torch.long) + 3)
    torch.testing.assert_close(logits_eval, logits_grad.detach(), **TOL[torch.float32])


def _lora_with_live_b(model, targets) -> None:
    """LoRA (r=2) on ``targets``, each B drawn from a seeded normal (B = 0 after init makes the adapter a no-op)."""
    apply_lora(model, r=2, alpha=4, target_modules=targets)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_lora_and_other_modules_take_the_separate_path(tiny_hf_config):
    model, attn, mlp = _model(tiny_hf_config, "qwen2")
    _lora_with_live_b(model, ("q_proj", "gate_proj"))
    x = _x(attn.q_proj.in_features, torch.float32)
    q, k, v = qkv_proj(attn, x)
    want = attn.q_proj(x).view(q.shape)
    base = nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(q.shape)
    torch.testing.assert_close(q, want, rtol=0, atol=0)
    assert (q - base).abs().max() > 1e-3  # the adapter's contribution is in q
    assert gate_up_proj(mlp, x) is None
    assert "LoRALinear" in fusable(attn.q_proj, attn.k_proj, attn.v_proj)

    class MyLinear(nn.Linear):
        pass

    assert "MyLinear" in fusable(MyLinear(4, 4), nn.Linear(4, 4))
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *a: None)
    assert "hooks" in fusable(hooked, nn.Linear(4, 4))
    assert "bias" in fusable(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
    assert "dtype" in fusable(nn.Linear(4, 4), nn.Linear(4, 4).double())
    assert fusable(nn.Linear(4, 4), nn.Linear(4, 2)) is None
    # weights on different devices (the meta device stands in for a second one): torch.cat would fail or copy
    assert "dtype or device" in fusable(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    assert fusable(nn.Linear(4, 4, device="meta"), nn.Linear(4, 2, device="meta")) is None


def test_every_one_of_three_modules_is_checked(tiny_hf_config):
    """fusable checks the type, bias presence, dtype and device of each module, not only the first two or the first
    and last: a k_proj without the bias of q and v failed in torch.cat on None, a v_proj in float64 promoted the
    GEMM, and LoRA on v_proj / up_proj alone went into the joint GEMM through the base weight, the adapter dropped."""
    class MyLinear(nn.Linear):
        pass

    assert "MyLinear" in fusable(nn.Linear(4, 4), nn.Linear(4, 2), MyLinear(4, 2))
    assert "bias" in fusable(nn.Linear(4, 4), nn.Linear(4, 2, bias=False), nn.Linear(4, 2))
    assert "bias" in fusable(nn.Linear(4, 4, bias=False), nn.Linear(4, 2), nn.Linear(4, 2, bias=False))
    assert fusable(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False), nn.Linear(4, 2, bias=False)) is None
    assert "dtype or device" in fusable(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2).double())
    assert "dtype or device" in fusable(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2, device="meta"))
    assert fusable(nn.Linear(4, 4).double(), nn.Linear(4, 2).double(), nn.Linear(4, 2).double()) is None

    model, attn, mlp = _model(tiny_hf_config, "llama3")
    _lora_with_live_b(model, ("v_proj", "up_proj"))
    x = _x(attn.q_proj.in_features, torch.float32)
    q, k, v = qkv_proj(attn, x)
    torch.testing.assert_close(v, attn.v_proj(x).view(v.shape), rtol=0, atol=0)
    gu = gate_up_proj(mlp, x)
    if gu is not None:  # a LoRA group GEMM may serve gate/up: it must hold the adapter's contribution
        torch.testing.assert_close(gu, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1), **TOL[torch.float32])


def test_a_forward_pre_hook_takes_the_separate_path_and_runs(tiny_hf_config):
    """A forward pre-hook keeps the module out of the joint GEMM, as a forward hook does: the joint GEMM calls
    F.linear directly and would skip it."""
    pre = nn.Linear(4, 4)
    pre.register_forward_pre_hook(lambda m, args: None)
    assert "hooks" in fusable(pre, nn.Linear(4, 4))
    model, attn, mlp = _model(tiny_hf_config, "llama3")
    seen = []
    attn.k_proj.register_forward_pre_hook(lambda m, args: seen.append("k") or (args[0] * 2,))
    mlp.up_proj.register_forward_pre_hook(lambda m, args: seen.append("up"))
    x = _x(attn.q_proj.in_features, torch.float32)
    q, k, v = qkv_proj(attn, x)
    assert seen == ["k"]
    torch.testing.assert_close(k, nn.functional.linear(2 * x, attn.k_proj.weight, attn.k_proj.bias).view(k.shape))
    assert gate_up_proj(mlp, x) is None  # the MLP then calls gate_proj / up_proj, hooks and all


def test_the_path_is_logged_once_per_kind(tiny_hf_config, monkeypatch, caplog):
    """Which projection path runs is said once per (kind, path), not at every layer of every step and token."""
    import logging

    monkeypatch.setattr(fused_proj, "_logged", set())
    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("llama3", num_hidden_layers=2))).init_weights(seed=0)
    ids = torch.randint(0, 64, (1, 4))
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        for _ in range(2):
            model(ids, labels=ids).backward()
            with torch.no_grad():
                model(ids)
    said = [r.getMessage() for r in caplog.records if r.name == "chronicals.models"
            and r.getMessage().startswith(("qkv_proj:", "gate_up_proj:"))]
    separate = "separate modules (no gradient: the weights are read where they are, not concatenated per call)"
    assert sorted(said) == sorted(["qkv_proj: one GEMM", "gate_up_proj: one GEMM", f"qkv_proj: {separate}",
                                   f"gate_up_proj: {separate}"]), said


@pytest.mark.skipif(OP_IMPL != "triton" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_strided_gate_up_view_takes_fresh_buffers_in_place_or_not():
    """SwiGLUDownFunction with in_place=True on a gate|up input that is a strided view (rows wider than 2I, a slice
    of a larger GEMM output) falls back to fresh buffers: the same gradients as in_place=False, and the caller's
    tensor is not written over (the in-place kernel refuses that layout)."""
    from chronicals.models.fused_proj import SwiGLUDownFunction

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    inter, hidden = 8, 6
    big, w, b, dy = (torch.randn(*shape, generator=g).to(dev) for shape in ((2, 3, 2 * inter + 4), (hidden, inter),
                                                                            (hidden,), (2, 3, hidden)))
    grads = []
    for in_place in (False, True):
        src, wt, bt = (t.clone().requires_grad_() for t in (big, w, b))
        gu = src[..., :2 * inter]  # unit column stride, row stride 2I + 4: not contiguous
        assert not gu.is_contiguous()
        y = SwiGLUDownFunction.apply(gu, wt, bt, in_place)
        y.backward(dy)
        assert torch.equal(src.detach(), big)  # the input's values are left as they were
        grads.append((y.detach(), src.grad, wt.grad, bt.grad))
    for a, c in zip(*grads):
        assert torch.equal(a, c)


@pytest.mark.skipif(OP_IMPL != "triton" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("in_place", [False, True])
def test_swiglu_down_gives_the_bias_and_weight_gradients_of_the_plain_path(in_place):
    """SwiGLUDownFunction returns down_proj's bias gradient (dy summed over the tokens) and weight gradient as
    silu(gate) * up -> F.linear's backward does. The recompute models have no MLP bias, so a dropped db only
    failed the strided test by accident (torch.equal(None, None)); an MLP bias (Llama mlp_bias) takes this path."""
    from chronicals.models.fused_proj import SwiGLUDownFunction

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    inter, hidden = 8, 6
    gu0, w0, b0, dy = (torch.randn(*shape, generator=g).to(dev)
                       for shape in ((2, 3, 2 * inter), (hidden, inter), (hidden,), (2, 3, hidden)))
    gu, w, b = (t.clone().requires_grad_() for t in (gu0, w0, b0))
    SwiGLUDownFunction.apply(gu.clone(), w, b, in_place).backward(dy)
    ref_gu, ref_w, ref_b = (t.clone().requires_grad_() for t in (gu0, w0, b0))
    gate, up = ref_gu.chunk(2, -1)
    nn.functional.linear(nn.functional.silu(gate) * up, ref_w, ref_b).backward(dy)
    assert b.grad is not None
    torch.testing.assert_close(b.grad, ref_b.grad)
    torch.testing.assert_close(b.grad, dy.sum((0, 1)))
    torch.testing.assert_close(w.grad, ref_w.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(OP_IMPL != "triton" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_swiglu_down_takes_a_non_contiguous_incoming_gradient():
    """SwiGLUDownFunction's backward reshapes dy (a transposed view, as a transpose / permute downstream gives):
    with dy.view it raised "view size is not compatible with input tensor's size and stride"."""
    from chronicals.models.fused_proj import SwiGLUDownFunction

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    gu0, w0, b0 = (torch.randn(*shape, generator=g).to(dev) for shape in ((2, 3, 16), (6, 8), (6,)))
    c = torch.randn(3, 2, 6, generator=g).to(dev)
    gu, w, b = (t.clone().requires_grad_() for t in (gu0, w0, b0))
    y = SwiGLUDownFunction.apply(gu.clone(), w, b, False)
    (y.transpose(0, 1).contiguous() * c).sum().backward()  # dy arrives as c.transpose(0, 1): not contiguous
    ref_gu, ref_w, ref_b = (t.clone().requires_grad_() for t in (gu0, w0, b0))
    gate, up = ref_gu.chunk(2, -1)
    (nn.functional.linear(nn.functional.silu(gate) * up, ref_w, ref_b).transpose(0, 1) * c).sum().backward()
    for a, r in ((gu, ref_gu), (w, ref_w), (b, ref_b)):
        torch.testing.assert_close(a.grad, r.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(OP_IMPL != "triton" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_swiglu_down_steps_aside_while_torch_compile_traces(tiny_hf_config, monkeypatch):
    """While dynamo traces, swiglu_down returns None (the MLP then runs traceable modules) instead of the Triton
    autograd Function; compile_layers turns recompute off, so the compiled suite never reached this check."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama3", num_hidden_layers=1))
    mlp = CausalLM(cfg, impl="triton").init_weights(std=0.1, seed=0).to(dev).model.layers[0].mlp
    gu = torch.randn(1, 3, 2 * mlp.down_proj.in_features, device=dev, requires_grad=True)
    assert fused_proj.swiglu_down(mlp, gu) is not None  # the control: eager, on Triton, a plain down_proj
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused_proj.swiglu_down(mlp, gu) is None


@pytest.mark.parametrize("names", [("swiglu",), ("gate_up",), ("swiglu", "gate_up")])
def test_mlp_biases_under_recompute_give_the_plain_loss_and_gradients(tiny_hf_config, names):
    """Llama mlp_bias=True with recomputation: "swiglu" (SwiGLUDownFunction on Triton) keeps down_proj's bias and
    "gate_up" rebuilds gu with gate / up's biases; loss and every gradient equal the run without recompute (the
    recompute models had no MLP bias, so a dropped bias went unseen)."""
    def run(recomputed):
        model, _, _ = _model(tiny_hf_config, "llama_bias")
        model.set_impl(OP_IMPL)
        model.set_recompute(recomputed)
        model.train()
        ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
        loss = model(ids, labels=ids)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    want_loss, want = run(())
    got_loss, got = run(names)
    torch.testing.assert_close(got_loss, want_loss, **TOL[torch.float32])
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **TOL[torch.float32], msg=name)


@pytest.mark.skipif(OP_IMPL != "triton" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_hooked_down_proj_runs_its_hook_under_swiglu_recompute(tiny_hf_config):
    """With SwiGLU recomputation on the Triton path, a down_proj with a forward hook keeps its own call (the hook
    runs and may change the output) instead of being skipped by the fused SwiGLU+down function."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama3", num_hidden_layers=1))
    model = CausalLM(cfg, impl="triton").init_weights(std=0.1, seed=0).to(dev).train()
    model.set_recompute(("swiglu",))
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0)).to(dev)
    plain = model(ids, labels=ids)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(1) or o * 0)
    hooked = model(ids, labels=ids)
    assert seen == [1]
    assert not torch.equal(hooked, plain)  # the hook's zeroed MLP output reached the loss


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def test_backward_is_one_dx_gemm_without_adds(tiny_hf_config):
    """The point of the fusion: per projection group one dx GEMM and one dW GEMM, one bias reduction, the
    q/k/v gradients joined by one cat, and no zero-fills or adds (the separate path runs 3 + 3 mm, 3 sums and
    2 adds for q/k/v alone)."""
    _, attn, mlp = _model(tiny_hf_config, "llama_bias")
    xa, xm = _x(attn.q_proj.in_features, torch.float32), _x(attn.q_proj.in_features, torch.float32, seed=4)
    q, k, v = qkv_proj(attn, xa)
    gu = gate_up_proj(mlp, xm)
    loss = (q * 2).sum() + (k * 3).sum() + (v * 4).sum() + (gu * 5).sum()
    with _CountOps() as counted:
        loss.backward()
    ops = counted.ops
    assert ops["mm"] == 4 and ops["cat"] == 1 and ops["sum"] == 2, ops
    assert not any(op in ops for op in ("add", "add_", "zeros", "new_zeros", "zero_", "fill_")), ops


@pytest.mark.skipif(OP_IMPL != "triton" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_frozen_down_proj_gets_no_weight_or_bias_gradient_work():
    """SwiGLUDownFunction's backward runs the dW GEMM and the bias reduction only when down_proj's weight / bias
    needs a gradient: a frozen MLP (LoRA on the attention only) paid an (H, I) GEMM per layer per step, thrown away."""
    from chronicals.models.fused_proj import SwiGLUDownFunction

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ops = {}
    for trainable in (False, True):
        g = torch.Generator().manual_seed(0)
        gu = torch.randn(2, 3, 16, generator=g).to(dev).requires_grad_()
        w, b = torch.randn(6, 8, generator=g).to(dev), torch.randn(6, generator=g).to(dev)
        w.requires_grad_(trainable), b.requires_grad_(trainable)
        y = SwiGLUDownFunction.apply(gu * 1, w, b, False)
        with _CountOps() as counted:
            y.sum().backward()
        ops[trainable] = counted.ops
        assert (w.grad is None) != trainable and (b.grad is None) != trainable
    assert ops[False]["mm"] == 1 and ops[True]["mm"] == 2, ops  # d_act, then dW only when trainable
    assert ops[True]["sum"] - ops[False]["sum"] == 1, ops  # the bias reduction (the interpreter sums on its own)


@pytest.mark.parametrize("session", [True, False])
def test_recompute_session_does_not_keep_the_concatenated_weight(tiny_hf_config, monkeypatch, session):
    """Inside recompute_session() the graph holds an offer instead of [Wq; Wk; Wv] / [Wg; Wu] (the weak
    references die after the forward) and the backward rebuilds them: gradients equal bit for bit.
    Without a session the graph keeps them (the control that shows the check can fail)."""
    _, attn, mlp = _model(tiny_hf_config, "qwen2")
    x = _x(attn.q_proj.in_features, torch.float32)
    _, want = _outputs_and_grads(_fused, attn, mlp, x)

    refs = []
    cat_params = fused_proj._cat_params

    def spy(mods):
        w, b = cat_params(mods)
        refs.append(weakref.ref(w))
        return w, b

    monkeypatch.setattr(fused_proj, "_cat_params", spy)
    with recompute_session(session):
        outs = _fused(attn, mlp, x)
    gc.collect()
    assert len(refs) == 2 and all((r() is None) == session for r in refs), [r() is None for r in refs]
    gen = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    params = [p for n, p in [*attn.named_parameters(), *mlp.named_parameters()]
              if "o_proj" not in n and "down_proj" not in n]
    got = torch.autograd.grad(loss, [x, *params])
    for (name, w), g in zip(want.items(), got):
        assert torch.equal(g, w), name


def _decoder_attention(attn, x, cos, sin):
    """The lines proposed for decoder.Attention.forward (training path, no kv cache)."""
    b, s, _ = x.shape
    q, k, v = qkv_proj(attn, x)  # (B, S, Hq, D), (B, S, Hk, D) x 2
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope_qk(q, k, cos, sin, impl=attn.opts.impl)
    o = attention(q, k, v, impl=attn.opts.impl)
    return attn.o_proj(o.reshape(b, s, attn.nq * attn.d))


def _decoder_mlp(mlp, x):
    """The lines proposed for decoder.MLP.forward when down_proj has no forward_swiglu, with the SwiGLU
    product offered for recomputation as the decoder does for swiglu(gate, up)."""
    gu = gate_up_proj(mlp, x)
    act = swiglu_gate_up(gu, impl=mlp.opts.impl)
    if recompute.is_active():
        recompute.offer(act, functools.partial(swiglu_gate_up, gu, impl=mlp.opts.impl))
    return mlp.down_proj(act)


@pytest.mark.parametrize("session", [False, True], ids=["plain", "recompute_session"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_decoder_blocks_with_fused_projections_match(tiny_hf_config, family, session):
    """Attention / MLP with the fused projections (strided q/k/v views into q/k norm, rope, attention)
    match the modules' own forward, values and gradients, also with the weights and the SwiGLU product
    rebuilt in backward."""
    model, attn, mlp = _model(tiny_hf_config, family)
    model.set_impl(OP_IMPL)
    x = _x(model.config.hidden_size, torch.float32)
    pos = torch.arange(5).repeat(2, 1)
    cos, sin = rope_cos_sin(pos, model.model.inv_freq, model.model.attention_scaling)
    params = [p for p in [*attn.parameters(), *mlp.parameters()]]
    dy = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    for fused_fn, module_fn in [(lambda t: _decoder_attention(attn, t, cos, sin), lambda t: attn(t, cos, sin)),
                                (lambda t: _decoder_mlp(mlp, t), mlp)]:
        with recompute.recompute_session(session):
            got = fused_fn(x)
        want = module_fn(x)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        g_got = torch.autograd.grad((got * dy).sum(), [x, *params], allow_unused=True)
        g_want = torch.autograd.grad((want * dy).sum(), [x, *params], allow_unused=True)
        for a, b in zip(g_got, g_want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_traces_under_torch_compile_fullgraph(tiny_hf_config):
    _, attn, mlp = _model(tiny_hf_config, "qwen2")
    attn.opts.impl = OP_IMPL

    def f(t):
        q, k, v = qkv_proj(attn, t)
        return q.sum() + 2 * k.sum() + 3 * (v * v).sum() + swiglu_gate_up(gate_up_proj(mlp, t), impl=OP_IMPL).sum()

    x = _x(attn.q_proj.in_features, torch.float32)
    params = [x, attn.q_proj.weight, attn.v_proj.bias, mlp.gate_proj.weight, mlp.up_proj.weight]
    want = torch.autograd.grad(f(x), params)
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(x), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_first_call_traced_by_torch_compile_logs_nothing_while_tracing(tiny_hf_config, monkeypatch):
    """The path is not logged while torch.compile traces (a logging call breaks fullgraph): with nothing logged yet,
    a compiled qkv_proj / gate_up_proj traces with fullgraph=True, and the path is logged once it runs eagerly. The
    test above calls f eagerly first, so the log was already filled when its trace ran."""
    monkeypatch.setattr(fused_proj, "_logged", set())
    torch._dynamo.reset()
    _, attn, mlp = _model(tiny_hf_config, "qwen2")

    def f(t):
        q, k, v = qkv_proj(attn, t)
        return q.sum() + k.sum() + v.sum() + gate_up_proj(mlp, t).sum()

    x = _x(attn.q_proj.in_features, torch.float32)
    got = torch.compile(f, backend="eager", fullgraph=True)(x)
    assert fused_proj._logged == set()  # nothing said while tracing
    torch.testing.assert_close(got, f(x))
    assert ("qkv_proj", "one GEMM") in fused_proj._logged


def test_a_lora_group_gemm_is_logged_as_such(tiny_hf_config, monkeypatch, caplog):
    """q/k/v and gate/up served by a LoRA group's one GEMM say so in the log, once per kind."""
    import logging

    monkeypatch.setattr(fused_proj, "_logged", set())
    model, attn, mlp = _model(tiny_hf_config, "qwen2")
    apply_lora(model, r=2, alpha=4)
    x = _x(attn.q_proj.in_features, torch.float32)
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        for _ in range(2):
            qkv_proj(attn, x)
            assert gate_up_proj(mlp, x) is not None
    said = [r.getMessage() for r in caplog.records if r.name == "chronicals.models"]
    assert said == ["qkv_proj: one LoRA group GEMM", "gate_up_proj: one LoRA group GEMM"], said


def test_a_hook_is_the_reason_given_for_hooked_lora_modules(tiny_hf_config):
    """LoRA modules given a forward hook after apply_lora run apart because of the hook (their group then steps
    aside), and the reason logged says so rather than that a LoRALinear is not a plain nn.Linear."""
    model, attn, _ = _model(tiny_hf_config, "qwen2")
    apply_lora(model, r=2, alpha=4, target_modules=("q_proj", "k_proj", "v_proj"))
    assert "LoRALinear" in fusable(attn.q_proj, attn.k_proj, attn.v_proj)
    attn.k_proj.register_forward_hook(lambda *a: None)
    assert fusable(attn.q_proj, attn.k_proj, attn.v_proj) == "a module has forward hooks"


def test_the_rebuilt_concatenation_is_the_forwards_output_without_a_graph(tiny_hf_config):
    """The recipe offered with the joint GEMM (run again in backward) gives the forward's output bit for bit and
    records no graph, even where gradients are on: it stands in for a saved tensor."""
    _, attn, mlp = _model(tiny_hf_config, "qwen2")
    x = _x(attn.q_proj.in_features, torch.float32)
    for kind, owner, attr, mods in [("qkv_proj", attn, "lora_qkv", (attn.q_proj, attn.k_proj, attn.v_proj)),
                                    ("gate_up_proj", mlp, "lora_gate_up", (mlp.gate_proj, mlp.up_proj))]:
        out, recipe = fused_proj._joint_gemm(kind, owner, attr, mods, x)
        assert out.requires_grad
        again = recipe()
        assert not again.requires_grad and again.grad_fn is None
        assert torch.equal(again, out.detach())
