"""A cache entry whose safetensors file was damaged after it was published (truncated by a full disk under a copy
of the cache, zeroed, removed) is converted again on the next load, with a warning; an intact one is reused."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import save_file
from test_gguf import _tiny
from test_gguf_cache_prune import _write

from chronicals.models import gguf_cache, gguf_io
from chronicals.models.hf_io import load_hf_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHRONICALS_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny(tiny_hf_config):
    return _tiny(tiny_hf_config, "llama2")


def _truncate(f):
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)


def _zero_header(f):
    with open(f, "r+b") as fh:
        fh.write(b"\0" * 64)


@pytest.mark.parametrize("damage", [_truncate, _zero_header, os.remove], ids=["truncated", "zeroed", "removed"])
def test_a_damaged_entry_is_converted_again(tmp_path, cache, tiny, caplog, damage):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    want = load_hf_dir(out, dtype=torch.float32).state_dict()
    damage(out / "model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chronicals.models.gguf_cache"):
        again = gguf_io.cached_gguf_dir(path)
    assert again == out
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and str(path.resolve()) in said[0] and "converting it again" in said[0], said
    got = load_hf_dir(again, dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [d.name for d in out.parent.iterdir()] == [out.name]  # the damaged copy is gone, not left aside


def test_an_intact_entry_is_reused_without_a_word(tmp_path, cache, tiny, caplog, monkeypatch):
    path = tmp_path / "m.gguf"
    _write(path, tiny)
    out = gguf_io.cached_gguf_dir(path)
    monkeypatch.setattr(gguf_io, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    with caplog.at_level(logging.WARNING, logger="chronicals.models.gguf_cache"):
        assert gguf_io.cached_gguf_dir(path) == out
    assert gguf_cache._damage(out) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_trailing_bytes_after_the_tensors_are_damage(tmp_path):
    """A cached safetensors file longer than its header says (bytes after the tensors, as a copy into an existing
    larger file leaves) is damage: safetensors refuses to load it, so the entry is converted again."""
    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(f))
    assert gguf_cache._damage(tmp_path) is None  # intact
    with open(f, "ab") as fh:
        fh.write(b"\0" * 16)
    why = gguf_cache._damage(tmp_path)
    assert why is not None and "model.safetensors" in why
