"""Hugging Face directories in and out: ``config.json`` + ``model.safetensors`` (or shards + index).

Our parameter names are HF's, so reading is: build an empty ``CausalLM`` from ``config.json`` (on the
meta device, no random init), check the file's tensor names against the model's, then copy tensor by
tensor (one tensor in host memory at a time, cast to the requested dtype on the way).

Writing goes to a temporary sibling directory that is renamed into place only when complete
(``atomic_dir``), so a crash never leaves a half-written model where a reader would find it. The writer holds a
lock on the temporary directory, so the next write of the same target removes one a killed writer left behind,
and puts back an output that a killed replacing write had moved aside (``orphans``).
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .._jsonio import fitting_name, json_kind, read_json_object
from .._numbers import is_int
from .config import ModelConfig, absent_defaults_note, rope_inv_freq
from .decoder import CausalLM
from .orphans import old_path, publish_lock, recover_replaced, remove_orphans, writer_lock

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tensors some HF checkpoints carry that are recomputed, not learned
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# what a model directory written by save_model (tokenizer files included) may hold: replacing such a directory
# loses nothing that is not written again
# a trailing "/" names a folder, matched by its exact name: transformers 5's tokenizer.save_pretrained writes
# additional_chat_templates/ for a tokenizer with named chat templates (default + tool_use)
# the tokenizer's files by name, not "tokenizer*": that pattern also owned (and deleted) a user's tokenizer_notes.txt
MODEL_DIR_FILES = ("config.json", "generation_config.json", SINGLE_FILE, INDEX_FILE, "model-*-of-*.safetensors",
                   "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.model.v[0-9]*",
                   "tekken.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json",
                   "merges.txt", "additional_chat_templates/")


def foreign_entries(out: Path, owned: tuple[str, ...]) -> list[str]:
    """The entries of the directory ``out`` that match none of the ``owned`` patterns, sorted (folders shown with a
    trailing "/"). The patterns name files, and a folder is foreign unless a pattern names it exactly with a trailing
    "/" (a user's ``tokenizer_backup/`` matched ``tokenizer*`` and was deleted with its contents)."""
    folders = {pat[:-1] for pat in owned if pat.endswith("/")}
    files = [pat for pat in owned if not pat.endswith("/")]

    def foreign_entry(p: Path) -> str | None:  # its name as shown, or None when the save owns it
        if p.is_dir() and not p.is_symlink():  # a link to a folder is removed as a link, not followed
            return None if p.name in folders else p.name + "/"
        return None if any(fnmatch.fnmatch(p.name, pat) for pat in files) else p.name

    return sorted(name for name in map(foreign_entry, out.iterdir()) if name is not None)


def same_files(out: Path, files: dict[str, bytes]) -> tuple[str, ...]:
    """The names of ``files`` (name -> bytes a save writes beside the model) whose entry in the directory ``out`` is
    a file holding those very bytes: a save that writes ``files`` owns them, as replacing them loses nothing. One
    holding other bytes (a LICENSE or README.md of the user's own, another base's) stays foreign: refused, not
    overwritten. As exact names for ``foreign_entries``' patterns (glob characters escaped)."""
    same = []
    for name, data in files.items():
        p = out / name
        try:
            if p.is_file() and p.stat().st_size == len(data) and p.read_bytes() == data:
                same.append(glob.escape(name))
        except OSError:  # unreadable: not known to be the same, so foreign (the refusal names it)
            continue
    return tuple(same)


def refuse_foreign_files(out: Path, owned: tuple[str, ...]) -> None:
    """FileExistsError when the existing directory ``out`` holds entries that are not ``owned`` (``foreign_entries``).

    An output directory is replaced as a whole, so anything else in it (notes, a git clone, another model's
    files) would be deleted: refuse before writing anything."""
    if not out.is_dir():
        return
    foreign = foreign_entries(out, owned)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(f"{out} exists and holds files this save would delete ({shown}): the directory is "
                              "replaced as a whole; choose another output directory, or move those files away")


# ---------------------------------------------------------------- atomic writes
# ".tmp-<pid up to 7 digits>-<8 hex>.lock" and the dot in front: what a temporary directory's lock file adds to a name
_TEMP_ROOM = 1 + len(".tmp-4194304-01234567.lock")


TEMP_SUFFIX = r"\.tmp-\d+-[0-9a-f]{8}"  # after ".{name}": atomic_dir's temporary directory's name, as a regex


def _temp_pattern(name: str) -> re.Pattern:
    """``atomic_dir``'s temporary directories for target ``name``: ``.{stem}.tmp-{pid}-{8 hex digits}``, the stem
    ``name`` shortened by ``fitting_name`` where its lock file's name would pass NAME_MAX."""
    return re.compile(rf"\.{re.escape(fitting_name(name, _TEMP_ROOM))}{TEMP_SUFFIX}")


def output_path(out_dir: str | Path) -> Path:
    """The directory a write of ``out_dir`` replaces: absolute, with ``..`` resolved, through a symlink.

    The renames need it: ``adapter/../adapter`` stops resolving once ``adapter`` is moved aside (the old output was
    left under the temporary name and the new one never published), and a symlink was itself renamed aside and
    replaced by a directory, leaving the link as a stray ``.old`` and its target unwritten."""
    return Path(out_dir).expanduser().resolve()


def refuse_blank(out_dir: str | Path) -> None:
    """ValueError for an empty or blank output path ("" is Path("."), the working directory; "  " a folder named
    by spaces), checked before the path is resolved."""
    if not str(out_dir).strip():
        raise ValueError(f"the output path is empty or blank ({str(out_dir)!r}); name the directory to write")


def check_output_dir(out_dir: str | Path, owned: tuple[str, ...] | None = None,
                     written: dict[str, bytes] | None = None) -> None:
    """The checks ``atomic_dir`` makes before writing, for callers that want them before a long load (export):
    ``out_dir`` is no file, nor under one, and holds nothing but ``owned`` entries (None: not checked), and entries
    of ``written`` (name -> bytes of further files the save writes) that hold those bytes (``same_files``)."""
    refuse_blank(out_dir)
    out = output_path(out_dir)
    if out == Path.cwd() or out in Path.cwd().parents:  # replacing it renames the process's own directory away
        raise ValueError(f"{out_dir} is the working directory{'' if out == Path.cwd() else ' or holds it'}; a "
                         "write replaces the whole directory: choose a new directory (e.g. ./out)")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another output path")
    parent = next((p for p in out.parents if p.exists()), None)  # the nearest existing ancestor
    if parent is not None and not parent.is_dir():  # mkdir would say only "[Errno 17] File exists"
        raise NotADirectoryError(f"{parent} is a file, not a directory, so {out} cannot be created under it; "
                                 "choose another output path")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):  # found before a long load, not after it
        raise PermissionError(f"{parent} cannot be written by this user, so {out} cannot be created there; choose "
                              "another output path")
    if owned is not None:
        refuse_foreign_files(out, owned + same_files(out, written or {}))


@contextmanager
def atomic_dir(out_dir: str | Path, *, replace: bool = True, owned: tuple[str, ...] | None = None,
               written: dict[str, bytes] | None = None):
    """Yield an empty temporary directory beside ``out_dir``; on success rename it to ``out_dir``.

    On any error the temporary directory is removed and ``out_dir`` is left as it was. An existing
    ``out_dir`` is replaced (two renames: a reader in between sees no directory, never a partial one),
    or with replace=False a FileExistsError is raised. ``owned``: the file-name patterns the replaced
    directory may hold (``refuse_foreign_files``, checked before anything is written); ``written``: name -> bytes
    of the files the caller writes besides those (an export's license files): an entry of such a name is replaced
    only when it holds those very bytes (``same_files``). The temporary
    directory is ``.{name}.tmp-{pid}-{random}`` (``name`` shortened by ``fitting_name`` near NAME_MAX), locked
    while it is written: those of earlier writers of ``out_dir`` that were killed mid-write (their own cleanup
    never ran) are removed first (``orphans``).
    The replaced ``out_dir`` is moved aside to ``<temp dir>.old`` under the same lock. A writer killed between
    the two renames leaves no ``out_dir`` until the next call, which first renames it back (a write that did
    not finish leaves ``out_dir`` as it was); one killed after them leaves a stale copy, which the next removes.
    """
    refuse_blank(out_dir)  # output_path resolves "  " to a folder of that name: checked on the path as given
    out = output_path(out_dir)
    recover_replaced(out, _temp_pattern(out.name))  # first: the checks below must see a restored out_dir
    check_output_dir(out, owned if replace else None, written)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(out.parent, _temp_pattern(out.name))  # a killed earlier write's, before this one needs the space
    tmp = out.parent / f".{fitting_name(out.name, _TEMP_ROOM)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with writer_lock(tmp):
        yield from _write_then_publish(tmp, out, replace)


def _write_then_publish(tmp: Path, out: Path, replace: bool):
    """atomic_dir's body, under the temporary directory's lock."""
    try:  # from the mkdir on: a Ctrl-C right after it left the empty directory (a walk)
        tmp.mkdir()
        os.chmod(tmp, 0o755)  # a saved model should be readable like any directory, whatever the umask
        try:
            yield tmp
        except OSError as e:  # "could not write <tmp>/x.safetensors": the user sees no <tmp>, it is removed below
            if str(tmp) not in str(e):
                raise
            raise OSError(str(e).replace(str(tmp), str(out))) from e
        for f in tmp.rglob("*"):  # some writers create 0600 files; a model directory is world-readable
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        with publish_lock(out.parent):
            _publish(tmp, out, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path, replace: bool) -> None:
    """Rename the written ``tmp`` to ``out`` (moving a previous ``out`` aside first), under the parent's lock."""
    if out.exists():
        if not replace:
            raise FileExistsError(f"{out} already exists")
        old = old_path(tmp)  # under tmp's lock: a killed writer's is told from a live one's (recover_replaced)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:  # put the previous output back rather than leave none under its name
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(tmp, out)
        except OSError as e:  # ENOTEMPTY/EEXIST: a writer that takes no lock created it after our check
            raise FileExistsError(f"{out} appeared while writing it ({e})") from e


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, its I/O failures (a full disk: "Error while serializing: I/O error: No space left on
    device") raised as an OSError naming the file, which the CLI reports as one error line (exit 3), not as an
    internal error with a traceback (exit 4). The caller's temporary directory is removed by atomic_dir."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        raise OSError(f"could not write {path} ({e}); is its disk full? free space and run again") from e


def write_state_dict(sd: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None = None) -> None:
    """Write ``model.safetensors``, or HF-style shards ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``."""
    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    write_tensors_lazily([(k, v.numel() * v.element_size(), lambda v=v: v) for k, v in sd.items()],
                         out_dir, max_shard_bytes)


def write_tensors_lazily(entries: list[tuple[str, int, Callable[[], torch.Tensor]]], out_dir: Path,
                         max_shard_bytes: int | None = None) -> None:
    """write_state_dict's files from (name, bytes, make) entries: each shard's tensors are made (``make()``, a
    contiguous CPU tensor of that many bytes) only while that shard is written, so at most one shard is in memory
    (a GGUF conversion of an 8B model: ~2 GiB instead of its 32 GB of float32)."""
    total = sum(nbytes for _, nbytes, _ in entries)
    if max_shard_bytes is None or total <= max_shard_bytes:
        shards = [entries]
    else:
        shards, size = [[]], 0
        for entry in entries:  # greedy in state-dict order, like transformers' own sharding
            if shards[-1] and size + entry[1] > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += entry[1]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, nbytes, make in shard:
            tensors[key] = make()
            made = tensors[key].numel() * tensors[key].element_size()
            if made != nbytes:  # the plan's sizes name the shards before any is written
                raise AssertionError(f"tensor {key}: {made} bytes made, {nbytes} planned")
        save_safetensors(tensors, out_dir / name)
        del tensors
        weight_map.update({key: name for key, _, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------- reading
def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory: the single file, or every shard its index names."""
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    for name in (SINGLE_FILE, INDEX_FILE):
        if (model_dir / name).exists() and not (model_dir / name).is_file():
            raise ValueError(f"{model_dir / name}: is a directory, not a file; copy the checkpoint again")
    index = model_dir / INDEX_FILE
    if index.is_file():
        obj = read_json_object(index, "safetensors index", "copy the checkpoint again")
        weight_map = obj.get("weight_map")
        bad = None if isinstance(weight_map, dict) else \
            f"'weight_map' is a JSON {json_kind(weight_map)}" if "weight_map" in obj else "no 'weight_map'"
        for tensor, shard in (weight_map.items() if bad is None else ()):
            if not isinstance(shard, str) or not shard or Path(shard).name != shard:  # ../x, /etc/x: not a shard
                bad = f"tensor {tensor!r} is mapped to {shard!r}, not to a file name in {model_dir}"
                break
        if bad:
            raise ValueError(f"{index}: not a valid safetensors index ({bad}; expected \"weight_map\": "
                             "{tensor name: shard file name}); copy the checkpoint again")
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that are missing: {', '.join(missing[:5])}; "
                                    "copy the complete checkpoint")
        return files
    present = sorted(p.name for p in model_dir.iterdir())[:10]
    raise FileNotFoundError(
        f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (found: {', '.join(present) or 'nothing'}); "
        "chronicals reads safetensors checkpoints only (convert pytorch_model.bin files with "
        "transformers' save_pretrained(..., safe_serialization=True))")


def _unreadable(path: Path, e: Exception) -> ValueError:
    return ValueError(f"{path}: cannot read this safetensors file ({e}); it is truncated or corrupt "
                      "(an interrupted download or copy?): copy or download it again")


@contextmanager
def _open(path: Path):
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            yield fh
    except SafetensorError as e:
        raise _unreadable(path, e) from None


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The tensor names of one safetensors file and their shapes, read from its header alone (no tensor is read); a
    truncated or corrupt file is a ValueError naming it, as ``load_safetensors`` says."""
    with _open(Path(path)) as fh:
        return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file on the CPU; a truncated or corrupt file is a ValueError naming it."""
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise _unreadable(Path(path), e) from None


def _list(items, n=5) -> str:
    items = sorted(items)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device, impl: str = "auto") -> CausalLM:
    """A CausalLM with uninitialized weights on ``device`` (built on meta: no time spent on random init)."""
    with torch.device("meta"):
        model = CausalLM(cfg, impl=impl)
    # cast on meta, then allocate: allocating fp32 first and casting made an fp32 copy first (SmolLM2-135M in bf16:
    # empty_model raised peak RSS by 384 MB, now 75 MB; the whole load still peaks ~590 MB over its 257 MB of weights,
    # the safetensors file's mapped pages counted in RSS while the tensors are copied out)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes new tensors per module; tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    inv_freq, _ = rope_inv_freq(cfg)  # non-persistent buffer: recompute, in fp32 whatever the weights' dtype
    model.model.inv_freq = inv_freq.to(device)
    return model


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} a checkpoint of ``cfg`` holds (lm_head.weight optional when tied); built on meta."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def expected_names(cfg: ModelConfig) -> set[str]:
    """Tensor names a checkpoint of ``cfg`` holds (lm_head.weight optional when tied)."""
    return set(expected_shapes(cfg))


def _absent_note(model_dir: Path) -> str:
    """A shape error's hint when config.json lacked a key that took transformers' family default."""
    return absent_defaults_note(read_json_object(model_dir / "config.json", "config.json", "copy it again"))


def _checked_header(fh, f: Path, name: str, want: tuple[int, ...] | None, model_dir: Path) -> str:
    """Tensor ``name``'s safetensors dtype string, after checking from ``f``'s header (before any allocation) that it
    is a float tensor and of shape ``want`` (None: not checked)."""
    st_dtype = fh.get_slice(name).get_dtype()
    # an int/bool tensor was cast into the weights silently; FP8 (F8_E4M3, F8_E5M2) needs its scales
    if not st_dtype.startswith(("F", "BF")) or st_dtype.startswith("F8"):
        raise ValueError(f"{f}: tensor {name} is stored as {st_dtype}, not as F32, F16 or BF16; chronicals "
                         "reads float checkpoints (F32, F16, BF16): a quantized one (GPTQ, AWQ, "
                         "bitsandbytes, FP8) must be dequantized first, or load its unquantized release")
    # config.json's vocab_size 10**9 over a real checkpoint allocated a 256 GB model (or failed to) before this message
    shape = tuple(fh.get_slice(name).get_shape())
    if want is not None and shape != want:
        raise ValueError(f"{f}: tensor {name} has shape {shape} but config.json implies {want}; "
                         f"config.json and the weights disagree{_absent_note(model_dir)}")
    return st_dtype


def _other_heads(model_dir: Path) -> list[str]:
    """config.json's architectures when one of them is not a causal LM (LlamaForSequenceClassification, ...), else []."""
    archs = read_json_object(model_dir / "config.json", "config.json", "copy it again").get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        return []
    return archs if any(not a.endswith("ForCausalLM") for a in archs) else []


def load_hf_dir(model_dir: str | Path, *, dtype: torch.dtype | None = None, device=None,
                impl: str = "auto") -> CausalLM:
    """An HF directory -> our CausalLM in eval mode. dtype None keeps the checkpoint's (the embedding's)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_json(model_dir / "config.json")
    files = checkpoint_files(model_dir)
    shapes = expected_shapes(cfg)
    want = set(shapes)
    where: dict[str, Path] = {}
    file_dtype = None
    tied_head = None  # the file holding lm_head.weight although config.json ties it to the embedding
    for f in files:
        with _open(f) as fh:
            for name in fh.keys():
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    tied_head = f
                    continue
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name in where:  # which copy to take is a guess: the last one read was taken
                    raise ValueError(f"{model_dir}: tensor {name} is stored twice, in {where[name].name} and "
                                     f"{f.name}; remove the stale shard (its index names the right one)")
                where[name] = f
                st_dtype = _checked_header(fh, f, name, shapes.get(name), model_dir)
                if name == "model.embed_tokens.weight":
                    file_dtype = _ST_DTYPES.get(st_dtype)
    source = {}  # parameter -> tensor name in the file, where they differ
    if tied_head is not None and "model.embed_tokens.weight" not in where:
        # tied, stored as the head only: transformers ties the embedding to it, so do we (the same header checks:
        # an I8 or FP8 head alone was cast into the float embedding without a word)
        where["model.embed_tokens.weight"], source["model.embed_tokens.weight"] = tied_head, "lm_head.weight"
        with _open(tied_head) as fh:
            st_dtype = _checked_header(fh, tied_head, "lm_head.weight", shapes["model.embed_tokens.weight"],
                                       model_dir)
            file_dtype = _ST_DTYPES.get(st_dtype)
    missing, unexpected = want - set(where), set(where) - want
    if missing or unexpected:
        msg = f"{model_dir}: the checkpoint does not match config.json ({cfg.model_type}, " \
              f"{cfg.num_hidden_layers} layers, tie_word_embeddings={cfg.tie_word_embeddings})"
        if missing:
            msg += f"; missing tensors: {_list(missing)}"
        if unexpected:
            msg += f"; unexpected tensors: {_list(unexpected)}"
        heads = _other_heads(model_dir)
        if heads:  # a classifier's "score" head: the tie hint below would point the wrong way (a user walk)
            msg += (f"; config.json names architectures={heads}: a model with another head than a causal language "
                    "model's (...ForCausalLM), which chronicals trains and loads")
        elif missing == {"lm_head.weight"}:
            msg += ("; a model whose output head is its embedding needs tie_word_embeddings: true in config.json "
                    "(transformers would start a random head instead)")
        raise ValueError(msg + ". Names must be Hugging Face's (model.layers.N.self_attn.q_proj.weight, ...); "
                               "a LoRA adapter directory is loaded with chronicals.lora, not load_model")
    dtype = dtype or file_dtype or torch.float32
    model = empty_model(cfg, dtype, torch.device("cpu" if device is None else device), impl)
    params = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name, f in where.items():
        by_file.setdefault(f, []).append(name)
    with torch.no_grad():
        for f, names in by_file.items():
            with _open(f) as fh:
                for name in names:
                    try:
                        t = fh.get_tensor(source.get(name, name))
                    except SafetensorError as e:
                        raise ValueError(f"{f}: tensor {name} cannot be read ({e}); the file is corrupt: "
                                         "copy or download it again") from None
                    if t.shape != params[name].shape:
                        raise ValueError(f"{f}: tensor {name} has shape {tuple(t.shape)} but config.json implies "
                                         f"{tuple(params[name].shape)}; config.json and the weights disagree"
                                         f"{_absent_note(model_dir)}")
                    params[name].copy_(t)
    if tied_head is not None and not source:
        _check_tied_head(model, tied_head, model_dir)
    gen = model_dir / GENERATION_CONFIG
    if gen.is_file():  # kept as bytes, written back unchanged by save_hf_dir
        model.source_generation_config = gen.read_bytes()
    return model.eval()


def _check_tied_head(model: CausalLM, f: Path, model_dir: Path) -> None:
    """config.json ties lm_head to the embedding, yet ``f`` stores an lm_head.weight too: a copy of the embedding is
    fine (.bin conversions store both); a different one is a head we would drop, and transformers 5 then unties the
    two (4.x ties them), so which model this is depends on the version: refuse."""
    with _open(f) as fh:
        head = fh.get_tensor("lm_head.weight")
    emb = model.model.embed_tokens.weight
    if head.shape != emb.shape or not torch.equal(head.to(emb.dtype), emb.to("cpu")):
        raise ValueError(
            f"{model_dir}: config.json sets tie_word_embeddings=true (lm_head is the embedding), but {f.name} stores "
            "an lm_head.weight that differs from model.embed_tokens.weight; transformers 5 then keeps the two apart "
            "(4.x ties them and drops the stored head). If the stored lm_head is the trained head, set "
            "tie_word_embeddings to false in config.json; if the embedding is, remove lm_head.weight from the file")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in TOKENIZER_FILES)


def no_hf_dir(cfg) -> str | None:
    """Why a model of config ``cfg`` has no Hugging Face directory (``save_hf_dir`` refuses it), or None."""
    if cfg.partial_rotary_factor != 1:  # a GGUF whose rope.dimension_count < head_dim
        return (f"rotates {cfg.rotary_dim} of its head_dim={cfg.head_dim} dims (partial_rotary_factor="
                f"{cfg.partial_rotary_factor}), which transformers' {cfg.model_type} code cannot express (it rotates "
                "all of them)")
    return None


UNTIED_HEAD = "config.tie_word_embeddings is true, but lm_head.weight is another tensor than the embedding"
UNTIED_HEAD_FIX = ("set model.config.tie_word_embeddings = False to save both, or tie them again "
                   "(model.lm_head.weight = model.model.embed_tokens.weight)")


def head_untied_in_code(model: CausalLM) -> bool:
    """A tied config whose lm_head was made its own tensor in code: save_hf_dir refuses it once the values differ."""
    return bool(model.config.tie_word_embeddings) and model.lm_head.weight is not model.model.embed_tokens.weight


def save_hf_dir(model: CausalLM, tokenizer, out_dir: str | Path, *, generation_config: dict | None = None,
                max_shard_bytes: int | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write ``model`` (+ tokenizer files when ``tokenizer`` is not None) as an HF directory, atomically.

    The tied ``lm_head.weight`` is not written (HF re-ties it from the embedding on load). generation_config.json:
    the ``generation_config`` dict when given, else the source directory's file as loaded
    (``model.source_generation_config``), else none. ``extra_files``: name -> bytes of more files written in the
    same write (an export's license files, ``license_files``); a name a model directory's own file has is refused.
    """
    for name in extra_files or {}:
        if not name or name in (".", "..") or "/" in name or os.sep in name or \
                any(fnmatch.fnmatch(name, pat) for pat in MODEL_DIR_FILES if not pat.endswith("/")):
            raise ValueError(f"save_model: extra_files names {name!r}, which is not a plain file name or is one "
                             "of the model directory's own files (config.json, weights, tokenizer files); rename it")
    if max_shard_bytes is not None and (not is_int(max_shard_bytes) or max_shard_bytes < 1):
        raise ValueError(f"save_model: max_shard_bytes={max_shard_bytes!r}; expected a number of bytes >= 1 (e.g. "
                         "5 * 2**30 for 5 GiB shards) or None for one file")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        # found before the weights are written (a string here wrote every shard, then failed on .save_pretrained)
        raise TypeError(f"save_model: tokenizer is a {type(tokenizer).__name__}, not a tokenizer; pass the one "
                        "load_model / load_tokenizer returned (or None to write no tokenizer files), and the output "
                        "directory as the third argument (save_model(model, tokenizer, out_dir))")
    cfg = model.config
    why = no_hf_dir(cfg)
    if why:
        raise ValueError(f"save_model: this model {why}, so a Hugging Face directory would load as a different "
                         "model; chronicals does not write one. Use the model where chronicals loads it (load_model "
                         "of its .gguf file; a LoRA adapter trained on it as it is, with chronicals chat/eval "
                         "--adapter, instead of export)")
    if head_untied_in_code(model) and not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
        # the directory holds no lm_head when tied: a head untied in code (a new Parameter) would be dropped
        raise ValueError(f"save_model: {UNTIED_HEAD}, with other values; {UNTIED_HEAD_FIX}")
    sd = model.state_dict()
    want = expected_names(cfg)
    extra = set(sd) - want - {"lm_head.weight"}
    if extra or want - set(sd):
        raise ValueError(f"save_model: the model's parameters are not a plain {cfg.model_type} decoder's "
                         f"(extra: {_list(extra) or 'none'}; missing: {_list(want - set(sd)) or 'none'}); "
                         "merge LoRA adapters into the weights first, or save the adapter with chronicals.lora")
    sd = {k: v for k, v in sd.items() if k in want}
    if "lm_head.weight" in sd and (sd["lm_head.weight"].untyped_storage().data_ptr()
                                   == sd["model.embed_tokens.weight"].untyped_storage().data_ptr()):
        # one tensor under a config that says untied (the flag set after loading a tied model): both are written,
        # as transformers writes an untied model; safetensors refuses two names for one storage
        sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    dtype = sd["model.embed_tokens.weight"].dtype
    hf = cfg.to_hf_dict()
    hf.pop("torch_dtype", None)
    hf["dtype"] = str(dtype).removeprefix("torch.")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, owned=MODEL_DIR_FILES, written=extra_files) as tmp:
        write_state_dict(sd, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            (tmp / GENERATION_CONFIG).write_text(json.dumps(generation_config, indent=2) + "\n")
        elif getattr(model, "source_generation_config", None) is not None:
            (tmp / GENERATION_CONFIG).write_bytes(model.source_generation_config)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp, out_dir)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return out_dir


def save_tokenizer(tokenizer, directory: Path, target: Path) -> None:
    """``tokenizer.save_pretrained(directory)`` for the output ``target``. The tokenizers library's Rust writer
    reports a full disk as a bare Exception ("No space left on device (os error 28)"), which got past every handler:
    exit 4 with a traceback (a GGUF walk). Such errors, and OSErrors, become an OSError naming ``target``."""
    try:
        tokenizer.save_pretrained(str(directory))
    except Exception as e:
        if isinstance(e, OSError) or "os error" in str(e).lower():
            raise OSError(f"could not write the tokenizer files of {target} ({e}); is its disk full? free space and "
                          "run again") from e
        raise
