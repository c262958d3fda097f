"""Exact resume in combinations the other resume tests leave out (a stop, then train.resume=auto, against an
uninterrupted run: weights, optimizer state, schedule, data position and RNG in the last checkpoint, and the
metrics.jsonl rows, bit for bit)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from chronicals.data import PackedLoader
from chronicals.data.dataset import DatasetStats, TokenizedDataset
from chronicals.train import train

from train_helpers import synthetic_docs, tiny_config, tiny_model

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

    mp.spawn(_dropout_worker, args=(tuple(_free_port() for _ in range(3)), str(tmp_path)), nprocs=WORLD, join=True)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"dropout{r}.pt", weights_only=False)
        assert got["stopped"] == ("interrupted", 2)
        for n, v in got["straight"].items():
            assert torch.equal(v, got["resumed"][n]), (r, n)
