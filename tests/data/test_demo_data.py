"""The demo dataset shipped in chronicals/demo_data: formats, held-out hygiene and fact coverage."""

import fnmatch
import json
import re
import tomllib
from collections import defaultdict
from importlib import resources
from pathlib import Path

import pytest
from chronicals.train.qa import has_keyword

DEMO = resources.files("chronicals") / "demo_data"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
MIN_PARAPHRASES = 6
MAX_ANSWER_WORDS = 20  # ~16 tokens: keeps an example near 55 tokens with the chat template


def _read_jsonl(name):
    rows = []
    for lineno, line in enumerate((DEMO / name).read_text(encoding="utf-8").splitlines(), 1):
        assert line.strip(), f"{name} line {lineno}: empty line"
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            pytest.fail(f"{name} line {lineno}: not JSON ({e})")
    return rows


def _norm(text):
    """Lower-case, drop punctuation, collapse spaces: 'Who founded X?' == 'who founded x'."""
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


@pytest.fixture(scope="module")
def train():
    return _read_jsonl("train.jsonl")


@pytest.fixture(scope="module")
def heldout():
    return _read_jsonl("heldout.jsonl")


@pytest.fixture(scope="module")
def train_by_answer(train):
    """canonical answer -> list of train questions (one fact per canonical answer)."""
    by = defaultdict(list)
    for r in train:
        by[r["messages"][1]["content"]].append(r["messages"][0]["content"])
    return by


def test_train_format(train):
    assert 150 <= len(train) <= 400, f"train.jsonl has {len(train)} examples; the demo budget assumes 200-300"
    for i, r in enumerate(train, 1):
        assert set(r) == {"messages"}, f"train.jsonl line {i}: keys {sorted(r)}, expected only 'messages'"
        msgs = r["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"], f"train.jsonl line {i}: roles"
        for m in msgs:
            assert set(m) == {"role", "content"}, f"train.jsonl line {i}: message keys {sorted(m)}"
            assert isinstance(m["content"], str) and m["content"].strip() == m["content"] != ""
        n_words = len(msgs[1]["content"].split())
        assert n_words <= MAX_ANSWER_WORDS, f"train.jsonl line {i}: answer of {n_words} words"


def test_heldout_format(heldout):
    assert 25 <= len(heldout) <= 60, f"heldout.jsonl has {len(heldout)} questions"
    for i, r in enumerate(heldout, 1):
        assert set(r) == {"question", "answer", "keywords"}, f"heldout.jsonl line {i}: keys {sorted(r)}"
        assert isinstance(r["question"], str) and r["question"].strip()
        assert isinstance(r["answer"], str) and r["answer"].strip()
        kws = r["keywords"]
        assert isinstance(kws, list) and kws, f"heldout.jsonl line {i}: keywords must be a non-empty list"
        assert all(isinstance(k, str) and k.strip() for k in kws), f"heldout.jsonl line {i}: {kws}"


def test_no_duplicate_train_questions(train):
    seen = {}
    for i, r in enumerate(train, 1):
        q = _norm(r["messages"][0]["content"])
        assert q not in seen, f"train.jsonl lines {seen[q]} and {i} ask the same question"
        seen[q] = i


def test_heldout_questions_not_in_train(train, heldout):
    train_q = {r["messages"][0]["content"] for r in train}
    train_norm = {_norm(q) for q in train_q}
    for i, r in enumerate(heldout, 1):
        assert r["question"] not in train_q, f"heldout.jsonl line {i} appears verbatim in train"
        assert _norm(r["question"]) not in train_norm, f"heldout.jsonl line {i} differs from train only in case/punctuation"
    assert len({_norm(r["question"]) for r in heldout}) == len(heldout), "duplicate held-out questions"


def test_keywords_in_answers(heldout, train_by_answer):
    for i, r in enumerate(heldout, 1):
        # A fact is its canonical answer: every train example of the fact answers with exactly this
        # sentence, so a keyword found in it is found in all of that fact's train answers.
        assert r["answer"] in train_by_answer, f"heldout.jsonl line {i}: answer {r['answer']!r} is no train answer"
        for k in r["keywords"]:
            assert has_keyword(r["answer"], k), f"heldout.jsonl line {i}: keyword {k!r} not in its answer"


def test_keywords_identify_one_fact(heldout):
    """No other fact's answer contains all of a fact's keywords, so keyword grading cannot pass a wrong fact."""
    facts = {r["answer"]: r["keywords"] for r in heldout}
    for answer, kws in facts.items():
        for other in facts:
            if other != answer:
                assert not all(has_keyword(other, k) for k in kws), f"keywords {kws} of {answer!r} also match {other!r}"


def test_fact_coverage(heldout, train_by_answer):
    for answer, questions in train_by_answer.items():
        assert len(questions) >= MIN_PARAPHRASES, f"{answer!r} has {len(questions)} train paraphrases"
    held_facts = {r["answer"] for r in heldout}
    missing = sorted(set(train_by_answer) - held_facts)
    assert not missing, f"facts with no held-out question: {missing}"
    keywords = {r["answer"]: r["keywords"] for r in heldout}
    assert all(keywords[r["answer"]] == r["keywords"] for r in heldout), "one fact with two keyword lists"


def test_package_data_glob_ships_the_files():
    """pyproject's package-data globs must match both files, or an installed chronicals has no demo."""
    globs = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]["chronicals"]
    for name in ("train.jsonl", "heldout.jsonl"):
        assert any(fnmatch.fnmatch(f"demo_data/{name}", g) for g in globs), f"{name} not matched by {globs}"
