"""Greedy / sampled generation with a KV cache, one prompt at a time (for chat, demos and tests)."""

from __future__ import annotations

import torch

from .decoder import CausalLM, KVCache


@torch.no_grad()
def generate(model: CausalLM, input_ids: torch.Tensor, max_new_tokens: int = 64, *, eos_token_id=None,
             temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """input_ids (S,) or (1, S) -> the new token ids (T,), T <= max_new_tokens; stops at eos.

    temperature 0 is greedy decoding.
    """
    ids = input_ids.view(1, -1).to(model.lm_head.weight.device)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    caches = [KVCache() for _ in model.model.layers]
    was_training = model.training
    model.eval()
    out: list[int] = []
    step_in = ids
    try:
        for _ in range(max_new_tokens):
            h = model.hidden_states(step_in, kv_caches=caches)[:, -1]  # (1, H)
            logits = model.lm_head(h).float()[0]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=generator))
            else:
                nxt = int(logits.argmax())
            out.append(nxt)
            if nxt in eos:
                break
            step_in = torch.tensor([[nxt]], device=ids.device)
    finally:
        model.train(was_training)
    return torch.tensor(out, dtype=torch.long)
