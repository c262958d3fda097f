"""A LoRA group reads its input norm's spare columns: the norm writes y into a (N, in + R) buffer, the group writes
x A^T into its last R columns and runs its GEMM there, instead of concatenating [x | x A^T] (``ops.rms_norm``
``spare``, ``models.fused_proj.norm_spare``). Same bits as the concatenating path, every recompute option."""

import pytest
import torch

import chronicals.models.decoder as decoder_mod
from chronicals.lora import apply_lora
from chronicals.lora import group as group_mod

from .conftest import randomize_lora_b, tiny_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEV)


def _run(monkeypatch, spare: bool, impl: str, recompute, dropout: float, kind: str = "qwen2", checkpointing=False):
    """(loss, {adapter name: grad}, how many group GEMMs read a norm's buffer) for one forward + backward."""
    with monkeypatch.context() as m:
        if not spare:
            m.setattr(decoder_mod, "norm_spare", lambda block: 0)
        used = []
        real = group_mod.group_forward

        def spy(x2, mat, bias, a_all, ranks=(), draws=None, full=None):
            used.append(full is not None)
            return real(x2, mat, bias, a_all, ranks, draws, full)

        m.setattr(group_mod, "group_forward", spy)
        model = tiny_model(kind).to(DEV).train()
        model.opts.impl = impl
        model.set_recompute(recompute)
        model.set_checkpointing(checkpointing)
        apply_lora(model, r=8, alpha=16, dropout=dropout)
        randomize_lora_b(model)
        torch.manual_seed(3)
        loss = model(IDS, shift_labels=torch.roll(IDS, -1, 1), reduction="sum")
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, used


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("recompute,dropout", [((), 0.0), (("norm", "swiglu"), 0.0),
                                               (("norm", "swiglu", "gate_up"), 0.0), (("norm", "swiglu"), 0.1)])
def test_the_norms_buffer_gives_the_concatenating_paths_bits(monkeypatch, impl, recompute, dropout):
    la, ga, used_a = _run(monkeypatch, True, impl, recompute, dropout)
    lb, gb, used_b = _run(monkeypatch, False, impl, recompute, dropout)
    # every forward group GEMM (2 groups x 2 layers) read the norm's buffer; a gate_up rebuild reads it again
    assert used_a[:4] == [True] * 4 and all(used_a) and not any(used_b)
    assert len(used_a) == len(used_b) == (6 if "gate_up" in recompute else 4)  # + one gate/up rebuild a layer
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys() and len(ga) == 2 * 7 * 2
    for n in ga:
        assert ga[n].abs().sum() > 0, n
        assert torch.equal(ga[n], gb[n]), n


@pytest.mark.parametrize("checkpointing", [True, 1])
def test_checkpointed_layers_give_the_concatenating_paths_bits(monkeypatch, checkpointing):
    """A checkpointed layer runs its forward again in backward: the norm's buffer is made and read again there."""
    la, ga, used_a = _run(monkeypatch, True, "torch", ("norm", "swiglu"), 0.0, checkpointing=checkpointing)
    lb, gb, used_b = _run(monkeypatch, False, "torch", ("norm", "swiglu"), 0.0, checkpointing=checkpointing)
    assert all(used_a) and not any(used_b) and len(used_a) == len(used_b) > 4  # the reruns read it too
    assert torch.equal(la, lb)
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def test_eval_and_generation_steps_read_the_buffer_too(monkeypatch):
    """Without gradients the group still runs (LoRA eval, chat): the same logits either way."""
    out = []
    for spare in (True, False):
        with monkeypatch.context() as m:
            if not spare:
                m.setattr(decoder_mod, "norm_spare", lambda block: 0)
            model = tiny_model("llama").to(DEV)
            apply_lora(model, r=8, alpha=16)
            randomize_lora_b(model)
            with torch.no_grad():
                out.append(model(IDS))
    assert torch.equal(out[0], out[1])


def test_a_group_that_no_longer_runs_gets_no_spare_columns():
    """merge_lora puts plain Linears back: the norms then write contiguous rows again."""
    from chronicals.lora import merge_lora
    from chronicals.models.fused_proj import norm_spare

    model = tiny_model("llama")
    apply_lora(model, r=8, alpha=16)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert norm_spare(attn) == 3 * 8 and norm_spare(mlp) == 2 * 8
    merge_lora(model)
    assert norm_spare(attn) == 0 and norm_spare(mlp) == 0


def test_a_row_stride_off_the_8_element_grid_keeps_the_concatenating_path():
    """hidden 32: q/k/v at r = 4 would give rows of 32 + 12 elements, which cuBLAS reads with slower kernels."""
    from chronicals.models.fused_proj import norm_spare

    model = tiny_model("llama")
    apply_lora(model, r=4, alpha=8)
    assert norm_spare(model.model.layers[0].self_attn) == 0 and norm_spare(model.model.layers[0].mlp) == 2 * 4


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("names,freed", [((), False), (("norm", "swiglu"), True)])
def test_norm_recompute_still_lets_the_buffer_go(impl, names, freed):
    """The group saves x as a view of the norm's (N, in + R) buffer; with "norm" recompute the graph holds a recipe
    for that buffer instead (x A^T is saved apart), so after forward nothing keeps the buffer alive."""
    import gc
    import weakref

    model = tiny_model("llama").to(DEV).train()
    model.opts.impl = impl
    model.set_recompute(names)
    apply_lora(model, r=8, alpha=16)
    refs = []

    def keep(mod, args, out):
        assert out.stride(-2) == 32 + 3 * 8  # the q/k/v group's buffer: hidden 32, R = 3 x 8
        refs.append(weakref.ref(out if out._base is None else out._base))

    hook = model.model.layers[0].input_layernorm.register_forward_hook(keep)
    loss = model(IDS, shift_labels=torch.roll(IDS, -1, 1), reduction="sum")
    gc.collect()
    assert (refs[0]() is None) == freed
    loss.backward()
    hook.remove()
