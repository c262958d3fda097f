"""chronicals: fast, memory-lean fine-tuning of decoder LLMs."""

__version__ = "0.1.0"
