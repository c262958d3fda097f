"""Greedy / sampled generation with a KV cache, one prompt at a time (for chat, demos and tests)."""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
from collections.abc import Mapping

import torch

from .._numbers import is_integral
from .decode_graph import DecodeStep
from .decoder import CausalLM, KVCache

log = logging.getLogger("chronicals.generate")
_warned: set[tuple[int, int]] = set()  # (max_new_tokens, context) already warned about: once per process
_logged: set[tuple[bool, str]] = set()  # (graphed, device type) already logged: once per process


def context_length(model) -> tuple[int | None, str]:
    """(tokens a prompt and its answer share, the config field that says so): max_position_embeddings, or a
    sliding_window shorter than that (no sliding-window attention here: past it the model refuses);
    (None, "") when the config has neither."""
    cfg = getattr(model, "config", None)
    context, limit = getattr(cfg, "max_position_embeddings", None), "max_position_embeddings"
    window = getattr(cfg, "sliding_window", None)
    if window and (not context or window < context):
        context, limit = window, "sliding_window"
    return (context, limit) if context else (None, "")


def new_token_budget(model, prompt_len: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, or fewer so that prompt and answer fit the model's context (``context_length``):
    past max_position_embeddings the positions were never trained, and a large request generated nonsense for
    minutes (100000 new tokens on a 64-position model); past a shorter sliding window the model refuses, which
    ended a chat or eval with an error. A warning, once per process and setting, says so; a chat loop goes on.
    A max_new_tokens that is not a whole number >= 0 is a ValueError (-1 had decoded without end)."""
    if not is_integral(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 0 (the most new tokens to "
                         "generate)")
    max_new_tokens = int(max_new_tokens)
    context, limit = context_length(model)
    if not context or prompt_len + max_new_tokens <= context:
        return max_new_tokens
    budget = max(0, context - prompt_len)
    if not budget:  # no answer at all, for this prompt: said each time (a chat loop's next prompt may fit)
        log.warning("a %d-token prompt: the prompt alone fills the model's context (%s=%d), so "
                    "no new token is generated; shorten the prompt to fewer than %d tokens", prompt_len, limit,
                    context, context)
        return 0
    if (max_new_tokens, context) not in _warned:
        _warned.add((max_new_tokens, context))
        log.warning("max_new_tokens=%d with a %d-token prompt goes past the model's context "
                    "(%s=%d): generating at most %d new tokens; lower max_new_tokens to at "
                    "most %d minus the prompt's length", max_new_tokens, prompt_len, limit, context, budget, context)
    return budget


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model.eval()`` inside, and each module's own mode back afterwards: ``model.train(was_training)`` would
    also switch on the dropout of a module the caller had left in eval."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def _one_prompt(enc: Mapping) -> torch.Tensor:
    """The input_ids of a tokenizer's output for one prompt; ValueError for padded or id-less ones."""
    if "input_ids" not in enc:
        raise ValueError(f"generate got a mapping without 'input_ids' (keys: {sorted(enc)}); pass the tokenizer's "
                         "output or its input_ids tensor")
    ids = enc["input_ids"]
    if isinstance(ids, (list, tuple)) and len(ids) != 1 and ids and isinstance(ids[0], (list, tuple)):
        raise ValueError(f"generate takes one prompt, and this tokenizer output holds {len(ids)}; call it once per "
                         "prompt")
    mask = enc.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("generate takes one unpadded prompt, and this one's attention_mask has zeros; tokenize "
                         "the prompt alone (no padding=...) or pass its input_ids without the padding")
    return torch.as_tensor(ids)


# Below this many new tokens eager decoding is kept: capturing costs ~3 eager steps (2 warm-up runs and the capture)
GRAPH_MIN_NEW_TOKENS = 16


def decode_with_graph(cuda_graph: bool | None, device: torch.device, max_new_tokens: int) -> bool:
    """Whether ``generate`` replays a captured decode step (``models.decode_graph``). None (auto): on CUDA for at
    least GRAPH_MIN_NEW_TOKENS new tokens; True on a CPU model is an error that says what to pass."""
    if cuda_graph is None:
        return device.type == "cuda" and max_new_tokens >= GRAPH_MIN_NEW_TOKENS
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"generate(cuda_graph=True) needs a model on CUDA, and this one is on {device}; pass "
                         "cuda_graph=None (auto) or False")
    return bool(cuda_graph)


def _choose(cuda_graph: bool | None, device: torch.device, max_new_tokens: int) -> bool:
    """decode_with_graph's answer, logged at INFO once per process and choice."""
    graphed = decode_with_graph(cuda_graph, device, max_new_tokens)
    if (graphed, device.type) not in _logged:
        _logged.add((graphed, device.type))
        if graphed:
            how = "one CUDA-graph replay per new token (cuda_graph=False: eager)"
        elif device.type == "cuda" and cuda_graph is None:
            how = f"eager decoding (fewer than {GRAPH_MIN_NEW_TOKENS} new tokens)"
        else:
            how = "eager decoding"
        log.info("generate: %s on %s", how, device)
    return graphed


# the smallest temperature sampling divides by; below it every temperature samples as this one (from the ties of the
# largest logit: all others get probability 0)
SHARPEST_TEMPERATURE = 1e-30


def _eos_set(eos_token_id) -> set[int]:
    """None, an id (int, numpy integer, 0-d tensor) or ids (a list, tuple, set, 1-d tensor) -> a set of ints."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):  # a 0-d or 1-d tensor of ids, as a tokenizer config may give
        eos_token_id = eos_token_id.flatten().tolist()
    ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else list(eos_token_id)
    if not all(is_integral(i) for i in ids):
        raise ValueError(f"eos_token_id={eos_token_id!r}: give a token id or a list of token ids")
    return {int(i) for i in ids}


def stop_ids(model: CausalLM, tokenizer) -> set[int]:
    """The ids a reply ends at: the tokenizer's eos, config.json's eos_token_id and generation_config.json's (of
    the directory the model was loaded from), an id or a list each. Llama-3.x instruct models end a turn with
    <|eot_id|> but list <|end_of_text|> and <|eom_id|> too; the tokenizer's eos alone ran past those."""
    ids = _eos_set(getattr(tokenizer, "eos_token_id", None)) | _eos_set(model.config.eos_token_id)
    raw = getattr(model, "source_generation_config", None)
    if raw is not None:
        try:
            gen = json.loads(raw)
            ids |= _eos_set(gen.get("eos_token_id") if isinstance(gen, dict) else None)
        except (ValueError, TypeError):  # transformers refuses such a file when it loads it: named there, not here
            pass
    return ids


@torch.no_grad()
def generate(model: CausalLM, input_ids: torch.Tensor, max_new_tokens: int = 64, *, eos_token_id=None,
             temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
             cuda_graph: bool | None = None, streamer=None) -> torch.Tensor:
    """input_ids (S,) or (1, S) -> the new token ids (T,), T <= max_new_tokens; stops at eos, and at the model's
    context (S + T <= max_position_embeddings, or sliding_window when shorter, with a warning: see
    ``new_token_budget``).

    eos_token_id: an id or ids to stop at (the eos included in the output); None (the default, as transformers'
    generate): the model's own, config.json's and generation_config.json's eos_token_id (``stop_ids`` without a
    tokenizer; it decoded past <|im_end|> before); ``[]`` to decode max_new_tokens whatever comes.

    temperature 0 is greedy decoding; above 0, tokens are drawn from softmax(logits / temperature) with
    ``generator`` (on the model's device), from the smallest set of most likely tokens whose probability
    reaches ``top_p`` (nucleus sampling; 1.0: from all). ``input_ids`` may also be a list of ints, or a tokenizer's
    output for one prompt (a mapping with "input_ids", such as the BatchEncoding that ``apply_chat_template(...,
    return_tensors="pt")`` returns).

    streamer: an object with ``put(ids)`` and ``end()``, such as transformers' ``TextStreamer`` (prints the text
    as it comes), in transformers' protocol: the prompt is put first, as a (1, S) tensor on the CPU (what
    ``TextStreamer(..., skip_prompt=True)`` skips: without it put, that skip ate the first new token), then each
    new token, as a (1,) tensor, when it is picked; end() after the last.

    cuda_graph: replay one captured decode step per token over a preallocated KV cache (``models.decode_graph``;
    the bare 0.5B model decoded ~10x faster on an H200, see benchmarks/bench_generate_adapter_dtype.py). None
    (auto) does on CUDA for >= GRAPH_MIN_NEW_TOKENS new tokens; the choice is logged at INFO. The tokens can
    differ from eager decoding's where two logits are within rounding: the step attends over the whole cache
    with a mask (PyTorch's SDPA), eager decoding over the filled part.
    """
    if isinstance(input_ids, Mapping):
        input_ids = _one_prompt(input_ids)
    elif isinstance(input_ids, str):  # was AttributeError: 'str' object has no attribute 'dim'
        raise TypeError("generate takes token ids, not text; tokenize it first: generate(model, "
                        "tokenizer(text, return_tensors='pt').input_ids), or chronicals.models.chat(model, tokenizer, "
                        "text) for a chat model's answer")
    elif isinstance(input_ids, (list, tuple)):  # a tokenizer's plain ids (apply_chat_template's default return)
        try:
            input_ids = torch.tensor(input_ids)  # its own dtype, checked below: dtype=long cut 5.9 to 5 silently
        except (TypeError, ValueError, RuntimeError) as e:  # ragged rows, strings in the list
            raise TypeError(f"generate takes token ids (a tensor or a list of ints), got a list it cannot read as "
                            f"ids ({e})") from None
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"generate takes token ids as a tensor (S,) or (1, S), a list of ints or a tokenizer's "
                        f"output, got {type(input_ids).__name__}")
    # view(1, -1) would join a (B, S) batch's rows into one prompt of B * S tokens
    if input_ids.dim() not in (1, 2) or input_ids.dim() == 2 and input_ids.shape[0] != 1 or not input_ids.shape[-1]:
        raise ValueError(f"generate takes one prompt, input_ids (S,) or (1, S) with S >= 1, got shape "
                         f"{tuple(input_ids.shape)}; call it once per prompt (an empty prompt: start it with the "
                         "tokenizer's bos_token_id)")
    if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise TypeError(f"generate takes integer token ids, got {input_ids.dtype} ones (e.g. "
                        f"{input_ids.view(-1)[0].item()}); pass the tokenizer's ids as they are, not scores or a mask")
    for name, v in (("temperature", temperature), ("top_p", top_p)):  # "0.5" or None: a bare TypeError from <= below
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise TypeError(f"generate: {name}={v!r} must be a number, got {type(v).__name__}")
    if not 0 <= temperature < float("inf"):  # NaN too
        raise ValueError(f"generate: temperature={temperature} must be a finite number >= 0 (0 = greedy decoding)")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1] (1 = sample from every token)")
    if top_p != 1 and temperature == 0:  # chat refuses --top-p without --temperature; here said, as transformers does
        log.warning("generate: top_p=%s has no effect at temperature=0 (greedy decoding); set temperature > 0 to "
                    "sample", top_p)
    ids = input_ids.view(1, -1).to(model.lm_head.weight.device)
    max_new_tokens = new_token_budget(model, ids.shape[1], max_new_tokens)
    eos = stop_ids(model, None) if eos_token_id is None else _eos_set(eos_token_id)
    graphed = _choose(cuda_graph, ids.device, max_new_tokens)

    def pick(logits: torch.Tensor) -> int:
        if temperature > 0:
            # from the largest logit down, in fp32: a temperature near 0 (1e-45) made logits / t inf and the
            # probabilities NaN; t >= 1e-30 keeps (z - max) / t finite (|z - max| << 3e8) and is greedy-sharp
            z = logits.float()
            probs = torch.softmax((z - z.max()) / max(temperature, SHARPEST_TEMPERATURE), dim=-1)
            if top_p < 1:  # keep a token while the mass of the likelier ones is below top_p (the first always)
                probs, order = probs.sort(descending=True)
                probs = probs * (probs.cumsum(0) - probs < top_p)
                return int(order[torch.multinomial(probs, 1, generator=generator)])
            return int(torch.multinomial(probs, 1, generator=generator))
        return int(logits.argmax())

    def shown(logits: torch.Tensor) -> int:  # the choice, put to the streamer as it is made
        token = pick(logits)
        streamer.put(torch.tensor([token]))
        return token

    try:
        if streamer is not None:
            streamer.put(ids.cpu())
        if not max_new_tokens:
            return torch.tensor([], dtype=torch.long)
        return _generate(model, ids, max_new_tokens, eos, pick if streamer is None else shown, graphed)
    finally:
        if streamer is not None:
            streamer.end()


def _generate(model, ids: torch.Tensor, max_new_tokens: int, eos: set, pick, graphed: bool) -> torch.Tensor:
    """generate's loop on the chosen path: a captured step over a static cache, or eager over a growing one."""
    with eval_mode(model):
        if graphed:
            return _generate_graphed(model, ids, max_new_tokens, eos, pick)
        caches = [KVCache() for _ in model.model.layers]

        def logits_of(step_in: torch.Tensor) -> torch.Tensor:  # (1, s) -> fp32 logits (V,) of its last token
            return model.lm_head(model.hidden_states(step_in, kv_caches=caches)[:, -1]).float()[0]

        return _decode(logits_of(ids), lambda t: logits_of(torch.tensor([[t]], device=ids.device)),
                       max_new_tokens, eos, pick)


def _decode(logits: torch.Tensor, feed, max_new_tokens: int, eos: set, pick) -> torch.Tensor:
    """The loop both paths share: pick a token from ``logits`` (the prompt's last), stop at eos or after
    max_new_tokens, else ``feed(token)`` -> the next logits. -> the new token ids (T,)."""
    out: list[int] = []
    while True:
        out.append(pick(logits))
        if out[-1] in eos or len(out) == max_new_tokens:
            return torch.tensor(out, dtype=torch.long)
        logits = feed(out[-1])


def _generate_graphed(model, ids: torch.Tensor, max_new_tokens: int, eos: set, pick, capture: bool = True):
    """``generate``'s loop on a static KV cache of prompt + max_new_tokens slots: the prompt eagerly, then one
    captured step per token, captured when the first one is fed (``capture=False``: the same step eagerly, for
    CPU tests of the cache logic)."""
    step = DecodeStep(model, ids.shape[1] + max_new_tokens)

    def feed(token: int) -> torch.Tensor:
        step.token.fill_(token)
        if capture and step.graph is None:
            step.capture()
        return step.run()[0]

    return _decode(step.prefill(ids)[0], feed, max_new_tokens, eos, pick)


@torch.no_grad()
def greedy_rows(model: CausalLM, ids: torch.Tensor, max_new_tokens: int, eos, *,
                cuda_graph: bool | None = None) -> list[list[int]]:
    """Greedy continuations of B prompts of one length: ids (B, S) -> B lists of new ids, each ending at its first
    eos (a token id, ids, or None, as ``generate``'s eos_token_id) or after max_new_tokens (fewer where prompt and answer would pass the model's context: new_token_budget).

    Equal lengths need no padding mask, so one batched step a token reads the weights once for all B rows (eval's
    held-out answers: ~1/6 of one-by-one decoding's time at B = 11 on a CPU, where a step is bound by reading the
    weights). ``cuda_graph`` as in ``generate``: on CUDA, for >= GRAPH_MIN_NEW_TOKENS, each token is one replay of
    a captured B-row step over a static cache (``decode_graph.DecodeStep(batch=B)``). Rows that reached eos are
    still fed (their tokens are dropped) so that the batch keeps its shape.
    """
    if ids.dim() != 2 or not ids.shape[1]:
        raise ValueError(f"greedy_rows takes prompts of one length as ids (B, S) with S >= 1, got shape "
                         f"{tuple(ids.shape)}")
    ids = ids.to(model.lm_head.weight.device)
    max_new_tokens = new_token_budget(model, ids.shape[1], max_new_tokens)
    eos = _eos_set(eos)
    graphed = _choose(cuda_graph, ids.device, max_new_tokens)
    if not max_new_tokens:
        return [[] for _ in range(ids.shape[0])]
    with eval_mode(model):
        if graphed:
            return _greedy_rows_static(model, ids, max_new_tokens, eos)
        caches = [KVCache() for _ in model.model.layers]

        def logits_of(step_in: torch.Tensor) -> torch.Tensor:  # (B, s) -> fp32 logits (B, V) of each last token
            return model.lm_head(model.hidden_states(step_in, kv_caches=caches)[:, -1]).float()

        return _decode_rows(logits_of(ids), lambda nxt: logits_of(nxt[:, None]), max_new_tokens, eos)


def _decode_rows(logits: torch.Tensor, feed, max_new_tokens: int, eos: set) -> list[list[int]]:
    """greedy_rows' loop: logits (B, V) -> each row's argmax appended until its eos; ``feed(tokens (B,))`` -> the
    next logits; at most max_new_tokens tokens a row."""
    out: list[list[int]] = [[] for _ in range(logits.shape[0])]
    done = [False] * len(out)
    for n in range(max_new_tokens):
        nxt = logits.argmax(dim=-1)  # (B,)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in eos
        if all(done) or n + 1 == max_new_tokens:
            return out
        logits = feed(nxt)
    return out


def _greedy_rows_static(model, ids: torch.Tensor, max_new_tokens: int, eos: set, capture: bool = True):
    """greedy_rows on a static KV cache of B rows x (prompt + max_new_tokens) slots, the step captured when the
    first tokens are fed (``capture=False``: the same step eagerly, for CPU tests of the cache logic)."""
    step = DecodeStep(model, ids.shape[1] + max_new_tokens, batch=ids.shape[0])

    def feed(nxt: torch.Tensor) -> torch.Tensor:
        step.token.copy_(nxt[:, None])
        if capture and step.graph is None:
            step.capture()
        return step.run()

    return _decode_rows(step.prefill(ids), feed, max_new_tokens, eos)
