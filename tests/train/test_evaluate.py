"""evaluate_loss, the held-out loss the trainer logs (eval.every, before / after): the mean over loss tokens of
every batch, computed in eval mode, with the model's mode given back.

The trainer tests see it only through "the loss after is lower than before", which a rescaled loss, dropout left
on during evaluation, or dropout switched off for the rest of training all pass.
"""

from __future__ import annotations

import pytest
import torch

from chronicals.lora import apply_lora
from chronicals.train.step import batch_loss_sum, evaluate_loss

from train_helpers import SyntheticLoader, synthetic_docs, tiny_model

CPU = torch.device("cpu")


@pytest.fixture
def batches():
    """Three one-row batches with unequal loss-token counts (equal counts would hide a mean of means)."""
    b = SyntheticLoader(synthetic_docs(30, seed=3), batch_size=1, row_len=29, shuffle=False).batches[:3]
    assert len({x.num_loss_tokens for x in b}) > 1
    return b


@pytest.fixture
def lora_model():
    """A float64 model with LoRA dropout 0.5 and nonzero B, so dropout changes the loss whenever it is on."""
    model = tiny_model(dtype=torch.float64)
    apply_lora(model, r=4, alpha=8, dropout=0.5, target_modules=("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def test_held_out_loss_is_the_token_weighted_mean_without_dropout(lora_model, batches):
    """Sum of the batches' loss sums over their total loss tokens, with dropout off, and the count returned is
    loss tokens (not the mean of per-batch means and a batch count, nor a loss with dropout on)."""
    lora_model.eval()
    with torch.no_grad():
        want = sum(batch_loss_sum(lora_model, b, CPU).item() for b in batches) / sum(b.num_loss_tokens for b in batches)
    lora_model.train()
    loss, n = evaluate_loss(lora_model, batches, CPU)
    assert n == sum(b.num_loss_tokens for b in batches)
    assert loss == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("training", [True, False])
def test_evaluation_gives_the_model_its_mode_back(lora_model, batches, training):
    """A model evaluated during training (eval.every) trains on in training mode, with its LoRA dropout; one
    evaluated in eval mode stays there."""
    lora_model.train(training)
    evaluate_loss(lora_model, batches[:1], CPU)
    assert all(m.training == training for m in lora_model.modules())
