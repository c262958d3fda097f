"""Session 26's audit of the data pipeline: the tokenization cache missed split_special_tokens (and text records
then ended in the eos spelled out in pieces), a mixed CSV's text rows read as empty alpaca records, and a held-out
file inside (or equal to) data.path was trained on as well."""

from __future__ import annotations

import csv
import json

import pytest

from chronicals.config import ConfigError, load_config
from chronicals.data import load_dataset
from chronicals.data.cache import tokenizer_fingerprint
from chronicals.train.guards import check_data_paths
from smollm2_tokenizer import smollm2_tokenizer


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


def test_a_mixed_csv_reads_its_text_rows_as_text(tmp_path):
    """pandas' to_csv of mixed records writes the missing fields as empty cells: ",,Paris." is a text row."""
    recs = [{"instruction": "Say hi", "output": "hi"}, {"text": "The capital of France is Paris."}]
    cols = ["instruction", "output", "text"]
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in recs:
            w.writerow([r.get(c, "") for c in cols])
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = smollm2_tokenizer()
    from_csv = load_dataset([tmp_path / "a.csv"], tok, max_seq_len=128)
    from_jsonl = load_dataset([tmp_path / "a.jsonl"], tok, max_seq_len=128)
    assert "Paris" in tok.decode(from_csv[1][0])
    for i in range(2):
        assert from_csv[i][0].tolist() == from_jsonl[i][0].tolist()
        assert from_csv[i][1].tolist() == from_jsonl[i][1].tolist()


def _cfg(tmp_path, *args):
    return load_config(None, ["model.path=/nonexistent/model", f"train.out_dir={tmp_path / 'run'}", *args])


def test_a_heldout_file_inside_or_equal_to_the_training_data_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    train = _text(tmp_path / "data" / "train.jsonl")
    (tmp_path / "data" / "sub").mkdir()
    held = _text(tmp_path / "data" / "sub" / "held.jsonl")
    with pytest.raises(ConfigError, match=r"data.eval_path=.*held.jsonl is inside data.path=.*data, whose files are "
                                          r"all read as training data, so it would be trained on"):
        check_data_paths(_cfg(tmp_path, f"data.path={tmp_path / 'data'}", f"data.eval_path={held}"))
    with pytest.raises(ConfigError, match=r"data.eval_path=.*train.jsonl is data.path=.*, which would be trained on"):
        check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={train}"))
    apart = _text(tmp_path / "held.jsonl")
    check_data_paths(_cfg(tmp_path, f"data.path={tmp_path / 'data'}", f"data.eval_path={apart}"))
    check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={held}"))  # a file beside a file
