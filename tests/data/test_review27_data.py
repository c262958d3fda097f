"""Mutation testing (session 27): the tokenization cache's code digest covers every encoding module; a loader refuses
a saved position past its epoch (it would skip the rest of the epoch without a word)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import chronicals.data.cache as cache_mod
from chronicals.data import PackedLoader
from chronicals.data.dataset import DatasetStats, TokenizedDataset


def test_encoder_digest_covers_every_module_that_turns_records_into_tokens():
    names = {Path(f).name for f in cache_mod.ENCODER_FILES}
    assert {"readers.py", "_jsonio.py", "formats.py", "tokenize.py", "dataset.py"} <= names


def test_a_position_past_the_epoch_is_refused():
    lengths = np.array([5, 7, 3, 6, 4, 8])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ds = TokenizedDataset(np.arange(1, offsets[-1] + 1, dtype=np.int32), np.ones(offsets[-1], bool), offsets, 0,
                          DatasetStats(records=6, documents=6, tokens=int(offsets[-1])), 8)
    loader = PackedLoader(ds, batch_size=1, max_seq_len=8)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="position"):
        loader.load_state_dict({**state, "position": len(loader) + 1})
