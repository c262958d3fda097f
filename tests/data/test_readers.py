"""Readers on valid input that naive line splitting gets wrong (no tokenizer needed)."""

import json

from chronicals.data.readers import read_file


def test_jsonl_keeps_unicode_line_separators_inside_strings(tmp_path):
    # JSON allows U+2028 / U+2029 / U+0085 unescaped in strings; json.dumps(ensure_ascii=False) writes them raw
    rows = [{"text": "a\u2028b"}, {"text": "c\u2029d\x85e"}, {"text": "plain"}]
    p = tmp_path / "u.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    recs = read_file(p)
    assert [r.error for r in recs] == [None] * 3
    assert [r.data for r in recs] == rows
    assert [r.where for r in recs] == [f"{p}:{i}" for i in (1, 2, 3)]
