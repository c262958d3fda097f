"""Data parallelism's launch in one process: torchrun's variables, an existing process group, device choice, timeouts
and the errors a launch mistake gets (the two-process runs are in test_distributed.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

from chronicals.config import ConfigError
from chronicals.train.distributed import DistContext, _device, init_distributed


def _existing_group(monkeypatch, world: int = 2, rank: int = 0, backend: str = "gloo") -> None:
    """dist's group calls replaced: a group the caller made already exists, of ``world`` ranks, this one ``rank``."""
    from chronicals.train import distributed

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(distributed.dist, "new_group", lambda **kw: "wait-group")


def _no_group_yet(monkeypatch) -> dict:
    """dist's group calls replaced: no group exists yet, init_process_group records its arguments (no port used)."""
    from chronicals.train import distributed

    made: dict = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: made.update(kw))
    monkeypatch.setattr(distributed.dist, "new_group", lambda **kw: "wait-group")
    return made


def _torchrun_vars(monkeypatch, **env) -> None:
    """torchrun's variables for a 2-rank job (rank 0, a local master), overridden by ``env`` (None: unset)."""
    base = dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK=None, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for k, v in {**base, **env}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)


def test_every_helper_of_a_one_process_context_leaves_its_input_as_it_is():
    """No process group exists with one process: each helper returns without a collective."""
    one = DistContext()
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((2,), 5.0)
    one.all_reduce_grads([p, q])
    assert torch.equal(p.grad, torch.full((2,), 5.0)) and q.grad is None
    one.broadcast_params([p, q])
    assert torch.equal(p.detach(), torch.ones(2))
    t = torch.ones(2)
    assert one.all_reduce_sum_(t) is t and torch.equal(t, torch.ones(2))
    assert one.gather_object({"a": 1}) == [{"a": 1}] and one.all_gather_object(3) == [3]
    one.check_same({"steps": 4}, "read the same data")
    one.barrier()
    with one.main_first():
        pass


def test_ranks_past_the_first_two_are_compared_too(monkeypatch):
    ctx = DistContext(rank=0, world_size=3)
    seen = [{"steps": 4}, {"steps": 4}, {"steps": 5}]
    monkeypatch.setattr(ctx, "all_gather_object", lambda obj: seen)
    with pytest.raises(ValueError, match=r"^the data-parallel ranks disagree on this run's steps "
                                         r"\(rank 0: 4, rank 1: 4, rank 2: 5\); read the same data$"):
        ctx.check_same({"steps": 4}, "read the same data")
    seen[2] = {"steps": 4}
    ctx.check_same({"steps": 4}, "read the same data")


def test_single_process_context_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_distributed("cpu")
    assert (ctx.world_size, ctx.rank, ctx.backend, ctx.device) == (1, 0, None, torch.device("cpu"))
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "3")  # a scheduler's, say: one process is rank 0 whatever RANK says
    assert (init_distributed("cpu").rank, init_distributed("cpu").is_main) == (0, True)
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="launch data-parallel training with torchrun"):
        init_distributed("cpu")


def test_a_launch_mistake_is_one_line_exit_2(monkeypatch, capsys):
    """WORLD_SIZE > 1 without torchrun's other variables was a RuntimeError: "internal error in chronicals ...
    please report it", exit 4, with a traceback (a data-parallel walk)."""
    from chronicals.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "model.device=cpu", "train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2 but RANK, MASTER_ADDR" in err and "Traceback" not in err, err


def test_the_process_group_waits_an_hour_and_main_first_a_week(monkeypatch):
    """Rank 0 alone writes checkpoints and the final model while the others wait at the next collective: NCCL's
    default 10 minutes was short for a large model, so the group waits 60 minutes. Rank 0's conversion and
    tokenization (main_first) wait on a gloo group of their own, without that deadline."""
    import datetime

    from chronicals.train import distributed

    made, waits = {}, {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: made.update(kw))
    monkeypatch.setattr(distributed.dist, "new_group", lambda **kw: waits.update(kw) or "wait-group")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    ctx = init_distributed("cpu")
    assert (ctx.world_size, ctx.rank, ctx.backend) == (2, 1, "gloo")
    assert made["timeout"] == datetime.timedelta(minutes=60) and made["backend"] == "gloo"
    assert waits == {"backend": "gloo", "timeout": datetime.timedelta(days=7)} and ctx.wait_group == "wait-group"


def test_torchrun_variables_that_are_empty_mean_unset_and_others_must_be_integers(monkeypatch):
    """WORLD_SIZE="" and RANK="" (a launcher's `export WORLD_SIZE=` left behind) mean one process, rank 0: they
    were read as int(""). A value that is not an integer is a ValueError naming the variable and torchrun, not
    Python's bare "invalid literal for int() with base 10"."""
    from chronicals.train import distributed

    monkeypatch.setenv("WORLD_SIZE", "")
    monkeypatch.setenv("RANK", "")
    ctx = init_distributed("cpu")
    assert (ctx.world_size, ctx.rank, ctx.backend) == (1, 0, None) and distributed.env_rank() == 0
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"^environment variable WORLD_SIZE='two' is not an integer \(torchrun "
                                         r"sets it\)$"):
        init_distributed("cpu")


def test_a_missing_master_port_is_a_launch_mistake(monkeypatch):
    """WORLD_SIZE > 1 with RANK and MASTER_ADDR but no MASTER_PORT is refused before any group is made, naming
    MASTER_PORT (a ConfigError: exit 2), not left to init_process_group's env:// rendezvous error."""
    made = _no_group_yet(monkeypatch)
    _torchrun_vars(monkeypatch, MASTER_PORT=None)
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=2 but MASTER_PORT not set: launch data-parallel training "
                                          r"with torchrun"):
        init_distributed("cpu")
    assert made == {}


def test_local_rank_defaults_to_rank(monkeypatch):
    """Without LOCAL_RANK (a launcher that sets RANK only, on one node) a rank's local rank is its rank: with 0
    every rank of a CUDA job took cuda:0. torchrun's LOCAL_RANK wins where it is set (two nodes of one GPU)."""
    _no_group_yet(monkeypatch)
    _torchrun_vars(monkeypatch, RANK="1")
    ctx = init_distributed("cpu")
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.owns_group) == (1, 1, 2, True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert init_distributed("cpu").local_rank == 0


def _two_gpus(monkeypatch) -> None:
    """resolve_device as on a machine with 2 GPUs (cuda:N kept, cuda without an index), without touching CUDA."""
    from chronicals.train import distributed

    monkeypatch.setattr(distributed, "resolve_device", lambda pref: torch.device(pref))
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 2)


def test_under_torchrun_a_gpu_named_by_index_must_be_the_ranks_own(monkeypatch):
    """Under torchrun each rank takes cuda:LOCAL_RANK: model.device=cuda:1 on LOCAL_RANK=0 is refused naming the fix
    (taken as named, two ranks could share one GPU), and accepted on LOCAL_RANK=1. One process (world_size 1) keeps
    the GPU it names, whatever LOCAL_RANK would say (that rule refused it too)."""
    _two_gpus(monkeypatch)
    with pytest.raises(ValueError, match=r"model.device=cuda:1 names one GPU, but under torchrun each rank takes "
                                         r"cuda:LOCAL_RANK \(this is LOCAL_RANK=0\); set model.device=cuda or auto"):
        _device("cuda:1", 0, 2)
    assert _device("cuda:1", 1, 2) == torch.device("cuda", 1)
    assert _device("cuda:1", 0, 1) == torch.device("cuda", 1)


def test_a_local_rank_past_the_visible_gpus_is_a_launch_mistake(monkeypatch):
    """With 2 GPUs (cuda:0, cuda:1) LOCAL_RANK=2 is a ConfigError naming the GPU count, not a raw CUDA error later;
    LOCAL_RANK=1, the last GPU, takes cuda:1."""
    _two_gpus(monkeypatch)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but only 2 GPUs are visible"):
        _device("cuda", 2, 3)
    assert _device("cuda", 1, 2) == torch.device("cuda", 1)


def test_an_existing_process_group_of_another_rank_is_refused(monkeypatch):
    """A process group the caller made already, of the same size but another rank than RANK says, is refused
    naming both: training on as the group's rank 1 while the loader shards by RANK=0 trains one shard twice and
    the other never. With the rank RANK says it is joined, not owned (destroy() leaves it to its maker)."""
    _existing_group(monkeypatch, rank=1)
    _torchrun_vars(monkeypatch, RANK="0")
    with pytest.raises(RuntimeError, match=r"a process group already exists with world_size=2, rank=1, but the "
                                           r"environment says WORLD_SIZE=2, RANK=0"):
        init_distributed("cpu")
    monkeypatch.setenv("RANK", "1")
    ctx = init_distributed("cpu")
    assert (ctx.rank, ctx.owns_group, ctx.backend) == (1, False, "gloo")


def test_an_existing_process_group_of_another_size_is_refused(monkeypatch):
    _existing_group(monkeypatch, world=4)
    _torchrun_vars(monkeypatch)
    with pytest.raises(RuntimeError, match=r"a process group already exists with world_size=4, rank=0, but the "
                                           r"environment says WORLD_SIZE=2, RANK=0"):
        init_distributed("cpu")


def test_the_data_parallel_setup_is_logged_by_rank_0_alone(monkeypatch, caplog):
    _no_group_yet(monkeypatch)
    caplog.set_level(logging.INFO, logger="chronicals.train")
    for rank in ("1", "0"):
        _torchrun_vars(monkeypatch, RANK=rank)
        init_distributed("cpu")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data parallel")]
    assert said == ["data parallel: world_size=2 backend=gloo"]


def test_a_joined_process_group_keeps_its_own_backend(monkeypatch):
    """A group the caller made is joined with its own backend (dist.get_backend(), "mpi" here), not the one this
    device would have picked ("gloo" on the CPU): barrier() chooses its form by ctx.backend."""
    _existing_group(monkeypatch, backend="mpi")
    _torchrun_vars(monkeypatch)
    ctx = init_distributed("cpu")
    assert (ctx.backend, ctx.owns_group) == ("mpi", False)


def test_the_callers_own_process_group_outlives_the_trainers_context(tmp_path, monkeypatch):
    """A script that made its own (one-process) group and then trains without torchrun's variables: train() runs
    init_distributed() and, on its way out, destroy(); the script's group must still exist afterwards. Ending any
    initialized group made the script's next collective fail with "Default process group has not been
    initialized"."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ctx = init_distributed("cpu")  # as train() does
        assert not ctx.owns_group and not ctx.enabled
        ctx.destroy()
        assert dist.is_initialized()
        DistContext().destroy()
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_collective_timeout_is_said_as_another_rank_lost():
    from chronicals.cli import _lost_rank

    os.environ["WORLD_SIZE"] = "2"
    try:
        assert _lost_rank(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting "
                                       "5000ms for recv operation to complete"))
    finally:
        del os.environ["WORLD_SIZE"]
