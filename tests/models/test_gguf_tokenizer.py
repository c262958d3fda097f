"""The GGUF tokenizer (models/gguf_tokenizer.py): transformers' converter, set to what the file's metadata says, so
that every transformers 5 gives the same tokenizer (5.17 did not: special tokens, BOS, byte-level decoding)."""

from __future__ import annotations

import pytest

import chronicals
from chronicals.models.gguf_tokenizer import convert_tokenizer
from test_gguf_hunt17 import _BPE_VOCAB, _bpe_tokenizer_metadata, hf_model, write_gguf

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
