"""train() on packed rows through each CUDA varlen attention kernel (model.attention): the same run with cuDNN's
ragged kernels and with FlashAttention-2 gives the same losses to bf16 tolerance, CUDA graphs on (the default).
GPU only; the cudnn case also needs nvidia-cudnn-frontend and a Hopper GPU."""

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


@pytest.mark.skipif(not _cudnn_ok(), reason="needs CUDA, nvidia-cudnn-frontend, cuDNN >= 9.6 and a Hopper GPU")
def test_train_with_cudnn_attention_matches_flash(tmp_path, caplog, monkeypatch):
    # each kernel choice is logged once per process: an earlier test in this process may have logged it already
    # (the module, not chronicals.ops.attention, which the package binds to the function of that name)
    monkeypatch.setattr(importlib.import_module("chronicals.ops.attention"), "_logged_notes", set())
    # 4 rows of 1024 holding documents of 200-400 tokens: >= 128 tokens per cu_seqlens entry even counted over the
    # CUDA-graph step's padded document capacity, so auto sends them to cudnn
    docs = synthetic_docs(64, seed=2, lo=200, hi=400)
    losses = {}
    for kernel in ("flash", "cudnn", "auto"):
        cfg = tiny_config(tmp_path / kernel, model__device="cuda", model__dtype="bfloat16", model__impl="auto",
                          model__attention=kernel, train__max_steps=4, optim__lr=1e-3)
        with caplog.at_level(logging.INFO, logger="chronicals"):
            train(cfg, model=_model(), train_loader=SyntheticLoader(docs, batch_size=4, row_len=1024, shuffle=False))
        recs = [json.loads(x) for x in (tmp_path / kernel / "run" / "metrics.jsonl").read_text().splitlines()]
        losses[kernel] = [r["loss"] for r in recs if r.get("kind") == "train"]
    assert "packed rows use cudnn (model.attention=cudnn)" in caplog.text
    assert "packed rows use cudnn (model.attention=auto: documents average >= 128 tokens)" in caplog.text
    assert "train.cuda_graphs=auto: on" in caplog.text
    assert len(losses["flash"]) == 4 and losses["flash"][-1] < losses["flash"][0]
    for kernel in ("cudnn", "auto"):
        assert losses[kernel] == pytest.approx(losses["flash"], rel=2e-2), (kernel, losses)
