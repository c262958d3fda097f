"""A LoRA run's checkpoint as an adapter (``apply_checkpoint_adapter``: export, chat and eval --adapter take it):
runs whose saved modules were untied from a tied base (continued from a PEFT adapter), older checkpoints whose
config alone rebuilds the adapter, a base whose LoRA targets match other modules (or whose tensors do not fit, said
on the meta-device decoder as when applied), and a checkpoint copied over in place read again."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from chronicals import load_model, save_model
from chronicals.config import TrainConfig
from chronicals.lora import apply_lora, load_adapter, merge_lora, save_adapter
from chronicals.models import CausalLM, ModelConfig
from chronicals.train import apply_checkpoint_adapter, train
from chronicals.train import checkpoint as ckpt
from chronicals.train.checkpoint_adapter import lora_settings, read_run_checkpoint

from test_checkpoint_as_adapter_or_model import _write
from train_helpers import VOCAB, SyntheticLoader, synthetic_docs, tiny_model


@pytest.mark.parametrize("saved", [["lm_head"], ["lm_head", "embed_tokens"]])
def test_a_checkpoint_of_a_run_on_untied_saved_modules_is_an_adapter(tmp_path, saved):
    """A tied base and a PEFT adapter training lm_head alone (or both tied modules, with different values):
    load_adapter unties them as PEFT does, and a run continued on it trained them untied. Its final adapter/ was
    right, but every checkpoint was refused as "does not fit this base", naming the base passed (a LoRA walk):
    apply_lora re-tied the pair. The checkpoint now gives the trained model's logits, saves as an adapter what the
    run's adapter/ holds (not a stray full fp32 embed_tokens, 113 MB at SmolLM2-135M, that a continued run would
    train), and merges into a model directory that says untied (else save_model refused the merge, asking for a
    config edit a command-line user cannot make) and reloads as trained, in chronicals and in transformers."""
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    base = save_model(CausalLM(ModelConfig.from_hf_dict(cfg.to_dict())).init_weights(seed=0), None, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                 modules_to_save=saved))
    if len(saved) == 2:  # different values in the two tied modules
        with torch.no_grad():
            pm.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    pm.save_pretrained(tmp_path / "peft")
    model, _ = load_model(base, tokenizer=False)
    load_adapter(model, tmp_path / "peft")
    train({"model": {"path": str(base), "device": "cpu", "impl": "torch"},
           "lora": {"targets": ["q_proj"], "rank": 4, "alpha": 8, "modules_to_save": saved},
           "data": {"max_seq_len": 32}, "schedule": {"warmup_steps": 0},
           "train": {"max_steps": 2, "out_dir": str(tmp_path / "run"), "resume": "none"}},
          model=model, train_loader=SyntheticLoader(synthetic_docs(16)))
    fresh, _ = load_model(base, tokenizer=False)
    apply_checkpoint_adapter(fresh, tmp_path / "run" / "checkpoints" / "step-000002")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(ids)
        torch.testing.assert_close(fresh.eval()(ids), want, rtol=0, atol=0)
    written = save_adapter(fresh, tmp_path / "adapter")
    mine, theirs = (load_file(d / "adapter_model.safetensors") for d in (written, tmp_path / "run" / "adapter"))
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert (json.loads((written / "adapter_config.json").read_text())["modules_to_save"]
            == json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())["modules_to_save"])
    merged = save_model(merge_lora(fresh), None, tmp_path / "merged")
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is False
    with torch.no_grad():
        torch.testing.assert_close(load_model(merged, tokenizer=False)[0].eval()(ids), want, rtol=1e-5, atol=1e-5)
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
        torch.testing.assert_close(hf_logits, want, rtol=1e-5, atol=1e-5)


def _lora_checkpoint(out, *, record: bool, modules_to_save=(), base=None):
    """A LoRA run's checkpoint (rank 4, alpha 8) of a two-layer tiny_model, model.norm.weight 3.0 (saved where
    ``modules_to_save`` has "norm"), recording ``base``; ``record``: with the adapter record (extra["lora"]), else
    only the config's lora section, as older checkpoints."""
    torch.manual_seed(0)
    model = tiny_model()
    apply_lora(model, r=4, alpha=8, modules_to_save=modules_to_save)
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)
    cfg = TrainConfig().to_dict()
    cfg["lora"].update(enabled=True, rank=4, alpha=8, modules_to_save=list(modules_to_save))
    extra = {"base": base, **({"lora": lora_settings(model)} if record else {})}
    return _write(out, extra, model=ckpt.trainable_state(model), config=cfg)


def test_an_older_checkpoint_with_modules_to_save_is_applied_with_them(tmp_path):
    """No adapter record (an older checkpoint): lora.modules_to_save of the run's config makes those modules
    trainable again, so the checkpoint's model.norm.weight fits and is copied in. Without them the checkpoint was
    refused as "does not fit this base" on the very base it trained."""
    path = _lora_checkpoint(tmp_path / "run", record=False, modules_to_save=("norm",))
    torch.manual_seed(0)
    again = apply_checkpoint_adapter(tiny_model(), path)
    assert torch.equal(again.model.norm.weight, torch.full_like(again.model.norm.weight, 3.0))


def test_a_checkpoint_on_a_deeper_base_is_refused_naming_a_module_its_targets_match_there(tmp_path):
    """With the adapter record, a base whose LoRA targets match other modules (one layer more) is refused naming
    such a module (model.layers.2...) and the base the run trained, not only by a count of tensors that differ."""
    path = _lora_checkpoint(tmp_path / "run", record=True, base="/models/two-layers")
    with pytest.raises(ValueError, match=r"LoRA targets match other modules here \(e\.g\. model\.layers\.2\.") as e:
        apply_checkpoint_adapter(tiny_model(layers=3), path)
    assert "/models/two-layers" in str(e.value)


def test_a_checkpoint_copied_over_in_place_is_read_again(tmp_path):
    """Another checkpoint of the same size copied over state.pt (cp: the same inode and size, a new mtime): the next
    read in the process sees the new file's record (its base), not the memoized read of the old one."""
    p = _write(tmp_path / "run", {"base": "/models/aaaa"})
    other = _write(tmp_path / "other", {"base": "/models/bbbb"})
    assert read_run_checkpoint(p).base == "/models/aaaa"
    ino = os.stat(p / "state.pt").st_ino
    assert os.path.getsize(other / "state.pt") == os.path.getsize(p / "state.pt")
    shutil.copyfile(other / "state.pt", p / "state.pt")  # rewrites in place: the same inode
    assert os.stat(p / "state.pt").st_ino == ino
    os.utime(p / "state.pt", ns=(time.time_ns(), time.time_ns() + 10**9))  # a coarse mtime: make it differ
    assert read_run_checkpoint(p).base == "/models/bbbb"


def test_a_checkpoint_of_a_run_whose_targets_were_a_regex_is_applied_with_it(tmp_path):
    """LoRA targets given as a regular expression (one string, as PEFT's target_modules takes it) are recorded as
    that string, and the checkpoint rebuilds the adapter on the same modules."""
    torch.manual_seed(0)
    model = tiny_model()
    rec = apply_lora(model, r=4, alpha=8, target_modules=r".*\.(q_proj|v_proj)")
    cfg = TrainConfig().to_dict()
    cfg["lora"].update(enabled=True, rank=4, alpha=8)
    path = _write(tmp_path / "run", {"lora": lora_settings(model)}, model=ckpt.trainable_state(model), config=cfg)
    assert read_run_checkpoint(path).lora["target_modules"] == r".*\.(q_proj|v_proj)"
    again = apply_checkpoint_adapter(tiny_model(), path)
    assert again.lora_config.lora_modules == rec.lora_modules


def test_an_older_checkpoint_is_applied_with_its_configs_scaling(tmp_path):
    """Without the adapter record (an older checkpoint) the config's lora.alpha and lora.rank give the scaling."""
    path = _lora_checkpoint(tmp_path / "run", record=False)
    assert apply_checkpoint_adapter(tiny_model(), path).lora_config.scaling == 8 / 4


def test_a_checkpoint_on_a_base_of_other_width_is_refused_naming_a_tensor_of_another_shape(tmp_path):
    """A base with the same modules and another MLP width: every name fits, a LoRA tensor of the MLP does not. It is
    refused as "does not fit this base" naming such a tensor and the base the run trained."""
    path = _lora_checkpoint(tmp_path / "run", record=True, base="/models/narrow")
    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    wider = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)
    with pytest.raises(ValueError, match=r"does not fit this base \(\d+ tensors of another name or shape, e\.g\. "
                                         r"model\.layers\.0\.mlp\..*trained on /models/narrow"):
        apply_checkpoint_adapter(wider, path)


def _width(intermediate: int) -> CausalLM:
    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=intermediate, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)


@pytest.mark.parametrize("odd", ["mlp_width", "missing_tensor", "unexpected_tensor"])
def test_a_checkpoint_that_does_not_fit_is_refused_on_the_meta_model_as_when_applied(tmp_path, odd):
    """eval --adapter with a LoRA run's checkpoint compared the names of the modules its settings adapt before the
    data and the weights, but its tensors' names and shapes only once the weights had loaded: a base of another MLP
    width (same module names), a checkpoint missing a tensor or holding one more. check_checkpoint_adapter on the
    meta-device decoder refuses those now, in apply_checkpoint_adapter's words (one check: ``_tensors_fit``)."""
    from chronicals.models.loading import meta_model
    from chronicals.train.checkpoint_adapter import check_checkpoint_adapter

    path = _lora_checkpoint(tmp_path / "run", record=True, modules_to_save=("norm",), base="/models/narrow")
    if odd != "mlp_width":
        state = torch.load(path / "state.pt", weights_only=False)
        if odd == "missing_tensor":
            del state["model"]["model.norm.weight"]
        else:
            state["model"]["model.layers.0.input_layernorm.weight"] = torch.ones(24)
        shutil.rmtree(path.parent.parent)
        path = _write(tmp_path / "run", state["extra"], model=state["model"], config=state["extra"]["config"])
    base = _width(48 if odd == "mlp_width" else 40)
    with pytest.raises(ValueError, match=r"does not fit this base") as applied:
        apply_checkpoint_adapter(base, path)
    shell = meta_model(base.config)
    with pytest.raises(ValueError) as checked:
        check_checkpoint_adapter(shell, path)
    assert str(checked.value) == str(applied.value)
    assert getattr(shell, "lora_config", None) is None
    check_checkpoint_adapter(meta_model(_width(40).config), _lora_checkpoint(tmp_path / "fits", record=True,
                                                                            modules_to_save=("norm",)))
