"""Fixes from session 25's generate/evaluate hunt: max_new_tokens that is not a whole number >= 0, eos ids given
as numpy integers or None, and evaluate's qa_limit / max_new_tokens."""

import numpy as np
import pytest
import torch

from chronicals.evaluate import evaluate
from chronicals.models import CausalLM, ModelConfig, generate
from chronicals.models.generate import greedy_rows


@pytest.fixture
def model(tiny_hf_config):
    return CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("qwen3"))).init_weights(std=0.5, seed=0).eval()


@pytest.mark.parametrize("n", [-1, 2.5, True, "4"])
def test_max_new_tokens_must_be_a_whole_number(model, n):
    """-1 decoded without end (401 tokens past a 128-position context before a streamer stopped it)."""
    ids = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="must be a whole number >= 0"):
        generate(model, ids, n)
    with pytest.raises(ValueError, match="must be a whole number >= 0"):
        greedy_rows(model, ids[None], n, set())


def test_eos_ids_of_any_integer_kind(model):
    ids = torch.tensor([5, 6, 7])
    free = generate(model, ids, 6).tolist()
    stop = free[2]
    for eos in (np.int64(stop), [np.int32(stop)], torch.tensor(stop), (stop,)):
        assert generate(model, ids, 6, eos_token_id=eos).tolist() == free[:free.index(stop) + 1]
    assert greedy_rows(model, ids[None], 6, None) == [free]
    assert greedy_rows(model, ids[None], 6, np.int64(stop)) == [free[:free.index(stop) + 1]]
    with pytest.raises(ValueError, match="give a token id or a list of token ids"):
        generate(model, ids, 6, eos_token_id="</s>")


@pytest.mark.parametrize("kw,value", [("qa_limit", -1), ("qa_limit", 1.5), ("max_new_tokens", 0),
                                      ("max_new_tokens", -3)])
def test_evaluate_refuses_a_limit_it_would_misread(kw, value):
    """qa_limit=-1 sliced off the last question; max_new_tokens <= 0 scored every answer 0 without a word."""
    with pytest.raises(ValueError, match=f"evaluate: {kw}={value!r} must be a whole number"):
        evaluate(None, None, None, torch.device("cpu"), **{kw: value})
