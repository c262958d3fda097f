"""A GGUF file's first use by train or eval (``models.loading.tokenizer_and_config`` on a cold cache) reads its
config and tokenizer as the conversion writes them, without converting its weights: a bad data file is said before
the conversion (SmolLM2-135M's took 10 s on two CPU cores, an 8B file's minutes), which happens when the weights load.
What it gives equals what the cached conversion gives, and its errors are the conversion's. The weights' conversion
in the same process copies its tokenizer files (the file unchanged since), and its temporary directory is removed
then or at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_gguf_metadata import _BPE_VOCAB, _bpe_tokenizer_metadata, hf_model, write_gguf
from test_gguf_tokenizer import _SPM_TOKENS, _spm_tokenizer_metadata

import chronicals
from chronicals.models import gguf_io
from chronicals.models.gguf_cache import CACHE_ENTRY, cache_dir_for
from chronicals.models.loading import tokenizer_and_config

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["hello world", " hello  world\n", "Héllo, wörld! 123", "<|im_start|>hell<|im_end|>", ""]


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    """An empty CHRONICALS_CACHE; returns it."""
    cache = tmp_path / "cold_cache"
    monkeypatch.setenv("CHRONICALS_CACHE", str(cache))
    return cache


def refuse_tensor_conversion(monkeypatch) -> list:
    """gguf_io.gguf_tensor (one tensor dequantized for the conversion) fails the test; returns the calls."""
    calls = []

    def refuse(t, *a, **k):
        calls.append(t.name)
        raise AssertionError(f"tensor {t.name} was converted")

    monkeypatch.setattr(gguf_io, "gguf_tensor", refuse)
    return calls


def _spm_gguf(path):
    def meta(w):
        _spm_tokenizer_metadata(w)
        w.add_add_space_prefix(False)  # the converter's JSON edit (gguf_tokenizer._no_space_prefix) runs

    write_gguf(path, "llama", hf_model("llama", vocab_size=len(_SPM_TOKENS)), extra=meta)
    return path


def _bpe_gguf(path, add_bos=False):
    write_gguf(path, "qwen2", hf_model("qwen2", vocab_size=_BPE_VOCAB),
               extra=lambda w: _bpe_tokenizer_metadata(w, pre="qwen2", add_bos=add_bos))
    return path


def _refused_gguf(path):
    """A GGUF whose tokenizer transformers' converter refuses (merges missing): its conversion records why."""
    write_gguf(path, "llama", hf_model("llama", vocab_size=_BPE_VOCAB),
               extra=lambda w: _bpe_tokenizer_metadata(w, merges=False))
    return path


@pytest.fixture
def user_temp(tmp_path, monkeypatch):
    """An empty directory that tempfile makes its directories in (the user's $TMPDIR); returns it."""
    temp = tmp_path / "user_temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def ours(temp) -> list[str]:
    """The weightless conversions' directories in ``temp`` (torch puts its own torchinductor_* there)."""
    return sorted(f.name for f in temp.iterdir() if f.name.startswith("chronicals-gguf-"))


def _same_as_a_conversion_from_scratch(entry, path, tmp_path) -> None:
    """Cache entry ``entry`` holds, byte for byte, what convert_gguf(path) writes, besides the cache's record."""
    scratch = gguf_io.convert_gguf(path, tmp_path / "scratch")
    names = sorted(f.name for f in entry.iterdir() if f.name != CACHE_ENTRY)
    assert names == sorted(f.name for f in scratch.iterdir()), names
    for name in names:
        assert (entry / name).read_bytes() == (scratch / name).read_bytes(), name


def _same_tokenizer(a, b, tmp_path) -> None:
    """``a`` and ``b`` save the same files and encode, decode and chat-format alike."""
    for tok, name in ((a, "a"), (b, "b")):
        tok.save_pretrained(tmp_path / name)
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "b").iterdir()) and "tokenizer.json" in files, files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    for text in TEXTS:
        ids = a(text)["input_ids"]
        assert ids == b(text)["input_ids"] and a.decode(ids) == b.decode(ids), text
    assert (a.bos_token, a.eos_token, a.pad_token, a.unk_token, a.model_max_length, a.chat_template) == \
        (b.bos_token, b.eos_token, b.pad_token, b.unk_token, b.model_max_length, b.chat_template)
    if a.chat_template:
        chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
        assert a.apply_chat_template(chat, return_dict=False) == b.apply_chat_template(chat, return_dict=False)
    assert a.chronicals_source == b.chronicals_source


@pytest.mark.parametrize("make", [_spm_gguf, _bpe_gguf], ids=["sentencepiece", "byte_level"])
def test_a_cold_cache_gives_the_conversions_tokenizer_and_config_without_its_weights(make, tmp_path, cold_cache,
                                                                                    monkeypatch):
    """No tensor is converted and nothing is written to the cache; the cached conversion made afterwards gives the
    same ModelConfig and tokenizer, and is then what is read (the file is not opened again)."""
    path = make(tmp_path / "tiny.gguf")
    with monkeypatch.context() as m:
        refused = refuse_tensor_conversion(m)
        tok, config = tokenizer_and_config(path)
    assert not refused and not cold_cache.exists(), list(cold_cache.rglob("*"))
    chronicals.load_model(path, tokenizer=False)  # the weights load: converted into the cache now
    assert len(list(cold_cache.rglob("*.safetensors"))) == 1
    monkeypatch.setattr(gguf_io, "open_gguf", lambda *a, **k: pytest.fail("the .gguf was read again"))
    tok_cached, config_cached = tokenizer_and_config(path)
    assert config == config_cached
    _same_tokenizer(tok, tok_cached, tmp_path)


def test_the_embedded_gguf_on_a_cold_cache_gives_what_its_conversion_gives(smollm2_gguf_path, tmp_path, monkeypatch):
    """The embedded SmolLM2: tokenizer (49,152 tokens, its chat template, eos <|im_end|>) and config as the session
    cache's full conversion gives them, without a tensor converted."""
    tok_cached, config_cached = tokenizer_and_config(smollm2_gguf_path)  # the session cache: converted once
    cache = tmp_path / "cold_cache"
    monkeypatch.setenv("CHRONICALS_CACHE", str(cache))
    refused = refuse_tensor_conversion(monkeypatch)
    tok, config = tokenizer_and_config(smollm2_gguf_path)
    assert not refused and not cache.exists()
    assert config == config_cached and config.vocab_size == 49152 and tok.eos_token == "<|im_end|>"
    _same_tokenizer(tok, tok_cached, tmp_path)


def test_a_damaged_cached_conversion_is_not_converted_again_before_the_data(tmp_path, cold_cache, monkeypatch):
    """An entry whose weights file was truncated (a full disk under a copy): the config and tokenizer come from the
    file, and the entry is converted again when the weights load, as before."""
    path = _bpe_gguf(tmp_path / "tiny.gguf")
    chronicals.load_model(path, tokenizer=False)
    (weights,) = cold_cache.rglob("model.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with monkeypatch.context() as m:
        refused = refuse_tensor_conversion(m)
        tok, config = tokenizer_and_config(path)
    assert not refused and weights.stat().st_size == 100 and tok("hell")["input_ids"] == [261]
    chronicals.load_model(path, tokenizer=False)
    assert weights.stat().st_size > 100


@pytest.mark.parametrize("how", ["no_tokenizer", "tokenizer_refused"])
def test_a_cold_caches_tokenizer_errors_are_the_conversions(how, tmp_path, cold_cache, monkeypatch):
    """A GGUF without tokenizer metadata, or with one transformers' converter refuses (merges missing): the same
    error as from its cached conversion, naming the .gguf file, with no tensor converted."""
    path = tmp_path / f"{how}.gguf"
    extra = None if how == "no_tokenizer" else (lambda w: _bpe_tokenizer_metadata(w, merges=False))
    write_gguf(path, "llama", hf_model("llama", vocab_size=_BPE_VOCAB), extra=extra)
    error = FileNotFoundError if how == "no_tokenizer" else ValueError
    with monkeypatch.context() as m:
        refused = refuse_tensor_conversion(m)
        with pytest.raises(error) as cold:
            tokenizer_and_config(path)
    assert not refused and not cold_cache.exists()
    chronicals.load_model(path, tokenizer=False)
    with pytest.raises(error) as cached:
        tokenizer_and_config(path)
    assert str(cold.value) == str(cached.value) and str(path) in str(cold.value)


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


@pytest.mark.parametrize("make", [_spm_gguf, _bpe_gguf, _refused_gguf],
                         ids=["sentencepiece", "byte_level", "tokenizer_refused"])
def test_the_first_load_copies_the_weightless_conversions_tokenizer_files(make, tmp_path, cold_cache, user_temp,
                                                                          monkeypatch):
    """tokenizer_and_config then load_model in one process: the full conversion copies the weightless one's tokenizer
    files (or its record of the tokenizer's error) instead of converting the tokenizer a second time (SmolLM2-135M:
    3.5 s on two CPU cores) and takes its parsed reader instead of parsing the file again (2.0 s), its entry is byte
    for byte a conversion from scratch, and the temporary directory, kept until then, is gone."""
    path = make(tmp_path / "tiny.gguf")
    if make is _refused_gguf:
        with pytest.raises(ValueError, match="cannot be made into a tokenizer"):
            tokenizer_and_config(path)
    else:
        tokenizer_and_config(path)
    assert len(ours(user_temp)) == 1
    with monkeypatch.context() as m:
        m.setattr(gguf_io, "convert_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was converted again"))
        m.setattr(gguf_io, "open_gguf", lambda *a, **k: pytest.fail("the file was parsed again"))
        chronicals.load_model(path, tokenizer=False)
    assert not ours(user_temp)
    _same_as_a_conversion_from_scratch(cache_dir_for(path), path, tmp_path)


def test_a_file_changed_since_its_weightless_conversion_has_its_tokenizer_converted(tmp_path, cold_cache, user_temp):
    """The same path rewritten between tokenizer_and_config and load_model with another tokenizer (BOS added) and
    the same config: its identity (the cache's key) changed, so its tokenizer is converted, not copied; the
    weightless directory of its former contents is removed all the same."""
    path = _bpe_gguf(tmp_path / "tiny.gguf")
    tokenizer_and_config(path)
    _bpe_gguf(path, add_bos=True)
    chronicals.load_model(path, tokenizer=False)
    assert not ours(user_temp)
    _same_as_a_conversion_from_scratch(cache_dir_for(path), path, tmp_path)


def test_copied_tokenizer_files_must_come_with_the_files_config(tmp_path):
    """convert_gguf(..., tokenizer_from=d): a d whose config.json is another file's is a ValueError naming d, and
    nothing is written."""
    other = gguf_io.convert_gguf(_spm_gguf(tmp_path / "other.gguf"), tmp_path / "other", weights=False)
    with pytest.raises(ValueError, match=f"{other}: its config.json is not the one .*tiny.gguf converts to"):
        gguf_io.convert_gguf(_bpe_gguf(tmp_path / "tiny.gguf"), tmp_path / "out", tokenizer_from=other)
    assert not (tmp_path / "out").exists()


def test_a_weightless_conversion_never_used_is_removed_at_exit(tmp_path, cold_cache):
    """A process that read a new GGUF's config and tokenizer and never loaded its weights (train stopped by bad data)
    leaves nothing in the user's temporary directory; a forked child's exit leaves the parent's directory alone."""
    path = _bpe_gguf(tmp_path / "tiny.gguf")
    temp = tmp_path / "user_temp"
    temp.mkdir()
    code = ("import os, sys\n"
            "from chronicals.models.loading import tokenizer_and_config\n"
            "tokenizer_and_config(sys.argv[1])\n"
            "if os.fork() == 0:\n"
            "    sys.exit(0)\n"
            "os.wait()\n"
            "print(os.listdir(sys.argv[2]))\n")
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(Path(chronicals.__file__).parents[1])}  # this code
    out = subprocess.run([sys.executable, "-c", code, str(path), str(temp)], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "chronicals-gguf-" in out, out  # kept after the child's exit, until the process's
    assert not ours(temp)
