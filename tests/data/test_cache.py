"""The tokenization cache: its key (the tokenizer's settings, the digest of every module that turns records into
tokens, the files' contents but not their names), where data.cache_dir may be, and damaged entries detected,
named in a warning, and rebuilt in place."""

import errno
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

import chronicals.data.cache as cache_mod
import chronicals.data.dataset as dsmod
from chronicals.config import from_dict
from chronicals.data import DataError, load_dataset
from chronicals.data.cache import tokenizer_fingerprint
from chronicals.train.guards import check_data_paths

from smollm2_tokenizer import smollm2_tokenizer
from test_formats import write_jsonl

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


def damage_file_counts(entry):  # valid JSON, a field edited by hand: int("x") raised a bare ValueError
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps(meta | {"file_counts": ["x"]}))


def damage_file_counts_bool(entry):  # true is no record count, though Python's sum() takes it as 1
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps(meta | {"file_counts": [True]}))


@pytest.mark.parametrize("damage", [damage_truncate_header, damage_truncate_data, damage_meta, damage_shorter_ids,
                                    damage_missing_meta, damage_offsets_disagree, damage_file_counts,
                                    damage_file_counts_bool])
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


def test_encoder_digest_covers_every_module_that_turns_records_into_tokens():
    names = {Path(f).name for f in cache_mod.ENCODER_FILES}
    assert {"readers.py", "_jsonio.py", "formats.py", "chat_template.py", "chat_turns.py", "tokenize.py", "dataset.py",
            "workers.py"} <= names


def test_cache_entries_of_other_encoding_code_are_not_reused(tokenizer, tmp_path, monkeypatch):
    import chronicals.data.cache as cache_mod

    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "abc"}])
    load_dataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    before = list((tmp_path / "cache").iterdir())
    monkeypatch.setattr(cache_mod, "encoder_digest", lambda: "the code of another release")
    load_dataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    after = [d for d in (tmp_path / "cache").iterdir() if not d.name.startswith(".")]
    assert len(after) == 1 and after != before  # another entry, which replaced the older code's


def test_a_cache_version_bump_is_another_key(tokenizer, tmp_path, monkeypatch):
    """CACHE_VERSION is bumped when the entry layout or DatasetStats change: every entry of the older layout is then
    another key (tokenized again), never loaded as if it had the new layout."""
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "one two"}])
    settings = {"format": "auto", "max_seq_len": 64, "loss_on": "assistant", "overlong": "truncate"}
    before = cache_mod.cache_key([p], tokenizer, settings)
    assert cache_mod.cache_key([p], tokenizer, settings) == before
    monkeypatch.setattr(cache_mod, "CACHE_VERSION", cache_mod.CACHE_VERSION + 1)
    assert cache_mod.cache_key([p], tokenizer, settings) != before


def test_the_encoder_digest_covers_the_masking_code(tmp_path):
    from pathlib import Path

    import chronicals.data.cache as cache_mod

    here = Path(cache_mod.__file__).parent
    assert {"tokenize.py", "formats.py"} <= set(cache_mod.ENCODER_FILES)  # where 3a2cf1f changed the masks
    assert {"readers.py", "../_jsonio.py"} <= set(cache_mod.ENCODER_FILES)  # what a record is: read, then encoded
    copies = [tmp_path / f"{i}_{Path(n).name}" for i, n in enumerate(cache_mod.ENCODER_FILES)]
    for name, copy in zip(cache_mod.ENCODER_FILES, copies):
        copy.write_bytes((here / name).read_bytes())
    assert cache_mod.files_digest(copies) == cache_mod.encoder_digest()
    copies[1].write_bytes(copies[1].read_bytes() + b"\n# edited\n")
    assert cache_mod.files_digest(copies) != cache_mod.encoder_digest()


def _text(path):
    path.write_text(json.dumps({"text": "hello world"}) + "\n")
    return path


def test_split_special_tokens_is_part_of_the_cache_key_and_text_still_ends_in_eos(tmp_path):
    plain, split = smollm2_tokenizer(), smollm2_tokenizer()
    split.split_special_tokens = True
    assert tokenizer_fingerprint(plain) != tokenizer_fingerprint(split)
    data = _text(tmp_path / "a.jsonl")
    a = load_dataset([data], plain, max_seq_len=64, cache_dir=tmp_path / "cache")
    b = load_dataset([data], split, max_seq_len=64, cache_dir=tmp_path / "cache")
    for ds in (a, b):  # the eos as its id (with loss), not '<|im_end|>' tokenized as text pieces
        ids, mask = ds[0][0], ds[0][1]
        assert int(ids[-1]) == plain.eos_token_id and bool(mask[-1])
    assert a[0][0].tolist() == b[0][0].tolist()
    # and text that spells a special token keeps it in pieces under the split setting, as the cache must know
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "a<|im_end|>b"}) + "\n")
    c = load_dataset([tmp_path / "b.jsonl"], plain, max_seq_len=64, cache_dir=tmp_path / "cache")
    d = load_dataset([tmp_path / "b.jsonl"], split, max_seq_len=64, cache_dir=tmp_path / "cache")
    assert len(d[0][0]) > len(c[0][0])


def test_a_cache_hit_names_the_files_by_this_runs_names(tmp_path, tokenizer):
    """The cache is keyed by the files' contents: after `mv old.jsonl new.jsonl` the entry's "file:line" of the
    first bad record named old.jsonl, a file that no longer exists."""
    from chronicals.data import load_dataset

    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"txt": "x"}) + "\n")
    kw = dict(max_seq_len=32, on_error="skip", cache_dir=tmp_path / "cache")
    first = load_dataset([str(old)], tokenizer, **kw)
    assert first.stats.first_errors[0].startswith(f"{old}:2: ")
    old.rename(new)
    again = load_dataset([str(new)], tokenizer, **kw)  # a cache hit
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert again.stats.first_errors == [e.replace(str(old), str(new), 1) for e in first.stats.first_errors]


def test_a_cache_hit_renames_each_file_by_its_whole_name(tokenizer, tmp_path, caplog):
    """The entry was written for d/a.jsonl and d/a.jsonl.jsonl (one name a prefix of the other); the same contents
    read again as e/x.jsonl and e/y.jsonl hit it. The second file's bad record is e/y.jsonl:2: matching old names
    without their ":" renamed it by the first file's prefix, to "e/x.jsonl.jsonl:2"."""
    good, bad = [{"text": "one"}, {"text": "two"}], [{"text": "three"}, {"nothing": 1}]
    d, e = tmp_path / "d", tmp_path / "e"
    d.mkdir(), e.mkdir()
    kw = dict(max_seq_len=64, on_error="skip", cache_dir=tmp_path / "cache")
    first = load_dataset([write_jsonl(d / "a.jsonl", good), write_jsonl(d / "a.jsonl.jsonl", bad)], tokenizer, **kw)
    assert first.stats.first_errors[0].startswith(f"{d / 'a.jsonl.jsonl'}:2: ")
    x, y = write_jsonl(e / "x.jsonl", good), write_jsonl(e / "y.jsonl", bad)
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        again = load_dataset([x, y], tokenizer, **kw)
    assert "loaded 3 documents from cache" in caplog.text
    assert again.stats.first_errors[0].startswith(f"{y}:2: "), again.stats.first_errors


def test_a_cache_entry_damaged_within_its_shape_is_rebuilt(tmp_path, tokenizer, caplog):
    """Zeroed trainable masks (same shape and dtype) passed the entry's checks: a step trained on 0 loss tokens."""
    import logging

    from chronicals.data import load_dataset

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(4)))
    kw = dict(max_seq_len=32, cache_dir=tmp_path / "cache")
    first = load_dataset([str(data)], tokenizer, **kw)
    [entry] = list((tmp_path / "cache").iterdir())
    masks = np.load(entry / "trainable.npy")
    assert masks.any()
    np.save(entry / "trainable.npy", np.zeros_like(masks))
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        again = load_dataset([str(data)], tokenizer, **kw)
    assert "is damaged (the arrays do not match the digest written with them" in caplog.text
    assert np.array_equal(again.trainable, first.trainable)


@pytest.mark.parametrize("inside", [True, False])
def test_a_cache_dir_inside_the_data_directory_is_refused_before_the_model_loads(tmp_path, inside):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    cache = data / "cache" if inside else tmp_path / "cache"
    cfg = from_dict({"data": {"path": str(data), "cache_dir": str(cache)}, "train": {"out_dir": str(tmp_path / "run")}})
    if inside:  # its meta.json would be read as a data file by the next run
        with pytest.raises(ValueError, match=r"data.cache_dir=.* is inside data.path=.*put data.cache_dir outside"):
            check_data_paths(cfg)
        return
    check_data_paths(cfg)
    cache.write_text("a file")  # said before the model loads (it was said after)
    with pytest.raises(ValueError, match=r"data.cache_dir=.* is a file, not a directory"):
        check_data_paths(cfg)


def _entries(root: Path) -> list[str]:
    return sorted(d.name for d in root.iterdir() if not d.name.startswith("."))


def test_an_edited_files_older_entry_is_removed_when_the_new_one_is_written(tokenizer, tmp_path, caplog):
    """Each edit of the data left another full entry under the cache for ever (~5 bytes a token: 12 GB per edit of a
    10 GB set; a data walk at scale). The new entry of the same files, tokenizer and settings replaces it; entries of
    other settings or of the same contents under another path stay, and the new entry's size is said. The replaced
    entry is really deleted: it was left moved aside in a hidden .bad-* directory, none of its bytes freed, while the
    log said "removed"."""
    cache = tmp_path / "cache"
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "one two"}, {"text": "three"}])
    load_dataset(data, tokenizer, max_seq_len=64, cache_dir=cache)
    load_dataset(data, tokenizer, max_seq_len=32, cache_dir=cache)  # other settings: another entry, kept
    copy = write_jsonl(tmp_path / "copy.jsonl", [{"text": "one two"}, {"text": "three"}])
    load_dataset(copy, tokenizer, max_seq_len=64, cache_dir=cache)  # the same contents: the same entry (a hit)
    first = _entries(cache)
    assert len(first) == 2
    write_jsonl(data, [{"text": "one two"}, {"text": "three four"}])  # edited
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset(data, tokenizer, max_seq_len=64, cache_dir=cache)
    now = _entries(cache)
    assert len(now) == 2 and len(set(now) - set(first)) == 1  # the max_seq_len=32 entry stays
    assert not [d.name for d in cache.iterdir() if d.name.startswith(".")]  # nothing hidden left behind
    assert "removed 1 older tokenization cache entry of the same files and settings" in caplog.text
    assert any(r.getMessage().startswith("cached ") and " tokens in " in r.getMessage() for r in caplog.records)
    assert load_dataset(data, tokenizer, max_seq_len=64, cache_dir=cache).ids.tolist() == ds.ids.tolist()
    # the copy's entry was the edited file's old one: its next load tokenizes again, and keeps the new entry
    load_dataset(copy, tokenizer, max_seq_len=64, cache_dir=cache)
    assert len(_entries(cache)) == 3


def test_a_cache_entry_is_readable_by_others(tokenizer, tmp_path):
    """Entries were mkdtemp's 0700: in a cache shared by a team the others re-tokenized, then warned they could not
    write the entry (a concurrency walk). Readable like the GGUF cache's."""
    import stat

    cache = tmp_path / "cache"
    load_dataset(write_jsonl(tmp_path / "d.jsonl", [{"text": "a b"}]), tokenizer, max_seq_len=64, cache_dir=cache)
    (entry,) = [d for d in cache.iterdir() if not d.name.startswith(".")]
    assert stat.S_IMODE(entry.stat().st_mode) & 0o055 == 0o055


def test_pruning_keeps_other_tokenizers_entries_and_survives_damaged_neighbours(tokenizer, tmp_path, caplog):
    """The entry a new one replaces is of the same files, settings and tokenizer: two models trained in turn on one
    data set keep an entry each (else each run re-tokenized the whole set). A damaged neighbour's meta.json ('{', a
    list) is not an entry of ours: left alone, and the load goes on (a ValueError there crashed load_dataset after
    the whole set was tokenized). A writer's hidden temporary directory is never moved (its rename would fail)."""
    from test_template_fallback import BASES, make_tokenizer

    cache = tmp_path / "cache"
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "one two"}])
    load_dataset(data, tokenizer, max_seq_len=64, cache_dir=cache)
    (entry,) = _entries(cache)
    source = json.loads((cache / entry / "meta.json").read_text())["source"]
    other = make_tokenizer(tokenizer, *BASES["chatml"])  # the same vocabulary, another template
    load_dataset(data, other, max_seq_len=64, cache_dir=cache)
    assert len(_entries(cache)) == 2
    for name, text in (("x", "{"), ("y", "[]")):
        (cache / name).mkdir()
        (cache / name / "meta.json").write_text(text)
    writing = cache / ".tmp-live"
    writing.mkdir()
    (writing / "meta.json").write_text(json.dumps({"source": source}))
    write_jsonl(data, [{"text": "one two three"}])  # edited: the first tokenizer's entry is replaced
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        load_dataset(data, tokenizer, max_seq_len=64, cache_dir=cache)
    assert len(_entries(cache)) == 4 and entry not in _entries(cache)  # 2 entries + x + y (_entries: not hidden)
    assert writing.is_dir() and (cache / "x").is_dir() and (cache / "y").is_dir()
    assert "removed 1 older tokenization cache entry of the same files and settings" in caplog.text


def test_a_tokenizer_with_another_chat_template_gets_its_own_entry(tokenizer, tmp_path):
    """Another chat template over the same vocabulary and special tokens (a fine-tuner's edited template, another
    default system prompt) gives other ids and masks: keyed without the template, the second run hit the first
    one's entry and trained on the other template's tokens, without a word."""
    import copy

    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template.replace("You are a helpful AI assistant named SmolLM",
                                                          "You answer arithmetic questions")
    first = load(data, tokenizer, tmp_path / "cache")
    fresh = load(data, other, None)
    assert not same(fresh, first) and same(load(data, other, tmp_path / "cache"), fresh)


def test_a_tokenizer_with_another_eos_gets_its_own_entry(tokenizer, tmp_path):
    """Another eos token (set in code, or named by another tokenizer_config.json) ends every text document in
    another id: keyed without the special tokens, the second run trained its documents to end in the old eos, which
    this model's generation does not stop on."""
    import copy

    data = write_jsonl(tmp_path / "t.jsonl", [{"text": f"note {i}"} for i in range(3)])
    other = copy.deepcopy(tokenizer)
    other.eos_token = "<|endoftext|>"
    assert other.eos_token_id != tokenizer.eos_token_id
    load(data, tokenizer, tmp_path / "cache")
    cached = load(data, other, tmp_path / "cache")
    assert int(cached.ids[-1]) == other.eos_token_id and same(cached, load(data, other, None))


def _word_level(vocab: dict) -> PreTrainedTokenizerFast:
    t = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", eos_token="[EOS]")


def test_a_tokenizer_with_another_vocabulary_gets_another_fingerprint():
    """Two tokenizers of one class, chat template and special tokens that give the same words other ids: the
    fingerprint (part of the cache key) covers the vocabulary, so the second does not load the first one's entry
    and train on its ids. Keyed without it, the two shared an entry; the same vocabulary still shares one."""
    vocab = {"[UNK]": 0, "[EOS]": 1, "hello": 2, "world": 3}
    a, b = _word_level(vocab), _word_level({**vocab, "hello": 3, "world": 2})
    assert a("hello world").input_ids != b("hello world").input_ids and a.special_tokens_map == b.special_tokens_map
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(_word_level(dict(vocab)))


def _pre_digest_entry(tokenizer, tmp_path):
    """(data file, its dataset, its cache entry) with the digest taken out of the entry's meta.json, as an entry
    written before meta.json carried one."""
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first = load(data, tokenizer, tmp_path / "cache")
    [entry] = [tmp_path / "cache" / n for n in _entries(tmp_path / "cache")]
    meta = json.loads((entry / "meta.json").read_text())
    del meta["digest"]
    (entry / "meta.json").write_text(json.dumps(meta))
    return data, first, entry


@pytest.mark.parametrize("kind", ["start", "end", "empty"])
def test_an_entry_from_before_the_digest_with_bad_offsets_is_rebuilt(tokenizer, tmp_path, caplog, kind):
    """An entry written before meta.json carried the arrays' digest (the same CACHE_VERSION, so still read) has only
    load()'s checks between a damaged offsets.npy and training: documents that skip tokens, cut into others or are
    empty. It is said to be damaged and rebuilt."""
    data, first, entry = _pre_digest_entry(tokenizer, tmp_path)
    off = np.load(entry / "offsets.npy")
    if kind == "start":  # the first document starts past token 0
        off[0] = 1
    elif kind == "end":  # the last document ends before the last token
        off[-1] -= 1
    else:
        off[1] = off[2]
    np.save(entry / "offsets.npy", off)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        again = load(data, tokenizer, tmp_path / "cache")
    assert "offsets.npy does not split" in caplog.text and "rebuilding it" in caplog.text
    assert same(again, first)


def test_an_intact_entry_from_before_the_digest_is_loaded(tokenizer, tmp_path, caplog):
    """The digest check applies only to an entry that has one: a pre-digest entry with intact arrays is loaded from
    the cache as it is (checking it regardless raised a bare KeyError out of load_dataset)."""
    data, first, entry = _pre_digest_entry(tokenizer, tmp_path)
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        again = load(data, tokenizer, tmp_path / "cache")
    assert "loaded 6 documents from cache" in caplog.text and "damaged" not in caplog.text
    assert same(again, first)


def test_a_nested_cache_dir_that_does_not_exist_yet_is_made(tokenizer, tmp_path):
    """data.cache_dir defaults to ~/.cache/chronicals/data, whose parents a fresh machine (or a new CHRONICALS_CACHE)
    lacks too: it is made with its parents, not refused as "cannot create it"."""
    cache = tmp_path / "home" / ".cache" / "chronicals" / "data"
    load(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer, cache)
    assert len(_entries(cache)) == 1


def test_a_cache_dir_starting_with_tilde_is_under_the_home_directory(tmp_path, monkeypatch):
    """data.cache_dir=~/tok-cache names $HOME/tok-cache; without expanding it a directory literally named '~' was
    made in the working directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert cache_mod.check_cache_root("~/tok-cache") == home / "tok-cache"
    assert cache_mod.cache_root("~/tok-cache") == home / "tok-cache"
    assert (home / "tok-cache").is_dir() and not (cwd / "~").exists()


def test_an_edited_files_older_entry_is_removed_whatever_the_paths_spelling(tokenizer, tmp_path, monkeypatch):
    """An entry names its files by their resolved paths: `d.jsonl` from its directory, then the absolute path after
    an edit, is one file, and its older entry goes (else each edit left a whole entry, ~5 bytes a token)."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"text": "one two"}])
    load("d.jsonl", tokenizer, tmp_path / "cache")
    write_jsonl(tmp_path / "d.jsonl", [{"text": "one two three"}])
    load(str(tmp_path / "d.jsonl"), tokenizer, tmp_path / "cache")
    assert len(_entries(tmp_path / "cache")) == 1


def _entry(path: Path, meta: dict | None = None) -> Path:
    cache_mod.save(path, np.arange(5, dtype=np.int32), np.ones(5, bool), np.array([0, 2, 5], np.int64),
                   meta if meta is not None else {"pad_id": 0, "stats": {"documents": 2, "tokens": 5}})
    return path


@pytest.mark.parametrize("edit", [
    lambda meta: {}, lambda meta: [], lambda meta: {"pad_id": 0, "stats": {"documents": 2}},
    lambda meta: {"pad_id": 0, "stats": 3},
    # the entry's own meta.json with only pad_id edited
    lambda meta: {**meta, "pad_id": "0"}, lambda meta: {**meta, "pad_id": None}, lambda meta: {**meta, "pad_id": 1.5},
    lambda meta: {**meta, "pad_id": True},
], ids=["empty", "a list", "no tokens", "stats a number", "pad_id a string", "pad_id null", "pad_id a float",
        "pad_id true"])
def test_a_meta_json_of_the_wrong_shape_is_a_damaged_entry(tmp_path, edit):
    """Valid JSON that is not an entry's meta (a hand edit, another tool's file), or a pad_id that is no integer (the
    collator pads rows with it), is a CacheError, which load_dataset rebuilds: a bare KeyError or TypeError crashed
    every run until the user found the entry and deleted it."""
    entry = _entry(tmp_path / "e")
    (entry / "meta.json").write_text(json.dumps(edit(json.loads((entry / "meta.json").read_text()))))
    with pytest.raises(cache_mod.CacheError, match="meta.json is unreadable|pad_id is"):
        cache_mod.load(entry)


@pytest.mark.parametrize("name, dtype", [("ids", np.float32), ("trainable", np.int8), ("offsets", np.int32)])
def test_an_array_of_another_dtype_is_a_damaged_entry(tmp_path, name, dtype):
    """ids.npy is int32, trainable.npy bool, offsets.npy int64: one of the right length in another dtype (another
    tool's or a hand-made file: float ids, a 0/1/2 int8 mask) is a CacheError naming it, which load_dataset rebuilds;
    it was loaded as a valid entry, arrays the collator would misread."""
    entry = _entry(tmp_path / "e")
    np.save(entry / f"{name}.npy", np.load(entry / f"{name}.npy").astype(dtype))
    with pytest.raises(cache_mod.CacheError, match=f"{name}.npy holds {np.dtype(dtype)}"):
        cache_mod.load(entry)


def test_a_cache_entry_that_cannot_be_written_is_a_warning_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    """A disk full while writing an entry: the data is tokenized already, so it is a warning and the run goes on,
    with no entry and no temporary entry left behind. Let through, the OSError stopped the run after tokenizing."""
    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        _entry(tmp_path / "e")
    assert "could not write the tokenization cache entry" in caplog.text and "No space left" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_loses_the_race_for_its_key_says_nothing(tmp_path, monkeypatch, caplog):
    """Two runs started together tokenize the same data into one cache; the other publishes the same entry between
    this writer's check and its rename. The entry is there and whole: no warning that the next run tokenizes again
    (it does not), the entry loads, and no temporary entry is left."""
    import shutil

    entry, real = tmp_path / "e", Path.rename

    def raced(self, target):
        if Path(target) == entry and self.name.startswith(".tmp-"):
            shutil.copytree(self, entry)  # the other writer's entry, published just now
        return real(self, target)

    monkeypatch.setattr(Path, "rename", raced)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        _entry(entry)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    monkeypatch.setattr(Path, "rename", real)
    ids, trainable, offsets, meta = cache_mod.load(entry)
    assert ids.tolist() == list(range(5)) and offsets.tolist() == [0, 2, 5]
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".")]


def test_a_publish_that_fails_is_a_warning_naming_its_cause(tmp_path, monkeypatch, caplog):
    """The rename that publishes the entry failing with no other writer's entry in its place: the warning that the
    next run tokenizes again names the rename's own error (not a later one of a missing entry), and no temporary
    entry is left."""
    entry, real = tmp_path / "e", Path.rename

    def refused(self, target):
        if Path(target) == entry:
            raise OSError(errno.EACCES, "Permission denied")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", refused)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        _entry(entry)
    assert "could not write the tokenization cache entry" in caplog.text and "Permission denied" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_live_writers_temporary_entry_is_not_swept_by_another_save(tmp_path, monkeypatch, caplog):
    """A writer holds the flock on its temporary entry's lock file until it publishes: another save meanwhile (a
    second run writing another entry into the same cache) leaves that temporary entry alone and both entries are
    published. Without the lock the second save took the live write for a killed writer's and removed it: the first
    save failed with a warning and its entry was never written."""
    real, nested = np.save, []

    def other_writer_meanwhile(file, arr, *a, **k):
        if not nested:  # the first writer is between its lock and its rename
            nested.append(1)
            _entry(tmp_path / "other")
        return real(file, arr, *a, **k)

    monkeypatch.setattr(np, "save", other_writer_meanwhile)
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        _entry(tmp_path / "e")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    for name in ("e", "other"):
        assert cache_mod.load(tmp_path / name)[0].tolist() == list(range(5))


def test_changing_overlong_is_another_cache_entry(tokenizer, tmp_path):
    """overlong decides which documents exist (truncate: cut to max_seq_len; drop: gone; split: several pieces), so
    it is part of the cache key: a rerun with data.on_long=split after a truncating run must not load the
    truncated documents from the cache (the tokens the user asked to keep silently lost)."""
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 100}, {"text": "short one"}])
    kw = dict(max_seq_len=32, cache_dir=tmp_path / "cache")
    truncated = load_dataset(p, tokenizer, overlong="truncate", **kw)
    split = load_dataset(p, tokenizer, overlong="split", **kw)
    dropped = load_dataset(p, tokenizer, overlong="drop", **kw)
    assert (len(truncated), truncated.stats.truncated) == (2, 1)
    assert len(split) > 2 and split.stats.split == 1 and split.stats.truncated == 0
    assert (len(dropped), dropped.stats.dropped_overlong, dropped.stats.truncated) == (1, 1, 0)
    assert len(_entries(tmp_path / "cache")) == 3


def test_another_format_on_the_same_files_is_another_cache_entry(tokenizer, tmp_path):
    """format decides how a record reads: {"prompt", "completion", "text"} is prompt/completion under auto and text
    under format=text, so format is part of the cache key. Without it a format=text run after an auto one loaded
    the auto entry and trained the completion alone, the prompt masked, though the user asked for the text field."""
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: hi", "completion": " A: yo", "text": "something else"}])
    kw = dict(max_seq_len=64, cache_dir=tmp_path / "cache")
    auto = load_dataset(p, tokenizer, **kw)
    text = load_dataset(p, tokenizer, format="text", **kw)
    fresh = load_dataset(p, tokenizer, max_seq_len=64, format="text")
    assert not np.array_equal(auto.ids, fresh.ids)
    assert np.array_equal(text.ids, fresh.ids) and np.array_equal(text.trainable, fresh.trainable)
    assert len(_entries(tmp_path / "cache")) == 2


def test_a_cache_on_a_file_system_without_flock_is_written_and_hit(tokenizer, tmp_path, no_flock, caplog):
    """flock failing with ENOLCK (some network mounts): the entry is written unlocked, so the next load reads it
    instead of tokenizing again, and the writer's lock file is not published with it."""
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    first = load(p, tokenizer, tmp_path / "cache")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        again = load(p, tokenizer, tmp_path / "cache")
    assert "loaded 6 documents from cache" in caplog.text and same(first, again)
    assert not list((tmp_path / "cache").rglob(cache_mod.WRITER_LOCK))
