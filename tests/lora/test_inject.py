"""apply_lora / merge_lora / lora_plus_param_groups on our decoder."""

import logging

import pytest
import torch

from chronicals.lora import LoRALinear, apply_lora, lora_plus_param_groups, merge_lora

from .conftest import randomize_lora_b, tiny_model

TARGETS7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_zero_b_gives_base_logits_exactly(kind, ids, monkeypatch):
    model = tiny_model(kind)
    # the base model on the same GEMM grouping as LoRA's layers (one GEMM per projection): the plain model
    # joins q/k/v and gate/up into one GEMM each, whose fp32 sums may round differently in the last bit
    monkeypatch.setattr("chronicals.models.fused_proj.fusable", lambda *mods: "separate, as under LoRA")
    with torch.no_grad():
        base = model(ids)
    rec = apply_lora(model, r=4, alpha=8, group=False)
    assert len(rec.lora_modules) == 7 * 2 and all(isinstance(model.get_submodule(n), LoRALinear)
                                                  for n in rec.lora_modules)
    with torch.no_grad():
        assert torch.equal(model(ids), base)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_zero_b_grouped_matches_base_to_fp32_rounding(kind, ids):
    """The default LoRA groups (q/k/v, gate/up) multiply [x, x A^T] by [W, s B] with K = in + R: B = 0 adds
    exact zeros, but the BLAS may block a longer K differently, so the sums agree to fp32 rounding, not bits."""
    model = tiny_model(kind)
    with torch.no_grad():
        base = model(ids)
    apply_lora(model, r=4, alpha=8)
    assert all(getattr(layer.self_attn, "lora_qkv", None) is not None and
               getattr(layer.mlp, "lora_gate_up", None) is not None for layer in model.model.layers)
    with torch.no_grad():
        got = model(ids)
    torch.testing.assert_close(got, base, rtol=1e-6, atol=1e-6)


def test_only_adapters_train_and_both_grads_positive(ids):
    model = tiny_model(tied=True)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, r=4, alpha=8, dropout=0.1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = torch.optim.AdamW(lora_plus_param_groups(model, lr=1e-2), weight_decay=0.0)
    labels = torch.roll(ids, -1, dims=1)
    norms = []
    for _ in range(2):  # step 1: B = 0 so dA = 0; step 2: B moved, both gradients nonzero
        opt.zero_grad()
        model(ids, shift_labels=labels, reduction="mean").backward()
        norms.append({n: p.grad.norm().item() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
    assert all(v > 0 for n, v in norms[1].items()), norms[1]
    assert all(v > 0 for n, v in norms[0].items() if "lora_B" in n)
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"frozen {k} changed"
    assert all(not torch.equal(after[n], torch.zeros_like(after[n])) for n in trainable if "lora_B" in n)


def test_modules_to_save_with_tied_embeddings(ids):
    model = tiny_model(tied=True)
    rec = apply_lora(model, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert rec.saved_modules == ["lm_head", "model.embed_tokens"]  # the tied partner comes along
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.requires_grad
    opt = torch.optim.SGD(lora_plus_param_groups(model, lr=0.1), lr=0.1)
    model(ids, shift_labels=torch.roll(ids, -1, 1)).backward()
    w0 = model.lm_head.weight.clone()
    opt.step()
    assert not torch.equal(model.lm_head.weight, w0)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_only_tied_weights_are_logged_as_shared(caplog):
    with caplog.at_level(logging.INFO, logger="chronicals.lora"):
        rec = apply_lora(tiny_model(), r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert rec.saved_modules == ["lm_head"] and "tied" not in caplog.text
    with caplog.at_level(logging.INFO, logger="chronicals.lora"):
        apply_lora(tiny_model(tied=True), r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert "['lm_head'] share weights with ['model.embed_tokens'] (tied)" in caplog.text


def test_merge_gives_same_logits_and_plain_modules(ids):
    model = tiny_model("qwen2")
    apply_lora(model, r=4, alpha=16, use_rslora=True)
    randomize_lora_b(model)
    with torch.no_grad():
        want = model(ids)
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert not any("lora" in k for k in model.state_dict()) and not hasattr(model, "lora_config")
    assert not any(m.training for m in model.modules())  # eval mode survives apply + merge
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(tiny_model("qwen2").state_dict())


def test_rslora_scaling(ids):
    plain, rs = tiny_model(), tiny_model()
    apply_lora(plain, r=16, alpha=8, target_modules=["v_proj"])
    apply_lora(rs, r=16, alpha=8, target_modules=["v_proj"], use_rslora=True)
    assert plain.lora_config.scaling == 0.5 and rs.lora_config.scaling == 2.0
    assert all(m.scaling == 2.0 for m in rs.modules() if isinstance(m, LoRALinear))
    randomize_lora_b(plain)
    randomize_lora_b(rs)
    v, vr = plain.model.layers[0].self_attn.v_proj, rs.model.layers[0].self_attn.v_proj
    x = torch.randn(3, 32)
    base = torch.nn.functional.linear(x, v.weight)
    torch.testing.assert_close((vr(x) - base), 4 * (v(x) - base), rtol=1e-5, atol=1e-6)


def test_lora_plus_groups():
    model = tiny_model("qwen2", tied=True)
    apply_lora(model, r=2, alpha=4, modules_to_save=["embed_tokens", "norm"])
    groups = {g["name"]: g for g in lora_plus_param_groups(model, 1e-3, ratio=8.0, weight_decay=0.1)}
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = {k: sorted(by_id[id(p)] for p in g["params"]) for k, g in groups.items()}
    assert set(groups) == {"lora_A", "lora_B", "full", "no_decay"}
    assert names["lora_A"] == sorted(n for n in by_id.values() if n.endswith("lora_A.weight"))
    assert names["lora_B"] == sorted(n for n in by_id.values() if n.endswith("lora_B.weight"))
    assert names["full"] == ["model.embed_tokens.weight"]  # tied lm_head: the same tensor, listed once
    assert names["no_decay"] == ["model.norm.weight"]  # q/k/v biases are frozen: not in any group
    assert (groups["lora_A"]["lr"], groups["lora_B"]["lr"], groups["full"]["lr"]) == (1e-3, 8e-3, 1e-3)
    assert groups["lora_A"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert sum(len(g["params"]) for g in groups.values()) == n_trainable
    torch.optim.AdamW(list(groups.values()))  # accepted by a torch optimizer as is



def test_lora_plus_defaults_are_the_papers_ratio_without_weight_decay():
    """Called with lr alone: every B at 16 x lr (LoRA+'s default ratio), A and the other trainables at lr, and no group
    decays its weights (a torch optimizer's own weight_decay default does not reach groups that set one)."""
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head", "norm"])
    groups = {g["name"]: g for g in lora_plus_param_groups(model, 1e-3)}
    assert {k: g["lr"] for k, g in groups.items()} == pytest.approx(
        {"lora_A": 1e-3, "lora_B": 16e-3, "full": 1e-3, "no_decay": 1e-3})
    assert all(g["weight_decay"] == 0.0 for g in groups.values())

def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"matched no nn.Linear.*q_proj.*\(in a config: lora.targets\)"):
        apply_lora(tiny_model(), target_modules=["qkv"])
    with pytest.raises(ValueError, match="lm_head is not supported.*modules_to_save"):
        apply_lora(tiny_model(), target_modules=["lm_head"])
    model = tiny_model()
    apply_lora(model, r=2)
    with pytest.raises(RuntimeError, match="merge_lora"):
        apply_lora(model, r=2)
    with pytest.raises(ValueError, match="apply_lora"):
        lora_plus_param_groups(tiny_model(), 1e-3)


def test_fp32_adapters_on_bf16_base(ids):
    """adapter_dtype=float32 on a bf16 model: fp32 A/B receive fp32 gradients through their fp32 branch (PEFT's
    computation, tests/lora/test_adapter_dtype.py)."""
    model = tiny_model().to(torch.bfloat16)
    apply_lora(model, r=4, alpha=8, adapter_dtype=torch.float32)
    randomize_lora_b(model)
    model(ids, shift_labels=torch.roll(ids, -1, 1)).backward()
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 and p.grad.norm() > 0 for _, p in lora)


def test_bf16_merge_rounds_once():
    """A bf16 merge stores round(W + s B A), computed in fp32: adding the bf16-rounded delta to W rounded twice,
    and ~46% of the elements of a merged export then differed from the correctly rounded sum."""
    model = tiny_model("llama").to(torch.bfloat16)
    apply_lora(model, r=4, alpha=8, target_modules=["q_proj"], group=False)
    randomize_lora_b(model)
    mod = model.model.layers[0].self_attn.q_proj
    want = (mod.weight.float() + mod.delta_weight()).to(torch.bfloat16)
    twice = mod.weight + mod.delta_weight().to(torch.bfloat16)
    assert not torch.equal(twice, want)  # double rounding differs here, so the test can fail
    merge_lora(model)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, want)


def test_merge_without_adapters_is_refused():
    """merge_lora on a model without LoRA (never adapted, or merged already) says so instead of a silent no-op."""
    with pytest.raises(ValueError, match=r"merge_lora: the model has no LoRA adapters \(apply_lora or load_adapter"):
        merge_lora(tiny_model())
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    merge_lora(model)
    with pytest.raises(ValueError, match="merge_lora: the model has no LoRA adapters"):
        merge_lora(model)


def test_the_record_prints_counts_not_every_module_name():
    """apply_lora's result in a REPL: the dataclass repr listed every LoRA module (210 names on SmolLM2); now the
    settings, the counts and one name, with the fields that say what was done."""
    model = tiny_model()
    rec = apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])
    text = repr(rec)
    assert len(rec.lora_modules) == 6 and text.count("layers.") == 1, text
    assert "lora_modules=['model.layers.0.self_attn.q_proj', ... 6 in all]" in text
    assert "r=2, alpha=4" in text and "saved_modules=[]" in text
    assert f"trainable_params={rec.trainable_params:,}" in text
