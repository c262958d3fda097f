"""The training step's forward + backward captured in CUDA graphs and replayed (``train.cuda_graphs``).

Why: at the Qwen2.5-0.5B protocol (16 x 1024 tokens, bf16, H200) a LoRA r=32 step took 127 ms with the
GPU busy 97.6 ms: ~30 ms per step is host time launching ~170 small LoRA GEMMs, autograd Functions,
torch.library ops and Triton kernels. A replayed graph launches all of them with one call.

What is captured, per batch shape (one graph per key, see ``graph_key``)::

    loss_sum = model(input_ids, position_ids=..., cu_seqlens=..., max_seqlen=S, shift_labels=..., reduction="sum")
    (loss_sum * inv_count).backward()      # inv_count: a device fp32 scalar, 1 / (step's loss tokens)

into static input buffers. Replay = copy the batch into the buffers, replay, read ``loss_sum``. The
optimizer step stays outside the graph. Gradient accumulation replays once per micro-batch with the same
``inv_count``, so k micro-batches give the gradient of one batch of all of them.

Where the gradients go: persistent ``.grad`` tensors, the "home" gradients. They are created by capturing
the first micro-batch's shape with every ``.grad`` None: autograd then hands each parameter its freshly
computed gradient (no copy), and every replay of that "assign" graph writes the step's gradient straight
into them. Graphs for the other micro-batches are captured with ``.grad`` bound to the home tensors, so
autograd records ``grad += g`` there. A step whose grads start None (``zero_grad(set_to_none=True)``) and
whose first micro-batch has the home shape replays the assign graph first: no zeroing, no adds. Why: with
one graph that always accumulates, the full fine-tune at the Qwen2.5-0.5B protocol spent 1.35 ms a step in
292 bf16 ``grad += g`` kernels (one per parameter) plus a zeroing pass over 0.9 GiB of gradients.
Data parallel (``reducer=``): the grads are ``GradBuckets``' flat views, and the last micro-batch replays a
graph that also holds the bucketed NCCL all-reduces, overlapping its backward (``train/grad_buckets.py``).

Nothing in the graph depends on a host value of the batch:
- ``max_seqlen`` is fixed to S (the varlen kernel only sizes its grid with it; a larger value is exact);
- packed ``cu_seqlens`` is padded to a fixed document capacity by repeating its last value: the extra
  entries are zero-length documents, which the varlen kernels skip. Worked example, B=2, S=5, capacity 8::

      batch cu_seqlens  [0, 3, 5, 9, 10]                  4 documents
      static buffer     [0, 3, 5, 9, 10, 10, 10, 10, 10]  capacity 8 -> 9 entries
- ``inv_count`` is filled with ``fill_`` (a kernel launch, no host sync) before the replays.
Our ops were checked for capture safety: no ``.item()``/``.cpu()`` in ops/, models/, lora/ on the
training path; attention's only host sync (deriving ``max_seqlen``) is skipped because it is passed.

Memory: every graph keeps its static inputs (3 x B x S int64 + the cu buffer: 0.4 MB at 16 x 1024) and
the home gradients (the size of the trainable parameters, also held by eager training between backward and
``zero_grad``; they live in the graphs' pool). All graphs share one private memory pool, so the activations of several
captured shapes cost about the largest one, not the sum; the pool is kept between steps (eager frees
it), so ``torch.cuda.memory_reserved`` stays at the step's peak. Sharing is safe here because each
graph's only outputs are ``loss_sum``, read right after its replay before any other graph runs, and (the
assign graph) the home gradients, which stay allocated, so no later capture is given their memory.

RNG: capturing leaves the device's generator as it found it (warm-up runs draw from it and are thrown away),
and every replay advances it by what the step draws, as an eager step does: seeded LoRA dropout masks follow
``manual_seed`` and a checkpoint's RNG state wherever the capture happens.

Limits: activation checkpointing (it reads the CUDA RNG state during capture, which CUDA forbids) and
parameters replaced after capture (the graph holds their storage) are not supported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._words import counted
from ..models.decoder import judged_length
from ..ops.attention_cudnn import MIN_DOCS, bucket
from .step import loss_token_count

if TYPE_CHECKING:
    from .grad_buckets import GradBuckets

log = logging.getLogger("chronicals.train")

# smallest padded document count: one bucket serves every batch of <= 16 documents; the cuDNN attention op pads to
# the same buckets (ops.attention_cudnn), so a captured step meets no graph shape of its own
MIN_DOC_CAPACITY = MIN_DOCS


def doc_capacity(num_docs: int, minimum: int = MIN_DOC_CAPACITY) -> int:
    """Padded document count for a packed batch: the next power of two >= ``num_docs`` (at least ``minimum``).

    Powers of two bound the distinct graphs by log2(B*S / minimum) (10 at 16 x 1024) while keeping the
    varlen grid at most 2x the documents (the padded, zero-length ones exit at once).
    """
    if num_docs < 1:
        raise ValueError(f"doc_capacity: a packed batch has at least one document (got {num_docs})")
    return bucket(num_docs, minimum)


def graph_key(batch) -> tuple[int, int, int]:
    """(B, S, document capacity) of a ``PackedBatch``; capacity 0 for dense rows (``cu_seqlens`` None)."""
    b, s = batch.input_ids.shape
    if batch.cu_seqlens is None:
        return (b, s, 0)
    return (b, s, doc_capacity(batch.cu_seqlens.numel() - 1))


def fill_cu_seqlens_(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Write ``cu_seqlens`` (n + 1,) into ``out`` (capacity + 1,) int32, repeating its last value after it.

    Device-side copies only (no host sync, no allocation): safe before every replay.
    """
    n1 = cu_seqlens.numel()
    if n1 < 2 or n1 > out.numel():
        raise ValueError(f"cu_seqlens has {n1} entries ({n1 - 1} documents); the static buffer holds "
                         f"{out.numel()} (capacity {out.numel() - 1}); pick the graph with graph_key(batch)")
    out[:n1].copy_(cu_seqlens, non_blocking=True)
    out[n1:].copy_(cu_seqlens[-1:].expand(out.numel() - n1), non_blocking=True)
    return out


def bind_static_grads(params: list, grads: list) -> None:
    """Point each ``p.grad`` at its persistent buffer, keeping eager semantics (backward adds to ``.grad``).

    ``p.grad`` None (after ``zero_grad(set_to_none=True)``): bound and zeroed. ``p.grad`` already the buffer:
    untouched (it accumulates). Another tensor: copied into the buffer, then bound.
    """
    to_zero = []
    for p, g in zip(params, grads):
        cur = p.grad
        if cur is g:
            continue
        if cur is None:
            to_zero.append(g)
        else:
            g.copy_(cur)
        p.grad = g
    if to_zero:
        torch._foreach_zero_(to_zero)  # one launch per dtype group instead of one per tensor


def resolve_cuda_graphs(setting: str, device, checkpointing, world_size: int) -> tuple[bool, str]:
    """``train.cuda_graphs`` ("auto" | "true" | "false") -> (use graphs, the reason, for the log).

    "auto" turns graphs on for CUDA processes without activation checkpointing: there the replayed step was
    measured equal to eager (gradients, tests/train/test_graphs.py; on 2 NCCL ranks,
    tests/train/test_distributed.py, passed on 2 H200s at 309473b) and faster: one GPU, 0.5B LoRA 120.7k ->
    165.9k tokens/s, full fine-tuning unchanged and 0.9 GiB lighter; 2 GPUs (benchmarks/bench_dp.py, same
    commit), LoRA 297.6k -> 321.2k tokens/s over both, full 257.7k -> 258.3k. The gradient all-reduce stays
    outside the captured forward + backward.
    """
    if setting == "true":
        return True, "train.cuda_graphs=true"
    if setting == "false":
        return False, "train.cuda_graphs=false"
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"train.cuda_graphs=auto: off on {device} (CUDA graphs need a GPU)"
    if checkpointing:
        return False, ("train.cuda_graphs=auto: off with activation checkpointing (it reads the CUDA RNG state "
                       "during capture)")
    ranks = "one CUDA process" if world_size == 1 else f"{world_size} data-parallel ranks"
    return True, f"train.cuda_graphs=auto: on ({ranks}, no activation checkpointing)"


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    input_ids: torch.Tensor  # (B, S) int64
    position_ids: torch.Tensor  # (B, S) int64
    shift_labels: torch.Tensor  # (B, S) int64
    cu_seqlens: torch.Tensor | None  # (capacity + 1,) int32, None for dense rows
    loss_sum: torch.Tensor  # () fp32, overwritten by each replay


class GraphedStep:
    """Forward + backward of a training step as replayed CUDA graphs; see the module docstring.

        graphs = GraphedStep(model, device)          # trainable params: those with requires_grad
        loss, n = graphs.accumulate(micro_batches)   # what train.step.accumulate_gradients returns
        optimizer.step(); optimizer.zero_grad()      # outside the graph

    ``max_graphs``: accumulating graphs captured before new shapes run eagerly (logged, counted in
    ``eager_fallbacks``); the one assign graph (the first micro-batch's shape, see the module docstring) is extra.
    ``reducer``: data parallelism's ``GradBuckets`` over the same params. The persistent grads are then its flat
    bucket views, and the step's last micro-batch replays a second graph per shape that also holds the
    bucketed NCCL all-reduces, issued by the reducer's hooks while it was captured (they overlap the rest of
    the captured backward); the other micro-batches replay the graph without them.
    """

    def __init__(self, model: torch.nn.Module, device, *, params: list | None = None, warmup: int = 3,
                 max_graphs: int = 8, reducer: "GradBuckets | None" = None):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"CUDA graphs need a CUDA device, but the step runs on {device} "
                               f"(torch.cuda.is_available()={torch.cuda.is_available()}); turn them off (train.cuda_graphs=false; "
                               "in the bench a contender without -graphs) or run on a GPU (model.device=cuda)")
        if warmup < 1 or max_graphs < 0:
            raise ValueError(f"GraphedStep: warmup={warmup} must be >= 1 (Triton autotuning and cuBLAS set-up "
                             f"must run before capture), max_graphs={max_graphs} >= 0")
        self.model, self.device, self.warmup, self.max_graphs = model, device, warmup, max_graphs
        self.params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
        if not self.params:
            raise ValueError("GraphedStep: no trainable parameters (requires_grad=True) to capture gradients for")
        self.reducer = reducer
        if reducer is not None and {id(p) for p in reducer.params} != {id(p) for p in self.params}:
            raise ValueError("GraphedStep: reducer was built over other parameters than the trainable ones captured")
        self.graphs: dict[tuple, _Captured] = {}  # (graph_key(batch), holds the all-reduce) -> captured step
        self.eager_fallbacks = 0  # micro-batches run eagerly because max_graphs shapes were already captured
        self._pool = torch.cuda.graph_pool_handle()
        self._inv_count = torch.zeros((), dtype=torch.float32, device=device)  # 1 / step's loss tokens
        self._grad_params: list = []  # the params that receive a gradient (found by the first capture)
        self._grads: list = []  # their home .grad tensors (see the module docstring)
        self._assign: tuple[tuple, _Captured] | None = None  # (key, graph) that writes the home grads afresh

    # ---- public ----
    def accumulate(self, micro_batches: list, count: int | None = None) -> tuple[torch.Tensor, int]:
        """Replay forward + backward per micro-batch; grads become d(sum of losses / N). -> (mean loss, N).

        ``count``: N when it is not these micro-batches' loss tokens (data parallelism: all ranks' count, a device
        int64 scalar, returned as it is).
        """
        n = loss_token_count(micro_batches) if count is None else count  # an int, or a device scalar (DP)
        check = getattr(self.model, "check_sequence_length", None)
        for b in micro_batches if check is not None else ():  # a replay runs no Python: the model's checks, here
            check(judged_length(b.input_ids.shape[1], b.cu_seqlens, b.max_seqlen, getattr(b, "longest_doc", None)))
        last = len(micro_batches) - 1  # with a reducer, its graph also all-reduces the gradients
        keys = [(graph_key(b), self.reducer is not None and i == last) for i, b in enumerate(micro_batches)]
        # capture before any replay: warm-up must not touch the grads. The first capture of all is the assign
        # graph, whose gradients become the home ones that every later capture accumulates into
        if self.reducer is None and self._assign is None and self.max_graphs > 0:
            self._capture(keys[0], micro_batches[0], assign=True)
        fresh = (self._assign is not None and self._assign[0] == keys[0]
                 and all(p.grad is None for p in self.params))  # the assign graph writes every grad anew
        for i, (b, k) in enumerate(zip(micro_batches, keys)):
            if (i > 0 or not fresh) and k not in self.graphs and len(self.graphs) < self.max_graphs:
                self._capture(k, b)
        if fresh:
            for p, g in zip(self._grad_params, self._grads):
                p.grad = g  # the replay below overwrites them: no zeroing
        else:
            bind_static_grads(self._grad_params, self._grads)
        if isinstance(n, torch.Tensor):  # device to device, no host sync
            self._inv_count.copy_(1.0 / n.clamp(min=1))
        else:
            self._inv_count.fill_(1.0 / max(int(n), 1))  # a fill kernel: no host sync
        total = None
        for i, (b, k) in enumerate(zip(micro_batches, keys)):
            cap = self._assign[1] if i == 0 and fresh else self.graphs.get(k)
            if cap is None:
                loss = self._eager(b, k)
            else:
                self._load(cap, b)
                cap.graph.replay()
                loss = cap.loss_sum
            total = loss.detach().clone() if total is None else total + loss.detach()
        return total * self._inv_count, n

    def captured(self) -> list[tuple[tuple, str]]:
        """[(graph_key, kind)] of every captured graph; kind "assign" (writes the step's first gradients),
        "accumulate" (adds into them) or "accumulate+all-reduce" (data parallelism's last micro-batch)."""
        out = [] if self._assign is None else [(self._assign[0][0], "assign")]
        return out + [(k, "accumulate+all-reduce" if comm else "accumulate") for k, comm in self.graphs]

    # ---- internals ----
    def _forward_backward(self, ids, pos, labels, cu, s: int, longest: int | None = None) -> torch.Tensor:
        loss_sum = self.model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=s, shift_labels=labels,
                              reduction="sum", longest_doc=longest)
        (loss_sum * self._inv_count).backward()
        return loss_sum

    def _reduced(self, comm: bool, *args) -> torch.Tensor:
        """forward + backward; with ``comm`` the reducer's hooks issue the all-reduces and finish() joins them."""
        if not comm:
            return self._forward_backward(*args)
        self.reducer.begin(1, bind=False)  # the grads are bound already (bind_static_grads / _capture)
        loss_sum = self._forward_backward(*args)
        self.reducer.finish()
        return loss_sum

    def _eager(self, batch, key) -> torch.Tensor:
        self.eager_fallbacks += 1
        log.warning("cuda_graphs: batch shape %s is not captured and the max_graphs limit (%s) is reached: running "
                    "it eagerly (%s so far); fixed shapes (data.max_seq_len, packed rows) avoid this", key[0],
                    counted(len(self.graphs), "graph"),
                    counted(self.eager_fallbacks, "eager micro-batch", "eager micro-batches"))
        d = self.device
        cu = None if batch.cu_seqlens is None else batch.cu_seqlens.to(d, non_blocking=True)
        return self._reduced(key[1], batch.input_ids.to(d, non_blocking=True),
                             batch.position_ids.to(d, non_blocking=True),
                             batch.shift_labels.to(d, non_blocking=True), cu, batch.max_seqlen,
                             getattr(batch, "longest_doc", None))

    @staticmethod
    def _load(cap: _Captured, batch) -> None:
        cap.input_ids.copy_(batch.input_ids, non_blocking=True)
        cap.position_ids.copy_(batch.position_ids, non_blocking=True)
        cap.shift_labels.copy_(batch.shift_labels, non_blocking=True)
        if cap.cu_seqlens is not None:
            fill_cu_seqlens_(cap.cu_seqlens, batch.cu_seqlens.to(cap.cu_seqlens.device, non_blocking=True))

    def _capture(self, key: tuple, batch, assign: bool = False) -> None:
        """Capture the step for ``key``; ``assign``: with every ``.grad`` None, making the home grads."""
        if getattr(getattr(self.model, "opts", None), "checkpointing", False):
            raise RuntimeError("cuda_graphs with activation checkpointing is not supported: checkpoint reads the "
                               "CUDA RNG state during capture, which CUDA forbids; set model.checkpointing=false "
                               "or train.cuda_graphs=false")
        (b, s, capacity), comm = key
        d = self.device
        long = dict(dtype=torch.long, device=d)
        cap = _Captured(graph=torch.cuda.CUDAGraph(), input_ids=torch.zeros((b, s), **long),
                        position_ids=torch.zeros((b, s), **long), shift_labels=torch.zeros((b, s), **long),
                        cu_seqlens=None if capacity == 0 else torch.zeros(capacity + 1, dtype=torch.int32, device=d),
                        loss_sum=None)
        self._load(cap, batch)
        args = (cap.input_ids, cap.position_ids, cap.shift_labels, cap.cu_seqlens, s,
                getattr(batch, "longest_doc", None))
        saved = [p.grad for p in self.params]
        # warm-up draws from the device's generator (LoRA dropout seeds, ops/dropout.py); capture only records
        # offsets that each replay takes. Put it back, so the step's masks are those an eager step or a run
        # resumed at another step draws: a resume captures after restoring the generator, a straight run did
        # not, and their masks would differ from the resumed step on
        rng = torch.cuda.get_rng_state(d)
        reserved0 = torch.cuda.memory_reserved(d)
        # warm-up on a side stream (as torch's docs do): Triton autotuning, cuBLAS workspaces and lazy
        # initialization happen here, not in the capture; its gradients are thrown away
        side = torch.cuda.Stream(d)
        side.wait_stream(torch.cuda.current_stream(d))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                for p in self.params:
                    p.grad = None
                self._forward_backward(*args)
        torch.cuda.current_stream(d).wait_stream(side)
        if not self._grads and self.reducer is not None:
            # the reducer's flat buckets: every trainable parameter is in one, so all are bound
            self._grad_params = list(self.params)
            self._grads = [self.reducer.view(p) for p in self._grad_params]
        if not assign and not self._grads:
            raise RuntimeError("GraphedStep: an accumulating graph needs the home gradients of the assign graph, "
                               "captured first (internal order error)")
        for p in self.params:
            p.grad = None
        if not assign:
            for p, g in zip(self._grad_params, self._grads):
                p.grad = g  # defined before capture, so AccumulateGrad records `grad += g`, never a new tensor
        try:
            with torch.cuda.graph(cap.graph, pool=self._pool):
                cap.loss_sum = self._reduced(comm, *args)
            if assign:  # autograd gave each parameter its gradient tensor (in the pool): those are home now
                self._grad_params = [p for p in self.params if p.grad is not None]  # as eager: unused keep None
                self._grads = [p.grad for p in self._grad_params]
        except Exception as e:
            raise RuntimeError(f"cuda_graphs: capturing the training step for batch shape (B, S, doc capacity)="
                               f"{key} failed: {e}. Something in the step needs the host (an .item(), a "
                               "host-dependent shape, a sync); set train.cuda_graphs=false to train eagerly") from e
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
            torch.cuda.set_rng_state(rng, d)
        if assign:
            self._assign = (key, cap)
        else:
            self.graphs[key] = cap
        log.info("cuda_graphs: captured the step for (B, S, doc capacity)=%s%s (%s; reserved memory %+.2f "
                 "GiB incl. warm-up)", key[0], " with the gradient all-reduce" if comm else
                 " writing the step's first gradients" if assign else "",
                 counted(len(self.graphs) + (self._assign is not None), "graph"),
                 (torch.cuda.memory_reserved(d) - reserved0) / 2**30)
