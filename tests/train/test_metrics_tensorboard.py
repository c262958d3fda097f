"""TensorBoard shows what metrics.jsonl holds: after a resume at step k, the steps the interrupted run logged past k
once (not its copy and the resumed run's), after a fresh run in a reused out_dir none of the earlier run's.

TensorBoard's event files are only appended to; a SummaryWriter's ``purge_step`` makes TensorBoard hide the steps
>= it that earlier files logged. Without the tensorboard package (not a dependency) the writer is a stand-in that
reads its events the way TensorBoard does (``_FakeTensorBoard``); with it, one test reads the real event files.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest

from chronicals.train import train
from chronicals.train.metrics import MetricsLog

from train_helpers import SyntheticLoader, tiny_config, tiny_model


class _FakeTensorBoard:
    """``torch.utils.tensorboard`` in memory: each log dir an append-only list of events, shown as TensorBoard's
    event accumulator shows them (a writer's purge_step drops every earlier event at or past that step)."""

    def __init__(self):
        self.events: dict[str, list[tuple]] = {}
        self.purge_steps: list[int | None] = []
        self.flush_secs: list[int] = []
        fake = self

        class SummaryWriter:
            def __init__(self, log_dir, purge_step=None, flush_secs=120):
                fake.purge_steps.append(purge_step)
                fake.flush_secs.append(flush_secs)
                self.events = fake.events.setdefault(str(log_dir), [])
                if purge_step is not None:
                    self.events.append(("purge", purge_step))

            def add_scalar(self, tag, value, step):
                self.events.append(("scalar", tag, step, value))

            def close(self):
                pass

        self.module = types.SimpleNamespace(SummaryWriter=SummaryWriter)

    def shown(self, log_dir) -> dict[str, list[tuple[int, float]]]:
        tags: dict[str, list] = {}
        for ev in self.events.get(str(log_dir), []):
            if ev[0] == "purge":
                tags = {t: [(s, v) for s, v in pts if s < ev[1]] for t, pts in tags.items()}
            else:
                tags.setdefault(ev[1], []).append((ev[2], ev[3]))
        return {t: sorted(pts) for t, pts in tags.items() if pts}


@pytest.fixture
def tb(monkeypatch):
    fake = _FakeTensorBoard()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake.module)
    return fake


def _in_jsonl(out_dir) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's records as TensorBoard tags: {"train/loss": [(step, value), ...], ...}."""
    tags: dict[str, list] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                tags.setdefault(f"{rec.get('kind', 'train')}/{k}", []).append((rec["step"], v))
    return {t: sorted(pts) for t, pts in tags.items()}


def _log(out_dir, steps, resume_step=None, loss=1.0, after=False, close=True):
    """A run's records: the held-out loss before (fresh runs), a train record per step, the closing "after"."""
    out_dir.mkdir(exist_ok=True)
    m = MetricsLog(out_dir, True, resume_step)
    if resume_step is None:
        m.write({"kind": "eval", "step": 0, "eval_loss": 3.0, "tag": "before"})
    for s in steps:
        m.write({"kind": "train", "step": s, "loss": loss + s, "lr": 0.1})
        if s % 4 == 0:
            m.write({"kind": "eval", "step": s, "eval_loss": loss - s / 10, "tag": "interval"})
    if after:
        m.write({"kind": "eval", "step": steps[-1], "eval_loss": 0.5, "tag": "after"})
    if close:
        m.close()
    return m


def test_a_resume_shows_the_redone_steps_once(tmp_path, tb):
    """A run logs steps 1..7 and is killed; the resume from its step-5 checkpoint redoes 6..8 with other losses.
    TensorBoard shows steps 1..8 once, 6 and 7 with the resumed run's values, like metrics.jsonl. The writer
    purges from step 6: without a purge_step 6 and 7 showed twice, from 5 step 5 was lost (no one logs it again)."""
    _log(tmp_path, range(1, 8), close=False)
    _log(tmp_path, range(6, 9), resume_step=5, loss=2.0, after=True)
    assert tb.purge_steps == [0, 6]
    shown = tb.shown(tmp_path / "tensorboard")
    assert [s for s, _ in shown["train/loss"]] == list(range(1, 9))
    assert dict(shown["train/loss"])[7] == 9.0  # the resumed run's
    assert shown == _in_jsonl(tmp_path)


def test_the_writer_flushes_every_10_seconds(tmp_path, tb):
    """TensorBoard's default (flush_secs=120) showed nothing of a run's first two minutes."""
    _log(tmp_path, range(1, 3))
    assert tb.flush_secs == [10]


def test_a_fresh_run_in_a_reused_out_dir_shows_none_of_the_earlier_runs_steps(tmp_path, tb):
    """train.resume=none over an out_dir with 9 logged steps: metrics.jsonl starts over, and so does TensorBoard
    (steps 4..9 of the earlier run were shown beside the new run's 1..3)."""
    _log(tmp_path, range(1, 10))
    _log(tmp_path, range(1, 4), loss=5.0)
    shown = tb.shown(tmp_path / "tensorboard")
    assert [s for s, _ in shown["train/loss"]] == [1, 2, 3]
    assert shown == _in_jsonl(tmp_path)


def test_extending_a_finished_run_drops_its_closing_evaluation_from_tensorboard_too(tmp_path, tb):
    """A finished 4-step run resumed from its last checkpoint with more steps: metrics.jsonl drops the "after"
    held-out loss at step 4 (the run did not end there), so TensorBoard purges from step 4 and is given step 4's
    kept records again."""
    _log(tmp_path, range(1, 5), after=True)
    _log(tmp_path, range(5, 7), resume_step=4)
    assert tb.purge_steps == [0, 4]
    shown = tb.shown(tmp_path / "tensorboard")
    assert shown["eval/eval_loss"] == [(0, 3.0), (4, 0.6)]  # before and the interval one; not the "after" 0.5
    assert shown == _in_jsonl(tmp_path)


def test_a_run_stopped_before_its_first_record_leaves_tensorboard_as_it_was(tmp_path, tb):
    """No writer opens before the first record (as metrics.jsonl is rewritten only then): a resume or fresh run
    that fails while loading purges nothing."""
    _log(tmp_path, range(1, 8))
    before = tb.shown(tmp_path / "tensorboard")
    MetricsLog(tmp_path, True, 3).close()
    MetricsLog(tmp_path, True).close()
    assert tb.purge_steps == [0] and tb.shown(tmp_path / "tensorboard") == before


def test_another_runs_records_are_shown_too(tmp_path, tb):
    """A resume from another run's checkpoint starts metrics.jsonl with that run's records (train/run_dir.py sets
    ``records``); TensorBoard gets them as well, and none of out_dir's own earlier steps."""
    _log(tmp_path / "b", range(1, 7))
    m = MetricsLog(tmp_path / "b", True)
    m.records = [{"kind": "train", "step": s, "loss": 10.0 + s} for s in (1, 2, 3)]
    m.write({"kind": "train", "step": 4, "loss": 20.0})
    m.close()
    assert tb.shown(tmp_path / "b" / "tensorboard")["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 20.0)]
    assert tb.shown(tmp_path / "b" / "tensorboard") == _in_jsonl(tmp_path / "b")


def test_train_resumed_from_an_earlier_checkpoint_shows_each_step_once(tmp_path, docs, tb):
    """Through train(): 4 steps with a checkpoint at each, then a resume from step-000002 redoes steps 3 and 4."""
    def run(**over):
        train(tiny_config(tmp_path, train__max_steps=4, train__save_every=1, train__keep_last=4,
                          logging__tensorboard=True, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))

    run()
    run(train__resume=str(tmp_path / "run" / "checkpoints" / "step-000002"))
    assert tb.purge_steps == [0, 3]
    shown = tb.shown(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in shown["train/loss"]] == [1, 2, 3, 4]
    assert shown == _in_jsonl(tmp_path / "run")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="the tensorboard package is not installed (optional; the stand-in tests above cover "
                           "the purge step)")
def test_tensorboard_reads_each_step_once_after_a_resume(tmp_path):
    """The real event files, read by TensorBoard's own event accumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(tmp_path, range(1, 8))
    _log(tmp_path, range(6, 9), resume_step=5, loss=2.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    shown = {t: sorted((e.step, e.value) for e in acc.Scalars(t)) for t in acc.Tags()["scalars"]}
    assert [s for s, _ in shown["train/loss"]] == list(range(1, 9))
    assert shown == {t: [(s, pytest.approx(v)) for s, v in pts] for t, pts in _in_jsonl(tmp_path).items()}


def test_a_writer_that_cannot_be_made_fails_before_the_earlier_run_is_removed(tmp_path):
    """MetricsLog ran on_open (which removes an earlier run's checkpoints and final adapter) before making the
    SummaryWriter: a file named tensorboard in out_dir then failed the run after the removal, nothing trained (a
    metrics walk). The writer comes first now; its failure names the folder and logging.tensorboard=false."""
    removed = []
    log = MetricsLog(tmp_path, tensorboard=False, on_open=lambda: removed.append(True))

    def no_writer(log_dir, purge_step=None, flush_secs=120):
        raise FileExistsError(17, "File exists", log_dir)

    log._summary_writer = no_writer
    with pytest.raises(OSError, match=r"tensorboard: TensorBoard's writer cannot be made there \(File exists\); move "
                                      r"it away or set logging.tensorboard=false"):
        log.write({"kind": "train", "step": 1, "loss": 1.0})
    assert removed == [] and not (tmp_path / "metrics.jsonl").exists()


def test_a_broken_tensorboard_install_is_a_warning(tmp_path, monkeypatch, caplog):
    """Importing tensorboard against another protobuf raises a TypeError: only ImportError was caught, so every
    run with logging.tensorboard on (the default) stopped with an internal error, exit 4."""
    import importlib.abc

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch.utils.tensorboard":
                raise TypeError("Descriptors cannot be created directly.")
            return None

    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with caplog.at_level("WARNING", logger="chronicals"):
        log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"kind": "train", "step": 1, "loss": 1.0})
    assert "TensorBoard could not be imported (TypeError: Descriptors cannot be created directly.)" in caplog.text
    assert log.tb is None and (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_a_run_without_tensorboard_installed_logs_to_metrics_jsonl_only(tmp_path, monkeypatch, caplog):
    """tensorboard is not a dependency: with logging.tensorboard on (the default) and the package missing, the log
    says how to install it and the records go to metrics.jsonl alone."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ModuleNotFoundError
    with caplog.at_level("INFO", logger="chronicals"):
        log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"kind": "train", "step": 1, "loss": 1.0})
    log.close()
    assert "TensorBoard not installed (pip install tensorboard)" in caplog.text
    assert log.tb is None and not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"kind": "train", "step": 1, "loss": 1.0}
