"""Exact resume over the data the checkpoint was written with: a data file edited since, that still packs into
as many rows (and so as many batches), was resumed at a position that now points at other documents, without a
word. The loader's state keeps a digest of its dataset (token ids, masks, boundaries); a resume over other data
is refused naming the checkpoint and the fix. Checkpoints from before the digest still resume."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from smollm2_tokenizer import smollm2_tokenizer

from chronicals.data import PackedLoader, TokenizedDataset
from chronicals.data.dataset import DatasetStats
from chronicals.models import CausalLM, ModelConfig
from chronicals.train import train
from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs

from train_helpers import tiny_config

WORDS = ["cat", "dog", "sun", "tree", "river", "stone", "cloud", "bird", "house", "road"]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _model(tok) -> CausalLM:
    import transformers

    hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                  eos_token_id=tok.eos_token_id)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)


def _write(path, swap: tuple[str, str] | None = None) -> None:
    lines = []
    for i in range(24):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4 + i % 5))
        if swap:
            text = text.replace(*swap)
        lines.append(json.dumps({"text": text}) + "\n")
    path.write_text("".join(lines))


def _cfg(tmp_path, **over):
    over = dict(data__max_seq_len=48, data__batch_size=2, data__format="text") | over
    return tiny_config(tmp_path, data__path=str(tmp_path / "train.jsonl"), data__cache_dir="none",
                       train__save_every=1, **over)


def _rows(tok, path) -> int:
    from chronicals.data import load_dataset

    ds = load_dataset([str(path)], tok, format="text", max_seq_len=48, cache_dir=None)
    return len(PackedLoader(ds, batch_size=2, max_seq_len=48).rows)


def test_resume_over_edited_data_of_the_same_packed_size_is_refused(tmp_path, tok):
    data = tmp_path / "train.jsonl"
    _write(data)
    rows = _rows(tok, data)
    train(_cfg(tmp_path, train__max_steps=2), model=_model(tok), tokenizer=tok)
    last = checkpoint_dirs(tmp_path / "run")[-1]
    assert "data_digest" in torch.load(last / STATE_FILE, map_location="cpu", weights_only=False)["data"]

    _write(data, swap=("dog", "cow"))  # other documents, the same packing
    assert _rows(tok, data) == rows
    with pytest.raises(ValueError, match=rf"cannot resume from .*{last.name}: the training data changed since this "
                                         r"checkpoint was written: .* would point at other documents; resume with the "
                                         r"original data, or start fresh with train.resume=none"):
        train(_cfg(tmp_path, train__max_steps=4, train__resume="auto"), model=_model(tok), tokenizer=tok)


def test_resume_over_unchanged_data_continues(tmp_path, tok):
    data = tmp_path / "train.jsonl"
    _write(data)
    train(_cfg(tmp_path, train__max_steps=2), model=_model(tok), tokenizer=tok)
    data.write_text(data.read_text())  # rewritten, the same contents
    train(_cfg(tmp_path, train__max_steps=4, train__resume="auto"), model=_model(tok), tokenizer=tok)
    assert checkpoint_dirs(tmp_path / "run")[-1].name == "step-000004"


def _dataset(ids) -> TokenizedDataset:
    ids = np.asarray(ids, dtype=np.int32)
    return TokenizedDataset(ids, np.ones(len(ids), bool), np.arange(0, len(ids) + 1, 4), 0, DatasetStats(), 8)


def test_loader_refuses_other_contents_and_skips_the_check_for_old_states(caplog):
    a = PackedLoader(_dataset(np.arange(1, 33)), batch_size=1, max_seq_len=8, seed=0)
    next(iter(a))
    state = a.state_dict()
    b = PackedLoader(_dataset(np.arange(1, 33)[::-1]), batch_size=1, max_seq_len=8, seed=0)
    assert len(b.rows) == len(a.rows) and state["data_digest"] != b.state_dict()["data_digest"]
    with pytest.raises(ValueError, match="the training data changed since the saved loader's state was written"):
        b.load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "data_digest"}  # a checkpoint from before the digest
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        b.load_state_dict(old)
    assert (b.epoch, b.position) == (state["epoch"], state["position"])
    assert "no digest of its dataset" in caplog.text
    c = PackedLoader(_dataset(np.arange(1, 33)), batch_size=1, max_seq_len=8, seed=0)
    c.load_state_dict(state)  # the same contents
    assert (c.epoch, c.position) == (state["epoch"], state["position"])


def test_resume_under_another_train_on_names_the_setting(tmp_path, tok, caplog):
    """data.train_on=all over an assistant-only checkpoint: the same documents with other loss tokens. The refusal
    named no setting ("the training data changed") after a warning that read as if the run would go on."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{w} and", "completion": f" {WORDS[i % 7]} {w}"}) + "\n"
                            for i, w in enumerate(WORDS * 2)))
    cfg = dict(data__format="auto")
    train(_cfg(tmp_path, train__max_steps=2, **cfg), model=_model(tok), tokenizer=tok)
    last = checkpoint_dirs(tmp_path / "run")[-1]
    with caplog.at_level(logging.WARNING, logger="chronicals"):
        with pytest.raises(ValueError, match=rf"cannot resume from .*{last.name}: this run changed "
                                             r"data.train_on='assistant' \(this run: 'all'\), which changes the "
                                             r"training documents or their loss tokens .*set the checkpoint's value"):
            train(_cfg(tmp_path, train__max_steps=4, train__resume="auto", data__train_on="all", **cfg),
                  model=_model(tok), tokenizer=tok)
    assert "from here on the run trains" not in caplog.text  # no warning that it goes on


def test_resume_over_another_batch_size_names_the_key_not_the_loaders_arguments(tmp_path, tok):
    """The refusal read '... and seed. this run changed ...': the loader's own advice in its arguments' names
    (drop_last is no config key), then a sentence starting in lower case. Now the counts, then this run's keys."""
    _write(tmp_path / "train.jsonl")
    train(_cfg(tmp_path, train__max_steps=1), model=_model(tok), tokenizer=tok)
    with pytest.raises(ValueError) as e:
        train(_cfg(tmp_path, train__max_steps=2, train__resume="auto", data__batch_size=1), model=_model(tok),
              tokenizer=tok)
    msg = str(e.value)
    assert "drop_last" not in msg and "PackedLoader" not in msg and ". this" not in msg, msg
    assert "the saved loader had seed=0," in msg and "this run changed data.batch_size" in msg, msg


def test_a_resume_under_another_on_long_that_changes_the_batches_names_it(tmp_path, tok):
    """data.on_long=drop over a checkpoint of an on_long=truncate run: the long examples are gone, the set packs into
    fewer rows, and the loader refuses the position. The refusal names data.on_long: without the loss settings among
    the diffs it said "no data setting changed", sending the user to check files and torchrun instead."""
    lines = []
    for i in range(24):
        n = 70 if i % 2 else 4 + i % 5  # every other example is longer than data.max_seq_len=48 tokens
        lines.append(json.dumps({"text": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))}) + "\n")
    (tmp_path / "train.jsonl").write_text("".join(lines))
    train(_cfg(tmp_path, train__max_steps=2), model=_model(tok), tokenizer=tok)
    with pytest.raises(ValueError, match=r"cannot resume from .*this run changed data.on_long="):
        train(_cfg(tmp_path, train__max_steps=4, train__resume="auto", data__on_long="drop"), model=_model(tok),
              tokenizer=tok)
