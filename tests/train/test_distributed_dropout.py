"""Data parallelism with LoRA dropout: each rank draws its own masks (train.distributed.rank_seed), and a run
stopped by a signal and resumed ends bit for bit like a straight run (each rank's generator comes back from the
checkpoint).
A resume from a checkpoint that holds no generator state for this number of ranks (written by one process, or by
another number of ranks: allowed at an epoch's start or end) still draws other seeds on each rank: restoring rank
0's generator on every rank would draw the same seeds again. 2 ranks on gloo (CPU), as
tests/train/test_distributed.py runs them."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from chronicals.train import train
from chronicals.train.distributed import rank_seed

from test_distributed import DEVICE, WORLD, _cpu_state, _free_port, _shards, _torchrun_env
from train_helpers import record_dropout_seeds, sigterm_at_forward, spawn_ranks, synthetic_docs, tiny_config, tiny_model


def _dropout_worker(rank: int, ports: tuple, out: str) -> None:
    seeds = record_dropout_seeds()
    docs = synthetic_docs(40, seed=1)
    over = dict(lora__enabled=True, lora__dropout=0.3, train__max_steps=4, model__device=DEVICE,
                train__cuda_graphs="false")
    _torchrun_env(rank, ports[0])
    straight = tiny_model(seed=0)
    train(tiny_config(Path(out) / "straight", **over), model=straight, train_loader=_shards(docs, WORLD)[1][rank])
    straight_seeds = list(seeds)
    os.environ["MASTER_PORT"] = str(ports[1])
    cfg = tiny_config(Path(out) / "stop", train__resume="auto", train__save_every=1, **over)
    first = tiny_model(seed=0)
    if rank == 1:
        sigterm_at_forward(first, 2)
    stopped = train(cfg, model=first, train_loader=_shards(docs, WORLD)[1][rank])
    os.environ["MASTER_PORT"] = str(ports[2])
    resumed = tiny_model(seed=0)  # LoRA: the checkpoint holds the adapters, the base comes from here
    train(cfg, model=resumed, train_loader=_shards(docs, WORLD)[1][rank])
    torch.save({"seeds": straight_seeds, "straight": _cpu_state(straight), "stopped": (stopped.status, stopped.step),
                "resumed": _cpu_state(resumed)}, f"{out}/dropout{rank}.pt")


def test_ranks_draw_their_own_masks_and_resume_exactly(tmp_path):
    spawn_ranks(_dropout_worker, args=(tuple(_free_port() for _ in range(3)), str(tmp_path)), nprocs=WORLD,
                device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"dropout{r}.pt", weights_only=False) for r in range(WORLD))
    assert len(r0["seeds"]) == len(r1["seeds"]) > 0
    assert not set(r0["seeds"]) & set(r1["seeds"])  # the same seed on both ranks drew the same masks before
    for n, v in r0["straight"].items():  # one all-reduced update: the ranks' weights stay equal
        assert torch.equal(v, r1["straight"][n]), n
    assert r0["stopped"] == r1["stopped"] and r0["stopped"][0] == "interrupted"
    for r in (r0, r1):  # each rank's generator restored, after the rank seeding: bit for bit on the CPU
        for n, v in r["resumed"].items():
            if DEVICE == "cpu":
                assert torch.equal(v, r0["straight"][n]), n
            else:
                torch.testing.assert_close(v, r0["straight"][n], rtol=1e-5, atol=1e-6, msg=n)


def test_rank_seed_keeps_rank_0_and_spreads_the_others():
    assert rank_seed(7, 0) == 7
    assert len({rank_seed(7, r) for r in range(64)}) == 64 and all(0 <= rank_seed(7, r) < 2 ** 63 for r in range(64))


_OVER = dict(lora__enabled=True, lora__dropout=0.3, model__device="cpu", train__cuda_graphs="false",
             train__resume="auto")


def _resume_worker(rank: int, port: int, out: str) -> None:
    seeds = record_dropout_seeds()
    _torchrun_env(rank, port)
    docs = synthetic_docs(40, seed=1)
    train(tiny_config(Path(out), train__max_steps=4, **_OVER), model=tiny_model(seed=0),
          train_loader=_shards(docs, WORLD)[1][rank])
    torch.save(seeds, f"{out}/seeds{rank}.pt")


def test_resume_of_a_one_process_checkpoint_draws_other_seeds_per_rank(tmp_path):
    docs = synthetic_docs(40, seed=1)
    # one process, 2 steps: a checkpoint without per-rank generator states (no "rank_rng")
    first = train(tiny_config(tmp_path, train__max_steps=2, **_OVER), model=tiny_model(seed=0),
                  train_loader=_shards(docs, WORLD)[1][0])
    assert first.status == "completed" and first.step == 2
    spawn_ranks(_resume_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    s0, s1 = (torch.load(tmp_path / f"seeds{r}.pt") for r in range(WORLD))
    assert len(s0) == len(s1) > 0
    assert not set(s0) & set(s1)  # before: rank 1 restored rank 0's generator and drew rank 0's seeds
