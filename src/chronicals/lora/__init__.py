"""LoRA / LoRA+ on our decoder: layers, injection and merging, PEFT-format adapter I/O, LoRA+ groups.

    rec = apply_lora(model, r=32, alpha=64)                 # freeze the base, add adapters
    opt = torch.optim.AdamW(lora_plus_param_groups(model, lr=2e-4), fused=True)
    save_adapter(model, "out/adapter")                      # PEFT's format
    load_adapter(other_model, "out/adapter")                # or a PEFT-saved adapter
    merge_lora(model)                                       # plain nn.Linear again, W += s B A
"""

from .inject import DEFAULT_TARGETS, LoraRecord, apply_lora, lora_modules, merge_lora
from .layer import LoRALinear, LoRALinearFunction, lora_linear, lora_linear_ref
from .mlp import LoRASwiGLUDownFunction
from .peft_io import adapter_config_dict, adapter_state_dict, load_adapter, read_adapter_config, save_adapter
from .plus import lora_plus_param_groups

__all__ = [
    "DEFAULT_TARGETS", "LoRALinear", "LoRALinearFunction", "LoRASwiGLUDownFunction", "LoraRecord", "adapter_config_dict",
    "adapter_state_dict", "apply_lora", "load_adapter", "lora_linear", "lora_linear_ref", "lora_modules",
    "lora_plus_param_groups", "merge_lora", "read_adapter_config", "save_adapter",
]
