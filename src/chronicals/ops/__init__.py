"""Fused ops (Triton) and their pure-PyTorch reference twins. Imports torch and triton only."""

from ._impl import resolve_impl
from .attention import attention, attention_ref
from .cross_entropy import cross_entropy_ref, linear_cross_entropy, linear_cross_entropy_ref
from .lowrank import lowrank_update_, lowrank_update_ref
from .rms_norm import rms_norm, rms_norm_ref
from .rope import rope_cos_sin, rope_qk, rope_qk_ref, rope_qkv, rope_ref
from .swiglu import swiglu, swiglu_gate_up, swiglu_gate_up_ref, swiglu_ref

__all__ = [
    "attention", "attention_ref", "cross_entropy_ref", "linear_cross_entropy", "linear_cross_entropy_ref",
    "lowrank_update_", "lowrank_update_ref", "resolve_impl", "rms_norm", "rms_norm_ref", "rope_cos_sin", "rope_qk", "rope_qk_ref", "rope_qkv", "rope_ref",
    "swiglu", "swiglu_gate_up", "swiglu_gate_up_ref", "swiglu_ref",
]
