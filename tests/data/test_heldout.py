"""build_loaders' held-out data: QA files are chat whatever data.format says; errors say which set."""

import json
import logging

import pytest

from chronicals.config import load_config
from chronicals.data import DataError
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
    with pytest.raises(DataError, match=rf"^{qa}:1: 'answer' is a int, expected a string"):
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
