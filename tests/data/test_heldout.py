"""Held-out data: build_loaders reads QA files as chat whatever data.format says, and its errors say which set;
read_qa takes question/answer records from .jsonl or .json files only; a held-out file inside (or equal to)
data.path is refused, as it would be trained on as well."""

import json
import logging

import pytest

from chronicals.config import ConfigError, load_config
from chronicals.data import DataError
from chronicals.train.guards import check_data_paths
from chronicals.train.setup import build_loaders

ALPACA = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(4)]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_for(tmp_path, *args):
    return load_config(None, ["data.max_seq_len=64", "data.cache_dir=none", "eval.qa=false",
                              f"train.out_dir={tmp_path / 'run'}", *args])


def test_qa_heldout_is_read_as_chat_whatever_the_train_format(tokenizer, tmp_path):
    train = write(tmp_path / "alpaca.jsonl", ALPACA)
    qa = write(tmp_path / "qa.jsonl", [{"question": "Capital of France?", "answer": "Paris"}])
    cfg = cfg_for(tmp_path, f"data.path={train}", "data.format=alpaca", f"data.eval_path={qa}")
    _, eval_loader, heldout = build_loaders(cfg, tokenizer, tmp_path / "run")
    assert heldout == [{"question": "Capital of France?", "answer": "Paris", "keywords": ["Paris"]}]
    assert len(eval_loader.dataset) == 1


def test_errors_name_the_set_and_the_users_file(tokenizer, tmp_path):
    train = write(tmp_path / "alpaca.jsonl", ALPACA)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = cfg_for(tmp_path, f"data.path={train}", f"data.eval_path={empty}")
    with pytest.raises(DataError, match=rf"^the held-out set is empty: no records in {empty} "):
        build_loaders(cfg, tokenizer, tmp_path / "run")
    noasst = write(tmp_path / "noasst.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    cfg = cfg_for(tmp_path, f"data.path={train}", f"data.eval_path={noasst}")
    with pytest.raises(DataError, match=rf"^no example has a trainable token in the held-out set \({noasst}\)"):
        build_loaders(cfg, tokenizer, tmp_path / "run")
    cfg = cfg_for(tmp_path, f"data.path={noasst}")
    with pytest.raises(DataError, match=rf"^no example has a trainable token in the training set \({noasst}\)"):
        build_loaders(cfg, tokenizer, tmp_path / "run")
    bad = write(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}])
    cfg = cfg_for(tmp_path, f"data.path={train}", f"data.eval_path={bad}")
    with pytest.raises(DataError, match=rf"^the held-out set: {bad}:1: messages\[0\] has no 'content'"):
        build_loaders(cfg, tokenizer, tmp_path / "run")
    qa = write(tmp_path / "qa.jsonl", [{"question": "q?", "answer": 5}])
    cfg = cfg_for(tmp_path, f"data.path={train}", f"data.eval_path={qa}")
    with pytest.raises(DataError, match=rf"^{qa}:1: 'answer' is an int, expected a string"):
        build_loaders(cfg, tokenizer, tmp_path / "run")


def test_system_prompt_warning_for_user_data(tokenizer, tmp_path, caplog):
    train = write(tmp_path / "alpaca.jsonl", ALPACA)
    for args, warned in (([], False), (["data.system_prompt="], False), (["data.system_prompt=Be terse."], True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.train"):
            build_loaders(cfg_for(tmp_path, f"data.path={train}", *args), tokenizer, tmp_path / "run")
        msgs = [r.getMessage() for r in caplog.records if "system_prompt" in r.getMessage()]
        assert bool(msgs) == warned and (not msgs or "has no effect on your training records" in msgs[0])


def test_a_qa_heldout_file_beside_user_data_gets_the_training_records_system_message(tokenizer, tmp_path):
    """The user's records without a system message are rendered with the template's default one: the held-out QA
    records (and the QA prompts, same helper) get no system message of ours either, unless data.system_prompt is set;
    with the demo data they keep the demo's, which its training records carry too."""
    from chronicals.config import DEMO_SYSTEM_PROMPT
    from chronicals.train.qa import heldout_system_prompt

    train = write(tmp_path / "alpaca.jsonl", ALPACA)
    qa = write(tmp_path / "qa.jsonl", [{"question": "q?", "answer": "a"}])
    for args, system in (([], None), (["data.system_prompt=Be terse."], "Be terse.")):
        cfg = cfg_for(tmp_path, f"data.path={train}", f"data.eval_path={qa}", *args)
        build_loaders(cfg, tokenizer, tmp_path / "run")
        msgs = json.loads((tmp_path / "run" / "data" / "heldout.jsonl").read_text().splitlines()[0])["messages"]
        assert (msgs[0]["content"] if msgs[0]["role"] == "system" else None) == system
        assert heldout_system_prompt(cfg.data) == (system or "")
    assert heldout_system_prompt(cfg_for(tmp_path, "data.path=demo").data) == DEMO_SYSTEM_PROMPT


def test_qa_heldout_in_csv_or_a_directory_says_to_convert(tmp_path):
    from chronicals.train.qa import read_qa

    p = tmp_path / "qa.csv"
    p.write_text("question,answer\nCapital of France?,Paris\n")
    with pytest.raises(DataError, match=rf"^{p}: question/answer held-out records are read from \.jsonl or "
                                        rf"\.json only; convert {p} "):
        read_qa(p)
    d = tmp_path / "qa_dir"
    d.mkdir()
    (d / "part-0.jsonl").write_text(json.dumps({"question": "a?", "answer": "b"}) + "\n")
    with pytest.raises(DataError, match=rf"^{d}: question/answer .*not a directory; set data.eval_path to "
                                        rf"{d / 'part-0.jsonl'} itself$"):
        read_qa(d)
    (d / "part-0.jsonl").write_text(json.dumps({"text": "plain held-out text"}) + "\n")  # not QA: read as data
    assert read_qa(d) is None
    p.write_text("prompt,completion\na,b\n")
    assert read_qa(p) is None and read_qa(tmp_path / "missing.csv") is None
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    q = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": ["a?"], "answer": ["b"]}), q)
    with pytest.raises(DataError, match=rf"^{q}: question/answer held-out records are read from"):
        read_qa(q)


def _text(path):
    path.write_text(json.dumps({"text": "hello world"}) + "\n")
    return path


def _cfg(tmp_path, *args):
    return load_config(None, ["model.path=/nonexistent/model", f"train.out_dir={tmp_path / 'run'}", *args])


def test_a_heldout_file_inside_or_equal_to_the_training_data_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    train = _text(tmp_path / "data" / "train.jsonl")
    (tmp_path / "data" / "sub").mkdir()
    held = _text(tmp_path / "data" / "sub" / "held.jsonl")
    with pytest.raises(ConfigError, match=r"data.eval_path=.*held.jsonl is inside data.path=.*data, whose files are "
                                          r"all read as training data, so it would be trained on"):
        check_data_paths(_cfg(tmp_path, f"data.path={tmp_path / 'data'}", f"data.eval_path={held}"))
    with pytest.raises(ConfigError, match=r"data.eval_path=.*train.jsonl is data.path=.*, which would be trained on"):
        check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={train}"))
    apart = _text(tmp_path / "held.jsonl")
    check_data_paths(_cfg(tmp_path, f"data.path={tmp_path / 'data'}", f"data.eval_path={apart}"))
    check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={held}"))  # a file beside a file
    # the other way round: a held-out directory that holds the training file (was accepted)
    with pytest.raises(ConfigError, match=r"data.eval_path=.*data is a directory that holds data.path=.*train.jsonl, "
                                          r"and all its files are read as held-out data"):
        check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={tmp_path / 'data'}"))


def test_heldout_rows_are_packed_to_data_max_seq_len_as_training_rows_are(tokenizer, tmp_path):
    """The held-out loader packs rows of data.max_seq_len, as training does: the same records pack alike (wider
    rows would take more memory at eval time than training did)."""
    train = write(tmp_path / "alpaca.jsonl", ALPACA)
    heldout = write(tmp_path / "heldout.jsonl", ALPACA)
    cfg = cfg_for(tmp_path, f"data.path={train}", "data.format=alpaca", f"data.eval_path={heldout}")
    train_loader, eval_loader, _ = build_loaders(cfg, tokenizer, tmp_path / "run")
    assert eval_loader.stats["rows"] == train_loader.stats["rows"] > 1
    assert eval_loader.stats["slots"] == 64 * eval_loader.stats["rows"]
