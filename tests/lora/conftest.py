"""Tiny random decoders for the LoRA tests (built from transformers configs, as a real checkpoint would be)."""

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig


def hf_config(kind: str = "llama", tied: bool = False):
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64)
    if kind == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def tiny_model(kind: str = "llama", tied: bool = False, seed: int = 0) -> CausalLM:
    cfg = ModelConfig.from_hf_dict(hf_config(kind, tied).to_dict())
    model = CausalLM(cfg).init_weights(seed=seed)
    if kind == "qwen2":  # nonzero biases so a bias bug shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def randomize_lora_b(model, seed: int = 1):
    """B = 0 after init makes every adapter a no-op; give B values so comparisons can fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def peft_adapter(hf_model, modules_to_save, ids, out_dir, seed: int = 3, **opts) -> torch.Tensor:
    """A PEFT LoRA (r=2 on q_proj, LoraConfig ``opts``) over ``hf_model`` with B and the saved modules perturbed (so
    comparisons can fail), saved to ``out_dir``; returns its logits on ``ids``."""
    import peft

    pm = peft.get_peft_model(hf_model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                       modules_to_save=modules_to_save, task_type="CAUSAL_LM", **opts))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        want = pm.eval()(input_ids=ids).logits
    pm.save_pretrained(out_dir)
    return want


@pytest.fixture
def ids():
    return torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(7))
