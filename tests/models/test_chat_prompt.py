"""``chronicals.chat`` hands the model the user turn and the assistant header, as apply_chat_template's generation
prompt writes it: without the header SmolLM2 continues the user's turn instead of answering."""

from __future__ import annotations

import torch

from chronicals.models import loading
from smollm2_tokenizer import smollm2_tokenizer


def test_chat_prompts_with_the_generation_prompt(monkeypatch):
    tok = smollm2_tokenizer()
    seen = {}

    def fake_generate(model, ids, max_new_tokens, eos_token_id=None):
        seen["ids"] = ids.tolist()
        return []

    monkeypatch.setattr(loading, "generate", fake_generate)
    monkeypatch.setattr(loading, "stop_ids", lambda model, tokenizer: [tok.eos_token_id])
    loading.chat(torch.nn.Module(), tok, "Hi")
    want = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False)
    assert seen["ids"] == list(want)
    assert tok.decode(seen["ids"]).endswith("<|im_start|>assistant\n")
