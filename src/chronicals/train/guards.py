"""Checks a run makes before it trains, and the clean-up of a run that failed before its first step.

Each says what is wrong and the setting that fixes it; none touches files a run did not write."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from ..config import DEMO, ConfigError, TrainConfig
from ..data.readers import pyarrow_modules
from ..data.files import glob_hint
from .checkpoint import STATE_FILE

log = logging.getLogger("chronicals.train")

ARROW_SUFFIXES = (".parquet", ".arrow")  # the files data/readers.py reads through pyarrow


def remove_setup_files(out_dir: Path, existed: set[Path] | None, new_parents: list[Path] = ()) -> None:
    """A run that failed before its first step (bad data, model or config found while setting up) leaves
    out_dir as it found it: the config.yaml, empty metrics.jsonl and data/ copies it wrote are removed, and
    out_dir itself if this run created it, with the folders above it that it created (``new_parents``, deepest
    first) while they are empty. Entries that were there before are never touched."""
    import shutil

    if not out_dir.is_dir():
        return
    for entry in set(out_dir.iterdir()) - (existed or set()):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if existed is None:
        for d in (out_dir, *new_parents):
            try:
                d.rmdir()
            except OSError:  # something else wrote there meanwhile: leave it (and what holds it)
                break


def check_token_ids(model, *loaders) -> None:
    """ValueError when the tokenized data holds ids the model's embedding has no row for (a tokenizer with added
    tokens the model was not resized for): the loss head would read past its last row instead."""
    for name, loader in zip(("training", "held-out"), loaders):
        ids = getattr(getattr(loader, "dataset", None), "ids", None)
        if ids is not None and len(ids):
            check_ids_in_vocab(model, int(ids.max()), f"the {name} data holds token id")


def check_document_lengths(model, *loaders) -> None:
    """ValueError before the first step when a set's longest document is past what the model computes as
    transformers does (a sliding window, a dynamic rope's limit: ``CausalLM.check_sequence_length``). The forward
    pass checks each batch too, but that came at whichever step first drew the document, hours in, without saying
    which set held it."""
    check = getattr(model, "check_sequence_length", None)
    for name, loader in zip(("training", "held-out"), loaders):
        lengths = getattr(getattr(loader, "dataset", None), "lengths", None)
        if check is None or lengths is None or not len(lengths):
            continue
        i = int(np.argmax(lengths))
        try:
            check(int(lengths[i]))
        except ValueError as e:
            hint = (" A held-out question/answer file's documents hold data.system_prompt as their system message "
                    "(the demo's, or the template's default when none is set): a shorter one shortens them."
                    if name == "held-out" else "")
            raise ValueError(f"the {name} data's longest document (number {i + 1} of {len(lengths)}, "
                             f"{int(lengths[i])} tokens after data.on_long) does not fit this model: {e}{hint}") from None


def check_max_seq_len(cfg: TrainConfig, model_config) -> None:
    """ConfigError when data.max_seq_len is past ``model_config.max_position_embeddings`` (the model's config, read
    before the data and the weights; None or no such field: nothing to check), as chronicals eval --max-seq-len
    refuses it. It was a warning: a typo'd 100000 on a 512-token model was killed for memory on the CPU (the
    attention mask is S x S a row) with no error, and the adapter could not be scored by eval at its own length."""
    trained_len = getattr(model_config, "max_position_embeddings", None)
    if not trained_len or cfg.data.max_seq_len <= trained_len:
        return
    src = Path(str(cfg.model.path)).expanduser()
    where = (f"{src / 'config.json'}" if (src / "config.json").is_file() else
             # a .gguf file or a short name has no config.json to edit (a user walk): a written-out directory has
             f"the config.json of a Hugging Face directory written from it (chronicals export --model "
             f"{cfg.model.path} --out DIR; then model.path=DIR)")
    raise ConfigError(f"data.max_seq_len={cfg.data.max_seq_len} is more than the model can attend to "
                      f"(max_position_embeddings={trained_len}): positions past {trained_len} were never trained; "
                      f"use at most {trained_len}, or, to extend the context on purpose, raise "
                      f"max_position_embeddings (with rope_scaling where the model needs it) in {where}",
                      "data.max_seq_len")


def check_ids_in_vocab(model, top: int, what: str) -> None:
    """ValueError when token id ``top`` has no row in the model's embedding; ``what`` says where it came from
    ("the training data holds token id", "the prompt 'hi' tokenizes to id"). Host values only: no device sync."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and top >= vocab:
        raise ValueError(f"{what} {top}, but the model's vocabulary has {vocab} entries "
                         "(model.embed_tokens): the tokenizer knows tokens the model lacks (added tokens?); use "
                         "the model's own tokenizer (or, in Python, a model whose embeddings were resized)")


def where_read(path: Path) -> str:
    """" (relative paths are read from the working directory, CWD)" for a relative path, "" for an absolute one."""
    return "" if path.is_absolute() else f" (relative paths are read from the working directory, {Path.cwd()})"


def check_model_path(cfg: TrainConfig) -> None:
    """FileNotFoundError naming model.path and where a relative path was looked for, as check_data_paths does for
    the data keys (load_model alone said only the path, and cannot know the key)."""
    from ..models.loading import SHORT_NAMES

    value = cfg.model.path
    if not isinstance(value, str) or not value.strip() or value.lower() in SHORT_NAMES:
        return  # an empty path: load_model's own error; a short name: the embedded model
    path = Path(value).expanduser()
    if not path.exists():
        names = ", ".join(SHORT_NAMES)
        raise FileNotFoundError(f"model.path={value}: no such file or directory{where_read(path)}; set model.path to "
                                f"a Hugging Face model directory, a .gguf file, or a short name: {names}")


def lies_in(path, folder) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (``~`` expanded, links resolved): a data directory is read
    whole, so an output or cache there becomes data on the next run."""
    there, folder = Path(path).expanduser().resolve(), Path(folder).expanduser().resolve()
    return there == folder or folder in there.parents


def check_data_paths(cfg: TrainConfig) -> None:
    """FileNotFoundError naming the key and where a relative path was looked for, for data.path and
    data.eval_path (a missing file used to surface after the model had loaded: minutes at 8B); DataError when
    they hold .parquet / arrow (save_to_disk) files and pyarrow is not installed; ValueError / DataError when
    train.out_dir or the tokenization cache lies inside a data directory, or the cache directory is a file."""
    from ..data.cache import check_cache_root
    from .setup import tokenization_cache_dir

    cache = tokenization_cache_dir(cfg.data.cache_dir)  # None: no cache (data.cache_dir=none)
    for key, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        # "auto" is a value of data.eval_path only: data.path=auto is a path, checked (it went unchecked, the model
        # loaded, and the reader then said "auto: no such file or directory", naming no setting)
        if value in (DEMO, "") or (key == "data.eval_path" and value == "auto"):
            continue
        path = Path(value).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{key}={value}: no such file or directory{where_read(path)}{glob_hint(value)}; "
                                    f"fix {key}")
        _check_pyarrow(path)
        # directories are read recursively: the run's metrics.jsonl, data/ copies and checkpoints, or the cache's
        # meta.json, would become training records on the next run
        for setting, inside in (("train.out_dir", cfg.train.out_dir), ("data.cache_dir", cache)):
            if inside is not None and path.is_dir() and lies_in(inside, path):
                raise ConfigError(f"{setting}={inside} is inside {key}={value}, whose files are all read as data; "
                                  f"put {setting} outside {value}", setting)  # two settings that clash: exit 2
    if cache is not None:
        check_cache_root(cache)  # a file: said before the model loads, not after
    _check_heldout_apart(cfg)
    _check_heldout_copy(cfg)


def _check_heldout_apart(cfg: TrainConfig) -> None:
    """data.eval_path that is data.path or lies in its directory (read recursively) would be trained on too, and
    its held-out loss measured on trained examples; an eval_path directory that holds data.path measures trained
    examples as held-out: a ConfigError (exit 2), two settings that clash."""
    d = cfg.data
    if d.path == DEMO or d.eval_path in (DEMO, "auto", ""):
        return
    train, held = Path(d.path).expanduser().resolve(), Path(d.eval_path).expanduser().resolve()
    if held == train or (train.is_dir() and train in held.parents):
        raise ConfigError(f"data.eval_path={d.eval_path} is {'data.path' if held == train else 'inside data.path'}="
                          f"{d.path}, {'which' if held == train else 'whose files are all read as training data, so it'}"
                          " would be trained on and its held-out loss measured on trained examples; keep the "
                          "held-out data apart from data.path", "data.eval_path")
    if held.is_dir() and held in train.parents:  # the other way round: the training file is read as held-out
        raise ConfigError(f"data.eval_path={d.eval_path} is a directory that holds data.path={d.path}, and all its "
                          "files are read as held-out data, so the held-out loss would be measured on trained "
                          "examples; keep the held-out data apart from data.path", "data.eval_path")


def _check_heldout_copy(cfg: TrainConfig) -> None:
    """A QA held-out file at out_dir/data/heldout.jsonl, where the run writes its chat copy of the questions, would
    be overwritten by that copy and lose its keywords: a ConfigError (exit 2) before the model loads."""
    from .qa import read_qa

    value = cfg.data.eval_path
    if value in (DEMO, "auto", ""):
        return
    copy = Path(cfg.train.out_dir).expanduser() / "data" / "heldout.jsonl"
    if copy.is_file() and copy.resolve() == Path(value).expanduser().resolve() \
            and read_qa(value, cfg.data.on_error) is not None:  # a chat-format file is read in place, not copied
        raise ConfigError(f"data.eval_path={value} is {copy}, where this run writes its chat copy of the held-out "
                          "questions (train.out_dir/data/heldout.jsonl), which would overwrite it; keep the file "
                          "elsewhere or set another train.out_dir", "data.eval_path")


def _check_pyarrow(path: Path) -> None:
    """The reader's "needs pyarrow" DataError, before the model loads, for a .parquet / .arrow file, or the first
    one in a directory (symlinked folders are not followed here: the reader still reports those)."""
    first = path if path.suffix.lower() in ARROW_SUFFIXES else None
    if path.is_dir():
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            first = next((Path(root) / n for n in sorted(names)
                          if not n.startswith(".") and Path(n).suffix.lower() in ARROW_SUFFIXES), None)
            if first is not None:
                break
    if first is not None:
        pyarrow_modules(first)


def check_out_dir(cfg: TrainConfig) -> None:
    """ConfigError (a bad value: exit status 2) when train.out_dir, or a folder above it, is a file;
    IsADirectoryError when out_dir/config.yaml is a folder (found now, not at the run's first record)."""
    out = Path(cfg.train.out_dir).expanduser()
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"train.out_dir={cfg.train.out_dir}: {p} is a file, not a directory; set "
                              "train.out_dir to a directory path", "train.out_dir")
    model = Path(cfg.model.path).expanduser()
    if model.is_dir() and out.exists() and out.resolve() == model.resolve():
        raise ConfigError(f"train.out_dir={cfg.train.out_dir} is model.path: the run would write its checkpoints, "
                          "config.yaml, metrics and outputs into the model's own directory; set train.out_dir to "
                          "another directory", "train.out_dir")
    if (out / "config.yaml").is_dir():
        raise IsADirectoryError(f"{out / 'config.yaml'} is a directory: a run writes its config to that file; move "
                                "it away or set another train.out_dir")


def check_resume_path(cfg: TrainConfig) -> None:
    """ConfigError (exit status 2, as for a train.resume that does not exist) unless an explicit train.resume
    is a checkpoint directory (holding state.pt) or a state.pt file: found before the model loads. A run's
    out_dir given instead is answered with its newest checkpoint."""
    if cfg.train.resume == "auto":
        _check_auto_over_finished(cfg)
    if cfg.train.resume in ("auto", "none"):
        return
    from .checkpoint import latest_checkpoint

    def newest(run) -> Path | None:
        try:
            return latest_checkpoint(run)
        except OSError:  # run/checkpoints a file: check_out_dir's to say, for this run's out_dir
            return None

    path = Path(cfg.train.resume).expanduser()
    out = Path(cfg.train.out_dir).expanduser()
    fix = f"give a checkpoint directory (out_dir/checkpoints/step-N) or its {STATE_FILE}"
    if (mine := newest(out)) is not None:  # resume=auto looks in this run's out_dir only: offered where it finds one
        fix += f", or train.resume=auto (continues from {mine})"
    if path.is_dir() and not (path / STATE_FILE).is_file():
        found = newest(path) or newest(path.parent)  # a run's out_dir, or its checkpoints/
        if found is not None:
            run = found.parent.parent
            fix = f"its newest checkpoint is train.resume={found}; " + (
                "or set train.resume=auto" if run.resolve() == out.resolve() else
                f"or continue that run in its own directory with train.out_dir={run} train.resume=auto")
        raise ConfigError(f"train.resume={cfg.train.resume} holds no checkpoint (no {STATE_FILE}); {fix}",
                          "train.resume")
    if path.is_file() and path.name != STATE_FILE:  # load_checkpoint would try it and blame its directory
        raise ConfigError(f"train.resume={cfg.train.resume} is a file, not a checkpoint; {fix}", "train.resume")


def _check_auto_over_finished(cfg: TrainConfig) -> None:
    """ConfigError when train.resume=auto finds no checkpoint in out_dir but an earlier run's final adapter/ or
    model/ there: the run would start over from step 0 and, at its first record, delete them and metrics.jsonl's
    history, without a word that it started over (a checkpoint walk: the checkpoints deleted, or moved away as an
    error advised). A run stopped before its first checkpoint wrote no final directory: it starts over as before."""
    from .checkpoint import latest_checkpoint

    out = Path(cfg.train.out_dir).expanduser()
    try:
        if latest_checkpoint(out) is not None:
            return
    except OSError:  # out/checkpoints a file: check_out_dir's to say
        return
    finals = [f"{d.name}/" for d in (out / "adapter", out / "model") if d.is_dir() and not d.is_symlink()
              and any(d.iterdir())]
    if finals:
        raise ConfigError(f"train.resume=auto found no checkpoint in {out / 'checkpoints'}, but {out} holds an earlier "
                          f"run's {' and '.join(finals)}: this run would start over from step 0 and replace them "
                          "(and metrics.jsonl's records); set train.resume=none to start this out_dir over, or "
                          "another train.out_dir", "train.resume")


LOCK_FILE = ".chronicals.lock"  # in train.out_dir while a run uses it (a dot-file: data readers skip it)


@contextmanager
def out_dir_lock(out_dir: Path, hold: bool = True):
    """An exclusive flock on out_dir/.chronicals.lock for the run's whole life (``hold``: False on the ranks
    other than 0 of a data-parallel job, which write nothing there). A second run on the same out_dir fails at
    once (ConfigError: exit status 2) instead of training beside the first, mixing their metrics.jsonl and
    checkpoints, or, failing in setup, removing the first one's config.yaml, metrics.jsonl and data/.

    The OS drops a killed process's flock, so no stale lock outlives a run. The file is removed on the way out
    while still locked; a run that opened it just before then finds, once locked, that its path no longer names
    that file, and locks the new one instead (two runs cannot then each hold a lock on a different file)."""
    if not hold:
        yield
        return
    try:
        import fcntl
    except ImportError:  # no flock (Windows): said, not silent
        log.warning("no fcntl on this platform: train.out_dir=%s is not locked against a second run", out_dir)
        yield
        return
    path = out_dir / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only file system, another user's directory: was a bare "[Errno 30] ..."
            raise OSError(f"train.out_dir={out_dir} cannot be written ({e.strerror or e}: {path}): a run writes its "
                          "lock, checkpoints and metrics there; set train.out_dir to a folder you can write (to go on "
                          "from its checkpoints elsewhere: train.resume=OUT_DIR/checkpoints/step-N "
                          "train.out_dir=NEW)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"train.out_dir={out_dir} is in use by another chronicals run ({_lock_holder(path)}); "
                              "wait for it to finish, or set another train.out_dir", "train.out_dir") from None
        except OSError as e:  # a filesystem without flock (some network mounts): train unlocked, say so
            os.close(fd)
            log.warning("cannot lock %s (%s): train.out_dir=%s is not locked against a second run", path, e, out_dir)
            try:
                yield
            finally:  # the file this run made is left behind by no run
                with suppress(OSError):
                    path.unlink(missing_ok=True)
            return
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the run before us removed the file we locked: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
        yield
    finally:
        with suppress(OSError):
            path.unlink(missing_ok=True)  # before the lock goes: see above
        os.close(fd)


def _lock_holder(path: Path) -> str:
    """Who holds the lock file ``path``, for the refusal: "process 4242, running; it holds PATH" (the pid the holder
    wrote there), or "it holds PATH" when the file names none yet (its holder is between the lock and the write)."""
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return f"it holds {path}"
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
        alive = "running"
    except ProcessLookupError:  # the flock outlived it: a process it started still has the file open
        alive = "which has exited; a process it started still holds the lock"
    except OSError:  # EPERM: it exists, as another user
        alive = "running"
    return f"process {pid}, {alive}; it holds {path}"


def check_cuda_graphs(cfg: TrainConfig, device) -> None:
    """train.cuda_graphs=true with model.device=auto resolved to a CPU: said before the model and data load, not at
    the first step after them (model.device=cpu and checkpointing are refused when the config is read)."""
    if cfg.train.cuda_graphs == "true" and device.type != "cuda":
        raise ConfigError(f"train.cuda_graphs=true needs CUDA, but this run's device is {device} (model.device="
                          f"{cfg.model.device}); use train.cuda_graphs=auto (on where graphs can run) or false",
                          "train.cuda_graphs")


def check_impl(cfg: TrainConfig, device) -> None:
    """model.impl=triton where the Triton kernels cannot run (a CPU run outside Triton's interpreter): a setting
    this machine cannot run, exit status 2 before the model loads, as train.cuda_graphs=true (it was load_model's
    ValueError after the load, exit status 3, "bad input", worded for the Python API)."""
    from ..ops._impl import check_impl as op_impl
    from ..ops._impl import triton_interpreting

    if cfg.model.impl == "triton" and device.type != "cuda" and not triton_interpreting():
        raise ConfigError(f"model.impl=triton needs CUDA, but this run's device is {device} (model.device="
                          f"{cfg.model.device}); use model.impl=auto (Triton on CUDA, the PyTorch reference elsewhere) "
                          "or torch, or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter (slow)",
                          "model.impl")
    if cfg.model.loss_vocab_parts > 1 and op_impl("linear_cross_entropy", cfg.model.impl, device) == "torch":
        # the reference head materializes the (N, V) logits and has no parts: the setting was silent there
        where = "with model.impl=torch" if cfg.model.impl == "torch" else f"on {device}"
        log.warning("model.loss_vocab_parts=%d does nothing %s: the PyTorch reference loss head builds the whole "
                    "logits; the parts are the Triton head's (model.impl=auto or triton on CUDA)",
                    cfg.model.loss_vocab_parts, where)
    kernel = cfg.model.attention
    if kernel in ("cudnn", "fa4"):  # an ImportError at the first step's forward on CUDA (exit 4), silent off it
        from ..ops import attention_cudnn, attention_fa4

        if device.type != "cuda" or cfg.model.impl == "torch":
            runs = "packed rows run the masked" if kernel == "cudnn" else "attention runs the"
            log.warning("model.attention=%s does nothing %s: %s SDPA reference there", kernel,
                        f"on {device}" if device.type != "cuda" else "with model.impl=torch", runs)
        elif kernel == "cudnn" and not attention_cudnn.available():
            raise ConfigError("model.attention=cudnn needs NVIDIA's cuDNN Python frontend with cuDNN >= 9.6: pip "
                              "install 'nvidia-cudnn-frontend>=1.12' (or pip install 'chronicals[cudnn]'); "
                              "model.attention=auto or flash runs without it", "model.attention")
        elif kernel == "fa4" and not attention_fa4.available():
            raise ConfigError(f"model.attention=fa4 needs FlashAttention-4's CuTe kernels: {attention_fa4.INSTALL}",
                              "model.attention")


def final_dir(cfg: TrainConfig, out_dir: Path, lora: bool | None = None) -> Path:
    """Where the run's result goes: out_dir/adapter (LoRA, PEFT format) or out_dir/model (full, Hugging Face);
    ``lora`` None: this run's kind (cfg.lora.enabled)."""
    return out_dir / ("adapter" if (cfg.lora.enabled if lora is None else lora) else "model")


def _final_files(lora: bool) -> tuple[str, ...]:
    """The names (fnmatch patterns) of the files of a final directory: an adapter's (LoRA) or a model's."""
    from ..lora.peft_io import CONFIG_NAME, WEIGHTS_NAME
    from ..models.hf_io import MODEL_DIR_FILES

    return (CONFIG_NAME, WEIGHTS_NAME) if lora else MODEL_DIR_FILES


def check_final_dir(cfg: TrainConfig, out_dir: Path) -> None:
    """FileExistsError if save_final could not replace out_dir/adapter (LoRA) or out_dir/model (full): it holds
    files that are not an adapter's / a model's, or is a file."""
    from ..models.hf_io import refuse_foreign_files

    final = final_dir(cfg, out_dir)
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final} exists and is not a directory: the final {final.name} is written there; "
                              "move it away or set another train.out_dir")
    refuse_foreign_files(final, _final_files(cfg.lora.enabled))


def check_final_model(cfg: TrainConfig, model) -> None:
    """ValueError now, before the run, if save_final of a full fine-tune would be refused by save_model
    (``hf_io.no_hf_dir``: a GGUF file with partial rope; a head untied in code under a tied config, which
    training moves away from the embedding), not after the whole run."""
    from ..models.hf_io import UNTIED_HEAD, UNTIED_HEAD_FIX, head_untied_in_code, no_hf_dir

    mcfg = getattr(model, "config", None)
    if not cfg.train.save_final or cfg.lora.enabled or not hasattr(mcfg, "partial_rotary_factor"):
        return
    if head_untied_in_code(model):
        raise ValueError(f"the model passed to train(): {UNTIED_HEAD}, and full fine-tuning would train them apart, "
                         f"so the final model could not be saved; {UNTIED_HEAD_FIX}")
    why = no_hf_dir(mcfg)
    if why:
        raise ValueError(f"{getattr(model, 'chronicals_base', None) or 'the model passed to train()'} {why}: a GGUF "
                         "file whose rope.dimension_count is below head_dim. A full fine-tune's final model could not "
                         "be saved; train a LoRA adapter (lora.enabled=true) or set train.save_final=false "
                         "(the checkpoints keep the weights)")


def earlier_finals(cfg: TrainConfig, out_dir: Path, resume_from: Path | None, rewind: bool = False) -> list[Path]:
    """out_dir's final adapter/ (LoRA) and model/ (full) that an earlier run wrote and this run does not continue:
    they go with that run's checkpoints once this run writes, as they would otherwise sit beside this run's
    config.yaml (which ``chat --adapter out_dir/adapter`` reads) though this run never wrote them. This run's own
    kind is kept when it continues its own checkpoints (its history wrote it), unless it is a ``rewind`` (a resume
    from an earlier step of out_dir, whose later checkpoints go: the final directory holds their last step's
    weights, which `chat --adapter` then used without a word); the other kind never is (a full run over an earlier
    LoRA run's out_dir left its adapter/ beside the new config.yaml).

    One is left, with a warning, when it holds other files or is this run's model.path: a run deletes no file it
    could not have written."""
    from ..models.hf_io import foreign_entries
    from .checkpoint import is_own

    base = Path(cfg.model.path).expanduser().resolve()
    out = []
    for lora in (cfg.lora.enabled, not cfg.lora.enabled):  # this run's kind, then the other
        final = final_dir(cfg, out_dir, lora)
        if not final.is_dir() or final.is_symlink():
            continue
        if lora == cfg.lora.enabled and resume_from is not None and is_own(resume_from, out_dir) and not rewind:
            continue  # the final directory is of this run's history
        foreign = foreign_entries(final, _final_files(lora))  # a folder in it too (a user's tokenizer_backup/)
        if foreign or final.resolve() in (base, *base.parents):
            why = f"it also holds {', '.join(foreign[:5])}" if foreign else f"it holds model.path={cfg.model.path}"
            log.warning("%s is an earlier run's final %s, not this run's; left in place as %s: move it away, or set "
                        "another train.out_dir", final, final.name, why)
            continue
        out.append(final)
    return out
