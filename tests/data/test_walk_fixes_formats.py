"""Fixes from the data-journey walk: text that looks like JSON, template errors as bad records, tool calls,
the Alpaca-prompt note and the no-loss summary."""

import csv
import json

import pytest

from chronicals.data import load_dataset
from chronicals.data.readers import DataError


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
    assert trained_spans(tokenizer, *chat[0]) == ["pong<|im_end|>\n"]
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
             "{{ m['content'] + '<|im_end|>\n' }}{END}{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}"
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
