"""Decoding one token per CUDA-graph replay: a static KV cache and one captured decode step.

Eager decoding is host-bound: a 0.5B step launches ~25 kernels a layer from Python, ~18 ms of host time per token
for ~1 ms of GPU work on an H200 (bench_generate_adapter_dtype.py --profile, git dd561e4: 54.9 tokens/s for the
bare model, 21.0 with an fp32 adapter). Replaying one captured step costs one launch.

Shapes must not change between replays, so the cache is preallocated for the whole answer: (B, L, Hk, D) keys and
values per layer, L = prompt + new tokens, and the step attends over all L slots with a mask that hides the slots
past the current position (a device tensor, advanced inside the graph). The prompt runs eagerly first, as in
eager decoding, and fills the first slots. B > 1 decodes B prompts of one length together (eval's held-out
answers, ``generate.greedy_rows``): they share the position, so one mask serves every row.

Memory: 2 x B x L x Hk x D x layers elements, 45 MiB at SmolLM2-135M (30 layers, 3 kv heads of 64, bf16) for B = 1,
L = 2,048.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._words import counted
from ..ops.attention import attention_ref


class StaticKVCache:
    """Keys and values for one layer in preallocated (B, L, Hk, D) buffers. ``pos`` (1,) int64, on the device and
    shared by every layer, is the slot the next token's keys go to; the decode step reads and advances it."""

    def __init__(self, capacity: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device, pos: torch.Tensor,
                 batch: int = 1):
        self.k = torch.zeros(batch, capacity, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = pos
        self.slots = torch.arange(capacity, device=device)
        self.filled = 0  # the prompt's slots, counted on the host (decode steps count on the device only); once
        # the prompt is in (filled > 0), one token per call, at pos

    @property
    def length(self) -> int:
        """Tokens in the cache before a decode step, as far as the host knows (the prompt's): the decoder's
        host-side length checks read it. ``generate`` keeps prompt + answer within the context before it starts."""
        return self.filled

    def attend(self, q, k, v):
        """q (B, s, Hq, D), k/v (B, s, Hk, D): the prompts (into the empty cache, causal over itself), or after it
        one token, written at slot pos and attending over slots 0..pos."""
        s = q.shape[1]
        if not self.filled:
            if s > self.k.shape[1]:
                raise ValueError(f"StaticKVCache: a {s}-token prompt after {self.filled} tokens does not fit its "
                                 f"{counted(self.k.shape[1], 'slot')}")
            self.k[:, :s], self.v[:, :s] = k, v
            self.filled = s
            return attention_ref(q, k, v)
        if s != 1 or q.shape[0] != self.k.shape[0]:
            raise ValueError(f"StaticKVCache: after the prompt, feed one token a row to its "
                             f"{counted(self.k.shape[0], 'row')}, q of shape (B, 1, H, D); got {tuple(q.shape)}")
        self.k.index_copy_(1, self.pos, k)
        self.v.index_copy_(1, self.pos, v)
        mask = (self.slots <= self.pos).view(1, 1, 1, -1)  # (1, 1, 1, L): slots written so far
        qt, kt, vt = q.transpose(1, 2), self.k.transpose(1, 2), self.v.transpose(1, 2)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=qt.shape[1] != kt.shape[1])
        return out.transpose(1, 2)


class DecodeStep:
    """One token a row through the model at the device-side position: ``run()`` -> fp32 logits (B, V) of the
    tokens in ``self.token`` (B, 1), then the position advanced. ``capture()`` records it as a CUDA graph; ``run`` then
    replays it. Without capture (CPU, or tests) it runs eagerly on the same static cache, so both paths share the
    cache logic."""

    def __init__(self, model, capacity: int, batch: int = 1):
        cfg, w = model.config, model.lm_head.weight
        self.model, self.device = model, w.device
        self.pos = torch.zeros(1, dtype=torch.long, device=w.device)
        dtype = model.model.embed_tokens.weight.dtype
        self.caches = [StaticKVCache(capacity, cfg.num_key_value_heads, cfg.head_dim, dtype, w.device, self.pos,
                                     batch) for _ in model.model.layers]
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=w.device)
        self.graph = self.logits = None

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, S) -> fp32 logits (B, V) of each row's last prompt token; the cache holds the prompts and
        pos = S."""
        if ids.shape[0] != self.token.shape[0]:
            raise ValueError(f"DecodeStep for {counted(self.token.shape[0], 'row')} got "
                             f"{counted(ids.shape[0], 'prompt')}")
        h = self.model.hidden_states(ids, kv_caches=self.caches)[:, -1]
        self.pos.fill_(ids.shape[1])
        return self.model.lm_head(h).float()

    def _step(self) -> torch.Tensor:
        positions = self.pos.view(1, 1).expand_as(self.token)  # every row is at the same position
        h = self.model.hidden_states(self.token, position_ids=positions, kv_caches=self.caches)[:, -1]
        logits = self.model.lm_head(h).float()
        self.pos.add_(1)
        return logits

    def capture(self, warmup: int = 2) -> None:
        """Warm up (Triton autotuning, lazy inits) on a side stream, then capture one step. Warm-up writes the
        current slot, which the first replay writes again; pos is put back."""
        saved = self.pos.clone()
        with torch.cuda.device(self.device):  # the model's GPU, which need not be the current one
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._step()
                    self.pos.copy_(saved)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._step()
        self.graph, self.logits = graph, logits

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self._step()
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.logits
