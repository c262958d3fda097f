"""``check_adapter``: the adapter file's tensor names and shapes, read from its safetensors header, checked against
the decoder built on the meta device (no weights) with load_adapter's own check and in its words, so that
``chronicals eval --adapter`` refuses a file of another model before the weights load (tests/test_cli_eval_hostile.py
shows that part)."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from chronicals.lora import apply_lora, load_adapter, save_adapter
from chronicals.lora.peft_io import check_adapter
from chronicals.models import CausalLM, ModelConfig
from chronicals.models.loading import meta_model

from .conftest import hf_config, tiny_model

P = "base_model.model."
Q0 = f"{P}model.layers.0.self_attn.q_proj"


def _wider_model(tied: bool) -> CausalLM:
    """The tiny model's architecture with other sizes (intermediate 56, vocabulary 69 in place of 40 and 61): its
    module names are the tiny model's."""
    hf = hf_config(tied=tied)
    hf.intermediate_size, hf.vocab_size = 56, 69
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=1)


def _edited(src, out, edit=None):
    """``src`` (adapted) saved to ``out`` with its tensors changed by ``edit(dict)`` -> ``out``."""
    save_adapter(src, out)
    if edit is not None:
        wpath = out / "adapter_model.safetensors"
        tensors = load_file(wpath)
        edit(tensors)
        save_file(tensors, wpath, metadata={"format": "pt"})
    return out


def _base_adapter(tied, **opts):
    src = tiny_model(tied=tied)
    apply_lora(src, r=2, alpha=4, **{"target_modules": ["q_proj", "v_proj"], **opts})
    return src


def _other_models_adapter(tied, **opts):
    """An adapter made for the wider model: same module names and rank, other in / out features."""
    src = _wider_model(tied)
    apply_lora(src, r=2, alpha=4, **opts)
    return src


# (name, tied, the adapted model saved, tensor edit, words load_adapter's refusal holds)
MISMATCHES = [
    ("missing_lora_B", False, lambda t: _base_adapter(t), lambda d: d.pop(f"{Q0}.lora_B.weight"),
     rf"missing keys \['{Q0}.lora_B.weight'\] \(1\), unexpected keys \[\] \(0\)"),
    ("unexpected_key", False, lambda t: _base_adapter(t),
     lambda d: d.update({f"{P}model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(2, 32)}),
     r"missing keys \[\] \(0\), unexpected keys \['base_model\.model\.model\.layers\.0\.self_attn\.k_proj\.lora_A"),
    ("other_model_out_features", False, lambda t: _other_models_adapter(t, target_modules=["gate_proj"]), None,
     r"gate_proj\.lora_B\.weight has shape \(56, 2\), the model expects \(40, 2\) \(r=2\)"),
    ("other_model_in_features", False, lambda t: _other_models_adapter(t, target_modules=["down_proj"]), None,
     r"down_proj\.lora_A\.weight has shape \(2, 56\), the model expects \(2, 40\) \(r=2\)"),
    ("modules_to_save_shape", False, lambda t: _other_models_adapter(t, target_modules=["q_proj"],
                                                                     modules_to_save=["lm_head"]), None,
     r"base_model\.model\.lm_head\.weight has shape \(69, 32\), the model expects \(61, 32\)"),
    ("tied_modules_to_save_shape", True, lambda t: _other_models_adapter(t, target_modules=["q_proj"],
                                                                         modules_to_save=["lm_head"]), None,
     r"embed_tokens\.weight has shape \(69, 32\), the model expects \(61, 32\)"),
    ("tied_head_alone_shape", True, lambda t: _other_models_adapter(t, target_modules=["q_proj"],
                                                                    modules_to_save=["lm_head"]),
     lambda d: d.pop(f"{P}model.embed_tokens.weight"),  # PEFT's file of an untied head: load_adapter unties first
     r"base_model\.model\.lm_head\.weight has shape \(69, 32\), the model expects \(61, 32\)"),
    ("embedding_layers", False, lambda t: _base_adapter(t),
     lambda d: d.update({f"{P}lm_head.weight": torch.zeros(61, 32)}),
     r"the adapter holds whole embedding layers outside its modules_to_save \(base_model\.model\.lm_head\.weight\)"),
]


@pytest.mark.parametrize("name, tied, make, edit, said", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_names_and_shapes_are_refused_on_the_meta_model_as_load_adapter_refuses_them(name, tied, make, edit, said,
                                                                                      tmp_path):
    """A missing or unexpected key, or a shape of another model (LoRA's in or out features, a modules_to_save
    tensor), was left to load_adapter, once the base weights had loaded; check_adapter on the meta-device decoder
    says it now, in load_adapter's words (one check: ``_file_fits``), and leaves that decoder as it was."""
    adapter = _edited(make(tied), tmp_path / "a", edit)
    with pytest.raises(ValueError) as loaded:
        load_adapter(tiny_model(tied=tied), adapter)
    wanted = f"load_adapter {adapter / 'adapter_model.safetensors'}: "
    assert str(loaded.value).startswith(wanted)
    assert re.search(said, str(loaded.value)), str(loaded.value)
    shell = meta_model(tiny_model(tied=tied).config)
    names = [n for n, _ in shell.named_modules()]
    with pytest.raises(ValueError) as checked:
        check_adapter(shell, adapter)
    assert str(checked.value) == str(loaded.value)
    assert getattr(shell, "lora_config", None) is None and [n for n, _ in shell.named_modules()] == names
    assert (shell.lm_head.weight is shell.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("saved", [(), ("lm_head",), ("lm_head", "norm")])
def test_a_fitting_adapter_passes_the_check(tmp_path, tied, saved):
    """What load_adapter accepts, check_adapter accepts: adapters with modules trained in full, a tied head saved
    with its embedding (save_adapter) or alone (PEFT's file of a head it untied), on the meta decoder and on a
    loaded model, which it leaves as it was (same Parameters, none copied)."""
    src = _base_adapter(tied, target_modules=["q_proj", "down_proj"], modules_to_save=list(saved))
    both = _edited(src, tmp_path / "both")
    alone = _edited(src, tmp_path / "alone", lambda d: d.pop(f"{P}model.embed_tokens.weight", None))
    for adapter in (both, alone):
        model = tiny_model(tied=tied)
        params = dict(model.named_parameters())
        check_adapter(meta_model(model.config), adapter)
        check_adapter(model, adapter)
        assert getattr(model, "lora_config", None) is None
        assert all(p is params[n] and p.device.type == "cpu" for n, p in model.named_parameters())
        load_adapter(model, adapter)
