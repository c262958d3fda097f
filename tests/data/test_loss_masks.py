"""Loss masks across chat-template shapes: what carries loss is each reply and its end-of-turn token."""

import pytest

from chronicals.data import load_dataset

from test_formats import trained_spans, write_jsonl

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
