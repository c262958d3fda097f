"""GGUF tokenizer metadata (``tokenizer.ggml.*``) -> a transformers tokenizer, alike under every transformers 5.

transformers' GGUF converter builds the tokenizer; what it leaves unlike the file's metadata is set from the
metadata here. Measured with transformers 5.17.0 (the GPU machine's) against 5.18.0 and 5.24.0:

- special tokens: 5.17 gives a llama file eos = its bos token (SmolLM2: eos '<|im_start|>', so documents ended on
  the wrong token), a qwen2 file no bos, and neither a pad; bos / eos / unk / pad are set from the ids the file names
  (None where it names none, as 5.18 on do);
- BOS: 5.17 ignores ``tokenizer.ggml.add_bos_token``, so SentencePiece files (Llama 2, Mistral) lost their BOS;
  add_bos / add_eos are set from the file (absent: BOS for SentencePiece only, as llama.cpp and 5.18 on do);
- decoding: 5.17's byte-level decoder on llama files fuses the tokens before the byte decoding, so a single token
  spelled outside the byte alphabet (an added '<｜end▁of▁sentence｜>') left the whole text undecoded ('ĠParis.');
  byte-level files get the byte-level decoder, as 5.18 on give them.

Differences left between versions: 5.17 splits a qwen2 file's text after NFC normalisation (as Qwen2's own
tokenizer.json does) and 5.18 on without; a SentencePiece file's text right after a special token gets the space
prefix under 5.17 (as llama.cpp does) and not under 5.18 on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# special token attribute -> its id's metadata key
_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


@dataclass
class _TokenizerMeta:
    arch: str
    model: str  # tokenizer.ggml.model: 'gpt2' (byte-level BPE), 'llama' (SentencePiece), ...
    pre: str | None  # tokenizer.ggml.pre: the byte-level split
    specials: dict[str, str | None]  # bos_token / eos_token / unk_token / pad_token -> the token the file names
    add_bos: bool
    add_eos: bool


def _read_meta(reader) -> tuple[_TokenizerMeta | None, str | None]:
    """(the tokenizer metadata of a GGUFReader, None) or (None, what is wrong with it)."""
    def get(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None, "metadata tokenizer.ggml.tokens is missing"
    n = len(tokens.data)
    specials = {}
    for name, key in _SPECIAL_IDS.items():
        tid = get(key)
        if tid is not None and not (isinstance(tid, int) and 0 <= tid < n):
            return None, f"metadata {key}={tid!r} is not a token id of its {n} tokens"
        specials[name] = None if tid is None else tokens.contents(tid)
    model = get("tokenizer.ggml.model")
    add_bos = get("tokenizer.ggml.add_bos_token")
    return _TokenizerMeta(arch=get("general.architecture"), model=model, pre=get("tokenizer.ggml.pre"),
                          specials=specials, add_bos=model == "llama" if add_bos is None else bool(add_bos),
                          add_eos=bool(get("tokenizer.ggml.add_eos_token", False))), None


def refusal(source, reason: str) -> str:
    """The error of a GGUF file's tokenizer that cannot be converted: names the file, the reason and the fix."""
    return (f"{source}: its tokenizer metadata (tokenizer.ggml.*) cannot be made into a tokenizer by transformers' "
            f"GGUF converter ({reason}); use the tokenizer of the model's Hugging Face directory (from Python, "
            "load_model(..., tokenizer=False) loads the weights alone)")


def _match_metadata(tok, meta: _TokenizerMeta) -> None:
    """Set on ``tok`` what the file states and transformers' converter may have left otherwise (see the module's
    docstring): special tokens, BOS / EOS added, the byte-level decoder."""
    for name, want in meta.specials.items():
        if getattr(tok, name) != want:
            log.debug("GGUF tokenizer: %s %r -> %r (the file's)", name, getattr(tok, name), want)
            setattr(tok, name, want)
    for name, want in (("add_bos_token", meta.add_bos), ("add_eos_token", meta.add_eos)):
        if bool(getattr(tok, name, False)) != want:
            setattr(tok, name, want)  # transformers rebuilds the post-processor that adds them
    if meta.model == "gpt2":
        from tokenizers import decoders

        backend = tok.backend_tokenizer
        if not isinstance(backend.decoder, decoders.ByteLevel):  # 5.17: ByteFallback, Fuse, Replace, ByteLevel
            backend.decoder = decoders.ByteLevel()


def convert_tokenizer(gguf_path: str | Path, reader=None):
    """(transformers' tokenizer of a GGUF file, matched to its metadata, None) or (None, why not, naming the file
    and the fix). reader: the file's ``gguf.GGUFReader`` when the caller has one (parsing SmolLM2's takes 2 s)."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    why = None
    try:
        if reader is None:
            import gguf

            reader = gguf.GGUFReader(gguf_path)
        meta, bad = _read_meta(reader)
    except Exception as e:  # a damaged tokenizer field
        meta, bad = None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    if bad is not None:
        why = refusal(gguf_path, f"{bad}; the file's metadata is damaged")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except Exception as e:  # KeyError 'scores', ValueError "tokenizer 'rwkv'", ...
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            why = refusal(gguf_path, f"{type(e).__name__}: {msg}")
        else:
            _match_metadata(tok, meta)
            return tok, None
    log.warning("%s", why)
    return None, why
