"""A tokenizer without an eos_token: text / prompt_completion records (and alpaca ones under the Alpaca prompt) got
no end token, silently, so the model never learned to stop. load_dataset warns once per set, also on a cache hit;
chat records (their template's business) and tokenizers with an eos get no warning."""

import logging

import pytest

from chronicals.data import load_dataset

from test_formats import write_jsonl
from test_template_fallback import make_tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PC = [{"prompt": "Capital of France? ", "completion": "Paris."}, {"prompt": "2+2? ", "completion": "4."}]
ALPACA = [{"instruction": "Name a colour.", "output": "Blue."}]
CHAT = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "no eos_token" in r.getMessage()]


@pytest.mark.parametrize("records,template,want", [(PC, CHATML, "prompt_completion"), ([{"text": "a b c"}], CHATML,
                                                   "text"), (ALPACA, None, "alpaca"), (PC + CHAT, CHATML,
                                                   "prompt_completion")])
def test_records_without_an_end_token_are_warned_about_once_per_set(tokenizer, tmp_path, caplog, records,
                                                                     template, want):
    tok = make_tokenizer(tokenizer, template, None, None, ["<|im_start|>", "<|im_end|>"])
    path = write_jsonl(tmp_path / "d.jsonl", records)
    ds = load_dataset(path, tok, max_seq_len=64, cache_dir=tmp_path / "cache", name="the training set")
    assert all(ds[i][0][-1] != tokenizer.eos_token_id for i in range(len(ds)))  # nothing ends them
    got = warnings(caplog)
    assert len(got) == 1 and f"its {want} records end with no end token" in got[0], got
    assert got[0].startswith(f"the training set ({path}): the tokenizer has no eos_token")
    caplog.clear()
    load_dataset(path, tok, max_seq_len=64, cache_dir=tmp_path / "cache", name="the training set")  # cache hit
    assert len(warnings(caplog)) == 1


@pytest.mark.parametrize("records,template,eos", [(CHAT, CHATML, None), (ALPACA, CHATML, None),
                                                  (PC, CHATML, "<|im_end|>")])
def test_chat_records_and_tokenizers_with_an_eos_are_not_warned_about(tokenizer, tmp_path, caplog, records,
                                                                      template, eos):
    tok = make_tokenizer(tokenizer, template, None, eos, ["<|im_start|>", "<|im_end|>"])
    load_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, max_seq_len=64)
    assert not warnings(caplog)


def test_an_empty_eos_token_is_no_end_token(tokenizer, tmp_path, caplog):
    """A tokenizer_config.json with "eos_token": "" names a token that is not in the vocabulary (its id is None, in
    all_special_ids too): the records load, with the same warning as for no eos_token (encoding appends nothing)."""
    tok = make_tokenizer(tokenizer, CHATML, None, "", ["<|im_start|>", "<|im_end|>"])
    assert tok.eos_token == "" and None in tok.all_special_ids
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", PC), tok, max_seq_len=64)
    assert len(ds) == 2
    got = warnings(caplog)
    assert len(got) == 1 and "its prompt_completion records end with no end token" in got[0], got
