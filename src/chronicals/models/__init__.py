"""Our decoder, its config, and checkpoint I/O (Hugging Face safetensors directories, GGUF)."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .decoder import IGNORE_INDEX, CausalLM, shift_labels_per_document
from .generate import generate

__all__ = ["CausalLM", "IGNORE_INDEX", "ModelConfig", "SUPPORTED_MODEL_TYPES", "generate",
           "shift_labels_per_document"]
