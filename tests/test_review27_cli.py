"""Mutation testing (session 27): eval notes that --system-prompt changes nothing without question/answer records,
export --no-merge records a relative --base as an absolute path (chat/eval elsewhere find it), and the flags checked
against the model's context are refused one token past it, exactly."""

from __future__ import annotations

import argparse
import json
import types

import pytest

from chronicals import load_model
from chronicals.cli import main
from chronicals.cli_models import _within_context
from chronicals.lora import apply_lora, save_adapter


def test_system_prompt_without_qa_records_is_noted(tiny_base, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there"},
                                             {"role": "assistant", "content": "Hello, how can I help?"}]}) + "\n")
    assert main(["eval", "--model", str(tiny_base), str(data), "--device", "cpu", "--system-prompt", "Be brief."]) == 0
    err = capsys.readouterr().err
    assert "note: --system-prompt has no effect" in err and "holds no question/answer records" in err
    assert main(["eval", "--model", str(tiny_base), str(data), "--device", "cpu"]) == 0  # not given: no note
    assert "has no effect" not in capsys.readouterr().err


def test_no_merge_records_a_relative_base_as_an_absolute_path(tiny_base, tmp_path, monkeypatch, capsys):
    model, _ = load_model(tiny_base, tokenizer=False)
    apply_lora(model, r=2, alpha=4)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tiny_base))
    monkeypatch.chdir(tiny_base.parent)
    out = tmp_path / "exported"
    assert main(["export", "--no-merge", "--base", tiny_base.name, "--adapter", str(adapter), "--out", str(out)]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_base.resolve())


def _model(context):
    return types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=context))


def test_one_past_the_context_exits_2_and_the_context_itself_passes(capsys):
    p = argparse.ArgumentParser(prog="chronicals eval")
    _within_context(p, _model(512), "m", ("--max-seq-len", 512), ("--max-new-tokens", 512))  # no exit
    with pytest.raises(SystemExit) as e:
        _within_context(p, _model(512), "m", ("--max-seq-len", 64), ("--max-new-tokens", 513))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 513 is more than m can attend to (max_position_embeddings=512); use at most 512" in err
