"""Rendering a chat with the tokenizer's chat template: whether the template has ``{% generation %}`` markers,
``apply_chat_template`` with a pinned date (``TEMPLATE_DATE``) whose failures on a conversation are bad records
(FormatError), and the checks that a template is there and renders the conversation's tool calls.
"""

from __future__ import annotations

import logging
import re
import sys

from .formats import FormatError


log = logging.getLogger("chronicals.data")

# "{% generation %}" with any Jinja whitespace control: "{%- generation -%}", "{%generation%}", "{%+ generation %}"
_GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


def has_generation_markers(tokenizer) -> bool:
    """Whether the template apply_chat_template renders (no tools passed) has ``{% generation %}`` markers. A
    tokenizer saved with more than one template (``additional_chat_templates/``, e.g. "tool_use") holds them as a
    dict, of which apply_chat_template renders "default"."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default") or ""
    return isinstance(template, str) and _GENERATION_TAG.search(template) is not None


# The date Llama-3.x templates write into the system header ("Today Date: ..."): their own fallback when the
# renderer has no strftime_now. Left to the template, it is today's date, so the same data tokenized on another
# day gave other ids (a resume with data.cache_dir=none refused as "data changed"), and a record whose prefixes
# rendered either side of midnight lost its turn spans.
TEMPLATE_DATE = "26 Jul 2024"
_warned_dated: set[str] = set()  # chat templates already warned about (once a process each)


def _warn_dated(tokenizer) -> None:
    """Warn once per template that calls strftime_now with no date_string to pin (Mistral-Small-3's
    ``strftime_now("%Y-%m-%d")``): transformers gives templates no way to fix that date."""
    t = tokenizer.chat_template
    text = "\n".join(t.values()) if isinstance(t, dict) else str(t)
    if "strftime_now" in text and "date_string" not in text and text not in _warned_dated:
        _warned_dated.add(text)
        log.warning("the chat template writes today's date (strftime_now) into the conversation, so the "
                    "same data tokenizes to other ids on another day; the tokenization cache (data.cache_dir, on "
                    "by default) keeps the first day's ids, so keep it on to resume a run on a later day")


def _apply(tokenizer, messages, **kw):
    """``tokenizer.apply_chat_template`` with ``date_string=TEMPLATE_DATE``; a template that refuses the
    conversation (``raise_exception``: Mistral's "Conversation roles must alternate", Gemma's "System role not
    supported") or fails on it (``None + str``) raises FormatError, a bad record (file:line, skipped under
    on_error=skip)."""
    _warn_dated(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, date_string=TEMPLATE_DATE, **kw)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # what a template expression raises
        raise FormatError(f"the chat template failed on this conversation ({type(e).__name__}: {e})") from None
    except Exception as e:
        if is_template_error(e):  # raise_exception(...), undefined values
            raise FormatError(f"the chat template refused this conversation: {e}") from None
        raise


def is_template_error(e: BaseException) -> bool:
    """Whether ``e`` is jinja2's TemplateError: a chat template's ``raise_exception(...)`` (Mistral's "Conversation
    roles must alternate") or an undefined value. jinja2 is transformers' (not our dependency), imported once a
    template rendered."""
    jinja2 = sys.modules.get("jinja2")
    return jinja2 is not None and isinstance(e, jinja2.TemplateError)


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return _apply(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _check_tool_calls(tokenizer, messages: list[dict], full: str | None = None) -> None:
    """FormatError (a bad record) when a message's tool_calls are not in the rendering ``full`` (rendered here when
    None and some message has tool_calls): SmolLM2's template drops them, so an assistant turn of only a tool
    call trained `<|im_end|>` alone, teaching the model to end its turn at once, without a word. Checked by each
    call's function name (a template may reformat the arguments), which the rendering must hold more often than
    the rendering without the calls does (``_without_calls``)."""
    names = [(j, (call.get("function") if isinstance(call.get("function"), dict) else call).get("name"))
             for j, m in enumerate(messages) for call in (m.get("tool_calls") or ())]
    names = [(j, n) for j, n in names if isinstance(n, str) and n]
    if not names:
        return
    refused = None
    if full is None:
        full, refused = _render_calls(tokenizer, messages)
    bare = _without_calls(tokenizer, messages)
    for j, name in names:
        if full.count(name) <= bare.count(name):
            raise FormatError(f"message {j} calls tool {name!r}, but the chat template does not render tool_calls "
                              "(the call would be left out and the turn trained as an empty reply); use a model "
                              "whose template renders tool calls (Qwen2.5's, Llama 3.1's), or write the call into "
                              "the message's content")
    if refused is not None:
        raise refused


def _without_calls(tokenizer, messages: list[dict]) -> str:
    """The rendering of ``messages`` without their tool_calls (null content as ""), or "" when the template refuses
    it: a call's name the template writes anyway is no proof that it renders the call (a tool 'f' was "found" in
    SmolLM2's default system prompt, "... trained by Hugging Face"), so the rendering must hold it more often."""
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} | ({"content": ""} if m.get("content") is None else {})
            for m in messages]
    try:
        return _render(tokenizer, bare)
    except FormatError:
        return ""


def _render_calls(tokenizer, messages: list[dict]) -> tuple[str, FormatError | None]:
    """(the rendering to look for the tool calls in, the template's error on ``messages`` or None). OpenAI's null
    content beside tool_calls fails a template that reads every message's content (SmolLM2's ``message['content'] +
    ...``: "'dict object' has no attribute 'content'"), which hid what "" content said, that the template drops the
    calls; such messages are rendered with "" content for the check, and the error, when the calls are there, says
    that fix."""
    try:
        return _render(tokenizer, messages), None
    except FormatError as e:
        nulls = [j for j, m in enumerate(messages) if m.get("content") is None and m.get("tool_calls")]
        if not nulls:
            raise
        blank = [m | {"content": ""} if j in nulls else m for j, m in enumerate(messages)]
        try:
            full = _render(tokenizer, blank)
        except FormatError:
            raise e from None
        return full, FormatError(f"{e}; message {nulls[0]} has null content beside its tool_calls, which this chat "
                                 "template cannot render: give it \"content\": \"\"")


def _need_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise FormatError("chat data needs a tokenizer with a chat template (tokenizer.chat_template is None); "
                          "set one, or convert the data to prompt/completion")
