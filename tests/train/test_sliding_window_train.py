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


def test_a_long_document_in_the_data_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """Session 26: the per-batch check came at whichever step first drew the long document (a run died at step 3,
    two steps logged, no checkpoint), without saying which set held it. The sets' longest documents are checked
    when the loaders are built, against the model's config.json (the decoder built from it on the meta device),
    before the weights load."""
    import json

    import chronicals.train.loop as loop

    def refuse(*a, **k):
        raise AssertionError("the weights loaded before the data's documents were checked")

    monkeypatch.setattr(loop, "load_base", refuse)

    from chronicals import save_model
    from smollm2_tokenizer import smollm2_tokenizer

    tok = smollm2_tokenizer()
    import transformers

    hf = transformers.MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    sliding_window=32)
    base = save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0), tok, tmp_path / "m")
    recs = [{"text": "short one"}] * 6 + [{"text": "word " * 40}] + [{"text": "short two"}] * 6
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = tiny_config(tmp_path, model__path=str(base), data__path=str(tmp_path / "d.jsonl"), data__eval_path="",
                      data__max_seq_len=64, data__batch_size=1, train__max_steps=0, train__epochs=1)
    with pytest.raises(ValueError, match=r"the training data's longest document \(number \d+ of 13, \d+ tokens "
                                         r"after data.on_long\) does not fit this model: a sequence of \d+ tokens is "
                                         r"longer than this mistral model's sliding_window=32"):
        train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
