"""Our decoder with the fused Triton ops (impl="triton") matches the same decoder with the reference ops.

Tiny random configs of real families: Qwen2 (q/k/v bias, GQA), Qwen3 (per-head q/k RMSNorm on 4-D inputs),
Llama with partial rotary. Positions restart mid-row as in packed batches.
"""

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig
from chronicals.ops._impl import triton_interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_config(family: str) -> ModelConfig:
    if family == "qwen2":
        d = transformers.Qwen2Config(**TINY).to_dict()
    elif family == "qwen3":
        d = transformers.Qwen3Config(**TINY, head_dim=16).to_dict()
    else:
        d = transformers.LlamaConfig(**TINY).to_dict()
        d["partial_rotary_factor"] = 0.5  # rotary dims 8 of 16: the pass-through path
    return ModelConfig.from_hf_dict(d)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 13), generator=g)
    pos = torch.cat([torch.arange(8), torch.arange(5)]).repeat(2, 1)  # two documents per row
    return ids.to(DEV), pos.to(DEV)


def _logits_and_grads(model, impl):
    model.set_impl(impl).zero_grad(set_to_none=True)
    ids, pos = _batch()
    logits = model(ids, position_ids=pos)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    (logits.double() * w).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_triton_matches_torch_fp32(family):
    model = CausalLM(tiny_config(family)).init_weights(std=0.1, seed=0).to(DEV)
    ref_logits, ref_grads = _logits_and_grads(model, "torch")
    logits, grads = _logits_and_grads(model, "triton")
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5 * max(scale, 1e-3), rtol=1e-3, msg=name)


def test_triton_tracks_torch_in_bf16():
    """In bf16 our decoder is at most about as far from the fp32 decoder as the bf16 reference decoder is."""
    cfg = tiny_config("qwen3")
    model = CausalLM(cfg).init_weights(std=0.1, seed=0).to(DEV)
    exact_logits, exact_grads = _logits_and_grads(model, "torch")
    model.to(torch.bfloat16)
    ref_logits, ref_grads = _logits_and_grads(model, "torch")
    logits, grads = _logits_and_grads(model, "triton")

    def err(a, b):
        return (a.double() - b.double()).abs().max().item()

    assert err(logits, exact_logits) <= 2 * err(ref_logits, exact_logits) + 1e-3
    for name, g in grads.items():
        assert g.dtype == torch.bfloat16
        # 3x: per parameter the two bf16 paths round at different places, and the reference's own error moves
        # with GEMM grouping (one q/k/v GEMM: k_norm.weight 0.27 vs 0.36 with three). Measured on this seed:
        # ratios 1.1-2.9 (max at k_norm.weight; Triton RMSNorm alone 2.3, RoPE alone 1.9, the rest ~1).
        bound = 3 * err(ref_grads[name], exact_grads[name]) + 1e-2 * exact_grads[name].abs().max().item()
        assert err(g, exact_grads[name]) <= bound, name
