"""Several runs in one train.out_dir: a fresh run replaces an earlier run's checkpoints (not at setup, only once it
writes), a resume from an earlier step drops the later branch, and a LoRA checkpoint resumes only under the
adapter settings and base model it was trained with."""

from __future__ import annotations

import json
import re

import pytest

from chronicals.train import train
from chronicals.train.checkpoint import checkpoint_dirs

from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model


@pytest.fixture
def docs():
    return synthetic_docs(40, seed=1)


def _run(tmp_path, docs, **over):
    return train(tiny_config(tmp_path, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))


def _names(tmp_path):
    return [d.name for d in checkpoint_dirs(tmp_path / "run")]


def _records(path):
    """The records of a metrics.jsonl, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_fresh_run_replaces_an_earlier_runs_checkpoints(tmp_path, docs, caplog):
    """resume=none over a finished run: keep_last used to prune the new run's step-1 (the old steps 2 and 4 sort
    higher) and resume=auto then continued the old run; now the old ones go once the new run writes."""
    _run(tmp_path, docs, train__max_steps=4, train__save_every=2, train__keep_last=5)
    assert _names(tmp_path) == ["step-000002", "step-000004"]
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=1, train__resume="none", train__keep_last=2)
    assert _names(tmp_path) == ["step-000001"]
    assert "removed 2 checkpoint(s) of another run" in caplog.text and "step-000002, step-000004" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=2, train__resume="auto")
    assert "checkpoints/step-000001 at step 1 of 2" in caplog.text  # the new run's, not the old step 4


def test_a_fresh_run_that_fails_in_setup_keeps_the_earlier_checkpoints(tmp_path, docs):
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1, train__keep_last=5)
    final = tmp_path / "run" / "model"
    final.mkdir()
    (final / "notes.md").write_text("mine")  # refused before the first step (test_loop has this case)
    with pytest.raises(FileExistsError):
        _run(tmp_path, docs, train__max_steps=1, train__resume="none", train__save_final=True)
    assert _names(tmp_path) == ["step-000001", "step-000002"]


def test_a_fresh_run_removes_an_earlier_runs_final_adapter(tmp_path, docs, caplog):
    """Run A wrote adapter/; run B (resume=none, train.save_final=false) left it beside B's config.yaml, so
    chat --adapter run/adapter paired A's adapter with B's settings. It goes with A's checkpoints now, said; a
    resume from out_dir's own checkpoint keeps it, and one holding files no adapter has is left, said."""
    lora = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__max_steps=1)
    adapter = tmp_path / "run" / "adapter"
    _run(tmp_path, docs, train__save_final=True, **lora)
    _run(tmp_path, docs, **dict(lora, train__max_steps=2, train__resume=str(adapter.parent / "checkpoints" /
                                                                            "step-000001")))
    assert adapter.is_dir() and len(checkpoint_dirs(adapter.parent)) == 2  # its own history: kept
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__resume="none", optim__lr=1e-2, **lora)
    assert not adapter.exists() and "lr: 0.01" in (tmp_path / "run" / "config.yaml").read_text()
    assert (f"removed {adapter}, another run's final adapter (train.resume=none starts this out_dir over; "
            "train.save_final=false: this run writes none)") in caplog.text
    _run(tmp_path, docs, train__save_final=True, **lora)
    (adapter / "notes.md").write_text("mine")
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__resume="none", **lora)
    assert (adapter / "notes.md").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert f"{adapter} is an earlier run's final adapter, not this run's; left in place as it also holds notes.md" \
        in caplog.text


def test_a_resume_from_an_earlier_step_drops_the_later_branch(tmp_path, docs, caplog):
    """A rewind: the later checkpoints were named "of another run" though they were this run's own, and the final
    adapter/ of the discarded steps stayed beside the new checkpoints (chat --adapter used its stale weights)."""
    lora = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__save_every=1, train__keep_last=10)
    _run(tmp_path, docs, train__max_steps=4, train__save_final=True, **lora)
    adapter = tmp_path / "run" / "adapter"
    assert adapter.is_dir()
    step2 = tmp_path / "run" / "checkpoints" / "step-000002"
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=3, train__resume=str(step2), **lora)
    assert _names(tmp_path) == ["step-000001", "step-000002", "step-000003"]  # this run's history, not step 4
    why = f"(a rewind: training continues from {step2}, at step 2)"
    assert f"removed 2 later checkpoints of this run from {step2.parent}: step-000003, step-000004 {why}" \
        in caplog.text
    assert not adapter.exists()  # train.save_final=false: this run writes none
    assert (f"removed {adapter}, the final adapter of this run's steps after 2, which the rewind discards {why[:-1]}; "
            "train.save_final=false: this run writes none)") in caplog.text
    assert "another run" not in caplog.text


LORA = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__save_every=1, train__max_steps=1)


@pytest.mark.parametrize("key,value,shown", [
    ("lora__alpha", 32.0, "lora.alpha=16.0 (this run: 32.0)"),
    ("lora__rslora", True, "lora.rslora=False (this run: True)"),
])
def test_a_lora_resume_under_other_adapter_settings_is_refused(tmp_path, docs, key, value, shown):
    """Same shapes, other meaning: the adapters' scaling or base differ, so the run would continue from weights that
    compute something else (lora.rank and lora.targets are caught by the parameter names and shapes)."""
    _run(tmp_path, docs, lora__alpha=16.0, **LORA)
    again = dict(LORA, lora__alpha=16.0, train__max_steps=2, train__resume="auto")
    with pytest.raises(ValueError, match="holds LoRA adapters trained with " + re.escape(shown)):
        _run(tmp_path, docs, **dict(again, **{key: value}))


def test_lora_dropout_and_a_full_fine_tunes_base_only_warn(tmp_path, docs, caplog):
    _run(tmp_path, docs, **LORA)
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, **dict(LORA, lora__dropout=0.1, train__max_steps=2, train__resume="auto"))
    assert "lora.dropout=0.0 (this run: 0.1), train.max_steps=1 (this run: 2); they apply from step 2" in caplog.text
    full = tmp_path / "full"
    _run(full, docs, train__save_every=1, train__max_steps=1)
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(full, docs, train__max_steps=2, train__resume="auto", model__path="another-base")
    assert "model.path='smollm2-135m-instruct' (this run: 'another-base'): the checkpoint's weights replace" \
        in caplog.text


def test_a_fresh_run_stopped_in_its_before_report_leaves_the_earlier_run_as_it_was(tmp_path, docs):
    """The "before" report (held-out loss, QA answers) runs before the first step: a Ctrl-C there used to find the
    earlier run's checkpoints deleted and config.yaml / metrics.jsonl rewritten (the before record was written
    first), while the CLI said the checkpoints stayed."""
    eval_loader = SyntheticLoader(synthetic_docs(8, seed=5), shuffle=False)
    train(tiny_config(tmp_path, train__max_steps=2, train__save_every=1, train__keep_last=5),
          model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=eval_loader)
    run = tmp_path / "run"
    kept = {p.name: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}

    def stop(phase, **_):
        if phase == "before":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(tmp_path, train__max_steps=1, train__resume="none", optim__lr=1e-3), model=tiny_model(),
              train_loader=SyntheticLoader(docs), eval_loader=eval_loader, report=stop)
    assert _names(tmp_path) == ["step-000001", "step-000002"]
    assert {n: (run / n).read_bytes() for n in kept} == kept
    # run through, the fresh run's first record is still its "before" held-out loss
    train(tiny_config(tmp_path, train__max_steps=1, train__resume="none"), model=tiny_model(),
          train_loader=SyntheticLoader(docs), eval_loader=eval_loader)
    first = (run / "metrics.jsonl").read_text().splitlines()[0]
    assert '"tag": "before"' in first and '"step": 0' in first


class _CountingLoader(SyntheticLoader):
    """Refuses a position saved over another number of batches, as PackedLoader does."""

    def state_dict(self):
        return dict(super().state_dict(), batches=len(self))

    def load_state_dict(self, sd):
        if sd["batches"] != len(self):
            raise ValueError(f"the saved loader had {sd['batches']} batches per epoch, this one {len(self)}")
        super().load_state_dict(sd)


def test_a_resume_over_other_data_names_the_checkpoint_and_the_changed_key(tmp_path, docs, caplog):
    train(tiny_config(tmp_path, train__max_steps=1, train__save_every=1, data__path="a.jsonl"), model=tiny_model(),
          train_loader=_CountingLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"), pytest.raises(ValueError) as err:
        train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto", data__path="b.jsonl"),
              model=tiny_model(), train_loader=_CountingLoader(docs[:20]))
    msg = str(err.value)
    assert "cannot resume from" in msg and "step-000001" in msg and "batches per epoch" in msg
    assert "data.path='a.jsonl' (this run: 'b.jsonl')" in msg and "train.resume=none" in msg
    # nothing said before the refusal that it contradicts or repeats: a warning of the same keys came first, and
    # "resumed from" was said before refusals that came after the data position
    assert "data.path=" not in caplog.text and "resumed from" not in caplog.text


def test_a_resume_over_edited_data_under_the_same_settings_names_both_causes(tmp_path, docs):
    """Same data.path, other contents (records appended) or another number of ranks: no setting differs, so the
    refusal names both possible causes and each one's way out."""
    train(tiny_config(tmp_path, train__max_steps=1, train__save_every=1), model=tiny_model(),
          train_loader=_CountingLoader(docs))
    with pytest.raises(ValueError) as err:
        train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto"), model=tiny_model(),
              train_loader=_CountingLoader(docs[:20]))
    msg = str(err.value)
    assert "no data setting changed, so either the data files' contents did" in msg and "train.resume=none" in msg
    assert "resume with the checkpoint's torchrun --nproc-per-node" in msg


def test_a_run_of_the_other_kind_removes_the_earlier_final_directory(tmp_path, docs, caplog):
    """A LoRA run's adapter/, then a full run over the same out_dir (resume=none): the adapter stayed beside the full
    run's config.yaml (chat --adapter run/adapter reads it); only the run's own kind was looked at. The other way
    too: a full run's model/ under a LoRA run."""
    lora = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__max_steps=1)
    run = tmp_path / "run"
    _run(tmp_path, docs, train__save_final=True, **lora)
    assert (run / "adapter").is_dir()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__resume="none", train__max_steps=1, train__save_final=True)
    assert not (run / "adapter").exists() and (run / "model").is_dir()
    assert (f"removed {run / 'adapter'}, another run's final adapter (train.resume=none starts this out_dir over; "
            "this run writes a model)") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__resume="none", **lora)
    assert not (run / "model").exists() and not (run / "adapter").exists()
    assert f"removed {run / 'model'}, another run's final model" in caplog.text


def test_a_resume_from_another_runs_last_checkpoint_makes_out_dir_that_runs_record(tmp_path, docs):
    """Nothing to train (the checkpoint is at the run's last step): the final adapter was written, but out_dir kept
    its earlier run's config.yaml, metrics.jsonl and checkpoints, mixing two runs. Now it is as a run that trained
    from that checkpoint makes it: that run's records up to the step, this config.yaml, the earlier files gone."""
    lora = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__save_final=True)
    other = tmp_path / "other"
    other.mkdir()
    _run(other, docs, train__max_steps=3, **lora)
    _run(tmp_path, docs, train__max_steps=2, optim__lr=5e-3, **lora)
    run = tmp_path / "run"
    source = other / "run" / "checkpoints" / "step-000003"
    _run(tmp_path, docs, train__max_steps=3, train__resume=str(source), **lora)
    assert "lr: 0.005" not in (run / "config.yaml").read_text()
    theirs = _records(other / "run" / "metrics.jsonl")
    assert _records(run / "metrics.jsonl") == [r for r in theirs if r.get("step", 0) <= 3]
    assert _names(tmp_path) == []  # the earlier run's step-000002 went with it
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


def test_a_run_that_starts_over_removes_the_earlier_loss_curve(tmp_path, docs, caplog):
    """loss.png, the earlier run's curve, stayed beside the new run's config.yaml and metrics.jsonl (with
    logging.plot=false the new run draws none); a resume of the run's own checkpoint keeps it until it draws its own."""
    pytest.importorskip("matplotlib")
    _run(tmp_path, docs, train__max_steps=2, train__save_every=1, logging__plot=True)
    plot = tmp_path / "run" / "loss.png"
    assert plot.is_file()
    _run(tmp_path, docs, train__max_steps=3, train__resume="auto", logging__plot=False)  # its own history
    assert plot.is_file()
    with caplog.at_level("INFO", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=1, train__resume="none", logging__plot=False)
    assert not plot.exists()
    assert f"removed {plot}, the loss curve of the run before" in caplog.text


def test_a_linked_loss_curve_is_left_alone_and_plot_false_draws_none(tmp_path, docs):
    """A loss.png that is a link (the user's, e.g. into a dashboard folder) is not the earlier run's file: a run that
    starts over leaves it. logging.plot=false draws no curve and returns none."""
    res = _run(tmp_path, docs, train__max_steps=1, logging__plot=False)
    plot = tmp_path / "run" / "loss.png"
    assert res.plot is None and not plot.exists()
    target = tmp_path / "dashboard.png"
    target.write_bytes(b"the user's file")
    plot.symlink_to(target)
    _run(tmp_path, docs, train__max_steps=1, logging__plot=False)  # resume=none: starts the history over
    assert plot.is_symlink() and target.read_bytes() == b"the user's file"


def test_a_rerun_of_a_finished_run_keeps_its_loss_curve_untouched(tmp_path, docs):
    """A rerun that finds the run finished changes nothing in its record: loss.png is kept as it is (not rewritten),
    as metrics.jsonl is; a curve is drawn only where the run left none."""
    pytest.importorskip("matplotlib")
    _run(tmp_path, docs, train__max_steps=2, train__resume="auto", logging__plot=True)
    plot = tmp_path / "run" / "loss.png"
    before = plot.stat()
    res = _run(tmp_path, docs, train__max_steps=2, train__resume="auto", logging__plot=True)
    after = plot.stat()
    assert res.plot == plot and res.start_step == 2
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    plot.unlink()
    assert _run(tmp_path, docs, train__max_steps=2, train__resume="auto", logging__plot=True).plot == plot
    assert plot.is_file()


def test_the_rerun_that_closes_a_stopped_run_redraws_its_curve(tmp_path, docs, monkeypatch):
    """A run stopped by a signal in its last step drew loss.png without its closing held-out loss; the rerun that
    logs that evaluation redraws the curve from records that hold it (as an uninterrupted run's curve does)."""
    import os
    import signal

    import chronicals.train.finish as finish

    pytest.importorskip("matplotlib")
    cfg = tiny_config(tmp_path, train__max_steps=3, train__resume="auto", logging__plot=True)
    held = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    first = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=held(),
                  on_step=lambda step, rec: step == 3 and os.kill(os.getpid(), signal.SIGTERM))
    assert first.status == "interrupted" and (tmp_path / "run" / "loss.png").is_file()
    drawn = []
    real = finish.plot_losses
    monkeypatch.setattr(finish, "plot_losses", lambda records, path: drawn.append(list(records)) or real(records, path))
    res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=held())
    assert res.eval_loss_after is not None and res.plot == tmp_path / "run" / "loss.png"
    assert drawn and any(r.get("tag") == "after" and r.get("step") == 3 for r in drawn[-1])


def test_the_runs_data_copy_is_replaced_whole(tmp_path):
    """Under data parallel every rank writes out_dir/data/*.jsonl; each wrote in place (open "w"), so a rank could
    read the file while another had emptied it. Now each writes a temporary file and renames it: a failed write
    leaves the earlier copy and no temporary file."""
    from chronicals.train.qa import write_chat_jsonl

    path = tmp_path / "data" / "heldout.jsonl"
    write_chat_jsonl([{"question": "q?", "answer": "a"}], path, "Be brief.")
    before, inode = path.read_text(), path.stat().st_ino
    assert '"Be brief."' in before and '"q?"' in before
    with pytest.raises(TypeError):  # a value json cannot write, after the first record
        write_chat_jsonl([{"question": "q2?", "answer": "b"}, {"messages": [{"role": "user", "content": object()}]}],
                         path, "")
    assert path.read_text() == before and sorted(p.name for p in path.parent.iterdir()) == ["heldout.jsonl"]
    write_chat_jsonl([{"question": "q2?", "answer": "b"}], path, "")
    assert '"q2?"' in path.read_text() and path.stat().st_ino != inode


def test_resume_auto_without_checkpoints_over_a_finished_run_is_refused(tmp_path, docs, caplog):
    """A finished run's checkpoints deleted (or moved away as an error advised): resume=auto started over from
    step 0 without a word and, at its first record, deleted the run's adapter/ and metrics history, blaming
    train.resume=none (a checkpoint walk). Refused before training, naming what is there and the fix; resume=none
    starts over as asked, and says so in its own words."""
    import shutil

    from chronicals.config import ConfigError

    lora = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__max_steps=1, train__save_final=True)
    run = tmp_path / "run"
    _run(tmp_path, docs, **lora)
    shutil.rmtree(run / "checkpoints")
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"train.resume=auto found no checkpoint in .*checkpoints, but .* holds an "
                                          r"earlier run's adapter/: this run would start over from step 0"):
        _run(tmp_path, docs, train__resume="auto", **lora)
    assert (run / "adapter" / "adapter_model.safetensors").is_file() and (run / "metrics.jsonl").read_text() == before
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__resume="none", **dict(lora, train__save_final=False))
    assert "(train.resume=none starts this out_dir over" in caplog.text and not (run / "adapter").exists()
    shutil.rmtree(run / "checkpoints")
    (run / "model").mkdir()  # an empty folder (made by hand or by a tool) is no earlier run's result: not refused
    _run(tmp_path, docs, train__resume="auto", **lora)  # no final directory: a run stopped early starts over


def test_an_own_resume_without_metrics_jsonl_says_where_the_file_starts(tmp_path, docs, caplog):
    """Resuming out_dir's own checkpoint with metrics.jsonl gone restarted the file at step N+1 without a word (a
    checkpoint walk; another run's checkpoint was already said)."""
    _run(tmp_path, docs, train__max_steps=2)
    (tmp_path / "run" / "metrics.jsonl").unlink()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=3, train__resume="auto")
    assert "has no metrics.jsonl: it starts at step 3 (the records of steps 1..2" in caplog.text


def test_an_own_step_0_resume_without_metrics_jsonl_says_nothing_is_gone(tmp_path, caplog):
    """A step-0 checkpoint (one written through the API before any optimizer step) has no records to lose: its own
    resume without metrics.jsonl used to warn that "the records of steps 1..0 are gone". At step 2 it still warns."""
    from chronicals.train.run_dir import _metrics_log

    cfg = tiny_config(tmp_path)
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000000").mkdir(parents=True)
    (out / "checkpoints" / "step-000002").mkdir()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        assert _metrics_log(cfg, out, out / "checkpoints" / "step-000000", 0, None).records == []
        assert "has no metrics.jsonl" not in caplog.text
        _metrics_log(cfg, out, out / "checkpoints" / "step-000002", 2, None)
    assert "has no metrics.jsonl: it starts at step 3" in caplog.text


def test_another_runs_checkpoint_without_its_runs_metrics_jsonl_names_the_missing_file(tmp_path, caplog):
    """Another run's checkpoint whose run has lost its metrics.jsonl: the file missing is named, and this run's
    metrics.jsonl starts at step N+1 with no records."""
    from chronicals.train.run_dir import _metrics_log

    out, other = tmp_path / "run", tmp_path / "other"
    (other / "checkpoints" / "step-000002").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="chronicals.train"):
        assert _metrics_log(tiny_config(tmp_path), out, other / "checkpoints" / "step-000002", 2, None).records == []
    assert f"{other / 'metrics.jsonl'} does not exist: {out / 'metrics.jsonl'} starts at step 3" in caplog.text

def test_a_checkpoint_copied_out_of_its_run_starts_metrics_at_the_next_step(tmp_path, docs, caplog):
    """A checkpoint copied out of its run (its parent is no ``checkpoints`` dir) has no run records beside it:
    metrics.jsonl starts at step N+1. It took an unrelated metrics.jsonl two levels up as that run's records, and
    with none taken it kept out_dir's own earlier run's records (another history)."""
    import shutil

    other = tmp_path / "other"
    other.mkdir()
    _run(other, docs, train__max_steps=2)
    _run(tmp_path, docs, train__max_steps=2, optim__lr=5e-3)  # out_dir's earlier run: records of steps 1, 2
    saved = tmp_path / "saved" / "step-000002"
    shutil.copytree(other / "run" / "checkpoints" / "step-000002", saved)
    (tmp_path / "metrics.jsonl").write_text((other / "run" / "metrics.jsonl").read_text())  # unrelated, 2 levels up
    with caplog.at_level("WARNING", logger="chronicals.train"):
        _run(tmp_path, docs, train__max_steps=3, train__resume=str(saved))
    steps = [r.get("step") for r in _records(tmp_path / "run" / "metrics.jsonl")]
    assert steps and min(steps) == 3, steps
    assert "no metrics.jsonl beside it" in caplog.text


def test_another_runs_state_pt_as_resume_takes_that_runs_records(tmp_path, docs):
    """train.resume=<other run>/checkpoints/step-N/state.pt (the file, not its directory) starts metrics.jsonl with
    that run's records up to step N, as the directory does; the file's path was not mapped to its directory."""
    other = tmp_path / "other"
    other.mkdir()
    _run(other, docs, train__max_steps=3, train__save_every=1, train__keep_last=3)
    state = other / "run" / "checkpoints" / "step-000002" / "state.pt"
    assert state.is_file()
    _run(tmp_path, docs, train__max_steps=3, train__resume=str(state))
    theirs = [r for r in _records(other / "run" / "metrics.jsonl") if r.get("step", 0) <= 2 and r.get("tag") != "after"]
    mine = _records(tmp_path / "run" / "metrics.jsonl")
    assert theirs and mine[:len(theirs)] == theirs


def test_another_runs_unreadable_metrics_is_said_and_the_run_goes_on(tmp_path, docs, caplog):
    """Another run's metrics.jsonl holding a line that is no record is said ("could not be read") and the run goes
    on, its metrics.jsonl starting at step N+1; it stopped with that file's ValueError."""
    other = tmp_path / "other"
    other.mkdir()
    _run(other, docs, train__max_steps=2)
    theirs = other / "run" / "metrics.jsonl"
    theirs.write_text("not a record\n" + theirs.read_text())
    with caplog.at_level("WARNING", logger="chronicals.train"):
        res = _run(tmp_path, docs, train__max_steps=3, train__resume=str(other / "run" / "checkpoints" / "step-000002"))
    assert res.status == "completed" and res.step == 3
    assert "could not be read" in caplog.text
    assert min(r.get("step") for r in _records(tmp_path / "run" / "metrics.jsonl")) == 3
