"""Turning an ``Example`` into token ids and a trainable mask (loss on predicting that token).

Chat examples are rendered with the tokenizer's chat template (chat_template.py). Which tokens belong to assistant
turns:
- if the template marks them (``{% generation %}``), transformers' ``return_assistant_tokens_mask``; a completion
  (``train_from``) blanks the tokens the prompt's rendering shares with the full one (``_prompt_end``);
- otherwise by rendering prefixes, which bound each turn as a character span of the full rendering (chat_turns.py
  says how, and what it does for a template that is not prefix-stable). The full text is tokenized once with
  character offsets, and a token is trainable when it overlaps a span.
Prompt/target examples: ``prompt + target + eos`` with the tokenizer's special tokens (e.g. BOS); loss on
target and eos.

A reply whose loss ends in its text, with no trained special token after it, teaches the model to write replies
but never to stop: a template whose ``{% generation %}`` markers close before ``<|im_end|>``, or one that closes
no reply with a special token (GLM's turns end where the next ``<|user|>`` begins). ``unclosed_replies`` counts
them per example and ``load_dataset`` warns once per set; which tokens carry loss stays the template's.
"""

from __future__ import annotations

import numpy as np

from .chat_template import _apply, _check_tool_calls, _need_template, _render
from .chat_turns import _Unbounded, _locate, _without_system
from .formats import Example, FormatError


def check_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"chronicals.data needs a fast (Rust) tokenizer for character offsets; got "
                        f"{type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(..., use_fast=True)")


def _offsets_mask(tokenizer, text: str, spans, add_special_tokens: bool, across: list | None = None):
    """(ids, trainable): a token is trainable when it overlaps a span. ``across``: a list to which True is appended
    when a token spans the start of the first span (it holds prompt text too), else False."""
    # verbose=False: transformers' "longer than the specified maximum sequence length ... indexing errors" line; the
    # loader checks each example against data.max_seq_len and the model's context itself, and says what to do
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True, verbose=False)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:  # overlap, so " A" of "Q: " + "A" (one token across the boundary) is trained
        mask |= (ends > lo) & (starts < hi)
    if across is not None:
        lo = spans[0][0] if spans else 0
        across.append(bool(((starts < lo) & (ends > lo)).any()))
    return ids, mask


def _special_texts(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (eos, ``<|im_end|>``, ``<|eot_id|>``, ...)."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok))
    return tuple(t for t in texts if t)


def turn_end_ids(tokenizer) -> np.ndarray:
    """The ids of the tokenizer's special tokens (sorted int64), any of which may close a turn: eos, ``<|im_end|>``,
    ``<|eot_id|>``, Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``. Which one a model stops at is its generation
    config's, which the tokenizer does not hold, so every special token counts; one not in the vocabulary (an
    eos_token of "") has the id None and closes nothing. Ask once per dataset."""
    ids = {int(t) for t in getattr(tokenizer, "all_special_ids", None) or [] if t is not None}
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return np.array(sorted(ids), dtype=np.int64)


def unclosed_replies(tokenizer, ids: np.ndarray, mask: np.ndarray, end_ids: np.ndarray) -> tuple[int, int]:
    """(runs, unclosed) of a chat example: its runs of consecutive trainable tokens (one per reply, unless the
    template marks a turn in pieces) and how many of them no trained special token (``end_ids``) closes. A run
    is closed when it ends in one, whitespace after it allowed (a template may mark ``<|im_end|>\\n``), or when
    the first special token after its text carries loss (a later marked piece of the same turn holds it).
    ``reply`` marked without ``<|im_end|>``, or GLM's ``reply`` before the next ``<|user|>``, is unclosed."""
    edges = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0, append=0))  # run starts and ends, interleaved
    is_end = np.isin(ids, end_ids)
    unclosed = 0
    for lo, hi in zip(edges[0::2].tolist(), edges[1::2].tolist()):
        k = hi - 1  # back over the whitespace after the run's last special token or text
        while k > lo and not is_end[k] and not tokenizer.decode([int(ids[k])]).strip():
            k -= 1
        if is_end[k]:
            continue
        later = np.flatnonzero(is_end[k + 1:])  # k: the reply's last text token
        unclosed += not (len(later) and mask[k + 1 + later[0]])
    return len(edges) // 2, unclosed


def unclosed_last_reply(tokenizer, messages: list[dict], ids: np.ndarray, end_ids: np.ndarray) -> tuple[int, int]:
    """(ends in a reply, unclosed) of a chat example trained on every token (loss_on="all"), each 0 or 1: a
    conversation that ends in an assistant reply, and whether its rendering then ends, past whitespace, in no token
    of ``end_ids`` (GLM's writes nothing after the last reply: its turns end where the next one begins). A reply
    with a turn after it trains whatever the template writes between them (GLM's next ``<|user|>``), so only the
    last reply is checked."""
    if not messages or messages[-1].get("role") != "assistant" or not len(ids):
        return 0, 0
    return unclosed_replies(tokenizer, ids, np.ones(len(ids), dtype=bool), end_ids)


def _prompt_end(tokenizer, prompt, ids: np.ndarray) -> int:
    """Where the prompt ends in the full rendering's ids (a template with ``{% generation %}`` markers): the tokens
    the prompt's rendering (with the generation prompt) shares with them. Not its length: a generation prompt may
    hold text the rendered reply does not (DeepSeek-R1's ``<think>\\n``), or the prompt's rendering text the full
    one drops (Mistral v0.3's system message, written into a final user turn), and blanking that many tokens
    would blank the completion's first ones, or all of it. Every reply the prompt marks must lie in that shared
    part (else its tokens in the full rendering are not known): raises FormatError otherwise."""
    out = _apply(tokenizer, prompt, tokenize=True, add_generation_prompt=True, return_dict=True,
                 return_assistant_tokens_mask=True)
    head, head_mask = np.asarray(out["input_ids"], dtype=np.int32), np.asarray(out["assistant_masks"], dtype=bool)
    n = min(len(head), len(ids))
    differ = np.flatnonzero(head[:n] != ids[:n])
    shared = int(differ[0]) if len(differ) else n
    if head_mask[shared:].any():
        raise FormatError(f"the chat template renders the prompt's replies (messages before {len(prompt)}) "
                          "differently when the completion follows, so its {% generation %} markers cannot tell "
                          "the completion's turns from the prompt's; put the whole conversation in 'messages' "
                          "(loss on every reply) or use data.train_on=all (load_dataset: loss_on='all')")
    return shared


def encode_chat(tokenizer, messages: list[dict], train_from: int = 0, markers: bool = False):
    """messages -> (ids (L,) int32, trainable (L,) bool): trainable = assistant turns at index >= train_from."""
    _need_template(tokenizer)
    if markers:
        _check_tool_calls(tokenizer, messages)
        out = _apply(tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if train_from:
            mask[:_prompt_end(tokenizer, messages[:train_from], ids)] = False  # loss only on the completion's turns
        return ids, mask
    try:
        full = _render(tokenizer, messages)
    except FormatError:  # a clearer error where a tool call's null content failed the template (_render_calls)
        _check_tool_calls(tokenizer, messages)
        raise
    _check_tool_calls(tokenizer, messages, full)
    specials = _special_texts(tokenizer)
    try:
        spans = [(lo, hi) for _, lo, hi in _locate(tokenizer, messages, full, train_from, specials)]
    except _Unbounded as e:
        spans = _without_system(tokenizer, messages, full, train_from, specials)
        if spans is None:
            raise FormatError(
                f"the chat template is not prefix-stable at message {e.index}: rendering the first {e.index + 1} "
                "messages is not a prefix of rendering them all (or an assistant message comes first), and neither "
                "fallback located the reply (dropping special tokens the template writes only at the end of a "
                "conversation, as Phi-3's eos; rendering without the system message, which Mistral v0.3 moves "
                "into the last user turn), so the assistant tokens cannot be located without risking mislabeled "
                "tokens; use a template with {% generation %} markers or data.train_on=all "
                "(load_dataset: loss_on='all')") from None
    return _offsets_mask(tokenizer, full, spans, add_special_tokens=False)


def encode(tokenizer, ex: Example, loss_on: str = "assistant", markers: bool = False, own_eos: bool | None = None,
           across: list | None = None):
    """Example -> (ids (L,) int32, trainable (L,) bool). loss_on: "assistant" | "all". ``markers``
    (``has_generation_markers``) and ``own_eos`` (``appends_eos``; None: asked here) are the tokenizer's, which
    a caller encoding many records works out once. ``across``: for a prompt/target example with loss on the target,
    True is appended to it when one token holds the end of the prompt and the start of the target ("Name: Jo" +
    "hn": " John" is trained, and served the prompt alone the model sees " Jo" instead), else False."""
    if ex.messages is not None:
        if loss_on == "all":
            _need_template(tokenizer)  # else transformers' long "Cannot use chat template functions ..."
            _check_tool_calls(tokenizer, ex.messages)
            ids = _render_ids(tokenizer, ex.messages)
            return ids, np.ones(len(ids), dtype=bool)
        return encode_chat(tokenizer, ex.messages, ex.train_from, markers)
    eos = tokenizer.eos_token or ""
    text = ex.prompt + ex.target
    if own_eos is None:
        own_eos = appends_eos(tokenizer)
    # split_special_tokens=True tokenizes '<|im_end|>' written in text as its pieces: the eos is then added as its id
    eos_id = tokenizer.eos_token_id if getattr(tokenizer, "split_special_tokens", False) else None
    if eos and not text.endswith(eos) and not own_eos and eos_id is None:
        text += eos
    lo = 0 if loss_on == "all" else len(ex.prompt)
    ids, mask = _offsets_mask(tokenizer, text, [(lo, len(text))], add_special_tokens=True,
                              across=across if lo else None)
    if eos and not own_eos and eos_id is not None:
        ids, mask = np.append(ids, np.int32(eos_id)), np.append(mask, True)
    if own_eos:  # the tokenizer's own eos covers no character of the text, so the span cannot reach it
        mask[-1] = True
    return ids, mask


def appends_eos(tokenizer) -> bool:
    """True when the tokenizer ends every sequence with eos itself (Llama's add_eos_token=True): appending one
    to the text as well would end each document in two. One tokenizer call (~40 us): ask once per dataset."""
    eos_id = tokenizer.eos_token_id
    return eos_id is not None and tokenizer("a", add_special_tokens=True)["input_ids"][-1] == eos_id


def _render_ids(tokenizer, messages) -> np.ndarray:
    enc = tokenizer(_render(tokenizer, messages), add_special_tokens=False, verbose=False)  # see _offsets_mask
    return np.asarray(enc["input_ids"], dtype=np.int32)
