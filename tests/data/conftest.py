"""The SmolLM2 tokenizer (with its chat template) from the embedded GGUF, loaded once per session
(``tests/smollm2_tokenizer.py``: saved to a temp directory that later sessions load in ~0.3 s)."""

import pytest
from smollm2_tokenizer import smollm2_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return smollm2_tokenizer()
