"""Data parallelism: 2 ranks (train_helpers.spawn_ranks: forked from a forkserver on the CPU, spawned on CUDA)
against one process on all the data.

On CPU (the default, CI): gloo. With ``CHRONICALS_TEST_DP_DEVICE=cuda`` on a machine with 2 GPUs: NCCL,
rank r on cuda:r, the one-process reference on cuda:0 (the same tests, same assertions except where a
GPU kernel's own nondeterminism is named).
The ranks' results come back as files under tmp_path (torch.save, moved to the CPU); each worker sets the
variables torchrun would (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and uses one thread,
since the two processes share this machine's cores.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist

from chronicals.train import accumulate_gradients, train
from chronicals.train.distributed import init_distributed
from chronicals.train.grad_buckets import GradBuckets
from chronicals.train.step import accumulate_data_parallel, batch_loss_sum

from train_helpers import (SyntheticLoader, assert_graphed_run_like_eager, sigterm_at_forward, spawn_ranks,
                           synthetic_docs, tiny_config, tiny_model)

WORLD = 2
CPU = torch.device("cpu")
DEVICE = os.environ.get("CHRONICALS_TEST_DP_DEVICE", "cpu")  # "cpu" (gloo) or "cuda" (NCCL, 2 GPUs)
REF = torch.device("cuda:0" if DEVICE == "cuda" else "cpu")  # where the one-process reference runs
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"
if DEVICE == "cuda" and torch.cuda.device_count() < WORLD:
    pytest.skip(f"CHRONICALS_TEST_DP_DEVICE=cuda needs {WORLD} GPUs (found {torch.cuda.device_count()})",
                allow_module_level=True)


_USED_PORTS: set[int] = set()


def _free_port() -> int:
    """A port for a process group's store, from 20000-32767: below Linux's ephemeral range (32768-60999), so an
    outgoing connection of another process cannot take it between this check and the store binding it (bind(0)
    handed out ephemeral ports, and the rare failures of these tests looked like that race); never the same
    port twice in one session."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port in _USED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _USED_PORTS.add(port)
        return port
    raise RuntimeError("no free TCP port in 20000-32767 on 127.0.0.1")


def _torchrun_env(rank: int, port: int) -> None:
    import datetime

    from chronicals.train import distributed

    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a rank that dies of a signal (once on CI: SIGABRT, "terminate called without an active exception", not seen
    # again in ~100 reruns) prints every thread's Python stack to the test's captured stderr
    faulthandler.enable(all_threads=True)
    # a regression that leaves one rank waiting in a collective fails in 5 minutes, not the job's 60 (with the
    # agreement check removed, its test hung until then: a mutation walk)
    distributed.GROUP_TIMEOUT = datetime.timedelta(minutes=5)


def _grads(model) -> dict:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def _on(model, device):
    """The fp32 tiny model on ``device`` with the PyTorch ops (the CUDA varlen kernel takes bf16 only)."""
    model.set_impl("torch")
    return model.to(device)


def _cpu_state(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _train_recs(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _micro_batches():
    """4 micro-batches with unequal loss-token counts: rank 0 takes the first, rank 1 the other three."""
    return SyntheticLoader(synthetic_docs(30, seed=3), batch_size=1, row_len=29, shuffle=False).batches[:4]


def _shards(docs, world: int):
    """(one process's loader over 2k batches, per-rank loaders of k each): rank r takes batches r, r+W, ...

    So one process with grad_accum=W sees, per step, the union of the ranks' batches of that step.
    """
    full = SyntheticLoader(docs, shuffle=False)
    full.batches = full.batches[:len(full.batches) // world * world]
    ranks = []
    for r in range(world):
        shard = SyntheticLoader(docs, shuffle=False)
        shard.batches = full.batches[r::world]
        ranks.append(shard)
    return full, ranks


# ---- workers (module level: spawn pickles them by name) ----
def _empty_batch():
    """What PackedLoader(remainder="train") gives a rank past the end of an epoch's last round."""
    from chronicals.data import collate_rows

    return collate_rows([[]], 29, 0)


def _grad_worker(rank: int, port: int, out: str, reduce: str = "after", split: str = "1+3") -> None:
    _torchrun_env(rank, port)
    dp = init_distributed(DEVICE)
    try:
        micro = _micro_batches()
        if split == "1+3":
            mine = micro[:1] if rank == 0 else micro[1:]
        else:  # "4+empty": rank 1's only micro-batch is an empty one
            mine = micro if rank == 0 else [_empty_batch()]
        model = _on(tiny_model(seed=0), dp.device)
        params = [p for p in model.parameters() if p.requires_grad]
        # overlap: small buckets (several per dtype) so the in-order issue across buckets is exercised
        reducer = GradBuckets(dp, params, bucket_elems=3_000) if reduce == "overlap" else None
        if reducer is not None:
            assert len(reducer.flats) > 3
        loss, n = accumulate_data_parallel(model, mine, dp.device, dp, params, reducer=reducer)
        assert isinstance(n, torch.Tensor) and n.device == dp.device  # the count stays on the device (no host sync)
        torch.save({"loss": loss.cpu(), "n": int(n), "grads": _grads(model), "backend": dp.backend,
                    "device": str(dp.device)}, f"{out}/rank{rank}.pt")
        dp.barrier()  # as in _overlap_worker: no teardown while the other rank may be in a collective
    finally:
        dp.destroy()


def _main_first_worker(rank: int, port: int, out: str) -> None:
    """Rank 0's block (tokenizing, in a real run) outlasts the process group's timeout, cut to 2 s here."""
    import datetime
    import time

    from chronicals.train import distributed

    _torchrun_env(rank, port)
    distributed.GROUP_TIMEOUT = datetime.timedelta(seconds=2)
    dp = init_distributed(DEVICE)
    try:
        with dp.main_first():
            if rank == 0:
                time.sleep(5)
        t = torch.ones(1, device=dp.device)
        dp.all_reduce_sum_(t)  # the group itself still works afterwards
        torch.save({"sum": float(t)}, f"{out}/rank{rank}.pt")
        dp.barrier()
    finally:
        dp.destroy()


def _main_first_fails_worker(rank: int, port: int, out: str) -> None:
    """Rank 0's block fails (a bad data record, in a real run); rank 1 records whether its block ran, and what it
    raised."""
    from pathlib import Path

    _torchrun_env(rank, port)
    dp = init_distributed(DEVICE)
    said = {"ran": False, "error": None}
    try:
        with dp.main_first():
            said["ran"] = True
            if rank == 0:
                raise ValueError("data.jsonl:6: messages[0] has no 'content'")
    except Exception as e:  # noqa: BLE001 - recorded for the test
        said["error"] = f"{type(e).__name__}: {e}"
    finally:
        dp.destroy()
    torch.save(said, Path(out) / f"rank{rank}.pt")


def test_a_failure_in_rank_0s_first_turn_stops_the_others_with_its_error(tmp_path):
    """Rank 0 failed in main_first (its data tokenization: a bad record) and removed the out_dir it had made; rank 1,
    released by the barrier, ran the block anyway and failed first, on "[Errno 2] No such file or directory:
    'out/data/.heldout.jsonl.tmp-PID'" (torchrun's "root cause"), while rank 0's own error could be cut off by
    torchrun's SIGTERM (a data-parallel walk). The others now raise rank 0's error without running the block."""
    spawn_ranks(_main_first_fails_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    for rank in range(WORLD):
        said = torch.load(tmp_path / f"rank{rank}.pt")
        assert said["error"] == "ValueError: data.jsonl:6: messages[0] has no 'content'", (rank, said)
        assert said["ran"] == (rank == 0), (rank, said)


def _none_grad_worker(rank: int, port: int, out: str) -> None:
    _torchrun_env(rank, port)
    dp = init_distributed(DEVICE)
    try:
        dev = dp.device
        unused, only0, both = (torch.nn.Parameter(torch.zeros(n, device=dev)) for n in (3, 2, 4))
        both.grad = torch.full((4,), float(rank + 1), device=dev)
        if rank == 0:
            only0.grad = torch.ones(2, device=dev)
        dp.all_reduce_grads([unused, only0, both])
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
        torch.save({"unused": cpu(unused.grad), "only0": cpu(only0.grad), "both": cpu(both.grad)},
                   f"{out}/none{rank}.pt")
        dp.barrier()
    finally:
        dp.destroy()


def _all_grads_on_rank_0_worker(rank: int, port: int, out: str) -> None:
    _torchrun_env(rank, port)
    dp = init_distributed(DEVICE)
    try:
        dev = dp.device
        both, only0 = (torch.nn.Parameter(torch.zeros(2, device=dev)) for _ in range(2))
        both.grad = torch.ones(2, device=dev)
        if rank == 0:  # rank 0 has every gradient
            only0.grad = torch.full((2,), 3.0, device=dev)
        dp.all_reduce_grads([both, only0])
        torch.save({"both": both.grad.cpu(), "only0": None if only0.grad is None else only0.grad.cpu()},
                   f"{out}/all0{rank}.pt")
        dp.barrier()
    finally:
        dp.destroy()


def _overlap_worker(rank: int, port: int, out: str) -> None:
    """When do the buckets go out: during the last micro-batch's backward; a parameter without a gradient
    on one rank contributes zeros and is counted."""
    _torchrun_env(rank, port)
    dp = init_distributed(DEVICE)
    try:
        dev = dp.device
        model = _on(tiny_model(seed=0), dev)
        params = [p for p in model.parameters() if p.requires_grad]
        reducer = GradBuckets(dp, params, bucket_elems=3_000)
        batch = _micro_batches()[rank]
        issued = []
        reducer.begin(micro_batches=2)
        for _ in range(2):
            batch_loss_sum(model, batch, dev).backward()
            issued.append(reducer._next)  # buckets issued when this backward returned
        reducer.finish()
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        # one backward more than begin() announced: the hook refuses (its bucket's all-reduce already went out)
        reducer.begin(micro_batches=1)
        batch_loss_sum(model, batch, dev).backward()
        try:
            batch_loss_sum(model, batch, dev).backward()
            too_many = "no error"
        except RuntimeError as e:
            too_many = str(e)
        reducer.finish()
        # a parameter used on rank 0 only: rank 1 contributes zeros, finish() counts its bucket
        extra = torch.nn.Parameter(torch.ones(3, device=dev))
        lone = GradBuckets(dp, [extra])
        lone.begin()
        if rank == 0:
            (extra * 2.0).sum().backward()
        missing = lone.finish()
        torch.save({"issued": issued, "buckets": len(reducer.flats), "grads": grads, "missing": missing,
                    "extra": extra.grad.cpu(), "too_many": too_many}, f"{out}/overlap{rank}.pt")
        dp.barrier()  # neither rank tears gloo down while the other may still be in its last collective
    finally:
        dp.destroy()


def _train_worker(rank: int, ports: tuple, out: str) -> None:
    from pathlib import Path

    _torchrun_env(rank, ports[0])
    docs = synthetic_docs(40, seed=1)
    _, shards = _shards(docs, WORLD)
    run_dir = Path(out) / f"rank{rank}"  # separate out_dirs show which rank wrote what
    cfg = tiny_config(run_dir, train__max_steps=4, train__save_every=2, train__save_final=True, logging__plot=True,
                      model__device=DEVICE, train__overlap_grad_reduce=True)  # the stop/resume runs below: after
    model = tiny_model(seed=rank)  # rank 1 starts from other weights: the broadcast must overwrite them
    res = train(cfg, model=model, train_loader=shards[rank], eval_loader=SyntheticLoader(docs[:10], shuffle=False))
    assert not dist.is_initialized()  # train created the group, so it tore it down
    state = _cpu_state(model)

    # a SIGTERM to rank 1 alone at step 2 stops both ranks after step 2; resume=auto on both continues
    os.environ["MASTER_PORT"] = str(ports[1])

    def sigterm_rank1(step, rec):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg2 = tiny_config(Path(out) / "stop", train__max_steps=4, train__resume="auto",  # one out_dir, as under torchrun
                       model__device=DEVICE)
    held = lambda: SyntheticLoader(docs[:10], shuffle=False)  # noqa: E731
    stopped = train(cfg2, model=tiny_model(seed=0), train_loader=_shards(docs, WORLD)[1][rank], on_step=sigterm_rank1,
                    eval_loader=held())
    os.environ["MASTER_PORT"] = str(ports[2])
    resumed_model = tiny_model(seed=rank)
    resumed = train(cfg2, model=resumed_model, train_loader=_shards(docs, WORLD)[1][rank], eval_loader=held())
    torch.save({"state": state, "status": res.status, "step": res.step, "eval_before": res.eval_loss_before,
                "eval_after": res.eval_loss_after, "checkpoint": res.checkpoint, "final_dir": res.final_dir,
                "stopped": (stopped.status, stopped.step, stopped.checkpoint),
                "resumed": (resumed.status, resumed.step, _cpu_state(resumed_model)),
                "before": (stopped.eval_loss_before, resumed.eval_loss_before)}, f"{out}/result{rank}.pt")


def _remainder_loader(rank: int, world: int):
    """PackedLoader over synthetic documents packed into 9 rows of 32 (one row per batch, unshuffled): over 2
    ranks the last round holds 1 batch, so rank 1 gets an empty one (data.dp_remainder=train)."""
    import numpy as np

    from chronicals.data import PackedLoader
    from chronicals.data.dataset import DatasetStats, TokenizedDataset

    docs = synthetic_docs(21, seed=4)
    lengths = [len(d[0]) for d in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stats = DatasetStats(records=len(docs), documents=len(docs), tokens=int(offsets[-1]),
                         loss_tokens=sum(int(d[1][1:].sum()) for d in docs))
    ds = TokenizedDataset(np.concatenate([d[0] for d in docs]).astype(np.int32),
                          np.concatenate([d[1] for d in docs]), offsets, 0, stats, 32)
    return PackedLoader(ds, batch_size=1, max_seq_len=32, shuffle=False, rank=rank, world_size=world)


def _remainder_worker(rank: int, port: int, out: str, epochs: float = 0) -> None:
    """One epoch of the remainder loader (train.max_steps), or train.epochs=``epochs`` when given."""
    from pathlib import Path

    _torchrun_env(rank, port)
    loader = _remainder_loader(rank, WORLD)
    length = dict(train__max_steps=0, train__epochs=epochs) if epochs else dict(train__max_steps=len(loader))
    cfg = tiny_config(Path(out) / f"rank{rank}", model__device=DEVICE, **length)
    model = tiny_model(seed=0)
    train(cfg, model=model, train_loader=loader)
    torch.save(_cpu_state(model), f"{out}/remainder{rank}.pt")


def test_two_ranks_train_the_last_incomplete_round_like_one_process(tmp_path):
    """An odd number of global batches over 2 ranks (data.dp_remainder=train): the last step gives rank 0 the
    last batch and rank 1 an empty one, and the weights equal one process's with grad_accum 2 over the same
    batches, whose epoch ends on a one-batch step."""
    one = _remainder_loader(0, 1)
    assert len(one) % WORLD == 1 and _remainder_loader(1, WORLD).empty_batches == 1
    spawn_ranks(_remainder_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"remainder{r}.pt") for r in range(WORLD))
    cfg = tiny_config(tmp_path / "single", train__max_steps=-(-len(one) // WORLD), train__grad_accum=WORLD,
                      model__device=DEVICE)
    single = tiny_model(seed=0)
    train(cfg, model=single, train_loader=one)
    for n, v in _cpu_state(single).items():
        assert torch.equal(r0[n], r1[n]), n
        torch.testing.assert_close(r0[n], v, rtol=1e-5, atol=1e-6, msg=n)
    dp_recs, one_recs = _train_recs(tmp_path / "rank0" / "run"), _train_recs(tmp_path / "single" / "run")
    assert [r["loss_tokens"] for r in dp_recs] == [r["loss_tokens"] for r in one_recs]


def test_two_ranks_train_a_fractional_epoch_like_one_process(tmp_path):
    """train.epochs=1.65 of 9 global batches: one process with grad_accum 2 trains 9 + ceil(5.85) = 15 batches;
    2 ranks trained the fraction of their own 5 batches, ceil(0.65 x 5) = 4 rounds = 8 (17; a data-parallel walk).
    The plan counts rounds of the fraction's global batches, ceil(6 / 2) = 3 (the trainer passes the loader's
    spread: without it, a 4th step of empty batches still moved the weights), and the last round's batch past the
    fraction is an empty one: the same loss tokens and weights. (At 1.3 the two plans agree: a mutation walk.)"""
    spawn_ranks(_remainder_worker, args=(_free_port(), str(tmp_path), 1.65), nprocs=WORLD, device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"remainder{r}.pt") for r in range(WORLD))
    cfg = tiny_config(tmp_path / "single", train__max_steps=0, train__epochs=1.65, train__grad_accum=WORLD,
                      model__device=DEVICE)
    single = tiny_model(seed=0)
    train(cfg, model=single, train_loader=_remainder_loader(0, 1))
    dp_recs, one_recs = _train_recs(tmp_path / "rank0" / "run"), _train_recs(tmp_path / "single" / "run")
    assert len(one_recs) == 8 and len(dp_recs) == 8  # steps of 2, 2, 2, 2, 1 in the first epoch, then 2, 2, 2
    assert [r["loss_tokens"] for r in dp_recs] == [r["loss_tokens"] for r in one_recs]
    for n, v in _cpu_state(single).items():
        assert torch.equal(r0[n], r1[n]), n
        torch.testing.assert_close(r0[n], v, rtol=1e-5, atol=1e-6, msg=n)


def _pipelined_worker(rank: int, ports: tuple, out: str) -> None:
    """Fused AdamW, no on_step: each step is read one step late, with the ranks' stop flags. A SIGTERM to rank 1
    during step 2's forward reaches every rank with step 2's metrics, read while step 3 runs: all stop after 3."""
    from pathlib import Path

    docs = synthetic_docs(40, seed=1)
    # eager: a CUDA graph's warm-up and capture would run forwards the hook below counts as steps
    over = dict(optim__fused="true", train__max_steps=5, model__device=DEVICE, train__cuda_graphs="false")
    _torchrun_env(rank, ports[0])
    straight = tiny_model(seed=0)
    train(tiny_config(Path(out) / "straight", **over), model=straight, train_loader=_shards(docs, WORLD)[1][rank])
    os.environ["MASTER_PORT"] = str(ports[1])
    cfg = tiny_config(Path(out) / "stop", train__resume="auto", **over)
    first = tiny_model(seed=0)
    if rank == 1:
        sigterm_at_forward(first, 2)
    stopped = train(cfg, model=first, train_loader=_shards(docs, WORLD)[1][rank])
    os.environ["MASTER_PORT"] = str(ports[2])
    resumed = tiny_model(seed=rank)
    train(cfg, model=resumed, train_loader=_shards(docs, WORLD)[1][rank])
    torch.save({"straight": _cpu_state(straight), "stopped": (stopped.status, stopped.step, stopped.checkpoint),
                "resumed": _cpu_state(resumed)}, f"{out}/pipelined{rank}.pt")


def _graphs_worker(rank: int, ports: tuple, out: str, graphed_runs: tuple, overlap: bool = False) -> None:
    """train() on this rank's shard once per entry of ``graphed_runs`` (train.cuda_graphs), tiny bf16 LoRA model,
    Triton ops, train.overlap_grad_reduce=``overlap``; rank 0 keeps each run's train records."""
    from pathlib import Path

    from chronicals.bench.contenders import build_chronicals_model
    from chronicals.bench.shapes import get_shape

    _torchrun_env(rank, ports[0])
    docs = synthetic_docs(48, seed=2)
    recs = {}
    for i, graphed in enumerate(graphed_runs):
        os.environ["MASTER_PORT"] = str(ports[i])
        run = Path(out) / f"graphs{graphed}"
        cfg = tiny_config(run, model__device=DEVICE, model__dtype="bfloat16", model__impl="auto", lora__enabled=True,
                          lora__rank=4, lora__alpha=8, train__max_steps=5, train__cuda_graphs=graphed,
                          train__overlap_grad_reduce=overlap)
        dev = torch.device(DEVICE, rank) if DEVICE == "cuda" else CPU
        model = build_chronicals_model(get_shape("tiny"), dev, "auto", seed=0)
        res = train(cfg, model=model, train_loader=_shards(docs, WORLD)[1][rank])
        assert (res.status, res.step) == ("completed", 5)
        if rank == 0:
            lines = (run / "run" / "metrics.jsonl").read_text().splitlines()
            recs[graphed] = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    if rank == 0:
        torch.save(recs, f"{out}/graphs.pt")


def _eval_worker(rank: int, port: int, out: str) -> None:
    """evaluate_loss under 2 ranks on a held-out loader of 5 batches: which batches this rank ran, the result, and
    the result of a pass that rank 1 alone is told to stop (before its second round)."""
    from chronicals.train import step as step_mod

    _torchrun_env(rank, port)
    dp = init_distributed(DEVICE)
    try:
        dev = dp.device
        model = _on(tiny_model(seed=0), dev)
        loader = SyntheticLoader(synthetic_docs(40, seed=3), batch_size=1, shuffle=False)
        ran, real = [], step_mod.batch_loss_sum

        def counted(m, b, d):
            ran.append(int(b.input_ids[0, 0]))
            return real(m, b, d)

        step_mod.batch_loss_sum = counted
        loss, n = step_mod.evaluate_loss(model, loader, dev, dp=dp)
        mine = list(ran)
        asked = []

        def stop():  # a signal to rank 1 only, got after its first round
            asked.append(1)
            return rank == 1 and len(asked) == 2

        stopped = step_mod.evaluate_loss(model, loader, dev, stop=stop, dp=dp)
        # a loader already sharded by rank (train(eval_loader=PackedLoader(..., rank=, world_size=))): each rank
        # scores all of its own batches (an empty one in the last round), the sums all-reduced
        own = step_mod.evaluate_loss(model, _remainder_loader(rank, WORLD), dev, dp=dp)
        torch.save({"len": len(loader), "ran": mine, "loss": loss, "n": n, "stopped": stopped, "own": own},
                   f"{out}/eval{rank}.pt")
        dp.barrier()
    finally:
        dp.destroy()


def _eval_stop_worker(rank: int, port: int, out: str) -> None:
    """Training with an interval evaluation (fused AdamW: the pipelined loop, whose stop flags are read with the
    next step's metrics) where rank 1 alone gets a SIGTERM in step 2's evaluation."""
    from pathlib import Path

    from train_helpers import sigterm_at_forward

    _torchrun_env(rank, port)
    held = SyntheticLoader(synthetic_docs(60, seed=5), shuffle=False)
    e = len(held)
    model = tiny_model(seed=0)
    if rank == 1:  # its share of the "before" pass, steps 1 and 2, then its 2nd batch of step 2's evaluation
        sigterm_at_forward(model, e // 2 + 2 + 2)
    cfg = tiny_config(Path(out), train__max_steps=6, eval__every=2, optim__fused="true", model__device=DEVICE)
    res = train(cfg, model=model, train_loader=_shards(synthetic_docs(48, seed=2), WORLD)[1][rank], eval_loader=held)
    torch.save({"status": res.status, "step": res.step, "e": e}, f"{out}/stop{rank}.pt")


def _heldout_disagree_worker(rank: int, port: int, out: str) -> None:
    """Each rank is given another held-out set (rank 1 a shorter one), then an eval loader sharded for 4 ranks:
    the error each train() raises."""
    from pathlib import Path

    from chronicals.data import PackedLoader

    _torchrun_env(rank, port)
    docs = synthetic_docs(40, seed=1)
    said = []
    ds = _remainder_loader(0, 1).dataset
    other = PackedLoader(ds, batch_size=1, max_seq_len=32, shuffle=False)  # rank 1: the same batches, other tokens
    other.dataset = type(ds)(ds.ids[::-1].copy(), ds.trainable, ds.offsets, 0, ds.stats, 32)
    held = PackedLoader(ds, batch_size=1, max_seq_len=32, shuffle=False) if rank == 0 else other
    for i, eval_loader in enumerate((held, PackedLoader(ds, batch_size=1, max_seq_len=32, shuffle=False, rank=rank,
                                                        world_size=4))):
        os.environ["MASTER_PORT"] = str(port + i)
        cfg = tiny_config(Path(out) / f"r{i}", train__max_steps=2, eval__every=1, model__device=DEVICE)
        try:
            train(cfg, model=tiny_model(seed=0), train_loader=_shards(docs, WORLD)[1][rank], eval_loader=eval_loader)
            said.append("no error")
        except ValueError as e:
            said.append(str(e))
    torch.save(said, f"{out}/disagree{rank}.pt")


def _closing_worker(rank: int, port: int, out: str) -> None:
    """A finished run whose closing evaluation is then taken out of its metrics (a stop between its last step and
    that evaluation), run again with resume=auto, with a held-out loader sharded by rank: the result's held-out
    losses on each rank."""
    import json
    from pathlib import Path

    from chronicals.data import PackedLoader

    _torchrun_env(rank, port)
    docs = synthetic_docs(40, seed=1)
    ds = _remainder_loader(0, 1).dataset
    held = lambda: PackedLoader(ds, batch_size=1, max_seq_len=32, shuffle=False, rank=rank, world_size=WORLD)  # noqa
    cfg = tiny_config(Path(out), train__max_steps=2, train__resume="auto", model__device=DEVICE)
    events = []
    report = lambda event, **info: events.append(event)  # noqa: E731  (the CLI's RunReport answers QA and prints)
    first = train(cfg, model=tiny_model(seed=0), train_loader=_shards(docs, WORLD)[1][rank], eval_loader=held(),
                  report=report)
    if rank == 0:
        m = Path(out) / "run" / "metrics.jsonl"
        recs = [json.loads(line) for line in m.read_text().splitlines()]
        m.write_text("".join(json.dumps(r) + "\n" for r in recs if r.get("tag") != "after"))
    os.environ["MASTER_PORT"] = str(port + 1)
    dist_barrier_file = Path(out) / f"edited{rank}"
    dist_barrier_file.touch()
    while not all((Path(out) / f"edited{r}").exists() for r in range(WORLD)):
        pass
    again = train(cfg, model=tiny_model(seed=0), train_loader=_shards(docs, WORLD)[1][rank], eval_loader=held(),
                  report=report)
    torch.save({"first": first.eval_loss_after, "again": again.eval_loss_after, "events": events,
                "before": (first.eval_loss_before, again.eval_loss_before)}, f"{out}/closing{rank}.pt")


def test_ranks_wait_for_rank_0s_data_preparation_past_the_group_timeout(tmp_path):
    """The other ranks waited for rank 0's tokenization at a barrier bound by the process group's timeout (60
    minutes): past it they failed, torchrun killed rank 0 mid-tokenization, no cache entry was kept, and every retry
    did the same (a data walk at scale). main_first waits without that deadline."""
    spawn_ranks(_main_first_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    assert [torch.load(tmp_path / f"rank{r}.pt")["sum"] for r in range(WORLD)] == [2.0, 2.0]


@pytest.mark.parametrize("reduce", ["after", "overlap"])
@pytest.mark.parametrize("split", ["1+3", "4+empty"])
def test_gradients_equal_one_process_on_all_micro_batches(tmp_path, reduce, split):
    """Rank 0: 1 micro-batch, rank 1: 3 (unequal loss tokens); after the step both hold the gradient and
    the loss of one process accumulating all 4 (fp32). "after": all_reduce_grads after backward; "overlap":
    GradBuckets (flat buckets issued during backward: rank 0 issues them in its one backward, rank 1 in its
    third). "4+empty": rank 0 takes all 4 and rank 1 an empty batch (data.dp_remainder=train's last round):
    it adds nothing, and its backward still issues the buckets the other rank waits for."""
    micro = _micro_batches()
    counts = [b.num_loss_tokens for b in micro]
    assert counts[0] != sum(counts[1:]) and len(set(counts)) > 1  # else per-rank means would agree too
    assert _empty_batch().num_loss_tokens == 0
    spawn_ranks(_grad_worker, args=(_free_port(), str(tmp_path), reduce, split), nprocs=WORLD, device=DEVICE)
    model = _on(tiny_model(seed=0), REF)
    loss_1, n_1 = accumulate_gradients(model, micro, REF)
    loss_1, g_1 = loss_1.cpu(), _grads(model)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["backend"] == BACKEND and got["n"] == n_1 == sum(counts)
        assert got["device"] == ("cpu" if DEVICE == "cpu" else f"cuda:{r}")
        torch.testing.assert_close(got["loss"], loss_1, rtol=1e-6, atol=1e-6)
        assert got["grads"].keys() == g_1.keys()
        for name, g in g_1.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6, msg=name)
    if split != "1+3":
        return
    # averaging the two ranks' own means (the common bug) is measurably different from the loss above
    per_rank = [accumulate_gradients(_on(tiny_model(seed=0), REF), m, REF)[0].cpu() for m in (micro[:1], micro[1:])]
    assert abs(float(sum(per_rank) / WORLD) - float(loss_1)) > 1e-3


def test_two_ranks_train_like_one_process_on_both_shards(tmp_path):
    """2 ranks x grad_accum 1 == 1 process x grad_accum 2 over the same batches (the straight run with
    train.overlap_grad_reduce, the stopped and resumed ones without): same losses, same weights;
    only rank 0 writes files; a signal to one rank stops both at the same step, and both resume from it."""
    spawn_ranks(_train_worker, args=(tuple(_free_port() for _ in range(3)), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"result{r}.pt", weights_only=False) for r in range(WORLD))
    for n in r0["state"]:
        assert torch.equal(r0["state"][n], r1["state"][n]), n  # identical updates on identical weights
    assert (r0["status"], r0["step"], r1["step"]) == ("completed", 4, 4)
    assert r0["eval_before"] == r1["eval_before"] and r0["eval_after"] == r1["eval_after"]

    run0, run1 = tmp_path / "rank0" / "run", tmp_path / "rank1" / "run"
    assert r0["checkpoint"].name == "step-000004" and (run0 / "metrics.jsonl").is_file()
    assert (run0 / "model").is_dir() and (run0 / "loss.png").is_file() and (run0 / "config.yaml").is_file()
    assert r1["final_dir"] is None and r1["checkpoint"] is None
    assert not any(run1.iterdir())  # rank 1 wrote nothing

    # a SIGTERM to rank 1 at step 2: both stop there; rank 0 wrote the checkpoint; after resume=auto on
    # both ranks the weights equal the straight run's, bit for bit
    assert r0["stopped"] == r1["stopped"] and r0["stopped"][:2] == ("interrupted", 2)
    assert r0["stopped"][2] == tmp_path / "stop" / "run" / "checkpoints" / "step-000002"
    metrics = (tmp_path / "stop" / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in metrics if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    # the resumed run's held-out loss before training is the stopped run's, read by rank 0, on both ranks
    assert r0["before"][0] is not None and r0["before"] == r1["before"] == (r0["before"][0],) * 2
    for r in (r0, r1):
        assert r["resumed"][:2] == ("completed", 4)
        for n, v in r["resumed"][2].items():
            if DEVICE == "cpu":
                assert torch.equal(v, r0["state"][n]), n
            else:  # two separate runs: CUDA attention backward kernels may add in another order (atomics)
                torch.testing.assert_close(v, r0["state"][n], rtol=1e-5, atol=1e-6, msg=n)

    # one process, grad_accum=2, on the union of the ranks' batches of each step
    docs = synthetic_docs(40, seed=1)
    full, _ = _shards(docs, WORLD)
    cfg = tiny_config(tmp_path / "single", train__max_steps=4, train__grad_accum=WORLD, model__device=DEVICE)
    single = tiny_model(seed=0)
    train(cfg, model=single, train_loader=full)
    for n, v in _cpu_state(single).items():
        torch.testing.assert_close(r0["state"][n], v, rtol=1e-5, atol=1e-6, msg=n)

    dp_recs, one_recs = _train_recs(run0), _train_recs(tmp_path / "single" / "run")
    assert [r["loss_tokens"] for r in dp_recs] == [r["loss_tokens"] for r in one_recs]
    for a, b in zip(dp_recs, one_recs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_two_ranks_pipelined_loop_stop_together_and_resume_exactly(tmp_path):
    """The pipelined loop under data parallelism: the loss-token count and the stop flags stay on the device and
    are read one step late, on every rank at the same step; resume=auto from that checkpoint ends like a
    straight run, bit for bit on the CPU."""
    spawn_ranks(_pipelined_worker, args=(tuple(_free_port() for _ in range(3)), str(tmp_path)), nprocs=WORLD,
                device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"pipelined{r}.pt", weights_only=False) for r in range(WORLD))
    assert r0["stopped"] == r1["stopped"] and r0["stopped"][:2] == ("interrupted", 3)
    assert r0["stopped"][2] == tmp_path / "stop" / "run" / "checkpoints" / "step-000003"
    recs, straight = _train_recs(tmp_path / "stop" / "run"), _train_recs(tmp_path / "straight" / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["loss_tokens"] for r in recs] == [r["loss_tokens"] for r in straight]  # the device counts, read late
    for r in (r0, r1):
        for n, v in r["resumed"].items():
            if DEVICE == "cpu":
                assert torch.equal(v, r0["straight"][n]), n
            else:
                torch.testing.assert_close(v, r0["straight"][n], rtol=1e-5, atol=1e-6, msg=n)


def test_buckets_go_out_during_the_last_backward_and_sum_like_after(tmp_path):
    """GradBuckets with 2 micro-batches a step: nothing is issued in the first backward, every bucket by the
    end of the second (before finish()); the sums equal all_reduce_grads' on the same batches; a backward more
    than announced is refused; a parameter with no gradient on rank 1 gets rank 0's alone, and rank 1's finish()
    counts the short bucket."""
    spawn_ranks(_overlap_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    got = [torch.load(tmp_path / f"overlap{r}.pt") for r in range(WORLD)]
    for g in got:
        assert g["buckets"] > 3 and g["issued"] == [0, g["buckets"]]
        assert torch.equal(g["extra"], torch.full((3,), 2.0))
        assert "more gradients this step than begin(micro_batches=k) announced" in g["too_many"]
    assert (got[0]["missing"], got[1]["missing"]) == (0, 1)
    # the reference: each rank's 2 backward passes summed, then over the ranks
    micro = _micro_batches()
    want = {}
    for r in range(WORLD):
        model = _on(tiny_model(seed=0), REF)
        for _ in range(2):
            batch_loss_sum(model, micro[r], REF).backward()
        for n, p in model.named_parameters():
            want[n] = want.get(n, 0) + p.grad.detach().cpu()
    for g in got:
        for n, w in want.items():
            torch.testing.assert_close(g["grads"][n], w, rtol=1e-5, atol=1e-5, msg=n)


def test_a_gradient_missing_on_every_rank_stays_none(tmp_path):
    spawn_ranks(_none_grad_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"none{r}.pt")
        assert got["unused"] is None  # as in one process: AdamW skips it (no weight decay step)
        assert torch.equal(got["only0"], torch.ones(2))  # rank 1 contributed zeros
        assert torch.equal(got["both"], torch.full((4,), 3.0))


def test_a_gradient_of_rank_0_alone_reaches_a_rank_without_it_when_rank_0_has_them_all(tmp_path):
    spawn_ranks(_all_grads_on_rank_0_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"all0{r}.pt")
        assert torch.equal(got["both"], torch.full((2,), 2.0))
        assert got["only0"] is not None and torch.equal(got["only0"], torch.full((2,), 3.0)), r


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need GPUs: CHRONICALS_TEST_DP_DEVICE=cuda on 2 GPUs")
@pytest.mark.parametrize("overlap", [False, True])
def test_two_ranks_with_cuda_graphs_train_like_two_eager_ranks(tmp_path, overlap):
    """train.cuda_graphs=true on 2 NCCL ranks logs the losses and gradient norms of the same 2 ranks run eagerly,
    to bf16 tolerance. overlap=False: the all-reduce after the replayed forward + backward; train.cuda_graphs=auto
    turns graphs on for data parallelism on the strength of this test (passed on 2 H200s at 309473b). overlap=True
    (train.overlap_grad_reduce): the bucketed all-reduces captured inside the graph (passed on 2 H200s at
    be746e1, where it was the trainer's path)."""
    spawn_ranks(_graphs_worker, args=(tuple(_free_port() for _ in range(2)), str(tmp_path), ("false", "true"),
                                      overlap), nprocs=WORLD, device=DEVICE)
    recs = torch.load(tmp_path / "graphs.pt")
    assert_graphed_run_like_eager(recs["false"], recs["true"], steps=5)


def _disagree_worker(rank: int, port: int, out: str, first: bool) -> None:
    """first: both ranks train 2 steps into one out_dir; else rank 0 resumes there and rank 1 from an empty one."""
    from pathlib import Path

    _torchrun_env(rank, port)
    docs = synthetic_docs(40, seed=1)
    run = Path(out) / ("a" if first or rank == 0 else "b")
    cfg = tiny_config(run, train__max_steps=2 if first else 4, train__save_every=1, train__resume="auto",
                      model__device=DEVICE)
    try:
        train(cfg, model=tiny_model(seed=0), train_loader=_shards(docs, WORLD)[1][rank])
    except ValueError as e:
        Path(out, f"error{rank}.txt").write_text(str(e))


def test_ranks_that_resume_from_other_steps_stop_together_naming_them(tmp_path):
    """Each rank finds its own checkpoint: ranks that did not see the same out_dir (several nodes without a shared
    file system) trained other weights with the same summed gradients without an error, then hung until the
    group's timeout (a data-parallel walk). Every rank now stops at once with the ranks' values."""
    spawn_ranks(_disagree_worker, args=(_free_port(), str(tmp_path), True), nprocs=WORLD, device=DEVICE)
    assert not list(tmp_path.glob("error*.txt"))
    spawn_ranks(_disagree_worker, args=(_free_port(), str(tmp_path), False), nprocs=WORLD, device=DEVICE)
    for rank in range(WORLD):
        said = (tmp_path / f"error{rank}.txt").read_text()
        assert said.startswith("the data-parallel ranks disagree on this run's first step (rank 0: 2, rank 1: 0); "
                               "every rank must read the same train.out_dir"), said


def _other_data_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 reads a copy of the data with one token edited: the same documents' lengths, other contents."""
    from pathlib import Path

    import numpy as np

    from chronicals.data import PackedLoader
    from chronicals.data.dataset import DatasetStats, TokenizedDataset

    _torchrun_env(rank, port)
    ids = np.arange(12 * 8, dtype=np.int32) % 50 + 1
    if rank == 1:
        ids[17] = 3  # another node's stale copy, say
    stats = DatasetStats(records=12, documents=12, tokens=96, loss_tokens=84)
    ds = TokenizedDataset(ids, np.ones(96, dtype=bool), np.arange(13) * 8, 0, stats, 8)
    loader = PackedLoader(ds, batch_size=2, max_seq_len=8, shuffle=False, rank=rank, world_size=WORLD)
    cfg = tiny_config(Path(out) / f"r{rank}", train__max_steps=2, model__device=DEVICE)
    try:
        train(cfg, model=tiny_model(seed=0), train_loader=loader)
    except ValueError as e:
        Path(out, f"error{rank}.txt").write_text(str(e))


def test_ranks_that_read_other_data_stop_together_naming_it(tmp_path):
    """Ranks whose data files differ with the same shape (one node's stale copy) trained on other data without a
    word before the agreement check; only its 'first step' value was tested (a mutation walk: dropping the data's
    digest from it survived)."""
    spawn_ranks(_other_data_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    for rank in range(WORLD):
        said = (tmp_path / f"error{rank}.txt").read_text()
        assert said.startswith("the data-parallel ranks disagree on this run's data (rank 0: "), said


def _other_settings_worker(rank: int, port: int, out: str, case: str) -> None:
    """Rank 1 runs another optim.lr ("lr"), or only its own out_dir and logging ("own", which may differ)."""
    from pathlib import Path

    _torchrun_env(rank, port)
    docs = synthetic_docs(40, seed=1)
    over = {}
    if rank == 1:
        over = {"optim__lr": 1e-3} if case == "lr" else {"logging__progress": True}
    cfg = tiny_config(Path(out) / case / f"r{rank}", train__max_steps=2, model__device=DEVICE, **over)
    try:
        train(cfg, model=tiny_model(seed=0), train_loader=_shards(docs, WORLD)[1][rank])
    except ValueError as e:
        Path(out, f"error-{case}{rank}.txt").write_text(str(e))


@pytest.mark.parametrize("case", ["lr", "own"])
def test_ranks_run_with_other_settings_stop_together_naming_the_key(tmp_path, case):
    """Ranks given another config (another optim.lr, train.seed: a node's stale YAML, a per-rank override) trained
    apart without a word: each applied its own update to the summed gradients, and rank 0's weights were saved;
    another lora.rank crashed in gloo ("Received data size doesn't match expected size"). A data-parallel walk.
    Every rank now stops before setup naming the key; paths and logging may still differ per rank."""
    spawn_ranks(_other_settings_worker, args=(_free_port(), str(tmp_path), case), nprocs=WORLD, device=DEVICE)
    if case == "own":
        assert not list(tmp_path.glob("error-*.txt"))
        return
    for rank in range(WORLD):
        said = (tmp_path / f"error-{case}{rank}.txt").read_text()
        assert said.startswith("the data-parallel ranks disagree on this run's optim.lr (rank 0: 0.003, "
                               "rank 1: 0.001); every rank must run the same config"), said


def test_held_out_evaluation_is_split_over_the_ranks_and_stopped_by_all_together(tmp_path):
    """Under data parallelism each rank evaluates its share of the held-out batches (rank r: r, r + W, ...) and the
    sums are all-reduced: the loss and count of one process's whole pass, in 1/W of its time (every rank ran the
    whole pass before). A stop signal to one rank abandons the pass on every rank at the same round (None, and the
    loss tokens counted so far over all ranks), so no rank is left waiting in a collective."""
    from chronicals.train.step import evaluate_loss

    spawn_ranks(_eval_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    loader = SyntheticLoader(synthetic_docs(40, seed=3), batch_size=1, shuffle=False)
    firsts = [int(b.input_ids[0, 0]) for b in loader]
    loss_1, n_1 = evaluate_loss(_on(tiny_model(seed=0), REF), loader, REF)
    r0, r1 = (torch.load(tmp_path / f"eval{r}.pt") for r in range(WORLD))
    assert r0["len"] == len(firsts) and len(firsts) % WORLD == 1  # rank 1 has one batch less
    assert r0["ran"] == firsts[0::2] and r1["ran"] == firsts[1::2]
    for r in (r0, r1):
        assert r["n"] == n_1 and r["loss"] == pytest.approx(loss_1, rel=1e-6)
    assert r0["loss"] == r1["loss"]
    # rank 1 stops before its second round: both abandon there, having run round 1 (batches 0 and 1)
    first_round = sum(int(b.num_loss_tokens) for b in list(SyntheticLoader(synthetic_docs(40, seed=3), batch_size=1,
                                                                              shuffle=False))[:2])
    assert r0["stopped"] == r1["stopped"] == (None, first_round)
    whole = evaluate_loss(_on(tiny_model(seed=0), REF), _remainder_loader(0, 1), REF)
    for r in (r0, r1):
        assert r["own"][1] == whole[1] and r["own"][0] == pytest.approx(whole[0], rel=1e-6)


def test_a_stop_signal_to_one_rank_in_an_interval_evaluation_checkpoints_that_step_on_all(tmp_path):
    """The abandoned evaluation is the ranks' agreement to stop: the pipelined loop checkpoints the finished step at
    once, as one process does, rather than training one step more before it reads the flag."""
    spawn_ranks(_eval_stop_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"stop{r}.pt") for r in range(WORLD))
    assert r0["e"] >= 6
    assert (r0["status"], r0["step"]) == (r1["status"], r1["step"]) == ("interrupted", 2)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("tag") for r in recs if r["kind"] == "eval"] == ["before"]
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
    assert not (tmp_path / "run" / "checkpoints" / "step-000003").exists()


def test_ranks_with_other_held_out_sets_or_a_wrongly_sharded_one_are_refused(tmp_path):
    """The held-out pass is a series of collectives now: ranks given other held-out sets logged a loss mixed from
    both (and with eval.every hung at the first interval evaluation, until the collective timeout). Their held-out
    data and batches are compared at setup like the training data's; an eval loader sharded for another number of
    ranks is refused like a train loader (a data-parallel walk)."""
    port = _free_port()
    while port + 1 in _USED_PORTS:
        port = _free_port()
    _USED_PORTS.add(port + 1)
    spawn_ranks(_heldout_disagree_worker, args=(port, str(tmp_path)), nprocs=WORLD, device=DEVICE)
    for r in range(WORLD):
        other, sharded = torch.load(tmp_path / f"disagree{r}.pt")
        assert "the data-parallel ranks disagree on this run's held-out data" in other, other
        assert "eval_loader has world_size=4 but the job runs 2 ranks" in sharded, sharded


def test_a_rerun_that_only_closes_the_run_scores_the_whole_held_out_set_on_every_rank(tmp_path):
    """The closing evaluation a rerun runs after a stop (finish._already_done) ran on rank 0 alone, without the
    other ranks: a loader sharded by rank was scored in part (55 of 104 tokens in a walk) and the other ranks
    returned no held-out loss. Every rank scores its share now, as at the end of a run."""
    port = _free_port()
    while port + 1 in _USED_PORTS:
        port = _free_port()
    _USED_PORTS.add(port + 1)
    spawn_ranks(_closing_worker, args=(port, str(tmp_path)), nprocs=WORLD, device=DEVICE)
    r0, r1 = (torch.load(tmp_path / f"closing{r}.pt") for r in range(WORLD))
    assert r0["first"] is not None and r0["first"] == r1["first"]
    assert r0["again"] == pytest.approx(r0["first"], rel=1e-9) and r1["again"] == r0["again"]
    assert r0["before"][0] is not None and r0["before"] == r1["before"] == (r0["before"][0],) * 2  # rank 0's record
    # the report (the CLI's answers and printout) on rank 0 alone, in the rerun too: rank 1 answered every held-out
    # question again and printed its own "== after training ==" block
    assert r0["events"] == ["before", "after", "after"] and r1["events"] == []
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_loss"] for r in recs if r.get("tag") == "after"] == [r0["again"]]


def test_graphs_and_a_call_that_disagree_on_the_reducer_are_refused():
    """The graphed step's reducer and this call's must be the same object: else the gradient sum runs twice (once in
    the captured graph, once here) or not at all."""
    from types import SimpleNamespace

    model = tiny_model()
    fake_dist = SimpleNamespace(enabled=True)
    with pytest.raises(ValueError, match="graphs and this call disagree on the reducer"):
        accumulate_data_parallel(model, [], CPU, fake_dist, [], graphs=SimpleNamespace(reducer=None, model=model),
                                 reducer=object())


def test_one_process_replays_the_graphed_step_it_is_given():
    from types import SimpleNamespace

    model = tiny_model()
    called = []
    graphs = SimpleNamespace(model=model, reducer=None,
                             accumulate=lambda micro, count: called.append(count) or (torch.zeros(()), count))
    micro = _micro_batches()[:2]
    accumulate_data_parallel(model, micro, CPU, SimpleNamespace(enabled=False), [], graphs=graphs)
    assert called == [sum(b.num_loss_tokens for b in micro)]
    assert all(p.grad is None for p in model.parameters())


def test_a_graphed_step_leaves_the_gradient_sum_to_its_captured_graph():
    from types import SimpleNamespace

    model = tiny_model()
    calls = []
    reducer = SimpleNamespace(begin=lambda k: calls.append("begin"), finish=lambda: calls.append("finish"))
    graphs = SimpleNamespace(model=model, reducer=reducer, accumulate=lambda micro, count: (torch.zeros(()), count))
    fake_dist = SimpleNamespace(enabled=True, all_reduce_count=torch.tensor, all_reduce_sum_=lambda t: t,
                                all_reduce_grads=lambda params: calls.append("all_reduce_grads"))
    accumulate_data_parallel(model, _micro_batches()[:1], CPU, fake_dist, [], graphs=graphs, reducer=reducer)
    assert calls == []


def test_an_eager_step_with_buckets_announces_its_micro_batches_and_finishes_them():
    from types import SimpleNamespace

    model = tiny_model()
    calls = []
    reducer = SimpleNamespace(begin=lambda k: calls.append(("begin", k)), finish=lambda: calls.append(("finish",)))
    fake_dist = SimpleNamespace(enabled=True, all_reduce_count=torch.tensor, all_reduce_sum_=lambda t: t,
                                all_reduce_grads=lambda params: calls.append(("all_reduce_grads",)))
    accumulate_data_parallel(model, _micro_batches()[:3], CPU, fake_dist, [], reducer=reducer)
    assert calls == [("begin", 3), ("finish",)]
