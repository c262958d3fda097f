"""Each format, the chat-template loss mask, every reader, the cache and parallel tokenization."""

import csv
import json
import os

import numpy as np
import pytest

import chronicals.data.dataset as dsmod
from chronicals.data import load_dataset
from chronicals.data.formats import Example
from chronicals.data.tokenize import encode, encode_chat

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4, I think\nso."}]


def trained_spans(tok, ids, mask):
    """Decoded runs of consecutive trainable tokens."""
    spans, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans + ([tok.decode(cur)] if cur else [])


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_chat_mask_is_exactly_the_assistant_turns(tokenizer):
    ids, mask = encode_chat(tokenizer, CHAT)
    assert ids.tolist() == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    # ChatML: each assistant turn is "<|im_start|>assistant\n{content}<|im_end|>\n"; the reply and its end
    # token are trained, not the newline after it (never generated: generation stops at <|im_end|>), nothing else
    assert trained_spans(tokenizer, ids, mask) == ["Hello there.<|im_end|>", "4, I think\nso.<|im_end|>"]


def test_generation_markers_give_the_same_mask(tokenizer):
    marked = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
              "{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = marked
        ids_m, mask_m = encode_chat(tokenizer, CHAT, markers=True)
        ids_p, mask_p = encode_chat(tokenizer, CHAT, markers=False)
    finally:
        tokenizer.chat_template = saved
    assert ids_m.tolist() == ids_p.tolist()
    assert mask_m.tolist() == mask_p.tolist()
    assert trained_spans(tokenizer, ids_m, mask_m) == ["Hello there.<|im_end|>", "4, I think\nso.<|im_end|>"]


def test_unlocatable_assistant_turns_raise(tokenizer):
    with pytest.raises(ValueError, match="before assistant message 0 .*expected a user or system message first"):
        encode_chat(tokenizer, [{"role": "assistant", "content": "first"}])
    saved = tokenizer.chat_template
    try:  # a template that rewrites earlier turns once more follow (as reasoning templates do)
        tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + (m['content'] if loop.last else "
                                   "'...') + '\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
        with pytest.raises(ValueError, match="not prefix-stable at message 2"):
            encode_chat(tokenizer, CHAT)
    finally:
        tokenizer.chat_template = saved


def test_each_format(tokenizer, tmp_path):
    records = [
        {"messages": CHAT},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "yo"},
                           {"from": "gpt", "value": "sup"}]},
        {"instruction": "Add.", "input": "1 2", "output": "3"},
        {"instruction": "Say hi.", "output": "hi"},
        {"prompt": "Q: capital of France? A:", "completion": " Paris"},
        {"prompt": [{"role": "user", "content": "ping"}], "completion": [{"role": "assistant", "content": "pong"}]},
        {"text": "The quick brown fox."},
    ]
    ds = load_dataset(write_jsonl(tmp_path / "mixed.jsonl", records), tokenizer, max_seq_len=512)
    assert len(ds) == len(records) and ds.stats.documents == len(records)
    got = [trained_spans(tokenizer, *ds[i]) for i in range(len(ds))]
    assert got[0] == ["Hello there.<|im_end|>", "4, I think\nso.<|im_end|>"]
    assert got[1] == ["sup<|im_end|>"]
    assert tokenizer.decode(ds[1][0]).startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nyo")
    assert got[2] == ["3<|im_end|>"] and "Add.\n\n1 2<|im_end|>" in tokenizer.decode(ds[2][0])
    assert got[3] == ["hi<|im_end|>"]
    assert got[4] == [" Paris<|im_end|>"]
    assert got[5] == ["pong<|im_end|>"]
    assert got[6] == ["The quick brown fox.<|im_end|>"]  # text: every token (eos appended)
    assert ds.stats.loss_tokens == sum(int(ds[i][1][1:].sum()) for i in range(len(ds)))


def test_loss_on_all_and_named_format(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    ds = load_dataset(path, tokenizer, format="chat", max_seq_len=512, loss_on="all")
    assert ds[0][1].all()
    assert ds[0][0].tolist() == encode_chat(tokenizer, CHAT)[0].tolist()


def test_alpaca_without_chat_template_uses_alpaca_prompt(tokenizer):
    from chronicals.data.formats import to_example

    ex = to_example({"instruction": "Add.", "input": "1 2", "output": "3"}, "alpaca", has_chat_template=False)
    assert ex.messages is None and ex.prompt.endswith("### Input:\n1 2\n\n### Response:\n") and ex.target == "3"
    ids, mask = encode(tokenizer, ex)
    assert trained_spans(tokenizer, ids, mask) == ["3<|im_end|>"]


def test_every_reader_gives_the_same_dataset(tokenizer, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"instruction": f"Repeat {i}.", "input": "x" * i, "output": str(i) * (i + 1)} for i in range(5)]
    want = load_dataset(write_jsonl(tmp_path / "a.jsonl", rows), tokenizer, max_seq_len=256)
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        w.writeheader()
        w.writerows(rows)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "a.parquet")
    disk = tmp_path / "saved"  # what datasets.save_to_disk writes: arrow IPC stream files + state.json
    disk.mkdir()
    with pa.OSFile(str(disk / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (disk / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                 "_fingerprint": "0", "_split": "train"}))
    (disk / "dataset_info.json").write_text("{}")
    pdir = tmp_path / "pq_dir"
    pdir.mkdir()
    pq.write_table(table.slice(0, 2), pdir / "part-0.parquet")
    pq.write_table(table.slice(2), pdir / "part-1.parquet")
    for source in ["a.json", "a.csv", "a.parquet", "saved", "pq_dir"]:
        ds = load_dataset(tmp_path / source, tokenizer, max_seq_len=256)
        assert ds.ids.tolist() == want.ids.tolist() and ds.trainable.tolist() == want.trainable.tolist(), source
        assert ds.offsets.tolist() == want.offsets.tolist(), source


def test_cache_hit_and_invalidation(tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"text": "abc"}])
    cache = tmp_path / "cache"
    first = load_dataset(path, tokenizer, max_seq_len=128, cache_dir=cache)
    real = dsmod._tokenize

    def forbidden(*a, **k):
        raise AssertionError("tokenized again although cached")

    monkeypatch.setattr(dsmod, "_tokenize", forbidden)
    again = load_dataset(path, tokenizer, max_seq_len=128, cache_dir=cache)
    assert np.array_equal(again.ids, first.ids) and np.array_equal(again.trainable, first.trainable)
    assert again.stats == first.stats
    with pytest.raises(AssertionError, match="tokenized again"):  # other settings: another key
        load_dataset(path, tokenizer, max_seq_len=128, loss_on="all", cache_dir=cache)
    write_jsonl(path, [{"messages": CHAT}, {"text": "abd"}])
    with pytest.raises(AssertionError, match="tokenized again"):  # other contents: another key
        load_dataset(path, tokenizer, max_seq_len=128, cache_dir=cache)
    monkeypatch.setattr(dsmod, "_tokenize", real)
    assert len(list(cache.iterdir())) == 1


def test_parallel_tokenization_matches_serial(tokenizer, tmp_path, monkeypatch):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * (i % 7 + 1)}]}
            for i in range(40)] + [{"text": "oops"}, {"bad": 1}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    monkeypatch.setattr(dsmod, "CHUNK", 10)
    serial = load_dataset(path, tokenizer, max_seq_len=64, num_proc=1, on_error="skip")
    parallel = load_dataset(path, tokenizer, max_seq_len=64, num_proc=2, on_error="skip")
    assert parallel.ids.tolist() == serial.ids.tolist() and parallel.offsets.tolist() == serial.offsets.tolist()
    assert parallel.trainable.tolist() == serial.trainable.tolist()
    assert serial.stats.skipped_errors == parallel.stats.skipped_errors == 1 and len(serial) == 41


def test_serial_tokenization_leaves_tokenizer_threads_alone(tokenizer, tmp_path, monkeypatch):
    """Only worker processes turn the Rust tokenizer's threads off, never the calling (training) process."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    load_dataset(write_jsonl(tmp_path / "s.jsonl", [{"text": "abc"}]), tokenizer, max_seq_len=64, num_proc=1)
    assert "TOKENIZERS_PARALLELISM" not in os.environ
