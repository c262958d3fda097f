"""Chat encoding edges: one BOS with a BOS-adding tokenizer, one eos with a tokenizer that appends its own or a text
that ends in it, plain-text turn endings, each spelling of the generation tag, template errors as bad records, tool
calls in the flat form, and templates that close or rewrite turns in ways the prefix-render fallbacks must bound or
refuse. Every other data test uses SmolLM2's tokenizer, which adds no BOS and appends no eos."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from chronicals.data.chat_template import _render, has_generation_markers
from chronicals.data.chat_turns import _insertion_points
from chronicals.data.formats import Example, FormatError
from chronicals.data.tokenize import encode, encode_chat
from test_formats import trained_spans
from test_template_fallback import BASES, NOTE_NOT_SYSTEM, PHI3, make_tokenizer

ONE_TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
TWO_TURNS = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
             {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"}]
ROLE_LINES = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"


def _bos_adding(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.bos_token = "<|im_start|>"
    tok.add_bos_token = True
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # it does add BOS
    return tok


def test_a_bos_adding_tokenizer_under_a_bos_template_gives_apply_chat_templates_ids(tokenizer):
    """The rendered text is tokenized without the tokenizer's own special tokens: a tokenizer that adds BOS (Llama 2,
    Mistral: add_bos_token) under a template that writes {{ bos_token }} gets one BOS, not two."""
    tok = _bos_adding(tokenizer)
    tok.chat_template = "{{ bos_token }}" + ROLE_LINES + "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    ids, mask = encode_chat(tok, ONE_TURN)
    want = tok.apply_chat_template(ONE_TURN, tokenize=True, return_dict=False)
    assert ids.tolist() == list(want) and ids.tolist().count(tok.bos_token_id) == 1
    assert tok.decode(ids[mask]).strip() == "hello"


def test_loss_on_all_under_a_bos_adding_tokenizer_gives_apply_chat_templates_ids(tokenizer):
    """The same for data.train_on=all."""
    tok = _bos_adding(tokenizer)
    tok.chat_template = "{{ bos_token }}" + ROLE_LINES
    ids, mask = encode(tok, Example(messages=ONE_TURN), loss_on="all")
    assert ids.tolist() == list(tok.apply_chat_template(ONE_TURN, tokenize=True, return_dict=False)) and mask.all()


def test_own_eos_and_split_special_tokens_end_in_one_eos(tokenizer):
    """A tokenizer that both appends eos itself (add_eos_token) and splits special-token text ends a prompt/target
    document in one eos, not its own and another."""
    tok = copy.deepcopy(tokenizer)
    tok.add_eos_token = True
    tok.split_special_tokens = True
    eos = tok.eos_token_id
    assert tok("a")["input_ids"][-1] == eos
    ids, mask = encode(tok, Example(prompt="Q: hi\nA:", target=" hello"))
    assert ids.tolist().count(eos) == 1 and ids[-1] == eos and mask[-1]


def test_a_plain_text_turn_ending_keeps_its_whitespace(tokenizer):
    """A template whose turns end in plain text keeps that ending, whitespace included, in the loss; only whitespace
    after a closing special token is left out."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "bye"}]
    ids, mask = encode_chat(tok, msgs)
    text = tok.decode(ids[mask])
    assert text == " hello\n\n bye\n\n", repr(text)  # " hello": one token across ": " and the reply


MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
          "TAG{{ '<|im_start|>assistant\n' + m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
          "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("tag", ["{% generation %}", "{%- generation %}", "{% generation -%}", "{%- generation -%}",
                                 "{%generation%}", "{%+ generation %}", "{%+ generation +%}"])
def test_each_spelling_of_the_tag_is_a_marker_and_its_spans_are_the_markers(tokenizer, tag):
    """Jinja's whitespace controls around the tag still make it a marker. The markers here cover the assistant
    header too, which the prefix renders never train, so only the markers give these spans."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = MARKED.replace("TAG", tag)
    assert has_generation_markers(tok)
    ids, mask = encode_chat(tok, TWO_TURNS, markers=True)
    assert trained_spans(tok, ids, mask) == ["<|im_start|>assistant\none<|im_end|>",
                                             "<|im_start|>assistant\ntwo<|im_end|>"]


def test_the_markers_are_those_of_the_default_template_of_several():
    """A tokenizer saved with several templates (additional_chat_templates/) holds a dict, of which
    apply_chat_template renders "default" (no tools passed): only its markers count. Reading the dict's first
    template instead took the markers route for a marked "tool_use" listed first (return_assistant_tokens_mask on
    the unmarked default masks nothing) and missed the default's markers behind an unmarked one."""
    marked = MARKED.replace("TAG", "{% generation %}")
    assert not has_generation_markers(SimpleNamespace(chat_template={"tool_use": marked, "default": ROLE_LINES}))
    assert has_generation_markers(SimpleNamespace(chat_template={"tool_use": ROLE_LINES, "default": marked}))
    assert not has_generation_markers(SimpleNamespace(chat_template={"tool_use": marked}))  # no default: none


@pytest.mark.parametrize("expr, error", [("'{0}{1}'.format(m['content'])", "IndexError"),
                                         ("'{who}'.format(m['content'])", "KeyError"),
                                         ("m['content']|dictsort", "AttributeError")])  # str has no .items()
def test_a_template_index_key_or_attribute_error_is_a_bad_record(tokenizer, expr, error):
    """A template expression that raises IndexError or KeyError (str.format with a missing field) or AttributeError
    (a dict filter on a string) on a record makes that record a FormatError (file:line, skipped under
    on_error=skip), as TypeError and ValueError do; a bare AttributeError ended the whole load."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ " + expr + " }}{% endfor %}"
    with pytest.raises(FormatError, match=rf"the chat template failed on this conversation \({error}"):
        encode_chat(tok, ONE_TURN)


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_a_flat_tool_call_the_template_drops_is_refused(tokenizer, loss_on):
    """A tool call in the flat form ({"name", "arguments"}, no "function" wrapper, which Llama 3.1's template reads)
    is checked against the rendering as the OpenAI form is: SmolLM2's template drops it, so the record is refused.
    Reading names only from "function" trained it as an empty reply (the model learns to end its turn at once)."""
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"c": "x"}}]}]
    with pytest.raises(FormatError, match=r"message 1 calls tool 'get_weather'"):
        encode(tokenizer, Example(messages=msgs), loss_on)


def test_a_text_that_ends_in_eos_gets_no_second_one(tokenizer):
    """Pre-formatted text and prompt/target records often end in the eos string already."""
    eos = tokenizer.eos_token
    for ex in (Example(prompt="", target="plain text" + eos), Example(prompt="Q: ", target="A." + eos)):
        ids, mask = encode(tokenizer, ex, loss_on="all" if not ex.prompt else "assistant")
        assert ids.tolist() == tokenizer(ex.prompt + ex.target, add_special_tokens=True)["input_ids"]
        assert ids.tolist().count(tokenizer.eos_token_id) == 1 and mask[-1]


def test_eos_and_a_newline_only_at_the_end_still_locate_earlier_replies(tokenizer):
    """A Phi-3-like template that closes the conversation with eos and a newline only when no generation prompt
    follows: an earlier reply still trains as ``reply<|end|>`` (the record was refused)."""
    template = PHI3.replace("{{ eos_token }}", "{{ eos_token + '\\n' }}")
    assert template != PHI3
    tok = make_tokenizer(tokenizer, template, *BASES["phi3"][1:])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids, mask = encode_chat(tok, messages)
    assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert trained_spans(tok, ids, mask)[0] == "Hello<|end|>"


BLANKS_EARLIER_REPLIES = ("{% for m in messages %}{% set c = m['content'] if (m['role'] != 'assistant' or loop.last) "
                          "else '' %}{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_reply_the_conversation_does_not_hold_is_refused(tokenizer):
    """A template that writes earlier replies empty: the fallback bounds such a turn as the bare ``<|im_end|>``,
    which does not hold the reply, so the record is refused rather than trained as an empty reply."""
    tok = make_tokenizer(tokenizer, BLANKS_EARLIER_REPLIES, None, "<|im_end|>", [])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(FormatError, match="not prefix-stable at message 1"):
        encode_chat(tok, messages)


def test_a_reply_inside_the_system_texts_sliding_range_is_not_mislabelled(tokenizer):
    """The system text Mistral's last-user variant inserts can slide over text it repeats; a reply that starts
    inside that range is refused or located right, never carried onto the wrong characters."""
    tok = make_tokenizer(tokenizer, *BASES["mistral_last_user"])
    messages = [{"role": "system", "content": "Q2[/INST] B"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "B"}]
    full, rest = _render(tok, messages), _render(tok, messages[1:])
    places = _insertion_points(rest, full)
    assert places[0] < rest.rindex(" B</s>") < places[-1]  # the case: the reply starts inside the range
    try:
        ids, mask = encode_chat(tok, messages)
    except FormatError:
        return
    assert trained_spans(tok, ids, mask) == [" A</s>", " B</s>"]


def test_a_non_blank_piece_for_a_blank_system_message_is_refused(tokenizer):
    """The moved-system fallback with a blank system message (" ") accepts an inserted piece only when it is
    whitespace: there is no system text to check it against, so a template that writes other text there (a fixed
    "(see system)" note) is refused, not trained as if the difference were the moved system message."""
    tok = make_tokenizer(tokenizer, NOTE_NOT_SYSTEM, None, "<|im_end|>", [])
    messages = [{"role": "system", "content": " "}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4."}]
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full == "<|im_start|>user\n2+2? (see system)<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
    with pytest.raises(FormatError, match="not prefix-stable at message 2"):
        encode_chat(tok, messages)


ENDS_ONLY_AT_THE_END = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% else %}{{ '<|im_end|>\\n<|endoftext|>' }}"
                        "{% endif %}")


def test_the_last_reply_keeps_the_conversations_closing_tokens(tokenizer):
    """A template that closes only the whole conversation, with two special tokens, and no turn between: the last
    reply keeps them (the only stop the model can learn), not cut back to the reply's text."""
    tok = make_tokenizer(tokenizer, ENDS_ONLY_AT_THE_END, None, "<|endoftext|>", ["<|im_end|>"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = encode_chat(tok, messages)
    assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    spans = trained_spans(tok, ids, mask)
    assert len(spans) == 1 and spans[0].startswith(("Hello", " Hello")) and spans[0].rstrip().endswith("<|endoftext|>")
