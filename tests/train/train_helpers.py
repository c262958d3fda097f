"""Tiny models and a synthetic packed loader (the PackedLoader protocol) for the trainer tests."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from chronicals.config import from_dict
from chronicals.data import collate_rows
from chronicals.models import CausalLM, ModelConfig

VOCAB = 61  # odd on purpose


def tiny_model(seed: int = 0, dtype=torch.float32, layers: int = 2) -> CausalLM:
    import transformers

    hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=seed).to(dtype)


def synthetic_docs(n: int, seed: int = 0, lo: int = 5, hi: int = 19):
    """n documents (ids (L,), trainable (L,)): a learnable pattern (next = prev + 1 mod VOCAB), loss on the 2nd half."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        L = int(rng.integers(lo, hi))
        start = int(rng.integers(0, VOCAB))
        ids = (start + np.arange(L)) % VOCAB
        trainable = np.zeros(L, dtype=bool)
        trainable[L // 2:] = True
        docs.append((ids.astype(np.int64), trainable))
    return docs


class SyntheticLoader:
    """Rows of ``row_len`` filled greedily with documents; ``batch_size`` rows per batch; the batch
    order is shuffled per epoch from (seed, epoch). Same protocol as chronicals.data.PackedLoader."""

    def __init__(self, docs, batch_size: int = 2, row_len: int = 32, seed: int = 0, shuffle: bool = True):
        rows, cur, used = [], [], 0
        for d in docs:
            if used + len(d[0]) > row_len:
                rows.append(cur)
                cur, used = [], 0
            cur.append(d)
            used += len(d[0])
        if cur:
            rows.append(cur)
        self.batches = [collate_rows(rows[i:i + batch_size], row_len, pad_id=0) for i in range(0, len(rows), batch_size)]
        self.seed, self.shuffle, self.epoch, self.position = seed, shuffle, 0, 0

    def __len__(self):
        return len(self.batches)

    def _order(self):
        if not self.shuffle:
            return list(range(len(self)))
        return np.random.default_rng((self.seed, self.epoch)).permutation(len(self)).tolist()

    def __iter__(self):
        order = self._order()
        while self.position < len(order):
            b = self.batches[order[self.position]]
            self.position += 1
            yield b
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd):
        self.epoch, self.position = sd["epoch"], sd["position"]


def tiny_config(tmp_path, **over):
    base = {"model": {"device": "cpu", "impl": "torch", "dtype": "float32"},
            "lora": {"enabled": False},
            "optim": {"lr": 3e-3, "grad_clip": 1.0},
            "schedule": {"warmup_steps": 2},
            "train": {"max_steps": 8, "out_dir": str(tmp_path / "run"), "resume": "none", "save_final": False},
            "data": {"max_seq_len": 128},  # tiny_model's max_position_embeddings: train refuses rows past it
            "eval": {"qa": False},
            "logging": {"progress": False, "tensorboard": False, "plot": False}}
    for key, v in over.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = v
    return from_dict(base)


def assert_graphed_run_like_eager(eager: list, graphed: list, steps: int) -> None:
    """Train records (metrics.jsonl, kind "train") of a CUDA-graph run against the same run eager: the same
    loss tokens, losses and gradient norms to bf16 tolerance, and losses that move (the replays saw new batches)."""
    assert len(eager) == len(graphed) == steps
    for a, b in zip(eager, graphed):
        assert a["loss_tokens"] == b["loss_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2) and b["grad_norm"] > 0
    assert len({r["loss"] for r in graphed}) > 1


def sigterm_at_forward(model, k: int):
    """This process gets a SIGTERM during ``model``'s k-th forward (1-based, counted at its final norm: a micro-batch
    inside a step's accumulation counts); the loop finishes that step, checkpoints it and returns. -> the model."""
    import os
    import signal

    calls = [0]

    def hook(module, args, out):
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    model.model.norm.register_forward_hook(hook)
    return model


def record_dropout_seeds() -> list[int]:
    """From now on in this process, every LoRA dropout draw's seed is appended to the returned list."""
    import chronicals.ops.dropout as D

    seeds, real_draw = [], D.draw

    def recording_draw(p, device):
        d = real_draw(p, device)
        seeds.append(int(d.seed.item()))
        return d
    D.draw = recording_draw
    return seeds


def full_disk_for(monkeypatch, name: str) -> None:
    """Files whose name holds ``name`` (the target or its temporary file) sit on a full disk: Path.open for writing
    opens (and truncates) them, and every write raises ENOSPC; Path.write_text too."""
    import errno
    from pathlib import Path

    real_open = Path.open

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self):  # the writer locks its temporary file first
            return self.fh.fileno()

        def flush(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def fake_open(self, mode="r", *a, **k):
        fh = real_open(self, mode, *a, **k)
        return Full(fh) if "w" in mode and name in self.name else fh

    def fake_write_text(self, text, *a, **k):
        with fake_open(self, "w", *a, **k) as fh:
            return fh.write(text)

    monkeypatch.setattr(Path, "open", fake_open)
    monkeypatch.setattr(Path, "write_text", fake_write_text)


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity / -Infinity (what JSON.parse and other strict readers refuse)."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant} in {text}")
    return json.loads(text, parse_constant=refuse)


def spawn_ranks(fn, args: tuple, nprocs: int, device: str = "cpu") -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``; on the CPU the ranks are forked from a
    forkserver that has imported torch and chronicals once. A spawned rank spent ~3.3 s of a 2-core CPU
    importing them, so each 2-rank test paid ~4 s before its first step. The forkserver is a fresh process (no
    threads, no process group), so a rank still starts as torchrun's would, less the imports. CUDA ranks
    (``device="cuda"``) keep spawn: nothing CUDA may have run in the process they are forked from."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = "spawn" if device == "cuda" else "forkserver"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "chronicals.train", "chronicals.cli"])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=method)
