"""fp32 adapters on a bf16 / fp16 base, as PEFT keeps them (``autocast_adapter_dtype=True``, its default): their
branch runs in fp32 as PEFT's does, in every layout. Before, A and B were cast to the base's dtype at each call."""

import peft
import pytest
import torch
import torch.nn as nn

from chronicals.lora import apply_lora
from chronicals.lora.layer import LoRALinear

from .conftest import tiny_model

LOW = [torch.bfloat16, torch.float16]


class _One(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.proj = lin

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("dt", LOW)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("impl,concat", [("fused", "auto"), ("fused", True), ("fused", False), ("torch", "auto")])
def test_a_wide_layer_computes_pefts_bits(dt, bias, impl, concat):
    """fp32 A and B on a bf16 / fp16 nn.Linear: every layout gives PEFT's output and A, B and x gradients bit for bit
    (round(round(x W^T + b) + s (x A^T) B^T), the branch in fp32)."""
    fin, fout, r, alpha = 24, 56, 4, 8  # out >= 2 in: "auto" picks the concatenated layout for bf16 adapters
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(fin, fout, bias=bias).to(dt)
    a, b = torch.randn(r, fin, generator=g) / fin ** 0.5, torch.randn(fout, r, generator=g)
    x = torch.randn(3, 5, fin, generator=g).to(dt)
    pm = peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"]),
                                      _One(nn.Linear(fin, fout, bias=bias).to(dt)))
    with torch.no_grad():
        pm.proj.base_layer.weight.copy_(lin.weight)
        if bias:
            pm.proj.base_layer.bias.copy_(lin.bias)
    pm.proj.lora_A["default"].weight = nn.Parameter(a.clone())
    pm.proj.lora_B["default"].weight = nn.Parameter(b.clone())
    ours = LoRALinear(lin, r, alpha, impl=impl, adapter_dtype=torch.float32, concat=concat)
    with torch.no_grad():
        ours.lora_A.weight.copy_(a)
        ours.lora_B.weight.copy_(b)
    outs = []
    for mod, la, lb in ((ours, ours.lora_A.weight, ours.lora_B.weight),
                        (pm, pm.proj.lora_A["default"].weight, pm.proj.lora_B["default"].weight)):
        xi = x.clone().requires_grad_()
        y = mod(xi)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dt)
        outs.append((y, *torch.autograd.grad(y, (xi, la, lb), dy)))
    for got, want, what in zip(outs[0], outs[1], ("y", "dx", "dA", "dB")):
        assert got.dtype == want.dtype and torch.equal(got, want), what
    assert outs[0][0].dtype == dt and outs[0][2].dtype == torch.float32


def test_training_keeps_base_dtype_adapters():
    """apply_lora's default (what the trainer calls: bf16 adapters, fp32 masters in the optimizer) keeps the fused
    layouts and the groups."""
    model = tiny_model().to(torch.bfloat16)
    apply_lora(model, r=4, alpha=8)
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert mods and all(m.lora_A.weight.dtype == torch.bfloat16 for m in mods)
    assert "lora_qkv" in vars(model.model.layers[0].self_attn) and "lora_gate_up" in vars(model.model.layers[0].mlp)
