"""Data parallelism with LoRA dropout, resumed from a checkpoint that holds no generator state for this number of
ranks (written by one process, or by another number of ranks: allowed at an epoch's start or end). load_checkpoint
restores rank 0's generator on every rank, so every rank drew the same dropout seeds again, which rank_seed exists to
prevent. 2 gloo ranks on the CPU, as tests/train/test_distributed.py runs them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from chronicals.train import train

from test_distributed import WORLD, _free_port, _shards, _torchrun_env
from train_helpers import record_dropout_seeds, synthetic_docs, tiny_config, tiny_model

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
    mp.spawn(_resume_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    s0, s1 = (torch.load(tmp_path / f"seeds{r}.pt") for r in range(WORLD))
    assert len(s0) == len(s1) > 0
    assert not set(s0) & set(s1)  # before: rank 1 restored rank 0's generator and drew rank 0's seeds
