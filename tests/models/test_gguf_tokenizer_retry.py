"""A GGUF tokenizer conversion that failed is recorded in the cache entry (not retried on every load) under the
versions it failed with (converter, transformers, tokenizers, gguf); after an upgrade it is retried, without
dequantizing the weights again."""

from __future__ import annotations

import importlib.metadata
import json
import logging

import pytest
import transformers
from test_gguf_metadata import _BPE_VOCAB, _bpe_tokenizer_metadata, hf_model, write_gguf

import chronicals
from chronicals.models import gguf_cache, gguf_io

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def bpe_gguf(tmp_path):
    path = tmp_path / "bpe.gguf"
    write_gguf(path, "qwen2", hf_model("qwen2", vocab_size=_BPE_VOCAB, bos_token_id=1, eos_token_id=2),
               extra=lambda w: _bpe_tokenizer_metadata(w, pre="qwen2"))  # Qwen's split: built under every transformers
    return path


def _count_gguf_tokenizer_calls(monkeypatch, fail: bool) -> list:
    """Record transformers' GGUF tokenizer conversions (from_pretrained with gguf_file); fail=True: each raises, as a
    transformers release with a bug in its converter would."""
    calls, real = [], transformers.AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        if "gguf_file" in kwargs:
            calls.append(kwargs["gguf_file"])
            if fail:
                raise KeyError("scores")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(from_pretrained))
    return calls


def _fake_version(monkeypatch, package: str, fake: str) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake if name == package else real(name))


def _no_dequantization(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the weights were converted again")

    monkeypatch.setattr(gguf_io, "convert_gguf", fail)


def test_failure_is_cached_then_retried_after_a_transformers_upgrade(bpe_gguf, monkeypatch):
    with monkeypatch.context() as m:  # the conversion fails under this transformers
        calls = _count_gguf_tokenizer_calls(m, fail=True)
        model, tok = chronicals.load_model(bpe_gguf, tokenizer=False)
        assert len(calls) == 1
    d = gguf_cache.cache_dir_for(bpe_gguf)
    rec = json.loads((d / gguf_cache.TOKENIZER_ERROR).read_text())
    assert rec == {"error": gguf_cache.tokenizer_error(d), **gguf_cache.tokenizer_stamp()}
    assert rec["transformers"] == transformers.__version__

    with monkeypatch.context() as m:  # the same versions: the recorded failure is raised, not retried
        calls = _count_gguf_tokenizer_calls(m, fail=False)
        with pytest.raises(ValueError, match=rf"^{bpe_gguf}: its tokenizer metadata .* \(KeyError: 'scores'\)"):
            chronicals.load_model(bpe_gguf)
        assert calls == []

    with monkeypatch.context() as m:  # transformers upgraded (and its converter fixed): retried once, and it loads
        _fake_version(m, "transformers", "99.0.0")
        calls = _count_gguf_tokenizer_calls(m, fail=False)
        _no_dequantization(m)
        model2, tok = chronicals.load_model(bpe_gguf)
        assert tok is not None and tok.convert_ids_to_tokens(tok("hello")["input_ids"]) == ["hell", "o"]
        chronicals.load_model(bpe_gguf)
        assert calls == [bpe_gguf.name]
    assert gguf_cache.cache_dir_for(bpe_gguf) == d and gguf_cache.tokenizer_error(d) is None
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


@pytest.mark.parametrize("package", ["transformers", "tokenizers", "gguf"])
def test_failure_still_there_after_an_upgrade_is_recorded_under_the_new_versions(bpe_gguf, monkeypatch, package):
    with monkeypatch.context() as m:
        _count_gguf_tokenizer_calls(m, fail=True)
        chronicals.load_model(bpe_gguf, tokenizer=False)
    d = gguf_cache.cache_dir_for(bpe_gguf)
    with monkeypatch.context() as m:
        _fake_version(m, package, "99.0.0")
        calls = _count_gguf_tokenizer_calls(m, fail=True)
        _no_dequantization(m)
        with pytest.raises(ValueError, match=r"KeyError: 'scores'"):
            chronicals.load_model(bpe_gguf)
        with pytest.raises(ValueError, match=r"KeyError: 'scores'"):
            chronicals.load_model(bpe_gguf)
        assert calls == [bpe_gguf.name]  # once: the retry's failure is cached in turn
        assert json.loads((d / gguf_cache.TOKENIZER_ERROR).read_text())[package] == "99.0.0"


def test_a_retry_that_cannot_record_its_failure_is_a_warning(bpe_gguf, monkeypatch, caplog):
    """A retry that fails again and cannot record its failure (a read-only cache) is a warning: the weights load and
    the tokenizer's own error is raised, not the PermissionError of the cache write."""
    with monkeypatch.context() as m:
        _count_gguf_tokenizer_calls(m, fail=True)
        chronicals.load_model(bpe_gguf, tokenizer=False)

    def denied(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    with monkeypatch.context() as m:
        _fake_version(m, "tokenizers", "99.0.0")
        _count_gguf_tokenizer_calls(m, fail=True)
        _no_dequantization(m)
        m.setattr(gguf_cache.os, "replace", denied)
        with caplog.at_level(logging.WARNING, logger="chronicals.models.gguf_cache"):
            model, tok = chronicals.load_model(bpe_gguf, tokenizer=False)
            with pytest.raises(ValueError, match=r"KeyError: 'scores'"):
                chronicals.load_model(bpe_gguf)
    assert model is not None and tok is None
    assert any("could not update" in r.getMessage() for r in caplog.records)


def test_a_retried_tokenizer_is_added_without_hard_links(bpe_gguf, monkeypatch):
    """On a file system without hard links (os.link fails: some network and FUSE file systems) a tokenizer that
    converts after an upgrade is still added to the entry, its files copied; the entry was never updated and the old
    failure was raised on every load."""
    with monkeypatch.context() as m:
        _count_gguf_tokenizer_calls(m, fail=True)
        chronicals.load_model(bpe_gguf, tokenizer=False)
    d = gguf_cache.cache_dir_for(bpe_gguf)
    assert gguf_cache.tokenizer_error(d) is not None

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted", str(src))

    with monkeypatch.context() as m:
        _fake_version(m, "transformers", "99.0.0")
        _no_dequantization(m)
        m.setattr(gguf_cache.os, "link", no_links)
        _, tok = chronicals.load_model(bpe_gguf)
    assert tok is not None and gguf_cache.tokenizer_error(d) is None
    assert (d / "model.safetensors").is_file() and (d / gguf_cache.CACHE_ENTRY).is_file()


def test_failure_recorded_before_stamps_is_retried(bpe_gguf, monkeypatch):
    """A plain-text gguf_tokenizer_error.txt (no versions: written by an earlier chronicals) is retried once."""
    with monkeypatch.context() as m:
        _count_gguf_tokenizer_calls(m, fail=True)
        chronicals.load_model(bpe_gguf, tokenizer=False)
    d = gguf_cache.cache_dir_for(bpe_gguf)
    (d / gguf_cache.TOKENIZER_ERROR).write_text(f"{bpe_gguf}: its tokenizer metadata cannot be made into a tokenizer\n")
    assert gguf_cache.tokenizer_error(d) == f"{bpe_gguf}: its tokenizer metadata cannot be made into a tokenizer"
    _no_dequantization(monkeypatch)
    _, tok = chronicals.load_model(bpe_gguf)
    assert tok is not None and gguf_cache.tokenizer_error(d) is None


def test_a_retried_tokenizer_does_not_carry_hidden_leftovers_into_the_entry(bpe_gguf, monkeypatch):
    """The entry published again with the tokenizer takes the old entry's files, not a hidden temporary left in it
    by a killed write of its record."""
    with monkeypatch.context() as m:
        _count_gguf_tokenizer_calls(m, fail=True)
        chronicals.load_model(bpe_gguf, tokenizer=False)
    d = gguf_cache.cache_dir_for(bpe_gguf)
    (d / f".{gguf_cache.CACHE_ENTRY}.tmp-4242-0123abcd").write_text("{")
    _fake_version(monkeypatch, "transformers", "99.0.0")
    _no_dequantization(monkeypatch)
    _, tok = chronicals.load_model(bpe_gguf)
    assert tok is not None and not [f.name for f in d.iterdir() if f.name.startswith(".")]
