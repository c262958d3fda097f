"""Session 26's audit of chronicals eval and the QA scoring: a --system-prompt equal to the default text was dropped
for a file other than demo; a QA file's bad records vanished from the summary and --json; a long but valid --json
name failed after scoring; keywords matched with lower() (not Unicode case folding); a warning named the deleted
temporary chat copy."""

from __future__ import annotations

import json
import logging

import pytest

from chronicals.cli import main
from chronicals.config import DEMO_SYSTEM_PROMPT
from chronicals.train.qa import demo_file

QUICK = ["--max-new-tokens", "1", "--device", "cpu"]


@pytest.fixture()
def qa3(tmp_path):
    path = tmp_path / "qa3.jsonl"
    path.write_text("".join(demo_file("heldout.jsonl").read_text().splitlines(keepends=True)[:3]))
    return path


def test_a_system_prompt_given_is_used_even_when_it_is_the_default_text(tiny_base, qa3, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(tiny_base), str(qa3), *QUICK, "--json", str(out)]) == 0
    plain = json.loads(out.read_text())
    assert plain["qa"]["system_prompt"] == ""  # beside a file other than demo: none, as train asks
    assert main(["eval", "--model", str(tiny_base), str(qa3), *QUICK, "--json", str(out),
                 "--system-prompt", DEMO_SYSTEM_PROMPT]) == 0
    given = json.loads(out.read_text())
    assert given["qa"]["system_prompt"] == DEMO_SYSTEM_PROMPT and given["loss"] != plain["loss"]
    assert f"system message {DEMO_SYSTEM_PROMPT!r}" in capsys.readouterr().out


def test_a_qa_files_bad_records_are_counted_in_the_summary_and_json(tiny_base, qa3, tmp_path, capsys):
    bad = tmp_path / "qa_bad.jsonl"
    bad.write_text(qa3.read_text() + '{"question": "x"}\nnot json\n')
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(tiny_base), str(bad), *QUICK, "--on-error", "skip", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "3 examples of 5 records" in said and "2 bad records skipped" in said, said
    got = json.loads(out.read_text())
    assert (got["examples"], got["records"]) == (3, 5)


def test_a_long_json_name_is_written(tiny_base, qa3, tmp_path):
    """A 250-byte name is valid; the temporary '.<name>.tmp-<pid>' beside it was not (File name too long)."""
    out = tmp_path / ("e" * 245 + ".json")
    assert main(["eval", "--model", str(tiny_base), str(qa3), *QUICK, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["examples"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_keywords_match_by_unicode_case_folding():
    from chronicals.train import qa

    assert qa._fold("Straße") in qa._fold("IN DER STRASSE")
    assert qa._fold("Café") in qa._fold("CAFE\u0301 au lait")  # composed and decomposed accents alike


def test_warnings_about_a_qa_file_do_not_name_the_deleted_copy(tiny_base, tmp_path, caplog):
    long_q = tmp_path / "qa_long.jsonl"
    long_q.write_text(json.dumps({"question": "q1", "answer": "a1"}) + "\n"
                      + json.dumps({"question": "long " * 60, "answer": "a2"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        assert main(["eval", "--model", str(tiny_base), str(long_q), *QUICK, "--max-seq-len", "40"]) == 0
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "chronicals.data")
    assert said and "chronicals-eval-" not in said, said
