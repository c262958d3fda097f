"""``counted``: the noun of a count in a message is singular for 1 only ("1 documents", "at least 1 tokens" and
"1 timed steps" reached users before it)."""
from chronicals._words import counted


def test_counted_is_singular_for_one_and_plural_otherwise():
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert [counted(n, "batch", "batches") for n in (1, 3)] == ["1 batch", "3 batches"]
    assert counted(-1, "token") == "-1 tokens"

