"""Dataset formats: detection and normalization of one record to an ``Example``.

    text               {"text": "..."}                                       loss on every token
    alpaca             {"instruction": ..., "input": optional, "output": ...} loss on the output
    chat               {"messages": [{"role": "user", "content": ...}, ...]}  loss on assistant turns
    sharegpt           {"conversations": [{"from": "human", "value": ...}]}  human->user, gpt->assistant
    prompt_completion  {"prompt": ..., "completion": ...}                    loss on the completion
                       (prompt/completion given as message lists are conversational: rendered as chat)

Alpaca records become a two-turn chat (user: instruction + blank line + input; assistant: output)
when the tokenizer has a chat template; without one they use the classic Alpaca prompt (load_dataset logs
that once per set).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass

from .._jsonio import json_error

FORMATS = ("text", "alpaca", "chat", "sharegpt", "prompt_completion")
EXPECTED = "text | messages | conversations | instruction+output | prompt+completion"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system", "tool": "tool", "function": "tool",
                  "observation": "tool", "function_call": "assistant"}
# roles chat templates render: the common four, OpenAI's "developer", Llama 3.1's "ipython" (tool output) and the
# older "function"; anything else ("robot", a typo) is refused rather than rendered as an unknown header
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
ALPACA_PROMPT = ("Below is an instruction that describes a task{ctx}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")


@dataclass
class Example:
    """A normalized record: a chat (``messages``) or a prompt + a target text (``prompt`` may be "")."""
    messages: list[dict] | None = None
    prompt: str = ""
    target: str = ""
    train_from: int = 0  # chat: loss on assistant turns from this message index on


class FormatError(ValueError):
    """What is wrong with one record and what was expected (the reader adds ``file:line``)."""


def detect_format(record: dict, from_csv: bool = False) -> str:
    """The format of a record from its keys (see the module docstring). Keys whose value is null count only when
    the others name no format: a parquet or arrow file of mixed records fills every record's missing columns with
    nulls ({"text": "hi", "messages": null} is text), and {"text": null} is text, with a null field to report.
    ``from_csv``: a CSV row, whose missing fields are empty cells (pandas' to_csv of mixed records), so an empty
    cell counts as null: the row ",,Paris." under instruction,output,text is text, not an empty alpaca record."""
    present = {k for k, v in record.items() if v is not None and not (from_csv and v == "")}
    fmt = _format_of(present) or _format_of(set(record), prefer=present)
    if fmt is None:
        raise FormatError(f"cannot tell the format from fields {sorted(record)}; expected one of {EXPECTED}"
                          f"{_half_pair(present or set(record))}")
    return fmt


def _half_pair(keys: set) -> str:
    """What a record with one field of a two-field format lacks: an alpaca record without its ``output`` read as
    "cannot tell the format" alone, which named no missing field."""
    for fmt, pair in (("alpaca", ("instruction", "output")), ("prompt/completion", ("prompt", "completion"))):
        have = [k for k in pair if k in keys]
        if len(have) == 1:
            lacking = next(k for k in pair if k not in keys)
            return f" (it has {have[0]!r} but no {lacking!r}: {fmt} records need both)"
    return ""


_FIELDS = (("chat", {"messages"}), ("sharegpt", {"conversations"}), ("alpaca", {"instruction", "output"}),
           ("prompt_completion", {"prompt", "completion"}), ("text", {"text"}))  # in order of precedence


def _format_of(keys: set, prefer: set = frozenset()) -> str | None:
    """The first format whose fields are all in ``keys``, preferring one with a field in ``prefer`` (the fields that
    hold a value): a prompt beside a null completion and the null columns of other records' formats (a mixed
    parquet file, pandas' to_json) is a prompt/completion record that lacks its completion, not a chat record whose
    'messages' is null."""
    fits = [(fmt, need) for fmt, need in _FIELDS if need <= keys]
    return next((fmt for fmt, need in fits if need & prefer), fits[0][0] if fits else None)


def _field(record: dict, name: str, fmt: str, kinds=(str,), from_csv: bool = False):
    if name not in record:
        raise FormatError(f"missing field {name!r} (format {fmt} expects {_expects(fmt)}){_other_format(record, fmt)}")
    if record[name] is None:
        raise FormatError(f"field {name!r} is null (format {fmt} expects {_expects(fmt)})")
    value = record[name]
    if from_csv and list in kinds and isinstance(value, str):
        value = _csv_messages(value, name, text_ok=str in kinds)
    if not isinstance(value, kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise FormatError(f"field {name!r} is {a_type(value)}, expected {want}")
    return check_text(value, f"field {name!r}") if isinstance(value, str) else value


def _other_format(record: dict, fmt: str) -> str:
    """Where a record lacking ``fmt``'s field has another format's fields: the fix is data.format, not the data
    (data.format=text over a chat file named the missing 'text' and pointed at data.on_error=skip, which then
    dropped every record; a user walk)."""
    other = _format_of({k for k, v in record.items() if v is not None})
    if other is None or other == fmt:
        return ""
    return f"; its fields are {other} ones: set data.format=auto (or {other})"


def _csv_messages(value: str, name: str, text_ok: bool):
    """A CSV cell where a message list may stand: a cell cannot hold a list, so the list is JSON text. Decoded
    only to a list of message dicts; a cell that may be text (prompt, completion) stays text otherwise, so
    "[INST] hi [/INST]" or " [3, 2, 1]" is a prompt / completion, not a broken message list."""
    if text_ok and not value.lstrip().startswith("["):
        return value
    try:
        decoded = json.loads(value)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, or a number of > 4300 digits
        if text_ok:
            return value
        why = json_error(e) if isinstance(e, json.JSONDecodeError) else "nested too deeply" if isinstance(
            e, RecursionError) else "a number of more than 4300 digits"
        raise FormatError(f"field {name!r} is not valid JSON ({why}); expected a list of messages (a CSV cell "
                          "holds them as JSON text)") from None
    is_messages = (isinstance(decoded, list) and decoded
                   and all(isinstance(m, dict) and (not text_ok or "role" in m) for m in decoded))
    if is_messages:
        return decoded
    if text_ok:
        return value
    raise FormatError(f"field {name!r} is JSON text of {a_type(decoded)}, expected a list of messages "
                      "(a CSV cell holds them as JSON text)")


def check_text(value: str, name: str) -> str:
    """``value`` if it encodes as UTF-8; a lone surrogate (JSON "\\ud800" without its pair) does not, and the
    tokenizer would raise a TypeError about its input type far from the record."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FormatError(f"{name} is not valid Unicode (lone surrogate {value[e.start]!r} at character "
                          f"{e.start}); expected text (a \\ud800-\\udfff escape must be half of a pair)") from None
    return value


def _expects(fmt: str) -> str:
    return {"text": "'text'", "alpaca": "'instruction', optional 'input', 'output'",
            "chat": "'messages': [{'role', 'content'}, ...]",
            "sharegpt": "'conversations': [{'from', 'value'}, ...]",
            "prompt_completion": "'prompt' and 'completion'"}[fmt]


def _messages(items: list, role_key: str, content_key: str, roles: dict | None, field: str) -> list[dict]:
    """Messages as the chat template gets them: role and content under those names, every other key of the
    message (OpenAI's tool_calls, tool_call_id, name, ...) passed through as it is, as apply_chat_template does.
    A key whose value is null is dropped: parquet struct columns fill absent keys with null, and templates test
    ``is defined``. Content may be null or absent on a message with tool_calls (OpenAI's export format), or a list
    of OpenAI's text parts (joined into one string: ``_text_parts``)."""
    if not items:
        raise FormatError(f"field {field!r} is an empty list; expected at least one message")
    out = []
    for j, m in enumerate(items):
        if not isinstance(m, dict):
            raise FormatError(f"{field}[{j}] is {a_type(m)}, expected {{{role_key!r}, {content_key!r}}}")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and not (isinstance(tool_calls, list) and all(isinstance(t, dict)
                                                                                for t in tool_calls)):
            raise FormatError(f"{field}[{j}].tool_calls is {_short(tool_calls)}; expected a list of "
                              "{'type': 'function', 'function': {'name', 'arguments'}} objects (or null)")
        for key in (role_key, content_key):
            if key not in m and not (key == content_key and tool_calls):
                raise FormatError(f"{field}[{j}] has no {key!r}; expected {{{role_key!r}, {content_key!r}}}"
                                  f"{_other_style(m, field)}")
        role, content = m[role_key], m.get(content_key)
        if isinstance(content, list):  # OpenAI's content parts: [{"type": "text", "text": ...}, ...]
            content = _text_parts(content, f"{field}[{j}].{content_key}")
        if isinstance(content, str):
            check_text(content, f"{field}[{j}].{content_key}")
        elif not (content is None and tool_calls):
            raise FormatError(f"{field}[{j}].{content_key} is {a_type(content)}, expected a string or a "
                              "list of {'type': 'text', 'text': ...} parts (null only beside tool_calls)")
        if roles is not None:
            if not isinstance(role, str) or role not in roles:  # a list or dict role is unhashable
                raise FormatError(f"{field}[{j}].{role_key} is {role!r}; expected one of {sorted(roles)}"
                                  f"{_did_you_mean(role, sorted(roles))}")
            role = roles[role]
        elif role not in CHAT_ROLES:
            raise FormatError(f"{field}[{j}].{role_key} is {role!r}; expected one of {', '.join(CHAT_ROLES)}"
                              f"{_did_you_mean(role, CHAT_ROLES)}")
        msg = {}  # in the record's key order; null content stays null, as apply_chat_template passes it
        for k, v in m.items():
            if k == role_key:
                msg["role"] = role
            elif k == content_key:
                msg["content"] = content
            elif v is not None and k not in ("role", "content"):  # sharegpt: from/value are role/content
                msg[k] = _checked_strings(v, f"{field}[{j}].{k}")
        out.append(msg)
    return out


def _other_style(message: dict, field: str) -> str:
    """The fix for a message written in the other chat style than its field's: OpenAI's role/content under ShareGPT's
    'conversations' ("conversations[0] has no 'from'" named no cause), or ShareGPT's from/value under 'messages'."""
    if field == "conversations" and "role" in message:
        return "; these are OpenAI-style messages ({'role', 'content'}): name the field 'messages'"
    if field == "messages" and "from" in message:
        return "; these are ShareGPT-style turns ({'from', 'value'}): name the field 'conversations'"
    return ""


def _did_you_mean(role, roles) -> str:
    """"; did you mean 'assistant'?" for a role that is one of ``roles`` but for case and spaces ('Assistant') or
    close to one ('assitant', difflib's ratio >= 0.6), else ""."""
    if not isinstance(role, str):
        return ""
    key = role.strip().lower()
    near = [r for r in roles if r == key] or difflib.get_close_matches(key, roles, n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


def _checked_strings(value, name: str, depth: int = 0):
    """``value`` (a message's tool_calls, name, reasoning_content, ...) after ``check_text`` on every string in it,
    named by its path (messages[1].tool_calls[0].function.arguments): the template renders them, and a lone
    surrogate there made the tokenizer raise a TypeError that stopped the whole load, even with on_error=skip.
    Dict keys too: templates print an arguments object's keys (Qwen3-Coder's ``<parameter={{ k }}>``).
    Stops at depth 32: JSON deeper than that is no message field a template renders."""
    if isinstance(value, str):
        check_text(value, name)
    elif depth < 32 and isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                check_text(k, f"{name} key {ascii(k)}")  # ascii: the name itself must print
            _checked_strings(v, f"{name}.{k}", depth + 1)
    elif depth < 32 and isinstance(value, list):
        for i, v in enumerate(value):
            _checked_strings(v, f"{name}[{i}]", depth + 1)
    return value


def _text_parts(parts: list, field: str) -> str:
    """OpenAI-style list content as the one string a text model's chat template takes: the text parts joined by
    newlines (as vLLM joins them for such templates). A part that is not text (an image, audio) is refused by name:
    a text model cannot be trained on it."""
    if not parts:
        raise FormatError(f"{field} is an empty list; expected a string or a list of {{'type': 'text', 'text': ...}} "
                          "parts")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and not isinstance(part.get("text"), str):  # a text part whose text is missing or not one
            what = "no 'text'" if "text" not in part else f"'text' {_short(part['text'])}, not a string"
            raise FormatError(f"{field}[{k}] is a part of type 'text' with {what}; give its text as "
                              "{'type': 'text', 'text': '...'}")
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else _short(part)
            raise FormatError(f"{field}[{k}] is {what}; a text model takes only {{'type': 'text', 'text': ...}} "
                              "parts: remove the others (images, audio), or give the content as a string")
        texts.append(check_text(part["text"], f"{field}[{k}].text"))
    return "\n".join(texts)


def a_type(value) -> str:
    """``value``'s type for a message, with its article: "an int", "a list"; JSON's "null" for None."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _short(value) -> str:
    text = repr(value)
    return f"{a_type(value)} ({text[:40] + '...' if len(text) > 40 else text})"


def empty_target(ex: Example) -> bool:
    """True when a text that would carry loss (with loss on assistant turns / completion) is blank, so its turn
    trains the end-of-turn token alone, "answer with nothing": usually a gap in the data, not a wanted example. In
    a chat, any blank reply counts, also beside others (one in a five-turn chat trains that as much as a lone one)."""
    if ex.messages is None:
        return not ex.target.strip()
    replies = [(m.get("content") or "").strip() or m.get("tool_calls") for i, m in enumerate(ex.messages)
               if m["role"] == "assistant" and i >= ex.train_from]  # a tool call is a reply
    return not all(replies)


def to_example(record: dict, fmt: str, has_chat_template: bool, from_csv: bool = False) -> Example:
    """One record of format ``fmt`` -> Example; FormatError says what is wrong and what was expected.

    ``from_csv``: the record is a CSV row, whose cells hold message lists (messages, conversations,
    conversational prompt/completion) as JSON text; in other files a string is always text."""
    if fmt == "text":
        return Example(target=_field(record, "text", fmt))
    if fmt == "chat":
        return Example(messages=_messages(_field(record, "messages", fmt, (list,), from_csv), "role", "content", None,
                                          "messages"))
    if fmt == "sharegpt":
        return Example(messages=_messages(_field(record, "conversations", fmt, (list,), from_csv), "from", "value",
                                          SHAREGPT_ROLES, "conversations"))
    if fmt == "alpaca":
        instruction, output = _field(record, "instruction", fmt), _field(record, "output", fmt)
        extra = record.get("input")
        if extra is None:  # absent or null: no input (0, [] or {} are errors, as 5 is)
            extra = ""
        if not isinstance(extra, str):
            raise FormatError(f"field 'input' is {a_type(extra)}, expected a string (or null, or no 'input')")
        check_text(extra, "field 'input'")
        if has_chat_template:
            user = instruction + ("\n\n" + extra if extra else "")
            return Example(messages=[{"role": "user", "content": user},
                                     {"role": "assistant", "content": output}])
        prompt = ALPACA_PROMPT.format(ctx=", paired with an input that provides further context" if extra else "",
                                      instruction=instruction, input=f"### Input:\n{extra}\n\n" if extra else "")
        return Example(prompt=prompt, target=output)
    if fmt == "prompt_completion":
        prompt = _field(record, "prompt", fmt, (str, list), from_csv)
        completion = _field(record, "completion", fmt, (str, list), from_csv)
        if isinstance(prompt, list) or isinstance(completion, list):  # conversational prompt/completion
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise FormatError("'prompt' and 'completion' mix a string and a message list; expected both "
                                  "strings or both lists of {'role', 'content'}")
            msgs = _messages(prompt + completion, "role", "content", None, "prompt+completion")
            return Example(messages=msgs, train_from=len(prompt))
        return Example(prompt=prompt, target=completion)
    raise ValueError(f"format={fmt!r} is not one of {('auto',) + FORMATS}")
