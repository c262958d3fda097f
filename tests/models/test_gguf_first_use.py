"""A GGUF file's first use by train or eval (``models.loading.tokenizer_and_config`` on a cold cache) reads its
config and tokenizer as the conversion writes them, without converting its weights: a bad data file is said before
the conversion (SmolLM2-135M's took 10 s on two CPU cores, an 8B file's minutes), which happens when the weights load.
What it gives equals what the cached conversion gives, and its errors are the conversion's."""

from __future__ import annotations

import pytest
from test_gguf_metadata import _BPE_VOCAB, _bpe_tokenizer_metadata, hf_model, write_gguf

from chronicals.models import gguf_io

pytestmark = pytest.mark.usefixtures("one_thread")


def _bpe_gguf(path):
    write_gguf(path, "qwen2", hf_model("qwen2", vocab_size=_BPE_VOCAB),
               extra=lambda w: _bpe_tokenizer_metadata(w, pre="qwen2"))
    return path


def test_a_weightless_conversion_writes_the_conversions_files_but_the_weights(tmp_path):
    """convert_gguf(..., weights=False): config.json and the tokenizer files, byte for byte the full conversion's,
    and no weights file; never a cache entry (it holds no model)."""
    path = _bpe_gguf(tmp_path / "tiny.gguf")
    full = gguf_io.convert_gguf(path, tmp_path / "full")
    out = gguf_io.convert_gguf(path, tmp_path / "out", weights=False)
    names = sorted(f.name for f in out.iterdir())
    assert names == sorted(f.name for f in full.iterdir() if f.name != "model.safetensors")
    assert names == ["chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"], names
    for name in names:
        assert (out / name).read_bytes() == (full / name).read_bytes(), name
    with pytest.raises(ValueError, match="weights=False writes no model, so it cannot be a cache entry"):
        gguf_io.convert_gguf(path, tmp_path / "entry", weights=False, cache_entry={"source": str(path)})
    assert not (tmp_path / "entry").exists()
