"""The GGUF tokenizer (models/gguf_tokenizer.py): transformers' converter, set to what the file's metadata says, so
that every transformers 5 gives the same tokenizer (5.17 did not: special tokens, BOS, byte-level decoding), or
refused, naming the file and the fix, where transformers < 5.18 would build another tokenizer than the file's."""

from __future__ import annotations

import re

import pytest
import transformers

import chronicals
from chronicals.models import gguf_tokenizer
from chronicals.models.gguf_tokenizer import convert_tokenizer
from test_gguf_metadata import _BPE_VOCAB, _bpe_tokenizer_metadata, hf_model, write_gguf

_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "hell", "hello", "▁hello", "▁w", "or", "▁wor",
           "▁world", "ld"]
_SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + _PIECES


def _spm_tokenizer_metadata(w, add_bos=None) -> None:
    """A tiny SentencePiece (llama.cpp model 'llama') vocabulary as llama.cpp writes Llama 2 / Mistral's: <unk>,
    <s>, </s>, the 256 byte tokens, pieces with scores; add_bos: tokenizer.ggml.add_bos_token (None: left out)."""
    w.add_tokenizer_model("llama")
    w.add_token_list(_SPM_TOKENS)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(_PIECES))  # unknown, control, byte, normal
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(_PIECES))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_sentencepiece_tokenizer_adds_bos_as_the_file_says(tmp_path, add_bos):
    """llama.cpp adds BOS to a SentencePiece vocabulary unless tokenizer.ggml.add_bos_token says otherwise;
    transformers 5.17's tokenizer added none (and named eos '<s>'): Llama 2 and Mistral files trained without BOS."""
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", m, extra=lambda w: _spm_tokenizer_metadata(w, add_bos))
    _, tok = chronicals.load_model(path)  # converted, saved into the cache and read back
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<s>", "</s>", "<unk>", None)
    text = "hello world"
    body = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(body)[-1] == "▁world" and 2 not in body
    assert tok(text)["input_ids"] == ([1] if add_bos in (None, True) else []) + body


@pytest.mark.parametrize("prefix", [None, True, False])
def test_sentencepiece_space_prefix_is_as_the_file_says(tmp_path, prefix):
    """tokenizer.ggml.add_space_prefix=false (a vocabulary trained with add_dummy_prefix=false): llama.cpp puts no
    "▁" before the text; transformers' converter ignored the key, so "hello world" began '▁h' where the model was
    trained on 'hello' (a GGUF walk). Absent or true: the prefix, as before; decoding gives the text back."""
    m = hf_model("llama", vocab_size=len(_SPM_TOKENS))
    path = tmp_path / "spm.gguf"

    def meta(w):
        _spm_tokenizer_metadata(w)
        if prefix is not None:
            w.add_add_space_prefix(prefix)

    write_gguf(path, "llama", m, extra=meta)
    _, tok = chronicals.load_model(path)  # converted, saved into the cache and read back
    pieces = tok.convert_ids_to_tokens(tok("hello world", add_special_tokens=False)["input_ids"])
    assert pieces[0].startswith("▁") is (prefix is not False) and pieces[-1] == "▁world", pieces
    assert tok.decode(tok("hello world", add_special_tokens=False)["input_ids"]) == "hello world"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_byte_level_file_without_add_bos_token_adds_no_bos(tmp_path, arch):
    """tokenizer.ggml.add_bos_token left out of a byte-level (gpt2) file: no BOS, as llama.cpp tokenizes it (only
    SentencePiece vocabularies get one by default); a BOS the model never saw would begin every sequence."""
    path = tmp_path / "bpe.gguf"
    write_gguf(path, arch, hf_model(arch, vocab_size=_BPE_VOCAB),
               extra=lambda w: _bpe_tokenizer_metadata(w, pre="qwen2" if arch == "qwen2" else "gpt-2", add_bos=None))
    tok, why = convert_tokenizer(path)
    assert why is None and tok.bos_token == "<|im_start|>"
    assert tok("hell")["input_ids"] == [261]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_special_tokens_are_the_ones_the_file_names(tmp_path, arch):
    """bos / eos / pad / unk are the tokens of the ids the file names, and None where it names none, whatever
    transformers' converter chose (5.17: a llama file's eos was its bos token)."""
    def meta(w):
        _bpe_tokenizer_metadata(w, pre="qwen2" if arch == "qwen2" else "gpt-2")
        w.add_unk_token_id(0)

    m = hf_model(arch, vocab_size=_BPE_VOCAB)
    path = tmp_path / "bpe.gguf"
    write_gguf(path, arch, m, extra=meta)
    tok, why = convert_tokenizer(path)
    assert why is None
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == \
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok("hell")["input_ids"] == [261]  # no BOS: tokenizer.ggml.add_bos_token is false


def test_a_damaged_special_token_id_names_the_file_and_the_key(tmp_path):
    """An eos id past the vocabulary: was a bare IndexError (transformers 5.18 on) or a tokenizer with another eos
    (5.17); now the error names the file and the key."""
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "bad_eos.gguf"
    write_gguf(path, "llama", m, extra=lambda w: _bpe_tokenizer_metadata(w, eos_id=_BPE_VOCAB + 5))
    tok, why = convert_tokenizer(path)
    assert tok is None
    assert why.startswith(f"{path}: its tokenizer metadata (tokenizer.ggml.*) cannot be made into a tokenizer by "
                          f"transformers' GGUF converter (metadata tokenizer.ggml.eos_token_id={_BPE_VOCAB + 5} is "
                          f"not a token id of its {_BPE_VOCAB} tokens; the file's metadata is damaged)")


def test_a_file_without_tokens_is_named(tmp_path):
    """A GGUF file without tokenizer.ggml.tokens gets the error that says so and names the file, not an
    AttributeError text about None."""
    path = tmp_path / "no_tokens.gguf"
    write_gguf(path, "llama", hf_model("llama"))
    tok, why = convert_tokenizer(path)
    assert tok is None
    assert why.startswith(f"{path}: its tokenizer metadata (tokenizer.ggml.*) cannot be made into a tokenizer by "
                          "transformers' GGUF converter (metadata tokenizer.ggml.tokens is missing; the file's "
                          "metadata is damaged)"), why


def test_an_unreadable_file_is_named_and_logged_not_raised(tmp_path, caplog):
    """convert_tokenizer without a reader (the cache's tokenizer retry) parses the file itself: a truncated .gguf,
    whatever gguf's reader raises (an IndexError here), is (None, why) naming the file as damaged, not an exception,
    and that why is logged as a warning."""
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama", hf_model("llama", vocab_size=_BPE_VOCAB), extra=_bpe_tokenizer_metadata)
    path.write_bytes(path.read_bytes()[:200])
    caplog.set_level("WARNING", logger="chronicals.models.gguf_tokenizer")
    tok, why = convert_tokenizer(path)
    assert tok is None and why.startswith(f"{path}: its tokenizer metadata") and "the file's metadata is damaged" in why
    assert why in caplog.text


class _DamagedReader:
    """A GGUFReader whose metadata fields cannot be read: the error's message spans lines and runs long."""

    @property
    def fields(self):
        raise ValueError("tokenizer.ggml.tokens:\n   " + "x" * 400)


def test_a_damaged_readers_error_is_one_line_of_at_most_300_characters(tmp_path):
    """What the reader raised is quoted in the refusal on one line and cut to 300 characters, as the converter's
    errors are: the refusal is logged, recorded in the cache entry and raised on every load."""
    path = tmp_path / "damaged.gguf"
    tok, why = convert_tokenizer(path, reader=_DamagedReader())
    said = ("tokenizer.ggml.tokens: " + "x" * 400)[:300]
    assert tok is None and f"(ValueError: {said}; the file's metadata is damaged)" in why, why


def test_byte_level_text_decodes_beside_a_token_outside_the_byte_alphabet(tmp_path):
    """A special token added to a byte-level tokenizer (DeepSeek's '<｜end▁of▁sentence｜>', as a chat template
    brings it): transformers 5.17's decoder of llama files fused all tokens before decoding the bytes, so that one
    token left the whole text undecoded ('ĠParis.<｜end of sentence｜>')."""
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "bpe.gguf"
    write_gguf(path, "llama", m, extra=_bpe_tokenizer_metadata)
    _, tok = chronicals.load_model(path)
    end = "<｜end▁of▁sentence｜>"
    tok.add_special_tokens({"additional_special_tokens": [end]}, replace_extra_special_tokens=False)
    text = f"hello é 🤗,\n  hell{end}"
    ids = tok(text)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids(end) and tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text[:-len(end)]


def _bpe(**kw):
    return lambda w: _bpe_tokenizer_metadata(w, **kw)


_V = r"transformers 5\.17\.0"
# case -> (architecture, tokenizer metadata, why transformers < 5.18 would build it otherwise: None where it builds
# what 5.18 on build)
_OLD_CASES = {
    "llama_gpt2": ("llama", _bpe(), None),
    "llama_smollm": ("llama", _bpe(pre="smollm"), None),
    "llama_no_pre": ("llama", _bpe(pre=None), None),
    "llama_sentencepiece": ("llama", _spm_tokenizer_metadata, None),
    "llama_default": ("llama", _bpe(pre="default"), None),
    "qwen2_qwen2": ("qwen2", _bpe(pre="qwen2"), None),
    "qwen2_deepseek_r1": ("qwen2", _bpe(pre="deepseek-r1-qwen"), None),  # DeepSeek-R1-Distill-Qwen: qwen2 files
    "qwen3_qwen2": ("qwen3", _bpe(pre="qwen2"), None),  # how llama.cpp writes Qwen3 files
    "qwen3_deepseek_r1": ("qwen3", _bpe(pre="deepseek-r1-qwen"), None),
    "llama_rwkv": ("llama", _bpe(model="rwkv"),
                   rf"tokenizer\.ggml\.model='rwkv' of a llama file is built as byte-level BPE by {_V}"),
    "llama_llama3_split": ("llama", _bpe(pre="llama-bpe"),
                           rf"{_V} splits a llama file's text as GPT-2's pre-tokenizer does, not as its "
                           r"tokenizer\.ggml\.pre='llama-bpe' says"),
    "qwen2_gpt2_split": ("qwen2", _bpe(pre="gpt-2"),
                         rf"{_V} splits a qwen2 file's text as Qwen2's pre-tokenizer does, not as its "
                         r"tokenizer\.ggml\.pre='gpt-2' says"),
    "qwen2_sentencepiece": ("qwen2", _spm_tokenizer_metadata,
                            rf"tokenizer\.ggml\.model='llama' of a qwen2 file is built as Qwen2's byte-level BPE by "
                            rf"{_V}"),
}


@pytest.mark.parametrize("case", list(_OLD_CASES))
def test_before_transformers_5_18_what_it_would_build_otherwise_is_refused(tmp_path, monkeypatch, case):
    """transformers 5.17 picks a GGUF tokenizer by the architecture and reads neither tokenizer.ggml.model nor .pre:
    an 'rwkv' file became byte-level BPE, a Llama 3 file ('llama-bpe') was split like GPT-2. The check runs before
    transformers does, so it is run here under every version with 5.17 stated; the files it lets through are then
    built by the installed transformers."""
    arch, meta, refused = _OLD_CASES[case]
    monkeypatch.setattr(gguf_tokenizer, "transformers_version", lambda: (5, 17, 0))
    spm = meta is _spm_tokenizer_metadata
    m = hf_model(arch, vocab_size=len(_SPM_TOKENS) if spm else _BPE_VOCAB)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, m, extra=meta)
    tok, why = convert_tokenizer(path)
    if refused is None:
        assert why is None and tok.convert_ids_to_tokens(tok("hello")["input_ids"])[-1] == "o"
    else:
        assert tok is None and re.fullmatch(
            rf"{re.escape(str(path))}: its tokenizer metadata \(tokenizer\.ggml\.\*\) cannot be made into a tokenizer "
            rf"by transformers' GGUF converter \({refused}\); upgrade transformers \(pip install -U "
            r"'transformers>=5\.18' builds it from tokenizer\.ggml\.model and \.pre\), or use the tokenizer of the "
            r"model's Hugging Face directory \(from Python, load_model\(\.\.\., tokenizer=False\) loads the weights "
            r"alone\)", why), why


@pytest.mark.parametrize("version", [(5, 18, 0), (5, 18)], ids=["5.18.0", "5.18"])  # "5.18" reads as (5, 18)
def test_from_transformers_5_18_a_file_is_built_as_its_metadata_says(tmp_path, monkeypatch, version):
    """transformers 5.18 is the first that reads tokenizer.ggml.model and .pre: a Llama 3 ('llama-bpe') file,
    refused under 5.17, is built under 5.18 however its version reads."""
    monkeypatch.setattr(gguf_tokenizer, "transformers_version", lambda: version)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", hf_model("llama", vocab_size=_BPE_VOCAB), extra=_bpe(pre="llama-bpe"))
    tok, why = convert_tokenizer(path)
    assert why is None and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("message, said", [("no\n   tokenizer here", "no tokenizer here"), ("", "RuntimeError")],
                         ids=["message", "no_message"])
def test_a_converter_error_names_the_file_and_the_fix(tmp_path, monkeypatch, message, said):
    """Whatever transformers' converter raises (a KeyError 'scores' for a file without merges, ...) becomes one
    error naming the file, what transformers said, and the fix; an error without a message is named by its type
    (not a bare 'RuntimeError: ')."""
    def refuse(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "bpe.gguf"
    write_gguf(path, "llama", m, extra=_bpe_tokenizer_metadata)
    assert convert_tokenizer(path) == (None, (
        f"{path}: its tokenizer metadata (tokenizer.ggml.*) cannot be made into a tokenizer by transformers' GGUF "
        f"converter (RuntimeError: {said}); use the tokenizer of the model's Hugging Face directory (from "
        "Python, load_model(..., tokenizer=False) loads the weights alone)"))


@pytest.mark.parametrize("installed, release", [("5.17.0.dev0", (5, 17, 0)), ("5.18.0rc1", (5, 18, 0)),
                                                ("4.57.1", (4, 57, 1)), ("5.2", (5, 2)), ("5.20.0+local", (5, 20, 0))])
def test_transformers_version_reads_the_release_numbers(installed, release, monkeypatch):
    monkeypatch.setattr(gguf_tokenizer, "version", lambda name: installed)
    assert gguf_tokenizer.transformers_version() == release


@pytest.mark.parametrize("context", [True, False])
def test_model_max_length_is_the_files_context_length(tmp_path, context):
    """transformers' converter leaves model_max_length at 1e30 ("no limit": no too-long warning); the file's
    {arch}.context_length is the tokenizer's limit, and without that key the default stays."""
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "bpe.gguf"
    write_gguf(path, "llama", m, skip=() if context else ("context_length",),
               extra=lambda w: _bpe_tokenizer_metadata(w, pre="gpt-2"))
    tok, why = convert_tokenizer(path)
    assert why is None
    if context:
        assert tok.model_max_length == m.config.max_position_embeddings
    else:
        assert tok.model_max_length >= 10 ** 20
