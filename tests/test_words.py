"""``counted``: the noun of a count in a message is singular for 1 only ("1 documents", "at least 1 tokens" and
"1 timed steps" reached users before it)."""
from chronicals._words import counted


def test_counted_is_singular_for_one_and_plural_otherwise():
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert [counted(n, "batch", "batches") for n in (1, 3)] == ["1 batch", "3 batches"]
    assert counted(-1, "token") == "-1 tokens"


def test_the_data_summary_counts_files_records_and_files_past_eight_in_both_numbers():
    """The summary line of what was read: "1 file ..., 1 record" and, past eight files listed, "and 1 more file"."""
    from chronicals.data.dataset import _summary_line

    assert _summary_line("train", ["a.jsonl"], [1], ["chat"], "auto") == "train: 1 file (a.jsonl), 1 record; " \
                                                                          "format auto -> chat"
    files = [f"d/{i}.jsonl" for i in range(9)]
    line = _summary_line("train", files, [2] * 9, ["chat", "text"] * 4 + ["chat"], "auto")
    assert line.startswith("train: 9 files (") and ", 18 records; format auto -> 0.jsonl: chat" in line, line
    assert line.endswith("; 7.jsonl: text; and 1 more file"), line
    line = _summary_line("train", files + ["d/9.jsonl"], [2] * 10, ["chat", "text"] * 5, "auto")
    assert line.endswith("; and 2 more files"), line
