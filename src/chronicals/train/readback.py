"""A finished step's scalars on the host without stalling the GPU: the trainer reads step k while step k+1 runs.

``loss.item()`` or ``float(grad_norm)`` waits for everything queued on the stream, so a loop that reads them
every step leaves the GPU idle while the host prepares the next step (batch copies, graph replays, the
optimizer's launches). Measured on one H200 at the 0.5B protocol (``benchmarks/bench_trainer.py``, git
d897243): the per-step reads cost the trainer 2.5-2.8% against the bench's queue-ahead loop (full 137.0k vs
140.9k tokens/s, LoRA 169.9k vs 174.2k).

``StepReadback`` copies the scalars into pinned host memory behind a CUDA event; ``values()`` waits for that
event only, i.e. for the step that produced them and not for the steps queued after it. On the CPU the copy is
the value itself (nothing runs asynchronously there).

Step time: the GPU time between the previous step's end and this step's end when the two steps ran back to back
(``after`` = the previous readback), which counts any time the GPU sat idle waiting for the host; else (the first
step, or after an evaluation or a checkpoint) from an event recorded when this step began.
"""

from __future__ import annotations

import time

import torch


class StepReadback:
    """Scalars of one optimizer step, readable later on the host. See the module docstring.

        rb = StepReadback([loss, grad_norm], device, started=rb_start)   # after the step's last launch
        ...                                                             # queue the next step
        loss_val, gnorm = rb.values(); seconds = rb.seconds()
    """

    # (device, length) -> [pinned buffer, the readback whose copy it holds]: one buffer per shape, so no
    # pinned allocation (a cudaHostAlloc, ~ms) per step; a new copy first reads out the previous owner's values
    _pinned: dict = {}

    def __init__(self, scalars: list, device: torch.device, *, started: "StepStart", after: "StepReadback | None" = None):
        self.device, self._started = device, started
        # the previous step's end event only (not the readback: a chain of them would grow with the steps)
        self._begin = after.event if after is not None else started.event
        self._numbers = [None if isinstance(s, torch.Tensor) else float(s) for s in scalars]  # host values as they are
        tensors = [s for s in scalars if isinstance(s, torch.Tensor)]
        if device.type != "cuda":
            self._host = [float(s) for s in scalars]
            self._host_end = time.perf_counter()
            self.event = None
            return
        self._host, self._slot, self._values = [], None, None
        if tensors:  # one small device tensor, one async copy (a Python number sent to the GPU: a pageable copy, a sync)
            flat = torch.stack([t.reshape(()).double() for t in tensors])
            key = (device, len(tensors))
            slot = StepReadback._pinned.get(key)
            if slot is None:
                slot = StepReadback._pinned[key] = [torch.empty(len(tensors), dtype=torch.float64, pin_memory=True),
                                                    None]
            elif slot[1] is not None:
                slot[1].values()  # its copy is still in the buffer unread: take it out before overwriting
            slot[0].copy_(flat, non_blocking=True)
            slot[1] = self
            self._host, self._slot = slot[0], slot
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def values(self) -> list[float]:
        """The scalars as Python floats; on CUDA waits for this step's event (not for later work)."""
        if self.event is None:
            return list(self._host)
        if self._values is None:
            self.event.synchronize()
            read = iter(self._host.tolist() if self._slot else [])  # the buffer is reused next step: copy out now
            self._values = [next(read) if v is None else v for v in self._numbers]
            if self._slot and self._slot[1] is self:
                self._slot[1] = None
        return self._values

    def seconds(self) -> float:
        """Wall time of the step (see the module docstring); call after ``values()``."""
        if self.event is None:
            return self._host_end - self._started.host
        self.values()
        return self._begin.elapsed_time(self.event) / 1e3


class StepStart:
    """When a step began: a host clock and, on CUDA, an event in the stream."""

    def __init__(self, device: torch.device):
        self.host = time.perf_counter()
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
