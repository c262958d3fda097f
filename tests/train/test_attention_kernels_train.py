"""train() on packed rows through each CUDA varlen attention kernel (model.attention): the same run with cuDNN's
ragged kernels, with FlashAttention-4's and with FlashAttention-2 gives the same losses to bf16 tolerance, CUDA graphs
on (the default). GPU only; the cudnn case also needs nvidia-cudnn-frontend and the fa4 case flash-attn-4, both on a
Hopper GPU."""

from __future__ import annotations

import importlib
import json
import logging

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig
from chronicals.train import train

from train_helpers import VOCAB, SyntheticLoader, synthetic_docs, tiny_config


def _cudnn_ok() -> bool:
    from chronicals.ops import attention_cudnn

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and attention_cudnn.available()


def _model():
    """head_dim 64 (4 heads of a 256 hidden), as the kernels' usual shapes."""
    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)


def _losses(tmp_path, caplog, docs, kernels) -> dict[str, list[float]]:
    """model.attention -> the train losses of 4 steps on rows of 1024 (4 a batch) of ``docs``, CUDA graphs on."""
    losses = {}
    for kernel in kernels:
        cfg = tiny_config(tmp_path / kernel, model__device="cuda", model__dtype="bfloat16", model__impl="auto",
                          model__attention=kernel, train__max_steps=4, optim__lr=1e-3)
        with caplog.at_level(logging.INFO, logger="chronicals"):
            train(cfg, model=_model(), train_loader=SyntheticLoader(docs, batch_size=4, row_len=1024, shuffle=False))
        recs = [json.loads(x) for x in (tmp_path / kernel / "run" / "metrics.jsonl").read_text().splitlines()]
        losses[kernel] = [r["loss"] for r in recs if r.get("kind") == "train"]
    return losses


@pytest.mark.skipif(not _cudnn_ok(), reason="needs CUDA, nvidia-cudnn-frontend, cuDNN >= 9.6 and a Hopper GPU")
def test_train_with_cudnn_attention_matches_flash(tmp_path, caplog, monkeypatch):
    # each kernel choice is logged once per process: an earlier test in this process may have logged it already
    # (the module, not chronicals.ops.attention, which the package binds to the function of that name)
    monkeypatch.setattr(importlib.import_module("chronicals.ops.attention"), "_logged_notes", set())
    # 4 rows of 1024 holding documents of 200-400 tokens: >= 128 tokens per cu_seqlens entry even counted over the
    # CUDA-graph step's padded document capacity, so auto sends them to cudnn
    losses = _losses(tmp_path, caplog, synthetic_docs(64, seed=2, lo=200, hi=400), ("flash", "cudnn", "auto"))
    assert "packed rows use cudnn (model.attention=cudnn)" in caplog.text
    assert "packed rows use cudnn (model.attention=auto: documents average >= 128 tokens)" in caplog.text
    assert "train.cuda_graphs=auto: on" in caplog.text
    assert len(losses["flash"]) == 4 and losses["flash"][-1] < losses["flash"][0]
    for kernel in ("cudnn", "auto"):
        assert losses[kernel] == pytest.approx(losses["flash"], rel=2e-2), (kernel, losses)


def _fa4_ok() -> bool:
    from chronicals.ops import attention_fa4

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and attention_fa4.available()


@pytest.mark.skipif(not _fa4_ok(), reason="needs CUDA, flash-attn-4 and a Hopper GPU")
def test_train_with_fa4_attention_matches_auto(tmp_path, caplog, monkeypatch):
    """FA4 on the trainer's packed rows, documents of 40-400 tokens, CUDA graphs on (the graphed step pads cu_seqlens
    with empty documents up to its capacity and passes the row length as the bound): the losses of the auto
    kernels' run to bf16 tolerance."""
    monkeypatch.setattr(importlib.import_module("chronicals.ops.attention"), "_logged_notes", set())
    losses = _losses(tmp_path, caplog, synthetic_docs(64, seed=2, lo=40, hi=400), ("auto", "fa4"))
    assert "unpacked and packed rows use FlashAttention-4's kernels (model.attention=fa4)" in caplog.text
    assert "train.cuda_graphs=auto: on" in caplog.text
    assert len(losses["auto"]) == 4 and losses["auto"][-1] < losses["auto"][0]
    assert losses["fa4"] == pytest.approx(losses["auto"], rel=2e-2), losses
