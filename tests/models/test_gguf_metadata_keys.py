"""GGUF metadata keys the model config needs: missing, stored as a fractional float, or a vocabulary size left out."""

from __future__ import annotations

import gguf
import pytest

import chronicals
from test_gguf_metadata import _rel_err, hf_model, write_gguf


def _write_block_count(path, value):
    write_gguf(path, "llama", hf_model("llama"), skip=("block_count",),
               extra=lambda w: w.add_key_value("llama.block_count", value, gguf.GGUFValueType.FLOAT32))


def test_a_fractional_block_count_is_refused(tmp_path):
    """An integer key stored as a float with a fraction (a damaged or hand-edited file) is refused, naming the key,
    rather than truncated (2.5 layers read as 2) without a word."""
    _write_block_count(tmp_path / "m.gguf", 2.5)
    with pytest.raises(ValueError, match=r"metadata llama\.block_count=2\.5 is not an integer"):
        chronicals.load_model(tmp_path / "m.gguf", tokenizer=False)


def test_an_integer_valued_float_block_count_loads(tmp_path):
    _write_block_count(tmp_path / "m.gguf", 2.0)
    model, _ = chronicals.load_model(tmp_path / "m.gguf", tokenizer=False)
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize("skip, key", [("embedding_length", "llama.embedding_length"),
                                       ("feed_forward_length", "llama.feed_forward_length"),
                                       ("block_count", "llama.block_count"),
                                       ("head_count", "llama.attention.head_count")])
def test_a_missing_required_key_is_named(tmp_path, skip, key):
    """A key the config needs, left out, is one error naming the file and the key (without the check: a bare
    TypeError, '<' between NoneType and int, or a config error that names no GGUF key)."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_model("llama"), skip=(skip,))
    with pytest.raises(ValueError, match=rf"^{path}: metadata key '{key}' is missing; cannot build the model config"):
        chronicals.load_model(path, tokenizer=False)


@pytest.mark.parametrize("skip, over, field, value", [
    ("layer_norm_rms_eps", dict(rms_norm_eps=1e-6), "rms_norm_eps", 1e-6),  # transformers' LlamaConfig default
    ("rope_freq_base", dict(rope_theta=10000.0), "rope_theta", 10000.0),  # llama.cpp's rope_freq_base_train default
    ("context_length", {}, "max_position_embeddings", 4096),  # ModelConfig's default: generation's context limit
    # older converters wrote no key_length: head_dim is hidden / heads (64 / 4), as llama.cpp reads it
    ("key_length", {}, "head_dim", 16),
    # the whole head rotates: head_dim from key_length (32), not hidden / heads (16: a partial rope, logits wrong)
    ("rope_dimension_count", dict(head_dim=32), "rotary_dim", 32),
])
def test_an_absent_optional_key_takes_its_default(tmp_path, skip, over, field, value):
    """A GGUF without attention.layer_norm_rms_epsilon, rope.freq_base, context_length, rope.dimension_count or
    attention.key_length loads with the default llama.cpp and transformers use (the logits equal such a transformers
    model's), not some other epsilon, theta, context length, rotary dimension or head size."""
    m = hf_model("llama", **over)
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", m, skip=(skip,))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert getattr(ours.config, field) == value
    assert _rel_err(ours, m) <= 1e-5


def test_a_gguf_without_vocab_size_loads_with_the_embeddings_rows(tmp_path):
    """llama.cpp's converter wrote no {arch}.vocab_size before 2024: the size is then token_embd.weight's last GGUF
    dimension (its shape is (hidden, vocab)); the first one, the hidden size, refused every such file as damaged."""
    m = hf_model("llama", vocab_size=97)
    path = tmp_path / "novocab.gguf"
    write_gguf(path, "llama", m, skip=("vocab_size",))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.vocab_size == 97 and ours.model.embed_tokens.weight.shape == (97, 64)
    assert _rel_err(ours, m) <= 1e-5


def test_a_zero_embedding_length_names_the_file_and_the_key(tmp_path):
    """embedding_length 0 (a damaged file) is refused naming the file and the GGUF key, not by an error about
    hidden_size, a name the GGUF does not have."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_model("llama"), skip=("embedding_length",), extra=lambda w: w.add_embedding_length(0))
    with pytest.raises(ValueError, match=rf"^{path}: metadata llama\.attention\.head_count=4, "
                                         r"llama\.embedding_length=0: both must be >= 1"):
        chronicals.load_model(path, tokenizer=False)


@pytest.mark.parametrize("kv", [None, 0])
def test_head_count_kv_absent_or_zero_loads_as_one_kv_head_per_head(tmp_path, kv):
    """No head_count_kv (older Llama 1/2 files; llama.cpp then reads head_count) or head_count_kv=0 ("not set") is
    one kv head per head: the K rows are un-permuted by the query head count. An absent key was read as one kv head
    and the file refused as damaged ("k_proj.weight (64, 64) (expected (16, 64))"); 0 as "do not split into rotary
    pairs of 0 heads"."""
    m = hf_model("llama", num_key_value_heads=4)
    path = tmp_path / "kv.gguf"
    write_gguf(path, "llama", m, skip=("head_count_kv",),
               extra=None if kv is None else lambda w: w.add_head_count_kv(kv))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.num_key_value_heads == 4
    assert _rel_err(ours, m) <= 1e-5


@pytest.mark.parametrize("kind", [gguf.RopeScalingType.YARN, gguf.RopeScalingType.LONGROPE])
def test_an_unsupported_rope_scaling_type_is_refused(tmp_path, kind):
    """A GGUF that asks for YaRN or longrope scaling is refused naming the key, not loaded with linear or no scaling
    (positions past the original context silently wrong)."""
    path = tmp_path / "yarn.gguf"
    write_gguf(path, "llama", hf_model("llama"),
               extra=lambda w: (w.add_rope_scaling_type(kind), w.add_rope_scaling_factor(4.0)))
    with pytest.raises(ValueError, match=r"rope\.scaling\.type"):
        chronicals.load_model(path, tokenizer=False)
