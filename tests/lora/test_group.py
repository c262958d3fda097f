"""LoRA groups (q/k/v, gate/up as one GEMM): the function against per-module references, the model against
the ungrouped model, and the shared weight buffer through .to(), state dicts and merging."""

import gc
import logging
import re
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from chronicals.lora import LoRALinear, apply_lora, lora_linear_ref, merge_lora
from chronicals.lora import group as group_mod
from chronicals.lora.group import LoRAGroup, LoRAGroupFunction, bind_groups, why_not
from chronicals.lora.layer import draw_mask
from chronicals.ops import dropout as D

from .conftest import randomize_lora_b, tiny_model

# (in, [(out_i, r_i)]): unequal outs and ranks, an out of 1, a rank of 1
MEMBERS = [(7, [(5, 3), (2, 1), (2, 2)]), (13, [(11, 4), (11, 4)]), (4, [(1, 2), (9, 1)])]


def _members(fin, spec, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    mods = []
    for out, r in spec:
        lin = nn.Linear(fin, out, bias=bias, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out, fin, generator=g, dtype=torch.float64))
            if bias:
                lin.bias.copy_(torch.randn(out, generator=g, dtype=torch.float64))
        m = LoRALinear(lin, r=r, alpha=2.0 * r + 1, generator=g)
        with torch.no_grad():
            m.lora_B.weight.copy_(torch.randn(out, r, generator=g, dtype=torch.float64))
        mods.append(m)
    return mods


class _Ops(TorchDispatchMode):
    """Records the aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fin,spec", MEMBERS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [True, False])
def test_group_matches_per_module_reference_float64(fin, spec, bias, x_grad):
    mods = _members(fin, spec, bias)
    x = torch.randn(2, 3, fin, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, 3, sum(o for o, _ in spec), dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = [p for m in mods for p in (m.lora_A.weight, m.lora_B.weight)]
    # reference first: the group rebinds W into its buffer (same values)
    xr = x.clone().requires_grad_(x_grad)
    want = torch.cat([lora_linear_ref(xr, m.weight, m.bias, m.lora_A.weight, m.lora_B.weight, m.scaling)
                      for m in mods], dim=-1)
    want_g = torch.autograd.grad(want, ([xr] if x_grad else []) + params, dy)
    group = LoRAGroup(mods)
    xg = x.clone().requires_grad_(x_grad)
    got = group(xg)
    got_g = torch.autograd.grad(got, ([xg] if x_grad else []) + params, dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"gradient {i}")


def test_float32_adapters_on_a_float64_base_scale_b_in_the_base_dtype():
    """M holds s_i B_i: with float32 adapters on a float64 base both A and B are cast to float64 (exactly) before
    B is scaled, as LoRALinear does. Casting only A let torch.mul(B_fp32, s) round s B to float32 (s = 7/3 here;
    the model test's s = 2 is exact): an output off by ~1e-8 relative."""
    mods = _members(7, [(5, 3), (2, 1), (2, 2)], bias=True)
    for m in mods:
        m.lora_A.weight = nn.Parameter(m.lora_A.weight.detach().float())
        m.lora_B.weight = nn.Parameter(m.lora_B.weight.detach().float())
    assert abs(mods[0].scaling - 7 / 3) < 1e-15
    x = torch.randn(2, 3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want = torch.cat([lora_linear_ref(x, m.weight, m.bias, m.lora_A.weight.double(), m.lora_B.weight.double(),
                                      m.scaling) for m in mods], dim=-1)
    group = LoRAGroup(mods)
    with torch.no_grad():
        torch.testing.assert_close(group(x), want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("fin,spec", MEMBERS)
@pytest.mark.parametrize("drops", [(0.25, 0.5, 0.1), (0.0, 0.3, 0.0)])
@pytest.mark.parametrize("x_grad", [True, False])
def test_group_with_dropout_matches_per_module_reference_float64(fin, spec, drops, x_grad):
    """Each member's branch sees its own mask (a member with dropout 0 none): output, dx, every dA and dB as
    lora_linear_ref computes them with the same masks, also for an x that needs no gradient (a first layer's);
    recompute() with those masks gives the output again."""
    mods = _members(fin, spec, bias=True)
    for m, p in zip(mods, drops):
        m.dropout = p
    x = torch.randn(2, 3, fin, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, 3, sum(o for o, _ in spec), dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = [p for m in mods for p in (m.lora_A.weight, m.lora_B.weight)]
    group = LoRAGroup(mods)
    xg = x.clone().requires_grad_(x_grad)
    torch.manual_seed(11)
    got, recipe = group.with_recipe(xg)
    got_g = torch.autograd.grad(got, ([xg] if x_grad else []) + params, dy)
    torch.manual_seed(11)  # the draws the group made, in member order; their masks built in full
    draws = [D.draw(m.dropout, "cpu") if m.dropout > 0 else None for m in mods]
    masks = [None if d is None else draw_mask(d, x.shape) for d in draws]
    assert any(mk is not None and not mk.all() for mk in masks)
    xr = x.clone().requires_grad_(x_grad)
    want = torch.cat([lora_linear_ref(xr, m.weight, m.bias, m.lora_A.weight, m.lora_B.weight, m.scaling, mk,
                                      0.0 if d is None else d.p_applied)
                      for m, mk, d in zip(mods, masks, draws)], dim=-1)
    want_g = torch.autograd.grad(want, ([xr] if x_grad else []) + params, dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"gradient {i}")
    assert torch.equal(recipe(), got.detach())
    for m in mods:  # eval: no masks, the plain group
        m.eval()
    plain = torch.cat([lora_linear_ref(x, m.weight, m.bias, m.lora_A.weight, m.lora_B.weight, m.scaling)
                       for m in mods], dim=-1)
    torch.testing.assert_close(group(x), plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("need_x", [True, False])
def test_second_backward_with_dropout_gives_the_first_ones_gradients(need_x):
    """retain_graph=True: a second backward through one grouped forward uses the same draws (the first backward
    used to drop them from ctx, so the second ran with no dropout at all: other dx and dA without an error)."""
    fin, spec = 13, [(11, 4), (5, 2), (5, 2)]
    mods = _members(fin, spec, bias=False)
    for m, p in zip(mods, (0.5, 0.0, 0.3)):
        m.dropout = p
    group = LoRAGroup(mods)
    x = torch.randn(2, 3, fin, dtype=torch.float64, requires_grad=need_x)
    torch.manual_seed(4)
    y = group(x)
    dy = torch.randn_like(y)
    wrt = ([x] if need_x else []) + [m.lora_A.weight for m in mods]
    first = torch.autograd.grad(y, wrt, dy, retain_graph=True)
    second = torch.autograd.grad(y, wrt, dy)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"gradient {i}"


def test_recipe_output_carries_no_graph():
    """The recipe handed to ops.recompute only rebuilds the forward's bits: called with grad mode on (a direct
    caller, or a backward with create_graph) it must record no graph on A (without no_grad its GEMMs did, keeping x,
    A_all and the cat alive)."""
    group = LoRAGroup(_members(7, [(5, 3), (2, 1)], bias=True))
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    y, recipe = group.with_recipe(x)
    again = recipe()
    assert not again.requires_grad and again.grad_fn is None
    assert torch.equal(again, y.detach())


def test_eval_with_dropout_configured_takes_the_plain_one_gemm_path():
    """Dropout only applies in training: in eval a group whose members have dropout draws no masks and runs the
    same ops as one without (one GEMM for every member's x A_i^T). Drawing a tuple of Nones in eval had sent it down
    the per-member dropout path: 3 + 1 GEMMs and a cat instead of 2 GEMMs."""
    def ops_of(drops):
        mods = _members(13, [(11, 4), (5, 2), (5, 2)], bias=False)
        for m, p in zip(mods, drops):
            m.dropout = p
            m.eval()
        group = LoRAGroup(mods)
        x = torch.randn(2, 3, 13, dtype=torch.float64)
        with torch.no_grad(), _Ops() as ops:
            group(x)
        return ops.names

    plain, dropped = ops_of((0.0, 0.0, 0.0)), ops_of((0.3, 0.0, 0.5))
    assert dropped == plain, (dropped, plain)
    assert dropped.count("aten.mm") == 2, dropped


def test_backward_writes_dx_in_place_without_a_copy():
    """dx is summed into the first in columns of the backward GEMM's (N, in + R) output, in place: no
    aten copy of that strided view (out of place, addmm copied it first: 1.8 ms a step at 0.5B on an H200)."""
    fin, spec = 13, [(11, 4), (11, 4)]
    mods = _members(fin, spec, bias=False)
    group = LoRAGroup(mods)
    x = torch.randn(2, 3, fin, dtype=torch.float64, requires_grad=True)
    y = group(x)
    with _Ops() as ops:
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert "aten.copy_" not in ops.names and "aten.addmm_" in ops.names, ops.names
    assert dx.stride() == (3 * (fin + 8), fin + 8, 1)  # a view of the (N, in + R) GEMM output


def test_dropout_backward_takes_the_dropped_input_for_da_from_the_dx_pass(monkeypatch):
    """With dx and dA both needed, add_branch_dx_ hands back drop_i(x) from the pass that adds member i's rank-r term
    to dx; the backward must not build it again with branch_input and a draw (a second dropout pass and mask over
    (N, in) per dropout member: same values, twice the work). A member without dropout reads x itself."""
    mods = _members(13, [(11, 4), (5, 2), (5, 2)], bias=False)
    for m, p in zip(mods, (0.5, 0.0, 0.3)):
        m.dropout = p
    group = LoRAGroup(mods)
    x = torch.randn(2, 3, 13, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(4)
    y = group(x)
    draws = []
    real = group_mod.branch_input
    monkeypatch.setattr(group_mod, "branch_input", lambda x2, d: (d is not None and draws.append(d)) or real(x2, d))
    y.backward(torch.randn_like(y))
    assert draws == []
    assert all(m.lora_A.weight.grad.abs().sum() > 0 for m in mods)


def test_backward_runs_no_gemm_for_a_frozen_a_or_b(monkeypatch):
    """Only the gradients asked for are computed: a frozen B gets no dB (mm_scaled) and a frozen A no dA GEMM
    (exactly one aten.mm fewer). Both were computed and then dropped by autograd: same values, wasted GEMMs."""
    def backward_ops(freeze_a=False, freeze_b=False):
        mods = _members(13, [(11, 4), (5, 2)], bias=False)
        for m in mods:
            m.lora_A.weight.requires_grad_(not freeze_a)
            m.lora_B.weight.requires_grad_(not freeze_b)
        group = LoRAGroup(mods)
        x = torch.randn(2, 3, 13, dtype=torch.float64, requires_grad=True)
        y = group(x)
        with _Ops() as ops:
            y.backward(torch.ones_like(y))
        return ops.names

    db_calls = []
    real = group_mod.mm_scaled
    monkeypatch.setattr(group_mod, "mm_scaled", lambda *a: db_calls.append(1) or real(*a))
    backward_ops(freeze_b=True)
    assert db_calls == []
    trained = backward_ops()
    assert len(db_calls) == 2  # one dB per member when B trains
    frozen_a = backward_ops(freeze_a=True)
    assert frozen_a.count("aten.mm") == trained.count("aten.mm") - 1, (frozen_a, trained)


@pytest.mark.parametrize("frozen", [0, 1])
def test_a_member_with_a_frozen_b_leaves_the_others_b_gradients_float64(frozen):
    """One member's B frozen, the others' trained: each trained B gets the per-module reference gradient (its own
    rows of dy)."""
    fin, spec = 7, [(5, 3), (2, 1), (2, 2)]
    mods = _members(fin, spec, bias=False)
    mods[frozen].lora_B.weight.requires_grad_(False)
    x = torch.randn(2, 3, fin, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, 3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    bs = [m.lora_B.weight for i, m in enumerate(mods) if i != frozen]
    want = torch.cat([lora_linear_ref(x, m.weight, m.bias, m.lora_A.weight, m.lora_B.weight, m.scaling)
                      for m in mods], dim=-1)
    want_g = torch.autograd.grad(want, bs, dy)
    got_g = torch.autograd.grad(LoRAGroup(mods)(x), bs, dy)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"dB {i}")


def test_members_share_one_buffer_and_keep_their_state_dict():
    mods = _members(7, [(5, 3), (2, 1)], bias=True)
    keys = [sorted(m.state_dict()) for m in mods]
    before = [m.weight.detach().clone() for m in mods]
    group = LoRAGroup(mods)
    assert [sorted(m.state_dict()) for m in mods] == keys
    assert mods[0].weight.untyped_storage().data_ptr() == mods[1].weight.untyped_storage().data_ptr()
    for m, w in zip(mods, before):
        assert torch.equal(m.weight, w) and m._wcat is None and m.group is group
    # off-diagonal B blocks stay zero after a call; diagonal blocks hold s B
    group(torch.randn(3, 7, dtype=torch.float64))
    mat = group._mat
    assert torch.equal(mat[:5, 7 + 3:], torch.zeros(5, 1, dtype=mat.dtype))
    assert torch.equal(mat[5:, 7:7 + 3], torch.zeros(2, 3, dtype=mat.dtype))
    torch.testing.assert_close(mat[5:, 10:], mods[1].lora_B.weight * mods[1].scaling)


def test_grouped_members_drop_their_own_concat_buffer():
    """concat=True members hold a persistent [W | s B] buffer; in a group W lives in the group's M, so each member's
    buffer (a full copy of the old W) is released, not kept beside M. Also so for gate/up grouped by apply_lora."""
    g = torch.Generator().manual_seed(0)
    mods = [LoRALinear(nn.Linear(4, n, dtype=torch.float64), r=2, alpha=3, concat=True, generator=g) for n in (9, 3)]
    assert all(m._wcat is not None for m in mods)
    olds = [weakref.ref(m._wcat) for m in mods]
    group = LoRAGroup(mods)
    gc.collect()
    assert all(m._wcat is None for m in mods)
    assert [o() for o in olds] == [None, None]
    assert mods[0].weight.data_ptr() == group._mat.data_ptr()
    model = tiny_model("llama")
    apply_lora(model, r=2, alpha=4, concat=True)
    mlp = model.model.layers[0].mlp
    assert mlp.__dict__.get("lora_gate_up") is not None
    assert mlp.gate_proj._wcat is None and mlp.up_proj._wcat is None


def test_calls_reuse_the_bound_buffer(caplog):
    """Once bound, the group keeps M across calls and only refreshes its s B blocks in place (B changed by an
    optimizer step): no rebuild of M (a full copy of every W) and no "rebinding" log line per call."""
    mods = _members(7, [(5, 3), (2, 1), (2, 2)], bias=False)
    group = LoRAGroup(mods)
    mat = group._mat
    x = torch.randn(3, 7, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="chronicals"):
        for step in range(2):
            with torch.no_grad():
                mods[2].lora_B.weight.add_(1.0)  # an optimizer step, in place
            group(x)
            assert group._mat is mat, step
    assert "rebinding" not in caplog.text
    torch.testing.assert_close(mat[7:, 7 + 4:], mods[2].lora_B.weight * mods[2].scaling)


def test_why_not_names_the_reason():
    mods = _members(7, [(5, 3), (2, 1)], bias=False)
    assert why_not(mods) is None
    mods[1].dropout = 0.1  # dropout runs in the group (its own masks per member)
    assert why_not(mods) is None
    mods[0].impl = "torch"
    assert "impl" in why_not(mods)
    with pytest.raises(ValueError, match="cannot share one GEMM"):
        LoRAGroup(mods)
    assert "LoRALinear" in why_not([nn.Linear(3, 3)])


def _hooked(mods, pre=False):
    if pre:
        mods[0].register_forward_pre_hook(lambda mod, args: None)
    else:
        mods[1].register_forward_hook(lambda mod, args, out: None)
    return mods


def _b_in_float32(mods):
    mods[1].lora_B.weight = nn.Parameter(mods[1].lora_B.weight.detach().float())
    return mods


def _a_in_float32(mods):
    mods[1].lora_A.weight = nn.Parameter(mods[1].lora_A.weight.detach().float())
    return mods


MISMATCHES = {  # members that cannot share one GEMM -> the reason why_not gives
    "forward hook": (lambda: _hooked(_members(7, [(5, 3), (2, 1)], bias=False)), "a module has forward hooks"),
    "forward pre-hook": (lambda: _hooked(_members(7, [(5, 3), (2, 1)], bias=False), pre=True),
                         "a module has forward hooks"),
    "in_features": (lambda: _members(7, [(5, 3)], bias=False) + _members(6, [(2, 1)], bias=False, seed=1),
                    "the modules differ in in_features"),
    "base dtype": (lambda: _members(7, [(5, 3)], bias=False) + [_members(7, [(2, 1)], bias=False, seed=1)[0].float()],
                   "the base weights differ in dtype or device"),
    "B dtype": (lambda: _b_in_float32(_members(7, [(5, 3), (2, 1)], bias=False)), "the adapters differ in dtype"),
    "A dtype": (lambda: _a_in_float32(_members(7, [(5, 3), (2, 1)], bias=False)), "the adapters differ in dtype"),
    "device": (lambda: _members(7, [(5, 3)], bias=False)
               + [LoRALinear(nn.Linear(7, 2, bias=False, device="meta", dtype=torch.float64), r=1, alpha=3)],
               "the base weights differ in dtype or device"),
    "bias mix": (lambda: _members(7, [(5, 3)], bias=True) + _members(7, [(3, 2)], bias=False, seed=1),
                 "some have a bias and some do not"),
    "meta device": (lambda: [LoRALinear(nn.Linear(6, n, bias=False, device="meta"), r=2, alpha=4) for n in (6, 3)],
                    "the weights are on the meta device"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_why_not_names_each_mismatch_and_the_group_refuses_it(case):
    """The group's one GEMM reads one x, calls no member (so a hook would never run), holds s B in W's dtype and adds
    one cat of the biases: a member with a hook, another in_features, another base dtype or device, another A or B
    dtype, or a bias where the others have none is refused by name, and so are weights on the meta device (nothing to
    copy into M). Without each check the group formed (and skipped the hook, or failed inside cat / mm, or built a
    meta M), or, for the base dtype, the log blamed the adapters."""
    make, reason = MISMATCHES[case]
    mods = make()
    assert why_not(mods) == reason
    with pytest.raises(ValueError, match=f"cannot share one GEMM: {re.escape(reason)}"):
        LoRAGroup(mods)


def test_bind_groups_counts_the_groups_it_makes(caplog):
    """Two layers, each with q/k/v and gate/up: bind_groups returns 4, and apply_lora's log line says 4 (the count
    was unchecked: a bind_groups returning 0 went unnoticed)."""
    model = tiny_model("llama")
    apply_lora(model, r=2, alpha=4, group=False)
    assert bind_groups(model) == 4
    with caplog.at_level(logging.INFO, logger="chronicals"):
        apply_lora(tiny_model("llama"), r=2, alpha=4)
    assert "apply_lora: 4 LoRA groups" in caplog.text


def test_bind_groups_logs_why_a_block_runs_apart_and_nothing_for_blocks_without_lora(caplog):
    """A block whose projections are all LoRA but cannot share one GEMM is named with the reason; a block where only
    some projections are LoRA (q_proj, gate_proj here) is no candidate: no group and no reason logged for it."""
    model = tiny_model("llama")
    apply_lora(model, r=2, alpha=4, group=False)
    model.model.layers[0].self_attn.k_proj.impl = "torch"
    with caplog.at_level(logging.INFO, logger="chronicals"):
        assert bind_groups(model) == 3
    assert "separate projection calls (lora_qkv: impl='torch' (the group is the fused path))" in caplog.text
    caplog.clear()
    model = tiny_model("llama")
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "gate_proj"], group=False)
    with caplog.at_level(logging.INFO, logger="chronicals"):
        assert bind_groups(model) == 0
    assert "LoRA groups" not in caplog.text


@pytest.mark.parametrize("kind,adapter_dtype", [("llama", None), ("qwen2", None), ("qwen2", torch.float32)])
def test_grouped_model_equals_ungrouped_float64(kind, adapter_dtype, ids):
    """Logits and every adapter gradient, grouped (default) vs one call per module, on a float64 model
    (adapter_dtype float32: the adapters are cast to the activations' dtype, as LoRALinear does)."""
    _grouped_equals_ungrouped(kind, ids, adapter_dtype=adapter_dtype)


def _grouped_equals_ungrouped(kind, ids, recompute=None, **lora):
    """The loss and every adapter gradient of a float64 model, grouped vs one call per module, agree (the same
    seed before each forward: the same dropout masks); returns the grouped model."""
    out = []
    for group in (True, False):
        model = tiny_model(kind).double().train()
        if recompute is not None:
            model.set_recompute(recompute)
        apply_lora(model, r=4, alpha=8, group=group, **lora)
        randomize_lora_b(model)
        assert (model.model.layers[0].self_attn.__dict__.get("lora_qkv") is not None) == group
        assert (model.model.layers[0].mlp.__dict__.get("lora_gate_up") is not None) == group
        torch.manual_seed(3)
        loss = model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="sum")
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        grouped = model if group else grouped
    (la, ga), (lb, gb) = out
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    assert ga.keys() == gb.keys() and len(ga) == 2 * 7 * 2
    for n in ga:
        assert ga[n].abs().sum() > 0, n
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-10, atol=1e-12, msg=n)
    return grouped


@pytest.mark.parametrize("recompute", [("norm", "swiglu"), ("norm", "swiglu", "gate_up")])
def test_grouped_model_with_dropout_equals_ungrouped_float64(recompute, ids):
    """lora.dropout > 0 kept every block on one call per projection. Grouped now: the same masks (drawn in the
    same order and shapes from the same seed), so the loss and every adapter gradient equal the separate
    calls', also with the gate/up output rebuilt in backward from the group's recipe (``gate_up``)."""
    model = _grouped_equals_ungrouped("qwen2", ids, recompute, dropout=0.2)
    model.eval()  # a dropout model in eval: the group's plain path, the ungrouped model's logits
    ref = tiny_model("qwen2").double().eval()
    apply_lora(ref, r=4, alpha=8, dropout=0.2, group=False)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-10, atol=1e-12)


def test_to_dtype_rebinds_and_merge_restores_plain_linears(ids):
    model = tiny_model("qwen2")
    apply_lora(model, r=4, alpha=8)
    randomize_lora_b(model)
    with torch.no_grad():
        want = model.double()(ids)  # .to(dtype): the group rebinds at its next call
    attn = model.model.layers[0].self_attn
    group = attn.lora_qkv
    assert group._mat is not None and group._mat.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == group._mat.data_ptr()
    ref = tiny_model("qwen2").double()
    apply_lora(ref, r=4, alpha=8, group=False)
    randomize_lora_b(ref)
    with torch.no_grad():
        torch.testing.assert_close(want, ref(ids), rtol=1e-10, atol=1e-12)
        merge_lora(model)
        assert "lora_qkv" not in attn.__dict__ and type(attn.q_proj) is nn.Linear
        assert attn.q_proj.weight.is_contiguous() and attn.q_proj.weight.data_ptr() != group._mat.data_ptr()
        # a float64 model merges in float64 (LoRALinear.delta_weight; it was fp32: agreement only to 1e-6)
        torch.testing.assert_close(model(ids), want, rtol=1e-11, atol=1e-12)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def test_to_frees_the_old_shared_buffer_before_the_next_call():
    """After model.to(...) the groups' old (sum out, in + R) buffers are freed at once, as release_if_stale says:
    the group's B views into one had kept the whole buffer (every member's W) alive until the next forward, e.g.
    the base's q/k/v and gate/up weights held on the GPU after moving the model to the CPU."""
    model = tiny_model("qwen2")
    apply_lora(model, r=4, alpha=8)
    groups = [g for layer in model.model.layers for g in (layer.self_attn.lora_qkv, layer.mlp.lora_gate_up)]
    olds = [weakref.ref(g._mat) for g in groups]
    model.double()
    gc.collect()
    assert [o() for o in olds] == [None] * len(olds)


def test_bind_during_cuda_graph_capture_raises_and_keeps_the_buffer(monkeypatch):
    """A rebind allocates M and copies every W: inside a CUDA-graph capture it would bake a fresh allocation into the
    graph, so bind() raises (move or load the model before the first step) and leaves M alone (capture faked on the
    CPU; the check was untested)."""
    group = LoRAGroup(_members(7, [(5, 3), (2, 1)], bias=False))
    mat = group._mat
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="changed storage during CUDA-graph capture"):
        group.bind()
    assert group._mat is mat


def test_merge_frees_each_group_and_its_buffer_without_the_cycle_collector():
    """Each member points at its group (m.group) and the group at its members: merge_lora breaks that cycle, so the
    group and its (sum out, in + R) buffer (the q/k/v or gate/up weights' old storage) are freed by reference
    counting at once, not left for a later gc pass (with gc disabled they stayed alive). No module keeps a group
    attribute: the gate/up groups had been left on the MLPs, their buffers alive."""
    model = tiny_model("llama")
    apply_lora(model, r=2, alpha=4)
    layer = model.model.layers[0]
    groups = [layer.self_attn.lora_qkv, layer.mlp.lora_gate_up]
    refs = [weakref.ref(o) for g in groups for o in (g, g._mat)]
    del groups
    gc.collect()
    gc.disable()
    try:
        merge_lora(model)
        assert not any(a in m.__dict__ for m in model.modules() for a in ("lora_qkv", "lora_gate_up"))
        assert [r() for r in refs] == [None] * 4
    finally:
        gc.enable()


def test_a_hook_added_after_apply_lora_runs_and_an_unfrozen_base_weight_is_refused(ids):
    """The group's one GEMM calls no member: a forward hook put on q_proj after apply_lora was skipped, and a base
    weight unfrozen later got no gradient, both without a word. The members now run apart while one has a hook
    (same logits), and an unfrozen base weight raises as a lone LoRALinear does."""
    model = tiny_model("qwen2").double()
    apply_lora(model, r=4, alpha=8)
    randomize_lora_b(model)
    with torch.no_grad():
        want = model(ids)
    attn = model.model.layers[0].self_attn
    seen = []
    handle = attn.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, rtol=1e-12, atol=1e-12)
    assert seen == [(*ids.shape, attn.k_proj.out_features)]
    handle.remove()
    model(ids)
    assert len(seen) == 1  # grouped again
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="LoRAGroup: the base weight and bias must be frozen"):
        model(ids)
    with torch.no_grad():
        model(ids)  # no gradient: nothing to lose


def test_a_pre_hook_added_after_apply_lora_runs(ids):
    """As a forward hook, a forward pre-hook put on up_proj after apply_lora makes the gate/up members run apart, so
    it runs once, with the same logits (a pre-hook added late was skipped without a word)."""
    model = tiny_model("qwen2").double()
    apply_lora(model, r=4, alpha=8)
    randomize_lora_b(model)
    with torch.no_grad():
        want = model(ids)
    seen = []
    up = model.model.layers[1].mlp.up_proj
    handle = up.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, rtol=1e-12, atol=1e-12)
    assert seen == [(*ids.shape, up.in_features)]
    handle.remove()


def test_a_base_weight_given_new_storage_from_outside_is_followed(ids):
    """`q_proj.weight.data = t` (a loader rebinding .data) leaves the group's buffer holding the old W: the group sees
    that the member's weight no longer points into it and rebuilds, so the logits are those of the new weights, as
    the ungrouped model's (untested for the group: a mutation walk; LoRALinear had its test)."""
    grouped, plain = tiny_model("qwen2").double(), tiny_model("qwen2").double()
    apply_lora(grouped, r=4, alpha=8)
    apply_lora(plain, r=4, alpha=8, group=False)
    for m in (grouped, plain):
        randomize_lora_b(m)
    with torch.no_grad():
        grouped(ids)  # bound: the members' weights are views of the group's buffer
        g = torch.Generator().manual_seed(9)
        for m in (grouped, plain):
            layer = m.model.layers[0]
            for lin in (layer.self_attn.q_proj, layer.mlp.up_proj):
                lin.weight.data = torch.randn(lin.weight.shape, generator=g.manual_seed(lin.weight.shape[0]),
                                              dtype=torch.float64)
        torch.testing.assert_close(grouped(ids), plain(ids), rtol=1e-12, atol=1e-12)


def test_a_member_module_replaced_after_apply_lora_is_the_one_that_runs(ids):
    """`attn.q_proj = new_module` after the q/k/v group formed: the group no longer holds that block's modules, so the
    block runs its current modules apart and the logits are those of the new q_proj (as in the ungrouped model)."""
    grouped, plain = tiny_model("qwen2").double(), tiny_model("qwen2").double()
    apply_lora(grouped, r=4, alpha=8)
    apply_lora(plain, r=4, alpha=8, group=False)
    for m in (grouped, plain):
        randomize_lora_b(m)
    g = torch.Generator().manual_seed(9)
    new = nn.Linear(32, 32, dtype=torch.float64)
    with torch.no_grad():
        grouped(ids)  # the group is bound and used once
        new.weight.copy_(torch.randn(32, 32, generator=g, dtype=torch.float64))
        for m in (grouped, plain):
            m.model.layers[0].self_attn.q_proj = new
        torch.testing.assert_close(grouped(ids), plain(ids), rtol=1e-12, atol=1e-12)
