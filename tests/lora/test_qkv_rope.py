"""The decoder rotates q and k out of the joint q/k/v GEMM's output with one op (``models.fused_proj.qkv_rope``,
``ops.rope_qkv``), whose backward writes dq | dk | dv whole instead of split's cat: the same loss and gradients, bit for
bit, as the split path, for full fine-tuning and LoRA groups."""

import pytest
import torch

import chronicals.models.decoder as decoder_mod
from chronicals.lora import apply_lora
from chronicals.models import fused_proj
from chronicals.ops._impl import triton_interpreting

from .conftest import randomize_lora_b, tiny_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEV)


def _split_path(attn, x, cos, sin):
    """What the decoder ran before: qkv_proj's split views, then rope_qk."""
    q, k, v = fused_proj.qkv_proj(attn, x)
    return (*decoder_mod.rope_qk(q, k, cos, sin, impl=attn.opts.impl), v)


def _run(monkeypatch, fused: bool, lora: bool, impl: str, kind: str):
    with monkeypatch.context() as m:
        calls = []
        if not fused:
            m.setattr(decoder_mod, "qkv_rope", _split_path)
        real = fused_proj.rope_qkv
        m.setattr(fused_proj, "rope_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))
        model = tiny_model(kind).to(DEV).train()
        model.opts.impl = impl
        if lora:
            apply_lora(model, r=8, alpha=16)
            randomize_lora_b(model)
        loss = model(IDS, shift_labels=torch.roll(IDS, -1, 1), reduction="sum")
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if DEV == "cuda" or triton_interpreting() else []))
@pytest.mark.parametrize("lora,kind", [(False, "qwen2"), (True, "qwen2"), (True, "llama")])
def test_one_op_gives_the_split_paths_bits(monkeypatch, impl, lora, kind):
    la, ga, calls = _run(monkeypatch, True, lora, impl, kind)
    lb, gb, calls_b = _run(monkeypatch, False, lora, impl, kind)
    assert calls == 2 and calls_b == 0  # both layers' q/k/v went through rope_qkv
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert ga[n].abs().sum() > 0, n
        assert torch.equal(ga[n], gb[n]), n
