"""Mutation testing (session 27): top_p keeps the token that crosses it, models.chat opens the assistant turn,
same_model across spellings of one directory (LoRA resume and the base warnings read it)."""

from __future__ import annotations

import torch

from chronicals.bench.shapes import get_shape, model_config
from chronicals.models import CausalLM
from chronicals.models.generate import generate
from chronicals.models.loading import same_model


def _model():
    return CausalLM(model_config(get_shape("tiny"))).float().init_weights(std=0.5, seed=0).eval()


def test_top_p_keeps_the_token_that_crosses_it():
    """Nucleus = the smallest set of most likely tokens whose mass REACHES top_p: with top_p below the top token's
    probability it is that token alone (sampling is greedy), never an empty set."""
    model = _model()
    ids = torch.randint(3, 500, (6,), generator=torch.Generator().manual_seed(3))
    greedy = generate(model, ids, 4)
    for seed in range(3):
        got = generate(model, ids, 4, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(seed))
        assert got.tolist() == greedy.tolist()


class _Tok:
    """A tokenizer stand-in: records the template call, decodes ids as text."""
    chat_template = "{{ messages }}"
    eos_token_id = None

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, **kw):
        self.calls.append((messages, kw))
        return [5, 6, 7] + ([9] if kw.get("add_generation_prompt") else [])  # 9: the opened assistant turn

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids.tolist()))


def test_models_chat_opens_the_assistant_turn():
    from chronicals.models import chat

    tok = _Tok()
    text = chat(_model(), tok, "hi", max_new_tokens=3)
    (messages, kw), = tok.calls
    assert messages == [{"role": "user", "content": "hi"}] and kw["add_generation_prompt"] is True
    assert len(text.split()) == 3


def test_two_spellings_of_one_model_are_the_same(tmp_path, monkeypatch):
    d = tmp_path / "base"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    monkeypatch.chdir(tmp_path)
    assert same_model("base", str(d)) and same_model(str(tmp_path / "link"), "./base")
    other = tmp_path / "other"
    other.mkdir()
    assert not same_model(str(d), str(other))
    assert not same_model("smollm2-135m-instruct", str(d)) and not same_model(None, str(d))
