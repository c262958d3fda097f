"""The gradient buckets of data parallelism in one process (a recorded all-reduce stands in for the other ranks):
what goes in a bucket, when each goes out, and the refusals (the two-process runs are in test_distributed.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from chronicals.train.distributed import DistContext, _buckets, numel_runs
from chronicals.train.grad_buckets import GradBuckets


def test_buckets_split_by_dtype_and_size():
    ts = [torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(5), torch.zeros(9), torch.zeros(2)]
    got = [[t.numel() for t in b] for b in _buckets(ts, bucket_elems=8)]
    assert got == [[3, 5], [9], [2], [4]]
    one = DistContext()  # one process: every helper is a no-op
    assert one.all_reduce_count(7) == 7 and one.all_reduce_flag(True) == 1 and one.all_reduce_flag(False) == 0
    assert not one.enabled and one.is_main


def test_runs_start_counting_afresh_and_never_come_out_empty():
    sizes = lambda ts, limit: [[t.numel() for t in run] for run in numel_runs(ts, limit)]  # noqa: E731
    assert sizes([torch.zeros(n) for n in (5, 4, 2, 2)], 8) == [[5], [4, 2, 2]]
    assert sizes([torch.zeros(n) for n in (9, 2)], 8) == [[9], [2]]  # larger than the limit from the start
    assert sizes([], 8) == []


def test_buckets_never_mix_devices():
    """Each bucket is flattened into one tensor, so tensors of one dtype on two devices go to buckets of their own,
    in input order within each: grouped by dtype alone, cpu and meta tensors shared a bucket."""
    ts = [torch.zeros(3), torch.zeros(4, device="meta"), torch.zeros(2), torch.zeros(1, device="meta")]
    got = [[(t.numel(), t.device.type) for t in b] for b in _buckets(ts, bucket_elems=100)]
    assert got == [[(3, "cpu"), (2, "cpu")], [(4, "meta"), (1, "meta")]]


class _Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


def _recorded_all_reduce(monkeypatch) -> list:
    """dist.all_reduce replaced by a recorder, so GradBuckets runs without a process group: each call's
    (tensor, async_op, work) is recorded and the tensor left as it is (one rank's sum)."""
    calls = []

    def fake(t, op=None, async_op=False, **kw):
        calls.append((t, async_op, _Work()))
        return calls[-1][2]

    monkeypatch.setattr(dist, "all_reduce", fake)
    return calls


def test_a_backward_outside_a_step_is_ignored_by_the_buckets(monkeypatch):
    """GradBuckets' hooks count only between begin() and finish(): a backward outside a step (an eval with grads, a
    user's probe) raised IndexError from the hook, and after the first step would have issued collectives on one
    rank alone (a mutation walk). finish() disarms them: a backward after a step neither issues a collective nor
    raises about more gradients than announced."""
    from types import SimpleNamespace

    calls = _recorded_all_reduce(monkeypatch)
    lin = torch.nn.Linear(4, 3)
    params = list(lin.parameters())
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), params)
    lin(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in params) and not rb.armed and rb._works == []
    rb.begin(1)
    lin(torch.randn(2, 4)).sum().backward()
    rb.finish()
    n = len(calls)
    assert n >= 1 and not rb.armed
    lin(torch.randn(2, 4)).sum().backward()
    assert len(calls) == n


def test_bf16_parameters_get_bf16_gradient_buckets():
    """Each bucket's flat buffer has its parameters' dtype: bf16 parameters get bf16 gradient views. Every other
    bucket test used fp32 parameters; with fp32 buffers begin() failed to bind a float gradient to a bf16 one."""
    from types import SimpleNamespace

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), list(net.parameters()), bucket_elems=8)
    rb.begin(1)
    assert len(rb.flats) >= 3 and all(f.dtype == torch.bfloat16 for f in rb.flats)
    assert all(p.grad is rb.view(p) and p.grad.dtype == torch.bfloat16 for p in net.parameters())
    rb.remove()


def test_begin_without_bind_leaves_the_buffers_and_grads_as_they_are():
    """begin(bind=False) (a CUDA graph's replay: the captured graph zeroes and binds) only arms the counts: it
    neither zeroes the flat buffers nor rebinds the grads (it would have zeroed what the graph holds)."""
    from types import SimpleNamespace

    lin = torch.nn.Linear(4, 3)
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), list(lin.parameters()))
    rb.bind()
    for f in rb.flats:
        f.fill_(3.0)
    other = torch.zeros_like(lin.bias)
    lin.bias.grad = other
    rb.begin(2, bind=False)
    assert rb.armed and all(torch.all(f == 3.0) for f in rb.flats)
    assert lin.bias.grad is other
    rb.remove()


def test_grad_buckets_refuse_one_process_and_zero_micro_batches():
    """One process (world_size 1): refused at construction instead of hooking every parameter and failing at the
    first all-reduce on a process group that does not exist. begin(0) expects no gradient: the first backward
    overran its count inside autograd's hook; refused at begin."""
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"GradBuckets is for data parallelism \(world_size > 1\)"):
        GradBuckets(DistContext(), list(torch.nn.Linear(4, 3).parameters()))
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), list(torch.nn.Linear(4, 3).parameters()))
    with pytest.raises(ValueError, match=r"micro_batches=0 must be >= 1"):
        rb.begin(micro_batches=0)
    assert not rb.armed


def test_grad_buckets_refuse_a_finish_without_begin_and_more_gradients_than_announced(tmp_path):
    """finish() without begin() is refused (it would issue every bucket's all-reduce on this rank alone: a hang on
    many ranks); so is a parameter that gets more gradients than begin(micro_batches=k) announced (its bucket's
    all-reduce already went out, so the sum would silently miss the extra gradient)."""
    from types import SimpleNamespace

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        lin = torch.nn.Linear(4, 3)
        rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=1), list(lin.parameters()))
        with pytest.raises(RuntimeError, match=r"finish without begin"):
            rb.finish()
        rb.begin(1)
        lin(torch.randn(2, 4)).sum().backward()
        with pytest.raises(RuntimeError, match=r"more gradients this step than begin\(micro_batches=k\)"):
            lin(torch.randn(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()


def test_short_buckets_are_counted_every_step_and_warned_once(tmp_path, caplog):
    """A trainable parameter the step does not use leaves its bucket short: finish() returns the count of short
    buckets at every step (its documented return), and the warning about it is logged once, not at every step."""
    import logging
    from types import SimpleNamespace

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        unused = torch.nn.Parameter(torch.ones(2))  # first: it lands in the last bucket
        rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=1), [unused, *lin.parameters()],
                         bucket_elems=4)
        with caplog.at_level(logging.WARNING, logger="chronicals.train"):
            for _ in range(2):
                rb.begin(1)
                lin(torch.randn(2, 4)).sum().backward()
                assert rb.finish() == 1
        assert sum("short of gradients" in r.getMessage() for r in caplog.records) == 1
    finally:
        dist.destroy_process_group()


def test_grad_buckets_remove_takes_the_hooks_off_the_parameters():
    """remove() (train() calls it at the end) takes the hooks off: no hook on the user's model keeps the
    GradBuckets, and the flat buffers' owner, alive."""
    import gc
    import weakref
    from types import SimpleNamespace

    lin = torch.nn.Linear(4, 3)
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=1), list(lin.parameters()))
    ref = weakref.ref(rb)
    rb.remove()
    del rb
    gc.collect()
    assert ref() is None


def test_a_step_cut_short_by_remove_cannot_be_finished(monkeypatch):
    """remove() in a step (train()'s cleanup after an error mid-step) disarms the reducer: a finish() after it is
    refused instead of issuing every bucket's all-reduce on this rank alone."""
    from types import SimpleNamespace

    calls = _recorded_all_reduce(monkeypatch)
    lin = torch.nn.Linear(4, 3)
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), list(lin.parameters()))
    rb.begin(1)
    rb.remove()
    assert not rb.armed
    with pytest.raises(RuntimeError, match=r"finish without begin"):
        rb.finish()
    assert calls == []


def test_one_gradient_more_than_announced_is_refused_in_a_bucket_of_one(monkeypatch):
    """A parameter alone in its bucket that gets one gradient more than begin() announced is refused at that
    gradient: its bucket's all-reduce already went out without it."""
    from types import SimpleNamespace

    _recorded_all_reduce(monkeypatch)
    p = torch.nn.Parameter(torch.ones(3))
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), [p])
    rb.begin(1)
    (p * 2.0).sum().backward()
    with pytest.raises(RuntimeError, match=r"more gradients this step than begin\(micro_batches=k\)"):
        (p * 2.0).sum().backward()
    rb.remove()


def test_a_bucket_completed_early_waits_for_the_buckets_before_it(monkeypatch):
    """Backward may finish a later bucket before an earlier one (here the first parameter's gradient comes first):
    the earlier bucket does not go out until its own gradient is in (its all-reduce would miss it), and then
    both go out in order."""
    from types import SimpleNamespace

    calls = _recorded_all_reduce(monkeypatch)
    first, last = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), [first, last], bucket_elems=3)
    assert len(rb.flats) == 2 and rb.view(last).data_ptr() == rb.flats[0].data_ptr()  # reversed: last in bucket 0
    seen = []
    last.register_hook(lambda g: seen.append((len(calls), first.grad is not None and float(first.grad.sum()))))
    rb.begin(1)
    ((last * 2.0).sum() + (first * 3.0).sum()).backward()  # first's gradient is computed first
    assert seen == [(0, 9.0)]  # first's bucket was complete, and nothing had gone out
    assert rb.finish() == 0
    assert [t for t, _, _ in calls] == rb.flats
    assert torch.equal(rb.flats[0], torch.full((3,), 2.0)) and torch.equal(rb.flats[1], torch.full((3,), 3.0))
    rb.remove()


def test_buckets_start_each_step_from_zero_and_go_out_during_backward(tmp_path):
    """Buckets fill in reverse parameter order, the order backward finishes them: when the first layer's gradient
    is computed (the end of backward) the second layer's buckets are already issued, so their all-reduce overlaps
    the rest (filled in forward order the sums are the same and nothing goes out before the end). begin() zeroes
    the flat buffers: a second step's gradients are its own backward's, not added to the first's."""
    from types import SimpleNamespace

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
        rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=1), list(net.parameters()), bucket_elems=8)
        assert len(rb.flats) >= 3
        issued = []
        net[0].weight.register_hook(lambda g: issued.append(rb._next))  # before the first layer's weight lands
        for x in (torch.ones(2, 4), torch.full((2, 4), 3.0)):
            rb.begin(1)
            net(x).sum().backward()
            assert rb.finish() == 0
        assert issued and issued[0] >= 1, issued
        y = net[0](torch.full((2, 4), 3.0))  # the second step's gradient of the last layer: its inputs summed
        torch.testing.assert_close(net[1].weight.grad, y.sum(0).expand(3, 4).detach())
    finally:
        dist.destroy_process_group()


def test_finish_waits_for_every_buckets_all_reduce(monkeypatch):
    """Each step issues every bucket's all-reduce asynchronously, once and in bucket order, and finish() waits on
    each before the step reads the sums. Without the wait only the spawned 2-rank test noticed, by crashing at exit
    with the collectives still in flight."""
    from types import SimpleNamespace

    calls = _recorded_all_reduce(monkeypatch)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=2), list(net.parameters()), bucket_elems=8)
    assert len(rb.flats) >= 3
    for step in range(2):
        start = len(calls)
        rb.begin(1)
        net(torch.randn(2, 4)).sum().backward()
        assert rb.finish() == 0
        got = calls[start:]
        assert [t for t, _, _ in got] == rb.flats and all(a for _, a, _ in got), step
        assert all(w.waited for _, _, w in got), step
    rb.remove()


@pytest.mark.parametrize("when", ["before the backward", "between micro-batches"])
def test_a_grad_rebound_after_begin_is_summed_through_the_flat_buffer(tmp_path, when):
    """A .grad rebound between begin() and the backward (CUDA graphs, user code) is copied into its bucket and bound
    back: left in the new tensor, the bucket all-reduced zeros for it and the ranks silently diverged. Rebound to a
    copy between two micro-batches, the copy holds both, and the bucket gets that sum once (copied, not added to
    the first micro-batch's gradient already in the bucket, which counted it twice)."""
    from types import SimpleNamespace

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        lin = torch.nn.Linear(4, 3)
        rb = GradBuckets(SimpleNamespace(enabled=True, rank=0, world_size=1), list(lin.parameters()))
        xs = [torch.randn(2, 4)] if when == "before the backward" else [torch.randn(2, 4), torch.randn(2, 4)]
        rb.begin(len(xs))
        if when == "before the backward":
            lin.weight.grad = torch.zeros_like(lin.weight)
        for i, x in enumerate(xs):
            lin(x).sum().backward()
            if i == 0 and when == "between micro-batches":
                lin.weight.grad = lin.weight.grad.clone()
        rb.finish()
        assert lin.weight.grad is rb.view(lin.weight)
        torch.testing.assert_close(rb.view(lin.weight), torch.ones(3, 1) * sum(x.sum(0) for x in xs))
    finally:
        dist.destroy_process_group()
