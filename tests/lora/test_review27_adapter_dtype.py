"""bf16 adapters on an fp32 base (``apply_lora(adapter_dtype=torch.bfloat16)``) against the reference on the adapters
cast exactly to fp32: no test ran that path before session 27's mutation testing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from chronicals.lora.layer import LoRALinear, lora_linear_ref


@pytest.mark.parametrize("impl", ["fused", "torch"])
def test_bf16_adapters_on_an_fp32_base_match_the_reference(impl):
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(12, 20, bias=True), r=4, alpha=8, impl=impl, adapter_dtype=torch.bfloat16,
                       concat=False).eval()
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(20, 4))
    x = torch.randn(3, 12)
    a, b = layer.lora_A.weight.float(), layer.lora_B.weight.float()  # bf16 -> fp32 is exact
    with torch.no_grad():
        torch.testing.assert_close(layer(x), lora_linear_ref(x, layer.weight, layer.bias, a, b, layer.scaling),
                                   rtol=1e-6, atol=1e-6)
