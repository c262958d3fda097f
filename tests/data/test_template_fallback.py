"""Loss masks of templates the strict prefix test cannot bound: Phi-3 (eos only at the end of a conversation),
Mistral v0.3 (the system message moved into the last user turn) and Qwen3 (a think block only in the replies after
the last user message), with ChatML/Llama-3/Llama-2 as regressions.

The templates are written from the structure of the published ones; each runs on a copy of the SmolLM2
tokenizer with the template's special tokens added, so the decoded trained runs read like the real model's.
"""

import pytest

from chronicals.data import load_dataset
from chronicals.data.formats import FormatError
from chronicals.data.tokenize import encode_chat

from test_formats import trained_spans, write_jsonl

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
          "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")

# Phi-3-mini-4k-instruct: eos closes the text only when no generation prompt follows
PHI3 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}{% elif message['role'] == 'user' %}"
        "{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}{% elif message['role'] == 'assistant' %}"
        "{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

# Mistral-7B-Instruct-v0.3 (tool branches left out): the system message goes into the user turn that is the
# last message, so a conversation that ends in a reply renders without it
MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set ns.index = ns.index + 1 %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# the Mistral/Mixtral variant that writes the system message into the last user turn wherever it is, so it
# moves past earlier replies as the conversation grows
MISTRAL_LAST_USER = MISTRAL_V03.replace(
    "{{- bos_token }}",
    "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}\n{{- bos_token }}").replace(
    "loop.last and system_message is defined", "loop.index0 == ns.last_user and system_message is defined")

# Qwen3: the last reply, and a reply with reasoning after the last user message, open with a think block (empty
# without reasoning); the others do not, so an earlier reply rendered as the last message gains a block that the
# whole conversation does not have there (reasoning written inline, "<think>r</think>a" in content, is taken out of
# it as Qwen3's own template does)
QWEN3 = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
         "{% set content = m['content'] %}{% set reasoning = m['reasoning_content'] if m['reasoning_content'] is "
         "defined else '' %}{% if m['role'] == 'assistant' and '</think>' in content %}"
         "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
         "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
         "{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' and loop.index0 > ns.last and "
         "(loop.last or reasoning) %}"
         "{{ '<think>\n' + reasoning + '\n</think>\n\n' }}"
         "{% endif %}{{ content + '<|im_end|>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

BASES = {  # template -> bos, eos, added special tokens (as the model's tokenizer has them)
    "chatml": (CHATML, None, "<|im_end|>", []),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "llama2": (LLAMA2, "<s>", "</s>", []),
    "phi3": (PHI3, "<s>", "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "mistral_v03": (MISTRAL_V03, "<s>", "</s>", ["[INST]", "[/INST]"]),
    "mistral_last_user": (MISTRAL_LAST_USER, "<s>", "</s>", ["[INST]", "[/INST]"]),
    "qwen3": (QWEN3, None, "<|im_end|>", []),
}

SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello there."},
         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4, I think\nso."},
         {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]
REPLIES = [m["content"] for m in TURNS if m["role"] == "assistant"]


def trained(name: str, reply: str, last: bool) -> str:
    """The text a template's reply carries loss on: the reply and the end-of-turn token (the one generation
    stops at), with the space Llama-2/Mistral write before a reply inside the reply's first token."""
    return {"chatml": f"{reply}<|im_end|>", "llama3": f"{reply}<|eot_id|>", "llama2": f" {reply} </s>",
            # Phi-3 closes the conversation with "\n<|endoftext|>" after the last reply's <|end|>: not trained, the
            # turn ends at <|end|> as the earlier ones do (generation stops there)
            "phi3": f"{reply}<|end|>",
            "mistral_v03": f" {reply}</s>", "mistral_last_user": f" {reply}</s>",
            # Qwen3: the last reply with the think block the template writes there, as apply_chat_template does
            "qwen3": ("<think>\n\n</think>\n\n" if last else "") + f"{reply}<|im_end|>"}[name]


def make_tokenizer(base, template, bos, eos, extra):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(base.backend_tokenizer.to_str()),
                                  bos_token=bos, eos_token=eos, additional_special_tokens=extra,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=sorted(BASES))
def named(request, tokenizer):
    return request.param, make_tokenizer(tokenizer, *BASES[request.param])


def encode(tok, messages, train_from=0):
    ids, mask = encode_chat(tok, messages, train_from)
    assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    return trained_spans(tok, ids, mask)


@pytest.mark.parametrize("system", [False, True], ids=["no_system", "system"])
@pytest.mark.parametrize("n_turns", [1, 2, 3])
def test_trained_text_is_each_reply_and_its_end_of_turn(named, system, n_turns):
    name, tok = named
    messages = [SYSTEM] * system + TURNS[:2 * n_turns]
    spans = encode(tok, messages)
    assert spans == [trained(name, r, k == n_turns - 1) for k, r in enumerate(REPLIES[:n_turns])]
    for span in spans:  # no user or system text, nor any role header, carries loss
        assert not any(t in span for t in ("Be brief", "Hi!", "2+2?", "3+3", "user", "assistant", "INST"))


@pytest.mark.parametrize("system", [False, True], ids=["no_system", "system"])
def test_a_completion_trains_only_its_own_turns(named, system):
    name, tok = named
    prompt = [SYSTEM] * system + TURNS[:4]  # prompt/completion data: the completion is the last reply
    assert encode(tok, prompt + TURNS[4:6], train_from=len(prompt)) == [trained(name, "6.", True)]
    assert encode(tok, prompt[:-1] + TURNS[3:6], train_from=len(prompt) - 1) == [
        trained(name, "4, I think\nso.", False), trained(name, "6.", True)]


def test_load_dataset_reads_a_mistral_v03_chat_with_a_system_message(tokenizer, tmp_path, caplog):
    """...and says once that these examples train without their system prompt (the template drops it)."""
    tok = make_tokenizer(tokenizer, *BASES["mistral_v03"])
    records = [{"messages": [SYSTEM] + TURNS}, {"prompt": [SYSTEM] + TURNS[:4], "completion": TURNS[4:6]}]
    from chronicals.data import chat_turns

    chat_turns._warned_dropped_system.clear()  # once a process: earlier tests here rendered this template
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.data"):
        ds = load_dataset(write_jsonl(tmp_path / "m.jsonl", records), tok, max_seq_len=256)
    assert trained_spans(tok, *ds[0]) == [f" {r}</s>" for r in REPLIES]
    assert trained_spans(tok, *ds[1]) == [" 6.</s>"]
    said = [r.getMessage() for r in caplog.records if "without their system prompt" in r.getMessage()]
    assert len(said) == 1, said


# drops the reasoning of earlier replies without {% generation %} markers: the reply's own text changes
THINK_NO_MARKERS = ("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and not "
                    "loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
                    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}{{ eos_token }}")
THINKING = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>one"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>y</think>two"}]

# writes the system message into the reply that ends the conversation: carried over without it, that reply's
# span would hold the system text (or lose its end), so it cannot be located
SYSTEM_IN_LAST_REPLY = MISTRAL_V03.replace(
    '{{- " " + message["content"]|trim + eos_token }}',
    '{%- if loop.last and system_message is defined %}{{- " " + system_message + "\\n\\n" + message["content"] '
    '+ eos_token }}{%- else %}{{- " " + message["content"]|trim + eos_token }}{%- endif %}').replace(
    "loop.last and system_message is defined %}\n            {{- \"[INST] \" + system_message",
    "false %}\n            {{- \"[INST] \" + system_message")


@pytest.mark.parametrize("system", [False, True], ids=["no_system", "system"])
def test_a_template_that_rewrites_earlier_replies_still_raises(tokenizer, system):
    tok = make_tokenizer(tokenizer, THINK_NO_MARKERS, None, "<|im_end|>", [])
    with pytest.raises(FormatError, match=f"not prefix-stable at message {1 + system}: .*neither fallback"):
        encode_chat(tok, [SYSTEM] * system + THINKING)


def test_a_system_message_written_into_a_reply_still_raises(tokenizer):
    tok = make_tokenizer(tokenizer, SYSTEM_IN_LAST_REPLY, "<s>", "</s>", ["[INST]", "[/INST]"])
    full = tok.apply_chat_template([SYSTEM] + TURNS[:4], tokenize=False)
    assert full == "<s>[INST] Hi![/INST] Hello there.</s>[INST] 2+2?[/INST] Be brief.\n\n4, I think\nso.</s>"
    with pytest.raises(FormatError, match="not prefix-stable at message 2: .*rendering without the system message"):
        encode_chat(tok, [SYSTEM] + TURNS[:4])


def test_a_template_without_a_generation_prompt_trains_the_header_the_model_must_write(tokenizer):
    """ChatML with no add_generation_prompt branch: served with it, a model is given the prompt up to
    ``<|im_end|>\\n`` and must write ``<|im_start|>assistant\\n`` itself, so that header carries loss with the
    reply (deliberate: the loss is on what follows the rendering with the generation prompt)."""
    tok = make_tokenizer(tokenizer, CHATML.split("{% if add_generation_prompt %}")[0], None, "<|im_end|>", [])
    assert encode(tok, TURNS[:4]) == [f"<|im_start|>assistant\n{r}<|im_end|>" for r in REPLIES[:2]]
    assert encode(tok, TURNS[:4], train_from=3) == ["<|im_start|>assistant\n4, I think\nso.<|im_end|>"]


# GLM-like turns that no text closes, with eos written only at the end of a conversation (no generation prompt)
OPEN_TURNS_EOS_AT_END = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


@pytest.mark.parametrize("last", ["a2", ""])
def test_an_empty_reply_of_a_template_with_open_turns_trains_nothing_and_the_rest_trains(tokenizer, last):
    """Under such a template an empty reply before another turn has nothing to train: it was refused as "not
    prefix-stable" (the whole conversation lost under on_error=skip), while a non-empty one trained unclosed."""
    tok = make_tokenizer(tokenizer, OPEN_TURNS_EOS_AT_END, None, "<|endoftext|>", ["<|user|>", "<|assistant|>"])
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": last}]
    assert encode(tok, chat) == [f"{last}<|endoftext|>"]
    chat[1]["content"] = "ok"
    assert encode(tok, chat) == ["ok", f"{last}<|endoftext|>"]


# Llama-3.1's date header, as its published template writes it
DATED = ('{%- if not date_string is defined %}{%- if strftime_now is defined %}'
         '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}'
         '{%- endif %}{%- endif %}{{ "<|im_start|>system\nToday Date: " + date_string + "<|im_end|>\n" }}' + CHATML)


def test_a_dated_template_renders_one_fixed_date_and_a_strftime_one_is_named(tokenizer, tmp_path, caplog):
    """Today's date in the rendering made the same data tokenize to other ids on another day (a resume refused as
    'data changed'); date_string pins it. A template that calls strftime_now itself cannot be pinned: a warning."""
    from chronicals.data import chat_template

    tok = make_tokenizer(tokenizer, DATED, None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"])
    records = [{"messages": TURNS[:2]}]
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, max_seq_len=256, cache_dir=None)
    assert "Today Date: 26 Jul 2024<|im_end|>" in tok.decode(ds[0][0].tolist())
    assert trained_spans(tok, *ds[0]) == [f"{TURNS[1]['content']}<|im_end|>"]
    chat_template._warned_dated.clear()
    bare = make_tokenizer(tokenizer, DATED.replace("date_string", "d"), None, "<|im_end|>",
                          ["<|im_start|>", "<|im_end|>"])
    with caplog.at_level("WARNING", logger="chronicals.data"):
        load_dataset(write_jsonl(tmp_path / "e.jsonl", records), bare, max_seq_len=256, cache_dir=None)
        load_dataset(write_jsonl(tmp_path / "f.jsonl", records), bare, max_seq_len=256, cache_dir=None)
    said = [r.getMessage() for r in caplog.records if "writes today's date (strftime_now)" in r.getMessage()]
    assert len(said) == 1, said


def test_qwen3_reasoning_trains_where_the_template_writes_it(tokenizer):
    """Multi-turn Qwen3 data was refused (not prefix-stable) under train_on=assistant. Each reply trains as the whole
    conversation renders it: an earlier reply without its reasoning (the template drops it there), the last one
    with its think block."""
    tok = make_tokenizer(tokenizer, *BASES["qwen3"])
    messages = [TURNS[0], TURNS[1] | {"reasoning_content": "greet back"}, TURNS[2],
                TURNS[3] | {"reasoning_content": "add them"}]
    assert encode(tok, messages) == ["Hello there.<|im_end|>", "<think>\nadd them\n</think>\n\n4, I think\nso.<|im_end|>"]


def test_qwen3_reasoning_written_inline_trains_as_reasoning_content_does(tokenizer):
    """Reasoning datasets keep the thinking in the reply ("<think>r</think>a"); Qwen3's template takes it out and
    drops it from replies before the last user message. The record renders as its reasoning_content form and
    trains the same tokens; it was refused (the located turn holds "a", not the content's whole text)."""
    tok = make_tokenizer(tokenizer, *BASES["qwen3"])
    inline = [TURNS[0], TURNS[1] | {"content": "<think>\ngreet back\n</think>\n\nHello there."}, TURNS[2],
              TURNS[3] | {"content": "<think>add them</think>4, I think\nso."}]
    keyed = [TURNS[0], TURNS[1] | {"reasoning_content": "greet back"}, TURNS[2],
             TURNS[3] | {"reasoning_content": "add them"}]
    assert tok.apply_chat_template(inline, tokenize=False) == tok.apply_chat_template(keyed, tokenize=False)
    a, b = encode_chat(tok, inline), encode_chat(tok, keyed)
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    assert encode(tok, inline) == ["Hello there.<|im_end|>",
                                   "<think>\nadd them\n</think>\n\n4, I think\nso.<|im_end|>"]


@pytest.mark.parametrize("name", ["chatml", "llama3", "phi3"])
def test_a_conversation_that_opens_with_a_reply_trains_it(tokenizer, name):
    """ShareGPT dumps that open with the assistant's greeting were refused as bad records: transformers will not
    render the empty conversation before the first reply. Its header is now the text a sentinel reply renders
    before itself, and the greeting trains like any reply. (Qwen3 opens a lone greeting with a think block and the
    conversation's without one: still refused, naming the fix.)"""
    tok = make_tokenizer(tokenizer, *BASES[name])
    greeting = {"role": "assistant", "content": "Welcome!"}
    spans = encode(tok, [greeting] + TURNS[:2])
    assert spans == [trained(name, "Welcome!", False), trained(name, REPLIES[0], True)]


def test_a_qwen3_conversation_that_opens_with_a_reply_is_refused(tokenizer):
    tok = make_tokenizer(tokenizer, *BASES["qwen3"])
    with pytest.raises(FormatError, match="not prefix-stable at message 0: .*data.train_on=all"):
        encode_chat(tok, [{"role": "assistant", "content": "Welcome!"}] + TURNS[:2])


def test_a_blank_system_message_moved_into_the_last_user_turn_still_trains(tokenizer):
    """Mistral v0.3 writes the system message into the last user turn: a whitespace-only one is an inserted piece of
    whitespace, which no system text can be checked against; the record was refused, where "Be brief." trains."""
    tok = make_tokenizer(tokenizer, *BASES["mistral_v03"])
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    for system in ("Be brief.", " "):
        assert encode(tok, [{"role": "system", "content": system}] + turns) == [" a</s>"], system


# writes the system text right after the last reply's header when the conversation ends in a reply (into the last user
# turn under a generation prompt): the inserted piece goes exactly where that reply's turn opens
SYSTEM_AFTER_LAST_HEADER = (
    "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% set msgs = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}{{ '<|im_start|>user\n' + m['content'] }}"
    "{% if loop.last and sys %}{{ ' ' + sys }}{% endif %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' }}{% if loop.last and sys %}{{ '[' + sys + '] ' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# writes the system text into a user turn that is the last message, a fixed note (not the system text) into the others
NOTE_NOT_SYSTEM = (
    "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% set msgs = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}{{ '<|im_start|>user\n' + m['content'] }}"
    "{% if sys %}{{ (' ' + sys) if loop.last else ' (see system)' }}{% endif %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_turn_that_opens_where_the_system_text_is_inserted_is_shifted_past_it(tokenizer):
    """The moved-system fallback carries a turn over to the whole conversation shifted by the inserted piece when
    the turn starts exactly where the piece goes, not only after it: the reply trains as ``4, I think.<|im_end|>``.
    Left unshifted, the turn held the system text and lost the reply's end, and the record was refused."""
    tok = make_tokenizer(tokenizer, SYSTEM_AFTER_LAST_HEADER, None, "<|im_end|>", [])
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4, I think."}]
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n[Be brief.] 4, I think.<|im_end|>\n"
    assert encode(tok, messages) == ["4, I think.<|im_end|>"]


def test_an_inserted_piece_without_the_system_text_still_raises(tokenizer):
    """The moved-system fallback takes a difference from the rendering without the system message as the moved
    system message only when the inserted piece holds the system text. Other text there (a fixed note) means the
    template did something else: the record is refused, not trained as if the system message had moved."""
    tok = make_tokenizer(tokenizer, NOTE_NOT_SYSTEM, None, "<|im_end|>", [])
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full == "<|im_start|>user\n2+2? (see system)<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
    with pytest.raises(FormatError, match="not prefix-stable at message 2: .*rendering without the system message"):
        encode_chat(tok, messages)


@pytest.mark.parametrize("roles", ["uaa", "uaaua", "uaaa", "uaau", "suaaua"])
def test_qwen3_replies_in_a_row_train_as_the_whole_conversation_writes_them(tokenizer, roles):
    """Qwen3 gives a reply rendered last the think block it has nowhere else, so two assistant messages in a row (split
    replies, agent traces) were refused: the rendering before the second holds the first with a block. The second
    turn now opens where the first one, as located in the whole conversation, ends. Each reply trains as the whole
    conversation writes it: the last message with its block, the others without."""
    tok = make_tokenizer(tokenizer, *BASES["qwen3"])
    text = {"u": "Hi!", "a": "part {}", "s": "Be brief."}
    role = {"u": "user", "a": "assistant", "s": "system"}
    msgs = [{"role": role[r], "content": text[r].format(k)} for k, r in enumerate(roles)]
    want = [trained("qwen3", m["content"], k == len(msgs) - 1) for k, m in enumerate(msgs) if m["role"] == "assistant"]
    assert encode(tok, msgs) == want
    first = roles.index("a") + 1  # a completion that starts at the second reply of the pair trains from there
    assert encode(tok, msgs, train_from=first) == want[1:]


def test_qwen3_replies_in_a_row_with_reasoning_on_the_first(tokenizer):
    """A first reply with reasoning after the last user message keeps its block in the whole conversation too (Qwen3
    writes reasoning there), so its turn is a prefix and the second reply follows it as usual."""
    tok = make_tokenizer(tokenizer, *BASES["qwen3"])
    msgs = [TURNS[0], {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "assistant", "content": "b"}]
    assert encode(tok, msgs) == ["<think>\nr\n</think>\n\na<|im_end|>", "<think>\n\n</think>\n\nb<|im_end|>"]


def test_replies_in_a_row_under_a_template_that_thinks_after_the_last_user_message(tokenizer):
    """A template that opens every reply after the last user message with a think block (not only the last one):
    the first of two earlier replies, rendered last, gains a block, and so does the rendering of the pair, whose
    turn text is then read from the whole conversation's."""
    every = QWEN3.replace(" and (loop.last or reasoning) %}", " %}")
    assert every != QWEN3
    tok = make_tokenizer(tokenizer, every, *BASES["qwen3"][1:])
    msgs = [TURNS[0], {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}, TURNS[2],
            {"role": "assistant", "content": "c"}]
    assert encode(tok, msgs) == ["a<|im_end|>", "b<|im_end|>", "<think>\n\n</think>\n\nc<|im_end|>"]


class _Scripted:
    """A tokenizer whose chat template renders messages[:k] as ``texts[k]`` (``_after_reply`` renders only that)."""
    chat_template = "scripted"

    def __init__(self, texts):
        self.texts = texts

    def apply_chat_template(self, messages, **kw):
        return self.texts[len(messages)]


@pytest.mark.parametrize("case", ["fits", "no_turn", "prompt_not_after", "prefix_differs", "turn_differs",
                                  "prompt_not_in_full"])
def test_the_second_of_two_replies_opens_after_the_first_only_when_every_fact_holds(case):
    """``_after_reply`` places the second reply's turn from the first one's span in the whole conversation: the
    rendering before it must be that rendering of the first reply and the generation prompt, agree with the whole
    conversation up to the first turn, end with the first turn's text, and the prompt must follow that text in the
    whole conversation. Any fact that fails refuses (None), rather than guess a boundary."""
    from chronicals.data.chat_turns import _after_reply

    full = "U:q|A:a.|A:<t>b.|"  # the first reply's turn "a.|" lies at 6..9 in full
    rest = "U:q|A:<t>a.|"  # the first two messages, the first reply rendered last (with a block)
    before, prev = rest + "A:", (6, 8, False, 9)
    msgs = [{"role": "user"}, {"role": "assistant"}, {"role": "assistant"}]
    if case == "no_turn":  # an empty span that full's prefix and the prompt after it would both fit
        prev = (4, 4, False, 4)
    elif case == "prompt_not_after":  # the prompt is the same, what comes before it is not that rendering
        before = before.replace("q", "Q")
    elif case == "prefix_differs":
        rest, before = "V" + rest[1:], "V" + before[1:]
    elif case == "turn_differs":
        rest, before = rest[:-2] + "!|", rest[:-2] + "!|A:"
    elif case == "prompt_not_in_full":
        full = full.replace("|A:<t>", "|B:<t>")
    at = _after_reply(_Scripted({2: rest}), msgs, 2, before, full, prev)
    assert at == (11 if case == "fits" else None)
    if case == "fits":
        assert full[at:] == "<t>b.|"
