"""chronicals: fast, memory-lean fine-tuning of decoder LLMs."""

from .models import load_model, load_tokenizer, save_model

__version__ = "0.1.0"

__all__ = ["__version__", "load_model", "load_tokenizer", "save_model"]
