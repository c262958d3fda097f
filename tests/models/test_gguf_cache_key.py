"""The GGUF conversion cache follows the file's identity, not only its size and mtime: a file rewritten in
place with the same size and an mtime put back (cp -p, touch -r, rsync -t) is converted again."""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import pytest
import torch
from test_gguf import _tiny, write_gguf

import chronicals
from chronicals.models import gguf_cache, gguf_io

pytestmark = pytest.mark.usefixtures("one_thread")


def _rewrite(path, data: bytes, mtime_ns: int) -> None:
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(data)
        f.truncate()
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_same_size_same_mtime_other_content_converts_again(tmp_path, tiny_hf_config):
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    st = path.stat()
    old, _ = chronicals.load_model(path, tokenizer=False)
    first = gguf_cache.cache_dir_for(path)
    assert (first / "config.json").is_file()

    other = tmp_path / "other.gguf"  # the same shapes, other weights: a file of the same size
    with torch.no_grad():
        sd = {k: v + 0.5 for k, v in model.state_dict().items()}
    write_gguf(other, "llama", cfg, sd, quantize=False)
    new_bytes = other.read_bytes()
    assert len(new_bytes) == st.st_size and new_bytes != path.read_bytes()
    _rewrite(path, new_bytes, st.st_mtime_ns)
    st2 = path.stat()
    assert (st2.st_size, st2.st_mtime_ns, st2.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)

    assert gguf_cache.cache_dir_for(path) != first
    new, _ = chronicals.load_model(path, tokenizer=False)
    w = "model.embed_tokens.weight"
    assert torch.equal(new.state_dict()[w], sd[w]) and not torch.equal(old.state_dict()[w], sd[w])


def test_same_size_same_mtime_replaced_file_converts_again(tmp_path, tiny_hf_config):
    """Another file moved over the old one (os.replace, mv): a new inode."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    st = path.stat()
    first = gguf_io.cached_gguf_dir(path)
    other = tmp_path / "other.gguf"
    with torch.no_grad():
        write_gguf(other, "llama", cfg, {k: v * 2 for k, v in model.state_dict().items()}, quantize=False)
    os.utime(other, ns=(st.st_mtime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert gguf_cache.cache_dir_for(path) != first
    assert gguf_io.cached_gguf_dir(path) != first



def test_two_loads_of_a_new_gguf_at_once_convert_it_once(tmp_path, tiny_hf_config):
    """Two processes loading one new GGUF both converted it in full: 2 x the model's size of temporary disk and
    the CPU time (an 8B file: ~32 GB each; a concurrency walk). The second waits for the first, then reads its
    conversion. (Two threads stand in for the processes: each opens the lock file itself, and flock locks of
    separate opens exclude each other.)"""
    import threading
    import time

    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    calls = []

    def slow_convert(*a, **k):
        calls.append(1)
        time.sleep(1.0)  # the second load arrives while this one converts
        return gguf_io.convert_gguf(*a, **k)

    outs = []

    def load():
        outs.append(gguf_cache.cached_conversion(path, slow_convert, gguf_io.convert_tokenizer))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(60)
    assert len(outs) == 2 and outs[0] == outs[1] and (outs[0] / "config.json").is_file()
    assert len(calls) == 1
    assert not list(outs[0].parent.glob(".*.lock"))  # the lock file goes with the conversion


def _stat(**fields):
    st = {"st_size": 100, "st_mtime_ns": 10**18, "st_ino": 7, "st_ctime_ns": 2 * 10**18}
    return SimpleNamespace(**{**st, **fields})


@pytest.mark.parametrize("field", ["st_size", "st_mtime_ns", "st_ino", "st_ctime_ns"])
def test_each_part_of_the_files_identity_moves_its_key(tmp_path, field):
    """Each part is needed: the inode tells a replacement of the same size, mtime and (on a file system with coarse
    timestamps) ctime from the file it replaced."""
    p = tmp_path / "m.gguf"
    assert gguf_cache._entry_dir(p, _stat()) != gguf_cache._entry_dir(p, _stat(**{field: getattr(_stat(), field) + 1}))


def test_an_entry_name_of_the_older_key_scheme_is_spelled_as_it_was_written(tmp_path):
    """Entries written before the inode and ctime joined the key are found by the name older chronicals gave them:
    sha256 of "path|size|mtime_ns|vN". The spelling is fixed here, not taken from _identity, so that a change to
    it cannot go unseen (those entries would never be pruned)."""
    p, st = tmp_path / "m.gguf", _stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|v3".encode()).hexdigest()[:16]
    assert gguf_cache._entry_name(p, gguf_cache._identity(p, st, 3, legacy=True)) == f"m-{key}"


def test_cache_dir_for_a_link_or_a_relative_path_is_the_entry_a_load_uses(tmp_path, tiny_hf_config, monkeypatch):
    cfg, model = _tiny(tiny_hf_config, "llama2")
    write_gguf(tmp_path / "m.gguf", "llama", cfg, model.state_dict(), quantize=False)
    (tmp_path / "link.gguf").symlink_to(tmp_path / "m.gguf")
    monkeypatch.chdir(tmp_path)
    entry = gguf_io.cached_gguf_dir("m.gguf")
    assert gguf_cache.cache_dir_for("m.gguf") == entry and gguf_cache.cache_dir_for("link.gguf") == entry


def test_a_file_system_without_flock_converts_unlocked(tmp_path, tiny_hf_config, no_flock):
    """flock failing with an OSError (ENOLCK on some network file systems) leaves the conversion unlocked; the load
    goes on."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    out = gguf_cache.cached_conversion(path, gguf_io.convert_gguf, gguf_io.convert_tokenizer)
    assert (out / "config.json").is_file()
