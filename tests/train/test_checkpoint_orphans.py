"""A run killed mid-write (SIGKILL, OOM) leaves ``checkpoints/.tmp-step-N-{pid}`` and ``.model.tmp-{pid}-*``
behind, each with a lock file nobody holds: the next write into the same place removes them, and never touches
a live writer's temporaries (its lock is held: models/orphans.py) or names that are not ours. The same holds for the
temporaries of the atomic file writes (metrics.jsonl, the data copies) and of tokenization cache entries."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from chronicals._jsonio import temp_beside, write_text_atomic
from chronicals.models.orphans import lock_path, writer_lock
from chronicals.train import checkpoint as ckpt
from chronicals.train import train

from train_helpers import SyntheticLoader, tiny_config, tiny_model

fcntl = pytest.importorskip("fcntl")


@pytest.fixture(scope="module")
def dead_pid() -> int:
    return 4242  # any: only the lock tells a live writer from a killed one


def _partial(path, nbytes: int = 1000, lock: bool = True):
    """A temporary checkpoint directory as a killed write leaves it: a truncated state.pt and a free lock file."""
    path.mkdir(parents=True)
    (path / ckpt.STATE_FILE).write_bytes(b"\0" * nbytes)
    if lock:
        lock_path(path).touch()
    return path


class _Opt:
    """An optimizer / scheduler stand-in: snapshot() needs only state_dict()."""

    def state_dict(self) -> dict:
        return {}


def _state(step: int) -> dict:
    return {"step": step, "model": {}, "optimizer": {}, "scheduler": {}, "data": {}, "rng": {}, "extra": {}}


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_write_removes_dead_writers_temporaries_only(tmp_path, dead_pid, background, caplog):
    root = tmp_path / "checkpoints"
    dead = _partial(root / f".tmp-step-000004-{dead_pid}", nbytes=2_500_000)
    others = [_partial(root / name) for name in (f".tmp-foo-{dead_pid}", ".tmp-step-000004-abc", "notes",
                                                   f"tmp-step-000004-{dead_pid}", f".tmp-step-000004-{dead_pid}.bak")]
    writer = ckpt.CheckpointWriter(background=background)
    live = root / f".tmp-step-000006-{os.getpid()}"
    with writer_lock(live), caplog.at_level(logging.INFO, logger="chronicals.train"):
        live.mkdir()  # a write in flight (this process's other thread, or another process)
        writer.save(tmp_path, 2, tiny_model(), _Opt(), _Opt(), {})
        writer.wait()
        assert live.is_dir()
    assert not dead.exists()
    assert all(p.is_dir() for p in others)
    assert [d.name for d in ckpt.checkpoint_dirs(tmp_path)] == ["step-000002"]
    removed = [r.getMessage() for r in caplog.records if r.name == "chronicals.train" and "removed" in r.getMessage()]
    assert len(removed) == 1 and dead.name in removed[0] and "2.5 MB" in removed[0]


def test_write_checkpoint_leaves_temporaries_without_a_lock_file(tmp_path):
    """Without its lock file a directory is not known to be a killed write of ours (or predates the locks)."""
    unknown = _partial(tmp_path / "checkpoints" / ".tmp-step-000004-4242", lock=False)
    ckpt.write_checkpoint(tmp_path, _state(2))
    assert unknown.is_dir()


def test_a_run_after_a_killed_one_clears_its_checkpoint_and_final_model_temporaries(tmp_path, docs, dead_pid):
    """The reported case: a run killed while writing step 4's checkpoint (and one killed while writing the final
    model); the next run in the same out_dir removes both once it writes its own, and finishes."""
    cfg = tiny_config(tmp_path, train__save_every=2, train__max_steps=2, train__resume="auto",
                      train__save_final=True)
    out = tmp_path / "run"
    ck_orphan = _partial(out / "checkpoints" / f".tmp-step-000004-{dead_pid}")
    model_orphan = _partial(out / f".model.tmp-{dead_pid}-0a1b2c3d")
    res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs, seed=1))
    assert res.status == "completed" and (out / "model" / "config.json").is_file()
    assert not ck_orphan.exists() and not model_orphan.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]


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


def _cache_save_then_die(root: str) -> None:
    """In a child: a tokenization cache save killed (os._exit, as SIGKILL: no finally runs) writing its first array."""
    from chronicals.data import cache

    np.save = lambda *a, **k: os._exit(9)
    cache.save(Path(root) / "entry", np.arange(5, dtype=np.int32), np.ones(5, bool), np.array([0, 5], np.int64), {})


def test_a_cache_save_killed_mid_write_leaves_what_the_next_save_removes(tmp_path):
    """The temporary entry a real kill leaves (its name, its lock file nobody holds) is the one the next save's sweep
    finds and removes: nothing but the new entry stays in the cache."""
    import multiprocessing

    from chronicals.data import cache

    proc = multiprocessing.get_context("fork").Process(target=_cache_save_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join()
    assert proc.exitcode == 9 and len(os.listdir(tmp_path)) == 1  # the killed save's temporary entry
    cache.save(tmp_path / "entry", np.arange(5, dtype=np.int32), np.ones(5, bool), np.array([0, 5], np.int64),
               {"pad_id": 0, "stats": {"documents": 1, "tokens": 5}})
    assert os.listdir(tmp_path) == ["entry"] and cache.load(tmp_path / "entry")[0].tolist() == list(range(5))


def _prune_then_die(out: str) -> None:
    """In a child: write step 2 over step 1 with keep_last=1, and die (os._exit, as SIGKILL: no finally runs) in
    the middle of removing step 1, after its state.pt went."""
    import shutil

    real = shutil.rmtree

    def dies(path, *a, **k):
        if (Path(path) / "state.pt").is_file() and "step-000001" in str(path):
            (Path(path) / "state.pt").unlink()
            os._exit(9)
        return real(path, *a, **k)

    shutil.rmtree = dies
    ckpt.write_checkpoint(out, _state(1), keep_last=1)
    ckpt.write_checkpoint(out, _state(2), keep_last=1)


def test_a_kill_while_pruning_leaves_nothing_that_outlives_the_next_write(tmp_path):
    """A SIGKILL between the removal of an old checkpoint's state.pt and its directory left an empty step-N that
    pruning never listed (it lists complete checkpoints only) and that, as the newest, stopped resume=auto (a
    SIGKILL walk found two). The old checkpoint is renamed to a locked temporary first: the next write sweeps it;
    and an empty step-N older than the kept ones (from before) is pruned too."""
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=_prune_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join()
    assert proc.exitcode == 9
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000002"]
    leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp-step-000001")]
    assert leftovers  # the renamed directory and its lock, swept below
    (root / "step-000000").mkdir()  # an empty step directory left by an older version
    ckpt.write_checkpoint(tmp_path, _state(3), keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]
