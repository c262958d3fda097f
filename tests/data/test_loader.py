"""PackedLoader: the batch contract, epochs, deterministic shuffle, exact resume, ranks, token budgets; a saved
position past its epoch is refused (it would skip the rest of the epoch without a word); the TokenizedDataset
it reads indexes like a list."""

import numpy as np
import pytest

from chronicals.data import IGNORE_INDEX, PackedLoader
from chronicals.data.dataset import DatasetStats, TokenizedDataset
from chronicals.data.loader import LoaderMismatch


def synthetic(n=37, max_len=24, seed=0):
    """Documents whose ids encode (document, position): id = 1000 * (doc + 1) + position."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_len + 1, n)
    ids = np.concatenate([1000 * (i + 1) + np.arange(L) for i, L in enumerate(lengths)]).astype(np.int32)
    trainable = rng.random(len(ids)) < 0.7
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    loss = sum(int(trainable[offsets[i] + 1:offsets[i + 1]].sum()) for i in range(n))
    stats = DatasetStats(records=n, documents=n, tokens=int(offsets[-1]), loss_tokens=loss)
    return TokenizedDataset(ids, trainable, offsets, 0, stats, max_len)


def of_lengths(*lengths, stats=None, pad_id=0):
    """Documents of these lengths, token ids 1, 2, ... in order, every token trainable (max_seq_len: the longest)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stats = stats or DatasetStats(records=len(lengths), documents=len(lengths), tokens=int(offsets[-1]))
    return TokenizedDataset(np.arange(1, offsets[-1] + 1, dtype=np.int32), np.ones(offsets[-1], bool), offsets,
                            pad_id, stats, max(lengths))


def rows_of_eight(n):
    """n documents of 8 tokens: with max_seq_len=8 and batch_size=1, one row and one global batch each."""
    return of_lengths(*[8] * n)


def check_batch(batch, ds):
    b, s = batch.input_ids.shape
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == b * s and batch.max_seqlen == max(np.diff(cu))
    flat_ids, flat_pos = batch.input_ids.flatten().tolist(), batch.position_ids.flatten().tolist()
    flat_lab = batch.shift_labels.flatten().tolist()
    docs = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        assert lo // s == (hi - 1) // s, "a document never spans two rows"
        assert flat_pos[lo:hi] == list(range(hi - lo))
        if flat_ids[lo] == ds.pad_id:  # padding: no targets
            assert all(x == IGNORE_INDEX for x in flat_lab[lo:hi])
            continue
        d = flat_ids[lo] // 1000 - 1
        ids, trainable = ds[d]
        assert flat_ids[lo:hi] == ids.tolist()
        want = [int(ids[t + 1]) if trainable[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        assert flat_lab[lo:hi] == want
        docs.append(d)
    assert batch.num_loss_tokens == sum(x != IGNORE_INDEX for x in flat_lab)
    assert batch.num_docs == len(docs)
    return docs


def test_rows_mode_epoch_covers_every_document_once():
    ds = synthetic()
    loader = PackedLoader(ds, batch_size=3, max_seq_len=24, seed=1)
    seen, loss = [], 0
    batches = list(loader)
    assert len(batches) == len(loader) == -(-len(loader.rows) // 3)
    for batch in batches:
        assert batch.input_ids.shape[1] == 24 and batch.input_ids.shape[0] <= 3
        seen += check_batch(batch, ds)
        loss += batch.num_loss_tokens
    assert sorted(seen) == list(range(len(ds)))
    st = loader.stats
    assert loss == st["loss_tokens"] == ds.stats.loss_tokens
    assert st["slots"] == len(loader.rows) * 24 and st["efficiency"] == loss / st["slots"]
    assert loader.state_dict()["epoch"] == 1


def test_shuffle_is_deterministic_and_changes_per_epoch():
    """The order is seeded by the pair (seed, epoch): seeded by their sum, seed 8's first epoch was seed 7's second,
    so runs of neighbouring seeds trained the same epochs shifted by one. It is exactly
    default_rng([seed, epoch]).permutation(rows), as loader.py says: a checkpoint keeps only (epoch, position), so
    this mapping is part of exact resume; seeded by [epoch, seed] every order still looked shuffled and
    deterministic, yet a resumed checkpoint trained other rows."""
    ds = synthetic()
    a = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=7)
    b = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=7)
    e0 = [x.input_ids.tolist() for x in a]
    assert e0 == [x.input_ids.tolist() for x in b]
    e1 = [x.input_ids.tolist() for x in a]
    assert e1 != e0 and sorted(map(str, e1)) != sorted(map(str, e0))  # other rows share a batch
    c = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=8)
    c0 = [x.input_ids.tolist() for x in c]
    assert c0 != e0 and c0 != e1
    ds = rows_of_eight(12)  # one document per row, rows in document order
    for seed in (0, 3):
        loader = PackedLoader(ds, batch_size=1, max_seq_len=8, seed=seed)
        assert loader.rows == [[i] for i in range(12)]
        for epoch in range(3):
            got = [(int(b.input_ids[0, 0]) - 1) // 8 for b in loader]
            assert got == np.random.default_rng([seed, epoch]).permutation(12).tolist(), (seed, epoch)


@pytest.mark.parametrize("stop", [0, 3, 7, "epoch"])
def test_exact_resume(stop):
    ds = synthetic()
    ref = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3)
    want = [x.input_ids.tolist() for x in ref] + [x.input_ids.tolist() for x in ref]  # two epochs
    stop = len(ref) if stop == "epoch" else stop
    run = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3)
    got = []
    if stop:
        for x in run:
            got.append(x.input_ids.tolist())
            if len(got) == stop:
                break  # a checkpoint taken while holding batch number `stop`
    fresh = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3)
    fresh.load_state_dict(run.state_dict())
    while len(got) < len(want):
        got += [x.input_ids.tolist() for x in fresh]
    assert got == want
    with pytest.raises(ValueError, match="resume with the same dataset"):
        PackedLoader(ds, batch_size=2, max_seq_len=24, seed=4).load_state_dict(run.state_dict())


def test_set_epoch_starts_the_epoch_from_its_first_batch():
    """set_epoch(e) jumps to the start of epoch e: keeping the position, a loader set mid-epoch skipped the new
    epoch's first batches and its state named the old position."""
    ds = synthetic()
    ref = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=5)
    epochs = [[b.input_ids.tolist() for b in ref] for _ in range(3)]
    run = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=5)
    it = iter(run)
    for _ in range(3):
        next(it)
    run.set_epoch(2)
    assert (run.state_dict()["epoch"], run.state_dict()["position"]) == (2, 0)
    assert [b.input_ids.tolist() for b in run] == epochs[2]


@pytest.mark.parametrize("remainder", ["train", "drop"])
def test_ranks_split_the_batches(remainder):
    ds = synthetic(n=60)
    one = [x.input_ids.tolist() for x in PackedLoader(ds, batch_size=2, max_seq_len=24, seed=0)]
    w = 4
    assert len(one) % w  # a last round that does not reach every rank
    ranks = [PackedLoader(ds, batch_size=2, max_seq_len=24, seed=0, rank=r, world_size=w, remainder=remainder)
             for r in range(w)]
    assert all(len(r) == (-(-len(one) // w) if remainder == "train" else len(one) // w) for r in ranks)
    per_rank = [[x for x in r] for r in ranks]
    interleaved = [per_rank[i % w][i // w] for i in range(w * len(ranks[0]))]
    real = [b.input_ids.tolist() for b in interleaved if b.num_docs]
    assert real == (one if remainder == "train" else one[:len(one) // w * w])
    empty = [b for b in interleaved if not b.num_docs]  # the last round's ranks past the end
    assert len(empty) == ranks[0].empty_batches == (w - len(one) % w if remainder == "train" else 0)
    for b in empty:
        assert b.input_ids.shape == (1, 24) and b.num_loss_tokens == 0 and (b.input_ids == ds.pad_id).all()
        check_batch(b, ds)


def test_token_budget_mode_is_padding_free():
    ds = synthetic()
    loader = PackedLoader(ds, tokens_per_batch=64, max_seq_len=24, seed=0)
    seen = []
    for batch in loader:
        assert batch.input_ids.shape[0] == 1 and batch.input_ids.shape[1] <= 64
        assert batch.num_tokens == batch.input_ids.numel()  # no padding at all
        seen += check_batch(batch, ds)
    assert sorted(seen) == list(range(len(ds)))
    assert loader.stats["fill"] == 1.0
    padded = PackedLoader(ds, tokens_per_batch=64, max_seq_len=24, pad_to_multiple_of=16)
    for batch in padded:
        assert batch.input_ids.shape[1] % 16 == 0
        check_batch(batch, ds)


def test_bad_loader_options():
    ds = synthetic()
    for both in ({}, dict(batch_size=2, tokens_per_batch=64)):  # neither, or both (then collate_rows failed later)
        with pytest.raises(ValueError, match="give exactly one of batch_size"):
            PackedLoader(ds, max_seq_len=24, **both)
    with pytest.raises(ValueError, match="> max_seq_len=16; load the dataset with the same max_seq_len"):
        PackedLoader(ds, batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match="a step must hold the longest document"):
        PackedLoader(ds, tokens_per_batch=20, max_seq_len=24)


def test_resume_with_other_batch_settings_fails():
    """Same rows and seed but another batch_size / world_size: the saved position means other batches. Other rows
    with the same batch count (20 rows of 24 tokens, 14 of 40: one batch an epoch) are refused too, by the row count
    the state keeps; without it the position resumed silently over other documents."""
    ds = synthetic()
    run = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3)
    next(iter(run))
    with pytest.raises(ValueError, match=r"batches per epoch.*resume with the same dataset"):
        PackedLoader(ds, batch_size=3, max_seq_len=24, seed=3).load_state_dict(run.state_dict())
    # another world size mid-epoch: the position's own message (an epoch's end resumes; see the test below)
    with pytest.raises(ValueError, match=r"ran on 1 data-parallel rank\(s\), this one on 2; its position .*resume "
                                         r"with torchrun --nproc-per-node 1 or plain chronicals train"):
        PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3, world_size=2).load_state_dict(run.state_dict())
    a = PackedLoader(ds, batch_size=64, max_seq_len=24, seed=0)
    b = PackedLoader(ds, batch_size=64, max_seq_len=40, seed=0)
    assert len(a) == len(b) == 1 and len(a.rows) != len(b.rows)
    with pytest.raises(LoaderMismatch, match=f"{len(a.rows)} packed rows and 1 batch per epoch, this one seed=0, "
                                             f"{len(b.rows)} and 1"):
        b.load_state_dict(a.state_dict())


def test_loader_with_no_batch_fails_at_construction():
    """The refusal suggests remainder='train' only where there are global batches for it to spread over the ranks
    (with none at all, "train" gives no batch either)."""
    ds = synthetic(n=3)  # 3 documents of <= 24 tokens: at most 3 rows
    with pytest.raises(ValueError, match=r"give no batch per rank .*world_size=8.* or remainder='train'"):
        PackedLoader(ds, batch_size=1, max_seq_len=24, world_size=8, remainder="drop")
    assert len(PackedLoader(ds, batch_size=1, max_seq_len=24, world_size=8)) == 1  # "train": 5 ranks get an empty one
    with pytest.raises(ValueError, match="remainder='keep'; expected one of train, drop"):
        PackedLoader(ds, batch_size=1, max_seq_len=24, remainder="keep")
    for remainder in ("train", "drop"):  # 0 global batches
        with pytest.raises(ValueError, match=r"give no batch per rank .*drop_last=True") as e:
            PackedLoader(ds, batch_size=4, max_seq_len=24, drop_last=True, remainder=remainder)
        assert "or remainder='train'" not in str(e.value)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=0; expected an integer >= 1"):
        PackedLoader(ds, tokens_per_batch=64, max_seq_len=24, pad_to_multiple_of=0)
    # no documents at all (load_dataset refuses them first; a direct caller got numpy's "zero-size array" message)
    empty = TokenizedDataset(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(1, np.int64), 0, DatasetStats(), 8)
    for kw in (dict(batch_size=1), dict(tokens_per_batch=16)):
        with pytest.raises(ValueError, match="PackedLoader: 0 documents pack into 0 rows, which give no batch"):
            PackedLoader(empty, max_seq_len=8, **kw)


@pytest.mark.parametrize("remainder", ["train", "drop"])
def test_rows_left_out_under_data_parallel(remainder):
    """Every rank takes the same number of batches: with remainder="drop" rows_left_out counts the rows of the
    remainder batches; with "train" every document is trained once an epoch, the last round padded with empty
    batches. With drop_last, the short last global batch's rows are left out beside the empty batches (which train
    nothing): counted as trained, "train" on 3 ranks said 0 rows left out and build_loaders' warning stayed silent."""
    ds = synthetic(n=60)
    left, empty = {}, {}
    for shape, w in (({"batch_size": 5}, 1), ({"batch_size": 5}, 2), ({"batch_size": 5}, 3),
                     ({"batch_size": 7}, 4), ({"tokens_per_batch": 40}, 3), ({"tokens_per_batch": 40}, 1),
                     ({"batch_size": 5, "drop_last": True}, 3)):
        ranks = [PackedLoader(ds, max_seq_len=24, seed=1, rank=r, world_size=w, remainder=remainder, **shape)
                 for r in range(w)]
        batches = [b for r in ranks for b in r]
        seen = [d for b in batches for d in check_batch(b, ds)]
        assert len(seen) == len(set(seen))
        rows_seen = sum(set(row) <= set(seen) for row in ranks[0].rows)
        assert ranks[0].rows_left_out == len(ranks[0].rows) - rows_seen
        assert sum(not b.num_docs for b in batches) == ranks[0].empty_batches
        left[(*shape.values(), w)] = ranks[0].rows_left_out
        empty[(*shape.values(), w)] = ranks[0].empty_batches
        if remainder == "train" and "drop_last" not in shape:
            assert sorted(seen) == list(range(len(ds)))
    # 36 rows: 8 batches of 5 (3 ranks: 6 rows left), 6 of 7 (4 ranks: the 8 rows of batches 5-6); 20 budget rows;
    # drop_last: 7 batches of 5 (1 row left; 3 ranks: "drop" leaves batch 7 too, "train" runs 2 empty batches)
    if remainder == "drop":
        assert left == {(5, 1): 0, (5, 2): 0, (5, 3): 6, (7, 4): 8, (40, 3): 2, (40, 1): 0, (5, True, 3): 6}, left
        assert set(empty.values()) == {0}
    else:
        assert left == {(5, 1): 0, (5, 2): 0, (5, 3): 0, (7, 4): 0, (40, 3): 0, (40, 1): 0, (5, True, 3): 1}, left
        assert empty == {(5, 1): 0, (5, 2): 0, (5, 3): 1, (7, 4): 2, (40, 3): 1, (40, 1): 0, (5, True, 3): 2}, empty


def test_a_checkpoint_from_before_the_remainder_setting_names_the_fix():
    """A loader state saved when the remainder was always dropped (no "remainder" key) under a remainder: the
    refusal says to resume with remainder='drop', which then restores the position. A state that has its remainder
    is a LoaderMismatch naming the counts (the trainer's "this run changed data.dp_remainder"), not told that it
    predates the remainder setting."""
    ds = synthetic(n=60)
    old = PackedLoader(ds, batch_size=5, max_seq_len=24, seed=1, world_size=3, remainder="drop")
    next(iter(old))
    assert old.state_dict()["remainder"] == "drop"
    with pytest.raises(LoaderMismatch, match="2 batches per epoch, this one seed=1, 36 and 3") as e:
        PackedLoader(ds, batch_size=5, max_seq_len=24, seed=1, world_size=3).load_state_dict(old.state_dict())
    assert "from before the remainder setting" not in str(e.value)
    state = {k: v for k, v in old.state_dict().items() if k != "remainder"}
    with pytest.raises(ValueError, match=r"left the last 2 of 8 global batches out .*remainder='drop' "
                                         r"\(data.dp_remainder=drop\)"):
        PackedLoader(ds, batch_size=5, max_seq_len=24, seed=1, world_size=3).load_state_dict(state)
    again = PackedLoader(ds, batch_size=5, max_seq_len=24, seed=1, world_size=3, remainder="drop")
    again.load_state_dict(state)
    assert (again.epoch, again.position) == (0, 1)


def test_build_loaders_warns_about_rows_left_out(tokenizer, tmp_path, caplog):
    import json
    import logging

    from chronicals.config import load_config
    from chronicals.train.setup import build_loaders

    data = tmp_path / "t.jsonl"  # one ~40-token document per 64-token row: 7 rows
    data.write_text("".join(json.dumps({"text": f"doc {i} " + "word " * 36}) + "\n" for i in range(7)))
    cfg = load_config(None, ["data.max_seq_len=64", "data.cache_dir=none", "eval.qa=false", "data.batch_size=3",
                             "data.dp_remainder=drop", f"data.path={data}", f"train.out_dir={tmp_path / 'run'}"])
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        loader, _, _ = build_loaders(cfg, tokenizer, tmp_path / "run", rank=0, world_size=2)
    assert len(loader.rows) == 7 and loader.rows_left_out == 1  # 3 global batches of 3, 3, 1 rows: 2 trained
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("training data: 1 of 7 packed rows per epoch (about 1 "
                                                     "document, ")
    assert "other ones are left out each time" in warned[0]
    assert warned[0].endswith("use data.dp_remainder=train (a new run), or data.batch_size=2 or 4 (ceil(7 / "
                              "batch_size) a multiple of 2 ranks), or a number of ranks that divides the 3 batches")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        build_loaders(cfg, tokenizer, tmp_path / "run", rank=1, world_size=2)  # rank 0 says it
        build_loaders(cfg, tokenizer, tmp_path / "run")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    cfg.data.dp_remainder = "train"  # the default: the 3rd global batch goes to rank 0, rank 1 runs an empty one
    with caplog.at_level(logging.INFO, logger="chronicals.train"):
        loader, _, _ = build_loaders(cfg, tokenizer, tmp_path / "run", rank=0, world_size=2)
    assert loader.rows_left_out == 0 and loader.empty_batches == 1 and len(loader) == 2
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "the last round of each epoch fills 1 of the 2 ranks; the others run an empty batch" in caplog.text


def test_build_loaders_names_a_batch_size_that_tokens_per_batch_overrides(tokenizer, tmp_path, caplog):
    import json
    import logging

    from chronicals.config import load_config
    from chronicals.train.setup import build_loaders

    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i} " + "word " * 12}) + "\n" for i in range(30)))
    cfg = load_config(None, ["data.max_seq_len=64", "data.tokens_per_batch=128", "data.batch_size=3",
                             "data.cache_dir=none", "eval.qa=false", f"data.path={data}",
                             f"train.out_dir={tmp_path / 'run'}"])
    with caplog.at_level(logging.WARNING):
        build_loaders(cfg, tokenizer, tmp_path / "run", rank=1, world_size=2)  # rank 0 says it
        assert not [r for r in caplog.records if "batch_size" in r.getMessage()]
        loader, _, _ = build_loaders(cfg, tokenizer, tmp_path / "run")
    assert all(len(row) == 1 for row in (b.input_ids for b in loader))  # one packed row per micro-batch
    warned = [r.getMessage() for r in caplog.records if "data.batch_size=3 is not used" in r.getMessage()]
    assert len(warned) == 1 and "data.tokens_per_batch=128" in warned[0], warned


@pytest.mark.parametrize("saved_w,new_w", [(2, 1), (2, 3), (1, 2)])
def test_an_epoch_end_resumes_on_another_number_of_ranks(saved_w, new_w):
    """A checkpoint at an epoch's end (position = batches per rank) names the same place under any number of ranks,
    as the README says; it was refused because the per-rank batch count, which follows the rank count, differed.
    Mid-epoch positions stay refused."""
    ds = synthetic(n=60)
    kw = dict(batch_size=2, max_seq_len=24, seed=1)
    old = PackedLoader(ds, **kw, world_size=saved_w)
    list(old)  # one whole epoch: epoch 1, position 0 ...
    end = {**old.state_dict(), "epoch": 0, "position": len(old)}  # ... or, as a checkpoint at the last step wrote it
    for state in (old.state_dict(), end):
        new = PackedLoader(ds, **kw, world_size=new_w)
        new.load_state_dict(state)
        first_of_next = next(iter(new))  # the next epoch's first batch of rank 0
        fresh = PackedLoader(ds, **kw, world_size=new_w)
        fresh.set_epoch(1)
        assert first_of_next.input_ids.tolist() == next(iter(fresh)).input_ids.tolist()
    mid = {**old.state_dict(), "epoch": 0, "position": 1}
    with pytest.raises(ValueError, match=f"ran on {saved_w} data-parallel rank\\(s\\), this one on {new_w}; its "
                                         f"position \\(batch 1 of {len(old)} per rank"):
        PackedLoader(ds, **kw, world_size=new_w).load_state_dict(mid)
    other = {**old.state_dict(), "seed": 2}  # a real change is still one
    with pytest.raises(ValueError, match="the saved loader had seed=2"):
        PackedLoader(ds, **kw, world_size=new_w).load_state_dict(other)


@pytest.mark.parametrize("saved,new,new_w", [("drop", "train", 1), ("train", "drop", 1), ("drop", "train", 3)])
def test_an_epoch_end_resumes_under_another_remainder(saved, new, new_w):
    """The saved per-rank batch count is checked under the saved world_size and the saved remainder (the state keeps
    it): 9 global batches on 2 ranks, 4 per rank under "drop", 5 under "train". Recomputed under this run's
    remainder, an epoch's end was refused as a LoaderMismatch."""
    ds = synthetic(n=60)
    kw = dict(batch_size=4, max_seq_len=24, seed=1)
    old = PackedLoader(ds, **kw, world_size=2, remainder=saved)
    assert old._global_batches() == 9
    list(old)
    for state in (old.state_dict(), {**old.state_dict(), "epoch": 0, "position": len(old)}):
        resumed = PackedLoader(ds, **kw, world_size=new_w, remainder=new)
        resumed.load_state_dict(state)
        fresh = PackedLoader(ds, **kw, world_size=new_w, remainder=new)
        fresh.set_epoch(1)
        assert next(iter(resumed)).input_ids.tolist() == next(iter(fresh)).input_ids.tolist()
        assert resumed.epoch == 1  # the next epoch's first batch, not one of the saved epoch
    assert old.state_dict()["remainder"] == saved


def test_a_position_past_the_epoch_is_refused():
    lengths = np.array([5, 7, 3, 6, 4, 8])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ds = TokenizedDataset(np.arange(1, offsets[-1] + 1, dtype=np.int32), np.ones(offsets[-1], bool), offsets, 0,
                          DatasetStats(records=6, documents=6, tokens=int(offsets[-1])), 8)
    loader = PackedLoader(ds, batch_size=1, max_seq_len=8)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="position"):
        loader.load_state_dict({**state, "position": len(loader) + 1})


def test_a_dataset_indexes_like_a_list():
    ids = np.arange(1, 11, dtype=np.int32)
    ds = TokenizedDataset(ids, np.ones(10, bool), np.array([0, 3, 10]), 0, DatasetStats(), 16)
    assert ds[-1][0].tolist() == list(range(4, 11)) and ds[-2][0].tolist() == [1, 2, 3]
    assert [d[0].tolist() for d in ds] == [[1, 2, 3], list(range(4, 11))]
    for i in (2, -3):
        with pytest.raises(IndexError, match=f"document {i} of a dataset of 2"):
            ds[i]


def test_a_state_of_another_row_order_is_refused():
    """shuffle was not in the state: a shuffled loader's position loaded into an unshuffled one repeated some
    documents and skipped others (a property walk). Refused; states from before it was saved still load."""
    from chronicals.data.loader import LoaderMismatch

    ds = synthetic()
    run = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3)
    next(iter(run))
    state = run.state_dict()
    with pytest.raises(LoaderMismatch, match=r"the saved loader shuffled its rows' order, this one keeps it; .*"
                                             r"resume with shuffle=True"):
        PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3, shuffle=False).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "shuffle"}
    PackedLoader(ds, batch_size=2, max_seq_len=24, seed=3).load_state_dict(old)


def test_a_dataset_without_a_digest_resumes_a_state_with_one():
    """A dataset-like object without ``digest`` is not checked against the saved digest (no check, as the loader
    documents): comparing the saved digest with None refused every such resume as DataChanged."""

    class NoDigest:  # the TokenizedDataset interface the loader reads, without digest
        def __init__(self, ds):
            self._ds, self.lengths, self.pad_id, self.stats = ds, ds.lengths, ds.pad_id, ds.stats

        def __len__(self):
            return len(self._ds)

        def __getitem__(self, i):
            return self._ds[i]

    ds = synthetic()
    saved = PackedLoader(ds, batch_size=2, max_seq_len=24, seed=1)
    it = iter(saved)
    for _ in range(3):
        next(it)
    state = saved.state_dict()
    assert isinstance(state["data_digest"], str)
    new = PackedLoader(NoDigest(ds), batch_size=2, max_seq_len=24, seed=1)
    new.load_state_dict(state)
    assert new.state_dict()["position"] == 3 and "data_digest" not in new.state_dict()


def test_an_empty_batch_is_as_wide_as_the_other_ranks_batches():
    """Rows mode: batches are max_seq_len wide; the empty one of a last round was rounded up to pad_to_multiple_of
    (token-budget mode's setting): (1, 20) beside (1, 16), a second shape for a CUDA graph (a property walk).
    Token-budget mode: the empty batch is rounded up to pad_to_multiple_of like every other batch; unrounded it was
    (1, 24) beside widths of 32 and 48, off the multiple that bounds the shapes a compiled step sees."""
    ds = synthetic(n=3, max_len=16)
    loaders = [PackedLoader(ds, batch_size=1, max_seq_len=16, shuffle=False, rank=r, world_size=4,
                            pad_to_multiple_of=5) for r in range(4)]
    shapes = {tuple(b.input_ids.shape) for loader in loaders for b in loader}
    assert shapes == {(1, 16)} and sum(loader.empty_batches for loader in loaders[:1]) > 0
    ds = synthetic(n=5)  # 5 documents of <= 24 tokens in rows of <= 48: fewer global batches than 4 ranks
    loaders = [PackedLoader(ds, tokens_per_batch=48, max_seq_len=24, seed=0, rank=r, world_size=4,
                            pad_to_multiple_of=16) for r in range(4)]
    batches = [b for loader in loaders for b in loader]
    empty = [b for b in batches if not b.num_docs]
    assert len(empty) == loaders[0].empty_batches > 0
    assert all(b.input_ids.shape[1] % 16 == 0 for b in batches), [b.input_ids.shape for b in batches]
    assert {tuple(b.input_ids.shape) for b in empty} == {(1, 32)}


def test_token_budget_mode_reshuffles_its_rows_each_epoch():
    """data.tokens_per_batch: each epoch takes the packed rows in another seeded order, as rows mode does (unshuffled,
    BFD's order is longest-first, a silent curriculum; untested: a mutation walk)."""
    ds = synthetic()
    a = PackedLoader(ds, tokens_per_batch=64, max_seq_len=24, seed=7)
    e0, e1 = [b.input_ids.tolist() for b in a], [b.input_ids.tolist() for b in a]
    assert e0 != e1 and sorted(map(str, e0)) == sorted(map(str, e1))
    assert [b.input_ids.tolist() for b in PackedLoader(ds, tokens_per_batch=64, max_seq_len=24, seed=8)] != e0


def test_shuffle_false_keeps_the_packed_order():
    """shuffle=False (the held-out loader's) takes the rows as packed, every epoch (untested: a mutation walk)."""
    keep = PackedLoader(synthetic(), batch_size=1, max_seq_len=24, shuffle=False)
    for _ in range(2):
        assert [int(b.input_ids[0, 0]) // 1000 - 1 for b in keep] == [row[0] for row in keep.rows]


def test_an_epoch_yields_exactly_its_batches():
    """One epoch's iterator ends after len(loader) batches: read through islice, so a loader that never ends fails
    here at once instead of filling the memory (a mutation walk's `list(loader)` reached 10.9 GB)."""
    from itertools import islice

    for kw in (dict(batch_size=3), dict(tokens_per_batch=64), dict(batch_size=2, rank=1, world_size=3)):
        loader = PackedLoader(synthetic(), max_seq_len=24, **kw)
        assert len(list(islice(iter(loader), len(loader) + 1))) == len(loader), kw


def test_token_budget_slots_count_the_padding_to_a_multiple():
    """stats["slots"] (the setup log's packing efficiency) counts the padding to pad_to_multiple_of: the batches'
    own sizes (untested: a mutation walk)."""
    padded = PackedLoader(synthetic(), tokens_per_batch=64, max_seq_len=24, pad_to_multiple_of=16)
    assert padded.stats["slots"] == sum(b.input_ids.numel() for b in padded) > padded.stats["tokens"]


def test_the_loader_refuses_bad_arguments_from_python():
    """The config checks these first; a Python caller gets the loader's own message instead of a ZeroDivisionError
    (batch_size=0), rank 0's batches twice (rank == world_size) or other rows (a negative or fractional position)."""
    ds = synthetic()
    with pytest.raises(ValueError, match="batch_size=0"):
        PackedLoader(ds, batch_size=0, max_seq_len=24)
    # a negative rank too: rank=-1 failed at iteration (rows mode) or took the epoch's last row (token budgets)
    for rank, kw in ((2, dict(batch_size=1)), (-1, dict(batch_size=2)), (-1, dict(tokens_per_batch=48))):
        with pytest.raises(ValueError, match=rf"rank={rank} must be in 0..world_size-1 \(world_size=2\)"):
            PackedLoader(ds, max_seq_len=24, rank=rank, world_size=2, **kw)
    loader = PackedLoader(ds, batch_size=2, max_seq_len=24)
    # not an integer: 1.5 resumed silently at batch 1, "2" failed with Python's bare TypeError
    for key, value in (("position", -1), ("position", 1.5), ("position", "2"), ("epoch", 0.5)):
        with pytest.raises(ValueError, match=f"no '{key}' \\(a non-negative integer\\)"):
            loader.load_state_dict({**loader.state_dict(), key: value})


@pytest.mark.parametrize("new_w", [1, 2, 3])
def test_a_cut_epoch_end_resumed_on_other_ranks_names_the_untrained_batch(new_w, caplog):
    """0.9 of 10 global batches on 2 ranks: rank 1's 5th batch is empty, so global batch 10 is not trained. A resume
    of that epoch's end on any number of ranks says so. On 3 ranks it said nothing: the saved position was first
    rewritten to this loader's own batches (4), times the saved 2 ranks is 8 < 9; without the cap at the epoch's
    batches 1 rank said "10..20" (a mutation walk)."""
    import logging

    ds = rows_of_eight(10)
    saved = PackedLoader(ds, batch_size=1, max_seq_len=8, seed=0, rank=0, world_size=2)
    saved.cut_epoch(0, 9)
    assert len(list(saved)) == 5  # the whole cut epoch: position 5 of 5
    state = {**saved.state_dict(), "epoch": 0, "position": 5}  # as the checkpoint at its last step wrote it
    new = PackedLoader(ds, batch_size=1, max_seq_len=8, seed=0, rank=0, world_size=new_w)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        new.load_state_dict(state)
    assert "global batches 10..10 of that epoch are not trained" in caplog.text, caplog.text


def test_the_cut_warning_names_only_the_cut_epochs_batches(caplog):
    """The not-trained warning counts handed-out global batches capped at the cut epoch's own, and only for the
    cut's own epoch. Uncapped, 9 global batches on 2 ranks (rank 1's 5th batch empty) named batches "8..10" and
    warned about a cut of all 9; for a checkpoint in epoch 0 of a 1.5-epoch run (cut on epoch 1) it warned that
    epoch 1's batches are not trained although the resumed run trains them."""
    import logging

    def resume(ds, state, kw):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.data"):
            new = PackedLoader(ds, **kw)
            new.load_state_dict(state)
        return new, caplog.text

    ds = rows_of_eight(9)
    kw = dict(batch_size=1, max_seq_len=8, seed=0, rank=0, world_size=2)
    for cut, warned in ((7, "8..9"), (9, None)):
        saved = PackedLoader(ds, **kw)
        saved.cut_epoch(0, cut)
        assert len(list(saved)) == 5  # 9 global batches on 2 ranks: 5 each, rank 1's 5th empty
        _, text = resume(ds, {**saved.state_dict(), "epoch": 0, "position": 5}, kw)
        if warned:
            assert f"trained {cut} of epoch 0's first 9 global batches" in text, text
            assert f"global batches {warned} of that epoch are not trained" in text, text
        else:
            assert "not trained" not in text, text

    ds = synthetic()
    kw = dict(batch_size=2, max_seq_len=24, seed=0)
    saved = PackedLoader(ds, **kw)
    saved.cut_epoch(1, 2)  # the last pass: 2 global batches of epoch 1
    it = iter(saved)
    for _ in range(5):
        next(it)
    state = saved.state_dict()
    assert state["epoch"] == 0 and state["cut"] == [1, 2]
    new, text = resume(ds, state, kw)  # resumed without that cut (more epochs)
    assert "not trained" not in text, text
    assert (new.epoch, new.position) == (0, 5)


def test_a_cut_past_the_epochs_end_trains_the_whole_epoch():
    """cut_epoch(epoch, k) trains the first k global batches, capped at the epoch's own: a cut past the end trains the
    whole epoch as cut G does, the rank past the last batch getting its empty batch. Uncapped, that rank asked for
    global batch G, which holds no rows, and failed in collate_rows ("no rows"). The trainer's cut is <= G; the cap
    is for direct callers."""
    ds = rows_of_eight(5)  # 5 global batches on 2 ranks: rank 1's 3rd batch is empty
    for cut in (5, 8):
        got = []
        for rank in range(2):
            loader = PackedLoader(ds, batch_size=1, max_seq_len=8, seed=0, rank=rank, world_size=2)
            loader.cut_epoch(0, cut)
            got.append([int(b.num_docs) for b in loader])
        assert got == [[1, 1, 1], [1, 1, 0]], (cut, got)


def test_a_document_one_token_over_max_seq_len_is_refused_in_either_mode():
    """The loader refuses any document longer than max_seq_len with its own message, in rows mode and in
    token-budget mode, where a budget of several max_seq_len would hold it."""
    ds = of_lengths(5, 9, 3)
    for kw in (dict(batch_size=1), dict(tokens_per_batch=32)):
        with pytest.raises(ValueError, match="a document has 9 tokens > max_seq_len=8; load the dataset"):
            PackedLoader(ds, max_seq_len=8, **kw)


def test_a_token_budget_below_max_seq_len_is_refused_even_for_short_documents():
    """tokens_per_batch must hold a document of max_seq_len, whether or not this dataset has one; a budget of exactly
    max_seq_len is accepted."""
    ds = of_lengths(3, 4, 2)
    with pytest.raises(ValueError, match="tokens_per_batch=7 < max_seq_len=8; a step must hold the longest"):
        PackedLoader(ds, tokens_per_batch=7, max_seq_len=8)
    assert len(PackedLoader(ds, tokens_per_batch=8, max_seq_len=8).rows) == 2


def test_a_state_without_shuffle_loads_into_an_unshuffled_loader():
    """States written before the loader saved ``shuffle`` carry no row order to compare: they load into an unshuffled
    loader (the held-out one) as into a shuffled one."""
    ds = of_lengths(5, 7, 3, 6, 4, 8)
    run = PackedLoader(ds, batch_size=1, max_seq_len=8, shuffle=False)
    next(iter(run))
    old = {k: v for k, v in run.state_dict().items() if k != "shuffle"}
    resumed = PackedLoader(ds, batch_size=1, max_seq_len=8, shuffle=False)
    resumed.load_state_dict(old)
    assert (resumed.epoch, resumed.position) == (0, 1)


def test_stats_carry_the_datasets_counts():
    """loader.stats reports the rows and batches it packed beside the dataset's own counts, each under its name."""
    ds = of_lengths(5, 7, 3, stats=DatasetStats(records=13, documents=3, tokens=15, loss_tokens=12, truncated=1,
                                                dropped_overlong=2, dropped_no_loss=3, skipped_errors=4))
    st = PackedLoader(ds, batch_size=2, max_seq_len=8).stats
    keys = ("documents", "rows", "batches_per_epoch", "tokens", "loss_tokens", "truncated", "dropped_overlong",
            "dropped_no_loss", "skipped_errors")
    assert {k: st[k] for k in keys} == {"documents": 3, "rows": 2, "batches_per_epoch": 1, "tokens": 15,
                                        "loss_tokens": 12, "truncated": 1, "dropped_overlong": 2,
                                        "dropped_no_loss": 3, "skipped_errors": 4}


def test_every_batch_pads_with_the_datasets_pad_id():
    """Rows mode, a token-budget row rounded up to pad_to_multiple_of and the empty batch of a last round all fill
    their padding with the dataset's pad_id (token 0 is a real token), so input_ids != pad_id marks the real tokens."""
    ds = of_lengths(5, 7, 3, pad_id=99)  # ids 1..15; rows [7], [5, 3]
    for kw in (dict(batch_size=1), dict(tokens_per_batch=8, pad_to_multiple_of=8)):
        loaders = [PackedLoader(ds, max_seq_len=8, shuffle=False, rank=r, world_size=3, **kw) for r in range(3)]
        batches = [b for loader in loaders for b in loader]
        assert sum(not b.num_docs for b in batches) == loaders[0].empty_batches == 1, kw
        for b in batches:
            assert int((b.input_ids != 99).sum()) == b.num_tokens, kw
