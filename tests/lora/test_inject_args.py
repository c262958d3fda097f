"""apply_lora checks every argument before touching the model: a call that raises leaves the parameters'
requires_grad flags, the modules and the weights as they were (r=0 used to freeze all 20 parameters first)."""

import pytest
import torch

from chronicals.lora import apply_lora
from chronicals.lora.layer import LoRALinear

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
    (dict(target_modules=[]), r"target_modules=\[\] must be a non-empty list"),
    (dict(target_modules=["q_proj", 3]), r"must be a non-empty list of module names"),
    (dict(target_modules="q_proj(("), r"does not compile"),
    (dict(target_modules=["nope"]), r"matched no nn.Linear"),
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
    rec = apply_lora(model, r=2, target_modules={"v_proj", "q_proj"}, modules_to_save={"norm"})
    assert rec.target_modules == ("q_proj", "v_proj") and rec.saved_modules == ["model.norm"]
    assert {n.rpartition(".")[2] for n in rec.lora_modules} == {"q_proj", "v_proj"}
