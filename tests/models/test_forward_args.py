"""CausalLM.forward checks its arguments' shapes and dtypes before any work, and takes int32 ids and labels."""

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.decoder import KVCache
from chronicals.ops._impl import triton_interpreting

TRITON = torch.cuda.is_available() or triton_interpreting()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_hf_dict(transformers.LlamaConfig(**TINY).to_dict())
    return CausalLM(cfg, impl="torch").init_weights(std=0.1, seed=0).to(DEV)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0)).to(DEV)


@pytest.mark.parametrize("call,match", [
    (lambda m, ids: m(ids[0]), r"2-D \(B, S\), got shape \(11,\); add a batch dimension: model\(ids\[None\]\)"),
    (lambda m, ids: m(ids[None]), r"2-D \(B, S\), got shape \(1, 2, 11\)"),
    (lambda m, ids: m(ids[0, 0]), r"2-D \(B, S\), got shape \(\); reshape to \(batch, sequence\)"),  # 0-d
    (lambda m, ids: m(ids.float()), r"input_ids .* int64 or int32, got torch.float32"),
    (lambda m, ids: m(ids, labels=ids[:, :10]), r"labels has shape \(2, 10\) but input_ids has \(2, 11\)"),
    (lambda m, ids: m(ids, labels=ids.reshape(-1)), r"labels has shape \(22,\) but input_ids has \(2, 11\)"),
    (lambda m, ids: m(ids, shift_labels=ids.reshape(11, 2), reduction="none"),
     r"shift_labels has shape \(11, 2\) but input_ids has \(2, 11\)"),
    (lambda m, ids: m(ids, labels=ids, shift_labels=ids), r"pass one of labels= .* and shift_labels="),
    (lambda m, ids: m(ids, labels=ids.float()), r"labels must be int64 or int32 .* got torch.float32"),
    (lambda m, ids: m(ids, shift_labels=ids.bool()), r"shift_labels must be int64 or int32 .* got torch.bool"),
    (lambda m, ids: m(ids, labels=ids, reduction="avg"), r"reduction='avg' is not one of"),
    # without labels too: a typo must not silently return the logits
    *[(lambda m, ids, r=r: m(ids, reduction=r), rf"reduction='{r}' is not one of \('mean', 'sum', 'none'\)")
      for r in ("avg", "None", "MEAN")],
    # other integer dtypes (int16 / uint8 from numpy, bool): the message, not an error inside the embedding
    *[(lambda m, ids, dt=dt: m(ids.to(dt)),
       rf"input_ids must hold token ids as int64 or int32, got {dt}; convert with input_ids.long\(\)")
      for dt in (torch.int16, torch.uint8, torch.bool)],
    *[(lambda m, ids, dt=dt: m(ids, position_ids=torch.arange(11, device=ids.device)[None].to(dt)),
       rf"position_ids must be int64 or int32, got {dt}") for dt in (torch.int16, torch.uint8)],  # int16 wraps
    (lambda m, ids: m(ids, attention_mask=torch.ones_like(ids, dtype=torch.complex64), labels=ids),
     r"attention_mask must be bool or integer .* got torch.complex64"),
    # generation runs one unpadded row: a padded mask would be ignored by the cached attention
    (lambda m, ids: m(ids[:1], attention_mask=torch.ones_like(ids[:1]), kv_caches=[KVCache()]),
     "attention_mask with kv_caches"),
])
def test_bad_arguments_say_what_and_how(model, ids, call, match):
    with pytest.raises(ValueError, match=match), torch.no_grad():
        call(model, ids)


@pytest.mark.parametrize("kw, says", [("input_ids", r"input_ids must be a tensor of token ids \(B, S\)"),
                                      ("position_ids", r"position_ids must be a tensor \(B, S\) or \(1, S\)"),
                                      ("attention_mask", r"attention_mask must be a tensor \(B, S\) like input_ids"),
                                      ("labels", r"labels must be a tensor \(B, S\) like input_ids"),
                                      ("shift_labels", r"shift_labels must be a tensor \(B, S\) like input_ids")])
def test_an_argument_given_as_a_list_is_a_type_error_naming_it(model, ids, kw, says):
    """A Python list (as a user may pass it): a TypeError naming the argument, not an AttributeError from inside."""
    value = {"input_ids": ids, "position_ids": torch.arange(11).expand(2, 11)}.get(kw, torch.ones_like(ids))
    with pytest.raises(TypeError, match=says + ", got list"):
        model(**{"input_ids": ids, kw: value.tolist()})


def test_restarting_positions_are_documents_as_long_as_the_longest():
    """Restarting position_ids read as packed documents give max_seqlen = the longest document, not the row length:
    a row of two 6-token documents on a model with a sliding window of 8 is not refused, and its logits are each
    document's own."""
    from chronicals.models.forward_args import documents_from_positions

    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    cu, longest = documents_from_positions(pos)
    assert cu.tolist() == [0, 3, 8, 10, 17, 20] and cu.dtype == torch.int32 and longest == 7
    hf = transformers.MistralConfig(**{**TINY, "tie_word_embeddings": False}, sliding_window=8)
    windowed = CausalLM(ModelConfig.from_hf_dict(hf.to_dict()), impl="torch").init_weights(seed=0).eval()
    ids = torch.randint(0, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = windowed(ids, position_ids=torch.cat([torch.arange(6), torch.arange(6)])[None])
        want = torch.cat([windowed(ids[:, :6]), windowed(ids[:, 6:])], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_documents_restart_in_any_row_and_the_last_one_counts_for_max_seqlen():
    """Restarts are looked for in every row, also when row 0 is a plain row (a batch whose second row holds two
    documents was read as plain rows, attention crossing them), and max_seqlen counts the batch's last document
    too (it was left out of the max)."""
    from chronicals.models.forward_args import documents_from_positions

    cu, longest = documents_from_positions(torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]))
    assert cu.tolist() == [0, 5, 7, 10] and longest == 5
    cu, longest = documents_from_positions(torch.tensor([[0, 1, 2], [0, 1, 2], [0, 0, 1]]))
    assert cu.tolist() == [0, 3, 6, 7, 9] and longest == 3
    cu, longest = documents_from_positions(torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]]))
    assert cu.tolist() == [0, 2, 8] and longest == 6
    cu, longest = documents_from_positions(torch.tensor([[0, 1, 0], [0, 1, 2]]))
    assert cu.tolist() == [0, 2, 3, 6] and longest == 3


def test_positions_that_never_restart_are_plain_rows():
    from chronicals.models.forward_args import documents_from_positions

    assert documents_from_positions(torch.arange(5).expand(3, 5)) == (None, None)
    assert documents_from_positions(torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]])) == (None, None)


def test_restarting_positions_with_kv_caches_are_one_sequence():
    """With kv_caches restarting position_ids are no documents: the cache attends over the whole row, so the
    sliding window judges every token of the prompt (read as documents, a 10-token prompt with positions 0..4, 0..4
    passed a window of 8 by its longest "document" and attended over all 10)."""
    hf = transformers.MistralConfig(**{**TINY, "tie_word_embeddings": False}, sliding_window=8)
    windowed = CausalLM(ModelConfig.from_hf_dict(hf.to_dict()), impl="torch").init_weights(seed=0).eval()
    caches = [KVCache() for _ in windowed.model.layers]
    pos = torch.cat([torch.arange(5), torch.arange(5)])[None]
    with torch.no_grad(), pytest.raises(ValueError, match=r"10 tokens is longer than this mistral model's "
                                                          r"sliding_window=8"):
        windowed(torch.randint(0, TINY["vocab_size"], (1, 10)), position_ids=pos, kv_caches=caches)


@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if TRITON else []))
def test_int32_ids_and_labels_equal_int64(model, ids, impl):
    model.set_impl(impl)
    try:
        targets = ids.clone()
        targets[:, ::3] = -100
        for kw in ("labels", "shift_labels"):
            want = model(ids, **{kw: targets}, reduction="none")
            got = model(ids.int(), **{kw: targets.int()}, reduction="none")
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert torch.isfinite(got).all()
    finally:
        model.set_impl("torch")


@pytest.mark.skipif(DEV == "cuda", reason="on CUDA an id past the table is a device-side assert, not an IndexError")
@pytest.mark.parametrize("bad", [53, 1000, -60])
def test_an_id_past_the_embedding_names_the_vocabulary_size(model, ids, bad):
    """A tokenizer with more tokens than the model's embedding gave a bare 'IndexError: index out of range in self'
    from the Python API (the CLI checks the tokenizer against the model before)."""
    wrong = ids.clone()
    wrong[1, 3] = bad
    with pytest.raises(IndexError, match=r"input_ids hold ids outside \[0, 53\), the model's vocab_size.*tokenizer"):
        model(wrong)
