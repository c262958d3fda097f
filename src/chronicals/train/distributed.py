"""Data parallelism for the trainer: one process per GPU under ``torchrun`` (gloo on CPU for the tests).

    torchrun --nproc-per-node 2 -m chronicals.cli train configs/qwen2.5-0.5b/lora.yaml

Every rank holds the whole model and its own shard of the batches (``PackedLoader(rank=, world_size=)``).
A step is exact: the divisor is the all-ranks loss-token count ``N`` (a device scalar, all-reduced before any
backward), each rank backpropagates ``loss_sum_local / N``, and the gradients are summed across ranks,
so the update equals one process training on the union of the ranks' micro-batches. Worked example,
2 ranks, one micro-batch each::

    rank 0: loss_sum 30.0 over 10 tokens    rank 1: loss_sum 90.0 over 40 tokens    N = 50
    rank 0 grads d(30/50), rank 1 d(90/50) -> sum = d(120/50): the mean over all 50 tokens
    (averaging per-rank means instead would give (3.0 + 2.25) / 2 = 2.625, not 2.4)

``DistContext`` is a no-op with ``world_size == 1``: every helper returns its input untouched, and no
process group exists, so the single-process trainer runs exactly as before.
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..config import ConfigError, TrainConfig
from .setup import resolve_device

log = logging.getLogger("chronicals.train")

# elements per all-reduce bucket: 25M fp32 = 100 MB (bf16: 50 MB), large enough that NCCL runs at
# bus bandwidth, small enough that the flat copy costs little memory next to the gradients themselves
BUCKET_ELEMS = 25_000_000


def env_rank() -> int:
    """This process's rank as torchrun sets it (RANK; 0 without torchrun, or with WORLD_SIZE unset or 1, where
    ``init_distributed`` runs one process whatever RANK says). Readable before any process group."""
    return (_env_int("RANK") or 0) if (_env_int("WORLD_SIZE") or 1) > 1 else 0


@contextmanager
def main_rank_tells(rank: int | None = None):
    """Within: on a rank other than 0, the ``chronicals`` log says errors only (its level raised to ERROR, put back
    on exit). Every rank runs the same code, so each warning would otherwise appear once per rank (8 times on 8
    GPUs); rank 0 tells the story, the others say only what failed there. ``rank`` None: ``env_rank()``."""
    logger = logging.getLogger("chronicals")
    rank = env_rank() if rank is None else rank
    old = logger.level
    if rank != 0 and logger.getEffectiveLevel() < logging.ERROR:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


@dataclass
class DistContext:
    """Where this process stands in the data-parallel job. ``backend`` is None without a process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    owns_group: bool = False  # True when init_distributed created the group (and destroy() should end it)
    # a gloo group with a long timeout for main_first's waits (init_distributed makes it): rank 0's first conversion
    # and tokenization of a large dataset can outlast the default group's collective timeout
    wait_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    # ---- collectives (all no-ops with one process) ----
    def all_reduce_count(self, value: int) -> "torch.Tensor | int":
        """``value`` summed over the ranks as an int64 device scalar, no host sync (one process: ``value``).

        Built with a fill kernel: ``torch.tensor([value], device=cuda)`` would copy from pageable host memory,
        which waits for the stream, i.e. for the previous step's queued work.
        """
        return self._all_reduce_scalar(int(value), dist.ReduceOp.SUM)

    def all_reduce_flag(self, value: bool) -> "torch.Tensor | int":
        """1 if ``value`` holds on any rank, as an int64 device scalar read later (one process: 0 or 1)."""
        return self._all_reduce_scalar(int(bool(value)), dist.ReduceOp.MAX)

    def _all_reduce_scalar(self, value: int, op) -> "torch.Tensor | int":
        if not self.enabled:
            return value
        t = torch.full((), value, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op)
        return t

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum of ``t`` over the ranks (``t`` on this rank's device); returns ``t``."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_grads(self, params: list, bucket_elems: int = BUCKET_ELEMS) -> None:
        """Sum every ``p.grad`` over the ranks, in flat buckets of about ``bucket_elems`` per dtype.

        A parameter without a gradient on this rank contributes zeros (and then holds the sum): every rank
        must issue the same buckets in the same order, or the collectives would pair unlike tensors. One
        without a gradient on every rank gets ``None`` back, as in a single process (so AdamW skips it
        instead of applying weight decay): one small all-reduce of the "has a gradient" flags per step.
        """
        if not self.enabled:
            return
        local = [p.grad is not None for p in params]
        # all present (the usual case): a fill kernel; a list copied from pageable host memory would wait for
        # the stream (cudaMemcpy from pageable memory syncs it first), i.e. for the whole backward
        present = (torch.ones(len(params), dtype=torch.int32, device=self.device) if all(local) else
                   torch.tensor(local, dtype=torch.int32, device=self.device))
        dist.all_reduce(present, op=dist.ReduceOp.MAX)  # every rank issues it: the collectives must pair
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params], bucket_elems):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))  # one launch, not one per tensor
        if not all(local):  # only a rank that lacked a gradient reads the flags (a host sync): all others had all
            for p, anywhere in zip(params, present.tolist()):
                if not anywhere:
                    p.grad = None

    def broadcast_params(self, params: list, bucket_elems: int = BUCKET_ELEMS) -> None:
        """Copy rank 0's values of ``params`` into every rank's (so all start identical), in flat buckets.

        Through a flat copy, so parameters that are views of a larger buffer (LoRA's) are written in place.
        """
        if not self.enabled:
            return
        with torch.no_grad():
            for bucket in _buckets([p.detach() for p in params], bucket_elems):
                flat = _flatten_dense_tensors(bucket)
                dist.broadcast(flat, src=0)
                torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` (picklable) in rank order on rank 0, None on the others (one process: ``[obj]``)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (picklable) in rank order, on every rank (one process: ``[obj]``)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def check_same(self, what: dict, fix: str) -> None:
        """ValueError on every rank, naming each rank's value, when the ranks' ``what`` (name -> a picklable value)
        differ: each rank reads its own files, and ranks that disagree (another checkpoint, other data) trained
        other weights with the same summed gradients without an error, then hung until the group's timeout."""
        every = self.all_gather_object(what)
        for name in what:
            seen = [w.get(name) for w in every]
            if any(v != seen[0] for v in seen):
                said = ", ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
                raise ValueError(f"the data-parallel ranks disagree on this run's {name} ({said}); {fix}")

    def barrier(self) -> None:
        if not self.enabled:
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    @contextmanager
    def main_first(self):
        """Rank 0 runs the block first (it writes shared files and caches), then the others (they reuse them).

        When rank 0's block fails, the others raise its error instead of running the block: they ran it after rank 0
        had failed (a bad data record) and removed the out_dir it had made, and said "[Errno 2] No such file or
        directory: 'out/data/.heldout.jsonl.tmp-PID'", the first failure torchrun reported, while rank 0's own
        error could be cut off by torchrun's SIGTERM (a data-parallel walk)."""
        if not self.enabled:
            yield
            return
        if not self.is_main:
            failed = self._handed_on(None)
            if failed is not None:
                raise failed
            yield
            return
        failed = None
        try:
            yield
        except BaseException as e:
            failed = _passable(e)
            raise
        finally:
            self._handed_on(failed)

    def _handed_on(self, failed: "BaseException | None") -> "BaseException | None":
        """Rank 0's ``failed`` (None: its block succeeded) on every rank; without the default group's deadline
        (``wait_group``)."""
        box = [failed]
        dist.broadcast_object_list(box, src=0, group=self.wait_group)
        return box[0]

    def destroy(self) -> None:
        """End the process group if init_distributed created it (safe to call more than once)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def _passable(e: BaseException) -> Exception:
    """What the other ranks raise for rank 0's failure ``e``: itself where it pickles (the same message and exit
    status from the CLI), else a DistError naming it (a stop signal, an exception that does not pickle)."""
    import pickle

    if isinstance(e, Exception):
        try:
            back = pickle.loads(pickle.dumps(e))
            if type(back) is type(e) and str(back) == str(e):
                return back
        except Exception:  # noqa: BLE001 - any exception that does not survive the trip is named instead
            pass
    return dist.DistError(f"rank 0 failed while it prepared the model or data for every rank "
                          f"({type(e).__name__}: {str(e).strip()[:300]})")


def numel_runs(tensors: list, limit: int):
    """Consecutive runs of ``tensors``, in order, holding at most ``limit`` elements each (a tensor larger than
    that is a run of its own): gradient buckets here, the master-weight optimizer's update slices."""
    cur, n = [], 0
    for t in tensors:
        if cur and n + t.numel() > limit:
            yield cur
            cur, n = [], 0
        cur.append(t)
        n += t.numel()
    if cur:
        yield cur


def _buckets(tensors: list, bucket_elems: int):
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_elems`` elements each
    (a tensor larger than that is a bucket of its own). The order is the input order on every rank."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        yield from numel_runs(group, bucket_elems)


# a collective waits this long for the other ranks (NCCL's default is 10 minutes): rank 0 alone writes the checkpoints
# and the final model while the others wait at the next collective
GROUP_TIMEOUT = datetime.timedelta(minutes=60)
# main_first's waits: rank 0 alone converts a GGUF model and tokenizes the data (0.7 ms of CPU a short chat: ~10 GB
# of jsonl took an hour) while the others wait; past GROUP_TIMEOUT they failed, torchrun killed rank 0 mid-tokenization
# and no cache entry was kept, on every retry. A lost rank 0 still ends the wait at once (its sockets close).
WAIT_TIMEOUT = datetime.timedelta(days=7)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer (torchrun sets it)") from None


def _device(pref: str, local_rank: int, world_size: int) -> torch.device:
    """This rank's device: ``pref`` ('auto' | 'cpu' | 'cuda' | 'cuda:N'); under data parallelism cuda:LOCAL_RANK."""
    dev = resolve_device(pref)
    if world_size == 1 or dev.type != "cuda":
        return dev
    if dev.index is not None and dev.index != local_rank:
        raise ValueError(f"model.device={pref} names one GPU, but under torchrun each rank takes cuda:LOCAL_RANK "
                         f"(this is LOCAL_RANK={local_rank}); set model.device=cuda or auto")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                          "launch with --nproc-per-node <= the GPU count", "LOCAL_RANK")
    return torch.device("cuda", local_rank)


def init_distributed(device_pref: str = "auto") -> DistContext:
    """A DistContext from torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

    WORLD_SIZE unset or 1: one process, no process group, the device from ``device_pref``.
    WORLD_SIZE > 1: joins (or creates) the default process group, "nccl" on CUDA (after
    ``torch.cuda.set_device(cuda:LOCAL_RANK)``), "gloo" on CPU.
    """
    world = _env_int("WORLD_SIZE") or 1
    if world == 1:
        return DistContext(device=_device(device_pref, 0, 1))
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    missing = [k for k, v in (("RANK", rank), ("MASTER_ADDR", os.environ.get("MASTER_ADDR")),
                              ("MASTER_PORT", os.environ.get("MASTER_PORT"))) if v is None]
    if missing:  # a launch mistake, not a bug: exit 2 (it was a RuntimeError, "internal error", exit 4)
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch data-parallel training "
                          "with torchrun (torchrun --nproc-per-node N -m chronicals.cli train CONFIG.yaml)",
                          "WORLD_SIZE")
    local_rank = rank if local_rank is None else local_rank
    device = _device(device_pref, local_rank, world)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise RuntimeError(f"a process group already exists with world_size={dist.get_world_size()}, "
                               f"rank={dist.get_rank()}, but the environment says WORLD_SIZE={world}, RANK={rank}")
        backend = dist.get_backend()
    else:
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=GROUP_TIMEOUT, **kw)
        owns = True
    # every rank makes it here, in the same order (new_group is a collective over the default group)
    wait_group = dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT)
    ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend,
                      owns_group=owns, wait_group=wait_group)
    if ctx.is_main:
        log.info("data parallel: world_size=%d backend=%s", world, backend)
    return ctx


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed data-parallel rank ``rank`` > 0 trains with. The same seed on every rank drew the same LoRA
    dropout masks on every rank, over other tokens: data parallelism then averaged none of that noise away. Rank 0
    keeps ``seed`` (a one-process run's masks are rank 0's); a resume restores each rank's own state (rank_rng)."""
    return (seed + rank * 0x9E3779B97F4A7C15) % 2 ** 63


# keys a rank may set for itself: places that can differ between nodes (their contents are compared after setup:
# the data's digest, the checkpoint's step), this process's device and workers, and what rank 0 alone does (logging)
RANK_OWN_SETTINGS = {"model.path", "model.device", "data.path", "data.eval_path", "data.cache_dir", "data.num_proc",
                     "train.out_dir", "train.resume"}


def shared_settings(cfg: TrainConfig) -> dict:
    """``section.key`` -> value of every setting the data-parallel ranks must share: ranks run with another
    optim.lr or train.seed trained apart without a word (each its own update of the summed gradients, or other
    shuffles), and another lora.rank crashed in gloo ("Received data size doesn't match expected size")."""
    return {f"{section}.{key}": value for section, values in cfg.to_dict().items() if section != "logging"
            for key, value in values.items() if f"{section}.{key}" not in RANK_OWN_SETTINGS}
