"""adapter_config.json fields that the logit round trips of test_peft.py cannot see: lora_dropout (off in eval
mode), every PEFT option we do not implement (test_peft.py tries use_dora only), and a tied lm_head trained by
the adapter, which only shows once the merged model is saved and loaded again (`chronicals export`)."""

import json
import re

import peft
import pytest
import torch
import torch.nn as nn
import transformers
from safetensors.torch import load_file, save_file

import chronicals
from chronicals.lora import apply_lora, load_adapter, lora_modules, merge_lora, save_adapter
from chronicals.lora.group import LoRAGroup

from .conftest import hf_config, peft_adapter, randomize_lora_b, tiny_model


def _saved(tmp_path, **config):
    """A q_proj adapter saved from the tiny model, its adapter_config.json updated with ``config`` -> its dir."""
    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    out = save_adapter(model, tmp_path / "a")
    cfg = out / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **config}))
    return out


def test_adapter_keeps_its_dropout(tmp_path):
    """lora_dropout is written to adapter_config.json (PEFT reads it back) and applied by load_adapter, so an
    adapter trained further, by PEFT or by us, keeps its dropout instead of training on without it."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, dropout=0.1, target_modules=["q_proj", "down_proj"])
    save_adapter(ours, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    assert peft.LoraConfig.from_pretrained(tmp_path / "a").lora_dropout == 0.1
    again = tiny_model()
    assert load_adapter(again, tmp_path / "a").dropout == 0.1
    assert [m.dropout for _, m in lora_modules(again)] == [0.1] * 4


def test_a_config_without_lora_dropout_loads_without_dropout(tmp_path, ids):
    """A hand-written adapter_config.json without lora_dropout loads with PEFT's default 0.0, on the record and on
    every layer, so a train-mode forward draws no mask. Any other default went unseen: the minimal-config load
    compares eval-mode logits, where dropout is off."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    randomize_lora_b(ours)
    out = save_adapter(ours, tmp_path / "a")
    (out / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    again = tiny_model()
    rec = load_adapter(again, out)
    assert rec.dropout == 0.0 and all(m.dropout == 0.0 for _, m in lora_modules(again))
    again.train()
    with torch.no_grad():
        torch.testing.assert_close(again(ids), again(ids), rtol=0, atol=0)


def test_modules_to_save_is_null_without_saved_modules_as_peft_writes_it(tmp_path):
    """adapter_config.json's modules_to_save is null when the adapter trains no module in full (as PEFT writes it)
    and the names otherwise; an empty list written for "none" went unnoticed."""
    plain = tiny_model()
    apply_lora(plain, r=2, alpha=4, target_modules=["q_proj"])
    cfg = json.loads((save_adapter(plain, tmp_path / "a") / "adapter_config.json").read_text())
    assert "modules_to_save" in cfg and cfg["modules_to_save"] is None
    head = tiny_model()
    apply_lora(head, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    cfg = json.loads((save_adapter(head, tmp_path / "b") / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["lm_head"]


def test_peft_loads_our_adapter_as_a_causal_lm_model(tmp_path):
    """adapter_config.json says task_type CAUSAL_LM, so PEFT loads our adapter as a PeftModelForCausalLM (its
    generate and prepare_inputs hooks), not a bare PeftModel. task_type null went unseen: the logit round trip is
    the same for both classes."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    out = save_adapter(ours, tmp_path / "a")
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    pm = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(hf_config()).eval(), out)
    assert isinstance(pm, peft.PeftModelForCausalLM)


UNSUPPORTED = [("fan_in_fan_out", True), ("rank_pattern", {"q_proj": 4}),
               ("alpha_pattern", {"q_proj": 8}), ("layers_to_transform", [0]), ("lora_bias", True),
               ("target_parameters", ["mlp.experts.gate_up_proj"]), ("layer_replication", [[0, 2]]),
               ("trainable_token_indices", [1, 2]), ("exclude_modules", ["k_proj"]),
               # initializations that rewrite W (only A and B are saved), PEFT's LoRA variants, a future field
               ("init_lora_weights", "corda"), ("init_lora_weights", "loftq"), ("init_lora_weights", "lora_ga"),
               ("init_lora_weights", "some_new_init"), ("use_qalora", True),
               ("kasa_config", {"svd_weight": 0.1}), ("velora_config", {"rank": 2}), ("monteclora_config", {"n": 4}),
               ("use_bdlora", {"nblocks": 2}), ("arrow_config", {"top_k": 3}), ("use_future_variant", True)]


@pytest.mark.parametrize("key,val", UNSUPPORTED, ids=[f"{k}={v}" for k, v in UNSUPPORTED])
def test_every_unsupported_peft_option_is_refused(tmp_path, key, val):
    """An adapter that sets any PEFT option chronicals does not implement fails to load, naming the option,
    instead of loading and computing something other than PEFT would."""
    out = _saved(tmp_path, **{key: val})
    with pytest.raises(ValueError, match=rf"{out / 'adapter_config.json'}: {key}=.* is not supported by "
                                         r"chronicals.lora.*PEFT"):
        load_adapter(tiny_model(), out)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_bias_option_that_trains_no_bias_loads_as_peft_saved_it(tmp_path, ids, bias):
    """PEFT's bias="all" / "lora_only" on a model without biases (Llama, SmolLM2) trains and saves nothing more than
    "none": such an adapter loads with PEFT's logits. It was refused as 'not supported'."""
    hf = transformers.LlamaForCausalLM(hf_config()).eval()
    ours = tiny_model()
    hf.load_state_dict(ours.state_dict(), strict=False)
    want = peft_adapter(hf, None, ids, tmp_path / "a", bias=bias)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["bias"] == bias
    load_adapter(ours, tmp_path / "a")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bias,targets", [("all", ["o_proj"]), ("lora_only", ["q_proj"])])
def test_a_bias_option_that_trains_biases_is_refused_naming_one(tmp_path, bias, targets):
    """On Qwen2 (q/k/v biases) PEFT's bias option saves trained biases (q_proj.base_layer.bias ...), which
    chronicals does not load: refused before the model changes, naming the option and a bias. "all" trains every
    bias even with LoRA on o_proj alone (no bias of its own); "lora_only" those of the targets."""
    import peft

    hf = transformers.Qwen2ForCausalLM(hf_config("qwen2")).eval()
    peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, bias=bias)) \
        .save_pretrained(tmp_path / "a")
    ours = tiny_model("qwen2")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=rf"bias='{bias}' trains \d+ bias\(es\) of this model \(such as "
                                         r"model\.layers\.0\.self_attn\.q_proj\.bias\).*merge_and_unload"):
        load_adapter(ours, tmp_path / "a")
    assert not hasattr(ours, "lora_config") and ours.state_dict().keys() == before.keys()


def test_lora_only_on_targets_without_biases_loads_on_qwen2(tmp_path, ids):
    """bias="lora_only" with LoRA on o_proj alone (Qwen2's o_proj has no bias) trains nothing more than "none"."""
    hf = transformers.Qwen2ForCausalLM(hf_config("qwen2")).eval()
    ours = tiny_model("qwen2")
    hf.load_state_dict(ours.state_dict(), strict=False)
    import peft

    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], bias="lora_only"))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
        want = pm.eval()(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "a")
    load_adapter(ours, tmp_path / "a")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), want, rtol=2e-5, atol=2e-5)


def test_a_bias_value_peft_does_not_have_is_refused(tmp_path):
    out = _saved(tmp_path, bias="some")
    with pytest.raises(ValueError, match=r"bias='some' is not one of PEFT's values \('none', 'all', 'lora_only'\)"):
        load_adapter(tiny_model(), out)


def test_rank_and_alpha_patterns_at_the_global_values_load(tmp_path, ids):
    """rank_pattern {"q_proj": r} (and alpha_pattern at lora_alpha) change nothing, but were refused."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"])
    with torch.no_grad():
        ours.model.layers[0].self_attn.q_proj.lora_B.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
        want = ours.eval()(ids)
    save_adapter(ours, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rank_pattern": {"q_proj": 2},
                                "alpha_pattern": {"q_proj": 4}}))
    again = tiny_model()
    load_adapter(again, tmp_path / "a")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids), want, rtol=0, atol=0)


def _tied_pair():
    """(our tiny tied llama, transformers' eager LlamaForCausalLM with the same weights)."""
    ours = tiny_model(tied=True)
    cfg = hf_config("llama", tied=True)
    cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(ours.state_dict(), strict=False)
    return ours, hf


def test_a_trained_tied_lm_head_survives_merge_save_and_load(tmp_path, ids):
    """A PEFT adapter with modules_to_save=[lm_head] on a tied model (SmolLM2, small Qwen2.5): load_adapter
    unties lm_head as PEFT does, and the merged model saved as an HF directory (what `chronicals export` does)
    says it is untied and carries that lm_head, so it loads back with PEFT's logits. Left marked as tied, the
    directory would hold no lm_head and the reloaded model would tie it to the embedding again."""
    ours, hf = _tied_pair()
    want = peft_adapter(hf, ["lm_head"], ids, tmp_path / "peft")
    load_adapter(ours, tmp_path / "peft")
    merge_lora(ours)
    out = chronicals.save_model(ours, None, tmp_path / "merged")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    again, _ = chronicals.load_model(out, tokenizer=False)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), want, rtol=1e-4, atol=1e-4)


def test_a_run_or_model_directory_given_as_the_adapter_is_told_what_to_pass(tmp_path):
    """--adapter runs/x (the run, whose adapter/ holds the files) or --adapter of a model directory said only
    "adapter_config.json: not found; a PEFT adapter directory holds ...", no word of the directory to pass."""
    from chronicals.lora import read_adapter_config

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    with pytest.raises(FileNotFoundError, match=rf"adapter_config\.json: not found; .*pass {run / 'adapter'}"):
        read_adapter_config(run)
    model = tmp_path / "merged"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json: not found; this is a model directory "
                                                r"\(config\.json\), not a LoRA adapter: pass it as --model"):
        read_adapter_config(model)


def test_tied_lm_head_and_embedding_trained_apart_by_peft_load_apart(tmp_path, ids):
    """PEFT's modules_to_save=[lm_head, embed_tokens] on a tied model trains two private copies and saves both.
    Both were copied into our one shared Parameter (the last key won), so the embedding ran with lm_head's values:
    logits off by more than their own size. Now the two are untied when the file's values differ, and stay so
    through merge, save and load (what `chronicals export` does)."""
    ours, hf = _tied_pair()
    want = peft_adapter(hf, ["lm_head", "embed_tokens"], ids, tmp_path / "peft")
    load_adapter(ours, tmp_path / "peft")
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), want, rtol=1e-4, atol=1e-4)
    merge_lora(ours)
    again, _ = chronicals.load_model(chronicals.save_model(ours, None, tmp_path / "merged"), tokenizer=False)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), want, rtol=1e-4, atol=1e-4)


def test_a_peft_adapter_with_ensure_weight_tying_loads_tied(tmp_path, ids):
    """PEFT asks for ensure_weight_tying=True when a tied lm_head is in modules_to_save (one trained copy for both
    modules): such an adapter loads with PEFT's logits, the pair still tied. The field must not be refused as one of
    a LoRA variant's."""
    ours, hf = _tied_pair()
    want = peft_adapter(hf, ["lm_head"], ids, tmp_path / "peft", ensure_weight_tying=True)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["ensure_weight_tying"] is True
    load_adapter(ours, tmp_path / "peft")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), want, rtol=1e-4, atol=1e-4)


def test_our_tied_adapter_with_both_modules_stays_tied(tmp_path):
    """save_adapter writes the shared tensor under both names (equal values): loading keeps them one Parameter."""
    ours = tiny_model(tied=True)
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    save_adapter(ours, tmp_path / "a")
    again = tiny_model(tied=True)
    load_adapter(again, tmp_path / "a")
    assert again.lm_head.weight is again.model.embed_tokens.weight and again.config.tie_word_embeddings


def test_a_tied_pair_absent_from_the_file_is_named_as_missing_keys(tmp_path):
    """A config that trains the tied lm_head / embed_tokens pair with a file holding neither tensor is refused with
    the "missing keys" message naming them (it was a bare KeyError), and the model keeps no LoRA and stays tied."""
    ours = tiny_model(tied=True)
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    out = save_adapter(ours, tmp_path / "a")
    wpath = out / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(wpath).items() if "lora_" in k}, wpath, metadata={"format": "pt"})
    model = tiny_model(tied=True)
    with pytest.raises(ValueError, match=r"missing keys .*(lm_head|embed_tokens)"):
        load_adapter(model, out)
    assert getattr(model, "lora_config", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings
    assert not any("lora_" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_a_failed_load_leaves_the_model_as_it_was(tmp_path, ids, tied, caplog):
    """An adapter refused by the key or shape check (a file of another model) left LoRA applied, the base frozen, a
    tied lm_head untied, and the tensors copied before the bad one in place: the final norm's base weight overwritten. A
    second load_adapter then said 'call merge_lora(model) first', which merged the half-loaded adapter into W. Now the
    model is as it was: same modules, flags, ties and weights, and the right adapter loads on it."""
    from safetensors.torch import load_file, save_file

    from chronicals.lora import LoRALinear

    from .conftest import randomize_lora_b

    src = tiny_model(tied=tied)
    apply_lora(src, r=2, alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "norm"])
    randomize_lora_b(src)
    with torch.no_grad():
        src.lm_head.weight.add_(0.5)
        src.model.norm.weight.add_(0.5)
        want_adapted = src(ids)
    save_adapter(src, tmp_path / "good")
    save_adapter(src, tmp_path / "bad")
    wpath = tmp_path / "bad" / "adapter_model.safetensors"
    tensors = load_file(wpath)
    tensors["base_model.model.lm_head.weight"] = torch.ones(5, 32)  # read after model.norm's tensor
    if tied:  # lm_head alone in the file: load_adapter unties it from the embedding first
        del tensors["base_model.model.model.embed_tokens.weight"]
    save_file(tensors, wpath)
    model = tiny_model(tied=tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids)
    with caplog.at_level("WARNING", logger="chronicals.lora"), \
            pytest.raises(ValueError, match=r"lm_head.weight has shape \(5, 32\)"):
        load_adapter(model, tmp_path / "bad")
    assert "untied" not in caplog.text  # said 'untied them as PEFT does' of the untying it then undid
    assert getattr(model, "lora_config", None) is None and not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied == model.config.tie_word_embeddings
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(model(ids), want)
    load_adapter(model, tmp_path / "good")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want_adapted, rtol=1e-5, atol=1e-5)
    if tied:  # an accepted file that holds lm_head alone: untied, and said
        tensors = load_file(tmp_path / "good" / "adapter_model.safetensors")
        del tensors["base_model.model.model.embed_tokens.weight"]
        save_file(tensors, tmp_path / "good" / "adapter_model.safetensors")
        caplog.clear()
        with caplog.at_level("WARNING", logger="chronicals.lora"):
            load_adapter(tiny_model(tied=tied), tmp_path / "good")
        assert "but not its tied partner(s) ['model.embed_tokens']; untied them as PEFT does" in caplog.text


def test_a_failed_load_gives_each_base_weight_its_own_storage(tmp_path):
    """A refused file (r edited, so no shape fits) leaves every base weight contiguous in a storage of its own size;
    q/k/v and gate/up stayed strided views into the freed LoRA group's [W | s B] buffer, which they kept alive. No
    module keeps a LoRAGroup either: with the groups left bound, the attention and MLP blocks held the refused LoRA
    layers and their concatenated weight buffers (a copy of every q/k/v and gate/up W) until the next load."""
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4)  # all seven projections: q/k/v and gate/up grouped
    assert {k for _, m in ours.named_modules() for k, v in vars(m).items() if isinstance(v, LoRAGroup)} == {
        "group", "lora_gate_up", "lora_qkv"}
    out = save_adapter(ours, tmp_path / "a")
    cfg = out / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "r": 3}))
    model = tiny_model()
    with pytest.raises(ValueError, match="shape"):
        load_adapter(model, out)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            w = mod.weight
            assert type(mod) is nn.Linear and w.is_contiguous(), name
            assert w.untyped_storage().nbytes() == w.numel() * w.element_size(), name
    # no block's lora_qkv / lora_gate_up, no member's group
    assert [(n, k) for n, m in model.named_modules() for k, v in vars(m).items() if isinstance(v, LoRAGroup)] == []


def test_all_linear_as_a_string_is_peft_shorthand_in_a_file_and_in_apply_lora(tmp_path, ids):
    """target_modules "all-linear" (a string, as PEFT reads it: every linear layer but the output) was read as a
    regular expression that matched nothing: refused with "matched no nn.Linear". PEFT loads such a file."""
    ours = tiny_model()
    rec = apply_lora(ours, r=2, alpha=4, target_modules="all-linear")
    seven = sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert sorted({n.rsplit(".", 1)[1] for n, _ in lora_modules(ours)}) == seven
    assert rec.target_modules == tuple(seven)  # saved as the names PEFT resolves all-linear to, not 14 full names
    randomize_lora_b(ours)
    with torch.no_grad():
        want = ours.eval()(ids)
    save_adapter(ours, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "target_modules": "all-linear"}))
    again = tiny_model()
    load_adapter(again, tmp_path / "a")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids), want, rtol=0, atol=0)
    hf = transformers.LlamaForCausalLM(hf_config()).eval()  # PEFT reads the file the same way: 7 targets a layer
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "a")
    assert sum("lora_A" in n for n, _ in pm.named_parameters()) == 2 * 7


def test_a_regex_target_modules_round_trips_as_that_string(tmp_path, ids):
    """A regular-expression target_modules (one string) is written to adapter_config.json as that string and loads
    back onto the same modules with the same logits; it was sorted into a list of its characters."""
    regex = r"model\.layers\.\d+\.self_attn\.(q|v)_proj"
    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=regex)
    randomize_lora_b(ours)
    out = save_adapter(ours, tmp_path / "a")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == regex
    again = tiny_model()
    assert load_adapter(again, out).target_modules == regex
    assert [n for n, _ in lora_modules(again)] == [n for n, _ in lora_modules(ours)]
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids))


def test_a_modules_to_save_entry_is_a_plain_suffix_as_in_peft(tmp_path):
    """PEFT matches a modules_to_save entry as a plain suffix of the module name: "norm" is model.norm and every
    layer's input_layernorm and post_attention_layernorm. Matched at a dot, it named model.norm only and the file's
    layernorm tensors were refused as unexpected keys."""
    ours = tiny_model()
    norms = [n for n, _ in ours.named_modules() if n.endswith("norm")]
    assert len(norms) == 5  # model.norm and two per layer
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=norms)
    with torch.no_grad():
        ours.model.layers[0].input_layernorm.weight.add_(0.25)
    out = save_adapter(ours, tmp_path / "a")
    cfg = out / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "modules_to_save": ["norm"]}))
    again = tiny_model()
    assert sorted(load_adapter(again, out).saved_modules) == sorted(norms)
    torch.testing.assert_close(again.model.layers[0].input_layernorm.weight,
                               ours.model.layers[0].input_layernorm.weight)


def test_a_modules_to_save_entry_matching_nothing_is_left_out_as_peft_does(tmp_path, ids, caplog):
    """PEFT skips a modules_to_save entry that names no module (a sequence-classification "score" in a causal LM's
    adapter); it was refused here. Tensors saved under such a name are still unexpected keys."""
    import logging

    from safetensors.torch import load_file, save_file

    ours = tiny_model()
    apply_lora(ours, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    randomize_lora_b(ours)
    with torch.no_grad():
        want = ours.eval()(ids)
    save_adapter(ours, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "modules_to_save": ["lm_head", "score"]}))
    again = tiny_model()
    with caplog.at_level(logging.WARNING, logger="chronicals.lora"):
        load_adapter(again, tmp_path / "a")
    assert "modules_to_save entries ['score'] match no module of this model; left out, as PEFT does" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids), want, rtol=0, atol=0)
    weights = tmp_path / "a" / "adapter_model.safetensors"
    save_file({**load_file(str(weights)), "base_model.model.score.weight": torch.zeros(2, 32)}, str(weights))
    with pytest.raises(ValueError, match=r"unexpected keys \['base_model.model.score.weight'\]"):
        load_adapter(tiny_model(), tmp_path / "a")


def test_an_adapter_file_with_nan_or_integer_tensors_is_refused(tmp_path):
    """A lora_A full of NaN loaded without a word (chat answered '', export wrote a NaN model, exit 0), as would
    one with a few infinite values; an integer tensor was refused by dtype. All name the file and the tensor; the
    model is left as it was."""
    from safetensors.torch import load_file, save_file

    src = tiny_model()
    apply_lora(src, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(src, tmp_path / "a")
    wpath = tmp_path / "a" / "adapter_model.safetensors"
    good = load_file(wpath)
    key = next(k for k in good if "lora_A" in k)
    for bad, said in ((good[key] * float("nan"), rf"tensor {key} holds {good[key].numel()} NaN or infinite value"),
                      (good[key].index_fill(1, torch.tensor([0]), float("inf")), rf"tensor {key} holds 2 NaN or inf"),
                      (good[key].to(torch.int32), rf"tensor {key} is stored as torch.int32, not as floating point")):
        save_file({**good, key: bad}, wpath)
        model = tiny_model()
        with pytest.raises(ValueError, match=rf"^{wpath}: {said}"):
            load_adapter(model, tmp_path / "a")
        assert getattr(model, "lora_config", None) is None


def test_an_empty_checkpoint_directory_as_an_adapter_says_what_it_is(tmp_path):
    """runs/x/checkpoints/step-N without its state.pt (a removal cut short) was told to be a PEFT adapter missing
    adapter_config.json (a checkpoint walk)."""
    import pytest

    from chronicals.lora.peft_io import read_adapter_config

    step = tmp_path / "checkpoints" / "step-000005"
    step.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"step-000005 is a run's checkpoint directory without its state.pt"):
        read_adapter_config(step)


def test_a_checkpoint_directory_given_as_an_adapter_says_what_it_is(tmp_path):
    """runs/x/checkpoints/step-N (with its state.pt) given as a PEFT adapter is named a training checkpoint, with how
    to use one (apply_checkpoint_adapter, export --no-merge), by read_adapter_config and load_adapter; without that
    hint only 'a PEFT adapter directory holds ...' was said. The model is left without LoRA."""
    from chronicals.lora import read_adapter_config

    step = tmp_path / "run" / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"not read")
    cfg, here = re.escape(str(step / "adapter_config.json")), re.escape(str(step))
    match = (rf"{cfg}: not found; a PEFT adapter directory holds adapter_config\.json and "
             rf"adapter_model\.safetensors; {here} is a training checkpoint \(state\.pt\), not a PEFT adapter: .*"
             r"apply_checkpoint_adapter\(model, path\).*export --no-merge")
    with pytest.raises(FileNotFoundError, match=match):
        read_adapter_config(step)
    model = tiny_model()
    with pytest.raises(FileNotFoundError, match=match):
        load_adapter(model, step)
    assert getattr(model, "lora_config", None) is None


def test_an_adapter_with_whole_embedding_layers_says_what_it_holds(tmp_path):
    """PEFT's save_embedding_layers=True (its "auto" after resize_token_embeddings) writes embed_tokens and lm_head
    whole: refused as "was it saved for a different model?" even on its own base (a LoRA walk). The refusal names
    the layers and the fix."""
    import peft
    import pytest
    import transformers

    from chronicals import load_model, save_model
    from chronicals.lora import load_adapter
    from chronicals.models import CausalLM, ModelConfig

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    base = save_model(CausalLM(ModelConfig.from_hf_dict(cfg.to_dict())).init_weights(seed=0), None, tmp_path / "b")
    pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                             peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    pm.save_pretrained(tmp_path / "peft", save_embedding_layers=True)
    model, _ = load_model(base, tokenizer=False)
    with pytest.raises(ValueError, match=r"holds whole embedding layers outside its modules_to_save .*"
                                         r"save_embedding_layers=True"):
        load_adapter(model, tmp_path / "peft")


def test_an_adapter_of_a_loaded_model_records_its_base(tmp_path):
    """load_model recorded no base: a run continued from a loaded model (load_adapter, then train(model=...)) wrote
    base_model_name_or_path null, and export / chat / eval --adapter fell back to the embedded model (a LoRA walk)."""
    import transformers

    from chronicals import load_model, save_model
    from chronicals.lora import apply_lora, save_adapter
    from chronicals.models import CausalLM, ModelConfig

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    base = save_model(CausalLM(ModelConfig.from_hf_dict(cfg.to_dict())).init_weights(seed=0), None, tmp_path / "b")
    model, _ = load_model(base, tokenizer=False)
    apply_lora(model, r=4, alpha=8, seed=0)
    saved = json.loads((save_adapter(model, tmp_path / "a") / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base.resolve())
    other = json.loads((save_adapter(model, tmp_path / "c", base_model_name_or_path="x") / "adapter_config.json")
                       .read_text())
    assert other["base_model_name_or_path"] == "x"


def test_hand_written_and_partly_set_configs_load(tmp_path, ids):
    """A config without peft_type (r, lora_alpha, target_modules only) is a LoRA adapter; init_lora_weights null
    (hand edits, some PEFT versions) concerns only the init the file overwrites; an unknown field left empty (null,
    false, "", {}, [], a newer PEFT's default) loads, and one that is set is refused."""
    from chronicals.lora import read_adapter_config

    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    randomize_lora_b(model)
    with torch.no_grad():
        want = model(ids)
    out = save_adapter(model, tmp_path / "a")
    (out / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    again = tiny_model()
    load_adapter(again, out)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), want)
    assert load_adapter(tiny_model(), _saved(tmp_path / "n", init_lora_weights=None)).r == 2
    for val in (None, False, "", {}, []):
        assert read_adapter_config(_saved(tmp_path / repr(val), some_future_option=val))["some_future_option"] == val
    with pytest.raises(ValueError, match=r"some_future_option=\[1\] is not supported"):
        read_adapter_config(_saved(tmp_path / "set", some_future_option=[1]))


@pytest.mark.parametrize("field", ["modules_to_save", "target_modules"])
@pytest.mark.parametrize("entries", [["q_proj", 3], [None], [["q_proj"]]])
def test_module_name_entries_must_be_names(tmp_path, field, entries):
    """A list holding a non-string: a ValueError naming the field, not a TypeError from the name matching. The
    public read_adapter_config checks it itself (cli_models reads configs through it): target_modules [..., 3] was
    returned unchecked there."""
    from chronicals.lora import read_adapter_config

    out = _saved(tmp_path, **{field: entries})
    for read in (read_adapter_config, lambda d: load_adapter(tiny_model(), d)):
        with pytest.raises(ValueError, match=rf"adapter_config.json: {field}=.* must be a list of module names"):
            read(out)


def test_a_missing_adapter_directory_is_file_not_found(tmp_path):
    """An adapter directory that does not exist is a FileNotFoundError naming it and what an adapter directory
    holds, from read_adapter_config and load_adapter, the model left without LoRA. Callers tell a missing path from
    a bad file by the exception type: as a ValueError it would read as a damaged adapter."""
    from chronicals.lora import read_adapter_config

    gone = tmp_path / "runs" / "demo" / "adaptr"
    match = rf"{re.escape(str(gone))}: no such directory; an adapter is the directory holding adapter_config\.json"
    with pytest.raises(FileNotFoundError, match=match):
        read_adapter_config(gone)
    model = tiny_model()
    with pytest.raises(FileNotFoundError, match=match):
        load_adapter(model, gone)
    assert getattr(model, "lora_config", None) is None


def test_an_adapter_file_given_for_its_directory_or_a_weights_folder_is_named(tmp_path):
    """adapter_config.json (or the weights file) passed instead of its directory names the directory to pass, not
    'adapter_config.json/adapter_config.json: not found'; a weights path that is a folder says so (not 'not found
    ... convert adapter_model.bin') and the model is left unchanged."""
    from chronicals.lora import read_adapter_config

    out = _saved(tmp_path)
    for path in (out / "adapter_config.json", out / "adapter_model.safetensors"):
        with pytest.raises(ValueError, match=rf"{path}: is a file; an adapter is the directory holding "
                                             rf".*\(pass {out}\)"):
            read_adapter_config(path)
    with pytest.raises(ValueError, match=rf"is a file; .*\(pass {out}\)"):
        load_adapter(tiny_model(), out / "adapter_config.json")
    (out / "adapter_model.safetensors").unlink()
    (out / "adapter_model.safetensors").mkdir()
    again = tiny_model()
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: is a directory, not a file; save the adapter "
                                         r"again"):
        load_adapter(again, out)
    assert getattr(again, "lora_config", None) is None


def test_missing_adapter_keys_are_named_even_beside_embedding_layers(tmp_path):
    """The 'whole embedding layers outside modules_to_save' diagnosis is given only when those layers are all that
    is wrong: a file that also lacks adapter keys gets the missing / unexpected keys message naming them."""
    from safetensors.torch import load_file, save_file

    out = _saved(tmp_path)
    wpath = out / "adapter_model.safetensors"
    tensors = load_file(wpath)
    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(61, 32)
    save_file(tensors, wpath)
    with pytest.raises(ValueError, match="holds whole embedding layers outside its modules_to_save"):
        load_adapter(tiny_model(), out)
    del tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, wpath)
    with pytest.raises(ValueError, match=r"missing keys \['base_model\.model\.model\.layers\.1\.self_attn\.q_proj\."
                                         r"lora_B\.weight'\] \(1\), unexpected keys .*embed_tokens"):
        load_adapter(tiny_model(), out)


def test_tied_modules_loaded_apart_both_train(tmp_path):
    """A tied lm_head / embed_tokens pair saved with different values is untied on load and both copies stay
    trainable, as in PEFT (a further run updates both)."""
    from safetensors.torch import load_file, save_file

    model = tiny_model(tied=True)
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    out = save_adapter(model, tmp_path / "a")
    wpath = out / "adapter_model.safetensors"
    tensors = load_file(wpath)
    tensors["base_model.model.model.embed_tokens.weight"] = tensors["base_model.model.lm_head.weight"] + 0.5
    save_file(tensors, wpath)
    again = tiny_model(tied=True)
    rec = load_adapter(again, out)
    lm, emb = again.lm_head.weight, again.model.embed_tokens.weight
    assert lm is not emb and not again.config.tie_word_embeddings
    assert set(rec.saved_modules) == {"lm_head", "model.embed_tokens"} and lm.requires_grad and emb.requires_grad
    assert torch.equal(emb, tensors["base_model.model.model.embed_tokens.weight"])
    assert torch.equal(lm, tensors["base_model.model.lm_head.weight"])


def test_adapter_state_dict_values_and_a_path_as_the_base(tmp_path):
    """adapter_state_dict's value() (the trainer's fp32 masters) must give each parameter's own shape (a wrong one is
    named, not written into the file); save_adapter writes a pathlib.Path base as its string (json.dumps raised
    TypeError after the weights were written)."""
    from chronicals.lora import read_adapter_config
    from chronicals.lora.peft_io import adapter_state_dict

    model = tiny_model()
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"value\(\) gave a tensor of shape \(64,\) for a parameter of shape "
                                         r"\(2, 32\)"):
        adapter_state_dict(model, value=lambda p: p.flatten())
    sd = adapter_state_dict(model, value=lambda p: p * 2)
    assert len(sd) == 4 and sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (2, 32)
    out = save_adapter(model, tmp_path / "a", base_model_name_or_path=tmp_path / "base")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    assert read_adapter_config(out)["base_model_name_or_path"] == str(tmp_path / "base")


def test_an_adapter_saved_as_bin_names_the_peft_calls_that_rewrite_it(tmp_path):
    """Only safetensors adapters are read. Beside an adapter_model.bin the error said "convert adapter_model.bin with
    PEFT first", and PEFT has no converter command: it names the two calls now (a walk of export and PEFT interop).
    Without a .bin it only says what is missing."""
    out = _saved(tmp_path)
    (out / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors: not found \(only safetensors adapters "
                                                r"are read\)$"):
        load_adapter(tiny_model(), out)
    (out / "adapter_model.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.bin is there: rewrite it as safetensors with PEFT, "
                                                r"PeftModel\.from_pretrained\(base, '.*'\) then "
                                                r"\.save_pretrained\(OUT, safe_serialization=True\)$"):
        load_adapter(tiny_model(), out)


def test_a_peft_adapter_with_lora_on_lm_head_or_the_embedding_is_told_to_merge_with_peft(tmp_path):
    """PEFT puts LoRA on lm_head and on embeddings; chronicals does not. The refusal gave training advice only
    ("train it with lora.modules_to_save=[lm_head]"), no fix for someone holding such a file: it names PEFT's
    merge too now (a walk of export and PEFT interop). The model is left without LoRA."""
    for targets in (["q_proj", "lm_head"], ["q_proj", "embed_tokens"]):
        out = _saved(tmp_path / targets[1], target_modules=targets)
        model = tiny_model()
        with pytest.raises(ValueError, match=r"adapter_config\.json: .*; for this adapter file: merge it into its "
                                             r"base with PEFT \(PeftModel\.from_pretrained\(base, dir\)"
                                             r"\.merge_and_unload\(\), then save_pretrained\)"):
            load_adapter(model, out)
        assert getattr(model, "lora_config", None) is None
