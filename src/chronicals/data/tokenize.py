"""Turning an ``Example`` into token ids and a trainable mask (loss on predicting that token).

Chat examples are rendered with the tokenizer's chat template. Which tokens belong to assistant turns:
- if the template marks them (``{% generation %}``), transformers' ``return_assistant_tokens_mask``;
- otherwise by rendering prefixes: for assistant message i, the text of messages[:i] with the generation
  prompt and the text of messages[:i+1] bound the turn as a character span of the full rendering: the reply
  and the template's end-of-turn text, e.g. ``hello<|im_end|>`` of ``hello<|im_end|>\\n``. Whitespace the
  template writes after the turn's closing special token is left out, as the field's templates with
  ``{% generation %}`` markers do (ChatML closes the block after ``<|im_end|>``, before the newline):
  generation stops at that token, so the newline is never sampled, and training on it adds loss tokens
  that carry nothing (226 of the demo's 3,380 per epoch, counted in tokens/s). The full text
  is tokenized once with character offsets, and a token is trainable when it overlaps a span.
  Tokenizing the whole text once (not pieces) keeps the ids identical to ``apply_chat_template``.
  Templates whose prefix renderings are not prefixes of the full one (some drop earlier reasoning)
  raise with the fix, rather than mislabel tokens.
Prompt/target examples: ``prompt + target + eos`` with the tokenizer's special tokens (e.g. BOS); loss on
target and eos.
"""

from __future__ import annotations

import re
import sys

import numpy as np

from .formats import Example, FormatError


# "{% generation %}" with any Jinja whitespace control: "{%- generation -%}", "{%generation%}", "{%+ generation %}"
_GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and _GENERATION_TAG.search(template) is not None


def check_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"chronicals.data needs a fast (Rust) tokenizer for character offsets; got "
                        f"{type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(..., use_fast=True)")


def _apply(tokenizer, messages, **kw):
    """``tokenizer.apply_chat_template``; a template that refuses the conversation (``raise_exception``:
    Mistral's "Conversation roles must alternate", Gemma's "System role not supported") or fails on it
    (``None + str``) raises FormatError, a bad record (file:line, skipped under on_error=skip)."""
    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # what a template expression raises
        raise FormatError(f"the chat template failed on this conversation ({type(e).__name__}: {e})") from None
    except Exception as e:
        jinja2 = sys.modules.get("jinja2")  # imported by transformers once a template rendered (not our dependency)
        if jinja2 is not None and isinstance(e, jinja2.TemplateError):  # raise_exception(...), undefined values
            raise FormatError(f"the chat template refused this conversation: {e}") from None
        raise


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return _apply(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _offsets_mask(tokenizer, text: str, spans, add_special_tokens: bool):
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:  # overlap, so " A" of "Q: " + "A" (one token across the boundary) is trained
        mask |= (ends > lo) & (starts < hi)
    return ids, mask


def _special_texts(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (eos, ``<|im_end|>``, ``<|eot_id|>``, ...)."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok))
    return tuple(t for t in texts if t)


def _turn_end(text: str, lo: int, hi: int, specials: tuple[str, ...]) -> int:
    """hi less the whitespace after the span's closing special token (``<|im_end|>\\n`` -> ``<|im_end|>``);
    hi itself when the span does not end in one (a template whose turns end in plain text keeps its ending)."""
    kept = text[lo:hi].rstrip()
    return lo + len(kept) if len(kept) < hi - lo and kept.endswith(specials) else hi


def _need_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise FormatError("chat data needs a tokenizer with a chat template (tokenizer.chat_template is None); "
                          "set one, or convert the data to prompt/completion")


def encode_chat(tokenizer, messages: list[dict], train_from: int = 0, markers: bool = False):
    """messages -> (ids (L,) int32, trainable (L,) bool): trainable = assistant turns at index >= train_from."""
    _need_template(tokenizer)
    if markers:
        out = _apply(tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if train_from:  # loss only on the completion's turns: blank the prompt's rendering
            head = len(_apply(tokenizer, messages[:train_from], tokenize=True, add_generation_prompt=True,
                              return_dict=True)["input_ids"])
            mask[:head] = False
        return ids, mask
    full = _render(tokenizer, messages)
    specials = _special_texts(tokenizer)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        try:
            before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        except Exception as e:  # a template may not render an empty prefix (assistant first)
            raise FormatError(f"the chat template cannot render the messages before assistant message {i} "
                              f"({type(e).__name__}: {e}); expected a user or system message first") from None
        upto = _render(tokenizer, messages[:i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise FormatError(
                f"the chat template is not prefix-stable at message {i} (rendering the first {i + 1} messages "
                "is not a prefix of rendering them all, or an assistant message comes first), so the assistant "
                "tokens cannot be located; use a template with {% generation %} markers or data.train_on=all "
                "(load_dataset: loss_on='all')")
        spans.append((len(before), _turn_end(full, len(before), len(upto), specials)))
    return _offsets_mask(tokenizer, full, spans, add_special_tokens=False)


def encode(tokenizer, ex: Example, loss_on: str = "assistant", markers: bool = False, own_eos: bool | None = None):
    """Example -> (ids (L,) int32, trainable (L,) bool). loss_on: "assistant" | "all". ``markers``
    (``has_generation_markers``) and ``own_eos`` (``appends_eos``; None: asked here) are the tokenizer's, which
    a caller encoding many records works out once."""
    if ex.messages is not None:
        if loss_on == "all":
            _need_template(tokenizer)  # else transformers' long "Cannot use chat template functions ..."
            ids = _render_ids(tokenizer, ex.messages)
            return ids, np.ones(len(ids), dtype=bool)
        return encode_chat(tokenizer, ex.messages, ex.train_from, markers)
    eos = tokenizer.eos_token or ""
    text = ex.prompt + ex.target
    if own_eos is None:
        own_eos = appends_eos(tokenizer)
    if eos and not text.endswith(eos) and not own_eos:
        text += eos
    lo = 0 if loss_on == "all" else len(ex.prompt)
    ids, mask = _offsets_mask(tokenizer, text, [(lo, len(text))], add_special_tokens=True)
    if own_eos:  # the tokenizer's own eos covers no character of the text, so the span cannot reach it
        mask[-1] = True
    return ids, mask


def appends_eos(tokenizer) -> bool:
    """True when the tokenizer ends every sequence with eos itself (Llama's add_eos_token=True): appending one
    to the text as well would end each document in two. One tokenizer call (~40 us): ask once per dataset."""
    eos_id = tokenizer.eos_token_id
    return eos_id is not None and tokenizer("a", add_special_tokens=True)["input_ids"][-1] == eos_id


def _render_ids(tokenizer, messages) -> np.ndarray:
    enc = tokenizer(_render(tokenizer, messages), add_special_tokens=False)
    return np.asarray(enc["input_ids"], dtype=np.int32)
