"""Records -> examples where a mutation walk found no test: CSV cells holding JSON, null message fields, blank
targets, mixed prompt/completion forms, ShareGPT roles and the classic Alpaca prompt with an input."""
from __future__ import annotations

import pytest

from chronicals.data.formats import to_example


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


def test_a_null_message_field_is_dropped_not_passed_to_the_template():
    """Parquet struct columns fill absent keys with null; templates test `is defined`, so a null must not reach them."""
    ex = to_example({"messages": [{"role": "user", "content": "hi", "name": None},
                                  {"role": "assistant", "content": "yo", "reasoning_content": None}]}, "chat", True)
    assert ex.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_a_whitespace_only_target_counts_as_empty():
    """A completion/output of blanks trains end-of-turn alone, as an empty one does."""
    from chronicals.data.formats import Example, empty_target

    assert empty_target(Example(prompt="q", target=" \n\t"))
    assert empty_target(Example(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]))
    assert not empty_target(Example(prompt="q", target=" a"))


@pytest.mark.parametrize("prompt,completion", [("hi", [{"role": "assistant", "content": "x"}]),
                                               ([{"role": "user", "content": "hi"}], "x")])
def test_a_prompt_completion_mixing_text_and_messages_is_a_format_error(prompt, completion):
    """Without the check, str + list raised a bare TypeError (not skipped by on_error=skip)."""
    from chronicals.data.formats import FormatError

    with pytest.raises(FormatError, match="mix a string and a message list"):
        to_example({"prompt": prompt, "completion": completion}, "prompt_completion", True)


def test_sharegpt_roles_map_as_documented():
    """A ShareGPT function_call turn is the assistant's (trained), observation / function the tool's."""
    conv = [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"},
            {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}]
    ex = to_example({"conversations": conv}, "sharegpt", True)
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant", "tool", "assistant"]


def test_alpaca_without_a_template_uses_the_classic_prompt_with_input():
    """The Stanford Alpaca prompt for records with an input names it in the first sentence."""
    ex = to_example({"instruction": "Add.", "input": "2 and 3", "output": "5"}, "alpaca", False)
    assert ex.prompt == ("Below is an instruction that describes a task, paired with an input that provides further "
                         "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                         "Add.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert ex.target == "5"
