"""train() on a sliding-window model (Mistral v0.1: a window of 4096 in 32768 positions) with rows longer than the
window: rows of short documents and a long padding tail were refused ("a sequence of 134 tokens is longer than
this mistral model's sliding_window=48"), the padding counted as a sequence. Now the documents are what count;
on CUDA, with the step captured, a batch's documents are checked on the host before each replay."""

import numpy as np
import pytest
import torch

from chronicals.models import CausalLM, ModelConfig
from chronicals.train import train

from train_helpers import VOCAB, SyntheticLoader, synthetic_docs, tiny_config

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mistral(window: int) -> CausalLM:  # head dim 16: the CUDA attention kernels take multiples of 8
    import transformers

    hf = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    sliding_window=window)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)


@pytest.mark.parametrize("device", DEVICES)
def test_short_documents_in_rows_longer_than_the_window_train(tmp_path, device):
    docs = synthetic_docs(12, lo=5, hi=12)  # each under the window of 16; rows of 48 end in padding
    loader = SyntheticLoader(docs, batch_size=2, row_len=48)
    assert max(b.max_seqlen for b in loader.batches) > 16 >= max(b.longest_doc for b in loader.batches)
    over = dict(train__max_steps=3, model__device=device, model__impl="auto",
                model__dtype="float32" if device == "cpu" else "bfloat16")
    result = train(tiny_config(tmp_path, **over), model=_mistral(16), train_loader=loader)
    assert result.step == 3


@pytest.mark.parametrize("device", DEVICES)
def test_a_document_longer_than_the_window_is_refused_also_after_capture(tmp_path, device):
    """The long document comes in the run's second batch: on CUDA the first one was captured, and the replay of
    the second runs no model code, so the check runs on the host first."""
    from chronicals.train.graphs import graph_key

    docs = synthetic_docs(12, lo=5, hi=12)
    long = (np.arange(20) % VOCAB, np.ones(20, bool))
    loader = SyntheticLoader(docs[:6] + [long] + docs[6:], batch_size=1, row_len=48, shuffle=False)
    assert [b.longest_doc > 16 for b in loader.batches][:2] == [False, True]
    assert graph_key(loader.batches[0]) == graph_key(loader.batches[1])  # the second batch replays the first's graph
    over = dict(train__max_steps=len(loader), model__device=device, model__impl="auto",
                model__dtype="float32" if device == "cpu" else "bfloat16")
    with pytest.raises(ValueError, match="a sequence of 20 tokens is longer than this mistral model's "
                                         "sliding_window=16"):
        train(tiny_config(tmp_path, **over), model=_mistral(16), train_loader=loader)
