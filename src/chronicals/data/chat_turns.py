"""Locating each assistant turn of a chat as a character span of the chat template's full rendering, for a template
without ``{% generation %}`` markers (``tokenize.encode_chat`` trains the tokens that overlap the spans).

By rendering prefixes: for assistant message i, the text of messages[:i] with the generation
prompt and the text of messages[:i+1] bound the turn as a character span of the full rendering: the reply
and the template's end-of-turn text, e.g. ``hello<|im_end|>`` of ``hello<|im_end|>\\n``. Whitespace the
template writes after the turn's closing special token is left out, as the field's templates with
``{% generation %}`` markers do (ChatML closes the block after ``<|im_end|>``, before the newline):
generation stops at that token, so the newline is never sampled, and training on it adds loss tokens
that carry nothing (226 of the demo's 3,380 per epoch, counted in tokens/s). The full text
is tokenized once with character offsets, and a token is trainable when it overlaps a span.
The turn thus starts where the prompt's rendering with the generation prompt ends, so the loss falls on what
the model must write when it is served with that template. A template with no ``add_generation_prompt``
branch therefore trains the assistant header (``<|im_start|>assistant\\n``) with the reply: a model served
with it is given no header and writes one itself (Llama-2's space before the reply is such a header).
Tokenizing the whole text once (not pieces) keeps the ids identical to ``apply_chat_template``.
When a template is not prefix-stable, two fallbacks bound the turn from other facts, each proven on the
text (the span's text in the full rendering is the turn's text in the rendering it was found in, and holds
the reply):
(a) a closing the template writes only at the end of a conversation: Phi-3 ends the rendering with
    ``{{ eos_token }}`` when there is no generation prompt, so messages[:i+1] ends ``reply<|end|>\\n<|endoftext|>``
    where the full text goes on ``reply<|end|>\\n<|user|>``. The turn ends where the two agree, once only
    special tokens and whitespace are left of messages[:i+1]'s rendering.
(b) a moved system message: Mistral v0.3 writes it into the user turn that ends the conversation, so it is in
    the rendering of messages[:i] + generation prompt and dropped from the full one (ending in an assistant
    turn); others write it into the last user turn. The turns are located in the rendering without the system
    message and carried over to the full one, which must be that text or it with one inserted piece that
    holds the system text, each turn on one side of the piece. (Mistral v0.3 itself thus trains without the
    system message, as ``apply_chat_template`` renders it.)
A template that neither explains (one that drops earlier reasoning or rewrites earlier turns) raises with the
fix, rather than mislabel tokens: use ``{% generation %}`` markers, or loss on everything.
Two renders a reply, each of the conversation so far, is quadratic in the turns; a chat of LINEAR_FROM replies
or more first tries ``_locate_linear``: the messages' places from one render with stand-ins for their contents;
every reply must have the same template text before it and (but the last) after it, and the turn's bounds in
that text come from the prefix renders of three replies, which must agree.
"""

from __future__ import annotations

import logging

from .chat_template import _render
from .formats import FormatError


log = logging.getLogger("chronicals.data")
_warned_dropped_system: set[str] = set()  # chat templates already warned about (once a process each)


def _turn_end(text: str, lo: int, hi: int, specials: tuple[str, ...]) -> int:
    """hi less the whitespace after the span's closing special token (``<|im_end|>\\n`` -> ``<|im_end|>``);
    hi itself when the span does not end in one (a template whose turns end in plain text keeps its ending)."""
    kept = text[lo:hi].rstrip()
    return lo + len(kept) if len(kept) < hi - lo and kept.endswith(specials) else hi


class _Unbounded(Exception):
    """The prefix renderings do not bound assistant message ``index``'s turn in the full rendering."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect the first difference
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def _closing_dropped(upto: str, full: str, lo: int, specials: tuple[str, ...]) -> int | None:
    """The turn's end when rendering messages[:i+1] (upto) closes the conversation with special tokens that the
    full rendering does not have there (Phi-3 writes ``{{ eos_token }}`` only without the generation prompt:
    upto ends ``reply<|end|>\\n<|endoftext|>``, full goes on ``reply<|end|>\\n<|user|>``). The end is the last
    position p such that full[:p] == upto[:p] (the common prefix) and upto[p:] is only special tokens and
    whitespace; None when no such p is at or past lo (the turn itself differs: not this case). p == lo is an empty
    reply of a template whose turns close with no text (GLM-like, eos only at the conversation's end): it trains
    nothing, and the conversation's other replies train (it was refused as "not prefix-stable", and under
    on_error=skip the whole conversation was lost)."""
    agree = lo + _common_prefix_len(upto[lo:], full[lo:])
    q = len(upto)  # drop upto's closing specials one at a time until what is left agrees with full
    ordered = sorted(specials, key=len, reverse=True)
    while q > agree:
        if upto[q - 1].isspace():
            q -= 1
            continue
        s = next((s for s in ordered if upto.endswith(s, lo, q)), None)
        if s is None:
            return None  # upto and full differ in the turn's own text
        q -= len(s)
    return q if q >= lo else None


def _turn_span(tokenizer, messages, i: int, full: str, specials, prev=None) -> tuple[int, int, bool, int]:
    """(lo, hi, strict, end): assistant message i's reply and end-of-turn text as a character span of full; strict
    when messages[:i+1] renders to a prefix of full; end: where the turn's text ends before ``_turn_end`` trims the
    whitespace after its closing special token. ``prev``: this function's answer for message i-1 when that one is
    a reply too (``_after_reply``). Raises _Unbounded when the renderings cannot bound it."""
    try:
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else _opening(tokenizer, messages)
    except Exception as e:  # a template may not render an empty prefix (assistant first)
        raise FormatError(f"the chat template cannot render the messages before assistant message {i} "
                          f"({type(e).__name__}: {e}); expected a user or system message first") from None
    upto = _render(tokenizer, messages[:i + 1])
    moved = prev is not None and not full.startswith(before)
    if moved:  # the reply before this one renders otherwise when last: take full's own text before this turn
        at = _after_reply(tokenizer, messages, i, before, full, prev)
        if at is None:
            raise _Unbounded(i)
        if upto.startswith(before):
            upto = full[:at] + upto[len(before):]
        before = full[:at]
    lo = len(before)
    if full.startswith(upto) and upto.startswith(before):
        hi = _turn_end(full, lo, len(upto), specials)
        if i == len(messages) - 1 and _closes_twice(full, lo, hi, specials):
            hi = _where_it_goes_on(tokenizer, messages, full, lo, hi, specials)
        return lo, hi, not moved, len(upto)
    if not (upto.startswith(before) and full.startswith(before)):
        raise _Unbounded(i)
    hi = _closing_dropped(upto, full, lo, specials)
    if hi is None:
        hi = _opened_differently(upto, full, lo)
    if hi is None:
        raise _Unbounded(i)
    return lo, _turn_end(full, lo, hi, specials), False, hi


def _after_reply(tokenizer, messages, i: int, before: str, full: str, prev) -> int | None:
    """Where assistant message i's turn opens in full when message i-1 is a reply that renders otherwise as the
    last message: Qwen3 writes its think block into the last reply only, so in ``[user, a, b]`` the rendering of
    the first two messages (before b's turn) holds a block before "a" that full does not. ``before`` is that
    rendering (R) and the generation prompt (G); R is full's text up to a's turn (``prev``: its lo and end in
    full) and something more inside that turn, ending with the turn's text as full has it; b's turn opens after
    that text and G in full. None when any of these does not hold."""
    lo, _, _, end = prev
    rest = _render(tokenizer, messages[:i])
    turn = full[lo:end]
    if not (turn and before.startswith(rest) and rest.startswith(full[:lo]) and rest.endswith(turn)):
        return None
    g = before[len(rest):]
    return end + len(g) if full.startswith(g, end) else None


def _closes_twice(text: str, lo: int, hi: int, specials: tuple[str, ...]) -> bool:
    """The span ends in two special tokens with only whitespace between them (Phi-3's last turn:
    ``reply<|end|>\n<|endoftext|>``), which may be a turn's closing and the conversation's."""
    ordered = sorted(specials, key=len, reverse=True)
    last = next((s for s in ordered if text.endswith(s, lo, hi)), None)
    if last is None:
        return False
    head = text[lo:hi - len(last)].rstrip()
    return head.endswith(specials)


def _where_it_goes_on(tokenizer, messages, full: str, lo: int, hi: int, specials: tuple[str, ...]) -> int:
    """The last reply's end when the template closes the whole conversation after the turn's own closing: Phi-3
    writes ``{{ eos_token }}`` after the last ``<|end|>`` only when no turn follows, so the span held
    ``reply<|end|>\n<|endoftext|>`` and trained two tokens that the earlier replies (ending at ``<|end|>``) and
    the template's own ``{% generation %}`` markers do not. The turn ends where the conversation with one more
    user message departs from it, when only special tokens and whitespace are left after that point (else, a
    reply whose text ends in special-token strings, the span stays)."""
    try:
        more = _render(tokenizer, list(messages) + [{"role": "user", "content": "\ue000"}])
    except Exception:  # a template that refuses the probe (roles must alternate, ...): keep the span
        return hi
    q = _closing_dropped(full[:hi], more, lo, specials)  # full[:q] == more[:q], then specials and whitespace
    if q is None or q >= hi:
        return hi
    end = _turn_end(full, lo, q, specials)
    return end if full[lo:end].endswith(specials) else hi


def _opened_differently(upto: str, full: str, lo: int) -> int | None:
    """The turn's end when rendering messages[:i+1] (upto) opens the turn with text the full rendering does not
    have there: Qwen3 writes ``<think>\n\n</think>\n\n`` (or the reasoning) only into assistant turns after the
    last user message, so an earlier turn, rendered last, gains the block, and in full it has none. upto[lo:] is
    then X + T and full[lo:] starts with T: the end is lo + len(T) for the longest such T (the fewest characters
    dropped), checked by the caller to hold the reply. None when no tail of upto[lo:] starts full[lo:]."""
    turn = upto[lo:]
    if not turn:
        return None
    head = full[lo:lo + 8]
    k = turn.find(head, 1) if head else -1
    while k != -1:
        if full.startswith(turn[k:], lo):
            return lo + len(turn) - k
        k = turn.find(head, k + 1)
    return None


_SENTINEL = "\x00chronicals-reply\x00"


def _opening(tokenizer, messages) -> str:
    """What a conversation that opens with an assistant message (a ShareGPT greeting) renders before that reply:
    transformers refuses to render the empty conversation before it, so the text before a sentinel reply, when
    the real reply's rendering starts with it (a template that writes the reply's text into its header cannot)."""
    text = _render(tokenizer, [messages[0] | {"content": _SENTINEL}])
    at = text.find(_SENTINEL)
    head = text[:at] if at >= 0 else None
    if head is None or not _render(tokenizer, messages[:1]).startswith(head):
        raise ValueError("the reply's rendering does not start with the same text whatever the reply")
    return head


def _holds_reply(full: str, span, message) -> bool:
    """A located span holds the message's text (stripped: Mistral writes ``content|trim``); a check on the
    fallbacks, which bound a turn from fewer facts than the strict test. Reasoning written inline
    (``<think>r</think>a``) counts by the text after it: Qwen3's template takes it out of the reply and drops it
    from replies before the last user message, so such a turn holds ``a`` alone."""
    content = message.get("content")
    if not (isinstance(content, str) and content.strip()):
        return True
    reply = content.split("</think>")[-1].strip()  # the whole content when it has no think block
    return not reply or reply in full[span[0]:span[1]]


def _locate(tokenizer, messages, full: str, train_from: int, specials) -> list[tuple[int, int, int]]:
    """(i, lo, hi) for the assistant turns at index i >= train_from; raises _Unbounded at the first one that the
    prefix renderings do not bound. A conversation of LINEAR_FROM replies or more tries ``_locate_linear`` first."""
    spans = _locate_linear(tokenizer, messages, full, train_from, specials)
    if spans is not None:
        return spans
    spans, prev = [], None  # prev: the span of message i-1 when it is a reply, which bounds a reply right after it
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            prev = None
            continue
        if i < train_from:  # not trained; located only to bound a trained reply right after it
            try:
                ahead = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
                prev = _turn_span(tokenizer, messages, i, full, specials, prev) if ahead else None
            except (_Unbounded, FormatError):
                prev = None
            continue
        lo, hi, strict, end = _turn_span(tokenizer, messages, i, full, specials, prev)
        if not (strict or _holds_reply(full, (lo, hi), m)):
            raise _Unbounded(i)
        spans.append((i, lo, hi))
        prev = (lo, hi, strict, end)
    return spans


# replies from which _locate_linear is tried: prefix renders cost 2 a reply, each of the whole conversation so far
# (quadratic: 500 turns took 3.7 s a record with SmolLM2's template, 11 s with Qwen3's; a chat walk); the shortcut
# costs ~8 renders of the whole conversation, so it pays from a few replies on
LINEAR_FROM = 8
_MARK = "\ue000{}\ue001"  # a message's stand-in (private-use characters, which text rarely holds: checked)


def _placed(full: str, messages, text: str, marks: list[str]) -> tuple[list[tuple[int, int]], list[str]] | None:
    """Where each message's content lies in ``full`` (the real rendering), found from ``text`` (the rendering with
    every content replaced by its mark): the text between the marks is the template's own, and in ``full`` each
    content must be, in turn, exactly one of the content, it stripped, or it stripped at one end (``content|trim``),
    with the template's text around it. -> ((start, end) per message, the template text before each message and
    after the last), or None."""
    segments, at = [], 0
    for mark in marks:
        k = text.find(mark, at)
        if k < 0 or text.count(mark) != 1:
            return None
        segments.append(text[at:k])
        at = k + len(mark)
    segments.append(text[at:])
    if not full.startswith(segments[0]):
        return None
    p, places = len(segments[0]), []
    for m, after in zip(messages, segments[1:]):
        c = m["content"]
        fits = [r for r in dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip())) if full.startswith(r + after, p)]
        if len(fits) != 1:  # none, or whitespace the content and the template's text could share: not decided here
            return None
        places.append((p, p + len(fits[0])))
        p += len(fits[0]) + len(after)
    return (places, segments) if p == len(full) else None


def _locate_linear(tokenizer, messages, full: str, train_from: int, specials) -> list[tuple[int, int, int]] | None:
    """_locate's spans from ~8 renders instead of 2 a reply, for a template that writes every reply alike; None when
    any check fails (the caller then renders the prefixes, as for a short conversation).

    1. Render the conversation with every message's content replaced by a stand-in (``_placed``): each reply's
       place in ``full``, and the template's own text before and after it. Every reply must have the same text
       before it (from the end of the message before), and every reply but the last the same text after it (to the
       next message's content): a reply the template writes with more (its reasoning_content, a name), after
       another kind of message, or next to another reply fails here.
    2. The prefix renders of the first, a middle and the last reply give the turn: the text it holds before the reply
       (Mistral's " ", Qwen3's think block) must be the same for the three and lie in that text before; the text
       after the reply (``<|im_end|>``) the same for the first and middle one and lie in the text after. The last
       reply keeps its own end (Phi-3 closes the conversation after it). Each reply's turn then follows by the same
       arithmetic as the three's."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(turns) < LINEAR_FROM or turns[0] == 0 or "\ue000" in full:
        return None
    if any(not isinstance(m.get("content"), str) or m.get("tool_calls") for m in messages):
        return None
    marks = [_MARK.format(j) for j in range(len(messages))]
    try:
        text = _render(tokenizer, [m | {"content": mark} for m, mark in zip(messages, marks)])
    except Exception:  # a template that refuses the stand-ins: the prefix renders say what it refuses
        return None
    found = _placed(full, messages, text, marks)
    if found is None:
        return None
    places, segments = found
    before = {segments[i] for i in turns}
    after = {segments[i + 1] for i in turns[:-1]}
    if len(before) != 1 or len(after) != 1:
        return None
    before, after = before.pop(), after.pop()
    heads, tails, last = set(), set(), None
    for k in sorted({0, len(turns) // 2, len(turns) - 1}):
        i = turns[k]
        try:
            lo, hi, strict, end = _turn_span(tokenizer, messages, i, full, specials)
        except (_Unbounded, FormatError):
            return None
        rlo, rhi = places[i]
        if not (strict or _holds_reply(full, (lo, hi), messages[i])) or not (rlo - len(before) <= lo <= rlo <= rhi <= hi):
            return None
        heads.add(full[lo:rlo])
        if k == len(turns) - 1:
            last = (lo, hi)
        elif end - rhi <= len(after):
            tails.add(full[rhi:end])  # untrimmed: whether the whitespace after it is trained is each reply's own
        else:
            return None
    if len(heads) != 1 or len(tails) != 1:
        return None
    head, tail = len(heads.pop()), len(tails.pop())
    spans = [(i, places[i][0] - head, _turn_end(full, places[i][0] - head, places[i][1] + tail, specials))
             for i in turns[:-1]] + [(turns[-1], *last)]
    return [s for s in spans if s[0] >= train_from]


def _insertion_points(short: str, long: str) -> range:
    """The positions at with long == short[:at] + X + short[at:] (len(X) = len(long) - len(short) >= 0): X
    slides over text that short repeats on either side of it, so at is a range; empty when long is not short
    with one piece inserted."""
    if len(long) < len(short):
        return range(0)
    last = _common_prefix_len(short, long)  # long[:at] == short[:at]
    first = len(short) - _common_prefix_len(short[::-1], long[::-1])  # long ends with short[at:]
    return range(first, last + 1)


def _without_system(tokenizer, messages, full: str, train_from: int, specials) -> list[tuple[int, int]] | None:
    """Spans for a template that moves the system message. Mistral v0.3 writes it into the user turn that is
    the conversation's last message (``loop.last``): it is in the rendering of messages[:i] + generation prompt
    and missing from the full one, which ends in an assistant turn; others write it into the last user turn,
    after earlier replies. The turns are located in the rendering without the system message (prefix-stable
    for these templates), then carried over to full, which must be that rendering (the system message dropped)
    or it with one piece inserted that holds the system text. Each span must lie on one side of every place
    the piece can go (it slides over repeated text), so the carried span holds the same text. None otherwise."""
    if not messages or messages[0]["role"] != "system":
        return None
    rest = messages[1:]
    try:
        rest_full = _render(tokenizer, rest)
        located = _locate(tokenizer, rest, rest_full, max(train_from - 1, 0), specials)
    except (FormatError, _Unbounded):
        return None
    system = messages[0].get("content")
    system = system.strip() if isinstance(system, str) else ""
    width = len(full) - len(rest_full)
    if width == 0:
        places = [0] if full == rest_full else []  # dropped: nothing moves
        if places and system:
            _warn_dropped_system(tokenizer)
    else:  # the inserted piece holds the system text; a blank system message (" "): the piece is only whitespace
        places = [at for at in _insertion_points(rest_full, full)
                  if (system in full[at:at + width] if system else not full[at:at + width].strip())]
    if not places:
        return None
    spans = []
    for i, lo, hi in located:
        if width and places[0] < hi and lo < places[-1]:
            return None  # the system text may sit before or after (part of) this turn
        span = (lo + width, hi + width) if width and lo >= places[-1] else (lo, hi)
        if not _holds_reply(full, span, rest[i]):
            return None
        spans.append(span)
    return spans


def _warn_dropped_system(tokenizer) -> None:
    """Once per template: its rendering of a conversation that ends in a reply has no system message (Mistral
    v0.3 writes it only into a final user turn), so training never sees the system prompt."""
    key = str(getattr(tokenizer, "chat_template", None))
    if key not in _warned_dropped_system:
        _warned_dropped_system.add(key)
        log.warning("the chat template leaves the system message out of conversations that end in an assistant "
                    "reply (as Mistral v0.3's writes it only into a final user turn): these examples train without "
                    "their system prompt, exactly as apply_chat_template renders them. To train with it, prepend "
                    "it to the first user message in the data, or use a template that keeps it")
