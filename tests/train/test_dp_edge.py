"""Data-parallel edge cases: resuming under another number of ranks; the warning of rows left out of every epoch.

PackedLoader-level (no process group needed): each rank's loader is built as torchrun's rank r would build it,
and the checkpoint's data state is rank 0's, as the trainer saves it.
"""

from __future__ import annotations

import numpy as np
import pytest
from smollm2_tokenizer import smollm2_tokenizer

from chronicals.config import load_config
from chronicals.data import PackedLoader
from chronicals.data.dataset import DatasetStats, TokenizedDataset
from chronicals.train.setup import build_loaders

from train_helpers import synthetic_docs


def _loader(rank: int, world: int, n_docs: int = 4, remainder: str = "train") -> PackedLoader:
    """One document per packed row (13..19 tokens, rows of 24: no two fit), one row per batch, unshuffled:
    global batch g is document g."""
    docs = synthetic_docs(n_docs, seed=5, lo=13, hi=20)
    lengths = [len(d[0]) for d in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stats = DatasetStats(records=n_docs, documents=n_docs, tokens=int(offsets[-1]),
                         loss_tokens=sum(int(d[1][1:].sum()) for d in docs))
    ds = TokenizedDataset(np.concatenate([d[0] for d in docs]).astype(np.int32),
                          np.concatenate([d[1] for d in docs]), offsets, 0, stats, 24)
    return PackedLoader(ds, batch_size=1, max_seq_len=24, shuffle=False, rank=rank, world_size=world,
                        remainder=remainder)


def _first_ids(batch) -> int:
    return int(batch.input_ids[0, 0])


def test_a_mid_epoch_position_of_other_ranks_is_refused_not_skipping_a_batch():
    """4 global batches: 2 per rank on 2 ranks and on 3 ranks, so the batch counts agreed and the 2-rank
    position 1 (batches 0 and 1 trained) resumed on 3 ranks at batch 3: batch 2 was never trained."""
    two = [_loader(r, 2) for r in range(2)]
    for ld in two:
        next(iter(ld))
    state = two[0].state_dict()
    three = _loader(0, 3)
    assert len(three) == len(two[0]) == 2  # the count check alone cannot tell them apart
    with pytest.raises(ValueError, match=r"ran on 2 data-parallel rank\(s\), this one on 3.*--nproc-per-node 2"):
        three.load_state_dict(state)


def test_an_epoch_end_resumes_on_other_ranks_with_the_next_epoch():
    """At an epoch's end the position names no batch of it: the next epoch starts at global batch r on any W."""
    two = [_loader(r, 2) for r in range(2)]
    for ld in two:
        list(iter(ld))
        ld.position = len(ld)  # as a checkpoint taken after the epoch's last step holds it
        ld.epoch = 0
    state = two[0].state_dict()
    three = [_loader(r, 3) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    one_rank = [_first_ids(b) for b in _loader(0, 1)]  # global batches 0..3 in order
    assert [_first_ids(next(iter(ld))) for ld in three] == one_rank[:3]


def test_fewer_batches_than_ranks_under_drop_names_the_remainder_setting():
    """1 global batch on 2 ranks: "drop" gives no batch per rank, "train" gives rank 0 the batch and rank 1 an
    empty one; the refusal under "drop" said to use more data or fewer ranks, not the setting that caused it."""
    assert len(_loader(1, 2, n_docs=1)) == 1
    with pytest.raises(ValueError, match=r"PackedLoader: 1 document packs into 1 row, which gives no batch per rank "
                                         r".*remainder='drop'.*data\.dp_remainder=train"):
        _loader(0, 2, n_docs=1, remainder="drop")


def test_rows_left_out_under_drop_are_warned_of_with_their_share_and_the_batch_sizes_that_fit(tmp_path, caplog):
    """7 one-document rows, data.batch_size=3, 2 ranks, data.dp_remainder=drop: 3 global batches, the third (1 row)
    never trained. Rank 0 warns once, counting the rows and their share of the loss tokens (1/7 of 98, not all 98),
    and advises data.dp_remainder=train or the two nearest batch sizes whose ceil(7 / batch_size) is a multiple of
    the ranks: 2 or 4 (floor division advised 3, the size that leaves the row out; one size was named, not two).
    Without the warning the row was left out of every epoch without a word."""
    f = tmp_path / "t.jsonl"
    f.write_text("".join('{"text": "record %d says a few more words here, and then a few"}\n' % i for i in range(7)))
    cfg = load_config(None, [f"data.path={f}", "data.eval_path=", "data.max_seq_len=16", "data.cache_dir=none",
                             "eval.qa=false", "data.dp_remainder=drop", "data.batch_size=3",
                             f"train.out_dir={tmp_path / 'run'}"])
    with caplog.at_level("WARNING", logger="chronicals.train"):
        loader, _, _ = build_loaders(cfg, smollm2_tokenizer(), tmp_path / "run", rank=0, world_size=2)
    assert len(loader.rows) == 7 and loader.rows_left_out == 1 and loader.dataset.stats.loss_tokens == 98
    said = [r.getMessage() for r in caplog.records if "are not trained" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].startswith("training data: 1 of 7 packed rows per epoch (about 1 document, 14 loss tokens"), said[0]
    assert "14 loss tokens; 14.3%) are not trained" in said[0], said[0]
    assert "To train them all use data.dp_remainder=train (a new run), or data.batch_size=2 or 4 (ceil(7 / " \
           "batch_size) a multiple of 2 ranks), or a number of ranks that divides the 3 batches" in said[0], said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.train"):  # the other ranks leave the same rows out unsaid
        loader, _, _ = build_loaders(cfg, smollm2_tokenizer(), tmp_path / "run", rank=1, world_size=2)
    assert loader.rows_left_out == 1 and "are not trained" not in caplog.text, caplog.text


def test_a_rank_count_refusal_reaches_the_user_without_a_guess(tmp_path):
    """The loader's message names both rank counts and the fix; train's wrapper appended "either the data files'
    contents did ... or the number of ranks did", a guess the message had already settled."""
    from chronicals.train.loop import _restore_position

    class Stream:
        def load_state_dict(self, state):
            raise ValueError("PackedLoader.load_state_dict: position 1 (the saved loader ran on 2 data-parallel "
                             "rank(s), this one on 3: resume with torchrun --nproc-per-node 2)")

    with pytest.raises(ValueError, match=r"cannot resume from .*step-000001: .*--nproc-per-node 2\)$"):
        _restore_position(Stream(), {"data": {}, "extra": {}}, {}, tmp_path / "step-000001")


def test_rows_left_out_warning_counts_documents_in_the_singular_and_plural(caplog):
    """"about 1 document" and "about 3 documents": the count's noun follows the count (it said "about 1
    documents")."""
    from types import SimpleNamespace

    from chronicals.train.setup import _warn_rows_left_out

    d = SimpleNamespace(tokens_per_batch=None, batch_size=3)
    dataset = type("Dataset", (), {"__len__": lambda self: 10, "stats": SimpleNamespace(loss_tokens=100)})()
    for left, noun in ((1, "1 document,"), (3, "3 documents,"), (0, "0 documents,")):
        loader = SimpleNamespace(rows=list(range(10)), world_size=2, rows_left_out=left, dataset=dataset)
        caplog.clear()
        with caplog.at_level("WARNING", logger="chronicals.train"):
            _warn_rows_left_out(loader, d)
        assert f"(about {noun} {10 * left} loss tokens;" in caplog.text, caplog.text
