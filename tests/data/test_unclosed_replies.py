"""Replies that train no end-of-turn token: a template whose {% generation %} markers close before ``<|im_end|>``,
or one that closes no reply with a special token (GLM's turns end where the next ``<|user|>`` begins), teaches the
model to write replies but not to stop. load_dataset warns once per set, with the counts, the template's source
and the fix, also on a cache hit; which tokens carry loss stays what the template says.

Templates are written from the structure of the published ones, on a copy of the SmolLM2 tokenizer with the
family's special tokens added (test_template_fallback.make_tokenizer).
"""

import logging

import pytest

from chronicals.data import load_dataset
from chronicals.data.tokenize import encode_chat, turn_end_ids, unclosed_replies

from test_formats import trained_spans, write_jsonl
from test_loss_masks import CONVERSATION, FAMILIES, NO_SYSTEM, SYSTEM
from test_template_fallback import BASES, make_tokenizer

# ChatML with markers around the reply's text only: <|im_end|> is outside them
CHATML_CONTENT_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
                         "{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>\n' }}{% else %}"
                         "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# GLM-4: a turn is "<|role|>\n" + content; nothing closes it but the next turn's opening token
GLM4 = ("[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
GLM_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
CHATS = [[{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello there."},
          {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}],
         [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]]


def chatml_content_marked(tokenizer):
    return make_tokenizer(tokenizer, CHATML_CONTENT_MARKED, None, "<|im_end|>", [])


def glm4(tokenizer):
    return make_tokenizer(tokenizer, GLM4, None, "<|endoftext|>", GLM_SPECIALS)


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "chronicals.data"]


def load(tok, path, caplog, **kw):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        ds = load_dataset(path, tok, max_seq_len=256, **kw)
    return ds, warnings(caplog)


def records(n=3):
    return [{"messages": CHATS[k % 2]} for k in range(n)]  # 2 + 1 + 2 replies


def test_markers_around_the_reply_text_only_warn_once_and_keep_the_loss(tokenizer, tmp_path, caplog):
    tok = chatml_content_marked(tokenizer)
    path = write_jsonl(tmp_path / "t.jsonl", records())
    ds, warned = load(tok, path, caplog)
    assert trained_spans(tok, *ds[0]) == ["Hello there.", "4."]  # the template's loss, not widened
    assert (ds.stats.replies, ds.stats.unclosed_replies, ds.stats.unclosed_examples) == (5, 5, 3)
    assert ds.stats.first_unclosed == f"{path}:1"
    assert len(warned) == 1, warned
    msg = warned[0]
    assert "5 of 5 assistant replies in 3 of 3 examples train no end-of-turn token" in msg, msg
    assert f"first: {path}:1" in msg and "never learns to stop" in msg, msg
    assert "the tokenizer's chat template closes its {% generation %} markers before the special token" in msg, msg
    assert "move {% endgeneration %} after that token" in msg and "set loss_on=all" in msg, msg


def test_the_warning_names_the_template_source_and_the_callers_option(tokenizer, tmp_path, caplog):
    tok = chatml_content_marked(tokenizer)
    tok.chronicals_source = "/models/my-chatml"  # what load_tokenizer sets: the path the user gave
    ds, warned = load(tok, write_jsonl(tmp_path / "t.jsonl", records(1)), caplog, name="the training set",
                      option_names={"loss_on": "data.train_on"})
    assert len(warned) == 1 and warned[0].startswith("the training set ("), warned
    assert "the chat template of /models/my-chatml closes its" in warned[0] and "data.train_on=all" in warned[0]


def test_a_template_that_closes_no_reply_warns(tokenizer, tmp_path, caplog):
    """GLM-style: the loss span the prefix renderings locate is the reply's text alone."""
    tok = glm4(tokenizer)
    (tmp_path / "d").mkdir()
    path = write_jsonl(tmp_path / "d" / "a.jsonl", records())
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "plain text ends in eos"}])
    write_jsonl(tmp_path / "d" / "c.jsonl", [{"prompt": "Q:", "completion": " A"}])
    ds, warned = load(tok, tmp_path / "d", caplog)  # the other formats' records close in eos: not counted
    assert trained_spans(tok, *ds[0]) == ["\nHello there.", "\n4."]
    assert len(warned) == 1, warned
    assert "5 of 5 assistant replies in 3 of 5 examples train no end-of-turn token" in warned[0], warned
    assert f"(first: {path}:1)" in warned[0], warned
    assert "closes no reply with a special token" in warned[0] and "{{ content + eos_token }}" in warned[0], warned


def test_workers_count_as_one_process(tokenizer, tmp_path, caplog, monkeypatch):
    import chronicals.data.workers as workers_mod

    monkeypatch.setattr(workers_mod, "CHUNK", 2)
    tok = glm4(tokenizer)
    path = write_jsonl(tmp_path / "g.jsonl", records(7))
    serial, _ = load(tok, path, caplog, num_proc=1)
    parallel, warned = load(tok, path, caplog, num_proc=2)
    assert serial.stats == parallel.stats and parallel.stats.unclosed_replies == 11 and len(warned) == 1


def test_a_cache_hit_warns_again_with_this_runs_source(tokenizer, tmp_path, caplog):
    """The counts live in the entry's stats, so a rerun that tokenizes nothing still says it; the source is this
    run's tokenizer's (the entry is keyed by content, not by where the tokenizer was loaded from)."""
    tok = chatml_content_marked(tokenizer)
    path, cache = write_jsonl(tmp_path / "t.jsonl", records()), tmp_path / "cache"
    tok.chronicals_source = "/first/path"
    first, warned = load(tok, path, caplog, cache_dir=cache)
    assert len(warned) == 1 and "/first/path" in warned[0]
    tok.chronicals_source = "/second/path"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        again = load_dataset(path, tok, max_seq_len=256, cache_dir=cache)
    assert "from cache" in caplog.text and again.stats == first.stats
    (msg,) = warnings(caplog)
    assert msg.replace("/second/path", "/first/path") == warned[0]


def test_loss_on_every_token_warns_for_a_last_reply_the_template_leaves_open(tokenizer, tmp_path, caplog):
    """loss_on="all" trains the rendering as it is: GLM's next <|user|> closes a reply another turn follows, but the
    last reply ends the text, so a conversation that ends in one never trains a stop token; loss_on="all" warned
    of nothing. A conversation that ends in the user's turn has no last reply to close."""
    tok = glm4(tokenizer)
    asks = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye?"}]
    path = write_jsonl(tmp_path / "g.jsonl", records() + [{"messages": asks}])
    ds, warned = load(tok, path, caplog, loss_on="all", option_names={"loss_on": "data.train_on"})
    assert ds.stats.unclosed_replies == ds.stats.unclosed_examples == ds.stats.replies == 3  # not the 4th
    assert len(warned) == 1, warned
    assert ("3 of 3 conversations that end in an assistant reply (of 4 examples) end in no end-of-turn token, so "
            "with data.train_on=all the model learns to stop only after replies that another turn follows "
            f"(first: {path}:1)") in warned[0], warned
    assert "writes nothing after a conversation's last reply" in warned[0] and "{{ content + eos_token }}" in warned[0]


@pytest.mark.parametrize("kind", ["loss_on_all", "closed_marked", "newline_marked", "pieces"])
def test_closed_replies_do_not_warn(tokenizer, tmp_path, caplog, kind):
    """loss on every token; markers that hold <|im_end|>, or <|im_end|> and the newline after it; a turn marked in
    two pieces (reasoning, then the answer and <|im_end|>) whose first piece the second closes."""
    template = {"closed_marked": CHATML_CONTENT_MARKED.replace(
                    "{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>\n' }}",
                    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"),
                "newline_marked": CHATML_CONTENT_MARKED.replace(
                    "{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>\n' }}",
                    "{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"),
                "pieces": CHATML_CONTENT_MARKED.replace(
                    "{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>\n' }}",
                    "{{ 'thinking' }}{% endgeneration %}{{ '\n\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
                    "{% endgeneration %}{{ '\n' }}")}.get(kind, CHATML_CONTENT_MARKED)
    tok = make_tokenizer(tokenizer, template, None, "<|im_end|>", [])
    ds, warned = load(tok, write_jsonl(tmp_path / "t.jsonl", records()), caplog,
                      loss_on="all" if kind == "loss_on_all" else "assistant")
    assert warned == [] and ds.stats.unclosed_replies == 0
    if kind == "pieces":
        assert trained_spans(tok, *ds[0])[:2] == ["thinking", "Hello there.<|im_end|>"]


@pytest.mark.parametrize("name", sorted(set(FAMILIES) | set(BASES)))
def test_every_family_closes_its_replies(tokenizer, name):
    """No false alarm on the templates the other tests cover: each reply ends in its end-of-turn token (Gemma's
    <end_of_turn> and Phi-3's <|end|> are not eos: any special token counts)."""
    template, bos, eos, extra = FAMILIES[name][:4] if name in FAMILIES else BASES[name]
    tok = make_tokenizer(tokenizer, template, bos, eos, extra)
    messages = CONVERSATION if name in NO_SYSTEM else [SYSTEM] + CONVERSATION
    ids, mask = encode_chat(tok, messages, markers=name == "chatml_marked")
    assert unclosed_replies(tok, ids, mask, turn_end_ids(tok)) == (3, 0)


def _chatml_with_another_eos(tokenizer):
    """ChatML whose <|im_end|> is a special token of the vocabulary (added_tokens_decoder) but neither eos nor a
    named special token: a base model's tokenizer (eos <|endoftext|>), Llama 3 base with its <|eot_id|>."""
    tok = make_tokenizer(tokenizer, BASES["chatml"][0], None, "<|endoftext|>", [])
    assert "<|im_end|>" not in tok.all_special_tokens  # the case under test
    return tok


def test_a_special_token_of_the_vocabulary_closes_a_reply(tokenizer):
    """turn_end_ids holds every special token of the vocabulary, and the whitespace after one is the template's:
    with only the named ones, both replies counted as unclosed (a false "will not learn to stop" warning) and
    "<|im_end|>\\n" trained, newline and all."""
    tok = _chatml_with_another_eos(tokenizer)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A."}]
    ends = turn_end_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ends.tolist()
    ids, mask = encode_chat(tok, msgs)
    assert trained_spans(tok, ids, mask) == ["Hello.<|im_end|>", "A.<|im_end|>"]
    assert unclosed_replies(tok, ids, mask, ends) == (2, 0)
