"""The Triton path (CUDA's default; here under TRITON_INTERPRET=1) against the PyTorch reference path on the same
weights, across the training options that change which autograd nodes run: full fine-tuning or LoRA (groups,
modules_to_save), layer checkpointing (all or the first k), the recompute names, the loss head's vocab parts.
Each option has its own tests; this checks them together (full fine-tuning with checkpointing once failed its
first backward on the Triton path only: the two forwards of a checkpointed layer saved different tensors)."""

import pytest
import torch
import transformers

from chronicals.lora import apply_lora
from chronicals.models import CausalLM, ModelConfig
from chronicals.models.decoder import RECOMPUTABLE, RuntimeOptions, check_recompute
from chronicals.ops._impl import triton_interpreting

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(vocab_size=89, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
DEFAULT, KEEP, GATE_UP = ("norm", "swiglu"), (), ("norm", "swiglu", "gate_up")


def test_recompute_names_as_true_or_one_string():
    """Besides a list, recompute takes True (every name, "gate_up" included, so gate_up_layers may go with it) and
    one name as a str. True once lacked "gate_up" (gate_up_layers refused), and a str was iterated as characters
    (refused as unknown names 'n', 'o', 'r', 'm')."""
    assert set(check_recompute(True)) == set(RECOMPUTABLE) == set(GATE_UP)
    opts = RuntimeOptions(recompute=True, gate_up_layers=1)
    assert opts.rebuilds_gate_up(0) and not opts.rebuilds_gate_up(1)
    assert check_recompute("norm") == ("norm",) and check_recompute("gate_up") == ("gate_up",)
    assert RuntimeOptions(recompute="swiglu").recompute == ("swiglu",)

# (lora, checkpointing, recompute, loss_vocab_parts, modules_to_save): every option value at least once, every
# checkpointing value with every recompute choice under full fine-tuning, and the LoRA cases that save lm_head
CASES = [
    (False, False, DEFAULT, 1, ()), (False, True, DEFAULT, 2, ()), (False, 1, DEFAULT, 1, ()),
    (False, True, KEEP, 1, ()), (False, 1, GATE_UP, 2, ()), (False, True, GATE_UP, 1, ()),
    (True, False, DEFAULT, 1, ()), (True, True, DEFAULT, 2, ("lm_head",)), (True, 1, KEEP, 1, ()),
    (True, True, GATE_UP, 1, ()), (True, False, GATE_UP, 2, ("lm_head",)),
]


def _model(impl, lora, checkpointing, names, parts, save):
    cfg = ModelConfig.from_hf_dict(transformers.Qwen2Config(**TINY).to_dict())
    model = CausalLM(cfg, impl=impl).init_weights(std=0.1, seed=0).to(DEV)
    model.set_recompute(names, 1 if "gate_up" in names else 0).set_checkpointing(checkpointing)
    model.opts.loss_vocab_parts = parts
    if lora:
        apply_lora(model, r=4, alpha=8, seed=0, modules_to_save=list(save))
        with torch.no_grad():  # non-zero B: the adapters change the output and every gradient is non-zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator(DEV).manual_seed(1))
    return model.train()


def _loss_and_grads(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=g).to(DEV)
    # two documents per row (packed: restarting positions are documents); on CUDA one, since packed rows there take
    # the varlen flash kernels, bf16 only, and this matrix runs in fp32 (test_packed_equivalence covers them)
    pos = (torch.cat([torch.arange(6), torch.arange(5)]) if DEV == "cpu" else torch.arange(11)).repeat(2, 1)
    pos = pos.to(DEV)
    labels = torch.randint(0, TINY["vocab_size"], (2, 11), generator=g).to(DEV)
    labels[0, :3] = -100
    loss = model(ids, position_ids=pos, shift_labels=labels, reduction="mean")
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora,checkpointing,names,parts,save", CASES)
def test_triton_path_matches_the_reference_path(lora, checkpointing, names, parts, save):
    loss_ref, ref = _loss_and_grads(_model("torch", lora, checkpointing, names, parts, save))
    loss, got = _loss_and_grads(_model("triton", lora, checkpointing, names, parts, save))
    assert got.keys() == ref.keys() and len(ref) > 0
    assert ("lm_head.weight" in got) == (not lora or "lm_head" in save)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for n in ref:
        assert got[n].abs().max() > 0, n
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5 * ref[n].abs().max().item(), msg=n)
