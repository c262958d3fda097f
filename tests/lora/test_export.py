"""Getting models out (`chronicals export`, merge_lora, save_adapter, save_model): what an output directory may hold
and where --out may be, each checked against what transformers and peft load from the written files."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from chronicals import save_model
from chronicals.cli import main
from chronicals.lora import apply_lora, merge_lora, save_adapter

from .conftest import hf_config, randomize_lora_b, tiny_model


def _model_files(d):
    """A written model directory's files, as save_model leaves them (no tokenizer: none is needed here)."""
    save_model(tiny_model(), None, d)
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("folder", ["tokenizer_backup", "model-00001-of-00002.safetensors", "special_tokens_map.json"])
def test_a_folder_in_an_output_directory_is_never_deleted(tmp_path, folder):
    """An output directory is replaced only when it holds nothing but a model's files. The file-name patterns
    matched folders too: a user's tokenizer_backup/ (matching tokenizer*) was deleted with its contents by the next
    save_model or export into that directory."""
    out = tmp_path / "out"
    files = _model_files(out)
    (out / folder).mkdir()
    (out / folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=f"would delete \\({folder}/\\)"):
        save_model(tiny_model(), None, out)
    assert (out / folder / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, folder])


def _tokenizer():
    """A 61-token word-level tokenizer (the tiny models' vocabulary): real tokenizer files, no GGUF parse."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(59)} | {"<unk>": 59, "</s>": 60}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                                unk_token="<unk>", eos_token="</s>")


def test_export_refuses_an_out_holding_a_folder(tmp_path, capsys):
    base = save_model(tiny_model(), _tokenizer(), tmp_path / "base")
    model = tiny_model()
    apply_lora(model, r=2, alpha=4)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    out = tmp_path / "out"
    _model_files(out)
    (out / "tokenizer_backup").mkdir()
    (out / "tokenizer_backup" / "notes.txt").write_text("keep me")
    assert main(["export", "--adapter", str(adapter), "--out", str(out)]) == 2
    assert "tokenizer_backup/" in capsys.readouterr().err
    assert (out / "tokenizer_backup" / "notes.txt").read_text() == "keep me"


def test_a_link_to_a_folder_is_replaced_as_a_file(tmp_path):
    """A symlink is removed as a link (its target stays), so one named like a model file is still the model's."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    _model_files(out)
    elsewhere.mkdir()
    (elsewhere / "x").write_text("x")
    (out / "tokenizer.json").symlink_to(elsewhere)
    save_model(tiny_model(), None, out)
    assert (elsewhere / "x").read_text() == "x" and not (out / "tokenizer.json").exists()


def test_merge_lora_returns_the_merged_model(ids):
    """merge_lora returns the model it merged (its signature says nn.Module), so `model = merge_lora(model)` keeps
    a plain model with the adapter's logits; returning None went unseen, every other caller uses the side effect."""
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    randomize_lora_b(model)
    with torch.no_grad():
        want = model(ids)
    merged = merge_lora(model)
    assert merged is model and getattr(merged, "lora_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), want)


def test_export_merges_onto_a_base_saved_without_tokenizer_files(tmp_path, ids, capsys):
    """A base written by transformers' save_pretrained alone (what a PEFT user has) holds no tokenizer files, and a
    merge needs none; export refused it (exit 3) with 'call load_model(..., tokenizer=False)', which the command
    line cannot do. It now merges and writes the model without them, saying so; the merged model computes what
    PEFT's merge_and_unload does on the same adapter."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config("llama", tied=True)).eval()
    hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"],
                                                 task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    pm.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = pm.merge_and_unload().eval()(input_ids=ids).logits
    out = tmp_path / "merged"
    assert main(["export", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
                 "--out", str(out)]) == 0
    assert "has no tokenizer files" in capsys.readouterr().err
    assert not any(p.name.startswith("tokenizer") for p in out.iterdir())
    got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_export_of_a_refused_model_says_nothing_about_writing_it(tmp_path, capsys):
    """A model directory without tokenizer files whose config the load refuses: the "written without them" note
    came before the error, for a model that was not written at all (a user walk). Now only the error, exit 3."""
    cfg = hf_config("llama", tied=True)
    cfg.hidden_act = "gelu"  # not a SwiGLU MLP: refused by the load
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    out = tmp_path / "out"
    assert main(["export", "--model", str(tmp_path / "base"), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "hidden_act='gelu'" in err and "written without" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("tokenizer", ["none", "damaged"])
def test_export_no_merge_neither_reads_nor_asks_for_the_bases_tokenizer(tmp_path, capsys, tokenizer):
    """export --no-merge writes only the adapter. A base with no tokenizer files gets none of the merge's "written
    without them" note (an adapter in PEFT's format never carries a tokenizer, so the note would send the user after
    files the output does not need), and a base whose tokenizer.json is damaged (or slow to build) does not stop it:
    the base's tokenizer is never loaded."""
    base = save_model(tiny_model(), None, tmp_path / "base")  # config.json and weights, no tokenizer files
    if tokenizer == "damaged":
        (base / "tokenizer.json").write_text("{ not json")
    model = tiny_model()
    apply_lora(model, r=2, alpha=4)
    randomize_lora_b(model)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    out = tmp_path / "peft"
    assert main(["export", "--no-merge", "--adapter", str(adapter), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "tokenizer" not in err, err
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("out", ["~/base", "~/adapter/merged"])
def test_export_guards_the_base_and_adapter_given_with_a_tilde(tmp_path, monkeypatch, capsys, out):
    """--base=~/base --out=~/base: no shell expands '~' after '=', and the checks that --out is not the base or the
    adapter (nor inside them) compared unexpanded paths, which named nothing: the merged model replaced its own
    base (load and write expand '~')."""
    monkeypatch.setenv("HOME", str(tmp_path))
    base = save_model(tiny_model(), None, tmp_path / "base")
    model = tiny_model()
    apply_lora(model, r=2, alpha=4)
    randomize_lora_b(model)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    before = (base / "model.safetensors").read_bytes()
    assert main(["export", "--base", "~/base", "--adapter", "~/adapter", "--out", out]) == 2
    assert "--out " + out in capsys.readouterr().err
    assert (base / "model.safetensors").read_bytes() == before and not (tmp_path / "adapter" / "merged").exists()


def test_an_out_whose_folder_cannot_be_written_is_refused_before_the_merge(tmp_path, monkeypatch, capsys):
    """Found only after the load and merge (minutes at 8B) when the temporary directory beside --out was made."""
    import os
    from pathlib import Path

    from chronicals.models import hf_io

    model = tiny_model()
    apply_lora(model, r=2, alpha=4)
    save_adapter(model, tmp_path / "a")
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(hf_io.os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    monkeypatch.setattr("chronicals.cli._load", lambda *a, **k: pytest.fail("loaded before the check"))
    assert main(["export", "--adapter", str(tmp_path / "a"), "--base", str(tmp_path / "b"),
                 "--out", str(locked / "m")]) == 2
    assert f"{locked} cannot be written by this user" in capsys.readouterr().err


def test_export_no_merge_on_a_bf16_base_keeps_the_modules_to_save_bits(tmp_path, capsys):
    """export --no-merge of an adapter with modules_to_save (fp32 in the file, as PEFT and a run's adapter/ or
    checkpoint hold them) on a bf16 base: the saved modules were copied into the bf16 base's parameters and written
    from there, so the new adapter held them rounded to bf16 (A and B stayed fp32), against the help's "fp32" and
    the README's "a re-saved adapter keeps the file's bits"."""
    from safetensors.torch import load_file

    base = save_model(tiny_model().to(torch.bfloat16), None, tmp_path / "base")
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, modules_to_save=["lm_head"])
    randomize_lora_b(model)
    with torch.no_grad():  # values bf16 cannot hold
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape,
                                              generator=torch.Generator().manual_seed(5)) * 1e-3)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    out = tmp_path / "peft"
    assert main(["export", "--no-merge", "--adapter", str(adapter), "--out", str(out)]) == 0
    want, got = load_file(adapter / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == torch.float32, key
        assert torch.equal(got[key], want[key]), key


def test_export_dtype_bfloat16_from_an_fp32_base_rounds_each_merged_weight_once(tmp_path, capsys):
    """export --dtype bfloat16 of an adapter on an fp32 base loaded the base in bf16, so W was rounded before
    W + s B A was: 21% of a SmolLM2 merge's adapted elements differed from W + s B A rounded once, the value the
    help promises ("each W + s B A is computed in fp32 and rounded once"). The merged weights must be that value."""
    from safetensors.torch import load_file

    for base_dtype in (torch.float32, torch.float16):  # an fp16 base: rounded to fp16 first, then to bf16, before
        d = tmp_path / str(base_dtype)
        base = save_model(tiny_model().to(base_dtype), None, d / "base")
        model = tiny_model()
        apply_lora(model, r=2, alpha=4)
        randomize_lora_b(model)
        adapter = save_adapter(model, d / "adapter", base_model_name_or_path=str(base))
        out = d / "merged"
        assert main(["export", "--adapter", str(adapter), "--dtype", "bfloat16", "--out", str(out)]) == 0
        assert "(bfloat16)" in capsys.readouterr().out
        w, ad, got = (load_file(p / f) for p, f in ((base, "model.safetensors"), (adapter, "adapter_model.safetensors"),
                                                   (out, "model.safetensors")))
        scaling = model.lora_config.scaling
        for key, t in got.items():
            assert t.dtype == torch.bfloat16, key
            a = ad.get(f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight")
            w32 = w[key].float()
            want = w32 if a is None else \
                w32 + scaling * (ad[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"] @ a)
            assert torch.equal(t, want.to(torch.bfloat16)), (base_dtype, key)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert hf.dtype == torch.bfloat16
