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
