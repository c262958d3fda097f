"""The checks before the model loads (train.guards), on paths: a short model name in another case, out_dir or the
cache reached through a link into the data or equal to it, an earlier run's chat copy of its held-out questions, the
early "needs pyarrow" walk of a data directory, a linked adapter folder beside train.resume=auto, the
loss_vocab_parts warning on the reference head and model.impl=triton on a CPU; and the checks of the tokenized
data before the first step: the set the token-id and document-length checks name."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chronicals.config import ConfigError, load_config
from chronicals.data.readers import DataError
from chronicals.data.files import resolve_files
from chronicals.train.guards import (check_data_paths, check_document_lengths, check_impl, check_model_path,
                                     check_resume_path, check_token_ids, lies_in)

from train_helpers import tiny_config


def _cfg(tmp_path, *args, out_dir=None, cache_dir="none"):
    return load_config(None, ["model.path=/nonexistent/model", f"data.cache_dir={cache_dir}",
                              f"train.out_dir={out_dir or tmp_path / 'run'}", *args])


def _chat(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello"}]}) + "\n")
    return path


def test_a_short_model_name_in_another_case_is_no_missing_path():
    """load_model takes a short name in any case (model.path=SmolLM2-135M-Instruct, as the model card spells it):
    the early check must not call it "no such file or directory" and stop the run."""
    check_model_path(load_config(None, ["model.path=SmolLM2-135M-Instruct"]))
    check_model_path(load_config(None, ["model.path=SMOLLM2-135M-INSTRUCT"]))


def test_an_out_dir_or_cache_inside_the_data_through_a_link_is_refused(tmp_path):
    """train.out_dir (or data.cache_dir) given through a link into data.path's directory is inside it: its
    metrics.jsonl, data/ copies and checkpoints would be read as training records on the next run."""
    data = tmp_path / "data"
    _chat(data / "train.jsonl")
    (tmp_path / "link").symlink_to(data, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"train.out_dir=.*link.*run is inside data.path="):
        check_data_paths(_cfg(tmp_path, f"data.path={data}", out_dir=tmp_path / "link" / "run"))
    with pytest.raises(ConfigError, match=r"data.cache_dir=.*link.*cache is inside data.path="):
        check_data_paths(_cfg(tmp_path, f"data.path={data}", cache_dir=tmp_path / "link" / "cache"))


def test_an_out_dir_or_cache_equal_to_the_data_directory_is_refused(tmp_path):
    """train.out_dir (or data.cache_dir) that IS data.path's directory, not only a folder below it, is refused too:
    the directory is read whole, so the run's metrics.jsonl, data/ copies and checkpoints (or the cache's files)
    would be read as training records on the next run. lies_in counts the folder itself as in it."""
    data = tmp_path / "data"
    _chat(data / "train.jsonl")
    assert lies_in(data, data) and lies_in(data / "x", data) and not lies_in(tmp_path, data)
    with pytest.raises(ConfigError, match=rf"train.out_dir={data} is inside data.path={data}") as e:
        check_data_paths(_cfg(tmp_path, f"data.path={data}", out_dir=data))
    assert e.value.key == "train.out_dir"
    with pytest.raises(ConfigError, match=rf"data.cache_dir={data} is inside data.path={data}"):
        check_data_paths(_cfg(tmp_path, f"data.path={data}", cache_dir=data))


def _no_pyarrow(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)


def test_a_parquet_folder_before_a_jsonl_folder_needs_pyarrow_before_the_model_loads(tmp_path, monkeypatch):
    """Without pyarrow, a data directory whose first folder (sorted, top-down) holds a .parquet file is refused
    early, naming that file: a later sibling folder holding only .jsonl must not hide it (the walk went on and
    forgot it), or the run loads the model first and fails in the reader minutes later."""
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    (data / "a" / "part.parquet").write_bytes(b"PAR1")  # never opened: the import fails first
    _chat(data / "b" / "more.jsonl")
    _no_pyarrow(monkeypatch)
    with pytest.raises(DataError, match=rf"^{data / 'a' / 'part.parquet'}: reading \.parquet files needs pyarrow"):
        check_data_paths(_cfg(tmp_path, f"data.path={data}"))


def test_an_upper_case_parquet_data_path_needs_pyarrow_before_the_model_loads(tmp_path, monkeypatch):
    """data.path=TRAIN.PARQUET: the reader's suffixes are case-insensitive, so the early "needs pyarrow" check is
    too; matching .parquet alone let the run load the model first and fail in the reader."""
    f = tmp_path / "TRAIN.PARQUET"
    f.write_bytes(b"PAR1")
    _no_pyarrow(monkeypatch)
    with pytest.raises(DataError, match=r"TRAIN\.PARQUET: reading \.PARQUET files needs pyarrow"):
        check_data_paths(_cfg(tmp_path, f"data.path={f}"))


def test_a_parquet_dot_file_or_file_in_a_dot_folder_of_the_data_needs_no_pyarrow(tmp_path, monkeypatch):
    """The early "needs pyarrow" walk skips dot-folders and dot-files as the data reader does: a .cache/ (or .git/)
    holding a .parquet file, or a .old.parquet, inside a .jsonl data directory is never read, so the run is not
    refused for a pyarrow it does not need."""
    data = tmp_path / "data"
    (data / ".cache").mkdir(parents=True)
    (data / ".cache" / "old.parquet").write_bytes(b"PAR1")
    (data / ".old.parquet").write_bytes(b"PAR1")
    _chat(data / "train.jsonl")
    assert [p.name for p in resolve_files(str(data), quiet=True)] == ["train.jsonl"]  # what the reader reads
    _no_pyarrow(monkeypatch)
    check_data_paths(_cfg(tmp_path, f"data.path={data}"))


def test_an_earlier_runs_chat_heldout_copy_is_accepted_as_eval_path(tmp_path):
    """out_dir/data/heldout.jsonl in chat format (an earlier run's own chat copy of its questions, given back as
    data.eval_path) is read in place, never overwritten, so it is not refused; a QA file there still is."""
    train = _chat(tmp_path / "train.jsonl")
    copy = _chat(tmp_path / "run" / "data" / "heldout.jsonl")
    check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={copy}"))
    copy.write_text(json.dumps({"question": "Who?", "answer": "Ida"}) + "\n")
    with pytest.raises(ConfigError, match="where this run writes its chat copy"):
        check_data_paths(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={copy}"))


def test_resume_auto_beside_a_linked_adapter_folder_starts(tmp_path):
    """out_dir/adapter as a link to an adapter kept elsewhere is no earlier final of this out_dir (a new run never
    deletes it), so train.resume=auto with no checkpoint starts; a real adapter folder there is refused."""
    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "adapter_config.json").write_text("{}")
    (out / "adapter").symlink_to(tmp_path / "kept", target_is_directory=True)
    check_resume_path(_cfg(tmp_path, "train.resume=auto"))
    (out / "adapter").unlink()
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds an earlier run's adapter/"):
        check_resume_path(_cfg(tmp_path, "train.resume=auto"))


def test_loss_vocab_parts_2_on_the_reference_head_is_said(tmp_path, caplog):
    """model.loss_vocab_parts=2, the smallest split, does nothing on the PyTorch head either: the warning comes for
    it too, or a user who set it to save memory learns only from an out-of-memory error that it never applied. The
    default 1 asks for no split, so it is not said (a warning at >= 1 came on every reference-head run)."""
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(tiny_config(tmp_path, model__loss_vocab_parts=2, model__impl="torch"), torch.device("cpu"))
    assert "model.loss_vocab_parts=2 does nothing with model.impl=torch" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals"):
        check_impl(tiny_config(tmp_path, model__impl="torch"), torch.device("cpu"))  # the default, 1: no split asked
    assert "loss_vocab_parts" not in caplog.text


def test_impl_triton_on_a_cpu_is_accepted_under_the_interpreter_only(tmp_path, monkeypatch):
    """model.impl=triton on a CPU runs the kernels in Triton's interpreter with TRITON_INTERPRET=1 (as this suite
    does), so it is accepted there; without it the setting is a ConfigError naming the fix. Refusing it under the
    interpreter too stopped every CPU run of the Triton kernels."""
    cfg = tiny_config(tmp_path, model__impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_impl(cfg, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"model.impl=triton needs CUDA, but this run's device is cpu .*"
                                          r"set TRITON_INTERPRET=1"):
        check_impl(cfg, torch.device("cpu"))


def test_a_relative_heldout_file_inside_relative_training_data_is_refused(tmp_path, monkeypatch):
    """data.path=data and data.eval_path=data/sub/held.jsonl, relative to the working directory as users write
    them: the held-out file is read as training data too, and its held-out loss would be measured on trained
    examples. Compared unresolved, the two spellings never matched and the run trained on its held-out set."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "sub").mkdir(parents=True)
    for f in ("data/train.jsonl", "data/sub/held.jsonl"):
        (tmp_path / f).write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(ConfigError, match=r"data.eval_path=data/sub/held.jsonl is inside data.path=data"):
        check_data_paths(_cfg(tmp_path, "data.path=data", "data.eval_path=data/sub/held.jsonl"))
    with pytest.raises(ConfigError, match=r"is data.path=data/train.jsonl, which would be trained on"):
        check_data_paths(_cfg(tmp_path, "data.path=data/train.jsonl", "data.eval_path=./data/train.jsonl"))


def _loader(**dataset):
    return SimpleNamespace(dataset=SimpleNamespace(**dataset))


def test_a_token_id_past_the_vocabulary_names_its_set_and_a_set_without_tokens_is_skipped():
    """check_token_ids names the set that holds the id ("the held-out data holds token id 61", not the training
    data), and skips a set with no tokens at all (an empty ids array), where numpy's max of nothing raised."""
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=61))
    ok, bad, empty = (_loader(ids=np.array(x, dtype=np.int64)) for x in ([0, 5, 60], [3, 61, 2], []))
    check_token_ids(model, ok, ok)
    check_token_ids(model, empty, empty)
    with pytest.raises(ValueError, match=r"^the held-out data holds token id 61, but the model's vocabulary has 61"):
        check_token_ids(model, empty, bad)
    with pytest.raises(ValueError, match=r"^the training data holds token id 61, but"):
        check_token_ids(model, bad, ok)


class _WindowModel:
    def check_sequence_length(self, n):
        if n > 10:
            raise ValueError(f"{n} tokens are past the sliding window of 10")


def test_the_longest_document_check_names_its_set_and_document_from_1():
    """check_document_lengths numbers the longest document from 1 ("number 2 of 3"), gives the data.system_prompt
    hint with the held-out set only (its question files hold the system prompt; the training data's do not), and
    skips a set with no documents, where numpy's argmax of nothing raised."""
    ok, long, empty = (_loader(lengths=np.array(x, dtype=np.int64)) for x in ([3, 4], [5, 12, 7], []))
    check_document_lengths(_WindowModel(), ok, ok)
    check_document_lengths(_WindowModel(), empty, empty)
    with pytest.raises(ValueError) as e:
        check_document_lengths(_WindowModel(), long, ok)
    assert str(e.value) == ("the training data's longest document (number 2 of 3, 12 tokens after data.on_long) does "
                            "not fit this model: 12 tokens are past the sliding window of 10")
    with pytest.raises(ValueError) as e:
        check_document_lengths(_WindowModel(), ok, long)
    assert str(e.value).startswith("the held-out data's longest document (number 2 of 3, 12 tokens after "
                                   "data.on_long) does not fit this model: 12 tokens are past the sliding window of 10")
    assert "documents hold data.system_prompt as their system message" in str(e.value)
    for first in (empty, _loader()):  # a training set with no documents, or no lengths: the held-out set still checked
        with pytest.raises(ValueError, match="^the held-out data's longest document"):
            check_document_lengths(_WindowModel(), first, long)
