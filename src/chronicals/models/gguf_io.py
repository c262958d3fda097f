"""GGUF in: dequantize a llama.cpp checkpoint into a Hugging Face directory.

``convert_gguf`` writes an ordinary HF directory (``model.safetensors`` in float32, in shards past 2 GiB, written
one shard at a time; ``config.json``, tokenizer files); ``cached_gguf_dir`` does so once per file, into the
conversion cache (``gguf_cache``: keys, entry records, pruning, the recorded tokenizer failure), and later loads
read that directory (seconds instead of a full dequantization: about 8 s vs 1 s for SmolLM2-135M on two CPU cores).

What the conversion undoes:
- names: llama.cpp's ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` (table below);
- layout: llama.cpp's converter permutes the rows of Q and K of the ``llama`` architecture so that
  rotary pairs are adjacent (GPT-J, interleaved rotation); our decoder rotates halves (GPT-NeoX, like
  HF), so we apply the inverse permutation (``unpermute_qk``). With partial rope (``rope.dimension_count``
  n_rot < head_dim D) llama.cpp rotates stored rows (2i, 2i + 1), 2i < n_rot, of each head and passes rows
  n_rot..D-1 through, while we rotate dims (i, i + n_rot/2) of the first n_rot and pass the same tail
  through: only each head's first n_rot rows are un-permuted. One head, D = 8, n_rot = 4:

      stored (llama.cpp)   a0 b0 a1 b1 | t0 t1 t2 t3     pairs (a_i, b_i) rotate by theta^(-2i/4)
      ours (HF layout)     a0 a1 b0 b1 | t0 t1 t2 t3     pairs (i, i + 2)  rotate by theta^(-2i/4)

  ``qwen2``/``qwen3`` files are not permuted and llama.cpp rotates them in NEOX mode (pairs (i, i + n_rot/2),
  the tail passed through), which is our layout, partial or not;
- quantization: every tensor becomes float32 via ``gguf.quants.dequantize`` (exact dequantized values,
  the same numbers transformers' own GGUF loader produces).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .._numbers import is_int, is_real
from .._words import counted
from .config import ModelConfig
from .decoder import CausalLM
from .gguf_cache import CACHE_ENTRY, TOKENIZER_ERROR, cached_conversion, source_record, tokenizer_error_json
from .gguf_cache import cache_root, tokenizer_error  # noqa: F401 (re-exported: train.setup and models.loading)
from .gguf_tokenizer import convert_tokenizer
from .hf_io import MODEL_DIR_FILES, atomic_dir, expected_names, save_tokenizer, write_tensors_lazily
from .orphans import remove_tree

log = logging.getLogger(__name__)

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


def _swap_rotary_rows(w: torch.Tensor, n_head: int, n_rot: int | None, inverse: bool) -> torch.Tensor:
    """Per head of w (n_head * D, ...): its first n_rot rows (None: all D) viewed as (2, n_rot/2) and transposed,
    halves -> interleaved pairs (inverse: viewed as (n_rot/2, 2), pairs -> halves); rows n_rot..D-1 kept."""
    rest, d = w.shape[1:], w.shape[0] // n_head
    r = d if n_rot is None else n_rot
    h = w.reshape(n_head, d, *rest)  # (n_head, D, ...)
    split = (r // 2, 2) if inverse else (2, r // 2)
    rot = h[:, :r].reshape(n_head, *split, *rest).transpose(1, 2).reshape(n_head, r, *rest)
    return torch.cat((rot, h[:, r:]), dim=1).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int, n_rot: int | None = None) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (rows = n_head * head_dim, halves -> interleaved pairs).

    w (n_head * D, ...) -> same shape; within each head, row i of the first half and row i of the second
    half become rows 2i and 2i + 1. n_rot (even, <= D; None: D): only the first n_rot rows of each head are
    interleaved (rows i and i + n_rot/2 -> rows 2i and 2i + 1) and rows n_rot..D-1 stay, the layout in which
    llama.cpp's partial rope (NORM mode) computes what ours computes on ``w``. Used by tests to build GGUF
    files; ``unpermute_qk`` inverts it.
    """
    return _swap_rotary_rows(w, n_head, n_rot, inverse=False)


def unpermute_qk(w: torch.Tensor, n_head: int, n_rot: int | None = None) -> torch.Tensor:
    """Inverse of ``permute_qk``: interleaved rotary pairs (each head's first n_rot rows; None: all) back to HF's
    half-rotation layout, rows n_rot..D-1 as they are."""
    return _swap_rotary_rows(w, n_head, n_rot, inverse=True)


def _field(reader, key: str, default=None, required: bool = False, source: str = "gguf"):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ValueError(f"{source}: metadata key {key!r} is missing; cannot build the model config")
        return default
    return f.contents()


def refuse_foreign_layout(reader, source: str) -> None:
    """ValueError for a GGUF this reader would read wrong or in part (a GGUF walk): a big-endian file (llama.cpp's
    --bigendian; the gguf reader gives its metadata right, but its tensors as big-endian arrays that dequantize
    reads as little-endian: every weight garbage, silently) and one part of a split set (llama.cpp's gguf-split:
    part 1 read as a damaged file, the others as missing their architecture)."""
    if getattr(reader, "byte_order", "I") == "S":
        raise ValueError(f"{source}: a big-endian GGUF file; chronicals reads little-endian ones: convert it with "
                         "gguf-py's gguf_convert_endian.py (gguf_convert_endian.py FILE little), or use the model's "
                         "little-endian release")
    count = _field(reader, "split.count", 0)
    if isinstance(count, int) and count > 1:
        part = _field(reader, "split.no", 0)
        raise ValueError(f"{source}: part {part + 1 if isinstance(part, int) else '?'} of {count} of a split GGUF "
                         "(llama.cpp's gguf-split); merge the parts into one file first: llama-gguf-split --merge "
                         "FIRST-PART.gguf MERGED.gguf, then load MERGED.gguf")


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
        if is_real(v) and (kind is float or float(v).is_integer()):
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
    if rope_dim < 1 or rope_dim % 2 or rope_dim > head_dim:  # rotary dims come in pairs, within a head
        raise ValueError(f"{source}: metadata {arch}.rope.dimension_count={rope_dim} must be even and in 2.."
                         f"{head_dim} (head_dim, {arch}.attention.key_length or embedding_length / head_count); "
                         "the file's metadata is damaged: convert the model again with llama.cpp's "
                         "convert_hf_to_gguf.py, or load its Hugging Face safetensors release")
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
    if rope_dim != head_dim:  # ModelConfig.rotary_dim is int(head_dim * factor), as transformers computes it
        prf = rope_dim / head_dim
        if int(head_dim * prf) != rope_dim:  # 30 / 44 * 44 = 29.999999999999996: one ulp up gives back 30
            prf = math.nextafter(prf, 1.0)
        cfg["partial_rotary_factor"] = prf
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
            if not is_int(v) or v < 0:  # a string or array: int() named no field
                raise ValueError(f"{source}: metadata tokenizer.ggml.{key}={v!r} is not a token id (an integer >= 0); "
                                 "the file's metadata is damaged: convert the model again with llama.cpp's "
                                 "convert_hf_to_gguf.py")
            cfg[hf_key] = v
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


# at most this much float32 in memory while a conversion writes (one shard; an 8B model is 32 GB of float32, so
# building the whole state dict first took 32 GB of RAM beyond the reader's memory map)
CONVERT_SHARD_BYTES = 2 << 30


def gguf_tensor_plan(reader, cfg: dict, source: str = "gguf") -> list[tuple[str, tuple[int, ...], object, int]]:
    """(HF name, shape, reader tensor, heads) of every tensor of the file, before any is dequantized; heads > 0:
    the Q/K rows llama.cpp permuted per head (0: stored as they are). Rows that will not split into rotary pairs of
    the metadata's heads are refused here, naming the file."""
    permuted = SUPPORTED_GGUF_ARCHS[_field(reader, "general.architecture")][1]
    plan = []
    for t in reader.tensors:
        name = hf_name(t.name, source)
        shape, heads = tuple(int(s) for s in reversed(t.shape)), 0  # GGUF lists shapes reversed
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            key, shown = (("head_count", cfg["num_attention_heads"]) if ".q_proj." in name
                          else ("head_count_kv", cfg["num_key_value_heads"]))
            n = shown or cfg["num_attention_heads"]  # head_count_kv 0: not set, one kv head per head (ModelConfig)
            # else a bare reshape error, before _check_tensors could name the file; an odd head_dim is fine when
            # its rotary rows are even (key_length 5, rope.dimension_count 4: pairs 0-1 and 2-3, row 4 kept)
            if not n or shape[0] % n or _rotary_rows(shape[0] // n, cfg) % 2:
                raise ValueError(f"{source}: tensor {t.name!r} has {shape[0]} rows, which do not split into "
                                 f"rotary pairs of metadata llama.attention.{key}={shown} heads; the file's metadata "
                                 "is damaged: convert the model again with llama.cpp's convert_hf_to_gguf.py")
            heads = n
        plan.append((name, shape, t, heads))
    return plan


def gguf_tensor(t, shape: tuple[int, ...], heads: int, cfg: dict, source: str = "gguf") -> torch.Tensor:
    """One planned tensor (gguf_tensor_plan), dequantized to float32, its rows un-permuted (each of ``heads``
    heads' first n_rot rows: those llama.cpp rotates) when heads > 0."""
    arr = _dequantize(t, source)  # (rows, cols) float32
    w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)  # a copy: F32 data is a read-only mmap
    if heads:
        w = unpermute_qk(w, heads, _rotary_rows(w.shape[0] // heads, cfg))
    return w.contiguous()


def _rotary_rows(rows_per_head: int, cfg: dict) -> int:
    """How many of each head's rows llama.cpp interleaved: rope.dimension_count (int(head_dim * factor), as
    ModelConfig reads it) when a head has head_dim rows; else all of them (a shape _check_tensors then names,
    permuted whole so the swap cannot fail first)."""
    head_dim = cfg["head_dim"]
    if rows_per_head != head_dim:
        return rows_per_head
    return int(head_dim * cfg.get("partial_rotary_factor", 1.0))


def _check_tensors(sd: dict[str, tuple[int, ...]], cfg: ModelConfig, source: str) -> None:
    """ValueError naming the GGUF file when its tensors (name -> shape) are not those its metadata implies."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg).state_dict().items()}
    missing, unexpected = expected_names(cfg) - set(sd), set(sd) - set(shapes)
    wrong = [f"{k} {tuple(v)} (expected {shapes[k]})" for k, v in sd.items()
             if k in shapes and tuple(v) != shapes[k]]
    if missing or unexpected or wrong:
        problems = [f"{what}: {', '.join(sorted(names)[:4])}{f' ({len(names)} in all)' if len(names) > 4 else ''}"
                    for what, names in (("missing tensors", missing), ("tensors beyond them", unexpected),
                                        ("tensors of other shapes", wrong)) if names]
        raise ValueError(f"{source}: the tensors do not match the file's metadata ({cfg.model_type}, "
                         f"{counted(cfg.num_hidden_layers, 'layer')}, hidden {cfg.hidden_size}); {'; '.join(problems)} "
                         "(HF names); the file is damaged or was written by a converter we do not know: convert the "
                         "model again with llama.cpp's convert_hf_to_gguf.py, or load its safetensors release")


def open_gguf(gguf_path: Path, source: str | None = None):
    """``gguf.GGUFReader`` of the file, or a ValueError naming it (as ``source``, default the path) and the fix (a
    damaged file, a tensor type the installed gguf package does not know)."""
    import gguf

    source = str(gguf_path) if source is None else source
    try:
        return gguf.GGUFReader(gguf_path)
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


# GGUF metadata value types (gguf-py's GGUFValueType) -> struct format; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_keys(gguf_path: Path, keys: set[str]) -> dict:
    """The metadata values of ``keys`` that the file holds (a string as str, a number, an array as a list), read
    from its key/value section alone. gguf.GGUFReader parses every field and tensor first: 3.5 s for SmolLM2's
    (its 49,152 tokens and merges) on a busy 2-core CPU, where this reads the keys in under 0.2 s (it skips the
    values of other keys). Byte order and versions as gguf-py takes them (2 and 3); a file it cannot read is a
    ValueError naming it, as ``open_gguf``'s."""
    import struct

    def broken(why: str) -> ValueError:
        return ValueError(f"{gguf_path}: not a readable GGUF file ({why}); the file is truncated or corrupt, copy "
                          "it again")

    with open(gguf_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def take(n: int) -> bytes:
            # a damaged length field (2^62) made f.read allocate that much first: a bare MemoryError
            if n > size - f.tell():
                raise broken(f"it ends at byte {size}, inside its metadata")
            return f.read(n)

        if take(4) != b"GGUF":
            raise broken("it does not start with GGUF's magic bytes")
        raw = take(4)
        order = "<" if struct.unpack("<I", raw)[0] & 0xFFFF else ">"  # gguf-py's rule: a swapped version is 0 below
        version = struct.unpack(order + "I", raw)[0]
        if version not in (2, 3):
            raise broken(f"GGUF version {version}; the gguf package reads versions 2 and 3")

        def unpack(fmt: str):
            return struct.unpack(order + fmt, take(struct.calcsize(fmt)))[0]

        def value(kind: int, keep: bool):
            if kind in _GGUF_SCALARS:
                if keep:
                    return unpack(_GGUF_SCALARS[kind])
                return f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            if kind == 8:
                n = unpack("Q")
                return take(n).decode("utf-8", "replace") if keep else f.seek(n, 1)
            if kind == 9:
                item, n = unpack("I"), unpack("Q")
                if not keep and item in _GGUF_SCALARS:  # numbers skipped at once, strings one by one
                    return f.seek(n * struct.calcsize(_GGUF_SCALARS[item]), 1)
                return [value(item, keep) for _ in range(n)]
            raise broken(f"metadata value type {kind} at byte {f.tell() - 4}")

        _, kv_count = unpack("Q"), unpack("Q")
        found = {}
        for _ in range(kv_count):
            key = value(8, True)
            found_value = value(unpack("I"), key in keys)
            if key in keys:
                found[key] = found_value
                if len(found) == len(keys):
                    break
    return found


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, replace: bool = True,
                 cache_entry: dict | None = None, weights: bool = True, tokenizer_from: Path | None = None,
                 reader=None) -> Path:
    """Write the HF directory of a GGUF file to ``out_dir`` atomically.

    An existing ``out_dir`` is replaced only when it holds nothing but a model's files (as save_model's): any other
    entry, the .gguf itself included, is a FileExistsError naming it, raised before anything is written.
    replace=False raises FileExistsError when ``out_dir`` appeared meanwhile (another process won).
    cache_entry: the conversion cache's record of the entry, written as ``gguf_cache_entry.json``.
    weights=False: all but the weights (config.json, the tokenizer files or TOKENIZER_ERROR), after the same checks
    of the file, tensors' names and shapes included: what ``models.loading.tokenizer_and_config`` reads before the
    weights on a GGUF's first use (the tensors are 3.5 s of SmolLM2-135M's 10 s conversion on two CPU cores, minutes
    at 8B). Such a directory is no model: it is never a cache entry (with cache_entry: a ValueError).
    tokenizer_from: a weightless conversion of the same file, unchanged since (``cached_gguf_dir`` checks its
    identity): its tokenizer files (or TOKENIZER_ERROR) are copied instead of converting the tokenizer again, once
    its config.json is checked to be the one written here.
    reader: the file's ``open_gguf`` reader when the caller has one of the unchanged file (parsing SmolLM2-135M's
    takes 2.0 s on two CPU cores: the weightless conversion's reader, kept for this one).
    A change to what it writes bumps ``gguf_cache.CONVERTER_VERSION`` (the cache's entries of it go stale).
    """
    if not weights and cache_entry is not None:
        raise ValueError("convert_gguf: weights=False writes no model, so it cannot be a cache entry (cache_entry)")
    gguf_path, source = Path(gguf_path), str(gguf_path)
    reader = reader if reader is not None else open_gguf(gguf_path, source)
    refuse_foreign_layout(reader, source)
    cfg_dict = gguf_config(reader, source)
    cfg = ModelConfig.from_hf_dict(cfg_dict, source=source)
    plan = gguf_tensor_plan(reader, cfg_dict, source)
    if cfg.tie_word_embeddings:
        plan = [entry for entry in plan if entry[0] != "lm_head.weight"]
    # here, naming the .gguf: the cached directory's error would name the cache
    _check_tensors({name: shape for name, shape, _, _ in plan}, cfg, source)
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    # an existing out_dir is replaced only when it holds nothing but what a conversion writes (it was emptied, the
    # .gguf itself too when it lay there): refuse_foreign_files, checked before anything is written
    owned = MODEL_DIR_FILES + (CACHE_ENTRY, TOKENIZER_ERROR) if replace else None
    with atomic_dir(out_dir, replace=replace, owned=owned) as tmp:
        if weights:
            write_tensors_lazily([(name, 4 * math.prod(shape),
                                   lambda a=(t, shape, heads): gguf_tensor(*a, cfg_dict, source))
                                  for name, shape, t, heads in plan], tmp, CONVERT_SHARD_BYTES)
        hf = cfg.to_hf_dict()
        hf["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if cache_entry is not None:
            (tmp / CACHE_ENTRY).write_text(json.dumps(cache_entry, indent=2, sort_keys=True) + "\n")
        if tokenizer_from is not None:
            _copy_tokenizer_files(Path(tokenizer_from), tmp, source)
        elif has_tokenizer:  # transformers' GGUF tokenizer conversion, set to the metadata (gguf_tokenizer)
            tok, why = convert_tokenizer(gguf_path, reader)
            if tok is None:  # the weights still load
                (tmp / TOKENIZER_ERROR).write_text(tokenizer_error_json(why))
            else:
                save_tokenizer(tok, tmp, Path(out_dir))
    return Path(out_dir)


def _copy_tokenizer_files(made: Path, tmp: Path, source: str) -> None:
    """Copy into ``tmp`` all but config.json of ``made``, a weightless conversion of ``source``, once its config.json
    is checked to equal the one written in ``tmp``."""
    if (made / "config.json").read_bytes() != (tmp / "config.json").read_bytes():
        raise ValueError(f"{made}: its config.json is not the one {source} converts to, so its tokenizer files are "
                         "not that file's (convert_gguf's tokenizer_from); pass none, and the tokenizer is converted")
    for f in made.iterdir():
        if f.name != "config.json":
            (shutil.copytree if f.is_dir() else shutil.copyfile)(f, tmp / f.name)


# this process's weightless conversions (weightless_gguf_dir): resolved path -> (the file's source_record when it
# was made, the temporary directory whose "model" holds it, the file's gguf.GGUFReader: a memory map, no copy)
_WEIGHTLESS: dict[str, tuple[dict, Path, object]] = {}


def weightless_gguf_dir(gguf_path: str | Path) -> Path:
    """``convert_gguf(..., weights=False)`` of a GGUF file in a temporary directory, for reading its config and
    tokenizer before the weights (``models.loading.tokenizer_and_config``); made once while the file is unchanged.

    Kept for the file's full conversion in this process (``cached_gguf_dir``), which copies its tokenizer files if
    the file's identity (path, size, mtime, inode, ctime: the cache's key) is the same, instead of converting the
    tokenizer again (transformers' converter parses the 49,152 tokens and merges again: 3.2 s of SmolLM2-135M's),
    and takes the file's parsed reader with them (its parse is 2.0 s): that first load_model, two CPU cores, 2.0-2.5 s
    instead of 7.5 s. Removed once the file's cached conversion is asked for, or at exit. Its temporary directory is
    tempfile's (the user's $TMPDIR): a tokenizer's few MB."""
    p = Path(gguf_path).resolve()
    record = source_record(p, p.stat())  # before the file is read: a change meanwhile changes its ctime
    made = _WEIGHTLESS.get(str(p))
    if made is not None and made[0] == record:
        return made[1] / "model"
    _drop_weightless(str(p))
    reader = open_gguf(Path(gguf_path), str(gguf_path))
    tmp = Path(tempfile.mkdtemp(prefix="chronicals-gguf-"))
    try:  # "model", not the file's stem: 255 bytes with atomic_dir's suffix
        convert_gguf(gguf_path, tmp / "model", weights=False, reader=reader)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _WEIGHTLESS[str(p)] = (record, tmp, reader)
    return tmp / "model"


def _drop_weightless(source: str) -> None:
    made = _WEIGHTLESS.pop(source, None)
    if made is not None:
        remove_tree(made[1], f"a weightless conversion of {source}", log)


@atexit.register
def _drop_all_weightless() -> None:
    for source in list(_WEIGHTLESS):
        _drop_weightless(source)


os.register_at_fork(after_in_child=_WEIGHTLESS.clear)  # a forked worker's exit leaves its parent's to it


def cached_gguf_dir(gguf_path: str | Path) -> Path:
    """The converted HF directory of a GGUF file, converting it on first use (and then removing the file's older
    conversions, ``gguf_cache.prune_older_entries``). A weightless conversion of the file made by this process
    (``weightless_gguf_dir``) lends its tokenizer files and parsed reader when the file is unchanged since, and is
    removed."""
    def convert(path, out, *, cache_entry: dict, **kw) -> Path:
        made = _WEIGHTLESS.get(cache_entry["source"])
        if made is None or made[0] != cache_entry:  # the key of the entry being made: the same file
            return convert_gguf(path, out, cache_entry=cache_entry, **kw)
        return convert_gguf(path, out, cache_entry=cache_entry, tokenizer_from=made[1] / "model", reader=made[2], **kw)

    try:
        return cached_conversion(gguf_path, convert, convert_tokenizer)
    finally:
        _drop_weightless(str(Path(gguf_path).resolve()))
