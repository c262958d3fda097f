"""Held-out QA files: validation with file:line, formats, and scoring (no model: answers are given)."""

import json

import pytest
import torch

from chronicals.data import DataError
from chronicals.train import qa as qa_mod


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_keywords_must_be_non_empty_strings(tmp_path):
    ok = {"question": "Capital of France?", "answer": "Paris", "keywords": ["paris"]}
    for bad, what in (([1789], r"keywords\[0\] is an int"), (1789, "'keywords' is an int"),
                      ({"k": "paris"}, "'keywords' is a dict"), ([""], r"keywords\[0\] is empty"),
                      (["paris", None], r"keywords\[1\] is null"), (" ", "'keywords' is an empty string")):
        p = write(tmp_path / "q.jsonl", [ok, {**ok, "keywords": bad}])
        with pytest.raises(DataError, match=rf"^{p}:2: {what}.*expected a list of non-empty strings, or one string"):
            qa_mod.read_qa(p)
    for blank in (" ", "\t", "  \n"):  # a blank keyword can never be scored right
        p = write(tmp_path / "q.jsonl", [{**ok, "keywords": ["paris", blank]}])
        with pytest.raises(DataError, match=rf"^{p}:1: keywords\[1\] is empty, expected a list of non-empty strings"):
            qa_mod.read_qa(p)
    for bad, what in ((5, "'answer' is an int"), (None, "'answer' is null"), ("", "'answer' is empty")):
        p = write(tmp_path / "q.jsonl", [{**ok, "answer": bad}])
        with pytest.raises(DataError, match=rf"^{p}:1: {what}"):
            qa_mod.read_qa(p)
    for field in ("question", "answer"):
        p = write(tmp_path / "q.jsonl", [{**ok, field: "  \t "}])
        with pytest.raises(DataError, match=rf"^{p}:1: '{field}' is empty; expected"):
            qa_mod.read_qa(p)
    p = write(tmp_path / "q.jsonl", [{**ok, "question": ["x"]}])
    with pytest.raises(DataError, match=rf"^{p}:1: 'question' is a list, expected a string"):
        qa_mod.read_qa(p)
    p = write(tmp_path / "q.jsonl", [{**ok, "question": "a\ud800b"}])
    with pytest.raises(DataError, match=rf"^{p}:1: 'question' is not valid Unicode \(lone surrogate"):
        qa_mod.read_qa(p)
    p = write(tmp_path / "q.jsonl", [{**ok, "keywords": ["paris", "x\udc00"]}])  # failed only when scored
    with pytest.raises(DataError, match=rf"^{p}:1: keywords\[1\] is not valid Unicode \(lone surrogate"):
        qa_mod.read_qa(p)


def test_a_keyword_given_as_a_string_is_one_keyword(tmp_path, monkeypatch):
    """"keywords": "Paris" was refused ("'keywords' is a str"); it is the list ["Paris"]. Not split on commas:
    "2,318" (the demo's own keyword) and "Lake Ostrel, the largest" stay whole."""
    rows = [{"question": "Capital of France?", "answer": "Paris", "keywords": "Paris"},
            {"question": "How tall?", "answer": "2,318 meters", "keywords": "2,318"},
            {"question": "Largest lake?", "answer": "Lake Ostrel", "keywords": "Lake Ostrel, the largest"}]
    qa = qa_mod.read_qa(write(tmp_path / "q.jsonl", rows))
    assert [r["keywords"] for r in qa] == [["Paris"], ["2,318"], ["Lake Ostrel, the largest"]]
    assert score(monkeypatch, qa, ["It is paris.", "2,318 m", "Lake Ostrel"]) == [True, True, False]


def score(monkeypatch, qa, answers):
    monkeypatch.setattr(qa_mod, "answer_many", lambda *a, **k: list(answers))
    return qa_mod.answer_all(None, None, qa, "", 8).correct


def test_missing_keywords_default_to_the_answer(tmp_path, monkeypatch):
    p = write(tmp_path / "q.jsonl", [{"question": "Capital of Atlantis?", "answer": "Zorblax"},
                                     {"question": "2+2?", "answer": "4", "keywords": []}])
    qa = qa_mod.read_qa(p)
    assert [r["keywords"] for r in qa] == [["Zorblax"], ["4"]]
    assert score(monkeypatch, qa, ["", "four"]) == [False, False]  # an empty answer is never right
    assert score(monkeypatch, qa, ["It is zorblax.", "2+2=4"]) == [True, True]  # case-insensitive
    # a record given to answer_all without keywords (not through read_qa) is never counted right
    assert score(monkeypatch, [{"question": "q", "answer": "a"}], ["anything"]) == [False]


def test_json_errors_bom_and_json_arrays(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question": "a?", "answer": "b"}\n{bad json}\n')
    with pytest.raises(DataError, match=rf"^{p}:2: invalid JSON \(Expecting property name"):
        qa_mod.read_qa(p)
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "a?", "answer": "b"}).encode() + b"\n")
    assert qa_mod.read_qa(p) == [{"question": "a?", "answer": "b", "keywords": ["b"]}]
    q = tmp_path / "q.json"
    q.write_text(json.dumps([{"question": "a?", "answer": "b", "keywords": ["B"]}], indent=1))
    assert qa_mod.read_qa(q) == [{"question": "a?", "answer": "b", "keywords": ["B"]}]


def test_not_qa_empty_and_mixed_files(tmp_path):
    chat = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert qa_mod.read_qa(write(tmp_path / "c.jsonl", [chat])) is None  # plain held-out data
    (tmp_path / "e.jsonl").write_text("\n")
    assert qa_mod.read_qa(tmp_path / "e.jsonl") is None  # load_dataset reports the empty file by name
    p = write(tmp_path / "m.jsonl", [{"question": "a?", "answer": "b"}, chat])
    with pytest.raises(DataError, match=rf"^{p}:2: a record without 'question' in a held-out QA file"):
        qa_mod.read_qa(p)


def test_on_error_skip_leaves_bad_records_out_and_counts_them(tmp_path, caplog):
    """read_qa took no on_error: one broken line failed the held-out QA file even with data.on_error=skip."""
    ok = {"question": "a?", "answer": "b"}
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join([json.dumps(ok), "{bad json}", json.dumps({**ok, "answer": 5}),
                            json.dumps({"messages": []}), json.dumps({**ok, "question": "c?"})]) + "\n")
    with pytest.raises(DataError, match=rf"^{p}:2: invalid JSON .*\(data.on_error=skip drops bad records"):
        qa_mod.read_qa(p)
    with caplog.at_level("WARNING", logger="chronicals.data"):
        qa = qa_mod.read_qa(p, on_error="skip")
    assert [r["question"] for r in qa] == ["a?", "c?"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, warned
    assert f"{p}: skipped 3 bad records; first: {p}:2: invalid JSON" in warned[0]
    assert f"; {p}:3: 'answer' is an int" in warned[0] and f"; {p}:4: a record without 'question'" in warned[0]
    p.write_text("{bad json}\n" + json.dumps({**ok, "answer": ""}) + "\n")
    with pytest.raises(DataError, match=rf"^every record in {p} is bad \(2 skipped\); first: {p}:1: invalid JSON"):
        qa_mod.read_qa(p, on_error="skip")


def test_a_directory_holding_qa_jsonl_is_told_to_give_the_file_itself(tmp_path):
    """Was "convert qadir/qa.jsonl (one {...} object per line in a .jsonl)": it already is one."""
    d = tmp_path / "qadir"
    d.mkdir()
    write(d / "qa.jsonl", [{"question": "a?", "answer": "b"}])
    with pytest.raises(DataError, match=rf"^{d}: question/answer held-out records are read from one \.jsonl or "
                                        rf"\.json file, not a directory; set data.eval_path to {d / 'qa.jsonl'} "
                                        r"itself$") as e:
        qa_mod.read_qa(d)
    assert "convert" not in str(e.value)
    write(d / "qa2.jsonl", [{"question": "c?", "answer": "d"}])
    with pytest.raises(DataError, match=rf"itself \(merge the 2 files of {d} into one first\)$"):
        qa_mod.read_qa(d)
    (d / "qa2.jsonl").unlink()
    (d / "qa.jsonl").write_text("\n  \n" + json.dumps({"question": "a?", "answer": "b"}) + "\n")  # a leading blank
    with pytest.raises(DataError, match=r"not a directory; set data.eval_path to .*qa\.jsonl itself$"):
        qa_mod.read_qa(d)
    (d / "qa.jsonl").unlink()
    (d / "qa.json").write_text(json.dumps([{"question": "a?", "answer": "b"}]))  # a JSON array file alike
    with pytest.raises(DataError, match=r"not a directory; set data.eval_path to .*qa\.json itself$") as e:
        qa_mod.read_qa(d)
    assert "convert" not in str(e.value)
    (d / "qa.json").unlink()
    (d / "qa.csv").write_text("question,answer\na?,b\n")  # not .jsonl: still told to convert it
    with pytest.raises(DataError, match=rf"; convert {d / 'qa.csv'} "):
        qa_mod.read_qa(d)
    (d / "qa.csv").unlink()
    # a QA file sorted after a chat file: told the same (only the first file was peeked at, and load_dataset then
    # said "cannot tell the format from fields ['answer', 'question']": a walk of chronicals eval)
    write(d / "a_chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    write(d / "zz_qa.jsonl", [{"question": "a?", "answer": "b"}])
    with pytest.raises(DataError, match=rf"not a directory; set data.eval_path to {d / 'zz_qa.jsonl'} itself "
                                        rf"\(1 other file of {d} holds other records; score them apart\)$"):
        qa_mod.read_qa(d)


def test_a_directory_named_like_a_qa_file_is_read_as_a_directory(tmp_path):
    """A directory whose name ends in .jsonl goes through the directory check (told to give the QA file inside it),
    not read_file, which failed with a bare IsADirectoryError."""
    d = tmp_path / "held.jsonl"
    d.mkdir()
    write(d / "qa.jsonl", [{"question": "a?", "answer": "b"}])
    with pytest.raises(DataError, match=r"not a directory; set data.eval_path to .*held\.jsonl/qa\.jsonl itself$"):
        qa_mod.read_qa(d)
    write(d / "qa.jsonl", [{"text": "x"}])
    assert qa_mod.read_qa(d) is None  # not QA: load_dataset reads the directory


def test_a_directory_whose_first_jsonl_line_is_bad_is_left_to_load_dataset(tmp_path):
    """The QA peek into a held-out directory is quiet about a first line it cannot parse: read_qa returns None and
    load_dataset then names the bad line with file:line (the peek raised a bare JSONDecodeError)."""
    d = tmp_path / "held"
    d.mkdir()
    (d / "a.jsonl").write_text("{bad json\n")
    assert qa_mod.read_qa(d) is None
    assert qa_mod._first_keys(d / "a.jsonl") == []


def test_keywords_match_by_unicode_case_folding():
    from chronicals.train import qa

    assert qa._fold("Straße") in qa._fold("IN DER STRASSE")
    assert qa._fold("Café") in qa._fold("CAFE\u0301 au lait")  # composed and decomposed accents alike


def test_demo_beside_a_local_demo_folder_says_which_one_is_read(tmp_path, monkeypatch, caplog):
    """'demo' is the packaged demo data even where ./demo exists (the user's folder was left unread silently)."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="chronicals.train"):
        qa_mod.warn_demo_shadows("demo", "data.path")
        assert not caplog.text
        (tmp_path / "demo").mkdir()
        qa_mod.warn_demo_shadows("demo", "data.path")
        qa_mod.warn_demo_shadows("./demo", "data.path")
    assert caplog.text.count("data.path=demo is chronicals' packaged demo data, not ./demo in this directory; to "
                             "read that one, pass data.path=./demo") == 1


def test_keywords_match_whole_words_not_parts_of_longer_ones(tmp_path, monkeypatch):
    """A substring test credited wrong answers with the demo's own keywords: "seven" in "seventeen", "1742" in
    "17420", "green" and "gold" in "evergreen and golden" (a generation walk). Whole words now; punctuation beside
    a keyword, keywords that begin or end with a symbol, and scripts without spaces still match."""
    rows = [{"question": "q1", "answer": "seven islands", "keywords": ["seven"]},
            {"question": "q2", "answer": "1742", "keywords": ["1742"]},
            {"question": "q3", "answer": "green and gold", "keywords": ["green", "gold"]},
            {"question": "q4", "answer": "C++", "keywords": ["C++"]},
            {"question": "q5", "answer": "東京", "keywords": ["東京"]}]
    qa = qa_mod.read_qa(write(tmp_path / "q.jsonl", rows))
    wrong = ["It has seventeen islands.", "Founded in 17420 BC.", "It is evergreen and golden.", "C+", "大阪"]
    right = ["Seven islands.", "In 1742.", "Green, and gold!", "Written in C++.", "東京都です"]
    assert score(monkeypatch, qa, wrong) == [False] * 5
    assert score(monkeypatch, qa, right) == [True] * 5
    for answer, keyword in (("Built on ASP.NET Core.", ".NET"), ("It costs US$5 a day.", "$5"),
                            ("Winters reach 0-40 C there.", "-40")):  # a symbol edge needs no boundary
        assert qa_mod.has_keyword(answer, keyword) and not qa_mod.has_keyword(answer, keyword + "x")


def test_the_keyword_search_goes_on_past_an_occurrence_inside_a_longer_word():
    """After an occurrence inside a longer word the search resumes one character on, so a whole-word occurrence that
    overlaps it is found ("ha ha" in "aha ha ha", "2-2" in "12-2-2"); resuming after it missed them."""
    assert qa_mod.has_keyword("aha ha ha", "ha ha")
    assert qa_mod.has_keyword("It was 12-2-2 at the end", "2-2")
    assert not qa_mod.has_keyword("aha haha", "ha ha")


def test_an_underscore_joins_a_keyword_to_a_longer_word():
    """"_" beside a keyword's letter or digit edge continues the word (as \\w does): "paris" is not a whole word in
    "paris_texas" or "my_paris", nor "1742" in "id_1742"; other punctuation still bounds it."""
    assert not qa_mod.has_keyword("see paris_texas", "paris")
    assert not qa_mod.has_keyword("my_paris", "paris")
    assert not qa_mod.has_keyword("id_1742", "1742")
    assert qa_mod.has_keyword("paris-texas", "paris") and qa_mod.has_keyword("(1742)", "1742")


def test_an_answer_is_right_only_with_every_keyword(monkeypatch):
    """One keyword of two is not enough; both, in any order, are."""
    qa = [{"question": "q", "answer": "green and gold", "keywords": ["green", "gold"]}]
    assert score(monkeypatch, qa, ["green only"]) == [False]
    assert score(monkeypatch, qa, ["gold and green"]) == [True]


@pytest.mark.parametrize("answer, keyword", [("1742年に設立されました", "1742"), ("西暦1742年", "1742"),
                                             ("東京Towerです", "Tower"), ("人口は2,318人", "2,318")])
def test_a_latin_or_digit_keyword_beside_cjk_text_matches(answer, keyword):
    """Chinese and Japanese write a number or Latin word against the characters around it: those are no word's
    continuation, so the keyword matches (it scored correct CJK answers wrong); a digit or letter beside it still
    makes it part of a longer word."""
    assert qa_mod.has_keyword(answer, keyword)
    assert not qa_mod.has_keyword(answer.replace(keyword, keyword + "0"), keyword)
    assert not qa_mod.has_keyword(answer.replace(keyword, "x" + keyword), keyword)


def test_keywords_are_stripped_as_answers_are(tmp_path, monkeypatch):
    """"Paris " never matched "Paris." (the answers are stripped, the keywords were not; a generation walk)."""
    qa = qa_mod.read_qa(write(tmp_path / "q.jsonl", [{"question": "q", "answer": "Paris", "keywords": [" Paris "]}]))
    assert qa[0]["keywords"] == ["Paris"] and score(monkeypatch, qa, ["Paris."]) == [True]


@pytest.mark.parametrize("keyword", ["", "  ", "\t"])
def test_an_empty_keyword_matches_nothing(keyword):
    """has_keyword is public: a blank keyword passed from Python (not through the QA file's loader, which refuses
    it) would credit every answer (untested: a mutation walk)."""
    assert not qa_mod.has_keyword("anything at all", keyword)


def test_fraction_of_no_answers_is_zero_and_otherwise_the_share():
    assert qa_mod.QAResult(answers=[], correct=[]).fraction == 0.0
    assert qa_mod.QAResult(answers=["a", "b", "c", "d"], correct=[True, False, True, True]).fraction == 0.75


def test_qa_files_by_suffix_in_any_case_and_a_csv_with_a_bom_is_told_to_convert(tmp_path):
    """QA.JSONL / QA.Json are QA files (their suffix in any case); a QA CSV saved with a byte-order mark is still
    seen as QA records and told to convert (QA is read from .jsonl or .json only)."""
    rec = {"question": "a?", "answer": "b"}
    lines = write(tmp_path / "QA.JSONL", [rec])
    array = tmp_path / "QA.Json"
    array.write_text(json.dumps([rec]))
    for p in (lines, array):
        assert qa_mod.read_qa(p) == [{"question": "a?", "answer": "b", "keywords": ["b"]}]
    p = tmp_path / "qa.csv"
    p.write_bytes(b"\xef\xbb\xbfquestion,answer\nCapital?,Paris\n")
    assert qa_mod._first_keys(p) == ["question", "answer"]
    with pytest.raises(DataError, match=r"read from \.jsonl or \.json only; convert .*qa\.csv"):
        qa_mod.read_qa(p)


def test_a_records_own_system_message_is_kept_alone(tmp_path):
    from chronicals.train.qa import write_chat_jsonl

    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "u"},
           {"role": "assistant", "content": "a"}]
    bare = own[1:]
    path = write_chat_jsonl([{"messages": own}, {"messages": bare}], tmp_path / "h.jsonl", "Be brief.")
    got = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert got == [own, [{"role": "system", "content": "Be brief."}, *bare]]


def test_no_system_prompt_adds_no_system_message(tmp_path):
    """write_chat_jsonl with system prompt "" (the user's data has none) writes chat and QA records without a system
    message: an empty one would change the chat template's rendering from what training saw."""
    from chronicals.train.qa import write_chat_jsonl

    bare = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    path = write_chat_jsonl([{"messages": bare}, {"question": "q?", "answer": "b"}], tmp_path / "h.jsonl", "")
    got = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert got == [bare, [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "b"}]]


def test_a_prompt_opens_the_assistant_turn_after_earlier_turns_oldest_first():
    """chat_messages puts the earlier turns as user then assistant, oldest first; prompt_ids renders them with the
    assistant turn opened (add_generation_prompt) and the fixed template date, tokenized without extra specials."""
    from chronicals.data.chat_template import TEMPLATE_DATE
    from chronicals.train.qa import chat_messages, prompt_ids

    assert chat_messages("q3", "S", history=[("q1", "a1"), ("q2", "a2")]) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]

    class FakeTok:
        calls = []

        def apply_chat_template(self, msgs, **kw):
            self.calls.append(kw)
            text = "".join(f"<{m['role']}>{m['content']}" for m in msgs)
            return text + ("<assistant>" if kw.get("add_generation_prompt") else "")

        def __call__(self, text, add_special_tokens, verbose=True):
            # verbose=False: transformers' own too-long line is not printed before chat's (a walk of chronicals chat)
            assert add_special_tokens is False and verbose is False
            return {"input_ids": [len(part) for part in text.split("<")[1:]]}

    tok = FakeTok()
    ids = prompt_ids(tok, "q?", "S")
    assert tok.calls == [dict(tokenize=False, add_generation_prompt=True, date_string=TEMPLATE_DATE)]
    assert ids.dtype == torch.long and ids.tolist() == [len("system>S"), len("user>q?"), len("assistant>")]


def test_a_single_answer_is_stripped_and_prompt_ids_are_checked_against_the_vocabulary(monkeypatch):
    from types import SimpleNamespace

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=64))
    monkeypatch.setattr(qa_mod, "prompt_ids", lambda tok, q, system, history=(): torch.tensor([3, 70, 5]))
    with pytest.raises(ValueError, match=r"the prompt 'Capital\?' tokenizes to id 70, but the model's vocabulary "
                                         r"has 64 entries"):
        qa_mod.checked_prompt_ids(model, None, "Capital?", "")
    monkeypatch.setattr(qa_mod, "prompt_ids", lambda tok, q, system, history=(): torch.tensor([3, 63, 5]))
    assert qa_mod.checked_prompt_ids(model, None, "Capital?", "").tolist() == [3, 63, 5]

    monkeypatch.setattr(qa_mod, "checked_prompt_ids", lambda *a, **k: torch.tensor([1, 2]))
    monkeypatch.setattr(qa_mod, "stop_ids", lambda model, tok: {0})
    monkeypatch.setattr(qa_mod, "generate", lambda model, ids, n, **kw: torch.tensor([5, 6]))

    class Tok:
        def decode(self, toks, skip_special_tokens):
            assert toks == [5, 6] and skip_special_tokens
            return "\n Paris \n"
    assert qa_mod.answer(None, Tok(), "Capital?", "", 4) == "Paris"


def test_a_chat_reply_passes_its_sampling_settings_and_stop_ids_to_generate(monkeypatch):
    """answer (chat's reply) hands generate the token budget, eos_token_id=stop_ids(model, tokenizer), temperature,
    top_p, the generator and the streamer (a fake generate that ignored them let a dropped one pass)."""
    seen = {}
    monkeypatch.setattr(qa_mod, "checked_prompt_ids", lambda *a, **k: torch.tensor([1, 2]))
    monkeypatch.setattr(qa_mod, "stop_ids", lambda model, tok: {7, 9})
    monkeypatch.setattr(qa_mod, "generate", lambda model, ids, n, **kw: seen.update(kw, n=n) or torch.tensor([5]))

    class Tok:
        def decode(self, toks, skip_special_tokens):
            return "ok"

    gen, streamer = torch.Generator(), object()
    assert qa_mod.answer(None, Tok(), "q?", "", 4, temperature=0.7, top_p=0.9, generator=gen,
                         streamer=streamer) == "ok"
    assert seen == dict(n=4, eos_token_id={7, 9}, temperature=0.7, top_p=0.9, generator=gen, streamer=streamer)


def test_batched_answers_skip_special_tokens_and_group_prompts_by_length(monkeypatch):
    """answer_many decodes each row without special tokens (an eos or chat marker is not part of the scored answer),
    strips it, and batches prompts of equal length together. The CLI's batched test compared with a one-by-one
    decode that also skipped them, and its tiny model emits none."""
    calls, decoded = [], []
    monkeypatch.setattr(qa_mod, "checked_prompt_ids", lambda m, t, q, s: torch.tensor([1] * len(q)))
    monkeypatch.setattr(qa_mod, "stop_ids", lambda m, t: {0})
    monkeypatch.setattr(qa_mod, "greedy_rows", lambda m, ids, n, stops: calls.append(ids.shape) or [[4] for _ in ids])

    class Tok:
        def decode(self, toks, skip_special_tokens):
            decoded.append(skip_special_tokens)
            return " Paris " if skip_special_tokens else " Paris<|im_end|> "

    assert qa_mod.answer_many(None, Tok(), ["ab", "cd", "xyz"], "", 4) == ["Paris"] * 3
    assert decoded == [True] * 3 and sorted(calls) == [(1, 3), (2, 2)]


def test_a_keyword_followed_by_the_answers_last_character_is_not_a_whole_word():
    """A letter or digit that ends the answer right after the keyword still makes it part of a longer word: "1742"
    is not in "Founded in 17420", nor "seven" in "sevens"; an end-of-text check off by one would credit them."""
    assert not qa_mod.has_keyword("Founded in 17420", "1742")
    assert not qa_mod.has_keyword("sevens", "seven")
    assert qa_mod.has_keyword("Founded in 1742", "1742") and qa_mod.has_keyword("In 1742.", "1742")


def test_the_answer_is_case_folded_and_normalized_as_the_keyword_is():
    """has_keyword folds the answer as it folds the keyword (NFC, then casefold): "Straße" answers "STRASSE" and a
    decomposed "e" + combining accent answers "café". Lowering the answer alone would leave "ß" and the combining
    accent apart, and score such right answers wrong."""
    assert qa_mod.has_keyword("Die Straße", "STRASSE")
    assert qa_mod.has_keyword("CAFE\u0301 au lait", "café")


def test_a_directory_holding_an_upper_case_qa_jsonl_is_told_to_give_the_file_itself(tmp_path):
    """A held-out directory holding QA.JSONL (the suffix in any case, as read_qa reads it) is told to give that file,
    not to "convert" a file that already is JSON lines."""
    d = tmp_path / "qadir"
    d.mkdir()
    write(d / "QA.JSONL", [{"question": "a?", "answer": "b"}])
    with pytest.raises(DataError, match=r"not a directory; set data.eval_path to .*QA\.JSONL itself$") as e:
        qa_mod.read_qa(d)
    assert "convert" not in str(e.value)


def test_batched_answers_cover_every_row_past_a_full_batch(monkeypatch):
    """Prompts of one length beyond QA_BATCH_ROWS go in several batches of at most that many rows, and every
    question gets its own answer: a batch slice one short would leave a question unanswered ("" scored wrong)."""
    calls = []
    monkeypatch.setattr(qa_mod, "QA_BATCH_ROWS", 2)
    monkeypatch.setattr(qa_mod, "checked_prompt_ids", lambda m, t, q, s: torch.tensor([int(q[1:]), 0]))
    monkeypatch.setattr(qa_mod, "stop_ids", lambda m, t: {0})
    monkeypatch.setattr(qa_mod, "greedy_rows",
                        lambda m, ids, n, stops: calls.append(len(ids)) or [[int(row[0])] for row in ids])

    class Tok:
        def decode(self, toks, skip_special_tokens):
            return f"a{toks[0]}"

    questions = [f"q{i}" for i in range(5)]
    assert qa_mod.answer_many(None, Tok(), questions, "", 4) == [f"a{i}" for i in range(5)]
    assert calls == [2, 2, 1]
