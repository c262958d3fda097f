"""Records -> examples where a mutation walk found no test: CSV cells holding JSON (ShareGPT conversations too,
JSON nested too deeply), tool_calls that are not a list of objects, null message fields, blank targets (blank
assistant replies only), mixed prompt/completion forms, ShareGPT roles (and turns carrying role/content keys too),
the Alpaca user turn with and without an input, the classic Alpaca prompt with an input and an input that is not
valid Unicode; the half-pair hint of a record of nulls, what each format expects, the types a field takes, messages
that are not objects, ShareGPT's other senders, the index of a conversational prompt/completion's message, an
alpaca output list and a long bad value cut short."""
from __future__ import annotations

import csv
import json

import pytest

from chronicals.data.formats import Example, FormatError, detect_format, empty_target, to_example
from chronicals.data.readers import read_file


def test_a_csv_message_list_cell_may_start_with_whitespace():
    """' [{...}]' in a prompt/completion CSV cell is a message list, as '[{...}]' is."""
    rec = {"prompt": ' [{"role": "user", "content": "hi"}]', "completion": ' [{"role": "assistant", "content": "yo"}]'}
    ex = to_example(rec, "prompt_completion", True, from_csv=True)
    assert ex.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ex.train_from == 1


@pytest.mark.parametrize("text", ['[{"x": 1}]', "[]"])
def test_a_csv_prompt_that_is_json_but_no_message_list_stays_text(text):
    """Dicts without 'role', or the empty list, in a prompt cell: text, not a broken message list."""
    ex = to_example({"prompt": text, "completion": "ok"}, "prompt_completion", False, from_csv=True)
    assert ex.messages is None and ex.prompt == text and ex.target == "ok"


def test_a_csv_cell_of_json_nested_too_deeply_is_a_format_error_or_text():
    """JSON text nested 200k deep in a CSV cell: in a messages cell a FormatError (a bad record on_error=skip skips),
    in a prompt cell plain text. Uncaught, the bare RecursionError stopped the whole load."""
    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(FormatError, match=r"field 'messages' is not valid JSON \(nested too deeply\)"):
        to_example({"messages": deep}, "chat", True, from_csv=True)
    ex = to_example({"prompt": deep, "completion": "done"}, "prompt_completion", True, from_csv=True)
    assert (ex.messages, ex.prompt, ex.target) == (None, deep, "done")


def test_a_sharegpt_csv_reads_its_conversations_cell_as_json(tmp_path):
    """A CSV cell cannot hold a list, so a 'conversations' column holds JSON text: decoded to turns with ShareGPT's
    roles mapped, as a 'messages' cell is. Without it the row was a FormatError ('conversations' is a str)."""
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    p = tmp_path / "s.csv"
    with open(p, "w", newline="") as f:
        csv.writer(f).writerows([["conversations"], [json.dumps(conv)]])
    (rec,) = read_file(p)
    assert detect_format(rec.data, rec.from_csv) == "sharegpt"
    ex = to_example(rec.data, "sharegpt", True, from_csv=rec.from_csv)
    assert ex.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_tool_calls_whose_items_are_not_objects_are_a_format_error():
    """A list of strings as tool_calls would reach the chat template, which indexes each call's 'function': refused
    up front, naming the message (only a str tool_calls was refused before)."""
    rec = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": None, "tool_calls": ["get_weather()"]}]}
    with pytest.raises(FormatError, match=r"messages\[1\]\.tool_calls is a list .*expected a list of"):
        to_example(rec, "chat", True)


def test_a_null_message_field_is_dropped_not_passed_to_the_template():
    """Parquet struct columns fill absent keys with null; templates test `is defined`, so a null must not reach them."""
    ex = to_example({"messages": [{"role": "user", "content": "hi", "name": None},
                                  {"role": "assistant", "content": "yo", "reasoning_content": None}]}, "chat", True)
    assert ex.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_a_whitespace_only_target_counts_as_empty():
    """A completion/output of blanks trains end-of-turn alone, as an empty one does."""
    assert empty_target(Example(prompt="q", target=" \n\t"))
    assert empty_target(Example(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]))
    assert not empty_target(Example(prompt="q", target=" a"))


def test_a_blank_system_or_tool_message_is_not_an_empty_target():
    """Only blank assistant replies count: a blank system prompt or tool result carries no loss, so beside real
    replies the example is not "answer with nothing" (counting any non-user role flagged these)."""
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert not empty_target(Example(messages=msgs))
    call = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    tool = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "content": " "}, {"role": "assistant", "content": "done"}]
    assert not empty_target(Example(messages=tool))
    assert empty_target(Example(messages=msgs[:2] + [{"role": "assistant", "content": " "}]))


@pytest.mark.parametrize("prompt,completion", [("hi", [{"role": "assistant", "content": "x"}]),
                                               ([{"role": "user", "content": "hi"}], "x")])
def test_a_prompt_completion_mixing_text_and_messages_is_a_format_error(prompt, completion):
    """Without the check, str + list raised a bare TypeError (not skipped by on_error=skip)."""
    with pytest.raises(FormatError, match="mix a string and a message list"):
        to_example({"prompt": prompt, "completion": completion}, "prompt_completion", True)


def test_sharegpt_roles_map_as_documented():
    """A ShareGPT function_call turn is the assistant's (trained), observation / function the tool's."""
    conv = [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"},
            {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}]
    ex = to_example({"conversations": conv}, "sharegpt", True)
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant", "tool", "assistant"]


def test_a_sharegpt_turns_own_role_and_content_keys_do_not_override_from_and_value():
    """Some exports keep both spellings in a turn: role and content come from 'from' and 'value' alone, other keys
    (name) pass through. Passed through, 'role': 'human' replaced the mapped "user" (a role the template does not
    know) and a stale 'content' replaced the turn's text."""
    conv = [{"from": "human", "value": "hi", "role": "human"},
            {"from": "gpt", "value": "hello", "content": "stale copy", "name": "bot"}]
    ex = to_example({"conversations": conv}, "sharegpt", True)
    assert ex.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "name": "bot"}]


def test_alpaca_without_a_template_uses_the_classic_prompt_with_input():
    """The Stanford Alpaca prompt for records with an input names it in the first sentence."""
    ex = to_example({"instruction": "Add.", "input": "2 and 3", "output": "5"}, "alpaca", False)
    assert ex.prompt == ("Below is an instruction that describes a task, paired with an input that provides further "
                         "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                         "Add.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert ex.target == "5"


@pytest.mark.parametrize("extra, user", [({}, "Say hi"), ({"input": None}, "Say hi"), ({"input": ""}, "Say hi"),
                                         ({"input": "to Ana"}, "Say hi\n\nto Ana")])
def test_an_alpaca_user_turn_is_the_instruction_and_a_blank_line_only_before_an_input(extra, user):
    """With a chat template, an alpaca record without an input (absent, null or "") is a user turn of the bare
    instruction; the blank line only joins it to an input. It was appended regardless, and the model was trained on
    user turns ending in a stray blank line."""
    ex = to_example({"instruction": "Say hi", "output": "hi", **extra}, "alpaca", True)
    assert ex.messages == [{"role": "user", "content": user}, {"role": "assistant", "content": "hi"}]


@pytest.mark.parametrize("has_template", [True, False])
def test_an_alpaca_input_that_is_not_valid_unicode_is_a_format_error(has_template):
    """An input with a lone surrogate is refused, naming field 'input', as instruction and output are; unchecked it
    reached the tokenizer, whose bare TypeError stopped the whole load (even with on_error=skip)."""
    with pytest.raises(FormatError, match="field 'input' is not valid Unicode"):
        to_example({"instruction": "i", "input": "x\ud800", "output": "o"}, "alpaca", has_template)


@pytest.mark.parametrize("record, hint", [({"instruction": None}, "it has 'instruction' but no 'output'"),
                                          ({"prompt": None}, "it has 'prompt' but no 'completion'")])
def test_a_record_of_nulls_alone_still_names_the_missing_field(record, hint):
    """With every field null the hint still names the field that is there and the one that is not."""
    with pytest.raises(FormatError, match="cannot tell the format") as e:
        detect_format(record)
    assert hint in str(e.value)


def test_the_half_pair_hint_comes_from_the_fields_that_hold_values():
    """A null 'instruction' beside a prompt is a column of other records: the record lacks its completion."""
    with pytest.raises(FormatError) as e:
        detect_format({"instruction": None, "prompt": "Q: 1+1?"})
    assert "it has 'prompt' but no 'completion': prompt/completion records need both" in str(e.value)


@pytest.mark.parametrize("fmt, record, says", [
    ("text", {"body": "x"}, "missing field 'text' (format text expects 'text')"),
    ("chat", {}, "missing field 'messages' (format chat expects 'messages': [{'role', 'content'}, ...])"),
    ("sharegpt", {},
     "missing field 'conversations' (format sharegpt expects 'conversations': [{'from', 'value'}, ...])"),
    ("prompt_completion", {"prompt": "Q"},
     "missing field 'completion' (format prompt_completion expects 'prompt' and 'completion')"),
    # a forced format over records of another: the fix is data.format (a user walk: on_error=skip dropped them all)
    ("text", {"messages": [{"role": "user", "content": "hi"}]},
     "missing field 'text' (format text expects 'text'); its fields are chat ones: set data.format=auto (or chat)"),
    ("chat", {"prompt": "Q", "completion": "A"},
     "missing field 'messages' (format chat expects 'messages': [{'role', 'content'}, ...]); its fields are "
     "prompt_completion ones: set data.format=auto (or prompt_completion)"),
])
def test_a_missing_field_names_what_its_format_expects(fmt, record, says):
    with pytest.raises(FormatError) as e:
        to_example(record, fmt, True)
    assert str(e.value) == says


def test_a_prompt_that_is_neither_text_nor_messages_names_both_types():
    with pytest.raises(FormatError) as e:
        to_example({"prompt": 3, "completion": "x"}, "prompt_completion", True)
    assert str(e.value) == "field 'prompt' is an int, expected str or list"


@pytest.mark.parametrize("fmt, record, says", [
    ("chat", {"messages": ["hi"]}, "messages[0] is a str, expected {'role', 'content'}"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, None]}, "conversations[1] is null, expected "
                                                                              "{'from', 'value'}"),
])
def test_a_message_that_is_not_an_object_is_a_format_error_naming_it(fmt, record, says):
    """A string or null where a message stands is a bad record (on_error=skip skips it), not an AttributeError."""
    with pytest.raises(FormatError) as e:
        to_example(record, fmt, True)
    assert str(e.value) == says


@pytest.mark.parametrize("sender, role", [("chatgpt", "assistant"), ("tool", "tool"), ("function", "tool")])
def test_sharegpt_senders_beyond_human_and_gpt_map_to_chat_roles(sender, role):
    """ShareGPT exports also say chatgpt, tool and function: the role decides whether the turn trains."""
    ex = to_example({"conversations": [{"from": "human", "value": "q"}, {"from": sender, "value": "a"}]}, "sharegpt",
                    True)
    assert ex.messages[1] == {"role": role, "content": "a"}


def test_a_conversational_prompt_completion_error_names_the_joined_list():
    """Its messages are checked as one list, prompt then completion: the index counts on from the prompt's."""
    rec = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "robot", "content": "a"}]}
    with pytest.raises(FormatError, match=r"^prompt\+completion\[1\]\.role is 'robot'; expected one of system"):
        to_example(rec, "prompt_completion", True)


@pytest.mark.parametrize("has_template", [True, False])
def test_an_alpaca_output_that_is_a_list_is_a_format_error(has_template):
    """Only prompt/completion take message lists: an alpaca output list would reach the tokenizer as the target."""
    with pytest.raises(FormatError, match=r"^field 'output' is a list, expected str$"):
        to_example({"instruction": "List two colours.", "output": ["red", "blue"]}, "alpaca", has_template)


def test_a_long_bad_value_is_shown_cut_to_its_first_40_characters():
    """An error quotes a bad value so the user finds it, but a whole serialized tool call would bury the message."""
    calls = "get_weather(" + "x" * 60 + ")"
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}]}
    with pytest.raises(FormatError) as e:
        to_example(rec, "chat", True)
    assert str(e.value).startswith(f"messages[1].tool_calls is a str ({repr(calls)[:40]}...); expected a list of")
