"""Defects a walk of ``chronicals eval`` found outside the eval code: each is one clear error (or a skip under
data.on_error=skip), never a traceback or advice that does not fit the caller."""

from __future__ import annotations

import pytest

from chronicals.cli import main
from chronicals.config import MAX_ROW_TOKENS


@pytest.mark.parametrize("override, key", [
    ("data.max_seq_len=99999999999999999999", "data.max_seq_len"),  # was OverflowError in packing, exit 4
    (f"data.max_seq_len={MAX_ROW_TOKENS + 1}", "data.max_seq_len"),
    ("data.tokens_per_batch=99999999999999999999", "data.tokens_per_batch"),
])
def test_a_row_past_the_token_bound_exits_2_before_any_model_loads(override, key, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert f"config {key}=" in err and f"{MAX_ROW_TOKENS}]" in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def tokenizer():
    from smollm2_tokenizer import smollm2_tokenizer

    return smollm2_tokenizer()


def _cfg(tmp_path, *overrides):
    from chronicals.config import load_config

    given = {o.split("=", 1)[0] for o in overrides}  # a key given twice is refused: an override replaces a default
    defaults = ["data.max_seq_len=16", "data.cache_dir=none", "eval.qa=false", f"train.out_dir={tmp_path / 'run'}"]
    return load_config(None, [d for d in defaults if d.split("=", 1)[0] not in given] + list(overrides))


def test_the_trainers_data_errors_name_config_keys_not_load_dataset(tokenizer, tmp_path):
    """Was "(raise data.max_seq_len or set data.on_long=truncate; in load_dataset: max_seq_len,
    overlong='truncate')" and "(data.on_error=skip, or load_dataset(on_error='skip'), drops ...)"."""
    from chronicals.data import DataError
    from chronicals.train.setup import build_loaders

    long = tmp_path / "long.jsonl"
    long.write_text('{"text": "' + "word " * 40 + '"}\n')
    with pytest.raises(DataError, match=r"\(raise data\.max_seq_len or set data\.on_long=truncate\)") as e:
        build_loaders(_cfg(tmp_path, f"data.path={long}", "data.on_long=drop", "data.eval_path="), tokenizer,
                      tmp_path / "run")
    assert "load_dataset" not in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r":2: invalid JSON .*\(data\.on_error=skip drops bad records") as e:
        build_loaders(_cfg(tmp_path, f"data.path={long}", f"data.eval_path={bad}"), tokenizer, tmp_path / "run")
    assert "load_dataset" not in str(e.value)


def test_a_qa_heldout_file_with_a_broken_line_trains_under_on_error_skip(tokenizer, tmp_path):
    from chronicals.train.setup import build_loaders

    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "hello there"}\n')
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n{broken\n')
    cfg = _cfg(tmp_path, f"data.path={train}", f"data.eval_path={qa}", "data.on_error=skip", "data.max_seq_len=64")
    _, eval_loader, heldout = build_loaders(cfg, tokenizer, tmp_path / "run")
    assert heldout == [{"question": "Capital of France?", "answer": "Paris", "keywords": ["Paris"]}]
    assert len(eval_loader.dataset) == 1


def test_evals_qa_loader_honors_on_error_skip(tokenizer, tmp_path):
    from chronicals.config import DataSection
    from chronicals.evaluate import heldout_loader

    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n{broken\n')
    loader, records = heldout_loader(DataSection(path=str(qa), on_error="skip", cache_dir="none"), tokenizer,
                                     tmp_path / "work")
    assert [r["answer"] for r in records] == ["Paris"] and len(loader.dataset) == 1


def test_a_qa_file_on_a_tokenizer_without_a_template_is_not_told_to_set_format_text(tokenizer, tmp_path):
    """Was "... to train on plain text instead, set data.format=text": QA records are chat whatever the format."""
    import copy

    from chronicals.config import DataSection
    from chronicals.evaluate import heldout_loader

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n')
    with pytest.raises(ValueError, match=r"no chat template.*; question/answer records are read as chat whatever "
                                         r"data\.format; to score this model without a template, give text") as e:
        heldout_loader(DataSection(path=str(qa), format="text", cache_dir="none"), plain, tmp_path / "work")
    assert "data.format=text" not in str(e.value)


def test_a_missing_adapter_directory_is_said_as_such(tmp_path):
    from chronicals.lora import read_adapter_config

    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path / 'nosuchdir'}: no such directory; an adapter is the "
                                                r"directory holding adapter_config\.json and") as e:
        read_adapter_config(tmp_path / "nosuchdir")
    assert "adapter_config.json: not found" not in str(e.value)


def test_an_adapter_directory_given_as_the_model_is_told_to_be_the_adapter(tmp_path):
    """Was "adapter/config.json: not found; a Hugging Face model directory needs one", no word of the adapter."""
    from chronicals.models import load_model

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    with pytest.raises(FileNotFoundError, match=rf"^{adapter / 'config.json'}: not found; this is a LoRA adapter "
                                                r"\(adapter_config\.json\), not a model: pass it as --adapter"):
        load_model(adapter)
    (adapter / "adapter_config.json").unlink()  # a plain folder without config.json: as before
    with pytest.raises(FileNotFoundError, match=r"config\.json: not found; a Hugging Face model directory needs one$"):
        load_model(adapter)


def test_a_run_directory_given_as_the_model_names_its_model_or_adapter(tmp_path):
    """--model runs/x said only "runs/x/config.json: not found; a Hugging Face model directory needs one"."""
    from chronicals.models import load_model

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    with pytest.raises(FileNotFoundError, match=rf"needs one; {run} is a run directory holding a LoRA adapter: "
                                                rf"pass --adapter {run / 'adapter'}"):
        load_model(run)
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError,
                       match=rf"needs one; {run} holds one in its model folder: pass {run / 'model'}"):
        load_model(run)
