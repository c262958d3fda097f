"""Fixes from the data-journey walk: text that looks like JSON, template errors as bad records, tool calls,
the Alpaca-prompt note and the no-loss summary."""

import csv
import json

import pytest

from chronicals.data import load_dataset
from chronicals.data.readers import DataError

from test_formats import trained_spans, write_jsonl


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
    with pytest.raises(DataError, match=r"m3.csv:2: field 'messages' is not valid JSON \(Expecting value\)"):
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
    assert ds.stats.first_errors[0] == (f"{path}:1: messages[1].content is a NoneType, expected a string (null only "
                                        "beside tool_calls)")
    assert ds.stats.first_errors[1].startswith(f"{path}:2: messages[1].tool_calls is a str ('get_weather()'); "
                                               "expected a list of")
    assert ds.stats.first_errors[2] == f"{path}:3: messages[1] has no 'content'; expected {{'role', 'content'}}"


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


def test_cache_entries_of_other_encoding_code_are_not_reused(tokenizer, tmp_path, monkeypatch):
    import chronicals.data.cache as cache_mod

    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "abc"}])
    load_dataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(cache_mod, "encoder_digest", lambda: "the code of another release")
    load_dataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 2


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
        assert notes == ["data: the dataset: the tokenizer has no chat template, so alpaca records use the classic "
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
