"""Mistral's sliding window: rows up to the window run (full causal attention equals it there); longer
rows are refused with a message that says what to do, instead of silently computing something else."""

import pytest
import torch

from chronicals.models import CausalLM, ModelConfig


def _mistral(window):
    transformers = pytest.importorskip("transformers")
    hf = transformers.MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, sliding_window=window)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)


def test_rows_within_the_window_run_and_longer_rows_are_refused():
    model = _mistral(8)
    assert model(torch.randint(0, 97, (2, 8))).shape == (2, 8, 97)
    with pytest.raises(ValueError, match=r"9 tokens is longer than this mistral model's sliding_window=8.*"
                                         r"max_seq_len <= 8"):
        model(torch.randint(0, 97, (1, 9)))


def test_packed_rows_are_judged_by_their_longest_document():
    model = _mistral(8)
    ids = torch.randint(0, 97, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    assert model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=6).shape == (1, 12, 97)


def test_no_window_means_no_limit():
    model = _mistral(None)
    assert model(torch.randint(0, 97, (1, 40))).shape == (1, 40, 97)
