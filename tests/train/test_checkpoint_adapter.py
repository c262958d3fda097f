"""A LoRA run's checkpoint as an adapter (``apply_checkpoint_adapter``: export, chat and eval --adapter take it)
for runs whose saved modules were untied from a tied base (continued from a PEFT adapter)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from chronicals import load_model, save_model
from chronicals.lora import load_adapter, merge_lora, save_adapter
from chronicals.models import CausalLM, ModelConfig
from chronicals.train import apply_checkpoint_adapter, train

from train_helpers import VOCAB, SyntheticLoader, synthetic_docs


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
