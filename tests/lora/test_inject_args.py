"""apply_lora checks every argument before touching the model: a call that raises leaves the parameters'
requires_grad flags, the modules and the weights as they were (r=0 used to freeze all 20 parameters first)."""

import pytest
import torch
import torch.nn as nn

from chronicals.config import LoraSection
from chronicals.lora import apply_lora, lora_modules
from chronicals.lora.layer import LoRALinear, LoRALinearFunction, lora_linear_ref

from .conftest import tiny_model

BAD = [
    (dict(r=0), r"r=0 must be an integer >= 1"),
    (dict(r=-4), r"r=-4 must be an integer >= 1"),
    (dict(r=2.5), r"r=2.5 must be an integer >= 1"),
    (dict(r=True), r"r=True must be an integer >= 1"),
    (dict(alpha=0), r"alpha=0 must be a finite number > 0"),
    (dict(alpha=float("inf")), r"alpha=inf must be a finite number > 0"),
    (dict(alpha="16"), r"alpha='16' must be a finite number > 0"),
    (dict(dropout=1.0), r"dropout=1.0 must be a number in \[0, 1\)"),
    (dict(dropout=-0.1), r"dropout=-0.1 must be a number in \[0, 1\)"),
    (dict(dropout="0.1"), r"dropout='0.1' must be a number in \[0, 1\)"),
    (dict(target_modules=[]), r"target_modules=\[\] must be a non-empty list"),
    (dict(target_modules=["q_proj", 3]), r"must be a non-empty list of module names"),
    (dict(target_modules="q_proj(("), r"does not compile"),
    (dict(target_modules=["nope"]), r"matched no nn.Linear"),
    # full-matched as in PEFT: a pattern matching only the start of q_proj's name matches nothing
    (dict(target_modules=r".*\.q"), r"matched no nn.Linear"),
    # one name as a string is a regular expression over full names: the fix is a list
    (dict(target_modules="q_proj"), r"matched no nn.Linear.*a string is one regular expression matched against "
                                    r"full module names such as 'model\.layers\.0\..*: for names, pass a list, "
                                    r"e\.g\. target_modules=\['q_proj'\]"),
    (dict(modules_to_save=["nope"]), r"modules_to_save entries \['nope'\] match no module"),
    (dict(modules_to_save=[1]), r"modules_to_save=\[1\] must be a list of module names"),
    (dict(use_rslora="yes"), r"use_rslora='yes' must be True or False"),
    (dict(impl="triton"), r"impl='triton' is not one of \('fused', 'torch'\)"),
    (dict(adapter_dtype=torch.int8), r"adapter_dtype=torch.int8 must be None"),
    (dict(seed="0"), r"seed='0' must be an integer or None"),
    (dict(seed=True), r"seed=True must be an integer or None"),  # a bool is no seed, as it is no rank
    (dict(seed=False), r"seed=False must be an integer or None"),
    (dict(concat="yes"), r"concat='yes' must be 'auto', True or False"),
    (dict(group=None), r"group=None must be True or False"),
]


def snapshot(model):
    return ({n: p.requires_grad for n, p in model.named_parameters()},
            {n: type(m).__name__ for n, m in model.named_modules()},
            {n: t.clone() for n, t in model.state_dict().items()})


@pytest.mark.parametrize("kw,match", BAD, ids=[str(kw) for kw, _ in BAD])
def test_failed_call_leaves_model_unchanged(kw, match):
    model = tiny_model()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # a user's own freezing survives too
    flags, mods, state = snapshot(model)
    with pytest.raises(ValueError, match=match):
        apply_lora(model, **kw)
    flags2, mods2, state2 = snapshot(model)
    assert flags2 == flags and mods2 == mods
    assert state2.keys() == state.keys() and all(torch.equal(state2[k], state[k]) for k in state)
    assert getattr(model, "lora_config", None) is None
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    rec = apply_lora(model, r=2)  # the model is still usable
    assert rec.trainable_params > 0


def test_a_set_of_names_is_taken_as_the_list():
    """PEFT keeps target_modules as a set; apply_lora refused one ('must be a non-empty list')."""
    model = tiny_model()
    # four names: a set's own order (it varies with the string hash seed) is the sorted one once in 24 runs
    names = {"v_proj", "q_proj", "up_proj", "k_proj"}
    rec = apply_lora(model, r=2, target_modules=names, modules_to_save={"norm"})
    assert rec.target_modules == ("k_proj", "q_proj", "up_proj", "v_proj") and rec.saved_modules == ["model.norm"]
    assert {n.rpartition(".")[2] for n in rec.lora_modules} == names


def test_the_seed_decides_the_adapters_initialization():
    """apply_lora's seed picks A: the same seed gives the same A, another seed another, whatever torch's global RNG
    holds. A generator seeded with 0 whatever the seed went unseen: only seed=0 and seed=None were compared."""

    def lora_a(seed):
        model = tiny_model()
        torch.manual_seed(1234 + seed)  # the global RNG differs per call: only the seed may decide A
        apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "v_proj"], seed=seed)
        return torch.cat([m.lora_A.weight.flatten() for _, m in lora_modules(model)])

    assert torch.equal(lora_a(7), lora_a(7))
    assert not torch.equal(lora_a(7), lora_a(8))
    assert not torch.equal(lora_a(7), lora_a(0))


def test_seed_none_draws_a_from_torchs_global_rng():
    def lora_a(global_seed):
        model = tiny_model()
        torch.manual_seed(global_seed)
        apply_lora(model, r=2, alpha=4, target_modules=["q_proj"], seed=None)
        return torch.cat([m.lora_A.weight.flatten() for _, m in lora_modules(model)])

    assert torch.equal(lora_a(5), lora_a(5))
    assert not torch.equal(lora_a(5), lora_a(6))


def test_the_defaults_are_the_configs_and_reproducible():
    """apply_lora(model) trains what a config left at its defaults trains (lora.* of LoraSection), with the same A
    whatever torch's global RNG holds."""

    def adapted(global_seed):
        model = tiny_model()
        torch.manual_seed(global_seed)
        return model, apply_lora(model)

    (model, rec), (again, _) = adapted(1), adapted(2)
    d = LoraSection()
    assert (rec.r, rec.alpha, rec.dropout, rec.use_rslora) == (d.rank, d.alpha, d.dropout, d.rslora)
    assert sorted({n.rpartition(".")[2] for n in rec.lora_modules}) == sorted(d.targets)
    assert d.group and all(layer.self_attn.lora_qkv is not None for layer in model.model.layers)
    assert all(m.impl == "fused" for _, m in lora_modules(model))
    assert all(torch.equal(a.lora_A.weight, b.lora_A.weight)
               for (_, a), (_, b) in zip(lora_modules(model), lora_modules(again)))


def test_every_layer_gets_the_arguments():
    model = tiny_model()
    apply_lora(model, r=4, alpha=8, dropout=0.25, use_rslora=True, impl="torch", concat=True, group=False)
    mods = [m for _, m in lora_modules(model)]
    assert len(mods) == 14 and all(
        (m.r, m.dropout, m.scaling, m.impl, m.concat, m.group) == (4, 0.25, 4.0, "torch", True, None) for m in mods)
    apply_lora(other := tiny_model(), r=4, alpha=8, concat=False)
    assert not any(m.concat for _, m in lora_modules(other))


def test_one_name_or_a_frozenset_as_modules_to_save():
    """A single name is that one module (not its letters); a frozenset is taken as the sorted list, as a set is."""
    rec = apply_lora(tiny_model(), r=2, target_modules=["q_proj"], modules_to_save="lm_head")
    assert rec.saved_modules == ["lm_head"]
    rec = apply_lora(tiny_model(), r=2, target_modules=frozenset({"v_proj", "q_proj"}),
                     modules_to_save=frozenset({"norm", "lm_head"}))
    assert rec.target_modules == ("q_proj", "v_proj") and rec.saved_modules == ["model.norm", "lm_head"]


class _Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.proj2 = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj2(self.proj(x))


def test_a_saved_module_beside_a_target_of_a_longer_name_is_not_its_parent():
    """The "modules_to_save hold LoRA targets" refusal is for a module's children (its name and a dot):
    modules_to_save=["proj"] beside a target "proj2" was refused as its parent. Both now train."""
    net = _Siblings()
    rec = apply_lora(net, r=2, alpha=4, target_modules=["proj2"], modules_to_save=["proj"])
    assert rec.lora_modules == ["proj2"] and rec.saved_modules == ["proj"]
    assert isinstance(net.proj2, LoRALinear) and type(net.proj) is nn.Linear
    assert net.proj.weight.requires_grad and not net.proj2.weight.requires_grad
    net(torch.randn(3, 4)).sum().backward()
    assert net.proj.weight.grad is not None


def test_a_saved_block_trains_all_its_childrens_parameters():
    """modules_to_save=["model.layers.1.mlp"] unfreezes gate/up/down_proj's weights, counts them in
    trainable_params and gives them gradients. Unfreezing only the block's own parameters (it has none) left the
    MLP frozen: saved and loaded, never trained."""
    model = tiny_model()
    rec = apply_lora(model, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["model.layers.1.mlp"])
    mlp = model.model.layers[1].mlp
    assert rec.saved_modules == ["model.layers.1.mlp"]  # its children are inside it, not tied partners
    assert list(mlp.parameters()) and all(p.requires_grad for p in mlp.parameters())
    assert not any(p.requires_grad for p in model.model.layers[0].mlp.parameters())
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert rec.trainable_params == adapters + sum(p.numel() for p in mlp.parameters())
    model.train()
    model(torch.tensor([[1, 2, 3, 4]])).float().sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())


@pytest.mark.parametrize("p", [-0.1, -1e-9])
def test_a_negative_dropout_is_refused_by_the_layer(p):
    """A LoRALinear built directly refuses a negative dropout as apply_lora does; without the lower bound
    dropout=-0.1 was taken and silently meant no dropout."""
    with pytest.raises(ValueError, match=rf"LoRA dropout={p} must be in \[0, 1\)"):
        LoRALinear(nn.Linear(4, 3), r=2, alpha=2, dropout=p)
    assert LoRALinear(nn.Linear(4, 3), r=2, alpha=2, dropout=0.0).dropout == 0.0


@pytest.mark.parametrize("fin,fout", [(8, 6), (4, 8)], ids=["addmm", "concatenated"])
def test_impl_torch_runs_the_reference_not_the_fused_function(fin, fout, monkeypatch):
    """LoRALinear(impl="torch") runs lora_linear_ref (plain autograd, as PEFT), never LoRALinearFunction, in both
    layouts. With the impl check dropped, impl="torch" ran the fused path unseen: the outputs agree to rounding,
    and "torch" is the reference the suite compares the fused path against."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(fin, fout).double(), r=2, alpha=4, impl="torch")
    with torch.no_grad():
        layer.lora_B.weight.normal_()

    def refuse(*a, **k):
        raise AssertionError("impl='torch' called LoRALinearFunction")

    monkeypatch.setattr(LoRALinearFunction, "apply", refuse)
    x = torch.randn(3, fin, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, lora_linear_ref(x, layer.weight, layer.bias, layer.lora_A.weight, layer.lora_B.weight,
                                          layer.scaling))
    y.sum().backward()
    assert layer.lora_A.weight.grad is not None and layer.lora_B.weight.grad is not None


def test_a_target_name_that_matches_nothing_beside_good_ones_is_warned_of(caplog):
    """apply_lora leaves a listed name that matches no module out, as PEFT does (an adapter may list another
    architecture's names), but a typo beside good names adapted fewer layers without a word (an API walk; the
    trainer refuses it: lora.targets is the user's own)."""
    import logging

    model = tiny_model()
    with caplog.at_level(logging.WARNING, logger="chronicals.lora"):
        apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "qproj_typo"])
    said = [r.getMessage() for r in caplog.records if "match no module" in r.getMessage()]
    assert len(said) == 1 and "['qproj_typo']" in said[0] and "q_proj" in said[0]
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 2  # q_proj of each of the 2 layers
    caplog.clear()
    apply_lora(tiny_model(), r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    assert not [r for r in caplog.records if "match no module" in r.getMessage()]


# names only a model can refuse, beside BAD's: each must read the same from a model built on the meta device
NAMES = [
    (dict(target_modules=r".*lm_head"), r"LoRA on lm_head is not supported"),
    (dict(target_modules=["q_proj", "embed_tokens"]), r"that are not nn.Linear"),
    (dict(modules_to_save=["self_attn"]), r"hold LoRA targets"),
    (dict(target_modules=["q_proj"], modules_to_save=["layers.0.self_attn.q_proj"]),
     r"are both LoRA targets and modules_to_save"),
]


@pytest.mark.parametrize("kw,match", BAD + NAMES, ids=[str(kw) for kw, _ in BAD + NAMES])
def test_check_lora_on_a_meta_model_refuses_as_apply_lora_does(kw, match):
    """check_lora reads module names and kinds only: on the decoder built from the config on the meta device (no
    weights: how train and eval check a config's or an adapter's names before the data and the weights) it raises
    what apply_lora raises on the loaded model, word for word and with the same config key, and changes nothing."""
    from chronicals.lora.inject import check_lora
    from chronicals.models import CausalLM

    with torch.device("meta"):
        shell = CausalLM(tiny_model().config)
    mods = {n: type(m).__name__ for n, m in shell.named_modules()}
    with pytest.raises(ValueError, match=match) as real:
        apply_lora(tiny_model(), **kw)
    with pytest.raises(type(real.value)) as meta:
        check_lora(shell, **kw)
    assert str(meta.value) == str(real.value) and getattr(meta.value, "key", None) == getattr(real.value, "key", None)
    assert {n: type(m).__name__ for n, m in shell.named_modules()} == mods and not hasattr(shell, "lora_config")


def test_check_lora_on_a_meta_model_names_what_apply_lora_adapts():
    from chronicals.lora.inject import check_lora
    from chronicals.models import CausalLM

    with torch.device("meta"):
        shell = CausalLM(tiny_model().config)
    kw = dict(target_modules="all-linear", modules_to_save=["norm"])
    rec = apply_lora(tiny_model(), **kw)
    targets, lora, saved = check_lora(shell, **kw)
    assert targets == rec.target_modules and lora == rec.lora_modules and saved == rec.saved_modules == ["model.norm"]
