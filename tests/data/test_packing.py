import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chronicals.data import collate_rows, pack_bfd, pack_ffd


def _ffd_scan(lengths, capacity):
    """First-Fit-Decreasing by scanning every bin: the O(n * bins) textbook version; its bins (item indices)."""
    free, bins = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, f in enumerate(free):
            if f >= lengths[i]:
                free[b] -= lengths[i]
                bins[b].append(i)
                break
        else:
            free.append(capacity - lengths[i])
            bins.append([i])
    return bins


def _bfd_scan(lengths, capacity):
    bins, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b, f in enumerate(free) if f >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: free[b])
            free[b] -= lengths[i]
            bins[b].append(i)
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def _check_bins(bins, lengths, capacity):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every index exactly once"
    for b in bins:
        assert b and sum(lengths[i] for i in b) <= capacity


def test_worked_example_from_docstring():
    assert pack_bfd([5, 2, 7, 3, 1], 8) == [[2, 4], [0, 3], [1]]


def test_bfd_can_lose_to_ffd_and_then_returns_ffd():
    lengths, cap = [4, 20, 9, 2, 7, 11, 4, 24, 18, 5, 3, 17], 25
    assert len(_bfd_scan(lengths, cap)) == 6 and len(_ffd_scan(lengths, cap)) == 5
    bins = pack_bfd(lengths, cap)
    _check_bins(bins, lengths, cap)
    assert len(bins) == 5


def test_ffd_runs_only_when_bfd_misses_the_lower_bound(monkeypatch):
    """pack_bfd ran FFD after BFD every time, 2/3 of the packing (57 s for 3M documents, every start and resume; a
    data walk at scale); when BFD's bins meet a lower bound FFD cannot use fewer."""
    from chronicals.data import packing

    calls = []
    real = packing.pack_ffd
    monkeypatch.setattr(packing, "pack_ffd", lambda lengths, cap: calls.append(1) or real(lengths, cap))
    assert len(packing.pack_bfd([5, 2, 7, 3, 1], 8)) == 3 and calls == []  # ceil(18 / 8) = 3 bins
    assert len(packing.pack_bfd([5, 5, 5, 1], 8)) == 3 and calls == []  # 3 items over half the capacity
    assert len(packing.pack_bfd([4, 20, 9, 2, 7, 11, 4, 24, 18, 5, 3, 17], 25)) == 5 and calls == [1]


def test_items_of_exactly_half_the_capacity_share_a_bin_in_the_bound():
    """Two items of capacity / 2 fit one bin, so they are not "over half" in the lower bound: counted, the bound
    here is 7 = BFD's bins and the FFD pass that finds 6 was skipped (a mutation walk's directed search)."""
    lengths, cap = [3, 4, 4, 24, 18, 4, 3, 19, 11, 3, 9, 13, 13, 13, 13], 26
    assert len(_bfd_scan(lengths, cap)) == 7 and len(_ffd_scan(lengths, cap)) == 6
    bins = pack_bfd(lengths, cap)
    _check_bins(bins, lengths, cap)
    assert len(bins) == 6


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=60))))
def test_properties(case):
    cap, lengths = case
    bins = pack_bfd(lengths, cap)
    _check_bins(bins, lengths, cap)
    assert len(bins) <= len(_ffd_scan(lengths, cap))
    assert len(bins) >= -(-sum(lengths) // cap)  # the volume lower bound
    ffd = pack_ffd(lengths, cap)
    _check_bins(ffd, lengths, cap)
    assert ffd == _ffd_scan(lengths, cap)  # the same bins, item for item: first fit is one answer


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=40))))
def test_tree_matches_best_fit_scan(case):
    """The segment tree makes the same choices as a scan for the tightest bin.

    Bins with equal free space are interchangeable (the tree takes the newest, the scan the oldest), so
    the multiset of bin loads is identical, step for step.
    """
    cap, lengths = case
    from chronicals.data.packing import _best_fit

    def loads(bins):
        return sorted(sum(lengths[i] for i in b) for b in bins)

    assert loads(_best_fit(lengths, cap)) == loads(_bfd_scan(lengths, cap))


def test_large_input_is_fast_and_full():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 50_000).astype(int), 1, 2048).tolist()
    bins = pack_bfd(lengths, 2048)
    _check_bins(bins, lengths, 2048)
    assert sum(lengths) / (len(bins) * 2048) > 0.99  # many small items: BFD fills rows almost fully


def test_rejects_bad_lengths():
    with pytest.raises(ValueError, match="item 1 has length 9; every length must be in 1..8"):
        pack_bfd([3, 9], 8)
    with pytest.raises(ValueError, match="in 1..8"):
        pack_bfd([0], 8)
    assert pack_bfd([], 8) == []


def test_collate_rows_contract():
    a = (np.array([10, 11, 12], dtype=np.int32), np.array([False, True, True]))  # a dataset's ids are int32
    b = (np.array([20, 21]), np.array([False, True]))
    c = (np.array([30, 31, 32, 33]), np.array([True, False, True, True]))
    batch = collate_rows([[a, b], [c]], 6, pad_id=0)
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 0], [30, 31, 32, 33, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert batch.shift_labels.tolist() == [[11, 12, -100, 21, -100, -100], [-100, 32, 33, -100, -100, -100]]
    # the documented dtypes: input_ids collated as int32 passed every CPU test (the CUDA graphs are built for int64)
    assert [t.dtype for t in (batch.input_ids, batch.position_ids, batch.shift_labels)] == [torch.int64] * 3
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 12]
    assert batch.max_seqlen == 4 and batch.num_loss_tokens == 5
    assert batch.num_tokens == 9 and batch.num_docs == 3
    with pytest.raises(ValueError, match="more than row_len=4"):
        collate_rows([[a, b]], 4, pad_id=0)


def test_model_kwargs_pass_the_batchs_own_tensors():
    """model_kwargs() gives the forward the batch's own cu_seqlens, position_ids and shift_labels, max_seqlen and
    longest_doc. A None cu_seqlens went unnoticed: the eager CPU forward rebuilds it from the position ids, but under
    torch.compile or a CUDA graph it must be given (CausalLM.hidden_states)."""
    a = (np.array([5, 6, 7]), np.array([False, True, True]))
    b = (np.array([8, 9]), np.array([False, True]))
    batch = collate_rows([[a, b], [b]], 6, pad_id=0)
    kw = batch.model_kwargs()
    assert set(kw) == {"position_ids", "cu_seqlens", "max_seqlen", "shift_labels", "longest_doc"}
    assert kw["cu_seqlens"] is batch.cu_seqlens and kw["cu_seqlens"].tolist() == [0, 3, 5, 6, 8, 12]
    assert kw["position_ids"] is batch.position_ids and kw["shift_labels"] is batch.shift_labels
    assert kw["max_seqlen"] == batch.max_seqlen == 4 and kw["longest_doc"] == batch.longest_doc == 3


def test_lengths_and_capacity_are_whole_numbers():
    """A length of 2.7 was packed as 2, and a float capacity failed with a bare TypeError; collate_rows([]) said
    'max() arg is an empty sequence' (a property walk). Each is a ValueError saying what is expected; integral
    floats and numpy integers still pack."""
    import numpy as np

    from chronicals.data import collate_rows

    with pytest.raises(ValueError, match=r"item 1 has length 2.7; lengths are whole token counts"):
        pack_bfd([3, 2.7], 8)
    with pytest.raises(ValueError, match=r"capacity=8.5; expected a whole number"):
        pack_bfd([3, 2], 8.5)
    assert pack_bfd(np.array([3, 5]), 8.0) == [[1, 0]]
    with pytest.raises(ValueError, match=r"item 0 has length True"):  # a bool is no token count (it packed as 1)
        pack_bfd([True, 3], 8)
    with pytest.raises(ValueError, match=r"capacity=True"):
        pack_bfd([1], True)
    # text is no token count either: '3' packed as 3, and '3.0' failed in int() with Python's bare message
    with pytest.raises(ValueError, match=r"item 0 has length '3'; lengths are whole token counts"):
        pack_bfd(["3", 5], 8)
    with pytest.raises(ValueError, match=r"item 0 has length '3.0'; lengths are whole token counts"):
        pack_ffd(["3.0"], 8)
    with pytest.raises(ValueError, match=r"capacity='8'; expected a whole number"):
        pack_bfd([3], "8")
    with pytest.raises(ValueError, match=r"collate_rows: no rows"):
        collate_rows([], 8, 0)


@pytest.mark.parametrize("fn", [pack_bfd, pack_ffd])
def test_a_capacity_of_zero_is_refused_as_the_capacity(fn):
    """Capacity 0 fails saying the capacity is wrong (not blaming an item's length), with or without items."""
    for lengths in ([3], []):
        with pytest.raises(ValueError, match=r"capacity must be >= 1 \(got 0\)"):
            fn(lengths, 0)


def test_equal_lengths_keep_their_input_order():
    """Decreasing order is stable: documents of equal length are placed in their input order, so a shuffled
    dataset gives a shuffled packing (and the first bin holds the first of the longest)."""
    assert pack_bfd([4, 4, 4, 4], 4) == [[0], [1], [2], [3]]
    assert pack_ffd([2, 2, 2, 2, 2], 4) == [[0, 1], [2, 3], [4]]


def test_ffd_bins_are_returned_only_when_fewer():
    """Past the lower bound pack_bfd runs FFD but keeps its own packing unless FFD uses strictly fewer bins.
    [1, 8, 5, 4, 4] at 11: both need 3 bins (bound 2); best fit puts the 1 with 5 + 4 (the tightest), FFD with the 8."""
    lengths, cap = [1, 8, 5, 4, 4], 11
    assert pack_ffd(lengths, cap) == [[1, 0], [2, 3], [4]]
    assert pack_bfd(lengths, cap) == [[1], [2, 3, 0], [4]]


def test_padding_is_pad_id():
    """A row's padding (and a row of no documents) is filled with pad_id, not 0 (token 0 is a real token)."""
    doc = (np.array([5, 6]), np.ones(2, bool))
    batch = collate_rows([[doc], []], 4, pad_id=7)
    assert batch.input_ids.tolist() == [[5, 6, 7, 7], [7, 7, 7, 7]]
    assert batch.shift_labels.tolist() == [[6, -100, -100, -100], [-100] * 4]


def test_to_moves_every_tensor_including_cu_seqlens():
    """PackedBatch.to(device) moves each tensor field (cu_seqlens too: the varlen kernels read it on the GPU) and
    keeps the int fields. The meta device shows it on the CPU."""
    batch = collate_rows([[(np.array([1, 2, 3]), np.ones(3, bool))]], 5, pad_id=0)
    moved = batch.to("meta")
    for name in ("input_ids", "position_ids", "shift_labels", "cu_seqlens"):
        assert getattr(moved, name).device.type == "meta", name
    ints = ("max_seqlen", "num_loss_tokens", "num_tokens", "num_docs", "longest_doc")
    assert [getattr(moved, k) for k in ints] == [getattr(batch, k) for k in ints]


def test_pin_memory_and_non_blocking_to_reach_every_tensor(monkeypatch):
    """The asynchronous host-to-device copy: pin_memory() returns a copy with every tensor pinned (the ints kept), and
    to(device, non_blocking=...) passes the flag to every tensor's copy. pin_memory() returning the batch itself and
    to() dropping non_blocking both went unnoticed (no CPU result shows them). Pinning needs CUDA, so
    Tensor.pin_memory is stood in for by a recording copy, and Tensor.to records its flag."""
    pinned, flags = [], []

    def fake_pin(t):
        pinned.append(t.clone())
        return pinned[-1]

    real_to = torch.Tensor.to

    def recording_to(t, *args, **kwargs):
        flags.append(kwargs.get("non_blocking", False))
        return real_to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    batch = collate_rows([[(np.array([3, 4, 5]), np.ones(3, bool))]], 4, pad_id=0)
    out = batch.pin_memory()
    assert out is not batch and len(pinned) == 4
    tensors = ("input_ids", "position_ids", "shift_labels", "cu_seqlens")
    for name in tensors:
        assert any(getattr(out, name) is p for p in pinned), name
        assert torch.equal(getattr(out, name), getattr(batch, name))
    ints = ("max_seqlen", "num_loss_tokens", "num_tokens", "num_docs", "longest_doc")
    assert [getattr(out, k) for k in ints] == [getattr(batch, k) for k in ints]
    for flag in (True, False):
        flags.clear()
        moved = out.to("cpu", non_blocking=flag)
        assert flags == [flag] * 4 and all(torch.equal(getattr(moved, k), getattr(batch, k)) for k in tensors)


@pytest.mark.parametrize("fn", [pack_bfd, pack_ffd])
def test_the_first_length_that_is_no_whole_number_is_named(fn):
    """With several bad lengths the refusal names the first one, by index and value."""
    with pytest.raises(ValueError, match=r"item 1 has length 2.5; lengths are whole token counts"):
        fn([3, 2.5, 4, 1.5], 8)
