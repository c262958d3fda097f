"""GGUF tokenizer metadata (``tokenizer.ggml.*``) -> a transformers tokenizer, alike under every transformers 5.

transformers' GGUF converter builds the tokenizer; what it leaves unlike the file's metadata is set from the
metadata here, and what it would build wrongly is refused, naming the file and the fix. Measured with
transformers 5.17.0 (the GPU machine's) against 5.18.0 and 5.24.0:

- which tokenizer: 5.18 on build it from ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre`` (and raise for a
  model they do not know, e.g. 'rwkv'); 5.17 builds it from the architecture alone: a llama file's as SentencePiece
  when the model is 'llama' and as byte-level BPE split like GPT-2 for any other model ('rwkv' included), a qwen2 /
  qwen3 file's as byte-level BPE split like Qwen2. Under transformers < 5.18 a file whose model or split is not the
  one its architecture gets is refused (``_old_converter_refusal``: Llama 3's 'llama-bpe' split, for one);
- special tokens: 5.17 gives a llama file eos = its bos token (SmolLM2: eos '<|im_start|>', so documents ended on
  the wrong token), a qwen2 file no bos, and neither a pad; bos / eos / unk / pad are set from the ids the file names
  (None where it names none, as 5.18 on do);
- BOS: 5.17 ignores ``tokenizer.ggml.add_bos_token``, so SentencePiece files (Llama 2, Mistral) lost their BOS;
  add_bos / add_eos are set from the file (absent: BOS for SentencePiece only, as llama.cpp and 5.18 on do);
- decoding: 5.17's byte-level decoder on llama files fuses the tokens before the byte decoding, so a single token
  spelled outside the byte alphabet (an added '<｜end▁of▁sentence｜>') left the whole text undecoded ('ĠParis.');
  byte-level files get the byte-level decoder, as 5.18 on give them;
- space prefix: every version ignores ``tokenizer.ggml.add_space_prefix``; a SentencePiece file that sets it false
  gets no "▁" before the text, as llama.cpp tokenizes it (``_no_space_prefix``);
- length: every version leaves model_max_length at its "no limit" (1e30); it is set to ``{arch}.context_length``.

Differences left between versions: 5.17 splits a qwen2 file's text after NFC normalisation (as Qwen2's own
tokenizer.json does) and 5.18 on without; a SentencePiece file's text right after a special token gets the space
prefix under 5.17 (as llama.cpp does) and not under 5.18 on.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from .._numbers import is_int

log = logging.getLogger(__name__)

# the first transformers whose GGUF converter builds the tokenizer from tokenizer.ggml.model and .pre
READS_TOKENIZER_MODEL = (5, 18)

# tokenizer.ggml.pre values (None: absent) whose split transformers < 5.18 gives each architecture's byte-level files
# and 5.18 on give them too: GPT-2's for llama files ('smollm': llama.cpp splits digits off first, which neither
# transformers does: a no-op on SmolLM2's vocabulary, where no token holds a digit beside another character), Qwen2's
# for qwen2 / qwen3 files
_OLD_SPLITS = {"llama": (None, "default", "gpt-2", "smollm"),
               "qwen2": ("qwen2", "deepseek-r1-qwen"), "qwen3": ("qwen2", "deepseek-r1-qwen")}

# transformers' model_max_length when nothing set one (tokenization_utils_base.VERY_LARGE_INTEGER is 1e30)
VERY_LARGE = 10 ** 20

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
    add_space_prefix: bool = True  # tokenizer.ggml.add_space_prefix (SentencePiece: "▁" before the text)
    context_length: int | None = None  # {arch}.context_length: the tokenizer's model_max_length


def transformers_version() -> tuple[int, ...]:
    """The installed transformers' release numbers ("5.17.0.dev0" -> (5, 17, 0); "5.18.0rc1" -> (5, 18, 0))."""
    # the leading dotted digits: ".dev0", "rc1", "+local" are not release numbers ("0rc1" is 0, not 1)
    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version("transformers")).group().split(".")[:3])


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
        if tid is not None and not (is_int(tid) and 0 <= tid < n):
            return None, f"metadata {key}={tid!r} is not a token id of its {n} tokens"
        specials[name] = None if tid is None else tokens.contents(tid)
    model, arch = get("tokenizer.ggml.model"), get("general.architecture")
    add_bos = get("tokenizer.ggml.add_bos_token")
    return _TokenizerMeta(arch=arch, model=model, pre=get("tokenizer.ggml.pre"),
                          specials=specials, add_bos=model == "llama" if add_bos is None else bool(add_bos),
                          add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
                          add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
                          context_length=_positive_int(get(f"{arch}.context_length"))), None


def _positive_int(v) -> int | None:
    return int(v) if is_int(v) and v > 0 else None


def _old_converter_refusal(meta: _TokenizerMeta) -> str | None:
    """Why transformers < 5.18 (which picks the tokenizer by the architecture) would build another tokenizer than
    the file's, or None."""
    arch, model, v = meta.arch, meta.model, ".".join(map(str, transformers_version()))
    if arch == "llama" and model not in ("llama", "gpt2"):
        return f"tokenizer.ggml.model={model!r} of a llama file is built as byte-level BPE by transformers {v}"
    if arch != "llama" and model != "gpt2":
        return f"tokenizer.ggml.model={model!r} of a {arch} file is built as Qwen2's byte-level BPE by transformers {v}"
    if model == "gpt2" and meta.pre not in _OLD_SPLITS.get(arch, ()):
        return (f"transformers {v} splits a {arch} file's text as {'GPT-2' if arch == 'llama' else 'Qwen2'}'s "
                f"pre-tokenizer does, not as its tokenizer.ggml.pre={meta.pre!r} says")
    return None


def refusal(source, reason: str, upgrade: bool = False) -> str:
    """The error of a GGUF file's tokenizer that cannot be converted: names the file, the reason and the fix."""
    fix = (f"upgrade transformers (pip install -U 'transformers>={'.'.join(map(str, READS_TOKENIZER_MODEL))}' "
           "builds it from tokenizer.ggml.model and .pre), or " if upgrade else "")
    return (f"{source}: its tokenizer metadata (tokenizer.ggml.*) cannot be made into a tokenizer by transformers' "
            f"GGUF converter ({reason}); {fix}use the tokenizer of the model's Hugging Face directory (from Python, "
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
    if meta.context_length is not None and not tok.model_max_length < VERY_LARGE:
        # transformers' GGUF converter leaves model_max_length at its "no limit" 1e30, which turns off its too-long
        # warning; the Hugging Face release of SmolLM2-135M-Instruct says 8192, the file's context_length
        tok.model_max_length = meta.context_length
    if meta.model == "llama" and not meta.add_space_prefix:
        _no_space_prefix(tok)
    if meta.model == "gpt2":
        from tokenizers import decoders

        backend = tok.backend_tokenizer
        if not isinstance(backend.decoder, decoders.ByteLevel):  # 5.17: ByteFallback, Fuse, Replace, ByteLevel
            backend.decoder = decoders.ByteLevel()


def _no_space_prefix(tok) -> None:
    """A SentencePiece file with tokenizer.ggml.add_space_prefix=false: no "▁" before the text, as llama.cpp
    tokenizes it (transformers' converter ignores the key: "hello" came out '▁h', ... where the model was trained
    on 'h', ...; a GGUF walk). Edited in the tokenizer's JSON, whichever form the converter built: a Metaspace
    pre-tokenizer's prepend scheme, or a Prepend("▁") normalizer; and the decoder's Strip of that leading space."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())

    def drop(part, unwanted):  # a Sequence's members (or the part itself) without the unwanted ones
        if part is None:
            return None
        if part.get("type") == "Sequence":
            key = next(k for k in ("normalizers", "decoders", "pretokenizers") if k in part)
            part[key] = [p for p in part[key] if not unwanted(p)]
            return part
        return None if unwanted(part) else part

    def fix_pre(part):
        if part is not None and part.get("type") == "Metaspace":
            part["prepend_scheme"] = "never"
            part.pop("add_prefix_space", None)
        for sub in (part or {}).get("pretokenizers", []):
            fix_pre(sub)

    fix_pre(spec.get("pre_tokenizer"))
    spec["normalizer"] = drop(spec.get("normalizer"), lambda p: p.get("type") == "Prepend")
    spec["decoder"] = drop(spec.get("decoder"), lambda p: p.get("type") == "Strip" and p.get("start") == 1)
    if spec.get("decoder", {}) and spec["decoder"].get("type") == "Metaspace":
        spec["decoder"]["prepend_scheme"] = "never"
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))


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
    elif transformers_version() < READS_TOKENIZER_MODEL and (old := _old_converter_refusal(meta)):
        why = refusal(gguf_path, old, upgrade=True)
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
