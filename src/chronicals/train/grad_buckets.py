"""Data-parallel gradients that live in flat buckets and are all-reduced while backward is still running.

``DistContext.all_reduce_grads`` (the general path) waits for the whole backward, then copies every gradient
into flat buffers, all-reduces them and copies them back. ``GradBuckets`` removes both copies and most of the
wait:
- each trainable parameter's ``.grad`` is a view of one flat buffer per bucket (about ``bucket_elems``
  elements, one dtype), bound before the step's first backward, so backward accumulates straight into it;
- a post-accumulate-grad hook counts each bucket's gradients; once every one of its parameters has its last
  gradient of the step, the bucket's all-reduce is issued asynchronously and the rest of backward runs
  while it travels;
- buckets go out in one fixed order on every rank (bucket i only after buckets < i), or the ranks'
  collectives would pair unlike buffers. Buckets are filled in reverse parameter order, the order backward
  finishes them (last layers first);
- ``finish()`` issues whatever is left (a parameter that got no gradient this step holds zeros) and makes the
  current stream wait for every all-reduce (on NCCL a stream wait, no host sync).

Exactness is that of ``all_reduce_grads``: a sum over ranks of each rank's d(loss_sum_local / N). One
difference: a parameter that gets no gradient on any rank ends the step with zeros, not None (as torch DDP);
``finish`` returns how many of this rank's buckets were short, and the first such step is logged.

Worked example, 3 parameters p0 (in bucket 1), p1 and p2 (bucket 0: reversed order), one micro-batch:
backward finishes p2 (bucket 0 pending 1), p1 (bucket 0 complete: all-reduce issued), then p0 (bucket 1
complete, issued); ``finish`` waits for both. With ``begin(micro_batches=k)`` each parameter must report k
times, so the all-reduces start during the last micro-batch's backward.

Under CUDA graphs (``train.graphs.GraphedStep(reducer=...)``) the hooks run once, while the last micro-batch's
graph is captured: its replay contains the NCCL all-reduces on their own stream, overlapping the captured
backward, exactly as in eager.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .distributed import BUCKET_ELEMS, DistContext, _buckets

log = logging.getLogger("chronicals.train")


class GradBuckets:
    """Flat, overlapped gradient all-reduce for ``params`` (trainable, same order on every rank).

        reducer = GradBuckets(dp, params)
        reducer.begin(micro_batches=k)     # zero + bind the flat grads, count k gradients per parameter
        ... k forward/backward passes ...  # all-reduces start as buckets complete
        missing = reducer.finish()         # issue the rest, current stream waits; grads hold the sums
    """

    def __init__(self, dist_ctx: DistContext, params: list, bucket_elems: int = BUCKET_ELEMS):
        if not dist_ctx.enabled:
            raise ValueError("GradBuckets is for data parallelism (world_size > 1); one process needs no reduce")
        self.dist, self.params = dist_ctx, list(params)
        self.flats: list[torch.Tensor] = []  # (bucket elements,) each, one dtype and device
        self._sizes: list[int] = []  # parameters per bucket
        self._view: dict[int, torch.Tensor] = {}  # id(param) -> its view of a flat buffer
        self._bucket: dict[int, int] = {}  # id(param) -> bucket index
        for bucket in _buckets(list(reversed(self.params)), bucket_elems):
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            off = 0
            for p in bucket:
                self._view[id(p)] = flat[off:off + p.numel()].view_as(p)
                self._bucket[id(p)] = len(self.flats)
                off += p.numel()
            self.flats.append(flat)
            self._sizes.append(len(bucket))
        self.armed = False  # hooks count only between begin() and finish()
        self._pending: list[int] = []
        self._next = 0  # first bucket not yet issued
        self._works: list = []
        self._warned = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient buffer (a view of its bucket's flat tensor)."""
        return self._view[id(p)]

    def bind(self) -> None:
        """Zero the flat buffers and point every ``p.grad`` at its view (backward then adds into it in place)."""
        torch._foreach_zero_(self.flats)
        for p in self.params:
            p.grad = self._view[id(p)]

    def begin(self, micro_batches: int = 1, *, bind: bool = True) -> None:
        """Start a step: (``bind``: zero and bind the grads;) each parameter is expected ``micro_batches`` times."""
        if micro_batches < 1:
            raise ValueError(f"GradBuckets.begin: micro_batches={micro_batches} must be >= 1")
        if bind:
            self.bind()
        self._pending = [n * micro_batches for n in self._sizes]
        self._next, self._works, self.armed = 0, [], True

    def finish(self) -> int:
        """Issue the buckets not yet issued, in order; the current stream waits for all. -> the number of this
        rank's buckets that got fewer gradients than ``begin`` expected (the missing shares were zeros)."""
        if not self.armed:
            raise RuntimeError("GradBuckets.finish without begin()")
        missing_buckets = [b for b in range(self._next, len(self.flats)) if self._pending[b] > 0]
        self._issue(len(self.flats))
        for w in self._works:
            w.wait()
        self.armed, self._works = False, []
        missing = sum(self._pending[b] > 0 for b in missing_buckets)
        if missing and not self._warned:
            self._warned = True
            log.warning("data parallel: %d gradient bucket(s) of rank %d were short of gradients this step (a "
                        "trainable parameter unused by the step); they contributed zeros, and a parameter unused on "
                        "every rank gets a zero gradient (not None) under the overlapped all-reduce", missing,
                        self.dist.rank)
        return missing

    def remove(self) -> None:
        """Take the hooks off (the flat buffers stay bound as grads until the caller rebinds them)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.armed = [], False

    # ---- internals ----
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        view = self._view[id(p)]
        if p.grad is not view:  # e.g. rebound by the caller: keep the sum in the flat buffer
            view.copy_(p.grad)
            p.grad = view
        b = self._bucket[id(p)]
        self._pending[b] -= 1
        if self._pending[b] < 0:  # its all-reduce went out before this gradient arrived: the sum would miss it
            raise RuntimeError(f"GradBuckets: a parameter got more gradients this step than begin(micro_batches=k) "
                               f"announced (bucket {b}); call begin with the step's micro-batch count")
        if self._pending[b] == 0:
            self._issue_ready()

    def _issue_ready(self) -> None:
        end = self._next
        while end < len(self.flats) and self._pending[end] <= 0:
            end += 1
        self._issue(end)

    def _issue(self, end: int) -> None:
        while self._next < end:
            self._works.append(dist.all_reduce(self.flats[self._next], op=dist.ReduceOp.SUM, async_op=True))
            self._next += 1
