"""Hugging Face directories in and out, where a mutation walk found no test: shard files filled greedily with none
empty, a single file whatever the cap, the single file read before a stale index, a tied checkpoint stored as its
head alone, the written dtype, links in the output, the tokenizer files a replacing save owns, blank and nested
output paths, a full disk in the tokenizers writer (and its other errors), the device loaded on, a BPE tokenizer of
vocab.json + merges.txt alone, and the defaults of keys a config.json leaves out (as
transformers reads them)."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.hf_io import (atomic_dir, checkpoint_files, load_hf_dir, load_safetensors, save_hf_dir,
                                     write_state_dict, write_tensors_lazily)

_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128, hidden_act="silu",
               bos_token_id=1, eos_token_id=2)


def _model(**kw):
    cfg = {**_COMMON, "model_type": "llama", "tie_word_embeddings": False, **kw}
    return CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(std=0.2, seed=0).eval()


def _greedy(sizes, cap):  # the plan: greedy in state-dict order, a tensor larger than cap alone in its shard
    shards, size = [[]], 0
    for n in sizes:
        if shards[-1] and size + n > cap:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += n
    return len(shards)


@pytest.mark.parametrize("cap", [1, 5_000, 20_000])
def test_shards_are_filled_greedily_and_every_shard_file_holds_tensors(tmp_path, cap):
    """No empty first shard when the first tensor exceeds the cap, and the byte count restarts at each shard (else
    one tensor a shard after the first split)."""
    model = _model()
    sd = {k: v for k, v in model.state_dict().items()}
    out = save_hf_dir(model, None, tmp_path / "m", max_shard_bytes=cap)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    named = set(index["weight_map"].values())
    on_disk = {p.name for p in out.glob("model-*.safetensors")}
    assert named == on_disk  # no shard file without tensors
    assert len(on_disk) == _greedy([v.numel() * v.element_size() for v in sd.values()], cap)
    for f in on_disk:
        with safe_open(str(out / f), "pt") as fh:
            assert len(list(fh.keys())) >= 1


def test_a_shard_is_filled_up_to_exactly_max_shard_bytes(tmp_path):
    """max_shard_bytes is inclusive, as in transformers: tensors of 400 + 600 bytes share a 1000-byte shard (with
    ``>=`` they were split into a shard each, a third shard for the same tensors)."""
    sd = {"a": torch.zeros(100), "b": torch.zeros(150), "c": torch.zeros(100)}  # 400, 600, 400 bytes (fp32)
    write_state_dict(sd, tmp_path, max_shard_bytes=1000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                                   "c": "model-00002-of-00002.safetensors"}
    assert sorted(p.name for p in tmp_path.glob("model-*")) == ["model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"]


def test_one_tensor_over_max_shard_bytes_is_written_as_model_safetensors(tmp_path):
    """Tensors over max_shard_bytes that still make one shard (a tensor larger than the cap) are written as the
    single file model.safetensors: named model-00001-of-00001.safetensors, with no index, no reader found them."""
    w = torch.arange(250, dtype=torch.float32)  # 1000 bytes
    write_state_dict({"w": w}, tmp_path, max_shard_bytes=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert checkpoint_files(tmp_path) == [tmp_path / "model.safetensors"]
    assert torch.equal(load_safetensors(tmp_path / "model.safetensors")["w"], w)


def test_the_single_file_is_read_before_a_stale_index(tmp_path):
    """model.safetensors is read even with a stale model.safetensors.index.json beside it (naming shards that are
    gone), as transformers looks for the single file first: read by its index, the directory was refused as naming
    missing shards."""
    model = _model()
    out = save_hf_dir(model, None, tmp_path / "m")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 1}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    assert checkpoint_files(out) == [out / "model.safetensors"]
    assert torch.equal(load_hf_dir(out).model.norm.weight, model.model.norm.weight)


def test_a_lazy_tensor_of_other_bytes_than_planned_is_refused(tmp_path):
    """The shards are laid out from the planned sizes before any tensor is made (a GGUF conversion), so a tensor of
    other bytes is refused, and nothing written: unchecked, it made shards above max_shard_bytes and an index whose
    total_size is wrong."""
    with pytest.raises(AssertionError, match=r"tensor w: 16 bytes made, 8 planned"):
        write_tensors_lazily([("w", 8, lambda: torch.zeros(4))], tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_tied_checkpoint_stored_as_its_head_alone_keeps_the_files_dtype(tmp_path):
    """A tied bf16 checkpoint that stores lm_head.weight only loads in bf16 (dtype None: the file's)."""
    model = _model(tie_word_embeddings=True).to(torch.bfloat16)
    out = save_hf_dir(model, None, tmp_path / "m")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k not in ("lm_head.weight",
                                                                                 "model.embed_tokens.weight")}
    sd["lm_head.weight"] = model.model.embed_tokens.weight.detach().clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf_dir(out)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_dtype_none_follows_the_embedding_not_other_tensors(tmp_path):
    """A bf16 checkpoint with fp32 norms (as some releases keep them) loads in bf16, the embedding's dtype, not
    in the dtype of whichever tensor is read last (fp32, at twice the memory)."""
    model = _model().to(torch.bfloat16)
    out = save_hf_dir(model, None, tmp_path / "m")
    sd = {k: (v.float() if k.endswith("norm.weight") else v).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf_dir(out)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16 and ours.model.norm.weight.dtype == torch.bfloat16


def test_an_f16_checkpoint_loads_as_float16_by_default(tmp_path):
    """dtype=None keeps an F16 checkpoint in float16, bit for bit: read as bfloat16 it lost mantissa bits of every
    weight without a word."""
    model = _model().to(torch.float16)
    ours = load_hf_dir(save_hf_dir(model, None, tmp_path / "m"))
    assert ours.model.embed_tokens.weight.dtype == torch.float16
    assert torch.equal(ours.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("stored, st_name", [(torch.int8, "I8"), (torch.float8_e4m3fn, "F8_E4M3")])
def test_a_tied_head_stored_alone_gets_the_embeddings_dtype_and_shape_checks(tmp_path, stored, st_name):
    """A tied checkpoint's head stored alone is read as the embedding, so it is refused as the embedding would be:
    an I8 or FP8 head (cast into a float embedding without a word, FP8 without its scales) and a head of another
    shape, named before any weight is read."""
    model = _model(tie_word_embeddings=True)
    out = save_hf_dir(model, None, tmp_path / "m")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k not in ("lm_head.weight",
                                                                                 "model.embed_tokens.weight")}
    emb = model.model.embed_tokens.weight.detach()
    sd["lm_head.weight"] = emb.to(stored)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor lm_head.weight is stored as {st_name}, not as F32.*dequantized"):
        load_hf_dir(out)
    sd["lm_head.weight"] = emb[:1].clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor lm_head.weight has shape \(1, 32\) but config.json implies "
                                         r"\(97, 32\)"):
        load_hf_dir(out)


def test_a_stale_torch_dtype_of_the_source_config_is_not_written_back(tmp_path):
    """A config.json of transformers 4 says torch_dtype=bfloat16; the model saved in fp32 must not say both."""
    cfg = {**_COMMON, "model_type": "llama", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    model = CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(std=0.2, seed=0)
    out = save_hf_dir(model, None, tmp_path / "m")
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "float32" and "torch_dtype" not in written


def test_a_link_to_a_folder_counts_as_a_file_entry(tmp_path):
    """A symlink is removed as a link: one named like an owned folder is not that folder (foreign), one named
    like owned files is owned (its target is not deleted)."""
    from chronicals.models.hf_io import MODEL_DIR_FILES, foreign_entries

    target, out = tmp_path / "elsewhere", tmp_path / "out"
    target.mkdir()
    out.mkdir()
    (target / "keep.txt").write_text("x")
    (out / "additional_chat_templates").symlink_to(target, target_is_directory=True)
    (out / "tokenizer.json").symlink_to(target, target_is_directory=True)
    assert foreign_entries(out, MODEL_DIR_FILES) == ["additional_chat_templates"]


def test_a_users_file_named_like_a_tokenizer_file_is_not_replaced(tmp_path):
    """Only the tokenizer's own file names are owned: a user's tokenizer_notes.txt in a model directory matched
    "tokenizer*" and the next replacing save deleted it without a word; now that save is refused and the note kept."""
    out = save_hf_dir(_model(), None, tmp_path / "m")
    (out / "tokenizer_notes.txt").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"holds files this save would delete \(tokenizer_notes.txt\)"):
        save_hf_dir(_model(), None, out)
    assert (out / "tokenizer_notes.txt").read_text() == "my notes"


class _FilesTokenizer:
    """save_pretrained writes these files, as a tokenizer of that kind does."""

    def __init__(self, *names):
        self.names = names

    def save_pretrained(self, d):
        for name in self.names:
            (Path(d) / name).write_text("{}\n")


@pytest.mark.parametrize("files", [("vocab.json", "merges.txt"), ("tokenizer.model.v3",), ("tekken.json",),
                                   ("tokenizer.model", "special_tokens_map.json", "added_tokens.json",
                                    "chat_template.jinja")], ids=["bpe", "mistral", "tekken", "sentencepiece"])
def test_a_directory_with_a_tokenizers_own_files_is_replaced_by_the_next_save(tmp_path, files):
    """A GPT-2 style BPE tokenizer's vocab.json + merges.txt, Mistral's versioned tokenizer.model.v3 and its
    tekken.json, and a SentencePiece tokenizer's files as transformers writes them are files a saved model directory
    owns: the next save over it replaces them (it was refused as holding files this save would delete, merges.txt or
    tokenizer.model.v3)."""
    out = save_hf_dir(_model(), _FilesTokenizer("tokenizer_config.json", *files), tmp_path / "m")
    assert set(files) <= {p.name for p in out.iterdir()}
    save_hf_dir(_model(), None, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("blank", ["  ", "\t"])
def test_atomic_dir_refuses_a_blank_path_and_writes_nothing(tmp_path, monkeypatch, blank):
    """atomic_dir itself (under save_model, save_adapter and the GGUF cache) refuses a blank output path before
    resolving it: "  " was written as a folder named by two spaces in the working directory, without a word."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"the output path is empty or blank"):
        with atomic_dir(blank) as tmp:
            (tmp / "x").write_text("x")
    assert list(tmp_path.iterdir()) == []


def test_the_outputs_missing_parent_folders_are_created(tmp_path):
    """A save to a/b/m with a/ missing makes a/ and a/b/ (as mkdir -p does): it was a FileNotFoundError."""
    model = _model()
    out = save_hf_dir(model, None, tmp_path / "a" / "b" / "m")
    assert out == tmp_path / "a" / "b" / "m"
    assert torch.equal(load_hf_dir(out).model.norm.weight, model.model.norm.weight)


class _RustFullDisk:
    def save_pretrained(self, d):
        raise Exception("No space left on device (os error 28)")  # the tokenizers library's bare Exception


class _PythonFullDisk:
    def save_pretrained(self, d):
        raise OSError(errno.ENOSPC, "No space left on device")  # transformers' own Python writing a file


@pytest.mark.parametrize("writer", [_RustFullDisk, _PythonFullDisk])
def test_a_full_disk_in_the_tokenizer_writer_is_an_oserror_naming_the_output(tmp_path, writer):
    """The Rust writer's bare Exception and a Python OSError are both an OSError naming the output with the
    disk-full hint (the OSError was passed on as it came, naming neither), and nothing is left behind."""
    with pytest.raises(OSError, match=rf"could not write the tokenizer files of {tmp_path / 'out'} \(.*No space "
                                      r"left on device.*\); is its disk full"):
        save_hf_dir(_model(), writer(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_model_is_built_on_the_device_asked_for(tmp_path):
    """load_hf_dir's device reaches the allocation (ignored, load_model(device="cuda") would give a CPU model); meta
    stands in for another device on a CPU-only machine."""
    ours = load_hf_dir(save_hf_dir(_model(), None, tmp_path / "m"), device="meta")
    assert {p.device.type for p in ours.parameters()} == {"meta"} and ours.model.inv_freq.is_meta


def test_a_bpe_tokenizer_of_vocab_json_and_merges_alone_is_a_tokenizer(tmp_path):
    """A directory whose tokenizer is vocab.json + merges.txt (no tokenizer.json, as GPT-2 style releases ship it)
    loads it, and is not told it has no tokenizer files."""
    from chronicals.models.loading import load_tokenizer

    out = save_hf_dir(_model(model_type="qwen2"), None, tmp_path / "m")
    (out / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (out / "merges.txt").write_text("#version: 0.2\na b\n")
    assert load_tokenizer(out)("ab")["input_ids"] == [2]


class _BrokenTokenizer:
    def save_pretrained(self, d):
        raise ValueError("cannot serialize this tokenizer")  # no full disk: a bug of the tokenizer's own


def test_another_error_of_the_tokenizer_writer_fails_the_save_as_it_came(tmp_path):
    """Only a full disk is reworded; any other error passes as it came and the save leaves nothing (swallowed, the
    directory would be published without its tokenizer files)."""
    with pytest.raises(ValueError, match=r"^cannot serialize this tokenizer$"):
        save_hf_dir(_model(), _BrokenTokenizer(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_absent_keys_take_transformers_class_defaults(model_type):
    """rms_norm_eps, tie_word_embeddings, max_position_embeddings: a config.json without a key reads as
    transformers reads it."""
    import transformers

    d = dict(model_type=model_type, vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ours, theirs = ModelConfig.from_hf_dict(d), transformers.AutoConfig.for_model(**d)
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.max_position_embeddings == theirs.max_position_embeddings
