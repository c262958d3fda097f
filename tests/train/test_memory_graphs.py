"""Peak memory under CUDA graphs (train.metrics.memory_gib with the graphs' pools): a replay allocates nothing, so
max_memory_allocated alone misses what the pool holds once the capture's peak has passed."""

from __future__ import annotations

import pytest
import torch

from chronicals.train.metrics import memory_gib, private_pool_bytes

MIB = 2**20


def test_memory_gib_is_none_on_cpu():
    assert memory_gib(torch.device("cpu")) is None


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
