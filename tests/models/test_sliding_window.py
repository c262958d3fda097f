"""Sliding windows (Mistral: every layer; Qwen2/3: the layers transformers gives one): rows up to the window run
(full causal attention equals it there); longer rows are refused with a message that says what to do, instead
of silently computing something else; a model none of whose layers slide has no limit."""

import pytest
import torch
import transformers

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


def test_cached_steps_count_the_cache_against_the_window():
    """model(token, kv_caches=...) one token at a time: the step that takes prompt + cache past the window is
    refused, as generate's own stop does (without the cached length the check saw 1 token: a mutation walk)."""
    from chronicals.models.decoder import KVCache

    model = _mistral(8).eval()
    caches = [KVCache() for _ in model.model.layers]
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 6)), kv_caches=caches)
        model(torch.tensor([[5]]), kv_caches=caches)
        model(torch.tensor([[6]]), kv_caches=caches)  # the 8th token: still inside the window
        with pytest.raises(ValueError, match=r"9 tokens is longer than this mistral model's sliding_window=8"):
            model(torch.tensor([[7]]), kv_caches=caches)


def test_packed_rows_are_judged_by_their_longest_document():
    model = _mistral(8)
    ids = torch.randint(0, 97, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    assert model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=6).shape == (1, 12, 97)


def test_a_row_without_cu_seqlens_is_judged_by_its_whole_length():
    """max_seqlen and longest_doc describe packed documents: without cu_seqlens a row is one sequence, and the
    window judges all of it (else longest_doc=5 let a 10-token row through a window of 8)."""
    from chronicals.models.decoder import judged_length

    assert judged_length(10, None, max_seqlen=5, longest_doc=4) == 10
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    assert judged_length(10, cu, max_seqlen=5, longest_doc=4) == 4
    assert judged_length(10, cu, max_seqlen=5) == 5
    with pytest.raises(ValueError, match=r"10 tokens is longer than this mistral model's sliding_window=8"):
        _mistral(8)(torch.randint(0, 97, (1, 10)), longest_doc=5, max_seqlen=5)


def test_a_rows_padding_is_no_document_for_the_window():
    """Rows of short documents and a long padding tail: the padding is one segment of cu_seqlens, so max_seqlen
    counted it and the window refused (3 documents of 3-5 tokens in a row of 20 under a window of 8). The collator's
    longest_doc is what the window limits; the loss equals each document's alone."""
    import numpy as np

    from chronicals.data.collate import collate_rows

    model = _mistral(8)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 97, (n,), generator=g).numpy() for n in (5, 3, 4)]
    batch = collate_rows([[(d, np.ones(len(d), bool)) for d in docs]], 20, 0)
    assert (batch.max_seqlen, batch.longest_doc) == (8, 5)  # the 8 tokens of padding: at the window, not past it
    batch = collate_rows([[(d, np.ones(len(d), bool)) for d in docs]], 24, 0)
    assert (batch.max_seqlen, batch.longest_doc) == (12, 5)
    with pytest.raises(ValueError, match="a sequence of 12 tokens is longer than this mistral model's sliding_window=8"):
        model(batch.input_ids, **{**batch.model_kwargs(), "longest_doc": None}, reduction="sum")
    loss = model(batch.input_ids, **batch.model_kwargs(), reduction="sum")
    alone = sum(model(torch.as_tensor(d)[None], labels=torch.as_tensor(d)[None], reduction="sum") for d in docs)
    torch.testing.assert_close(loss, alone)
    long = torch.randint(1, 97, (9,), generator=g).numpy()
    batch = collate_rows([[(long, np.ones(9, bool))]], 24, 0)
    with pytest.raises(ValueError, match="a sequence of 9 tokens is longer than this mistral model's sliding_window=8"):
        model(batch.input_ids, **batch.model_kwargs(), reduction="sum")


def test_no_window_means_no_limit():
    model = _mistral(None)
    assert model(torch.randint(0, 97, (1, 40))).shape == (1, 40, 97)


def test_a_legacy_type_key_dynamic_rope_limits_the_row_length():
    """Like a window, dynamic rope limits a row (to max_position_embeddings), also when an older config.json names
    it rope_scaling={"type": "dynamic"} (config.py keeps that key): reading only "rope_type", such a model computed
    plain rope past the limit, where transformers rescales, instead of refusing."""
    cfg = ModelConfig(model_type="llama", vocab_size=17, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=8,
                      rope_scaling={"type": "dynamic", "factor": 2.0})
    model = CausalLM(cfg).init_weights(seed=0).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 17)
        with pytest.raises(ValueError, match=r"9 tokens is longer than this model's max_position_embeddings=8"):
            model(torch.zeros(1, 9, dtype=torch.long))


def test_packed_rows_padding_is_no_document_for_a_dynamic_rope():
    """As for a window: a dynamic rope's limit judges a packed row by its longest document, not by the positions of
    its padding segment (12 of them in a row of 24, past max_position_embeddings=8); the loss equals each
    document's alone, and a document past the limit is still refused."""
    import numpy as np

    from chronicals.data.collate import collate_rows

    cfg = ModelConfig(model_type="llama", vocab_size=17, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=8,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = CausalLM(cfg).init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 17, (n,), generator=g).numpy() for n in (5, 3, 4)]
    batch = collate_rows([[(d, np.ones(len(d), bool)) for d in docs]], 24, 0)
    assert int(batch.position_ids.max()) == 11 and batch.longest_doc == 5
    loss = model(batch.input_ids, **batch.model_kwargs(), reduction="sum")
    alone = sum(model(torch.as_tensor(d)[None], labels=torch.as_tensor(d)[None], reduction="sum") for d in docs)
    torch.testing.assert_close(loss, alone)
    long = torch.randint(1, 17, (9,), generator=g).numpy()
    batch = collate_rows([[(long, np.ones(9, bool))]], 24, 0)
    with pytest.raises(ValueError, match=r"9 tokens is longer than this model's max_position_embeddings=8"):
        model(batch.input_ids, **batch.model_kwargs(), reduction="sum")


def _qwen(family, layers=3, **kw):
    transformers = pytest.importorskip("transformers")
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    return cls(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, sliding_window=8, **kw)


_QWEN_CASES = [dict(use_sliding_window=False), dict(use_sliding_window=True),  # max_window_layers 28 >= 3 layers
               dict(use_sliding_window=True, max_window_layers=3), dict(use_sliding_window=True, max_window_layers=2),
               dict(use_sliding_window=True, max_window_layers=0),
               dict(use_sliding_window=True, layer_types=["full_attention"] * 3),
               dict(use_sliding_window=True, max_window_layers=28,
                    layer_types=["full_attention", "sliding_attention", "full_attention"]),
               dict(use_sliding_window=False, layer_types=["sliding_attention"] * 3)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("kw,with_layer_types", [(kw, True) for kw in _QWEN_CASES] +
                         [(kw, False) for kw in _QWEN_CASES if "layer_types" not in kw])
def test_qwen_window_follows_transformers_layer_types(family, kw, with_layer_types):
    """Ours has a window exactly when transformers gives some layer sliding attention (a layer_types entry
    "sliding_attention" and a non-None config.sliding_window); config.json files written before layer_types
    existed are judged by use_sliding_window and max_window_layers alone."""
    hf = _qwen(family, **kw)
    sliding = hf.sliding_window is not None and "sliding_attention" in hf.layer_types
    d = hf.to_dict()
    if not with_layer_types:
        d.pop("layer_types")
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_window == (8 if sliding else None)
    assert cfg.to_hf_dict()["sliding_window"] == d["sliding_window"]  # written back as read


@pytest.mark.parametrize("over", [{"sliding_window": 16},
                                  {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0}])
def test_llama_has_no_sliding_window(tiny_hf_config, over):
    """transformers' Llama ignores sliding_window and use_sliding_window: a llama config.json carrying Qwen2-style
    keys (edited from a Qwen2 one) attends over the full causal window, so rows past 16 tokens are not refused, and
    its sliding_window is written back unchanged."""
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama2", **over))
    assert cfg.sliding_window is None
    assert cfg.to_hf_dict()["sliding_window"] == 16


def test_qwen_without_sliding_layers_runs_past_the_window():
    cfg = ModelConfig.from_hf_dict(_qwen("qwen2", use_sliding_window=True, max_window_layers=3).to_dict())
    model = CausalLM(cfg).init_weights(seed=0)
    assert model(torch.randint(0, 97, (1, 20))).shape == (1, 20, 97)


def test_qwen_with_some_sliding_layers_refuses_neutrally():
    cfg = ModelConfig.from_hf_dict(_qwen("qwen2", use_sliding_window=True, max_window_layers=2).to_dict())
    model = CausalLM(cfg).init_weights(seed=0)
    with pytest.raises(ValueError, match=r"9 tokens is longer than this qwen2 model's sliding_window=8: sequences "
                                         r"longer than 8 tokens need sliding-window attention.*Keep prompt plus "
                                         r"generated tokens within 8; for training set data\.max_seq_len <= 8"):
        model(torch.randint(0, 97, (1, 9)))


@pytest.mark.parametrize("value", ["1", None, -1, 1.5])
def test_a_bad_max_window_layers_names_the_field(value):
    """use_sliding_window with max_window_layers "1" or null gave a bare TypeError ('<' between str and int)."""
    d = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True).to_dict()
    d.pop("layer_types", None)
    d["max_window_layers"] = value
    with pytest.raises(ValueError, match=rf"max_window_layers={value!r} must be an integer >= 0"):
        ModelConfig.from_hf_dict(d)


def test_use_sliding_window_as_a_string_is_refused(tiny_hf_config):
    """use_sliding_window must be a JSON boolean: the string "false" is truthy, and read as it is it turned a Qwen2
    model's sliding window on (longer rows refused, config.json saying so), the opposite of what the file says."""
    d = tiny_hf_config("qwen2", use_sliding_window="false", sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match=r"^config\.json: use_sliding_window='false' must be true or false"):
        ModelConfig.from_hf_dict(d)
