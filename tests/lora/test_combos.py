"""LoRA options in unusual but valid combinations: what apply_lora / load_adapter accept must mean what PEFT means,
and what they cannot do must be refused before the model changes (not skipped, not failing mid-training)."""

import json

import peft
import pytest
import torch
import transformers

from chronicals.lora import apply_lora, load_adapter, save_adapter

from .conftest import hf_config, peft_adapter, tiny_model


@pytest.mark.parametrize("targets,count,named", [
    (["q_proj", "embed_tokens"], 1, "model.embed_tokens (Embedding)"),
    # 4 of them (2 norms, self_attn, mlp; not its 7 projections), the first 3 named
    (r"model\.layers\.1\..*", 4, "model.layers.1.input_layernorm (RMSNorm).*model.layers.1.post_attention_layernorm"),
    (["q_proj", "norm"], 1, "model.norm (RMSNorm)")])
def test_a_target_that_is_not_a_linear_is_refused(targets, count, named):
    """PEFT adapts an embed_tokens target (lora_embedding_A/B) and refuses a norm or a decoder layer; apply_lora
    skipped every such match silently: no embedding adapter was trained, and the saved regex made an adapter that
    PEFT refused to load ('Target module Qwen2Attention(...) is not supported')."""
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"matches {count} module.s. that are not nn.Linear, such as "
                                         rf"\[.*{named.replace('(', '.').replace(')', '.')}"):
        apply_lora(model, r=2, target_modules=targets)
    assert getattr(model, "lora_config", None) is None and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="is not supported"):  # what PEFT does with the same regex
        peft.get_peft_model(tiny_hf(), peft.LoraConfig(r=2, target_modules=r"model\.layers\.1\..*"))


def tiny_hf(state=None):
    """transformers' Llama on conftest's tiny config, holding ``state`` (our base weights) when given."""
    cfg = hf_config()
    cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    if state is not None:
        hf.load_state_dict(state, strict=False)
    return hf


@pytest.mark.parametrize("saved", [["self_attn"], ["mlp"], ["layers.0"]])
def test_modules_to_save_holding_a_target_is_refused(saved, ids):
    """modules_to_save=['self_attn'] with q_proj adapted unfroze q_proj's base weight under its adapter: apply_lora
    succeeded and the first forward failed ('the base weight and bias must be frozen')."""
    model = tiny_model()
    with pytest.raises(ValueError, match=r"modules_to_save \['model.layers.0.*'\] hold LoRA targets .such as "
                                         r"model.layers.0.(self_attn.q_proj|mlp.down_proj)"):
        apply_lora(model, r=2, target_modules=["q_proj", "down_proj"], modules_to_save=saved)
    assert getattr(model, "lora_config", None) is None and all(p.requires_grad for p in model.parameters())
    apply_lora(model, r=2, target_modules=["q_proj", "down_proj"], modules_to_save=["o_proj", "up_proj"])
    model.train()
    model(ids, shift_labels=torch.roll(ids, -1, 1)).backward()  # the modules beside the targets train in full
    assert model.model.layers[0].self_attn.o_proj.weight.grad.norm() > 0


@pytest.mark.parametrize("layers, more", [(12, " and 9 more"), (3, "")])
def test_modules_to_save_holding_targets_in_every_layer_names_three(layers, more):
    """modules_to_save=[self_attn] on SmolLM2 listed all 30 layers' self_attn, sorted as text (0, 1, 10, 11, ...)."""
    from chronicals.models import CausalLM, ModelConfig

    hf = hf_config()
    hf.num_hidden_layers = layers
    model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)
    with pytest.raises(ValueError) as e:
        apply_lora(model, r=2, target_modules=["q_proj"], modules_to_save=["self_attn"])
    assert ("modules_to_save ['model.layers.0.self_attn', 'model.layers.1.self_attn', 'model.layers.2.self_attn']"
            f"{more} hold LoRA targets (such as model.layers.0.self_attn.q_proj)") in str(e.value)
    assert "layers.10" not in str(e.value)


@pytest.mark.parametrize("saved", [["norm"], ["layernorm", "head"]])
def test_peft_modules_to_save_entries_mean_what_peft_trained(saved, ids, tmp_path):
    """PEFT matches modules_to_save as a plain suffix: its "norm" trains model.norm and every layer's two norms,
    "head" is lm_head. load_adapter read them at a dot ("norm" = model.norm only; "layernorm" and "head" nothing),
    so the adapter was refused ('unexpected keys ... input_layernorm', or 'match no module')."""
    ours = tiny_model()
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    want = peft_adapter(tiny_hf(base), saved, ids, tmp_path / "peft")
    rec = load_adapter(ours, tmp_path / "peft")
    if tuple(int(x) for x in peft.__version__.split(".")[:2]) < (0, 22):  # a plain suffix
        assert "model.layers.1.post_attention_layernorm" in rec.saved_modules
        assert ("lm_head" in rec.saved_modules) == (saved != ["norm"])
    else:  # PEFT 0.22 matches at a dot: "norm" is model.norm alone, "layernorm" and "head" nothing
        assert rec.saved_modules == (["model.norm"] if saved == ["norm"] else []), rec.saved_modules
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), want, rtol=1e-4, atol=1e-4)
    save_adapter(ours, tmp_path / "ours")  # full names: PEFT loads the same modules back
    again = peft.PeftModel.from_pretrained(tiny_hf(base), tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["suffix", "dot"])
def test_a_modules_to_save_entry_is_read_as_the_peft_that_saved_it_matched_it(layout, tmp_path):
    """modules_to_save=["norm"] trained every norm under PEFT <= 0.21 (a plain suffix) and model.norm alone under PEFT
    0.22 (at a dot); adapter_config.json reads the same either way. The file's tensors tell which: a file holding
    only model.norm was refused under the suffix reading ('missing keys ... input_layernorm': CI's PEFT 0.22), one
    holding every norm is read as all of them. Whichever PEFT is installed here."""
    from safetensors.torch import load_file, save_file

    model = tiny_model()
    names = ["model.norm"] + ([f"model.layers.{i}.{n}" for i in range(2)
                               for n in ("input_layernorm", "post_attention_layernorm")] if layout == "suffix" else [])
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=names)
    out = save_adapter(model, tmp_path / "a")
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["norm"]}))
    tensors = load_file(out / "adapter_model.safetensors")
    assert sum(".weight" in k and "norm" in k for k in tensors) == len(names)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    rec = load_adapter(tiny_model(), out)
    assert sorted(rec.saved_modules) == sorted(names)
