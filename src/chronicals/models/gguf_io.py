"""GGUF in: dequantize a llama.cpp checkpoint into a Hugging Face directory, cached on disk.

A GGUF file is converted once into an ordinary HF directory (``model.safetensors`` in float32,
``config.json``, tokenizer files) under ``$CHRONICALS_CACHE`` (default ``~/.cache/chronicals``), keyed by
the file's resolved path, size, mtime, inode and ctime (a file rewritten in place with its old size and
mtime put back, by cp -p or touch -r, still changes its ctime, which users cannot set); later loads read
that directory (seconds instead of a full dequantization: about 8 s vs 1 s for SmolLM2-135M on two CPU cores).
Each entry records its source (``gguf_cache_entry.json``); completing a new one removes the source's older
entries (``prune_older_entries``: 540 MB each for SmolLM2). A tokenizer conversion that failed is recorded
with the versions it failed under and retried once they change (``tokenizer_stamp``).

What the conversion undoes:
- names: llama.cpp's ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` (table below);
- layout: llama.cpp's converter permutes the rows of Q and K of the ``llama`` architecture so that
  rotary pairs are adjacent (GPT-J, interleaved rotation); our decoder rotates halves (GPT-NeoX, like
  HF), so we apply the inverse permutation (``unpermute_qk``). ``qwen2``/``qwen3`` files are not permuted;
- quantization: every tensor becomes float32 via ``gguf.quants.dequantize`` (exact dequantized values,
  the same numbers transformers' own GGUF loader produces).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .decoder import CausalLM
from .hf_io import atomic_dir, expected_names, write_state_dict
from .orphans import _remove_tree, _tree_bytes

log = logging.getLogger(__name__)

# Bump when the converted directory's contents change, so stale caches are not reused.
CONVERTER_VERSION = 2  # 2: linear rope scaling given by its factor alone (llama.cpp: an absent type is linear)

# GGUF architecture -> (HF model_type, Q/K rows permuted by llama.cpp's converter)
SUPPORTED_GGUF_ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, source: str = "gguf") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(f"{source}: has per-frequency rope factors (rope_freqs, Llama 3.1-style rope scaling), "
                         "which this converter does not read; load the Hugging Face safetensors release instead")
    raise ValueError(f"{source}: tensor {gguf_name!r} has no counterpart in our decoder "
                     f"(known: {', '.join(_GLOBAL_NAMES)}, blk.N.{{{','.join(_LAYER_NAMES)}}})")


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (rows = n_head * head_dim, halves -> interleaved pairs).

    w (n_head * D, ...) -> same shape; within each head, row i of the first half and row i of the second
    half become rows 2i and 2i + 1. Used by tests to build GGUF files; ``unpermute_qk`` inverts it.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of ``permute_qk``: interleaved rotary pairs back to HF's half-rotation layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None, required: bool = False, source: str = "gguf"):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ValueError(f"{source}: metadata key {key!r} is missing; cannot build the model config")
        return default
    return f.contents()


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999974e-06 -> 1e-05)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def gguf_config(reader, source: str = "gguf") -> dict:
    """GGUF metadata -> a Hugging Face config.json dict for our decoder."""
    arch = _field(reader, "general.architecture", required=True, source=source)
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHS)} (Mistral files use 'llama')")
    model_type = SUPPORTED_GGUF_ARCHS[arch][0]

    def get(key, default=None, required=False, kind=None):
        """The metadata value {arch}.{key}; kind int / float: checked to be a number of that kind."""
        v = _field(reader, f"{arch}.{key}", default, required, source)
        if kind is None or v is None:
            return v
        if isinstance(v, list) and v and all(x == v[0] for x in v):  # per-layer values, alike for every layer
            v = v[0]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer()):
            return kind(v)
        shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:60] + "..."
        raise ValueError(f"{source}: metadata {arch}.{key}={shown} is not {'an integer' if kind is int else 'a number'}"
                         f"{' (per-layer values that differ, which our decoder has no way to hold)' if isinstance(v, list) else ''}"
                         "; the file's metadata is damaged or not from llama.cpp's converter: convert the model "
                         "again with convert_hf_to_gguf.py, or load its Hugging Face safetensors release")

    names = {t.name for t in reader.tensors}
    hidden = get("embedding_length", required=True, kind=int)
    heads = get("attention.head_count", required=True, kind=int)
    if heads < 1 or hidden < 1:
        raise ValueError(f"{source}: metadata {arch}.attention.head_count={heads}, {arch}.embedding_length={hidden}: "
                         "both must be >= 1; the file's metadata is damaged, copy or convert it again")
    head_dim = get("attention.key_length", hidden // heads, kind=int)
    vocab = get("vocab_size", kind=int)
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None:
            raise ValueError(f"{source}: neither metadata {arch}.vocab_size nor tensor token_embd.weight is present; "
                             "expected a complete llama.cpp model file")
        vocab = int(emb.shape[-1])  # GGUF shapes are (cols, rows)
    rope_dim = get("rope.dimension_count", head_dim, kind=int)
    # as llama.cpp reads it: an absent type is linear, the factor is rope.scaling.factor or the older
    # rope.scale_linear (absent or 0: none), and type none never scales
    scaling_type = get("rope.scaling.type", "linear")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"{source}: metadata {arch}.rope.scaling.type={scaling_type!r} is not supported (none, "
                         "linear); load the model's Hugging Face safetensors release instead")
    factor = get("rope.scaling.factor", kind=float)
    if factor is None:
        factor = get("rope.scale_linear", kind=float)
    cfg = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True, kind=int),
        "num_hidden_layers": get("block_count", required=True, kind=int),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads, kind=int),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6, kind=float)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0, kind=float)),
        "max_position_embeddings": get("context_length", 4096, kind=int),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
    }
    if rope_dim != head_dim:
        cfg["partial_rotary_factor"] = rope_dim / head_dim
    if scaling_type == "linear" and factor is not None and float(factor) not in (0.0, 1.0):
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(factor)}
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    if model_type == "llama":  # GGUF has no bias flags: llama files with biases carry them as tensors
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf_key] = int(v)
    return cfg


def dequantizable_types() -> list[str]:
    """The GGML tensor types the installed ``gguf`` package can dequantize, probed on one zero block each.

    With gguf 0.19 that is every type but Q8_1 and Q8_K (llama.cpp's activation types, not found in model
    files), Q1_0, F64 and the integer types I8..I64."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    ok = []
    for qtype in GGMLQuantizationType:
        block, nbytes = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros(nbytes, dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        except Exception:  # some other complaint about the zero block: the type itself is implemented
            pass
        ok.append(qtype.name)
    return ok


def _dequantize(t, source: str) -> np.ndarray:
    """One reader tensor -> float32 array (rows, cols), or a ValueError naming the file, tensor and type."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        from importlib.metadata import version

        raise ValueError(
            f"{source}: tensor {t.name!r} is stored as {t.tensor_type.name}, which the gguf package "
            f"({version('gguf')}) "
            f"cannot dequantize (it can: {', '.join(dequantizable_types())}); re-export the model as F16, BF16, "
            "F32 or Q8_0 (llama.cpp: convert_hf_to_gguf.py --outtype f16, or llama-quantize to Q8_0), or load "
            "its Hugging Face safetensors release instead") from None
    return np.asarray(arr, dtype=np.float32)


def gguf_state_dict(reader, cfg: dict, source: str = "gguf") -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, under HF names, Q/K rows un-permuted."""
    permuted = SUPPORTED_GGUF_ARCHS[_field(reader, "general.architecture")][1]
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name, source)
        arr = _dequantize(t, source)  # (rows, cols) float32; GGUF lists shapes reversed
        w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(  # a copy: F32 data is a read-only mmap
            tuple(int(s) for s in reversed(t.shape)))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            key, n = (("head_count", cfg["num_attention_heads"]) if ".q_proj." in name
                      else ("head_count_kv", cfg["num_key_value_heads"]))
            if w.shape[0] % (2 * n):  # else a bare reshape error, before _check_tensors could name the file
                raise ValueError(f"{source}: tensor {t.name!r} has {w.shape[0]} rows, which do not split into "
                                 f"rotary pairs of metadata llama.attention.{key}={n} heads; the file's metadata is "
                                 "damaged: convert the model again with llama.cpp's convert_hf_to_gguf.py")
            w = unpermute_qk(w, n)
        out[name] = w.contiguous()
    return out


def _check_tensors(sd: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    """ValueError naming the GGUF file when its tensors are not those (names, shapes) its metadata implies."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg).state_dict().items()}
    missing, unexpected = expected_names(cfg) - set(sd), set(sd) - set(shapes)
    wrong = [f"{k} {tuple(v.shape)} (expected {shapes[k]})" for k, v in sd.items()
             if k in shapes and tuple(v.shape) != shapes[k]]
    if missing or unexpected or wrong:
        problems = [f"{what}: {', '.join(sorted(names)[:4])}{f' ({len(names)} in all)' if len(names) > 4 else ''}"
                    for what, names in (("missing tensors", missing), ("tensors beyond them", unexpected),
                                        ("tensors of other shapes", wrong)) if names]
        raise ValueError(f"{source}: the tensors do not match the file's metadata ({cfg.model_type}, "
                         f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}); {'; '.join(problems)} "
                         "(HF names); the file is damaged or was written by a converter we do not know: convert the "
                         "model again with llama.cpp's convert_hf_to_gguf.py, or load its safetensors release")


def cache_root() -> Path:
    return Path(os.environ.get("CHRONICALS_CACHE") or Path.home() / ".cache" / "chronicals")


def _identity(p: Path, st: os.stat_result, version: int, legacy: bool = False) -> str:
    """The hashed part of a cache key (legacy: the (path, size, mtime) keys written before 2f71d96)."""
    if legacy:
        return f"{p}|{st.st_size}|{st.st_mtime_ns}|v{version}"
    return f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}|v{version}"


def _entry_name(p: Path, ident: str) -> str:
    return f"{p.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def cache_dir_for(gguf_path: str | Path) -> Path:
    """The cache directory of one GGUF file: keyed by resolved path, size, mtime, inode, ctime and converter
    version (size and mtime alone: a file overwritten in place with the same size and its mtime put back,
    cp -p or touch -r, reused the stale conversion; ctime cannot be set by users, and moves a file's
    replacement or in-place rewrite to a new key)."""
    p = Path(gguf_path).resolve()
    return cache_root() / "gguf" / _entry_name(p, _identity(p, p.stat(), CONVERTER_VERSION))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, replace: bool = True,
                 cache_entry: dict | None = None) -> Path:
    """Write the HF directory of a GGUF file to ``out_dir`` atomically.

    replace=False raises FileExistsError when ``out_dir`` appeared meanwhile (another process won).
    cache_entry: the conversion cache's record of the entry, written as ``gguf_cache_entry.json``.
    """
    import gguf

    gguf_path, source = Path(gguf_path), str(gguf_path)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises ValueError/struct errors on damaged files
        m = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))
        if m:  # a tensor type newer than the installed gguf package (or a damaged type field)
            from importlib.metadata import version

            raise ValueError(
                f"{source}: a tensor is stored in GGML type {m.group(1)}, which the installed gguf package "
                f"({version('gguf')}) does not know (a type newer than it, or a damaged file); upgrade gguf "
                "(pip install -U gguf), or re-export the model as F16, BF16, F32 or Q8_0 (llama.cpp: "
                "convert_hf_to_gguf.py --outtype f16), or load its Hugging Face safetensors release") from e
        raise ValueError(f"{source}: not a readable GGUF file ({type(e).__name__}: {e}); "
                         "the file is truncated or corrupt, copy it again") from e
    cfg_dict = gguf_config(reader, source)
    cfg = ModelConfig.from_hf_dict(cfg_dict, source=source)
    sd = gguf_state_dict(reader, cfg_dict, source)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    _check_tensors(sd, cfg, source)  # here, naming the .gguf: the cached directory's error would name the cache
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    with atomic_dir(out_dir, replace=replace) as tmp:
        write_state_dict(sd, tmp)
        hf = cfg.to_hf_dict()
        hf["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if cache_entry is not None:
            (tmp / CACHE_ENTRY).write_text(json.dumps(cache_entry, indent=2, sort_keys=True) + "\n")
        if has_tokenizer:  # transformers' GGUF tokenizer conversion (BPE / SentencePiece, chat template kept)
            tok, why = _convert_tokenizer(gguf_path)
            if tok is None:  # the weights still load
                (tmp / TOKENIZER_ERROR).write_text(_tokenizer_error_json(why))
            else:
                tok.save_pretrained(str(tmp))
    return Path(out_dir)


TOKENIZER_ERROR = "gguf_tokenizer_error.txt"  # in a converted directory: why the GGUF's tokenizer is missing


def tokenizer_stamp() -> dict:
    """What a failed GGUF tokenizer conversion is recorded under: the converter version and the packages the
    conversion runs (transformers' GGUF converter, built on tokenizers and gguf). A failure recorded under another
    stamp (an upgrade may have fixed it) is retried on the next load instead of being raised."""
    return {"converter_version": CONVERTER_VERSION,
            **{pkg: metadata.version(pkg) for pkg in ("transformers", "tokenizers", "gguf")}}


def _convert_tokenizer(gguf_path: Path):
    """(transformers' tokenizer of a GGUF file, None) or (None, why it failed, naming the file and the fix)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name), None
    except Exception as e:  # KeyError 'scores', ValueError "tokenizer 'rwkv'", ...
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        why = (f"{gguf_path}: its tokenizer metadata (tokenizer.ggml.*) cannot be made into a tokenizer by "
               f"transformers' GGUF converter ({type(e).__name__}: {msg}); use the tokenizer of the model's "
               "Hugging Face directory (from Python, load_model(..., tokenizer=False) loads the weights alone)")
        log.warning("%s", why)
        return None, why


def _tokenizer_error_json(why: str) -> str:
    return json.dumps({"error": why, **tokenizer_stamp()}, indent=2, sort_keys=True) + "\n"


def _read_tokenizer_error(converted_dir: Path) -> dict | None:
    """The recorded failure {"error", stamp...}; a plain-text file (written before the stamp) has no stamp."""
    f = converted_dir / TOKENIZER_ERROR
    try:
        text = f.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    return rec if isinstance(rec, dict) and isinstance(rec.get("error"), str) else {"error": text.strip()}


def tokenizer_error(converted_dir: str | Path) -> str | None:
    """Why a GGUF file's converted directory has no tokenizer although the file has tokenizer metadata, or None."""
    rec = _read_tokenizer_error(Path(converted_dir))
    return rec["error"] if rec else None


CACHE_ENTRY = "gguf_cache_entry.json"  # in a cache entry: its source (resolved path, identity), converter version
# An older entry last used (read, or written) this recently is kept: another process may be loading it (entries
# are read without a lock; a load of the embedded model takes about 1 s, a 7B model's from a slow disk minutes).
PRUNE_AFTER_S = 600


def cached_gguf_dir(gguf_path: str | Path) -> Path:
    """The converted HF directory of a GGUF file, converting it on first use (and then removing the file's older
    conversions, ``prune_older_entries``)."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    out = cache_root() / "gguf" / _entry_name(p, _identity(p, st, CONVERTER_VERSION))
    entry = {"source": str(p), "converter_version": CONVERTER_VERSION, "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}
    if (out / "config.json").is_file():
        _mark_used(out, entry)
        rec = _read_tokenizer_error(out)
        if rec is not None:  # a failure recorded under other versions (or none: written before stamps) is retried
            stamp = tokenizer_stamp()
            if any(rec.get(k) != v for k, v in stamp.items()):
                _retry_tokenizer(p, out, rec, stamp)
        return out
    log.info("converting %s to a Hugging Face directory in %s (first load only)", gguf_path, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out, replace=False, cache_entry=entry)
    except FileExistsError:  # another process finished the same conversion first: use theirs (it prunes)
        if not (out / "config.json").is_file():  # a file where a folder of the cache belongs
            raise _cache_error(gguf_path, out, "a file is in the way") from None
        return out
    except OSError as e:  # a read-only home, a CHRONICALS_CACHE that is a file: was a bare "[Errno 20] Not a
        raise _cache_error(gguf_path, out, e.strerror or str(e)) from None  # directory: '.../gguf'"
    prune_older_entries(p, out, st)
    return out


def _write_small_file(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it): readers run concurrently."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _mark_used(out: Path, entry: dict) -> None:
    """Stamp a cache hit on the entry's record (its mtime is the last use ``prune_older_entries`` reads); an entry
    written before records existed gets one. Best effort: a read-only cache is still read."""
    f = out / CACHE_ENTRY
    try:
        if f.is_file():
            os.utime(f)
        else:
            _write_small_file(f, json.dumps(entry, indent=2, sort_keys=True) + "\n")
    except OSError:
        pass


def _retry_tokenizer(p: Path, out: Path, rec: dict, stamp: dict) -> None:
    """Convert the tokenizer of a cached entry again, its recorded failure being from other versions (``stamp``
    differs): on success the entry is published again with the tokenizer (its other files hard-linked, not
    dequantized again); on failure the error is recorded under the new stamp. A cache we cannot write is left as
    it is (the recorded error is raised)."""
    was = ", ".join(f"{k} {rec.get(k, '?')}" for k in stamp if rec.get(k) != stamp[k])
    log.info("retrying the tokenizer conversion of %s (it failed under %s; now %s)", p, was,
             ", ".join(f"{k} {stamp[k]}" for k in stamp if rec.get(k) != stamp[k]))
    tok, why = _convert_tokenizer(p)
    try:
        if tok is None:
            _write_small_file(out / TOKENIZER_ERROR, _tokenizer_error_json(why))
            return
        with atomic_dir(out, replace=True) as tmp:
            for f in out.iterdir():
                if f.name != TOKENIZER_ERROR and not f.name.startswith(".") and f.is_file() and not f.is_symlink():
                    try:
                        os.link(f, tmp / f.name)
                    except OSError:  # a file system without hard links
                        shutil.copy2(f, tmp / f.name)
            tok.save_pretrained(str(tmp))
        log.info("%s: its tokenizer converts now; added to %s", p, out)
    except OSError as e:
        log.warning("could not update %s with the retried tokenizer conversion of %s (%s)", out, p, e)


def prune_older_entries(p: Path, keep: Path, st: os.stat_result | None = None) -> list[Path]:
    """Remove the cache entries of GGUF file ``p`` (resolved) other than ``keep``, its newly completed one: those of
    its earlier contents (the key follows the file's identity) and of earlier converter versions. Return them.

    An entry is removed only when it is recognisably ``p``'s: its name is ``{stem}-{16 hex}`` and its
    ``gguf_cache_entry.json`` names ``p`` and a converter version not newer than ours (another install's newer
    converter keeps its own), or, written before records existed, its name is a key of ``p``'s present identity
    under an earlier key scheme or converter version (a converter upgrade leaves the previous entry of an unchanged
    file). One used in the last PRUNE_AFTER_S seconds is kept (another process may be
    reading it). Writes in progress are never touched: they are hidden ``.{name}.tmp-*`` directories until their
    final rename (``atomic_dir``), and a published entry is complete. Each is renamed to a hidden
    ``.{name}.pruned-*`` directory first, so a reader sees the whole entry or none (and converts again), then
    removed. A failure is a warning: the load goes on."""
    parent, st = keep.parent, st or p.stat()
    entry_re = re.compile(rf"{re.escape(p.stem)}-[0-9a-f]{{16}}")
    trash_re = re.compile(rf"\.{re.escape(p.stem)}-[0-9a-f]{{16}}\.pruned-\d+-[0-9a-f]{{8}}")
    legacy = {_entry_name(p, _identity(p, st, v, old))  # the present file's entries under every earlier key
              for v in range(1, CONVERTER_VERSION + 1) for old in (False, True)} - {keep.name}
    now, removed, freed = time.time(), [], 0
    try:
        listing = sorted(parent.iterdir())
    except OSError:
        return []
    for d in listing:
        if trash_re.fullmatch(d.name) and d.is_dir() and not d.is_symlink():  # one whose removal failed before
            size = _tree_bytes(d)
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
                freed += size
            continue
        if d == keep or not entry_re.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        last_use = _last_use_if_ours(d, p, legacy)
        if last_use is None or now - last_use < PRUNE_AFTER_S:
            continue
        trash = parent / f".{d.name}.pruned-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        size = _tree_bytes(d)
        try:
            os.rename(d, trash)
        except FileNotFoundError:  # another process pruned it first
            continue
        except OSError as e:
            log.warning("could not remove %s, an older conversion of %s (%s); remove it by hand to free its %.1f MB",
                        d, p, e.strerror or e, size / 1e6)
            continue
        removed.append(d)
        if _remove_tree(trash, f"an older conversion of {p}", log) is not None:
            freed += size
    if removed:
        log.info("removed %d older conversion%s of %s from %s (%s): %.1f MB freed", len(removed),
                 "s" * (len(removed) > 1), p, parent, ", ".join(d.name for d in removed), freed / 1e6)
    return removed


def _last_use_if_ours(d: Path, p: Path, legacy: set[str]) -> float | None:
    """When cache entry ``d`` was last used, if it is one of ``p``'s that we may remove, else None."""
    try:
        f = d / CACHE_ENTRY
        if f.is_file():
            rec = json.loads(f.read_text())
            version = rec.get("converter_version") if isinstance(rec, dict) else None
            if rec.get("source") != str(p) or not isinstance(version, int) or version > CONVERTER_VERSION:
                return None
            return f.stat().st_mtime
        if d.name in legacy:  # no record to stamp uses on: its config.json's last access or write, best known
            cst = (d / "config.json").stat()
            return max(cst.st_atime, cst.st_mtime)
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object: not known to be ours
        return None
    return None


def _cache_error(gguf_path, out: Path, why: str) -> OSError:
    return OSError(f"{gguf_path}: cannot write its conversion to a Hugging Face directory in {out.parent} ({why}); "
                   "a .gguf file is converted once under $CHRONICALS_CACHE (default ~/.cache/chronicals): set "
                   "CHRONICALS_CACHE to a writable directory")

