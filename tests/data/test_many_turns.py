"""Chats of many turns: from chat_turns.LINEAR_FROM replies on, the turns are located from ~8 template renders
(``_locate_linear``) instead of 2 a reply (quadratic: 500 turns took 3.7-11 s a record in a chat walk). Wherever the
shortcut answers, it must give exactly the ids and mask of the prefix renders; where a template's turns do not all
have one shape, it must step aside."""

import random

import pytest

from chronicals.data import chat_template, chat_turns, tokenize
from chronicals.data.formats import FormatError
from chronicals.data.tokenize import encode_chat

from test_loss_masks import FAMILIES, NO_SYSTEM
from test_template_fallback import BASES, make_tokenizer

TEMPLATES = {name: spec[:4] for name, spec in FAMILIES.items()} | {
    "chatml": BASES["chatml"], "llama2": BASES["llama2"], "qwen3": BASES["qwen3"],
    "mistral_last_user": BASES["mistral_last_user"]}
# the templates whose turns are not all alike: Qwen3's replies after the last user message open with a think block,
# the earlier ones without; Mistral v0.3 (with a system message) moves it into the last user turn. (Phi-3 closes the
# conversation with eos after the last reply: that one keeps its own end, the others share one)
STEPS_ASIDE = {"qwen3"}
MOVES_SYSTEM = {"mistral_v03", "mistral_last_user"}
# replies a template must render faithfully: whitespace at either end, markers of other templates, unicode, empty
POOL = ["Paris.", "", "  padded both  ", "\nnewline first", "last newline\n", "<|im_end|> inside", "[INST] x [/INST]",
        "你好！🙂 ça va", "a\r\nb", "two\n\nparagraphs", " ", "</s>", "x" * 40, "Answer briefly."]


def conversation(rng: random.Random, turns: int, system: bool) -> list[dict]:
    msgs = [{"role": "system", "content": "Answer briefly."}] if system else []
    for _ in range(turns):
        msgs.append({"role": "user", "content": rng.choice(POOL[:1] + POOL[2:]) + f" q{rng.randrange(99)}"})
        msgs.append({"role": "assistant", "content": rng.choice(POOL)})
    return msgs


def exact(tok, messages, train_from=0):
    saved = chat_turns.LINEAR_FROM
    chat_turns.LINEAR_FROM = 10 ** 9
    try:
        return encode_chat(tok, messages, train_from)
    finally:
        chat_turns.LINEAR_FROM = saved


def count_renders(monkeypatch) -> list:
    """A list that gets an item a template render: ``_render`` is looked up in the module of each caller (the full
    rendering in tokenize, the prefix and stand-in renders in chat_turns, the tool-call check in chat_template)."""
    renders, real = [], chat_template._render
    for module in (chat_template, chat_turns, tokenize):
        monkeypatch.setattr(module, "_render", lambda *a, **k: (renders.append(1), real(*a, **k))[1])
    return renders


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template(request, tokenizer):
    name = request.param
    return name, make_tokenizer(tokenizer, *TEMPLATES[name])


def test_the_shortcut_gives_the_prefix_renders_ids_and_mask(template, monkeypatch):
    name, tok = template
    renders = count_renders(monkeypatch)
    rng = random.Random(name)
    for case in range(12):
        system = case % 2 == 1 and name not in NO_SYSTEM
        msgs = conversation(rng, rng.choice([8, 9, 13, 30]), system)
        train_from = rng.choice([0, 0, 5]) if case > 6 else 0  # a conversational completion: loss from message 5
        renders.clear()
        got = encode_chat(tok, msgs, train_from)
        used = len(renders)
        want = exact(tok, msgs, train_from)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), (name, case, msgs)
        replies = sum(m["role"] == "assistant" for m in msgs)
        shortcut = name not in STEPS_ASIDE and not (system and name in MOVES_SYSTEM)
        # the shortcut: the conversation, it with stand-ins, 2 prefix renders for each of 3 replies (and one probe
        # when the last reply ends in a special token's text)
        assert (used <= 9) == shortcut, (name, case, used, replies)


def test_a_reply_the_template_rewrites_steps_aside(tokenizer):
    """Qwen3 takes inline reasoning out of a reply: the stand-in rendering then differs from the real one around
    that reply, and the prefix renders locate the turns (the same result either way)."""
    tok = make_tokenizer(tokenizer, *BASES["chatml"])
    tok.chat_template = tok.chat_template.replace("message['content']", "message['content'].split('</think>')[-1]")
    msgs = conversation(random.Random(1), 10, False)
    msgs[5]["content"] = "<think>hidden</think>shown"
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert "hidden" not in tok.decode(got[0])


def test_turns_of_another_shape_step_aside(tokenizer):
    """A template whose first reply closes otherwise than the later ones (here: the later ones with one special token
    more): the prefix renders of the first, a middle and the last reply disagree on the turn's shape, and the
    shortcut, which would carry the first one's to all, steps aside."""
    tok = make_tokenizer(tokenizer, *BASES["chatml"])
    tok.chat_template = tok.chat_template.replace(
        "message['content'] + '<|im_end|>'",
        "message['content'] + '<|im_end|>' + ('<|endoftext|>' if message['role'] == 'assistant' and loop.index0 > 1 "
        "else '')")
    msgs = conversation(random.Random(2), 9, False)
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert tok.decode(got[0][got[1]]).count("<|endoftext|>") == 8


def test_a_reply_with_fields_the_others_lack_steps_aside(tokenizer):
    """A template that writes each reply's reasoning_content before it, kept in history: one middle reply with
    reasoning has another shape than the three the prefix renders sample (its think block, which the prefix renders
    train with it, is template text to the stand-in rendering): the shortcut must not carry their shape to it."""
    tok = make_tokenizer(tokenizer, *BASES["chatml"])
    plain = tok.chat_template
    tok.chat_template = plain.replace(
        "+ message['content']", "+ ('<think>' + message['reasoning_content'] + '</think>' if "
        "message['reasoning_content'] is defined else '') + message['content']")
    assert tok.chat_template != plain
    msgs = conversation(random.Random(3), 9, False)
    msgs[5]["reasoning_content"] = "step by step"  # the 3rd reply: not the first, middle or last
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert "<think>step by step</think>" in tok.decode(want[0][want[1]])
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_one_reply_closed_otherwise_steps_aside(tokenizer):
    """One reply, not among the three the prefix renders sample, closes with a special token more: the text after it
    differs from the other replies', and the shortcut steps aside (the prefix renders train that token with it)."""
    tok = make_tokenizer(tokenizer, *BASES["chatml"])
    plain = tok.chat_template
    tok.chat_template = plain.replace(
        "+ '<|im_end|>'", "+ '<|im_end|>' + ('<|endoftext|>' if loop.index0 == 5 else '')")
    assert tok.chat_template != plain
    msgs = conversation(random.Random(4), 9, False)
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert tok.decode(want[0][want[1]]).count("<|endoftext|>") == 1
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


# the first reply, when it is the last message (its prefix render), has no <|im_end|>: its end differs from the
# middle reply's, though the full render writes every reply alike
FIRST_OPEN = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '\nEND' }}"
              "{% if not (loop.last and loop.index0 == 1) %}{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# replies trimmed, the template's own text between messages only whitespace: where a reply's "\n" belongs (its
# content, or the template's text after it) is not decided by the full render
TRIMMED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] | trim }}{% else %}"
           "{{ m['content'] }}{% endif %}{{ '\n\n' }}{% endfor %}")


def _pairs(n, reply=lambda k: f"a{k}", user=lambda k: f"q{k}"):
    """``n`` user / assistant pairs: user(k), then reply(k), for k = 0 .. n - 1."""
    return [m for k in range(n) for m in ({"role": "user", "content": user(k)},
                                          {"role": "assistant", "content": reply(k)})]


def test_a_sampled_reply_that_ends_otherwise_in_its_prefix_render_steps_aside(tokenizer):
    """The shortcut takes every reply's end from the sampled ones only when the first and the middle reply end
    alike: here the first ends without <|im_end|> in its prefix render, and the shortcut steps aside (taking the
    middle reply's end for all, most replies trained without their <|im_end|>)."""
    tok = make_tokenizer(tokenizer, FIRST_OPEN, None, "<|im_end|>", [])
    msgs = _pairs(chat_turns.LINEAR_FROM + 1)
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert tok.decode(want[0][want[1]]).count("<|im_end|>") >= len(msgs) // 2 - 1
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_a_reply_whose_newline_could_be_the_templates_steps_aside(tokenizer):
    """A trimmed reply ("a3\n" written "a3") followed by the template's "\n\n" and a user message that starts with
    "\n": the full render cannot say which newline is the reply's, so the shortcut steps aside and the prefix renders
    decide (taken as the reply's, one "\n" more was trained)."""
    tok = make_tokenizer(tokenizer, TRIMMED, None, "<|im_end|>", [])
    msgs = _pairs(chat_turns.LINEAR_FROM + 1, reply=lambda k: "a3\n" if k == 3 else f"a{k}", user=lambda k: f"\nq{k}")
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


# a plain-text note after the last message when that is a reply past message 8: such a reply renders otherwise as the
# last message than with a turn after it
LATE_NOTE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
             "{% if loop.last and m['role'] == 'assistant' and loop.index0 > 8 %}{{ '(late)' }}{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_middle_reply_that_renders_otherwise_when_last_is_refused_as_the_prefix_renders_refuse_it(tokenizer):
    """The shortcut checks the bounds of a middle reply too, not only the first and last: a template that renders
    a reply past message 8 otherwise as the last message is not prefix-stable there, and the shortcut refuses the
    record as the prefix renders do (checking only the first and last reply, it trained every reply)."""
    tok = make_tokenizer(tokenizer, LATE_NOTE, None, "<|im_end|>", [])
    msgs = _pairs(chat_turns.LINEAR_FROM)
    with pytest.raises(FormatError, match="not prefix-stable at message 9"):
        exact(tok, msgs)
    with pytest.raises(FormatError, match="not prefix-stable at message 9"):
        encode_chat(tok, msgs)


# turns that end in plain text: the whitespace after a reply is trained unless the reply's own text ends in a special
# token's (then _turn_end trims it); a template with no generation prompt whose header ends in a special token
PLAIN = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '### User: ' + m['content'] + '\n' }}"
         "{% else %}{{ '### Assistant: ' + m['content'] + '\n\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '### Assistant: ' }}{% endif %}")
HEADER_SPECIAL = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>user: ' + m['content'] + '\n' }}"
                  "{% else %}{{ '<|im_end|>' + m['content'] + '\n' }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template, odd", [(PLAIN, "</s>"), (PLAIN, "y<|endoftext|>"), (HEADER_SPECIAL, "")],
                         ids=["plain-special", "plain-special-tail", "header-special-empty"])
@pytest.mark.parametrize("at", [2, 8], ids=["middle", "last"])
def test_where_a_reply_ends_is_its_own(tokenizer, template, odd, at):
    """Whether the whitespace after a reply is trained depends on the reply's own text (_turn_end trims it after a
    special token's text): the shortcut ends each reply as the prefix renders do, not by three sampled replies'
    lengths (the labels of a record depended on whether it had 7 or 8 replies; a mutation walk)."""
    tok = make_tokenizer(tokenizer, template, "<s>", "</s>", [])
    msgs = _pairs(9, reply=lambda k: odd if k == at else f"a{k}")
    got, want = encode_chat(tok, msgs), exact(tok, msgs)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_a_template_that_refuses_the_stand_ins_or_the_probe_keeps_the_prefix_renders(tokenizer):
    """A template that checks the content (here: refuses private-use characters) fails the stand-in rendering, and for
    Phi-3's last reply the one-more-turn probe: the record is located by the prefix renders (and its last turn keeps
    its span), not refused."""
    from test_template_fallback import PHI3

    guard = "{% for m in messages %}{% if '\ue000' in m['content'] %}{{ raise_exception('no') }}{% endif %}{% endfor %}"
    for name, template in (("chatml", BASES["chatml"][0]), ("phi3", PHI3)):
        spec = BASES[name]
        tok = make_tokenizer(tokenizer, guard + template, *spec[1:])
        msgs = conversation(random.Random(5), 9, False)
        msgs[-1]["content"] = "x"
        got, want = encode_chat(tok, msgs), exact(tok, msgs)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
        assert got[0].tolist() == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]


# no user header: a reply's turn is closed by the whole template text between it and the next message
NO_USER_HEADER = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                  "{% else %}{{ '<|im_start|>' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}")


def test_a_turn_end_that_is_all_the_text_before_the_next_message_takes_the_shortcut(tokenizer, monkeypatch):
    """A turn whose end-of-turn text is the whole text between the reply and the next message (``<|im_end|>``, then
    the user's text at once) has the shape the shortcut carries: it answers in at most 9 renders with the prefix
    renders' ids and mask. Refused at that boundary, it stepped aside to 2 renders a reply (the same output)."""
    tok = make_tokenizer(tokenizer, NO_USER_HEADER, None, "<|im_end|>", [])
    msgs = _pairs(10, reply=lambda k: f"answer {k}.", user=lambda k: f"question {k}?")
    renders = count_renders(monkeypatch)
    got = encode_chat(tok, msgs)
    used = len(renders)
    want = exact(tok, msgs)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert tok.decode(got[0][got[1]]).count("<|im_end|>") == 10
    assert used <= 9, used
