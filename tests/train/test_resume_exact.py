"""Exact resume in combinations the other resume tests leave out (a stop, then train.resume=auto, against an
uninterrupted run: weights, optimizer state, schedule, data position and RNG in the last checkpoint, and the
metrics.jsonl rows, bit for bit)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from chronicals.data import PackedLoader
from chronicals.data.dataset import DatasetStats, TokenizedDataset
from chronicals.train import train

from train_helpers import sigterm_at_forward, spawn_ranks, synthetic_docs, tiny_config, tiny_model

WORLD = 2


def _padding_free_loader(rank: int = 0, world: int = 1) -> PackedLoader:
    """tokens_per_batch: one padding-free row per batch, so each rank's batch has its own length."""
    docs = synthetic_docs(40, seed=1)
    lengths = [len(d[0]) for d in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stats = DatasetStats(records=len(docs), documents=len(docs), tokens=int(offsets[-1]),
                         loss_tokens=sum(int(d[1][1:].sum()) for d in docs))
    ds = TokenizedDataset(np.concatenate([d[0] for d in docs]).astype(np.int32), np.concatenate([d[1] for d in docs]),
                          offsets, 0, stats, 32)
    return PackedLoader(ds, tokens_per_batch=48, max_seq_len=32, seed=3, rank=rank, world_size=world)


def _dropout_worker(rank: int, ports: tuple, out: str) -> None:
    from test_distributed import _torchrun_env

    _torchrun_env(rank, ports[0])
    over = dict(train__max_steps=4, lora__enabled=True, lora__rank=4, lora__dropout=0.2,
                lora__targets=["q_proj", "v_proj"])
    straight = tiny_model()
    train(tiny_config(Path(out) / "straight", **over), model=straight, train_loader=_padding_free_loader(rank, WORLD))
    os.environ["MASTER_PORT"] = str(ports[1])
    cfg = tiny_config(Path(out) / "stop", train__resume="auto", **over)

    def sigterm_rank1(step, rec):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    stopped = train(cfg, model=tiny_model(), train_loader=_padding_free_loader(rank, WORLD), on_step=sigterm_rank1)
    os.environ["MASTER_PORT"] = str(ports[2])
    resumed = tiny_model()
    train(cfg, model=resumed, train_loader=_padding_free_loader(rank, WORLD))
    torch.save({"stopped": (stopped.status, stopped.step), "straight": straight.state_dict(),
                "resumed": resumed.state_dict()}, f"{out}/dropout{rank}.pt")


def test_data_parallel_lora_dropout_resumes_each_ranks_rng(tmp_path):
    """2 ranks, LoRA dropout, padding-free batches: each rank's dropout masks are as long as its own batch, so
    the ranks' RNGs advance apart. The checkpoint held rank 0's RNG alone and every rank resumed with it: rank 1
    drew other masks than in the uninterrupted run, and the adapters ended elsewhere. Each rank's RNG is kept."""
    from test_distributed import _free_port

    spawn_ranks(_dropout_worker, args=(tuple(_free_port() for _ in range(3)), str(tmp_path)), nprocs=WORLD)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"dropout{r}.pt", weights_only=False)
        assert got["stopped"] == ("interrupted", 2)
        for n, v in got["straight"].items():
            assert torch.equal(v, got["resumed"][n]), (r, n)


# ---- one process: the final checkpoint and metrics.jsonl of a stopped-and-resumed run equal the straight run's ----
def _sigterm_at(step_k):
    def on_step(step, rec):
        if step == step_k:
            os.kill(os.getpid(), signal.SIGTERM)
    return on_step


def _last_state(run: Path) -> dict:
    from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs

    state = torch.load(checkpoint_dirs(run)[-1] / STATE_FILE, weights_only=False)
    for key in ("out_dir", "resume"):  # the two runs' own settings
        state["extra"]["config"]["train"].pop(key)
    return state


def _assert_same(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl without the timing fields."""
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_s", "mfu", "mem_gib")} for r in rows]


def _eval_loader():
    from train_helpers import SyntheticLoader

    return SyntheticLoader(synthetic_docs(10, seed=2), shuffle=False)


def test_lora_dropout_padding_free_shuffled_epochs_resumed_twice_ends_like_a_straight_run(tmp_path):
    """Padding-free shuffled batches (10 an epoch), grad_accum 3 (steps of 3, 3, 3, 1 per epoch), train.epochs=2,
    eval.every=3 and save_every=2 (not dividing each other), keep_last=1, async saves, LoRA dropout (the RNG
    matters): stopped at step 3, resumed and stopped at step 4 (the epoch's short last step), resumed to the end.
    The last checkpoint (weights, AdamW moments, schedule, data position, RNG) and metrics.jsonl equal the
    uninterrupted run's."""
    over = dict(train__max_steps=0, train__epochs=2, train__grad_accum=3, eval__every=3, train__save_every=2,
                train__keep_last=1, train__async_save=True, lora__enabled=True, lora__rank=4, lora__dropout=0.2,
                lora__targets=["q_proj", "v_proj", "down_proj"], schedule__warmup_steps=3)
    assert len(_padding_free_loader()) == 10
    train(tiny_config(tmp_path / "a", **over), model=tiny_model(), train_loader=_padding_free_loader(),
          eval_loader=_eval_loader())
    cfg = tiny_config(tmp_path / "b", train__resume="auto", **over)
    for stop in (3, 4):
        got = train(cfg, model=tiny_model(), train_loader=_padding_free_loader(), eval_loader=_eval_loader(),
                    on_step=_sigterm_at(stop))
        assert (got.status, got.step) == ("interrupted", stop)
    torch.manual_seed(1234)  # another global RNG at the restart must not matter
    done = train(cfg, model=tiny_model(), train_loader=_padding_free_loader(), eval_loader=_eval_loader())
    assert (done.status, done.step) == ("completed", 8)
    _assert_same(_last_state(tmp_path / "a" / "run"), _last_state(tmp_path / "b" / "run"))
    rows = _rows(tmp_path / "b" / "run")
    assert rows == _rows(tmp_path / "a" / "run")
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))


def test_bf16_masters_pipelined_stop_inside_accumulation_ends_like_a_straight_run(tmp_path):
    """Full fine-tuning of bf16 weights with fp32 master weights, fused AdamW (the pipelined loop, each step read
    one step late), grad_accum 3: a SIGTERM during the 2nd micro-batch of step 3 finishes step 3, checkpoints it
    and returns; the resumed run's last checkpoint (bf16 weights, fp32 masters and moments) and metrics equal
    the uninterrupted run's."""
    over = dict(train__max_steps=6, train__grad_accum=3, model__dtype="bfloat16", optim__master_weights="true",
                optim__fused="true", optim__lr=1e-3, train__save_every=4)
    loader = lambda: _padding_free_loader()  # noqa: E731
    train(tiny_config(tmp_path / "a", **over), model=tiny_model(dtype=torch.bfloat16), train_loader=loader())
    cfg = tiny_config(tmp_path / "b", train__resume="auto", **over)
    got = train(cfg, model=sigterm_at_forward(tiny_model(dtype=torch.bfloat16), 2 * 3 + 2), train_loader=loader())
    assert (got.status, got.step) == ("interrupted", 3)
    train(cfg, model=tiny_model(dtype=torch.bfloat16), train_loader=loader())
    a, b = _last_state(tmp_path / "a" / "run"), _last_state(tmp_path / "b" / "run")
    assert any("master" in s for s in a["optimizer"]["state"].values())
    _assert_same(a, b)
    assert _rows(tmp_path / "a" / "run") == _rows(tmp_path / "b" / "run")


def test_apply_optimizer_settings_puts_back_this_runs_implementation():
    """The groups a checkpoint restores carry its run's fused flag; this run's comes back, and the step counts
    move where that implementation reads them (fused: the parameter's device; unfused: the CPU)."""
    from chronicals.train.resume import apply_optimizer_settings, optimizer_settings

    p = torch.nn.Parameter(torch.randn(3))
    old = torch.optim.AdamW([p], lr=0.1, fused=False)
    p.grad = torch.ones(3)
    old.step()
    new = torch.optim.AdamW([p], lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(new, lambda s: 1.0)
    fresh = optimizer_settings(new, sched)
    new.load_state_dict(old.state_dict())
    assert not new.param_groups[0]["fused"]
    apply_optimizer_settings(new, sched, fresh, None, {}, 1)
    assert new.param_groups[0]["fused"] and new.state[p]["step"].dtype == torch.float32
    new.step()  # the fused kernel, on the restored moments


@pytest.mark.parametrize("step, total, warned", [(2, None, True), (2, 5, True), (5, 5, False)])
def test_other_optimizer_settings_are_said_unless_nothing_is_left_to_train(caplog, step, total, warned):
    """Resumed under another optim.lr, the warning names it and the step it applies from; with no total given (a
    caller that does not know the run's length) too; at the run's last step nothing trains under it: no warning."""
    import logging

    from chronicals.train.resume import apply_optimizer_settings, optimizer_settings

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        apply_optimizer_settings(opt, sched, optimizer_settings(opt, sched), {"optim": {"lr": 1e-3}},
                                 {"optim": {"lr": 2e-3}}, step=step, total=total)
    said = [r.getMessage() for r in caplog.records]
    assert bool(said) == warned, said
    if warned:
        assert said == [f"resumed at step {step} with other settings than the checkpoint's run: optim.lr=0.001 "
                        f"(this run: 0.002); they apply from step {step + 1} on (the AdamW moments are kept)"]


def test_a_capturable_groups_steps_go_to_the_parameters_device():
    """A capturable AdamW (CUDA graphs) resumed from a checkpoint of an uncapturable run gets its flag back and its
    step counts on the parameter's device (as torch's load_state_dict does for fused or capturable groups), not left
    on the CPU for a captured step to read. On a CPU machine both would be the CPU: the parameter is on meta."""
    from chronicals.train.resume import apply_optimizer_settings, optimizer_settings

    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.AdamW([p], lr=1e-3, capturable=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    fresh = optimizer_settings(opt, sched)
    opt.state[p] = {"step": torch.tensor(2.0, dtype=torch.float64), "exp_avg": torch.empty(3, device="meta"),
                    "exp_avg_sq": torch.empty(3, device="meta")}  # as the uncapturable run's checkpoint restores
    opt.param_groups[0]["capturable"] = False
    apply_optimizer_settings(opt, sched, fresh, None, {}, step=2)
    step = opt.state[p]["step"]
    assert opt.param_groups[0]["capturable"] is True and step.device == p.device and step.dtype == torch.float32
