"""PEFT-format round trips against transformers + peft on tiny configs: same logits both ways."""

import json
import re

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from chronicals.lora import apply_lora, load_adapter, lora_modules, merge_lora, save_adapter

from .conftest import hf_config, randomize_lora_b, tiny_model

CLS = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}


def hf_twin(kind, tied, ours_state):
    """A transformers model holding exactly our base weights."""
    cfg = hf_config(kind, tied)
    cfg._attn_implementation = "eager"
    hf = CLS[kind](cfg).eval()
    missing, unexpected = hf.load_state_dict(ours_state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


CASES = [  # kind, tied, lora options
    ("llama", False, dict(r=4, alpha=8)),
    ("qwen2", False, dict(r=8, alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                          dropout=0.1)),
    ("llama", True, dict(r=2, alpha=2, target_modules=["o_proj", "up_proj"], modules_to_save=["lm_head"])),
]


@pytest.mark.parametrize("kind,tied,opts", CASES)
def test_ours_to_peft(kind, tied, opts, ids, tmp_path):
    ours = tiny_model(kind, tied)
    base_state = {k: v.clone() for k, v in ours.state_dict().items()}
    apply_lora(ours, **opts)
    randomize_lora_b(ours)
    with torch.no_grad():
        ours.lm_head.weight.add_(0.05) if tied else None  # a trained modules_to_save tensor
        want = ours(ids)
    save_adapter(ours, tmp_path / "adapter", base_model_name_or_path="tiny")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]  # no temp dir left behind
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight" in keys or not tied
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in keys)
    hf = hf_twin(kind, tied, base_state)
    assert not torch.allclose(hf_logits(hf, ids), want, atol=1e-3)  # the adapter changes the logits
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    torch.testing.assert_close(hf_logits(pm, ids), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,tied,opts", CASES)
def test_peft_to_ours(kind, tied, opts, ids, tmp_path):
    ours = tiny_model(kind, tied)
    hf = hf_twin(kind, tied, ours.state_dict())
    cfg = peft.LoraConfig(r=opts["r"], lora_alpha=opts["alpha"], use_rslora=opts.get("use_rslora", False),
                          lora_dropout=opts.get("dropout", 0.0), task_type="CAUSAL_LM",
                          target_modules=opts.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]),
                          modules_to_save=opts.get("modules_to_save"))
    pm = peft.get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.eval()
    want = hf_logits(pm, ids)
    pm.save_pretrained(tmp_path / "peft")
    rec = load_adapter(ours, tmp_path / "peft")
    assert rec.r == opts["r"] and rec.alpha == opts["alpha"]
    with torch.no_grad():
        got = ours(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if tied:  # PEFT trained a private copy of lm_head: ours is untied the same way
        assert ours.lm_head.weight is not ours.model.embed_tokens.weight and ours.lm_head.weight.requires_grad
        assert not ours.model.embed_tokens.weight.requires_grad
    merge_lora(ours)  # merged: plain model, same logits
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), want, rtol=1e-4, atol=1e-4)


def test_save_replaces_an_existing_adapter_and_config_fields(tmp_path):
    """A previous adapter directory is replaced as a whole (one holding other files is refused: test_cli)."""
    before = tiny_model()
    apply_lora(before, r=4, alpha=4, target_modules=["v_proj"])
    out = tmp_path / "a"
    save_adapter(before, out)
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(ours, out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == ("LORA", 2, 4, ["q_proj"])


def test_a_save_that_fails_part_way_leaves_the_previous_adapter(tmp_path, monkeypatch):
    """save_adapter writes into a temporary directory renamed into place: one that fails after the weights are
    written (here: the config) leaves the previous adapter as it was, not new weights beside its old config."""
    from chronicals.lora import peft_io

    before = tiny_model()
    apply_lora(before, r=2, alpha=4, target_modules=["q_proj"])
    out = save_adapter(before, tmp_path / "a")
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    ours = tiny_model()
    apply_lora(ours, r=4, alpha=8, target_modules=["v_proj"])
    monkeypatch.setattr(peft_io, "adapter_config_dict", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        save_adapter(ours, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary directory left behind


def test_save_adapter_expands_a_home_path(tmp_path, monkeypatch, ids):
    """An out_dir starting with "~" is written under $HOME (as load_adapter reads it) and that path is returned; it
    went to a literal "./~/a" folder under the working directory, and the returned "~/a" named no adapter."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    randomize_lora_b(ours)
    out = save_adapter(ours, "~/a")
    assert out == home / "a"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (cwd / "~").exists()
    again = tiny_model()
    load_adapter(again, "~/a")
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids))


def test_a_saved_module_with_children_keeps_all_their_parameters(tmp_path, ids):
    """modules_to_save naming a block whose parameters sit in its children (a whole MLP trained beside q_proj
    adapters) saves every one of them and loads back with the trained values; the block was saved with none of
    its parameters and the adapter then failed to load ("missing keys")."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["model.layers.1.mlp"])
    randomize_lora_b(ours)
    with torch.no_grad():
        ours.model.layers[1].mlp.up_proj.weight.add_(0.5)
    out = save_adapter(ours, tmp_path / "a")
    assert "base_model.model.model.layers.1.mlp.up_proj.weight" in load_file(out / "adapter_model.safetensors")
    again = tiny_model()
    load_adapter(again, out)
    torch.testing.assert_close(again.model.layers[1].mlp.up_proj.weight, ours.model.layers[1].mlp.up_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids))


def test_load_adapter_builds_layers_of_the_impl_asked(tmp_path, ids):
    """load_adapter(..., impl="torch") puts reference-path layers on the model, as apply_lora(impl="torch") does,
    with the saved adapter's logits. Dropping the argument (always "fused") gave no failing test: the logits agree."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj", "up_proj"])
    randomize_lora_b(ours)
    with torch.no_grad():
        want = ours(ids)
    out = save_adapter(ours, tmp_path / "a")
    for impl in ("torch", "fused"):
        again = tiny_model()
        load_adapter(again, out, impl=impl)
        mods = lora_modules(again)
        assert mods and all(m.impl == impl for _, m in mods)
        with torch.no_grad():
            torch.testing.assert_close(again(ids), want)


def test_the_adapter_weights_file_says_format_pt(tmp_path):
    """adapter_model.safetensors carries metadata {"format": "pt"}, as PEFT's save_pretrained writes it:
    transformers 4.x and other safetensors readers look for it."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(ours, tmp_path / "a")
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_load_rejects_unsupported_and_mismatched(tmp_path):
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(ours, tmp_path / "a")
    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_adapter(tiny_model(), tmp_path / "a")
    cfg_path.write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(ValueError, match="shape"):
        load_adapter(tiny_model(), tmp_path / "a")
    cfg_path.write_text(json.dumps({**cfg, "target_modules": ["q_proj", "k_proj"]}))
    with pytest.raises(ValueError, match="missing keys"):
        load_adapter(tiny_model(), tmp_path / "a")
    cfg_path.write_text(json.dumps(cfg))  # a lora_A stored transposed (in, r), as a fan_in_fan_out layout has it
    wpath = tmp_path / "a" / "adapter_model.safetensors"
    save_file({k: v.t().contiguous() if "lora_A" in k else v for k, v in load_file(wpath).items()}, wpath)
    with pytest.raises(ValueError, match=r"lora_A\.weight has shape \(32, 2\), the model expects \(2, 32\)"):
        load_adapter(tiny_model(), tmp_path / "a")


@pytest.mark.parametrize("edit,match", [
    (dict(r=0), r"apply_lora: r=0 must be an integer >= 1"),
    (dict(lora_dropout=1.0), r"apply_lora: dropout=1\.0 must be a number in \[0, 1\)"),
    (dict(target_modules=["nope"]), r"apply_lora: target_modules=\('nope',\) matched no nn\.Linear"),
], ids=["r=0", "lora_dropout=1", "target_modules=nope"])
def test_a_value_apply_lora_refuses_in_a_file_names_the_file(tmp_path, edit, match):
    """An adapter_config.json value that apply_lora refuses (r=0, a dropout of 1, targets naming no linear layer)
    is a ValueError starting with that file's path, then apply_lora's reason, and the model is left unfrozen and
    without LoRA. Without load_adapter's re-raise the bare 'apply_lora: r=0 must be ...' named no file."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    out = save_adapter(ours, tmp_path / "a")
    cfg = out / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **edit}))
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(cfg))}: {match}"):
        load_adapter(model, out)
    assert getattr(model, "lora_config", None) is None
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_load_names_a_damaged_weights_file(tmp_path, damage):
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(ours, tmp_path / "a")
    wpath = tmp_path / "a" / "adapter_model.safetensors"
    data = wpath.read_bytes()
    wpath.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    with pytest.raises(ValueError, match=rf"{wpath}: cannot read this safetensors file .*truncated or corrupt.*"
                                         "copy or download it again"):
        load_adapter(tiny_model(), tmp_path / "a")


@pytest.mark.parametrize("text,match", [('{"r": 2,\n "lora_alpha": }',
                                         r":2: invalid JSON \(Expecting value at column 16\); fix the file, or save "
                                         r"the adapter again"),
                                        ("[1, 2]", r"a JSON array, not an object, so not a valid adapter_config"),
                                        ('{"r": 2}', "missing field.s. lora_alpha, target_modules")])
def test_bad_adapter_config_names_the_file(tmp_path, text, match):
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(ours, tmp_path / "a")
    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg_path.write_text(text)
    with pytest.raises(ValueError, match=rf"{cfg_path}{'' if match.startswith(':') else ': '}{match}"):
        load_adapter(tiny_model(), tmp_path / "a")
