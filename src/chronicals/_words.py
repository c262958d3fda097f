"""Counts in messages: ``counted(1, "step")`` is "1 step", ``counted(2, "step")`` "2 steps" ("1 documents" and
"at least 1 tokens" reached users). Imports nothing of ours, so every layer can use it (as ``_jsonio``)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``plural``, default noun + "s") unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
