"""The tokenization cache: damaged entries are detected, named in a warning, and rebuilt in place."""

import json
import logging

import numpy as np
import pytest

import chronicals.data.dataset as dsmod
from chronicals.data import DataError, load_dataset

ROWS = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(6)]


def load(path, tokenizer, cache):
    return load_dataset(path, tokenizer, max_seq_len=64, cache_dir=cache)


def same(a, b):
    return (np.array_equal(a.ids, b.ids) and np.array_equal(a.trainable, b.trainable)
            and np.array_equal(a.offsets, b.offsets) and a.stats == b.stats)


def damage_truncate_header(entry):
    p = entry / "ids.npy"
    p.write_bytes(p.read_bytes()[:90])


def damage_truncate_data(entry):
    p = entry / "ids.npy"
    p.write_bytes(p.read_bytes()[:140])


def damage_meta(entry):
    (entry / "meta.json").write_text("{garbage")


def damage_shorter_ids(entry):
    np.save(entry / "ids.npy", np.load(entry / "ids.npy")[:9])


def damage_missing_meta(entry):  # a write that crashed before meta.json
    (entry / "meta.json").unlink()


def damage_offsets_disagree(entry):
    off = np.load(entry / "offsets.npy")
    off[1] = off[2]
    np.save(entry / "offsets.npy", off)


@pytest.mark.parametrize("damage", [damage_truncate_header, damage_truncate_data, damage_meta, damage_shorter_ids,
                                    damage_missing_meta, damage_offsets_disagree])
def test_damaged_entry_is_rebuilt(tokenizer, tmp_path, caplog, damage):
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cache = tmp_path / "cache"
    fresh = load(p, tokenizer, cache)
    (entry,) = [d for d in cache.iterdir()]
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        rebuilt = load(p, tokenizer, cache)
    assert same(rebuilt, fresh)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and str(entry) in warned[0] and "rebuilding it" in warned[0], warned
    assert sorted(d.name for d in cache.iterdir()) == [entry.name]  # replaced, no temp or bad copies left
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        again = load(p, tokenizer, cache)  # the repaired entry loads without a warning
    assert same(again, fresh) and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_cache_dir_that_is_a_file_fails_before_tokenizing(tokenizer, tmp_path, monkeypatch):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n")
    f = tmp_path / "cachefile"
    f.write_text("not a directory")
    monkeypatch.setattr(dsmod, "_tokenize", lambda *a, **k: pytest.fail("tokenized before checking cache_dir"))
    with pytest.raises(DataError, match=rf"data.cache_dir={f} is a file, not a directory; .*data.cache_dir=none"):
        load(p, tokenizer, f)
    with pytest.raises(DataError, match=rf"data.cache_dir={f / 'sub'}: cannot create it"):
        load(p, tokenizer, f / "sub")


def test_a_cache_hit_names_this_runs_files(tokenizer, tmp_path, caplog):
    """The entry is keyed by content: a byte-identical copy under another name hits it, and the log line of what
    was read names the copy (it replayed the first run's file names)."""
    a, b = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    b.write_bytes(a.read_bytes())
    cache = tmp_path / "cache"
    load(a, tokenizer, cache)
    caplog.clear()  # the first load's lines, captured when an earlier test left the logger at INFO
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load(b, tokenizer, cache)
    assert "loaded 6 documents from cache" in caplog.text
    assert "second.jsonl" in ds.summary and "first.jsonl" not in caplog.text and "6 records" in ds.summary
