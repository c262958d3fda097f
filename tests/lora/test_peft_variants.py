"""PEFT adapters whose logits are not x W^T + s x A^T B^T over the base they are loaded on. An initialization that
rewrote the base weights (PiSSA, OLoRA, CorDA, LoRA-GA: A and B belong to W - s B0 A0; LoftQ: W quantized) was
loaded without a word (logits 0.09-0.11 off PEFT's); it now fails naming init_lora_weights and what to do, and the
initializations that only set A and B load. The LoRA variants (aLoRA, KaSA, VeLoRA, MonteCLoRA, BD-LoRA, Arrow,
QA-LoRA) and fields of a newer PEFT: aLoRA loaded as plain LoRA (logits 0.35 off), the others were refused as
'saved for a different model?'; each now fails naming its field (their refusal by name: test_peft_fields)."""

import json

import peft
import pytest
import torch
import transformers

from chronicals.lora import load_adapter

from .conftest import hf_config, tiny_model


def _peft_save(ours, out_dir, **opts):
    """A PEFT LoRA (r=2 on q/v) made over a transformers twin of ``ours`` with ``opts``, B perturbed, saved to
    ``out_dir``; returns the logits PEFT gives after loading it back onto the same base (from_pretrained)."""
    def twin():
        cfg = hf_config()
        cfg._attn_implementation = "eager"
        hf = transformers.LlamaForCausalLM(cfg).eval()
        hf.load_state_dict({k: v.clone() for k, v in ours.state_dict().items()}, strict=False)
        return hf

    pm = peft.get_peft_model(twin(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM", **opts))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(out_dir)
    return peft.PeftModel.from_pretrained(twin(), out_dir).eval()


@pytest.mark.parametrize("opts,field", [
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
    (dict(init_lora_weights="pissa_niter_2"), "init_lora_weights='pissa_niter_2'"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora'"),
    (dict(alora_invocation_tokens=[5, 6]), r"alora_invocation_tokens=\[5, 6\]"),
], ids=["pissa", "pissa_niter", "olora", "alora"])
def test_peft_adapters_we_would_compute_differently_are_refused(opts, field, ids, tmp_path):
    ours = tiny_model()
    pm = _peft_save(ours, tmp_path / "peft", **opts)
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    loaded = tiny_model()
    with pytest.raises(ValueError, match=rf"adapter_config.json: {field} is not supported by chronicals.lora"):
        load_adapter(loaded, tmp_path / "peft")
    assert getattr(loaded, "lora_config", None) is None  # refused before the model changed
    # what loading it anyway gave: not PEFT's logits (so a refusal, not a load, is right)
    cfg_path = tmp_path / "peft" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "init_lora_weights": True, "alora_invocation_tokens": None}))
    load_adapter(ours, tmp_path / "peft")
    with torch.no_grad():
        assert (ours(ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "mica"])
def test_initializations_that_only_set_a_and_b_load_with_peft_logits(init, ids, tmp_path):
    ours = tiny_model()
    pm = _peft_save(ours, tmp_path / "peft", init_lora_weights=init)
    load_adapter(ours, tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), pm(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_every_field_peft_writes_by_default_loads(tmp_path, ids):
    """The refusal of unknown fields leaves a default PEFT config (every field of the installed PEFT) loadable."""
    ours = tiny_model()
    pm = _peft_save(ours, tmp_path / "peft")
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"qalora_group_size", "megatron_core", "peft_version"} <= set(cfg)  # non-empty defaults
    load_adapter(ours, tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), pm(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
