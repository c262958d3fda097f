"""What load_dataset tells the user: files and formats read, empty targets, examples truncated away."""

import json
import logging

import pytest

from chronicals.data import load_dataset
from chronicals.data.reporting import _summary_line
from chronicals.data.files import resolve_files


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.levelno >= level and r.name == "chronicals.data"]


def test_directories_recurse_skip_hidden_and_take_upper_case(tmp_path):
    d = tmp_path / "d"
    a = write(d / "a.jsonl", [{"text": "a"}])
    up = write(d / "B.JSONL", [{"text": "b"}])
    sub = write(d / "sub" / "c.json", [{"text": "c"}])
    deeper = write(d / "sub" / "z" / "e.csv", [])
    write(d / ".~lock.a.jsonl#", [])
    write(d / ".hidden" / "x.jsonl", [{"text": "x"}])
    write(d / ".x.jsonl", [{"text": "x"}])
    (d / "notes.txt").write_text("not data")
    assert resolve_files(d) == sorted([a, up, sub, deeper])
    assert resolve_files(up) == [up]
    only_sub = tmp_path / "o"
    f = write(only_sub / "nested" / "sub" / "a.jsonl", [{"text": "a"}])
    assert resolve_files(only_sub) == [f]


def test_files_and_formats_are_logged_once(tokenizer, tmp_path, caplog):
    d = tmp_path / "d"
    write(d / "a.jsonl", [{"instruction": "i", "output": "o"}] * 2)
    write(d / "b.jsonl", [{"text": "t"}, {"messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "a"}]}])
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        load_dataset(d, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    info = [m for m in messages(caplog) if m.startswith("the dataset: ")]
    assert len(info) == 1 and "2 files (" in info[0] and "a.jsonl: alpaca" in info[0], info
    assert "b.jsonl: mixed: 1 text, 1 chat" in info[0], info
    warned = messages(caplog, logging.WARNING)
    assert len(warned) == 1 and "b.jsonl mixes record formats (1 text, 1 chat)" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chronicals.data"):  # from the cache: the same line and warning
        load_dataset(d, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    assert [m for m in messages(caplog) if m.startswith("the dataset: ")] == info
    assert messages(caplog, logging.WARNING) == warned  # a cache hit said nothing


def test_a_mixed_file_lists_its_most_common_format_first_and_the_callers_option(tokenizer, tmp_path, caplog):
    """"mixed: 2 chat, 1 text" leads with the format most of the file's records have, whatever comes first in it:
    the one or two odd records (often a typo'd field) read as the exception they are. The fix names the format
    option as the caller calls it, when tokenizing and on a cache hit."""
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    p = write(tmp_path / "m.jsonl", [{"text": "t"}, chat, chat])
    for _ in ("tokenized", "cache hit"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.data"):
            ds = load_dataset(p, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache",
                              option_names={"format": "data.format"})
        assert ds.file_formats == ["mixed: 2 chat, 1 text"]
        (warned,) = messages(caplog, logging.WARNING)
        assert f"{p} mixes record formats (2 chat, 1 text)" in warned, warned
        assert "(data.format=FORMAT insists on one)" in warned, warned


def test_empty_targets_are_counted_and_warned(tokenizer, tmp_path, caplog):
    p = write(tmp_path / "e.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
        {"instruction": "i", "output": ""}, {"prompt": "p", "completion": "ok"},
        # one blank reply among others: that turn trains "answer nothing" as much as a lone blank one (a chat walk)
        {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
                      {"role": "user", "content": "And of Spain?"}, {"role": "assistant", "content": ""}]}])
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=64)
    assert ds.stats.empty_targets == 4 and len(ds) == 5
    warned = [m for m in messages(caplog, logging.WARNING) if "empty assistant reply" in m]
    assert len(warned) == 1 and "4 examples" in warned[0] and f"first: {p}:1" in warned[0], warned
    assert "its turn trains the end-of-turn token alone" in warned[0]


def test_truncated_to_no_loss_tokens_is_reported_as_dropped(tokenizer, tmp_path, caplog):
    """An example truncated to no loss token is said as that one cause; the "N without loss tokens" part counts only
    the drops truncation did not cause, so it is left out here (it said "0 without loss tokens" beside it)."""
    long_turn = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    p = write(tmp_path / "t.jsonl", [long_turn, short])
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=64)
    assert (len(ds), ds.stats.truncated, ds.stats.truncated_no_loss) == (1, 1, 1)
    warned = messages(caplog, logging.WARNING)
    assert len(warned) == 1 and f"1 truncated to no loss tokens (dropped; first: {p}:1)" in warned[0], warned
    assert "without loss tokens" not in warned[0], warned


def test_examples_dropped_as_too_long_are_a_warning(tokenizer, tmp_path, caplog):
    """overlong=drop leaves out data the user gave: the summary is a WARNING with the count and the option that
    dropped them (it was an INFO line, as a small truncation is)."""
    p = write(tmp_path / "d.jsonl", [{"text": "short one"}, {"text": "word " * 80}])
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=16, overlong="drop")
    assert (len(ds), ds.stats.dropped_overlong) == (1, 1)
    warned = messages(caplog, logging.WARNING)
    assert len(warned) == 1 and "1 of 2 records kept; 1 longer than max_seq_len=16 (dropped, overlong=drop)" \
        in warned[0], messages(caplog)


def test_the_tokens_truncation_cuts_are_counted_and_a_large_share_warned(tokenizer, tmp_path, caplog):
    """Only the count of truncated examples was said, at INFO: a set of long replies lost 81% of its tokens to
    data.max_seq_len without a word of it (a data walk at scale)."""
    long_reply = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 300}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    p = write(tmp_path / "long.jsonl", [long_reply, short, short])
    full = len(load_dataset(p, tokenizer, max_seq_len=4096)[0][0])
    for _ in range(2):  # tokenized, then from the cache: the same count and warning
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="chronicals.data"):
            ds = load_dataset(p, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
        assert ds.stats.truncated == 1 and ds.stats.truncated_tokens == full - 64
        share = (full - 64) / (full - 64 + ds.stats.tokens)
        assert share > 0.5
        warned = [m for m in messages(caplog, logging.WARNING) if "truncated to max_seq_len=64" in m]
        assert len(warned) == 1 and f"{full - 64:,} of their tokens cut ({share:.0%} of the data's)" in warned[0], \
            warned
        assert "raise max_seq_len to keep more of them, or set overlong=split" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chronicals.data"):  # a small share: said at INFO
        load_dataset(write(tmp_path / "few.jsonl", [long_reply] + [short] * 400), tokenizer, max_seq_len=120)
    said = [m for m in messages(caplog) if "truncated to max_seq_len=120" in m]
    assert len(said) == 1 and not messages(caplog, logging.WARNING), said


def test_records_without_loss_tokens_are_located(tokenizer, tmp_path, caplog):
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    no_reply = {"messages": [{"role": "user", "content": "q"}]}
    p = write(tmp_path / "noassist.jsonl", [ok, no_reply, ok, no_reply])
    for _ in range(2):  # tokenized, then from the cache: the same location
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.data"):
            ds = load_dataset(p, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
        assert (len(ds), ds.stats.dropped_no_loss, ds.stats.first_no_loss) == (2, 2, f"{p}:2")
        warned = messages(caplog, logging.WARNING)
        assert len(warned) == 1 and "2 of 4 records kept" in warned[0], warned
        assert (f"2 without loss tokens (dropped: no assistant turn / output / completion, or empty text; "
                f"first: {p}:2)" in warned[0]), warned


def test_the_tokenizing_bar_shows_for_any_slow_set(tokenizer, tmp_path, monkeypatch):
    """The bar was shown from 20,000 records only: 19,999 long records tokenized for a minute without a line (a data
    walk at scale). It is on for every set and drawn once tokenizing has taken 2 s."""
    from chronicals.data import dataset

    made = []

    class Bar:
        def __init__(self, *args, **kw):
            made.append(kw)

        def update(self, n):
            pass

        def close(self):
            pass

    monkeypatch.setattr(dataset, "tqdm", Bar)
    load_dataset(write(tmp_path / "s.jsonl", [{"text": "a b"}] * 3), tokenizer, max_seq_len=64)
    assert len(made) == 1 and not made[0].get("disable") and made[0]["delay"] == 2, made


def test_reading_a_large_set_is_said_before_it_starts(tokenizer, tmp_path, monkeypatch, caplog):
    """Hashing and reading the files come before the tokenizing bar, ~4.5 s per 65 MB, without a line."""
    from chronicals.data import dataset

    p = write(tmp_path / "s.jsonl", [{"text": "a b"}] * 3)
    monkeypatch.setattr(dataset, "SAY_READING_BYTES", p.stat().st_size)
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        load_dataset(p, tokenizer, max_seq_len=64)
    assert "reading the dataset (0.0 GB in 1 file)" in messages(caplog)
    caplog.clear()
    monkeypatch.setattr(dataset, "SAY_READING_BYTES", p.stat().st_size + 1)
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        load_dataset(p, tokenizer, max_seq_len=64)
    assert not [m for m in messages(caplog) if m.startswith("reading")]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_records_are_read_as_they_are_tokenized(tokenizer, tmp_path, monkeypatch, num_proc):
    """load_dataset read every record of every file before tokenizing (~5x a JSON-lines file in Python objects, 10x
    with the rest: a data walk at scale); now a chunk at a time, at most 2 x num_proc chunks ahead of the fold."""
    from chronicals.data import dataset, workers

    monkeypatch.setattr(workers, "CHUNK", 10)
    events = []
    real_iter, real_add = workers.iter_records, dataset._Fold.add

    def counted(path):
        for rec in real_iter(path):
            events.append("read")
            yield rec

    def add(self, records, results):
        events.append("fold")
        return real_add(self, records, results)

    monkeypatch.setattr(workers, "iter_records", counted)
    monkeypatch.setattr(dataset._Fold, "add", add)
    p = write(tmp_path / "d.jsonl", [{"text": f"record {i}"} for i in range(100)])
    ds = load_dataset(p, tokenizer, max_seq_len=64, num_proc=num_proc)
    assert len(ds) == 100 and events.count("fold") == 10
    ahead = events.index("fold")  # records read before the first chunk was folded in
    assert ahead <= 10 * (2 * num_proc + 1) if num_proc > 1 else ahead == 10, ahead


def test_on_long_split_keeps_every_token_as_documents_of_max_seq_len(tokenizer, tmp_path, caplog):
    """overlong="split" (data.on_long=split): a long text becomes documents of max_seq_len (positions restart,
    no attention across them) instead of losing its tail; a text corpus for continued pretraining keeps its tokens.
    Truncation cut them (81% of a long set's tokens in a data walk)."""
    p = write(tmp_path / "t.jsonl", [{"text": "word " * 300}, {"text": "short one"}])
    whole = load_dataset(p, tokenizer, max_seq_len=4096, loss_on="all")
    n = int(whole.lengths[0])
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=64, loss_on="all", overlong="split")
    pieces = -(-n // 64) - (1 if n % 64 == 1 else 0)  # a last piece of one token has no target
    assert ds.stats.split == 1 and ds.stats.split_pieces == pieces and len(ds) == pieces + 1
    assert ds.lengths[:pieces].tolist() == [64] * (n // 64) + ([n % 64] if n % 64 > 1 else [])
    assert ds.ids[:sum(ds.lengths[:pieces])].tolist() == whole.ids[:sum(ds.lengths[:pieces])].tolist()
    assert ds.stats.truncated == 0 and ds.stats.truncated_tokens == 0
    assert f"2 of 2 records kept; 1 longer than max_seq_len=64 split into {pieces} documents (overlong=split)" \
        in caplog.text
    chat = write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "word " * 100},
                                                      {"role": "assistant", "content": "ok"}]}])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chronicals.data"):  # the prompt-only pieces train nothing: left out
        ds = load_dataset(chat, tokenizer, max_seq_len=64, overlong="split")
    n = int(load_dataset(chat, tokenizer, max_seq_len=4096).lengths[0])
    assert len(ds) == 1 and ds.stats.loss_tokens >= 1
    # split into one trainable piece is still a split, and the prompt tokens it left out are said
    assert ds.stats.split == 1 and ds.stats.split_pieces == 1 and ds.stats.split_left_tokens == n - ds.lengths[0] > 0
    assert (f"1 of 1 records kept; 1 longer than max_seq_len=64 split into 1 documents (overlong=split; "
            f"{n - ds.lengths[0]:,} tokens in pieces without a target left out)") in caplog.text


def test_record_counts_and_formats_per_file_past_one_chunk(tokenizer, tmp_path, monkeypatch):
    """Records are tokenized in chunks (workers.CHUNK); a file of several chunks is counted whole and its format
    said of it, not of the next file; a trailing file with no records is "no readable records", not "not read"."""
    from chronicals.data import workers

    monkeypatch.setattr(workers, "CHUNK", 10)
    d = tmp_path / "d"
    write(d / "a.jsonl", [{"text": f"a {i}"} for i in range(25)])
    write(d / "b.jsonl", [{"prompt": f"p {i}", "completion": " c"} for i in range(25)])
    (d / "c.jsonl").write_text("\n")
    ds = load_dataset(d, tokenizer, max_seq_len=64)
    assert ds.file_counts == [25, 25, 0]
    assert ds.file_formats == ["text", "prompt_completion", "no readable records"]


def test_on_long_split_counts_two_pieces_and_leaves_out_a_one_token_tail(tokenizer, tmp_path):
    """A text of n tokens at max_seq_len n - 5 is two documents (counted as a split); at n - 1 its last piece is
    one token, which has no target: left out, and said as such (1 token), the record one document."""
    p = write(tmp_path / "x.jsonl", [{"text": "word " * 50}])
    n = int(load_dataset(p, tokenizer, max_seq_len=4096, loss_on="all").lengths[0])
    two = load_dataset(p, tokenizer, max_seq_len=n - 5, loss_on="all", overlong="split")
    assert (two.stats.split, two.stats.split_pieces, len(two), two.stats.split_left_tokens) == (1, 2, 2, 0)
    one = load_dataset(p, tokenizer, max_seq_len=n - 1, loss_on="all", overlong="split")
    assert (len(one), one.stats.split_pieces, one.stats.split_left_tokens) == (1, 1, 1)
    assert one.stats.loss_tokens == n - 2  # the first piece's targets: its tokens but the first


def test_truncation_that_cuts_a_tenth_or_more_names_the_fixes(tokenizer, tmp_path, caplog):
    """From 10% of the data's tokens cut (LOST_TOKENS_WARN), a WARNING naming both fixes; the other tests cut over
    half or under a tenth."""
    long_text = {"text": "word " * 100}
    short = [{"text": "word " * 55} for _ in range(4)]
    p = write(tmp_path / "t.jsonl", [long_text] + short)
    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=64, loss_on="all")
    lost = ds.stats.truncated_tokens / (ds.stats.truncated_tokens + ds.stats.tokens)
    assert 0.1 <= lost < 0.5, lost
    warned = messages(caplog, logging.WARNING)
    assert len(warned) == 1 and "raise max_seq_len to keep more of them, or set overlong=split" in warned[0], warned


def test_a_blank_reply_in_a_conversational_prompt_is_not_an_empty_target(tokenizer, tmp_path, caplog):
    """The empty-target warning is about what is trained: a blank assistant message inside a conversational
    completion's prompt trains nothing, and says nothing; a blank reply in its completion does."""
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
              {"role": "user", "content": "Capital of France?"}]
    p = write(tmp_path / "c.jsonl", [{"prompt": prompt, "completion": [{"role": "assistant", "content": "Paris."}]}])
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        ds = load_dataset(p, tokenizer, max_seq_len=128)
    assert ds.stats.empty_targets == 0 and not [m for m in messages(caplog, logging.WARNING) if "empty" in m]
    q = write(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": [{"role": "assistant", "content": " "}]}])
    assert load_dataset(q, tokenizer, max_seq_len=128).stats.empty_targets == 1


def test_the_data_summary_counts_files_records_and_files_past_eight_in_both_numbers():
    """The summary line of what was read: "1 file ..., 1 record" and, past eight files listed, "and 1 more file"."""
    assert _summary_line("train", ["a.jsonl"], [1], ["chat"], "auto") == "train: 1 file (a.jsonl), 1 record; " \
                                                                          "format auto -> chat"
    files = [f"d/{i}.jsonl" for i in range(9)]
    line = _summary_line("train", files, [2] * 9, ["chat", "text"] * 4 + ["chat"], "auto")
    assert line.startswith("train: 9 files (") and ", 18 records; format auto -> 0.jsonl: chat" in line, line
    assert line.endswith("; 7.jsonl: text; and 1 more file"), line
    line = _summary_line("train", files + ["d/9.jsonl"], [2] * 10, ["chat", "text"] * 5, "auto")
    assert line.endswith("; and 2 more files"), line


def test_the_data_summary_says_the_format_the_user_set():
    """format=chat (not auto) is said as set, so the line shows how the records were read."""
    assert _summary_line("train", ["a.jsonl"], [2], ["chat"], "chat") == "train: 1 file (a.jsonl), 2 records; " \
                                                                          "format chat"


def test_the_data_summary_at_its_limits_says_no_more_files_than_there_are():
    """Three files are named whole and eight formats listed whole: "and 0 more" is never said; one past either
    limit is."""
    files = [f"d/{i}.jsonl" for i in range(8)]
    line = _summary_line("train", files[:3], [1] * 3, ["chat"] * 3, "auto")
    assert line.startswith("train: 3 files (d/0.jsonl, d/1.jsonl, d/2.jsonl), 3 records"), line
    line = _summary_line("train", files[:4], [1] * 4, ["chat"] * 4, "auto")
    assert line.startswith("train: 4 files (d/0.jsonl, d/1.jsonl, d/2.jsonl and 1 more), 4 records"), line
    line = _summary_line("train", files, [1] * 8, ["chat", "text"] * 4, "auto")
    assert line.endswith("; 7.jsonl: text") and "more file" not in line.split("), ", 1)[1], line
