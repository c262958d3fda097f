"""Loss masks across chat-template shapes and families: what carries loss is each assistant reply and the token
that ends its turn, the ids are apply_chat_template's, and a {% generation %}-marked template's completion
(conversational prompt/completion) keeps its loss when the generation prompt is not the rendered turn's start.

The family templates are written from the structure of each family's published one, on a copy of the SmolLM2
tokenizer with the family's special tokens added (test_template_fallback.make_tokenizer).
"""

import pytest

from chronicals.data import load_dataset
from chronicals.data.formats import FormatError
from chronicals.data.tokenize import encode_chat

from test_formats import trained_spans, write_jsonl
from test_template_fallback import LLAMA3, MISTRAL_V03, PHI3, make_tokenizer

# drops the reasoning of earlier replies (as reasoning templates do), so only its {% generation %} markers can
# locate the replies; TAG is the opening tag, with or without Jinja's whitespace control
THINK = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% set c = m['content'] %}"
         "{% if not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
         "{{ '<|im_start|>assistant\n' }}TAG{{ c + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
         "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
THINKING = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>one"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>y</think>two"}]


@pytest.fixture
def set_template(tokenizer):
    saved = tokenizer.chat_template
    yield lambda t: setattr(tokenizer, "chat_template", t)
    tokenizer.chat_template = saved


@pytest.mark.parametrize("tag", ["{% generation %}", "{%- generation %}", "{% generation -%}", "{%- generation -%}",
                                 "{%generation%}", "{%+ generation %}"])
def test_generation_markers_with_whitespace_control_are_used(tokenizer, tmp_path, set_template, tag):
    set_template(THINK.replace("TAG", tag))
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"messages": THINKING}]), tokenizer, max_seq_len=256)
    ids, mask = ds[0]
    assert trained_spans(tokenizer, ids, mask) == ["one<|im_end|>", "<think>y</think>two<|im_end|>"]


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_a_tokenizer_that_appends_eos_ends_each_document_in_one(tokenizer, tmp_path, loss_on):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    eos_id = tokenizer.eos_token_id
    backend.post_processor = processors.TemplateProcessing(single="$A <|im_end|>",
                                                           special_tokens=[("<|im_end|>", eos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")  # no chat template
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}, {"text": "hello"}])
    ds = load_dataset(path, tok, max_seq_len=64, loss_on=loss_on)
    (ids, mask), (ids2, mask2) = ds[0], ds[1]
    assert ids.tolist() == tok("Q: 2+2?\nA: 4")["input_ids"] and ids.tolist().count(eos_id) == 1
    assert ids2.tolist() == tok("hello")["input_ids"] and ids2.tolist().count(eos_id) == 1
    assert trained_spans(tok, ids, mask) == [" 4<|im_end|>" if loss_on == "assistant" else "Q: 2+2?\nA: 4<|im_end|>"]
    assert trained_spans(tok, ids2, mask2) == ["hello<|im_end|>"]


LLAMA31 = ("{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0]['content']|trim %}"
           "{%- set messages = messages[1:] %}{%- else %}{%- set sys = '' %}{%- endif %}"
           "{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' + sys + "
           "'<|eot_id|>' }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
           "m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
          "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
          "{%- for m in messages %}{%- if m.role != 'system' or not loop.first %}"
          "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
MISTRAL_V01 = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
               "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
               "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
MISTRAL_SYS_FIRST = ("{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0]['content'] %}"
                     "{%- set msgs = messages[1:] %}{%- else %}{%- set sys = '' %}{%- set msgs = messages %}{%- endif %}"
                     "{{- bos_token }}{%- for m in msgs %}{%- if m['role'] == 'user' %}{%- if loop.first and sys %}"
                     "{{- '[INST] ' + sys + '\n\n' + m['content'] + ' [/INST]' }}{%- else %}"
                     "{{- '[INST] ' + m['content'] + ' [/INST]' }}{%- endif %}"
                     "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
ZEPHYR = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token }}"
          "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}{% endfor %}")
DEEPSEEK = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n\n' }}"
            "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token }}"
            "{% else %}{{ m['content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
            "{{ 'Assistant:' }}{% endif %}")
CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
                 "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
                 "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DS = "<｜end▁of▁sentence｜>"
FAMILIES = {  # template, bos, eos, added specials, end-of-turn text trained after a reply, reply prefix, system ok
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], "<|eot_id|>"),
    "llama31": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], "<|eot_id|>"),
    "qwen25": (QWEN25, None, "<|im_end|>", [], "<|im_end|>"),
    "mistral_v01": (MISTRAL_V01, "<s>", "</s>", [], "</s>"),
    "mistral_sys_first": (MISTRAL_SYS_FIRST, "<s>", "</s>", ["[INST]", "[/INST]"], "</s>"),
    "mistral_v03": (MISTRAL_V03, "<s>", "</s>", ["[INST]", "[/INST]"], "</s>"),
    "phi3": (PHI3, "<s>", "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    "gemma": (GEMMA, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "zephyr": (ZEPHYR, "<s>", "</s>", ["<|user|>", "<|assistant|>", "<|system|>"], "</s>"),
    "deepseek": (DEEPSEEK, "<｜begin▁of▁sentence｜>", DS, [], DS),
    "chatml_marked": (CHATML_MARKED, None, "<|im_end|>", [], "<|im_end|>"),
}
NO_SYSTEM = {"mistral_v01", "gemma"}  # their templates raise on a system message
# the template's own text between the generation prompt and the reply, trained with the reply (the model writes it)
LEAD = {"mistral_sys_first": " ", "mistral_v03": " ", "zephyr": "\n", "deepseek": " "}
TRIMS = {"llama3", "llama31", "gemma", "mistral_v03"}  # write content|trim

SYSTEM = {"role": "system", "content": "Answer briefly. Paris."}
CONVERSATION = [  # the last reply's text is also a prompt's; an empty reply; unicode; whitespace at both ends
    {"role": "user", "content": "Capital of France? Paris."}, {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": " Grüße, 你好 "}, {"role": "assistant", "content": ""},
    {"role": "user", "content": "again"}, {"role": "assistant", "content": "  你好！🙂 ça va — ✓ Paris. "}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tokenizer):
    name = request.param
    template, bos, eos, extra, _ = FAMILIES[name]
    return name, make_tokenizer(tokenizer, template, bos, eos, extra)


def expected(name: str, reply: str, last: bool) -> str:
    text = reply.strip() if name in TRIMS else reply
    end = FAMILIES[name][4]  # Phi-3's last turn too: the "\n<|endoftext|>" closing the conversation is not trained
    return LEAD.get(name, "") + text + end


@pytest.mark.parametrize("system", [False, True], ids=["no_system", "system"])
def test_each_family_trains_each_reply_and_its_end_of_turn(family, system):
    name, tok = family
    messages = [SYSTEM] * system + CONVERSATION
    if system and name in NO_SYSTEM:
        with pytest.raises(FormatError, match="refused this conversation"):
            encode_chat(tok, messages)
        return
    ids, mask = encode_chat(tok, messages, markers=name == "chatml_marked")
    assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    spans = trained_spans(tok, ids, mask)
    want = [expected(name, r, k == len(replies) - 1) for k, r in enumerate(replies)]
    if name in ("qwen25", "chatml_marked", "phi3"):  # "\n" + "  " is one token: the header's newline rides along
        want[2] = "\n" + want[2]
    assert spans == want


# DeepSeek-R1's generation prompt opens the reasoning ("<think>\n") that its rendered replies do not hold (it drops
# the reasoning from them); with {% generation %} markers, as trainers add them for assistant-only loss
R1_MARKED = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
             "{% else %}{% set c = m['content'].split('</think>')[-1] %}{{ '<｜Assistant｜>' }}"
             "{% generation %}{{ c + eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}")
MISTRAL_V03_MARKED = MISTRAL_V03.replace('{{- " " + message["content"]|trim + eos_token }}',
                                         '{%- generation %}{{- " " + message["content"]|trim + eos_token }}'
                                         '{%- endgeneration %}')
TURNS = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello there."},
         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is four, I am quite sure."}]


@pytest.mark.parametrize("name", ["r1", "mistral_v03"])
def test_a_marked_templates_completion_keeps_its_loss(tokenizer, tmp_path, name):
    """prompt/completion with a {% generation %}-marked template: the prompt's rendering with the generation prompt
    is not the start of the full one (R1: its "<think>\\n"; Mistral v0.3: the system message it writes into a final
    user turn). Blanking that rendering's length of tokens blanked the completion's reply (all of R1's, all but
    Mistral's "</s>")."""
    if name == "r1":
        tok = make_tokenizer(tokenizer, R1_MARKED, "<｜begin▁of▁sentence｜>", DS, ["<｜User｜>", "<｜Assistant｜>"])
        prompt, end = TURNS[:3], DS
    else:
        tok = make_tokenizer(tokenizer, MISTRAL_V03_MARKED, "<s>", "</s>", ["[INST]", "[/INST]"])
        prompt, end = [{"role": "system", "content": "Always answer in one full sentence, please."}] + TURNS[:3], "</s>"
    records = [{"prompt": prompt, "completion": TURNS[3:]}]
    ds = load_dataset(write_jsonl(tmp_path / "pc.jsonl", records), tok, max_seq_len=256)
    ids, mask = ds[0]
    assert ids.tolist() == tok.apply_chat_template(prompt + TURNS[3:], tokenize=True, return_dict=True)["input_ids"]
    lead = " " if name == "mistral_v03" else ""
    assert trained_spans(tok, ids, mask) == [f"{lead}It is four, I am quite sure.{end}"]


@pytest.mark.parametrize("old, new", [
    # the prompt's reply rewritten once the completion follows
    ("{% generation %}", "{% if add_generation_prompt %}{{ '(earlier) ' }}{% endif %}{% generation %}"),
    # the prompt's last reply closing with another token (the renderings first differ at that marked token)
    ("{{ m['content'] + '<|im_end|>' }}", "{{ m['content'] + ('<|endoftext|>' if add_generation_prompt else "
                                          "'<|im_end|>') }}"),
])
def test_a_marked_template_that_renders_the_prompts_replies_otherwise_is_refused(tokenizer, old, new):
    """The prompt's reply renders otherwise once the completion follows: where its tokens are in the full rendering
    is not known, so the completion cannot be told from it (unchecked, the second case trained the prompt reply's
    <|im_end|> as part of the completion, silently)."""
    tok = make_tokenizer(tokenizer, CHATML_MARKED.replace(old, new), None, "<|im_end|>", [])
    with pytest.raises(FormatError, match=r"\{% generation %\} markers cannot tell the completion's turns"):
        encode_chat(tok, TURNS, train_from=3, markers=True)
    ids, mask = encode_chat(tok, TURNS, markers=True)  # a whole conversation trains every reply
    assert trained_spans(tok, ids, mask) == ["Hello there.<|im_end|>", "It is four, I am quite sure.<|im_end|>"]


# marked, with no generation prompt and nothing between turns: a prompt ending in a reply shares all of its tokens,
# that reply's marked <|im_end|> last, with the full rendering
MARKED_NO_GEN_PROMPT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
                        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
                        "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}")


def test_a_marked_completion_after_a_prompt_reply_trains_none_of_the_prompt_reply(tokenizer):
    """With markers, a completion blanks every token the prompt's rendering shares with the full one, the last one
    too: here that is the prompt reply's own marked <|im_end|>, which must not carry loss (blanking one token short
    trained it with the completion)."""
    tok = make_tokenizer(tokenizer, MARKED_NO_GEN_PROMPT, None, "<|im_end|>", [])
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "b"}]
    ids, mask = encode_chat(tok, msgs, markers=True)
    assert trained_spans(tok, ids, mask) == ["a<|im_end|>", "b<|im_end|>"]
    ids, mask = encode_chat(tok, msgs, train_from=2, markers=True)
    assert trained_spans(tok, ids, mask) == ["b<|im_end|>"]


def test_markers_of_the_default_template_of_several_are_used(tokenizer, tmp_path):
    """A tokenizer saved with more than one template (additional_chat_templates/) has a dict chat_template, and
    apply_chat_template renders its "default". Its {% generation %} markers went unseen, so a template that drops
    earlier reasoning (only its markers locate the replies) was refused as not prefix-stable."""
    from transformers import AutoTokenizer

    tok = make_tokenizer(tokenizer, THINK.replace("TAG", "{% generation %}"), None, "<|im_end|>", [])
    tok.chat_template = {"default": tok.chat_template, "tool_use": tok.chat_template + "{{ '' }}"}
    tok.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert isinstance(tok.chat_template, dict)
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"messages": THINKING}]), tok, max_seq_len=256)
    assert trained_spans(tok, *ds[0]) == ["one<|im_end|>", "<think>y</think>two<|im_end|>"]
