"""Our decoder, its config, and checkpoint I/O (Hugging Face safetensors directories, GGUF)."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .decoder import IGNORE_INDEX, CausalLM, shift_labels_per_document
from .generate import generate, stop_ids
from .gguf_io import SUPPORTED_GGUF_ARCHS, convert_gguf
from .loading import SHORT_NAMES, chat, load_model, load_tokenizer, require_chat_template, save_model

__all__ = ["CausalLM", "IGNORE_INDEX", "ModelConfig", "SHORT_NAMES", "SUPPORTED_GGUF_ARCHS", "SUPPORTED_MODEL_TYPES",
           "chat", "convert_gguf", "generate", "load_model", "load_tokenizer", "require_chat_template",
           "save_model", "shift_labels_per_document", "stop_ids"]
