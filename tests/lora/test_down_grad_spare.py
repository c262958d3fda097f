"""A LoRA down_proj's backward runs one dx GEMM over [dy | s dy B] (``lora.layer.lora_backward``): the norm that reads
the MLP's output (the next layer's input norm, or the final norm) writes dy into a buffer with r columns free after each
row (``ops.rms_norm``'s ``grad_spare``, ``models.fused_proj.grad_spare``), where s dy B goes instead of a new cat.
Same bits as the concatenating path."""

import dataclasses

import pytest
import torch

import chronicals.lora.layer as layer_mod
import chronicals.models.decoder as decoder_mod
from chronicals.lora import apply_lora, merge_lora
from chronicals.lora.layer import LoRALinear
from chronicals.models import CausalLM
from chronicals.models.fused_proj import grad_spare
from chronicals.ops._impl import triton_interpreting

from .conftest import randomize_lora_b, tiny_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEV)
needs_triton = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                  reason="the norm's Triton backward: CUDA or TRITON_INTERPRET=1 (make test sets it)")


def _wide_mlp_model(intermediate: int = 72) -> CausalLM:
    """The tiny llama with intermediate >= 2 x hidden (32): down_proj then takes the [dy | s dy B] branch."""
    cfg = dataclasses.replace(tiny_model("llama").config, intermediate_size=intermediate)
    return CausalLM(cfg).init_weights(seed=0)


def _run(monkeypatch, mode: str, recompute=(), checkpointing=False, impl="triton"):
    """(loss, {adapter name: grad}, per joint dx GEMM: whether it found the norm's buffer) for one forward + backward.
    mode "buffer": the norms leave dy its columns; "copy": they do not, and each joint dx GEMM gets a fresh (N, out + r)
    copy of dy instead (the same math, so the same bits); "off": no joint GEMM where the norm left no columns."""
    with monkeypatch.context() as m:
        if mode != "buffer":
            m.setattr(decoder_mod, "grad_spare", lambda block: 0)
        found = []
        real = layer_mod.grad_spare_columns

        def spy(dy, width):
            full = real(dy, width)
            found.append(full is not None)
            if mode == "copy":
                full = torch.cat([dy, dy.new_zeros(dy.shape[0], width - dy.shape[1])], 1)
            return full

        m.setattr(layer_mod, "grad_spare_columns", spy)
        model = _wide_mlp_model().to(DEV).train()
        model.opts.impl = impl
        model.set_recompute(recompute)
        model.set_checkpointing(checkpointing)
        apply_lora(model, r=8, alpha=16)
        randomize_lora_b(model)
        loss = model(IDS, shift_labels=torch.roll(IDS, -1, 1), reduction="sum")
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, found


@needs_triton
@pytest.mark.parametrize("recompute,checkpointing", [((), False), (("norm", "swiglu"), False),
                                                     (("norm", "swiglu", "gate_up"), False), ((), True), ((), 1)])
def test_the_norms_gradient_buffer_gives_the_copys_bits(monkeypatch, recompute, checkpointing):
    la, ga, found_a = _run(monkeypatch, "buffer", recompute, checkpointing)
    lb, gb, found_b = _run(monkeypatch, "copy", recompute, checkpointing)
    # per layer, last first: down_proj, then o_proj (the post-attention norm's dx)
    assert found_a == [True] * 4 and found_b == [False] * 4
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys() and len(ga) == 2 * 7 * 2
    for n in ga:
        assert ga[n].abs().sum() > 0, n
        assert torch.equal(ga[n], gb[n]), n


@needs_triton
def test_the_joint_dx_gemm_gives_the_references_gradients(monkeypatch):
    """o_proj's dx through [dy | s dy B] @ [W ; A] (rounded once) against the torch path, and against the fused path
    without the norm's columns (dy W, then a rank-r update)."""
    _, got, _ = _run(monkeypatch, "buffer")
    _, off, found = _run(monkeypatch, "off")
    _, ref, _ = _run(monkeypatch, "off", impl="torch")
    assert found == [False] * 4  # no columns: o_proj takes dy W and a rank-r update, down_proj a cat of dy
    for n in got:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(off[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_only_a_projection_that_runs_the_joint_dx_gemm_asks_for_columns():
    """down_proj and o_proj without concat, bias or dropout keep [W ; A] ("rows"): their norms leave r columns."""
    model = _wide_mlp_model()
    apply_lora(model, r=8, alpha=16)
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert mlp.down_proj.dy_spare == attn.o_proj.dy_spare == 8 and grad_spare(mlp) == grad_spare(attn) == 8
    merge_lora(model)  # plain Linears again
    assert grad_spare(mlp) == grad_spare(attn) == 0
    for kwargs in (dict(dropout=0.1), dict(concat=True)):  # dropout: dx takes the masked path; concat: [W | s B]
        model = _wide_mlp_model()
        apply_lora(model, r=8, alpha=16, **kwargs)
        assert grad_spare(model.model.layers[0].mlp) == grad_spare(model.model.layers[0].self_attn) == 0, kwargs
    model = _wide_mlp_model()
    apply_lora(model, r=4, alpha=8)  # dy's rows of 32 + 4 elements: off cuBLAS's 8-element grid
    assert model.model.layers[0].mlp.down_proj.dy_spare == 4 and grad_spare(model.model.layers[0].mlp) == 0
    biased = LoRALinear(torch.nn.Linear(32, 32), r=8, alpha=16)  # no [W ; A] beside a bias
    assert biased._layout is None and biased.dy_spare == 0


@needs_triton
def test_evaluation_asks_for_no_gradient_columns(monkeypatch):
    asked = []
    real = decoder_mod.rms_norm

    def spy(*args, grad_spare=0, **kwargs):
        asked.append(grad_spare)
        return real(*args, grad_spare=grad_spare, **kwargs)

    monkeypatch.setattr(decoder_mod, "rms_norm", spy)
    model = _wide_mlp_model().to(DEV).eval()
    model.opts.impl = "triton"
    apply_lora(model, r=8, alpha=16)
    with torch.no_grad():
        model(IDS)
    assert len(asked) == 5 and not any(asked)  # 2 norms a layer + the final norm
    model.train()
    model(IDS, shift_labels=torch.roll(IDS, -1, 1), reduction="sum").backward()
    # the post-attention norms read o_proj's output; layer 1's input norm and the final norm a down_proj's
    assert asked[5:] == [0, 8, 8, 8, 8]
