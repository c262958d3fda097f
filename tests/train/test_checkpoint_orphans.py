"""A run killed mid-write (SIGKILL, OOM) leaves ``checkpoints/.tmp-step-N-{pid}`` and ``.model.tmp-{pid}-*``
behind: the next write into the same place removes them when their writer no longer runs, and never touches
this process's own temporaries (a background CheckpointWriter thread's) or names that are not ours."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from chronicals.train import checkpoint as ckpt
from chronicals.train import train

from train_helpers import SyntheticLoader, tiny_config, tiny_model


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped, so no process of that pid runs now."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _partial(path, nbytes: int = 1000):
    """A temporary checkpoint directory as a killed write leaves it: a truncated state.pt."""
    path.mkdir(parents=True)
    (path / ckpt.STATE_FILE).write_bytes(b"\0" * nbytes)
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
    live = _partial(root / f".tmp-step-000006-{os.getpid()}")  # this process's: a write in flight
    others = [_partial(root / name) for name in (f".tmp-foo-{dead_pid}", ".tmp-step-000004-abc", "notes",
                                                   f"tmp-step-000004-{dead_pid}", f".tmp-step-000004-{dead_pid}.bak")]
    writer = ckpt.CheckpointWriter(background=background)
    with caplog.at_level(logging.INFO, logger="chronicals.train"):
        writer.save(tmp_path, 2, tiny_model(), _Opt(), _Opt(), {})
        writer.wait()
    assert not dead.exists()
    assert live.is_dir() and all(p.is_dir() for p in others)
    assert [d.name for d in ckpt.checkpoint_dirs(tmp_path)] == ["step-000002"]
    removed = [r.getMessage() for r in caplog.records if r.name == "chronicals.train" and "removed" in r.getMessage()]
    assert len(removed) == 1 and dead.name in removed[0] and "2.5 MB" in removed[0] and str(dead_pid) in removed[0]


def test_write_checkpoint_leaves_a_live_processes_temporaries(tmp_path):
    """A pid that runs (here the pytest's parent, which outlives this test) is another writer at work."""
    live = _partial(tmp_path / "checkpoints" / f".tmp-step-000004-{os.getppid()}")
    ckpt.write_checkpoint(tmp_path, _state(2))
    assert live.is_dir()


def test_a_run_after_a_killed_one_clears_its_checkpoint_and_final_model_temporaries(tmp_path, docs, dead_pid):
    """The reported case: a run killed while writing step 4's checkpoint (and one killed while writing the final
    model); the next run in the same out_dir removes both once it writes its own, and finishes."""
    cfg = tiny_config(tmp_path, train__save_every=2, train__max_steps=2, train__resume="auto",
                      train__save_final=True)
    out = tmp_path / "run"
    ck_orphan = _partial(out / "checkpoints" / f".tmp-step-000004-{dead_pid}")
    model_orphan = _partial(out / f".model.tmp-{dead_pid}-k2x9_a1b")
    res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs, seed=1))
    assert res.status == "completed" and (out / "model" / "config.json").is_file()
    assert not ck_orphan.exists() and not model_orphan.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
