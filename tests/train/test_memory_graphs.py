"""Peak memory under CUDA graphs (train.metrics.memory_gib with the graphs' pools): a replay allocates nothing, so
max_memory_allocated alone misses what the pool holds once the capture's peak has passed."""

from __future__ import annotations

import pytest
import torch

from chronicals.train.metrics import memory_gib, private_pool_bytes

MIB = 2**20


def test_memory_gib_is_none_on_cpu():
    assert memory_gib(torch.device("cpu")) is None


def _allocator(monkeypatch, peak: int, now: int, segments=()):
    """torch.cuda's allocator statistics as a CUDA device would report them: peak and current allocated bytes,
    and the segments of its snapshot."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: now)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: list(segments))


def test_memory_gib_is_the_peak_in_gibibytes(monkeypatch):
    """mem_gib is max_memory_allocated in GiB (2**30 bytes), not GB."""
    _allocator(monkeypatch, peak=3 * 2**30, now=2**30)
    assert memory_gib(torch.device("cuda", 0)) == 3.0


def test_memory_gib_with_pools_counts_what_they_reserve_once(monkeypatch):
    """Under CUDA graphs the peak is at least what is allocated outside the pools plus all the pools reserve: the
    bytes allocated inside them are in memory_allocated and in the pools' reserve, and count once."""
    _allocator(monkeypatch, peak=2**30, now=3 * 2**30)
    assert memory_gib(torch.device("cuda", 0), (2 * 2**30, 2**30)) == 4.0  # 3 - 1 + 2
    assert memory_gib(torch.device("cuda", 0), (0, 0)) == 3.0
    _allocator(monkeypatch, peak=8 * 2**30, now=3 * 2**30)  # the plain peak when it is higher
    assert memory_gib(torch.device("cuda", 0), (2 * 2**30, 2**30)) == 8.0


def test_private_pool_bytes_sums_the_graph_pools_of_that_device_only(monkeypatch):
    """The segments of private pools (a nonzero segment_pool_id) on the device asked about; the default pool's
    segments (id (0, 0), or none given) and another device's are left out."""
    segments = [{"device": 1, "segment_pool_id": (0, 1), "total_size": 8 * MIB, "allocated_size": 2 * MIB},
                {"device": 1, "segment_pool_id": (0, 0), "total_size": 64 * MIB, "allocated_size": 64 * MIB},
                {"device": 1, "total_size": 32 * MIB, "allocated_size": 16 * MIB},
                {"device": 0, "segment_pool_id": (0, 1), "total_size": 128 * MIB, "allocated_size": 128 * MIB},
                {"device": 1, "segment_pool_id": (3, 2), "total_size": 4 * MIB, "allocated_size": 0}]
    _allocator(monkeypatch, peak=0, now=0, segments=segments)
    assert private_pool_bytes(torch.device("cuda", 1)) == (12 * MIB, 2 * MIB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_replays_pool_counts_in_the_peak():
    dev = torch.device("cuda")
    x = torch.ones(64 * MIB // 4, device=dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (x * 2).sum()  # warm-up off the default stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        tmp = x * 2  # 64 MiB of activations, in the graph's private pool
        out = tmp.sum()
        del tmp
    torch.cuda.synchronize()
    reserved, allocated = private_pool_bytes(dev)
    assert reserved >= 64 * MIB and allocated < reserved  # tmp's block stays reserved, out alone allocated
    # a later state the capture never saw: 256 MiB more outside the pool (an optimizer's moments, say)
    state = torch.zeros(256 * MIB // 4, device=dev)
    torch.cuda.reset_peak_memory_stats(dev)
    graph.replay()
    torch.cuda.synchronize()
    plain, counted = memory_gib(dev), memory_gib(dev, (reserved, allocated))
    assert out.item() == 2 * x.numel()
    # max_memory_allocated: x, out and the state; the pool's reserved 64 MiB only with pools
    assert counted - plain >= (64 * MIB - allocated) / 2**30 - 1e-6
    assert counted >= (x.numel() * 4 + state.numel() * 4 + 64 * MIB) / 2**30 - 1e-6
    del state, graph
