"""One train.out_dir, one run at a time (an flock on out_dir/.chronicals.lock), and the entry point's other
contracts: a resume from another run's checkpoint takes that run's history, ~ in train.out_dir / train.resume /
data.eval_path, exit status 2 for bad train.out_dir / train.resume values, config.yaml a folder, and generation
stopping at the model's context."""

from __future__ import annotations

import torch

from train_helpers import tiny_model


# ---- generation stops at the model's context ----

def test_generation_stops_at_the_models_context_with_one_warning(caplog):
    from chronicals.models.generate import generate
    from chronicals.train.qa import greedy_same_length

    model = tiny_model()  # max_position_embeddings=128
    prompt = torch.arange(100) % 50
    with caplog.at_level("WARNING", logger="chronicals.generate"):
        assert len(generate(model, prompt, 1000)) == 28
        assert len(generate(model, prompt, 1000)) == 28  # a chat loop: warned once
        outs = greedy_same_length(model, torch.stack([prompt, prompt + 1]), 1000, set())
    assert [len(o) for o in outs] == [28, 28]
    assert caplog.text.count("goes past the model's context (max_position_embeddings=128)") == 1
    assert len(generate(model, prompt, 5)) == 5


