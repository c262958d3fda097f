"""Defects a new user's walk through README.md and the CLI found (walk 17): each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

from chronicals.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="model.device=auto resolves to the GPU here")
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_model_impl_triton_on_a_cpu_exits_2_before_the_model_loads(device, tmp_path, monkeypatch, capsys):
    """model.impl=triton on a CPU was load_model's ValueError ("load_model: impl='triton' needs a CUDA tensor"),
    raised after the model had loaded and reported as bad input (exit 3); the README says a value this machine
    cannot run exits 2, before any model is loaded."""
    import chronicals.train.loop as loop

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before model.impl was checked")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(loop, "load_base", no_load)
    out = tmp_path / "run"
    assert main(["train", "model.impl=triton", f"model.device={device}", f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "model.impl=triton needs CUDA" in err and "model.impl=auto" in err, err
    assert "load_model" not in err and "Traceback" not in err, err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("layout", ["cache is a file", "gguf/ is a file"])
def test_a_gguf_cache_that_cannot_be_written_names_chronicals_cache(layout, tmp_path, monkeypatch, capsys):
    """A .gguf model with $CHRONICALS_CACHE (or ~/.cache/chronicals) not writable: a read-only home, a file in the
    way. It was a bare "error: [Errno 20] Not a directory: '.../gguf'" naming neither the setting nor the fix."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # never read: the cache folder fails first
    cache = tmp_path / "cache"
    if layout == "cache is a file":
        cache.write_text("")
    else:
        cache.mkdir()
        (cache / "gguf").write_text("")
    monkeypatch.setenv("CHRONICALS_CACHE", str(cache))
    assert main(["chat", "--model", str(model), "--device", "cpu", "hi"]) == 3
    err = capsys.readouterr().err
    assert f"{model}: cannot write its conversion" in err and "set CHRONICALS_CACHE to a writable directory" in err, err
    assert "[Errno" not in err and "Traceback" not in err, err


def test_evals_data_warnings_name_its_flags_not_config_keys(tiny_base, tmp_path, caplog):
    """chronicals eval's errors said --on-long / --max-seq-len, but its warnings still said the config keys:
    "1 longer than max_seq_len=16 (dropped, data.on_long=drop)", "raise data.max_seq_len", which eval has no
    way to set."""
    import json

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("short one", "word " * 60, "another short")))
    with caplog.at_level("WARNING", logger="chronicals.data"):
        assert main(["eval", "--model", str(tiny_base), "--device", "cpu", "--max-seq-len", "16", "--on-long", "drop",
                     "--cache-dir", "none", str(data)]) == 0
    said = caplog.text
    assert "--on-long=drop" in said, said
    assert "data.on_long" not in said and "data.max_seq_len" not in said, said


def test_a_data_directorys_unread_files_are_warned_about_once(tiny_base, tmp_path, caplog):
    """chronicals eval DIR (and train's data.eval_path=DIR) printed "DIR: 1 file not read: x.jsonl.gz ..." twice:
    once from the peek for question/answer records, once from the load."""
    import json

    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (d / "b.jsonl.gz").write_bytes(b"")
    with caplog.at_level("WARNING", logger="chronicals.data"):
        assert main(["eval", "--model", str(tiny_base), "--device", "cpu", "--cache-dir", "none", str(d)]) == 0
    assert caplog.text.count("1 file not read") == 1, caplog.text


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag(flag, capsys):
    """`chronicals --version`, what a user of any pip-installed CLI tries first, was "unknown command", exit 2."""
    import chronicals

    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == f"chronicals {chronicals.__version__}"
