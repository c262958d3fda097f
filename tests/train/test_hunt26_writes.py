"""Session 26's audit of the writers under failures: config.yaml and loss.png were rewritten in place (a full disk
left them empty or cut off, and chat then read an empty config as "every key at its default"); a rerun after a
failed final save drew no loss.png; killed writers' temporary files (metrics.jsonl, the data copies, tokenization
cache entries) piled up for ever; a bench worker's cut-off row ended the whole bench with a bare JSON error."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest
from train_helpers import SyntheticLoader, full_disk_for, tiny_config, tiny_model

from chronicals._jsonio import temp_beside, write_text_atomic
from chronicals.train import train

fcntl = pytest.importorskip("fcntl")


def _run(tmp_path, docs, **over):
    return train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))


def test_a_full_disk_keeps_the_runs_config_yaml(tmp_path, docs, monkeypatch):
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1, data__system_prompt="MY SYSTEM PROMPT")
    cfg = tmp_path / "run" / "config.yaml"
    good = cfg.read_text()
    with monkeypatch.context() as m:
        full_disk_for(m, "config.yaml")
        with pytest.raises(OSError, match="No space left"):
            _run(tmp_path, docs, train__max_steps=4, train__save_every=1, train__resume="auto",
                 data__system_prompt="MY SYSTEM PROMPT")
    assert cfg.read_text() == good
    assert [p.name for p in cfg.parent.iterdir() if p.name.startswith(".config")] == []


def test_a_failed_plot_keeps_the_earlier_curve(tmp_path, docs, monkeypatch):
    import matplotlib.figure

    _run(tmp_path, docs, train__max_steps=2, logging__plot=True)
    png = tmp_path / "run" / "loss.png"
    good = png.read_bytes()

    def half_then_full(self, fname, *a, **k):
        fname.write(good[:1000])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_full)
    res = _run(tmp_path, docs, train__max_steps=3, train__resume="auto", logging__plot=True)
    assert res.status == "completed" and res.plot is None
    assert png.read_bytes() == good


def test_a_rerun_after_a_failed_final_save_draws_the_curve(tmp_path, docs, monkeypatch):
    import chronicals.train.loop as loop

    real = loop.save_final

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "save_final", full_disk)
    with pytest.raises(OSError):
        _run(tmp_path, docs, train__max_steps=2, train__save_final=True, logging__plot=True)
    monkeypatch.setattr(loop, "save_final", real)
    png = tmp_path / "run" / "loss.png"
    png.unlink(missing_ok=True)  # wherever the failed run stopped, the rerun must draw it
    res = _run(tmp_path, docs, train__max_steps=2, train__save_final=True, train__resume="auto", logging__plot=True)
    assert res.plot == png and png.read_bytes()[:4] == b"\x89PNG"


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "metrics.jsonl"
    dead = temp_beside(target).with_name(temp_beside(target).name.rsplit("-", 1)[0] + "-999999")
    dead.write_text("half")
    old = time.time() - 3600
    os.utime(dead, (old, old))
    young = dead.with_name(dead.name[:-1] + "8")
    young.write_text("half")  # a writer that may not hold its lock yet: kept
    live = dead.with_name(dead.name[:-1] + "7")
    live.write_text("half")
    os.utime(live, (old, old))
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer
    try:
        write_text_atomic(target, "whole\n")
    finally:
        os.close(fd)
    assert target.read_text() == "whole\n"
    assert not dead.exists() and young.exists() and live.exists()


def test_a_killed_cache_writers_entry_is_removed_by_the_next_save(tmp_path):
    from chronicals.data import cache

    dead = tmp_path / ".tmp-dead"
    dead.mkdir()
    (dead / cache.WRITER_LOCK).write_text("")
    (dead / "ids.npy").write_bytes(b"x" * 1000)
    legacy = tmp_path / ".tmp-nolock"  # no lock file: not known to be ours, left alone
    legacy.mkdir()
    ids = np.arange(5, dtype=np.int32)
    cache.save(tmp_path / "entry", ids, np.ones(5, bool), np.array([0, 5], np.int64), {"version": 0})
    assert not dead.exists() and legacy.exists()
    assert (tmp_path / "entry" / "meta.json").is_file() and not (tmp_path / "entry" / cache.WRITER_LOCK).exists()


def test_a_cut_off_worker_row_fails_that_row_not_the_bench(tmp_path, monkeypatch):
    import subprocess

    from chronicals.bench import cli as bench_cli
    from chronicals.bench.protocol import RunSpec

    def cut_off(cmd, **kw):
        out = Path(cmd[cmd.index("--json-out") + 1])
        out.write_text('{"contender": "chronicals-full", "status": "o')
        return subprocess.CompletedProcess(cmd, 1, "", "OSError: [Errno 28] No space left on device\n")

    monkeypatch.setattr(bench_cli.subprocess, "run", cut_off)
    runner = bench_cli.Runner(timeout=10)
    row = runner.run("train", RunSpec(contender="chronicals-full", shape="tiny", device="cpu"))
    assert row["status"] == "crashed" and "unreadable" in row["reason"] and "No space left" in row["reason"]
