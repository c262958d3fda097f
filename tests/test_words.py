"""``counted``: the noun of a count in a message is singular for 1 only ("1 documents", "at least 1 tokens" and
"1 timed steps" reached users before it)."""
from chronicals._words import counted, size_text


def test_counted_is_singular_for_one_and_plural_otherwise():
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert [counted(n, "batch", "batches") for n in (1, 3)] == ["1 batch", "3 batches"]
    assert counted(-1, "token") == "-1 tokens"



def test_size_text_picks_the_unit_that_shows_the_size():
    """A 22 KB temporary directory was "(0.0 MB)" in the message that removed it."""
    assert [size_text(n) for n in (0, 512, 22_000, 1_500_000, 540_000_000, 2_345_000_000)] == [
        "0 B", "512 B", "22 KB", "1.5 MB", "540 MB", "2.35 GB"]
