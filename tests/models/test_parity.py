"""Our decoder vs transformers' own model classes on the same weights, for every supported family.

The reference is transformers' float32 model; our names equal HF's, so one state dict serves both.
Tolerances (float32): logits 1e-5 and gradients 1e-4, relative to the largest magnitude of the reference.
"""

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig


def _hf_model(cfg_dict: dict, seed: int = 0):
    """A transformers model of ``cfg_dict`` with every parameter random and O(1) (norm weights around 1,
    nonzero biases), so a wrong or unused parameter changes the logits visibly."""
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def _ours_from(hf_model, cfg_dict: dict) -> CausalLM:
    ours = CausalLM(ModelConfig.from_hf_dict(cfg_dict)).eval()
    ours.load_state_dict(hf_model.state_dict(), strict=True)
    return ours


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def test_logits_and_grads_match_transformers(hf_family, tiny_hf_config):
    cfg_dict = tiny_hf_config(hf_family)
    hf = _hf_model(cfg_dict)
    ours = _ours_from(hf, cfg_dict)
    assert set(dict(ours.named_parameters())) == set(dict(hf.named_parameters()))
    if cfg_dict["tie_word_embeddings"]:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight

    ids = torch.randint(0, cfg_dict["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 37, cfg_dict["vocab_size"], generator=torch.Generator().manual_seed(2))
    ref = hf(ids).logits
    out = ours(ids)
    assert out.shape == (2, 37, cfg_dict["vocab_size"])
    assert _rel(out, ref) <= 1e-5

    (ref * probe).sum().backward()
    (out * probe).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert _rel(p.grad, hf_params[name].grad) <= 1e-4, name


@pytest.mark.parametrize("family", ["llama3", "qwen3", "smollm2"])
def test_loss_matches_transformers(family, tiny_hf_config):
    """Our loss head (labels shifted inside) against transformers' loss on the same labels."""
    cfg_dict = tiny_hf_config(family)
    hf = _hf_model(cfg_dict, seed=3)
    ours = _ours_from(hf, cfg_dict)
    ids = torch.randint(0, cfg_dict["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt without loss
    ref = hf(ids, labels=labels).loss
    assert abs(ours(ids, labels=labels).item() - ref.item()) <= 1e-5 * ref.abs().item()


def test_unsupported_model_type_lists_supported(tiny_hf_config):
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_dict(tiny_hf_config("llama2", model_type="gpt2"))
