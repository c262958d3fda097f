"""A GGUF tokenizer's fields as the file states them: add_eos_token, the specials and decoder that transformers 5.17's
converter got wrong, the space prefix in each tokenizer form, an out-of-range special id, and the .gguf named as the
tokenizer's source."""

from __future__ import annotations

import json

import gguf
import pytest
import transformers
from tokenizers import Tokenizer, decoders

from chronicals.data.tokenize import appends_eos
from chronicals.models.gguf_tokenizer import _no_space_prefix, convert_tokenizer
from chronicals.models.loading import load_tokenizer, require_chat_template
from test_gguf_metadata import _BPE_VOCAB, _bpe_tokenizer_metadata, hf_model, write_gguf
from test_gguf_tokenizer import _SPM_TOKENS, _spm_tokenizer_metadata


@pytest.mark.parametrize("add_eos", [None, True, False])
def test_add_eos_token_is_as_the_file_says(tmp_path, monkeypatch, add_eos):
    """tokenizer.ggml.add_eos_token=true gives a tokenizer that appends eos; false, or the key left out, one that
    appends none (the key is read, not left to transformers' converter: here one that says the opposite, as 5.17's
    ignored add_bos_token)."""
    real = transformers.AutoTokenizer.from_pretrained

    def contrary(*a, **kw):
        tok = real(*a, **kw)
        tok.add_eos_token = not add_eos
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", contrary)
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "eos.gguf"

    def meta(w):
        _bpe_tokenizer_metadata(w)
        if add_eos is not None:
            w.add_add_eos_token(add_eos)

    write_gguf(path, "llama", m, extra=meta)
    tok, why = convert_tokenizer(path)
    assert tok is not None, why
    ids = tok("hell")["input_ids"]
    assert (ids[-1] == tok.eos_token_id) is bool(add_eos), ids
    assert appends_eos(tok) is bool(add_eos)


def _as_5_17(monkeypatch):
    """transformers' converter spoiled as 5.17's (the GPU machine's) builds it: a llama file's eos is its bos token,
    no pad, no BOS for SentencePiece files, a decoder that is not byte-level. Later versions build these right, so
    only this shows that ``_match_metadata`` sets them from the file."""
    real = transformers.AutoTokenizer.from_pretrained

    def spoiled(*a, **kw):
        tok = real(*a, **kw)
        tok.eos_token = tok.bos_token  # 5.17: a llama file's eos = its bos token
        tok.pad_token = None
        tok.add_bos_token = False  # 5.17 ignored tokenizer.ggml.add_bos_token
        tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spoiled)


def test_a_byte_level_file_gets_its_own_specials_and_decoder(tmp_path, monkeypatch):
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "bpe.gguf"
    write_gguf(path, "llama", m, extra=_bpe_tokenizer_metadata)
    _as_5_17(monkeypatch)
    tok, why = convert_tokenizer(path)
    assert tok is not None, why
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    text = "hello é,\n  hell"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_a_sentencepiece_file_gets_its_bos(tmp_path, monkeypatch):
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", m, extra=_spm_tokenizer_metadata)
    _as_5_17(monkeypatch)
    tok, why = convert_tokenizer(path)
    assert tok is not None, why
    assert tok("hello")["input_ids"][0] == 1  # <s>, as llama.cpp adds it (add_bos_token absent: SentencePiece)


def test_the_files_specials_overrule_the_converters(tmp_path, monkeypatch):
    """Every special token is the token of the id the file names, and None where it names none, whatever
    transformers' converter set: a converter that invents a pad, or another unk, is overruled by the file (a pad the
    file names none of was left as the converter set it, and the unk was not read at all)."""
    real = transformers.AutoTokenizer.from_pretrained

    def spoiled(*a, **kw):
        tok = real(*a, **kw)
        tok.pad_token = "</s>"  # the file names no pad
        tok.unk_token = "<s>"  # the file's unk is <unk>
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spoiled)
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", m, extra=_spm_tokenizer_metadata)
    tok, why = convert_tokenizer(path)
    assert tok is not None, why
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<s>", "</s>", "<unk>", None)
    assert (tok.unk_token_id, tok.pad_token_id) == (0, None)


def _spm_tokenizer_and_spec(tmp_path):
    """The tokenizer converted from a tiny SentencePiece GGUF, and its tokenizers JSON spec without a
    pre-tokenizer, for a test to give another normalizer / decoder form."""
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", m, extra=_spm_tokenizer_metadata)
    tok, why = convert_tokenizer(path)
    assert tok is not None, why
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = None
    return tok, spec


def test_the_old_sentencepiece_form_loses_its_space_prefix_and_decodes_back(tmp_path):
    """``_no_space_prefix`` edits whichever form the converter built; the older SentencePiece form (normalizer
    Prepend + Replace, decoder ending in Strip(' ', 1, 0)), which 5.17 builds for some files, loses its prefix and
    its decoder's Strip, which would otherwise eat a text's own first space."""
    tok, spec = _spm_tokenizer_and_spec(tmp_path)
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                              {"type": "Replace", "pattern": {"String": " "},
                                                               "content": "▁"}]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁") and tok.decode(ids) == "hello world"  # the old form
    _no_space_prefix(tok)
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    assert not tok.convert_ids_to_tokens(ids)[0].startswith("▁"), tok.convert_ids_to_tokens(ids)
    assert tok.decode(ids) == "hello world"
    # a text that starts with a space keeps it (the decoder's Strip of the prefix's space would eat the text's own)
    assert tok.decode(tok(" hello world", add_special_tokens=False)["input_ids"]) == " hello world"


def test_a_bare_prepend_normalizer_loses_its_space_prefix(tmp_path):
    """``_no_space_prefix`` on the form whose normalizer is a lone Prepend("▁"), not inside a Sequence (a form its
    docstring names): the normalizer goes, so "hello" is no longer tokenized as '▁h'... (it was kept)."""
    tok, spec = _spm_tokenizer_and_spec(tmp_path)
    spec["normalizer"] = {"type": "Prepend", "prepend": "▁"}
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert tok.convert_ids_to_tokens(tok("hello", add_special_tokens=False)["input_ids"])[0].startswith("▁")
    _no_space_prefix(tok)
    assert json.loads(tok.backend_tokenizer.to_str())["normalizer"] is None
    pieces = tok.convert_ids_to_tokens(tok("hello", add_special_tokens=False)["input_ids"])
    assert not pieces[0].startswith("▁"), pieces


def _spm(tmp_path, prefix):
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", m, extra=lambda w: (_spm_tokenizer_metadata(w), w.add_add_space_prefix(prefix)))
    tok, why = convert_tokenizer(path)
    assert tok is not None, why
    return tok


def test_the_installed_converters_form_keeps_a_leading_space_of_the_text(tmp_path):
    """The installed transformers' own form (Metaspace pre-tokenizer, decoder ending in Strip(' ', 1, 0)) with
    add_space_prefix=false: a text's leading space survives the decode ("hello world" alone cannot tell)."""
    tok = _spm(tmp_path, False)
    ids = tok(" hello world", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == " hello world"


def test_a_metaspace_inside_a_sequence_pre_tokenizer_loses_its_prefix(tmp_path):
    """A Metaspace wrapped in a Sequence pre-tokenizer (as converters that add a digit or punctuation split
    build it) gets prepend_scheme never too."""
    tok = _spm(tmp_path, True)
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["normalizer"] = None  # the prefix from the Metaspace alone, whichever form this transformers built
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}]}
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert tok.convert_ids_to_tokens(tok("hello", add_special_tokens=False)["input_ids"])[0].startswith("▁")
    _no_space_prefix(tok)
    pieces = tok.convert_ids_to_tokens(tok("hello world", add_special_tokens=False)["input_ids"])
    assert not pieces[0].startswith("▁"), pieces


@pytest.mark.parametrize("value, vtype", [(_BPE_VOCAB, gguf.GGUFValueType.UINT32), (-1, gguf.GGUFValueType.INT32),
                                          ("2", gguf.GGUFValueType.STRING)], ids=["past_the_end", "negative", "string"])
def test_an_eos_id_that_is_no_token_id_is_named(tmp_path, value, vtype):
    """A special token id that is not an integer in [0, n_tokens) is named as not a token id, as one further out
    is: one past the last token (not a bare IndexError in the message), a negative one (an INT32 -1 would index the
    token list from its end: eos = the last token, silently) and a string (not a bare TypeError text)."""
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "bad_eos.gguf"
    write_gguf(path, "llama", m, extra=lambda w: (_bpe_tokenizer_metadata(w, eos_id=None),
                                                  w.add_key_value("tokenizer.ggml.eos_token_id", value, vtype)))
    tok, why = convert_tokenizer(path)
    assert tok is None, (tok.eos_token, tok.eos_token_id)
    assert (f"metadata tokenizer.ggml.eos_token_id={value!r} is not a token id of its {_BPE_VOCAB} tokens; the "
            "file's metadata is damaged" in why), why


def test_a_boolean_unknown_token_id_is_named(tmp_path):
    """A bool is an int to Python: tokenizer.ggml.unknown_token_id=true (a damaged file; the model's config reads
    no unk id, so only the tokenizer sees it) would give unk = token 1, silently; it is named as not a token id."""
    path = tmp_path / "bool_unk.gguf"
    write_gguf(path, "llama", hf_model("llama", vocab_size=_BPE_VOCAB),
               extra=lambda w: (_bpe_tokenizer_metadata(w), w.add_key_value("tokenizer.ggml.unknown_token_id", True,
                                                                            gguf.GGUFValueType.BOOL)))
    with pytest.raises(ValueError, match=rf"^{path}: .*\(metadata tokenizer\.ggml\.unknown_token_id=True is not a "
                                         rf"token id of its {_BPE_VOCAB} tokens; the file's metadata is damaged\)"):
        load_tokenizer(path)


def test_a_gguf_without_a_chat_template_is_named_by_its_file(tmp_path):
    """A .gguf's tokenizer records the .gguf as its source, so the missing-template error names the file the user
    passed, not the conversion cache's directory."""
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "base.gguf"
    write_gguf(path, "llama", m, extra=_spm_tokenizer_metadata)  # no tokenizer.chat_template
    tok = load_tokenizer(path)
    assert tok.chronicals_source == str(path)
    with pytest.raises(ValueError, match=rf"^{path}: the tokenizer has no chat template"):
        require_chat_template(tok)


def test_a_metaspace_decoder_keeps_the_texts_leading_space(tmp_path):
    """The SentencePiece form whose decoder is a Metaspace (tokenizers' own default beside a Metaspace
    pre-tokenizer) strips the first space of a decoded text when it prepends one: with the prefix off, a text's own
    leading space survives the decode."""
    tok = _spm(tmp_path, True)
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    spec["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
    _no_space_prefix(tok)
    assert tok.decode(tok(" hello world", add_special_tokens=False)["input_ids"]) == " hello world"
