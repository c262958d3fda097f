"""Counts in messages: ``counted(1, "step")`` is "1 step", ``counted(2, "step")`` "2 steps" ("1 documents" and
"at least 1 tokens" reached users), and sizes: ``size_text(22_000)`` is "22 KB" ("0.0 MB" reached users). Imports
nothing of ours, so every layer can use it (as ``_jsonio``)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``plural``, default noun + "s") unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def size_text(nbytes: float) -> str:
    """A size in bytes in the unit that shows it: "512 B", "22 KB", "3.4 MB", "1.25 GB" (decimal units, as ``du -h
    --si``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{int(nbytes)} B"
