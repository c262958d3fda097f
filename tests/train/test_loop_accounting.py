"""What one optimizer step of the training loop consumes and records: train.grad_accum micro-batches per step,
train.epochs counted in such steps, tokens/s as loss tokens over seconds, and the stop on a non-finite gradient
norm under a finite loss.

Every other trainer test sets train.max_steps, checks tokens/s only for being positive, or poisons the loss
itself; a two-process test (test_distributed.py) is the only other one that sees grad_accum ignored.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from chronicals.data.dataset import DatasetStats
from chronicals.train import TrainingDiverged, loop, train

from train_helpers import SyntheticLoader, tiny_config, tiny_model


def _train_records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def test_a_step_takes_grad_accum_micro_batches(tmp_path, docs):
    """With train.grad_accum=3 each step trains on the next 3 batches (its loss tokens are theirs), not one."""
    loader = SyntheticLoader(docs, shuffle=False)
    train(tiny_config(tmp_path, train__max_steps=2, train__grad_accum=3), model=tiny_model(), train_loader=loader)
    want = [sum(b.num_loss_tokens for b in loader.batches[i:i + 3]) for i in (0, 3)]
    assert [r["loss_tokens"] for r in _train_records(tmp_path / "run")] == want


def test_epochs_count_steps_of_grad_accum_batches(tmp_path, docs):
    """train.epochs=1 with train.grad_accum=2 is len(loader) / 2 steps that train every batch once, not
    len(loader) steps (two epochs' worth)."""
    loader = SyntheticLoader(docs[:36], shuffle=False)  # 8 batches
    assert len(loader) % 2 == 0 and len(loader) >= 4
    res = train(tiny_config(tmp_path, train__max_steps=0, train__epochs=1, train__grad_accum=2), model=tiny_model(),
                train_loader=loader)
    assert res.total_steps == res.step == len(loader) // 2
    assert sum(r["loss_tokens"] for r in _train_records(tmp_path / "run")) == \
        sum(b.num_loss_tokens for b in loader.batches)


def test_tokens_per_s_is_loss_tokens_over_step_seconds(tmp_path, docs):
    """Each step's tokens_per_s in metrics.jsonl is its loss_tokens / step_s (any formula passes a check of the
    sign alone)."""
    train(tiny_config(tmp_path, train__max_steps=2), model=tiny_model(), train_loader=SyntheticLoader(docs))
    recs = _train_records(tmp_path / "run")
    assert len(recs) == 2
    for rec in recs:
        assert rec["tokens_per_s"] == pytest.approx(rec["loss_tokens"] / rec["step_s"])


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_result_tokens_per_s_is_loss_tokens_over_step_seconds(tmp_path, docs):
    res = train(tiny_config(tmp_path, train__max_steps=3), model=tiny_model(), train_loader=SyntheticLoader(docs))
    steps = [r for r in _records(tmp_path / "run") if r.get("kind") == "train"]
    want = sum(r["loss_tokens"] for r in steps) / sum(r["step_s"] for r in steps)
    assert res.tokens_per_s == pytest.approx(want, rel=1e-6)
    assert res.train_seconds == pytest.approx(sum(r["step_s"] for r in steps), rel=1e-6)
    # the summary's rate without the first step's warm-up: steps 2 and 3 alone
    assert res.first_step_seconds == pytest.approx(steps[0]["step_s"], rel=1e-6)
    want = sum(r["loss_tokens"] for r in steps[1:]) / sum(r["step_s"] for r in steps[1:])
    assert res.tokens_per_s_after_first == pytest.approx(want, rel=1e-6)


def test_a_resumed_process_times_its_own_first_step_apart(tmp_path, docs):
    """After a resume at step 2, the warm-up the summary sets apart is step 3's (this process's first), and the rate
    after it counts step 4 alone; step 1 of the earlier process is no step of this one."""
    for steps in (2, 4):
        res = train(tiny_config(tmp_path, train__max_steps=steps, train__save_every=2, train__resume="auto"),
                    model=tiny_model(), train_loader=SyntheticLoader(docs))
    recs = {r["step"]: r for r in _records(tmp_path / "run") if r.get("kind") == "train"}
    assert res.start_step == 2 and res.first_step_seconds == pytest.approx(recs[3]["step_s"], rel=1e-6)
    assert res.tokens_per_s_after_first == pytest.approx(recs[4]["loss_tokens"] / recs[4]["step_s"], rel=1e-6)


def test_the_result_holds_the_last_loss_and_the_training_data_stats(tmp_path, docs):
    """TrainResult.last_loss is the last train record's loss, and TrainResult.data_stats is
    train_loader.dataset.stats (what the run summary prints as "training data: N examples of M records ..."); either
    could be left None and the summary lost them."""
    stats = DatasetStats(records=10, documents=7, skipped_errors=2, truncated=1, dropped_no_loss=1,
                         unclosed_replies=0)
    loader = SyntheticLoader(docs)
    loader.dataset = SimpleNamespace(stats=stats)
    res = train(tiny_config(tmp_path, train__max_steps=3), model=tiny_model(), train_loader=loader)
    steps = [r for r in _records(tmp_path / "run") if r.get("kind") == "train"]
    assert res.step == 3 and steps[-1]["step"] == 3 and res.last_loss == steps[-1]["loss"]
    assert res.data_stats is stats


@pytest.mark.parametrize("fused", ["false", "true"])  # read before the update / the pipelined loop's device skip
def test_an_infinite_gradient_norm_under_a_finite_loss_stops_before_its_update(tmp_path, docs, fused):
    """A step whose loss is finite but whose gradient norm is inf raises TrainingDiverged at that step, naming
    the gradient norm, and its update is not applied (applied, it would make the weights NaN before any loss
    showed it)."""
    model = tiny_model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.lm_head.weight.register_hook(lambda g: g + math.inf)
    with pytest.raises(TrainingDiverged, match=r"gradient norm is inf \(loss [0-9.]+\) at step 1;"):
        train(tiny_config(tmp_path, train__max_steps=3, optim__fused=fused), model=model,
              train_loader=SyntheticLoader(docs))
    assert all(torch.equal(p.detach(), w0[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_step_never_spans_two_epochs(tmp_path, docs, epochs):
    """8 batches at grad_accum=3: each epoch is steps of 3, 3 and 2 batches (the last one short, as the Hugging Face
    Trainer does), so train.epochs=1 trains every batch exactly once instead of borrowing the next epoch's."""
    loader = SyntheticLoader(docs[:36], shuffle=False)
    assert len(loader) == 8
    res = train(tiny_config(tmp_path, train__max_steps=0, train__epochs=epochs, train__grad_accum=3),
                model=tiny_model(), train_loader=loader)
    assert res.total_steps == res.step == 3 * epochs
    per_epoch = [sum(b.num_loss_tokens for b in loader.batches[i:i + 3]) for i in (0, 3, 6)]
    assert [r["loss_tokens"] for r in _train_records(tmp_path / "run")] == per_epoch * epochs


def test_a_fraction_of_an_epoch_counts_its_own_steps(tmp_path, docs):
    loader = SyntheticLoader(docs[:36], shuffle=False)  # 8 batches: 1.5 epochs = 3 steps + ceil(4 / 3) = 5
    res = train(tiny_config(tmp_path, train__max_steps=0, train__epochs=1.5, train__grad_accum=3), model=tiny_model(),
                train_loader=loader)
    assert res.total_steps == 5
    # the fraction is 4 batches of the second epoch: steps of 3 and 1 (the last step took 3, 6 batches: 1.75 epochs)
    per_step = [sum(b.num_loss_tokens for b in loader.batches[i:j]) for i, j in ((0, 3), (3, 6), (6, 8), (0, 3),
                                                                                 (3, 4))]
    assert [r["loss_tokens"] for r in _train_records(tmp_path / "run")] == per_step


@pytest.mark.parametrize("epochs,batches,accum,last", [(2.1, 10, 4, 1), (2.5, 6, 4, 3), (0.3, 10, 8, 3),
                                                        (1.1, 10, 1, 1), (2, 10, 4, 4), (0.25, 10, 4, 3)])
def test_the_last_step_takes_only_the_fractions_batches(epochs, batches, accum, last):
    """The fraction of an epoch is its batches rounded up, not its steps: 0.3 epochs of 10 batches at grad_accum 8
    trained 8 batches (0.8 epochs), 2.1 epochs of 10 at 4 trained 24 batches instead of 21."""
    from chronicals.train.stream import _step_plan

    cfg = tiny_config(Path("/nonexistent"), train__max_steps=0, train__epochs=epochs, train__grad_accum=accum)
    assert _step_plan(cfg, batches)[1] == last


@pytest.mark.parametrize("epochs,batches,accum,steps", [(1.1, 10, 1, 11), (2.2, 20, 2, 22), (0.3, 10, 3, 1),
                                                         (2.5, 8, 3, 8)])
def test_step_counts_of_fractional_epochs_are_exact_decimals(epochs, batches, accum, steps):
    """1.1 - 1 is 0.10000000000000009 in floats: counted that way 1.1 epochs of 10 batches took 12 steps."""
    from chronicals.train.stream import _step_plan

    cfg = tiny_config(Path("/nonexistent"), train__max_steps=0, train__epochs=epochs, train__grad_accum=accum)
    assert _step_plan(cfg, batches)[0] == steps


class _OneShotLoader(SyntheticLoader):
    """__iter__ returns one generator for ever: after its first epoch it yields nothing."""

    def __iter__(self):
        if not hasattr(self, "_gen"):
            self._gen = super().__iter__()
        return self._gen


def test_a_loader_that_does_not_start_its_next_epoch_is_refused_not_spun_on(tmp_path, docs):
    loader = _OneShotLoader(docs[:36], shuffle=False)
    with pytest.raises(ValueError, match="yielded no batches after its epoch ended"):
        train(tiny_config(tmp_path, train__max_steps=len(loader) + 1), model=tiny_model(), train_loader=loader)


class _LazyRolloverLoader(SyntheticLoader):
    """Its epoch's iterator ends without starting the next epoch; the next __iter__ does, in a pass that yields
    nothing (as any loader resumed at its epoch's end does)."""

    def __iter__(self):
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
            return iter(())
        # the base's batches of this epoch, stopped before its own roll-over (islice takes no item past the last)
        return itertools.islice(super().__iter__(), len(self) - self.position)


def test_an_epoch_ended_by_a_running_iterator_is_not_counted_as_an_empty_pass(tmp_path, docs):
    """8 batches at grad_accum 4: step 2 takes the epoch's last batch, step 3 finds the running iterator ended and
    the loader's roll-over pass empty before epoch 1's batches. Only fresh passes that yield nothing count towards
    the refusal: counted too, the ended iterator and the empty roll-over pass would read as two empty passes, and
    this loader would be refused ("yielded no batches after its epoch ended") wherever an epoch ends on a step's end."""
    loader = _LazyRolloverLoader(docs[:36], shuffle=False)
    assert len(loader) == 8
    res = train(tiny_config(tmp_path, train__max_steps=4, train__grad_accum=4), model=tiny_model(),
                train_loader=loader)
    assert (res.status, res.step, loader.epoch, loader.position) == ("completed", 4, 1, 8)


def test_a_fractional_epoch_under_data_parallelism_trains_what_one_process_does(tmp_path):
    """2 ranks with train.epochs=0.2 of 5 global batches trained 2 of them (whole rounds of ranks), one process
    with grad_accum 2 trains 1 (a data-parallel walk): the plan counts rounds of the fraction's global batches,
    ceil(ceil(0.2 x 5) / 2) = 1, and the cut gives rank 1 an empty batch in that round."""
    from chronicals.train.stream import _step_plan, cut_fraction

    loaders = [_packed_loader(9, rank, 2) for rank in range(2)]  # 9 rows, batch 2: 5 global batches, 3 per rank
    cfg = tiny_config(tmp_path, train__epochs=1.2, train__max_steps=0)
    assert _step_plan(cfg, 3, spread=(5, 2)) == (4, 1)  # 3 rounds, then 1
    assert _step_plan(cfg, 3) == (4, 1)  # the count of rounds agrees here; 1.7 of 5 below does not (2 vs 3)
    assert _step_plan(tiny_config(tmp_path, train__epochs=1.7, train__max_steps=0), 3, spread=(5, 2)) == (5, 1)
    for loader in loaders:
        cut_fraction(cfg, loader)
    batches = [list(loader) + [next(iter(loader))] for loader in loaders]  # epoch 0, then epoch 1's first
    rows = [[int(b.num_loss_tokens > 0) for b in per_rank] for per_rank in batches]
    # epoch 0: batches 0..4 (rank 1's third empty: the remainder); epoch 1: batch 0 on rank 0, rank 1 empty
    assert [r[3] for r in rows] == [1, 0] and [r[:3] for r in rows] == [[1, 1, 1], [1, 1, 0]]
    one = _packed_loader(9, 0, 1)
    cut_fraction(cfg, one)
    assert one.state_dict()["cut"] == [1, 1]
    cut_fraction(tiny_config(tmp_path, train__epochs=2, train__max_steps=0), one)
    assert "cut" not in one.state_dict()  # whole epochs: no cut


def test_more_epochs_after_a_cut_fraction_say_which_batches_were_not_trained(tmp_path, caplog):
    """A data-parallel run of 0.2 epochs gave rank 1 an empty batch in its round; continued with train.epochs=1,
    the loader resumes after that round, so that global batch is never trained in the epoch: said."""
    from chronicals.train.stream import cut_fraction

    short = _packed_loader(9, 1, 2)
    cut_fraction(tiny_config(tmp_path, train__epochs=0.2, train__max_steps=0), short)
    next(iter(short))
    state = short.state_dict()
    longer = _packed_loader(9, 1, 2)
    cut_fraction(tiny_config(tmp_path, train__epochs=1, train__max_steps=0), longer)
    with caplog.at_level("WARNING", logger="chronicals.data"):
        longer.load_state_dict(state)
    assert "global batches 2..2 of that epoch are not trained" in caplog.text
    caplog.clear()
    again = _packed_loader(9, 1, 2)
    cut_fraction(tiny_config(tmp_path, train__epochs=0.2, train__max_steps=0), again)
    with caplog.at_level("WARNING", logger="chronicals.data"):
        again.load_state_dict(state)  # the same run resumed: nothing to say
    assert caplog.text == ""


def _packed_loader(rows: int, rank: int, world: int, remainder: str = "train"):
    """A PackedLoader over ``rows`` one-document rows of 8 tokens, batch_size 2, unshuffled."""
    import numpy as np

    from chronicals.data import PackedLoader
    from chronicals.data.dataset import DatasetStats, TokenizedDataset

    ids = np.arange(rows * 8, dtype=np.int32) % 50 + 1
    offsets = np.arange(rows + 1) * 8
    stats = DatasetStats(records=rows, documents=rows, tokens=rows * 8, loss_tokens=rows * 7)
    ds = TokenizedDataset(ids, np.ones(rows * 8, dtype=bool), offsets, 0, stats, 8)
    return PackedLoader(ds, batch_size=2, max_seq_len=8, shuffle=False, rank=rank, world_size=world,
                        remainder=remainder)

def test_a_resumed_data_parallel_plan_counts_rounds_of_the_fraction(tmp_path):
    """The resume's re-plan (stream._replan) takes the loader's spread as the first plan does: 0.7 of 5 global
    batches on 2 ranks is ceil(ceil(3.5) / 2) = 2 steps, where the rank's own 3 batches gave ceil(2.1) = 3
    (untested: a mutation walk)."""
    from chronicals.train.stream import _replan, _Stream, cut_fraction

    cfg = tiny_config(tmp_path, train__epochs=0.7, train__max_steps=0)
    loader = _packed_loader(9, 0, 2)
    cut_fraction(cfg, loader)
    assert _replan(cfg, _Stream(loader), 0, 99, 1, tmp_path) == (2, 1)
    next(iter(loader))  # one batch in: position 1 of epoch 0
    assert _replan(cfg, _Stream(loader), 1, 99, 1, tmp_path) == (2, 1)


def test_a_cut_under_drop_counts_only_the_whole_rounds(tmp_path):
    """remainder="drop": 5 global batches on 2 ranks train 4 an epoch, so 0.5 epochs is ceil(2 / 2) = 1 step (counting
    the dropped batch gave ceil(ceil(2.5) / 2) = 2, a step into the half-empty round; a mutation walk)."""
    from chronicals.train.stream import _spread, _step_plan

    loader = _packed_loader(9, 0, 2, remainder="drop")
    assert loader.trained_global_batches == 4 and len(loader) == 2
    assert _step_plan(tiny_config(tmp_path, train__epochs=0.5, train__max_steps=0), len(loader),
                      spread=_spread(loader)) == (1, 1)


def test_no_cut_under_max_steps(tmp_path):
    """train.max_steps with a fractional train.epochs beside it: the steps decide; the ranks' epochs are not cut (a cut
    would hand them empty batches for the rest of each epoch; untested: a mutation walk)."""
    from chronicals.train.stream import cut_fraction

    loader = _packed_loader(9, 0, 2)
    cut_fraction(tiny_config(tmp_path, train__max_steps=5, train__epochs=0.5), loader)
    assert "cut" not in loader.state_dict()
    cut_fraction(tiny_config(tmp_path, train__max_steps=0, train__epochs=0.5), loader)
    assert "cut" in loader.state_dict()  # the same fraction without max_steps is cut


def test_a_cut_on_a_full_round_says_nothing_when_resumed_longer(tmp_path, caplog):
    """0.4 of 5 global batches on 2 ranks is 2: one full round, nothing handed empty. Resumed with train.epochs=1,
    no batch is skipped, so no warning (">=" said "global batches 3..2 are not trained"; a mutation walk)."""
    from chronicals.train.stream import cut_fraction

    short = _packed_loader(9, 1, 2)
    cut_fraction(tiny_config(tmp_path, train__epochs=0.4, train__max_steps=0), short)
    next(iter(short))
    state = short.state_dict()
    assert state["cut"] == [0, 2]
    longer = _packed_loader(9, 1, 2)
    cut_fraction(tiny_config(tmp_path, train__epochs=1, train__max_steps=0), longer)
    with caplog.at_level("WARNING", logger="chronicals.data"):
        longer.load_state_dict(state)
    assert caplog.text == ""


def test_the_first_steps_divergence_names_the_quantity_that_was_not_finite():
    """At a process's first step with NaN/inf weights the message says which check failed: the loss (NaN loss) or the
    gradient norm (finite loss, inf norm); no last good checkpoint is asked for, as there is none. A non-finite loss
    is named even when the norm is NaN too (as a NaN loss leaves it): picking by the norm said "gradient norm"."""
    from chronicals.train.divergence import _check_finite

    never = lambda: pytest.fail("no last good checkpoint is asked for at the first step")  # noqa: E731
    with pytest.raises(TrainingDiverged, match=r"^loss is not finite at step 1, the first this process ran, "
                                               r".*1 tensor, e\.g\. w"):
        _check_finite(1, math.nan, 1.0, never, lambda: ["w"])
    for loss in (math.nan, math.inf):
        with pytest.raises(TrainingDiverged, match=r"^loss is not finite at step 4, the first this process ran"):
            _check_finite(4, loss, math.nan, never, lambda: ["w"])
    with pytest.raises(TrainingDiverged, match=r"^gradient norm is not finite at step 1, the first this process ran"):
        _check_finite(1, 2.5, math.inf, never, lambda: ["w"])
    with pytest.raises(TrainingDiverged, match=r"^gradient norm is not finite at step 4"):
        _check_finite(4, 1.25, math.nan, never, lambda: ["w"])
    _check_finite(1, 2.5, 1.0, never, lambda: ["w"])


def test_the_first_steps_divergence_counts_every_damaged_tensor_and_names_three():
    """With 5 damaged tensors the message counts all 5 and names the first three, in order: counting only the
    names shown said 3, and naming one hid the rest."""
    from chronicals.train.divergence import _check_finite

    bad = ["a.weight", "b.weight", "c.weight", "d.weight", "e.weight"]
    with pytest.raises(TrainingDiverged) as e:
        _check_finite(1, math.nan, math.nan, lambda: pytest.fail("no last good checkpoint is asked for"), lambda: bad)
    msg = str(e.value)
    assert "before any update: 5 tensors, e.g. a.weight, b.weight, c.weight; the checkpoint" in msg, msg
    assert "d.weight" not in msg


def test_a_later_steps_infinite_loss_is_named_as_the_loss():
    """After the first step, an inf (or -inf) loss under a finite norm says "loss is inf", with the last good
    checkpoint or its absence; testing the loss with isnan reported it as a gradient-norm divergence with the loss
    in brackets. A finite loss under an inf norm names the norm."""
    from chronicals.train.divergence import _check_finite

    with pytest.raises(TrainingDiverged, match=r"^loss is inf at step 3; stopping without its update\. No checkpoint "
                                               r"was written before it"):
        _check_finite(3, math.inf, 2.0, lambda: None)
    with pytest.raises(TrainingDiverged, match=r"^loss is -inf at step 3; stopping without its update\. The last "
                                               r"good checkpoint is runs/x/checkpoints/step-000002;"):
        _check_finite(3, -math.inf, 2.0, lambda: Path("runs/x/checkpoints/step-000002"))
    with pytest.raises(TrainingDiverged, match=r"^gradient norm is inf \(loss 1\.5000\) at step 3;"):
        _check_finite(3, 1.5, math.inf, lambda: None)


def test_a_first_step_with_intact_weights_names_the_last_good_checkpoint():
    """At a process's first step with no NaN/inf weight, a non-finite loss is the ordinary divergence: the message
    names the checkpoint the run resumed from, not damaged weights."""
    from chronicals.train.divergence import _check_finite

    with pytest.raises(TrainingDiverged, match=r"^loss is nan at step 5; stopping without its update\. The last "
                                               r"good checkpoint is runs/x/checkpoints/step-000004;"):
        _check_finite(5, math.nan, 1.0, lambda: Path("runs/x/checkpoints/step-000004"), lambda: [])


@pytest.mark.parametrize("fused", ["false", "true"])  # every step read / the pipelined loop
def test_a_step_after_an_evaluation_or_a_checkpoint_is_timed_from_its_own_start(tmp_path, docs, monkeypatch, fused):
    """A step's time runs from the previous step's end only when nothing ran between the two; after an interval
    evaluation or a checkpoint it runs from the step's own start. Chained across them, a step's step_s on CUDA
    would also hold the evaluation's or the save's time (its tokens/s and MFU too low). Checked on the wiring, since
    the CPU times each step from its start anyway: which readback each step's readback is chained to."""
    made = []

    class Recorded(loop.StepReadback):
        def __init__(self, *args, after=None, **kw):
            super().__init__(*args, after=after, **kw)
            made.append((self, after))

    monkeypatch.setattr(loop, "StepReadback", Recorded)
    # evaluations after steps 2 and 4 (none after the last step: the "after" pass), checkpoints after 3 and 6
    cfg = tiny_config(tmp_path, train__max_steps=6, eval__every=2, train__save_every=3, optim__fused=fused)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs),
          eval_loader=SyntheticLoader(docs[:4], shuffle=False))
    assert len(made) == 6
    chained = [after is not None for _, after in made]
    assert chained == [False, True, False, False, False, True]
    assert made[1][1] is made[0][0] and made[5][1] is made[4][0]  # the step just before, not an older one
