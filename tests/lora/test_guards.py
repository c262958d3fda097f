"""The LoRA guards a mutation walk found untested: a trainable base bias is refused as a trainable base weight is
(else it silently got no gradient), apply_lora's refusals reached only through dotted names or a regex, the PEFT
config checks between a pattern at the global value and one that is not, and the layer's own argument checks."""

import json

import pytest
import torch

from chronicals.config import ConfigError
from chronicals.lora import apply_lora, load_adapter, save_adapter
from chronicals.lora.layer import LoRALinear, LoRALinearFunction
from chronicals.lora.mlp import LoRASwiGLUDownFunction
from chronicals.lora.peft_io import read_adapter_config

from .conftest import tiny_model


def _rnd(*shape, grad=False):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64
                       ).requires_grad_(grad)


def test_a_trainable_base_bias_is_refused_in_every_function():
    """The backward returns no gradient for the base weight and bias: a bias a user unfroze (Qwen2's q/k/v, an
    mlp_bias model) must raise, not stay untrained (each check's bias half could go unnoticed)."""
    x, w, a, b = _rnd(2, 4, grad=True), _rnd(3, 4), _rnd(2, 4, grad=True), _rnd(3, 2, grad=True)
    with pytest.raises(RuntimeError, match="LoRALinearFunction: the base weight and bias must be frozen"):
        LoRALinearFunction.apply(x, w, _rnd(3, grad=True), a, b, 1.0, None)
    gate, up = _rnd(2, 4, grad=True), _rnd(2, 4, grad=True)
    with pytest.raises(RuntimeError, match="down_proj's base weight and bias must be frozen"):
        LoRASwiGLUDownFunction.apply(gate, up, w, _rnd(3, grad=True), a, b, 1.0, None, False, None, "torch")



def test_a_trainable_down_proj_weight_is_refused_by_the_lora_mlp():
    """The LoRA MLP's backward returns no gradient for down_proj's base weight: one a user unfroze raises, naming the
    fix, instead of staying untrained."""
    gate, up, a, b = _rnd(2, 4, grad=True), _rnd(2, 4, grad=True), _rnd(2, 4, grad=True), _rnd(3, 2, grad=True)
    with pytest.raises(RuntimeError, match="down_proj's base weight and bias must be frozen"):
        LoRASwiGLUDownFunction.apply(gate, up, _rnd(3, 4, grad=True), None, a, b, 1.0, None, False, None, "torch")

def test_a_trainable_bias_in_a_group_is_refused():
    """Qwen2's q/k/v run as one LoRA group: an unfrozen q_proj bias raises there too (no gradient would reach it)."""
    model = tiny_model("qwen2")
    apply_lora(model, r=2, alpha=4)
    model.model.layers[0].self_attn.q_proj.bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="LoRAGroup: the base weight and bias must be frozen"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("kw, match, key", [
    (dict(target_modules=["q_proj"], modules_to_save=["model.layers.0.self_attn.q_proj"]),
     "both LoRA targets and modules_to_save", "lora.modules_to_save"),
    (dict(target_modules=r".*(q_proj|lm_head)"), "lm_head is not supported", "lora.targets"),
])
def test_apply_lora_refusals_reached_by_dotted_names_or_a_regex(kw, match, key):
    """The config refuses the plain-name forms first; these reach apply_lora's own checks (without them: an unfrozen
    base weight failing in autograd, or an adapter on lm_head the loss never trains but generation uses), each
    naming the config key to change."""
    with pytest.raises(ConfigError, match=match) as e:
        apply_lora(tiny_model(), r=2, alpha=4, **kw)
    assert e.value.key == key


def test_all_linear_in_capitals_is_the_shorthand():
    """PEFT lower-cases "all-linear" before comparing: "ALL-LINEAR" adapts the same modules."""
    a, b = tiny_model(), tiny_model()
    apply_lora(a, r=2, alpha=4, target_modules="all-linear")
    apply_lora(b, r=2, alpha=4, target_modules="ALL-LINEAR")
    assert [n for n, p in a.named_parameters() if p.requires_grad] == [
        n for n, p in b.named_parameters() if p.requires_grad]


def test_the_record_counts_only_trainable_parameters():
    model = tiny_model()
    rec = apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    assert rec.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < rec.trainable_params < rec.total_params


def _config(tmp_path, **fields):
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    save_adapter(model, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return tmp_path / "a"


def test_an_alpha_pattern_partly_at_the_global_value_is_refused(tmp_path):
    """{"q_proj": lora_alpha, "v_proj": 4 x lora_alpha}: not every entry changes nothing, so the pattern is refused
    (keeping none of it would load v_proj at the global scaling without a word)."""
    with pytest.raises(ValueError, match=r"alpha_pattern=.* is not supported"):
        read_adapter_config(_config(tmp_path, alpha_pattern={"q_proj": 4, "v_proj": 16}))


def test_a_peft_type_other_than_lora_is_named(tmp_path):
    with pytest.raises(ValueError, match="peft_type='ADALORA'; only LORA adapters can be loaded"):
        read_adapter_config(_config(tmp_path, peft_type="ADALORA"))


@pytest.mark.parametrize("kind, peft_type", [("LoHaConfig", "LOHA"), ("IA3Config", "IA3")])
def test_a_peft_adapter_of_another_type_is_named_by_its_type(tmp_path, kind, peft_type):
    """A LoHa adapter (alpha, not lora_alpha) or an IA3 one (no r), as PEFT writes them, was told it missed
    LoRA fields ("missing field(s) lora_alpha"), not that only LoRA adapters can be loaded."""
    import peft

    getattr(peft, kind)(target_modules=["q_proj"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"peft_type='{peft_type}'; only LORA adapters can be loaded: merge it with "
                       r"PEFT first \(merge_and_unload\) and load the merged model"):
        read_adapter_config(tmp_path)


def test_explicit_nulls_in_an_adapter_config_load(tmp_path):
    """Some PEFT versions and hand edits write null for options left unset: they load as the defaults."""
    model = tiny_model()
    load_adapter(model, _config(tmp_path, use_dora=None, rank_pattern=None, alpha_pattern=None))


@pytest.mark.parametrize("kw, match", [(dict(r=0), "LoRA rank r=0 must be a positive integer"),
                                       (dict(r=2, dropout=1.0), r"LoRA dropout=1.0 must be in \[0, 1\)")])
def test_the_layer_checks_its_own_arguments(kw, match):
    """apply_lora checks these first; a LoRALinear built directly says the same (r=0 was a ZeroDivisionError)."""
    with pytest.raises(ValueError, match=match):
        LoRALinear(torch.nn.Linear(4, 3), alpha=2, **kw)
