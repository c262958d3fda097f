"""HF directories out and in: save_model -> transformers / load_model give the same logits; sharded
checkpoints; atomic writes; shapes checked from the safetensors header before any allocation; a bf16 model
allocated in bf16, not built in fp32 first; and every error names the file and the fix."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_decoder import _cfg

import chronicals
from chronicals.models import CausalLM, ModelConfig
from chronicals.models.hf_io import empty_model, load_hf_dir, save_hf_dir


def _model(cfg: dict, seed: int = 0) -> CausalLM:
    model = CausalLM(ModelConfig.from_hf_dict(cfg)).init_weights(std=0.2, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms and biases away from their init values, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


IDS = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(5))


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_save_then_transformers_and_our_load_match(tmp_path, tiny_hf_config, hf_family):
    cfg = tiny_hf_config(hf_family)
    model = _model(cfg)
    ref = _logits(model)
    out = chronicals.save_model(model, None, tmp_path / "m")
    names = set(safe_open(str(out / "model.safetensors"), "pt").keys())
    assert ("lm_head.weight" in names) == (not cfg["tie_word_embeddings"])  # no duplicate tied head
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "mistral": "MistralForCausalLM"}[cfg["model_type"]]
    assert torch.allclose(_logits(hf), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    ours, tok = chronicals.load_model(out, tokenizer=False)
    assert tok is None and not ours.training
    assert torch.equal(_logits(ours), ref)  # same fp32 weights, same ops: bit-identical


def test_sharded_checkpoint_loads_in_both(tmp_path, tiny_hf_config):
    cfg = tiny_hf_config("llama3")
    model = _model(cfg, seed=2)
    out = chronicals.save_model(model, None, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    ref = _logits(model)
    assert torch.equal(_logits(chronicals.load_model(out, tokenizer=False)[0]), ref)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert torch.allclose(_logits(hf), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_hf_saved_checkpoint_loads_with_dtype(tmp_path, tiny_hf_config):
    """A directory written by transformers itself (tied head, bf16 on disk) -> our model, cast on load."""
    cfg = tiny_hf_config("smollm2")
    model = _model(cfg, seed=3)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    hf.load_state_dict(model.state_dict())
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    ours, _ = chronicals.load_model(tmp_path / "hf", tokenizer=False)
    assert ours.lm_head.weight.dtype == torch.bfloat16  # dtype None keeps the checkpoint's
    assert ours.model.inv_freq.dtype == torch.float32
    f32, _ = chronicals.load_model(tmp_path / "hf", dtype=torch.float32, tokenizer=False)
    assert f32.lm_head.weight is f32.model.embed_tokens.weight
    assert torch.equal(f32.model.layers[1].mlp.down_proj.weight,
                       model.model.layers[1].mlp.down_proj.weight.to(torch.bfloat16).float())


def test_tied_checkpoint_may_carry_lm_head(tmp_path, tiny_hf_config):
    """A tied checkpoint storing a copy of its embedding as lm_head.weight (.bin conversions do) loads, in its own
    dtype and in another: the two are compared in the dtype loaded (compared in the file's fp32 against the
    bf16-rounded embedding, a load with dtype=bfloat16 was refused as having a different head)."""
    cfg = tiny_hf_config("qwen2")
    model = _model(cfg)
    out = chronicals.save_model(model, None, tmp_path / "m")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(_logits(chronicals.load_model(out, tokenizer=False)[0]), _logits(model))
    bf16, _ = chronicals.load_model(out, tokenizer=False, dtype=torch.bfloat16)
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight
    assert torch.equal(bf16.model.embed_tokens.weight, model.model.embed_tokens.weight.detach().to(torch.bfloat16))


def test_save_with_tokenizer_round_trips(tmp_path, one_thread, smollm2):
    """The embedded model saved with its tokenizer: files, chat template, same greedy output after reload."""
    model, tok = smollm2
    out = chronicals.save_model(model, tok, tmp_path / "smol", generation_config={"eos_token_id": 2})
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    again, tok2 = chronicals.load_model(out)
    assert tok2.chat_template == tok.chat_template
    msgs = [{"role": "user", "content": "Hi!"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert tok2.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False) == ids
    x = torch.tensor([ids])
    assert torch.equal(_logits(again, x), _logits(model, x))


def test_overwrite_is_atomic(tmp_path, tiny_hf_config):
    cfg = tiny_hf_config("llama2")
    a, b = _model(cfg, seed=0), _model(cfg, seed=1)
    out = tmp_path / "m"
    chronicals.save_model(a, None, out)

    class FailingTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="simulated"):
        chronicals.save_model(b, FailingTokenizer(), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left behind
    assert torch.equal(_logits(chronicals.load_model(out, tokenizer=False)[0]), _logits(a))  # old one intact
    chronicals.save_model(b, None, out)  # a successful overwrite replaces it
    assert torch.equal(_logits(chronicals.load_model(out, tokenizer=False)[0]), _logits(b))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_sharded_output_is_replaced_by_a_single_file_save(tmp_path, tiny_hf_config):
    """The shard files of an earlier save (model-0000i-of-0000n.safetensors) are the save's own, matched by glob:
    compared as exact names they were taken for the user's files, and saving over a sharded output was refused."""
    model = _model(tiny_hf_config("llama2"))
    out = chronicals.save_model(model, None, tmp_path / "m", max_shard_bytes=4096)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    chronicals.save_model(model, None, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_save_interrupted_by_ctrl_c_leaves_no_temporary_directory(tmp_path, tiny_hf_config):
    """The temporary directory is removed for any BaseException, not only for errors: a KeyboardInterrupt while the
    tokenizer files were written left a .m.tmp-* directory (up to a whole model's size) beside the output."""
    class InterruptedTokenizer:
        def save_pretrained(self, path):
            raise KeyboardInterrupt  # the user's Ctrl-C

    with pytest.raises(KeyboardInterrupt):
        chronicals.save_model(_model(tiny_hf_config("llama2")), InterruptedTokenizer(), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- errors
@pytest.fixture
def saved(tmp_path, tiny_hf_config):
    cfg = tiny_hf_config("llama3")
    return chronicals.save_model(_model(cfg), None, tmp_path / "m")


def test_missing_path():
    with pytest.raises(FileNotFoundError, match=r"/nope/model: no such file or directory .* smollm2-135m-instruct"):
        chronicals.load_model("/nope/model")


def test_missing_config_json(saved):
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json: not found; a Hugging Face model directory needs one"):
        chronicals.load_model(saved, tokenizer=False)


def test_missing_weights(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json "
                                                r"\(found: config\.json\)"):
        chronicals.load_model(saved, tokenizer=False)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_names_file_and_fix(saved, damage):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000] if damage == "truncated" else b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors: cannot read .* truncated or corrupt .* again"):
        chronicals.load_model(saved, tokenizer=False)


def test_missing_shard(tmp_path, tiny_hf_config):
    out = chronicals.save_model(_model(tiny_hf_config("llama2")), None, tmp_path / "s", max_shard_bytes=20_000)
    shards = sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (out / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"names shard\(s\) that are missing: {shards[1]}"):
        chronicals.load_model(out, tokenizer=False)


def test_a_shard_index_that_is_a_directory_says_so(saved):
    """A model.safetensors.index.json that is a directory (a botched copy) is named as one, not reported as a
    directory holding no checkpoint file at all ("no model.safetensors or model.safetensors.index.json")."""
    (saved / "model.safetensors").rename(saved / "model-00001-of-00001.safetensors")
    (saved / "model.safetensors.index.json").mkdir()
    with pytest.raises(ValueError, match=rf"{saved / 'model.safetensors.index.json'}: is a directory, not a file"):
        chronicals.load_model(saved, tokenizer=False)


def test_a_tensor_mapped_to_an_empty_name_makes_the_index_invalid(saved):
    """A shard index mapping a tensor to "" is an invalid index naming the tensor, not a missing shard named by
    the directory's own name ("names shard(s) that are missing: m")."""
    (saved / "model.safetensors").rename(saved / "model-00001-of-00001.safetensors")
    (saved / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": ""}}))
    with pytest.raises(ValueError, match=r"not a valid safetensors index \(tensor 'model\.norm\.weight' is mapped "
                                         r"to '', not to a file name in"):
        chronicals.load_model(saved, tokenizer=False)


def test_missing_and_unexpected_tensor_names(saved):
    f = saved / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        sd = {k: fh.get_tensor(k) for k in fh.keys()}
    sd["model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(2, 2)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight.*"
                                         r"unexpected tensors: model\.layers\.0\.mlp\.gate_proj\.lora_A\.weight"):
        chronicals.load_model(saved, tokenizer=False)


def test_a_classifier_checkpoint_is_named_by_its_architecture(tmp_path):
    """A LlamaForSequenceClassification directory: refused (no lm_head, a "score" head), and the message names its
    architectures instead of hinting at tie_word_embeddings, which would not make it load (a user walk)."""
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=3)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unexpected tensors: score\.weight; config\.json names "
                                         r"architectures=\['LlamaForSequenceClassification'\]: a model with another "
                                         r"head") as e:
        chronicals.load_model(tmp_path, tokenizer=False)
    assert "tie_word_embeddings: true" not in str(e.value)


def test_shape_mismatch(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape \((56, 32|32, 56)\) "
                                         r"but config\.json implies \((64, 32|32, 64)\)"):
        chronicals.load_model(saved, tokenizer=False)


def test_unsupported_model_type(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model_type"] = "gemma"
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'gemma' is not supported; supported: llama, mistral, qwen2, qwen3"):
        chronicals.load_model(saved, tokenizer=False)


def test_no_tokenizer_files(saved):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files .* tokenizer=False"):
        chronicals.load_model(saved)


def test_file_instead_of_directory(saved):
    with pytest.raises(ValueError, match=r"pass the directory"):
        chronicals.load_model(saved / "config.json")


def test_save_refuses_extra_parameters(tmp_path, tiny_hf_config):
    model = _model(tiny_hf_config("llama2"))
    model.model.layers[0].mlp.extra = torch.nn.Linear(2, 2)  # e.g. an unmerged adapter
    with pytest.raises(ValueError, match=r"extra: model\.layers\.0\.mlp\.extra\.bias.*merge LoRA"):
        chronicals.save_model(model, None, tmp_path / "m")
    assert not list(tmp_path.iterdir())


def test_save_refuses_a_model_that_lacks_parameters_its_config_names(tmp_path, tiny_hf_config):
    """A layer dropped in code, config.num_hidden_layers left at 2: the directory would say two layers and hold one,
    which no loader reads; refused naming what is missing, before anything is written."""
    model = _model(tiny_hf_config("llama2"))
    model.model.layers = model.model.layers[:1]
    with pytest.raises(ValueError, match=r"extra: none; missing: model\.layers\.1\..*merge LoRA"):
        chronicals.save_model(model, None, tmp_path / "m")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("error", [OSError("simulated failure"), KeyboardInterrupt()], ids=["oserror", "ctrl-c"])
def test_atomic_dir_restores_the_old_output_when_the_final_rename_fails(tmp_path, monkeypatch, error):
    """A Ctrl-C in the final rename puts the previous output back too (caught as an Exception only, it would stay
    under <tmp>.old and the output would be gone until the next write)."""
    import os

    from chronicals.models import hf_io

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("old")
    real_rename = os.rename

    def rename(src, dst):
        # the new directory's rename into place fails (e.g. a full disk, EIO); the old output's moves (to and from
        # <tmp>.old) go through
        if ".tmp-" in str(src) and not str(src).endswith(".old"):
            raise error
        return real_rename(src, dst)

    monkeypatch.setattr(hf_io.os, "rename", rename)
    with pytest.raises(type(error)):
        with hf_io.atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no .tmp- or .old- directory left


def test_generation_config_of_the_source_is_carried(tmp_path, tiny_hf_config):
    """A model loaded from an HF directory holding generation_config.json writes it back byte for byte (fine-tuned
    and merged outputs keep the base's sampling defaults); an explicit dict wins; a source without one gives none."""
    from chronicals.lora import apply_lora, merge_lora

    src = chronicals.save_model(_model(tiny_hf_config("llama2")), None, tmp_path / "base")
    assert not (src / "generation_config.json").exists()
    plain, _ = chronicals.load_model(src, tokenizer=False)
    assert not (chronicals.save_model(plain, None, tmp_path / "plain") / "generation_config.json").exists()
    text = b'{\r\n  "do_sample": true,\r\n  "temperature": 0.6, "top_p": 0.9,\r\n  "eos_token_id": [2, 5]\r\n}'
    (src / "generation_config.json").write_bytes(text)
    model, _ = chronicals.load_model(src, tokenizer=False)
    full = chronicals.save_model(model, None, tmp_path / "full")
    assert (full / "generation_config.json").read_bytes() == text
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    merged = chronicals.save_model(merge_lora(model), None, tmp_path / "merged")
    assert (merged / "generation_config.json").read_bytes() == text
    assert chronicals.load_model(merged, tokenizer=False)[0].source_generation_config == text
    given = chronicals.save_model(model, None, tmp_path / "given", generation_config={"eos_token_id": 2})
    assert json.loads((given / "generation_config.json").read_text()) == {"eos_token_id": 2}
    # the file is the save's own: a save over that directory replaces it (not refused as a file it would delete)
    assert not (chronicals.save_model(plain, None, given) / "generation_config.json").exists()


def test_atomic_dir_removes_temporaries_of_killed_writers_only(tmp_path, caplog):
    """A save killed mid-write leaves ``.model.tmp-{pid}-{hex}`` and its free lock file beside the target: the next
    write of the same target removes them; another target's, a directory without a lock file, ``.model.old-*``
    (possibly the only copy of the previous model) and other names stay. models/test_orphans.py has live writers."""
    import logging

    from chronicals.models import hf_io
    from chronicals.models.orphans import lock_path

    dead = tmp_path / ".model.tmp-4242-0a1b2c3d"
    keep = [tmp_path / name for name in (".model.tmp-4243-0a1b2c3d", ".other.tmp-4242-0a1b2c3d",
                                         ".model.old-0a1b2c3d", "model.tmp-4242-0a1b2c3d",
                                         ".model.tmp-4242-0a1b2c3")]  # 7 hex digits: another program's
    for d in [dead, *keep]:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1_500_000)
    for d in [dead, *keep[1:]]:  # keep[0] has no lock file
        lock_path(d).touch()
    with caplog.at_level(logging.INFO, logger="chronicals.models"):
        with hf_io.atomic_dir(tmp_path / "model") as tmp:
            assert re.fullmatch(r"\.model\.tmp-\d+-[0-9a-f]{8}", tmp.name) and lock_path(tmp).exists()
            (tmp / "config.json").write_text("{}")
    assert not dead.exists() and not lock_path(dead).exists() and all(d.is_dir() for d in keep)
    assert (tmp_path / "model" / "config.json").is_file() and not lock_path(tmp).exists()
    logged = [r.getMessage() for r in caplog.records if r.name == "chronicals.models"]
    assert len(logged) == 1 and dead.name in logged[0] and "1.5 MB" in logged[0]


def test_a_head_untied_in_code_is_not_dropped(tmp_path, tiny_hf_config):
    """config says tied, but lm_head got its own Parameter with other values (user code): the directory, which holds
    no lm_head when tied, lost the head without a word. Refused now; tied again, or marked untied, it saves."""
    cfg = tiny_hf_config("llama2", tie_word_embeddings=True)
    model = _model(cfg)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)
    with pytest.raises(ValueError, match="tie_word_embeddings is true, but lm_head.weight is another tensor"):
        chronicals.save_model(model, None, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    model.config.tie_word_embeddings = False
    again, _ = chronicals.load_model(chronicals.save_model(model, None, tmp_path / "m"), tokenizer=False)
    torch.testing.assert_close(_logits(again), _logits(model))
    # a separate head with the embedding's values (a copy, e.g. after a load that cloned it) loses nothing: saved
    # tied, and it loads as the same model
    model = _model(cfg)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    again, _ = chronicals.load_model(chronicals.save_model(model, None, tmp_path / "copy"), tokenizer=False)
    assert again.config.tie_word_embeddings
    torch.testing.assert_close(_logits(again), _logits(model))


def test_a_non_contiguous_parameter_is_saved(tmp_path, tiny_hf_config):
    """A parameter that is a non-contiguous view (a transposed tensor assigned in code) is saved and loads back
    equal: safetensors refuses such a view, so the model could not be saved at all."""
    model = _model(tiny_hf_config("llama2"))
    w = model.lm_head.weight.detach()
    model.lm_head.weight = torch.nn.Parameter(w.t().contiguous().t())
    assert not model.lm_head.weight.is_contiguous()
    again, _ = chronicals.load_model(chronicals.save_model(model, None, tmp_path / "m"), tokenizer=False)
    assert torch.equal(again.lm_head.weight, w)


def test_a_tokenizer_with_named_chat_templates_saves_twice(tiny_base, tmp_path):
    """transformers 5 writes named chat templates (default + tool_use) into additional_chat_templates/; a folder
    counts as foreign in an output directory, so the second save_model or export into it was refused."""
    model, tok = chronicals.load_model(tiny_base)
    tok.chat_template = {"default": tok.chat_template, "tool_use": tok.chat_template}
    out = chronicals.save_model(model, tok, tmp_path / "m")
    assert (out / "additional_chat_templates").is_dir()
    chronicals.save_model(model, tok, out)  # its own folder: replaced
    (out / "additional_chat_templates_old").mkdir()  # a user's folder: still refused
    with pytest.raises(FileExistsError, match=r"additional_chat_templates_old/"):
        chronicals.save_model(model, tok, out)


def _llama_dir(path, tied=False, dtype=torch.float32):
    hf = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(hf).to(dtype).save_pretrained(path)
    return path


def test_a_config_whose_sizes_disagree_with_the_weights_is_refused_before_allocating(tmp_path, monkeypatch):
    d = _llama_dir(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 10 ** 9}))
    import chronicals.models.hf_io as hf_io

    monkeypatch.setattr(hf_io, "empty_model", lambda *a, **k: pytest.fail("allocated before the shape check"))
    with pytest.raises(ValueError, match=r"tensor .*\.weight has shape \(61, 32\) but config.json implies "
                                         r"\(1000000000, 32\)"):
        chronicals.load_model(d, tokenizer=False)


def test_a_bf16_model_is_allocated_in_bf16(monkeypatch):
    """empty_model allocated fp32 and then cast: both copies at once (2.3x the weights in RAM)."""
    cfg = ModelConfig.from_hf_dict(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2).to_dict())
    allocated = []
    real = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        allocated.extend(p.dtype for p in self.parameters())
        return real(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model = empty_model(cfg, torch.bfloat16, torch.device("cpu"))
    assert set(allocated) == {torch.bfloat16} and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.inv_freq.dtype == torch.float32


def test_save_model_refuses_the_working_directory_and_bad_shard_sizes(tmp_path, monkeypatch):
    model, _ = chronicals.load_model(_llama_dir(tmp_path / "m"), tokenizer=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for where in (".", str(work), str(tmp_path)):
        with pytest.raises(ValueError, match="is the working directory"):
            chronicals.save_model(model, None, where)
    # empty or blank: refused as such before the path is resolved ("  " was written as a folder of two spaces here,
    # "" refused as the working directory)
    for where in ("", "  "):
        with pytest.raises(ValueError, match=rf"the output path is empty or blank \({where!r}\)"):
            chronicals.save_model(model, None, where)
    assert work.is_dir() and not any(work.iterdir())
    for bad in ("10KB", 0, -5, True):
        with pytest.raises(ValueError, match=rf"max_shard_bytes={bad!r}; expected a number of bytes >= 1"):
            chronicals.save_model(model, None, tmp_path / "out", max_shard_bytes=bad)
    assert not (tmp_path / "out").exists()


def test_a_tied_model_saved_under_an_untied_config_writes_both(tmp_path):
    """config.tie_word_embeddings set to False on a tied model: safetensors refused two names for one storage."""
    model, _ = chronicals.load_model(_llama_dir(tmp_path / "m", tied=True), tokenizer=False)
    model.config.tie_word_embeddings = False
    out = chronicals.save_model(model, None, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not hf.config.tie_word_embeddings
    torch.testing.assert_close(hf.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_an_fp8_checkpoint_is_refused_as_quantized(tmp_path):
    """F8_E4M3 passed the float check (it starts with "F"): cast to bf16 without its scales."""
    from safetensors.torch import load_file, save_file

    d = _llama_dir(tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.weight is stored as F8_E4M3, not as F32, F16 or BF16.*FP8\) must "
                                         r"be dequantized first"):
        chronicals.load_model(d, tokenizer=False)


def test_a_full_disk_while_saving_is_an_oserror_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own SafetensorError: the CLI called it an internal error (exit 4)."""
    from safetensors import SafetensorError

    import chronicals.models.hf_io as hf_io
    from chronicals.cli import _failed
    from chronicals.lora import apply_lora, save_adapter

    model, _ = chronicals.load_model(_llama_dir(tmp_path / "m"), tokenizer=False)

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_io, "save_file", full)
    with pytest.raises(OSError, match=r"could not write .*model.safetensors \(.*No space left.*\); is its disk full") \
            as e:
        chronicals.save_model(model, None, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["m"]
    assert _failed(e.value) == 3 and "error: could not write" in capsys.readouterr().err
    # the message names the output, not the temporary directory that is gone when it is read
    assert f"could not write {tmp_path / 'out' / 'model.safetensors'} (" in str(e.value) and ".tmp-" not in str(e.value)
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    with pytest.raises(OSError, match=r"adapter_model.safetensors .*is its disk full"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_save_model_refuses_what_is_not_a_tokenizer_before_writing(tiny_hf_config, tmp_path):
    """save_model(model, "a/path", out): the string where the tokenizer goes wrote every weight, then failed with
    an AttributeError; now a TypeError that says the argument order, and nothing is written."""
    from chronicals import save_model
    from chronicals.models import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("llama3"))).init_weights(seed=0)
    with pytest.raises(TypeError, match=r"tokenizer is a str, not a tokenizer.*save_model\(model, tokenizer, out_dir\)"):
        save_model(model, str(tmp_path / "a"), tmp_path / "out")
    assert not list(tmp_path.iterdir())

    class Tok:  # stands for a tokenizer: save_model(model, "out", tok) raised Path's TypeError about a Tok
        def save_pretrained(self, path):
            raise AssertionError("not reached")

    with pytest.raises(TypeError, match=r"out_dir is a Tok, not a path; the arguments are save_model\(model, "
                                        r"tokenizer, out_dir\)"):
        save_model(model, str(tmp_path / "b"), Tok())
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_that_stores_rotary_inv_freq_loads(tmp_path):
    """Older Llama checkpoints store one per layer; they are recomputed, not refused as unexpected tensors."""
    model = CausalLM(_cfg(vocab_size=17)).init_weights(seed=0).eval()
    out = save_hf_dir(model, None, tmp_path / "m")
    sd = load_file(str(out / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(load_hf_dir(out)(ids), model(ids))
