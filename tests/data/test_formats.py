"""Each format, the chat-template loss mask, every reader, the cache and parallel tokenization; text that looks
like JSON, a template that refuses a conversation (a bad record), tool calls, null fields (parquet's filled-in
columns) in auto-detection, the Alpaca-prompt note and the no-loss summary."""

import csv
import json
import os

import numpy as np
import pytest

import chronicals.data.dataset as dsmod
import chronicals.data.workers as workers_mod
from chronicals.data import load_dataset
from chronicals.data.formats import Example, FormatError, detect_format, to_example
from chronicals.data.readers import DataError, read_file
from chronicals.data.tokenize import encode, encode_chat

from smollm2_tokenizer import smollm2_tokenizer

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
    adir = tmp_path / "arrow_dir"  # loose arrow files, no state.json (were skipped without a word)
    adir.mkdir()
    for k, part in enumerate((table.slice(0, 3), table.slice(3))):
        with pa.OSFile(str(adir / f"part-{k}.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(part)
    for source in ["a.json", "a.csv", "a.parquet", "saved", "pq_dir", "arrow_dir"]:
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
    monkeypatch.setattr(workers_mod, "CHUNK", 10)
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


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


BRACKETS = [("[INST] Say hi [/INST]", " hi"), ("Reverse the list:", " [3, 2, 1]"), ("[1, 2, 3]", " sorted"),
            ('[{"role": "user"}] as text', " ok")]


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_prompt_completion_starting_with_a_bracket_is_text(tokenizer, tmp_path, kind):
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "b.jsonl", [{"prompt": p, "completion": c} for p, c in BRACKETS])
    else:
        path = write_csv(tmp_path / "b.csv", ["prompt", "completion"], BRACKETS)
    ds = load_dataset(path, tokenizer, max_seq_len=128)
    assert ds.stats.documents == len(BRACKETS) and ds.stats.skipped_errors == 0
    for i, (p, c) in enumerate(BRACKETS):
        ids, mask = ds[i]
        assert tokenizer.decode(ids) == p + c + tokenizer.eos_token
        assert trained_spans(tokenizer, ids, mask) == [c + tokenizer.eos_token]


def test_message_lists_as_json_text_only_in_csv(tokenizer, tmp_path):
    msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    rows = [(json.dumps(msgs),)]
    chat = load_dataset(write_csv(tmp_path / "m.csv", ["messages"], rows), tokenizer, max_seq_len=128)
    assert trained_spans(tokenizer, *chat[0]) == ["pong<|im_end|>"]
    pc = write_csv(tmp_path / "pc.csv", ["prompt", "completion"], [(json.dumps(msgs[:1]), json.dumps(msgs[1:]))])
    conv = load_dataset(pc, tokenizer, max_seq_len=128)
    assert conv.ids.tolist() == chat.ids.tolist() and conv.trainable.tolist() == chat.trainable.tolist()
    with pytest.raises(DataError, match=r"m2.csv:2: field 'messages' is JSON text of a list, expected a list of "
                                        "messages"):
        load_dataset(write_csv(tmp_path / "m2.csv", ["messages"], [("[1, 2]",)]), tokenizer, max_seq_len=128)
    with pytest.raises(DataError, match=r"m3.csv:2: field 'messages' is not valid JSON \(Expecting value at column 1\)"):
        load_dataset(write_csv(tmp_path / "m3.csv", ["messages"], [("hello",)]), tokenizer, max_seq_len=128)
    # in JSON lines a list is a list: a string is not decoded
    with pytest.raises(DataError, match=r"m.jsonl:1: field 'messages' is a str, expected list"):
        load_dataset(write_jsonl(tmp_path / "m.jsonl", [{"messages": json.dumps(msgs)}]), tokenizer,
                     max_seq_len=128)


NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}{GEN}"
             "{{ m['content'] + '<|im_end|>' }}{END}{{ '\n' }}{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture
def set_template(tokenizer):
    saved = tokenizer.chat_template
    yield lambda t: setattr(tokenizer, "chat_template", t)
    tokenizer.chat_template = saved


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_a_template_that_refuses_a_conversation_is_a_bad_record(tokenizer, tmp_path, set_template, markers, loss_on):
    gen = ("{% generation %}", "{% endgeneration %}") if markers else ("", "")
    set_template(NO_SYSTEM.replace("{GEN}", gen[0]).replace("{END}", gen[1]))
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "sys.jsonl", [{"messages": ok},
                                                {"messages": [{"role": "system", "content": "S"}] + ok},
                                                {"messages": ok}])
    with pytest.raises(DataError, match=rf"^{path}:2: the chat template refused this conversation: System role "
                                        "not supported"):
        load_dataset(path, tokenizer, max_seq_len=64, loss_on=loss_on)
    ds = load_dataset(path, tokenizer, max_seq_len=64, loss_on=loss_on, on_error="skip")
    assert (ds.stats.documents, ds.stats.skipped_errors) == (2, 1)
    assert ds.stats.first_errors == [f"{path}:2: the chat template refused this conversation: System role not "
                                     "supported"]


TOOLS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
         "{% if m.tool_calls is defined %}{% for t in m.tool_calls %}<tool_call>{{ t['function']['name'] }}("
         "{{ t['function']['arguments'] }})</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


@pytest.mark.parametrize("content", ["", None, "absent"])
def test_tool_calls_reach_the_template_and_carry_loss(tokenizer, tmp_path, set_template, content):
    set_template(TOOLS)
    call = {"role": "assistant", "tool_calls": CALL} | ({} if content == "absent" else {"content": content})
    messages = [{"role": "user", "content": "weather in Paris?"}, call,
                {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "18C"},
                {"role": "assistant", "content": "It is 18C."}]
    ds = load_dataset(write_jsonl(tmp_path / "tool.jsonl", [{"messages": messages}]), tokenizer, max_seq_len=256)
    ids, mask = ds[0]
    assert ids.tolist() == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert trained_spans(tokenizer, ids, mask) == [
        '<tool_call>get_weather({"city": "Paris"})</tool_call><|im_end|>', "It is 18C.<|im_end|>"]
    assert ds.stats.empty_targets == 0  # a tool call is a reply, not a blank one


def test_tool_call_checks(tokenizer, tmp_path, set_template):
    set_template(TOOLS)
    user = {"role": "user", "content": "hi"}
    bad = [{"role": "assistant", "content": None},  # null content without tool_calls
           {"role": "assistant", "content": "", "tool_calls": "get_weather()"},
           {"role": "assistant", "tool_calls": []}]  # no call: content is needed
    ok = {"messages": [user, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [user, m]} for m in bad] + [ok])
    ds = load_dataset(path, tokenizer, max_seq_len=64, on_error="skip")
    assert (ds.stats.skipped_errors, ds.stats.documents) == (3, 1)
    assert ds.stats.first_errors[0] == (f"{path}:1: messages[1].content is null, expected a string or a list "
                                        "of {'type': 'text', 'text': ...} parts (null only beside tool_calls)")
    assert ds.stats.first_errors[1].startswith(f"{path}:2: messages[1].tool_calls is a str ('get_weather()'); "
                                               "expected a list of")
    assert ds.stats.first_errors[2] == f"{path}:3: messages[1] has no 'content'; expected {{'role', 'content'}}"


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
@pytest.mark.parametrize("markers", [False, True])
def test_a_template_that_drops_tool_calls_makes_a_bad_record(tokenizer, tmp_path, set_template, loss_on, markers):
    """SmolLM2's template (the default model's) renders no tool_calls: a turn holding only a call trained
    `<|im_end|>` alone (the model learns to stop at once) without a warning, since a tool call counts as a reply.
    Now a bad record naming the message and the tool; the template that renders calls trains them as before."""
    plain = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             + ("{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}" if markers else
                "{{ m['content'] }}<|im_end|>")
             + "\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    set_template(plain)
    messages = [{"role": "user", "content": "weather in Paris?"}, {"role": "assistant", "content": "",
                                                                    "tool_calls": CALL},
                {"role": "tool", "content": "18C"}, {"role": "assistant", "content": "It is 18C."}]
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": messages}, ok])
    ds = load_dataset(path, tokenizer, max_seq_len=256, loss_on=loss_on, on_error="skip")
    assert (ds.stats.skipped_errors, ds.stats.documents) == (1, 1)
    assert ds.stats.first_errors == [
        f"{path}:1: message 1 calls tool 'get_weather', but the chat template does not render tool_calls (the call "
        "would be left out and the turn trained as an empty reply); use a model whose template renders tool calls "
        "(Qwen2.5's, Llama 3.1's), or write the call into the message's content"]
    set_template(TOOLS)
    assert load_dataset(path, tokenizer, max_seq_len=256, loss_on=loss_on).stats.documents == 2


def test_null_message_keys_are_dropped(tokenizer, tmp_path, set_template):
    """Parquet struct columns give every message every key, null where absent: 'is defined' must stay false."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    set_template(TOOLS)
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": CALL},
                {"role": "tool", "content": "18C"}, {"role": "assistant", "content": "18C."}]
    pq.write_table(pa.Table.from_pylist([{"messages": messages}]), tmp_path / "t.parquet")
    ds = load_dataset(tmp_path / "t.parquet", tokenizer, max_seq_len=256)
    want = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ds[0][0].tolist() == want


def test_the_classic_alpaca_prompt_is_logged_once(tokenizer, tmp_path, set_template, caplog):
    rows = [{"instruction": f"Add {i}.", "output": str(i)} for i in range(3)] + [{"text": "abc"}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with caplog.at_level("INFO", logger="chronicals.data"):
        load_dataset(path, tokenizer, max_seq_len=128, cache_dir=tmp_path / "cache")
    assert not [r for r in caplog.records if "classic Alpaca prompt" in r.getMessage()]  # a chat template
    set_template(None)
    for _ in range(2):  # tokenized, then from the cache
        caplog.clear()
        with caplog.at_level("INFO", logger="chronicals.data"):
            ds = load_dataset(path, tokenizer, max_seq_len=128, cache_dir=tmp_path / "cache")
        notes = [r.getMessage() for r in caplog.records if "classic Alpaca prompt" in r.getMessage()]
        assert notes == ["the dataset: the tokenizer has no chat template, so alpaca records use the classic "
                         "Alpaca prompt ('Below is an instruction ... ### Response:'); give the tokenizer a chat "
                         "template to train them as a chat"]
        assert "### Response:\n0" in tokenizer.decode(ds[0][0])


def test_an_empty_text_is_reported_as_such(tokenizer, tmp_path, caplog):
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": "abc"}, {"text": ""}])
    with caplog.at_level("WARNING", logger="chronicals.data"):
        ds = load_dataset(path, tokenizer, max_seq_len=64)
    assert (len(ds), ds.stats.dropped_no_loss, ds.stats.first_no_loss) == (1, 1, f"{path}:2")
    assert any("1 without loss tokens (dropped: no assistant turn / output / completion, or empty text; "
               f"first: {path}:2)" in r.getMessage() for r in caplog.records)


def test_null_fields_do_not_decide_the_format():
    assert detect_format({"text": "hello", "messages": None}) == "text"
    assert detect_format({"prompt": "a", "completion": "b", "text": None, "messages": None}) == "prompt_completion"
    assert detect_format({"messages": None}) == "chat"  # then read as chat: "field 'messages' is null"
    with pytest.raises(FormatError, match=r"cannot tell the format from fields \['body'\]"):
        detect_format({"body": None})


def test_null_columns_of_other_formats_do_not_decide_a_half_records_format():
    """pandas' to_json or a parquet file of mixed records gives each record every column, null where absent: a prompt
    whose completion is null is a prompt/completion record lacking its completion (it was read as chat, "field
    'messages' is null"), and an instruction beside a null output an alpaca record lacking its output."""
    record = {"messages": None, "instruction": None, "output": None, "prompt": "Q: 1+1?", "completion": None}
    assert detect_format(record) == "prompt_completion"
    with pytest.raises(FormatError, match=r"^field 'completion' is null \(format prompt_completion expects"):
        to_example(record, "prompt_completion", True)
    assert detect_format({"messages": None, "instruction": "Say hi", "output": None}) == "alpaca"


def test_a_formats_own_fields_win_over_a_text_field_beside_them():
    """Exports often carry a rendered "text" column beside messages, conversations, an alpaca record's fields or
    prompt/completion: the record is the structured format, which keeps its loss on the replies or the completion.
    Read as text (text checked first), it silently trained on every token."""
    msgs, conv = [{"role": "user", "content": "hi"}], [{"from": "human", "value": "hi"}]
    records = [{"text": "<rendered>", "messages": msgs}, {"messages": msgs, "text": "<rendered>"},
               {"text": "<rendered>", "conversations": conv},
               {"text": "<rendered>", "instruction": "Say hi", "output": "hi"},
               {"text": "Q: 2+2? A: 4", "prompt": "Q: 2+2? ", "completion": "A: 4"}]
    assert [detect_format(r) for r in records] == ["chat", "chat", "sharegpt", "alpaca", "prompt_completion"]
    ex = to_example(records[-1], detect_format(records[-1]), has_chat_template=False)
    assert (ex.prompt, ex.target) == ("Q: 2+2? ", "A: 4")


def test_a_mixed_parquet_file_reads_as_its_jsonl_does(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": ["hello", None], "messages": [None, [{"role": "user", "content": "hi"}]]})
    pq.write_table(table, tmp_path / "mixed.parquet")  # a column per field: each record's missing ones are null
    got = [detect_format(r.data) for r in read_file(tmp_path / "mixed.parquet")]
    assert got == ["text", "chat"]


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


@pytest.mark.parametrize("record, hint", [
    ({"instruction": "Name a colour.", "input": ""}, "it has 'instruction' but no 'output': alpaca records need both"),
    ({"output": "Blue.", "input": ""}, "it has 'output' but no 'instruction': alpaca records need both"),
    ({"prompt": "Q: 1+1?"}, "it has 'prompt' but no 'completion': prompt/completion records need both"),
])
def test_a_record_with_half_of_a_two_field_format_names_the_missing_field(record, hint):
    """An alpaca record missing its output, in a file of alpaca records: the error named no missing field."""
    with pytest.raises(FormatError, match="cannot tell the format") as e:
        detect_format(record)
    assert hint in str(e.value)
    with pytest.raises(FormatError) as e:
        detect_format({"body": "x"})
    assert "it has" not in str(e.value)


def test_openai_text_parts_train_as_the_string_they_join_to(tokenizer, tmp_path):
    """OpenAI's list content ([{"type": "text", "text": ...}, ...], what its chat exports and many datasets hold) was
    refused as "a list, expected a string". A text model's template takes one string: the parts joined by newlines.
    A part that is not text (an image) or an empty list is a bad record that names the part."""
    def parts(*texts):
        return [{"type": "text", "text": t} for t in texts]

    as_parts = {"messages": [{"role": "system", "content": parts("Be brief.")},
                             {"role": "user", "content": parts("Hi!", "2+2?")},
                             {"role": "assistant", "content": parts("4.")}]}
    as_text = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!\n2+2?"},
                            {"role": "assistant", "content": "4."}]}
    a = load_dataset(write_jsonl(tmp_path / "parts.jsonl", [as_parts]), tokenizer, max_seq_len=64)
    b = load_dataset(write_jsonl(tmp_path / "text.jsonl", [as_text]), tokenizer, max_seq_len=64)
    assert a[0][0].tolist() == b[0][0].tolist() and a[0][1].tolist() == b[0][1].tolist()
    user = {"role": "user", "content": "hi"}
    bad = [[{"type": "image_url", "image_url": {"url": "x.png"}}], [], ["hi"], [{"type": "text", "text": 3}],
           [{"type": "text"}]]
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [user, {"role": "assistant", "content": c}]}
                                                for c in bad] + [as_parts])
    ds = load_dataset(path, tokenizer, max_seq_len=64, on_error="skip")
    assert (ds.stats.skipped_errors, ds.stats.documents) == (5, 1)
    errors = ds.stats.first_errors
    assert errors[0] == (f"{path}:1: messages[1].content[0] is a part of type 'image_url'; a text model takes only "
                         "{'type': 'text', 'text': ...} parts: remove the others (images, audio), or give the content "
                         "as a string")
    assert errors[1].startswith(f"{path}:2: messages[1].content is an empty list")
    assert errors[2].startswith(f"{path}:3: messages[1].content[0] is a str ('hi')")
    # a text part without its text: was told to 'remove the others (images, audio)'
    assert errors[3] == (f"{path}:4: messages[1].content[0] is a part of type 'text' with 'text' an int (3), not a "
                         "string; give its text as {'type': 'text', 'text': '...'}")
    assert errors[4].startswith(f"{path}:5: messages[1].content[0] is a part of type 'text' with no 'text'; give")


def test_a_prompt_completion_split_inside_a_token_is_warned(tokenizer, tmp_path, caplog):
    """'Name: Jo' + 'hn Smith': the token ' John' holds prompt text and is trained; served 'Name: Jo' alone, the model
    sees ' Jo' and was never trained to go on from it. Said once with the count, the first record and the fix."""
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Name: Jo", "completion": "hn Smith"},
                                                {"prompt": "Name:", "completion": " John Smith"},
                                                {"prompt": "Complete the word: unbeliev", "completion": "able"}])
    with caplog.at_level("WARNING", logger="chronicals.data"):
        ds = load_dataset(path, tokenizer, max_seq_len=64, cache_dir=None)
    assert (ds.stats.across_boundary, ds.stats.first_across) == (2, f"{path}:1")
    assert f"2 of 3 examples split prompt and completion inside a token (first: {path}:1)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.data"):
        load_dataset(write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "Name:", "completion": " John"}]), tokenizer,
                     max_seq_len=64, cache_dir=None)
    assert "inside a token" not in caplog.text


def test_a_cache_hit_warns_again_about_a_split_inside_a_token(tokenizer, tmp_path, caplog, monkeypatch):
    """The cache entry's stats hold the count and the first record: a run that reads the entry says the warning as
    the run that tokenized did (a cache hit said nothing)."""
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Name: Jo", "completion": "hn Smith"},
                                                {"prompt": "Name:", "completion": " John Smith"}])
    for run in ("tokenized", "cache hit"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="chronicals.data"):
            ds = load_dataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
        assert ds.stats.across_boundary == 1
        said = [r.getMessage() for r in caplog.records if "inside a token" in r.getMessage()]
        assert len(said) == 1, (run, said)
        assert f"1 of 2 examples split prompt and completion inside a token (first: {path}:1)" in said[0]
        monkeypatch.setattr(dsmod, "_tokenize", lambda *a, **k: pytest.fail("not a cache hit"))


def test_a_tool_call_message_without_a_role_is_a_format_error_naming_it():
    """tool_calls excuse a missing 'content' only, not a missing 'role' ('from' in sharegpt): such a message is a
    FormatError naming its index and key (a bare KeyError escaped on_error=skip and named no record)."""
    call = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    rec = {"messages": [{"role": "user", "content": "q"}, {"content": None, "tool_calls": call}]}
    with pytest.raises(FormatError, match=r"messages\[1\] has no 'role'"):
        to_example(rec, "chat", True)
    conv = {"conversations": [{"value": None, "tool_calls": call}]}
    with pytest.raises(FormatError, match=r"conversations\[0\] has no 'from'"):
        to_example(conv, "sharegpt", True)
