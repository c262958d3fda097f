"""StepReadback (train/readback.py): a step's scalars come back in the order given, device tensors and host
numbers mixed, also when the next step's readback reuses the pinned buffer before this one was read. The CUDA
branch (pinned buffer, async copy behind an event) is what the trainer runs on a GPU; on the CPU the values are
read at once."""

from __future__ import annotations

import time

import pytest
import torch

from chronicals.train.readback import StepReadback, StepStart

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-buffer branch needs CUDA")


def _readback(scalars, device, after=None):
    return StepReadback(scalars, device, started=StepStart(device), after=after)


def test_cpu_values_in_order_and_seconds():
    dev = torch.device("cpu")
    rb = _readback([torch.tensor(1.5), 7.0, torch.tensor([2.25])], dev)
    assert rb.values() == [1.5, 7.0, 2.25]
    assert rb.seconds() >= 0.0


@cuda
def test_cuda_values_keep_their_order_with_host_numbers_between():
    dev = torch.device("cuda")
    loss, gnorm = torch.tensor(3.25, device=dev), torch.tensor([0.125], device=dev)
    rb = _readback([loss, 11.0, gnorm, 4.0], dev)
    assert rb.values() == [3.25, 11.0, 0.125, 4.0]
    assert rb.values() == [3.25, 11.0, 0.125, 4.0]  # read twice: the same numbers


@cuda
def test_cuda_next_step_reusing_the_buffer_keeps_the_unread_values():
    """Two steps' readbacks of one shape share one pinned buffer; the second copy first takes the first's values
    out, so reading the first after the second was queued gives the first's numbers."""
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    first = _readback([(a @ a).sum() * 0 + 1.0, torch.tensor(2.0, device=dev)], dev)  # behind a real GEMM
    second = _readback([torch.tensor(3.0, device=dev), torch.tensor(4.0, device=dev)], dev, after=first)
    assert second.values() == [3.0, 4.0]
    assert first.values() == [1.0, 2.0]
    assert second.seconds() >= 0.0 and first.seconds() >= 0.0


def test_cpu_step_seconds_stop_at_the_readback_not_when_read():
    """With optim.fused=true on a CPU the trainer is pipelined: it reads step k's seconds() after step k+1 ran. A
    step's time must end when its readback was made; counted to the read, each step's time took in the next
    step's, and the logged step_s / tokens_per_s were off by up to 2x."""
    dev = torch.device("cpu")
    start = StepStart(dev)
    rb = StepReadback([torch.tensor(1.0)], dev, started=start)
    time.sleep(1.0)  # the next step runs
    assert rb.values() == [1.0]
    assert 0.0 <= rb.seconds() < 0.5


@cuda
def test_cuda_step_seconds_count_the_gpus_idle_time_since_the_previous_step():
    """Back to back (``after``), a step's time runs from the previous step's end, so time the GPU sat idle waiting
    for the host between them is in it (tokens/s then says what the loop achieves); timed from this step's own start
    it would leave that out."""
    dev = torch.device("cuda")
    first = _readback([torch.tensor(1.0, device=dev)], dev)
    first.values()
    time.sleep(0.3)  # the host is busy; the GPU has nothing queued
    second = _readback([torch.tensor(2.0, device=dev)], dev, after=first)
    assert second.values() == [2.0]
    assert 0.3 <= second.seconds() < 5.0, second.seconds()
    alone = _readback([torch.tensor(3.0, device=dev)], dev)  # no previous step: from its own start
    assert alone.seconds() < 0.25
