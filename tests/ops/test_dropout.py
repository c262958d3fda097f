"""ops.dropout: the seeded mask (Triton kernel vs the int64 twin vs Random123's Philox answers) and the two passes
that apply it (drop(x), base += drop(t)) against float64 references built from the mask.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it).
"""

import pytest
import torch

from chronicals.ops import dropout as D
from chronicals.ops._impl import triton_interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
SHAPES = [(1, 1), (3, 8), (5, 13), (7, 96), (2, 1000), (300, 33)]


def _draw(p, seed):
    torch.manual_seed(seed)
    return D.draw(p, DEV)


def test_philox_twin_gives_random123s_known_answers():
    """Philox-4x32-10 known-answer vectors of Random123 (kat_vectors): an independent check of the twin."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, (k0, k1), want in cases:
        seed = torch.tensor([k0 | (k1 << 32)]) if k1 < 2 ** 31 else torch.tensor([k0 | ((k1 - 2 ** 32) << 32)])
        got = D.philox_ref(seed, *(torch.tensor([c]) for c in ctr))
        assert [int(w) for w in got] == list(want)


@needs_triton
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kernel_mask_equals_the_twins(rows, cols, p):
    d = _draw(p, rows * 31 + cols)
    a = D.keep_mask(d, rows, cols, DEV, impl="torch")
    b = D.keep_mask(d, rows, cols, DEV, impl="triton")
    assert a.dtype == torch.bool and a.shape == (rows, cols)
    assert torch.equal(a, b)


def test_mask_statistics_and_layout():
    d = _draw(0.1, 0)
    m = D.keep_mask(d, 600, 1000, DEV, impl="torch")
    assert abs(m.float().mean().item() - (1 - d.p_applied)) < 0.003  # 600k Bernoulli draws: sd 0.0004
    assert abs(m[:, :8].float().mean().item() - 0.9) < 0.01  # every lane of a Philox call is used
    assert abs(m[:, 1::8].float().mean().item() - 0.9) < 0.01
    # a row's mask depends on its index and the column count only: a prefix of rows is a prefix of the mask
    assert torch.equal(D.keep_mask(d, 7, 1000, DEV, impl="torch"), m[:7])
    # another seed, another mask; the same seed, the same mask
    assert not torch.equal(D.keep_mask(_draw(0.1, 1), 600, 1000, DEV, impl="torch"), m)
    assert torch.equal(D.keep_mask(_draw(0.1, 0), 600, 1000, DEV, impl="torch"), m)


def test_threshold_rounding():
    assert D.threshold(0.0) == (0, 1.0)
    thr, scale = D.threshold(0.1)
    assert thr == 6554 and scale == 65536 / (65536 - 6554)
    assert D.threshold(0.999999)[0] == 65535  # never drops everything
    with pytest.raises(ValueError, match=r"dropout p=1.0 must be in \[0, 1\)"):
        D.threshold(1.0)
    with pytest.raises(ValueError, match=r"dropout p=-0.1 must be in \[0, 1\)"):  # thr -6554: kept x scaled by 0.91
        D.threshold(-0.1)
    assert D.draw(0.1, DEV).p_applied == 6554 / 65536  # the rounded p the mask has, not the p asked for


IMPLS = ["torch", pytest.param("triton", marks=needs_triton)]


def _value_at(seed, col):
    """The 16-bit value of element (0, col), col < 8: half col % 2 of Philox word col // 2 at counter 0, straight
    from philox_ref (not through the twin's mask)."""
    z = torch.zeros(1, dtype=torch.int64)
    w = D.philox_ref(seed.cpu(), z, z)[col // 2]
    return int((w >> (16 * (col % 2))) & 0xFFFF)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_element_whose_value_equals_thr_is_kept(impl):
    """keep = value >= thr: an element whose 16-bit value equals thr is kept (and scaled), one with thr a step
    above it is dropped. A random mask hits value == thr for 1 element in 65536, so `>` in the kernel or the
    twin was caught only by one lucky element of one seed."""
    seed = torch.tensor([0x1234_5678_9ABC_DEF], dtype=torch.int64)
    col = next(c for c in range(8) if 0 < _value_at(seed, c) < 65535)
    v = _value_at(seed, col)
    at = D.DropDraw(seed.to(DEV), v / 65536, v, 65536.0 / (65536 - v))
    above = D.DropDraw(seed.to(DEV), (v + 1) / 65536, v + 1, 65536.0 / (65535 - v))
    assert bool(D.keep_mask(at, 1, 8, DEV, impl=impl)[0, col])
    assert not bool(D.keep_mask(above, 1, 8, DEV, impl=impl)[0, col])
    x = torch.ones(1, 8, device=DEV, dtype=torch.float64)
    assert D.dropped(x, at, impl=impl)[0, col].item() == at.scale


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,cols", [(7, 96), (300, 33), (5, 1000)])
def test_dropped_and_add_match_the_mask(impl, dtype, rows, cols):
    d = _draw(0.25, rows + cols)
    md = torch.float64 if dtype == torch.float64 else torch.float32  # the math dtype the module docstring names
    keep = D.keep_mask(d, rows, cols, DEV, impl="torch").to(md)
    x = torch.randn(rows, cols, dtype=torch.float64, device=DEV).to(dtype)
    scale = torch.tensor(d.scale, dtype=md)
    want = x.to(md) * scale * keep
    got = D.dropped(x, d, impl=impl)
    assert got.dtype == dtype and got.shape == (rows, cols) and got.is_contiguous()
    # bf16: the interpreter rounds by truncation (1 ulp); a GPU and the twin round to nearest
    tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got.double(), want.to(dtype).double(), **tol)
    assert torch.equal(got == 0, (keep == 0) | (x == 0))

    # base += drop(t) into a row-strided view of a wider buffer; the columns beside it stay as they were
    buf = torch.randn(rows, cols + 9, dtype=torch.float64, device=DEV).to(dtype)
    before = buf.clone()
    out = D.add_dropped_(buf[:, :cols], x, d, impl=impl)
    assert out.data_ptr() == buf.data_ptr()
    want_add = (before[:, :cols].to(md) + x.to(md) * scale * keep).to(dtype).double()
    torch.testing.assert_close(buf[:, :cols].double(), want_add, **tol)
    assert torch.equal(buf[:, cols:], before[:, cols:])


@pytest.mark.parametrize("impl", IMPLS)
def test_dropped_takes_any_leading_shape_and_row_strides(impl):
    d = _draw(0.5, 3)
    x = torch.randn(2, 3, 40, device=DEV)
    wide = torch.randn(6, 50, device=DEV)
    torch.testing.assert_close(D.dropped(x, d, impl=impl), D.dropped(x.reshape(6, 40).clone(), d, impl=impl))
    torch.testing.assert_close(D.dropped(wide[:, :40], d, impl=impl), D.dropped(wide[:, :40].contiguous(), d,
                                                                                impl=impl))


def test_add_dropped_refuses_what_it_cannot_write():
    d = _draw(0.1, 0)
    with pytest.raises(ValueError, match=r"must be 2-D with unit column stride and the shape of t \(4, 8\)"):
        D.add_dropped_(torch.zeros(4, 7), torch.zeros(4, 8), d, impl="torch")
    with pytest.raises(ValueError, match="unit column stride"):
        D.add_dropped_(torch.zeros(8, 4).t(), torch.zeros(4, 8), d, impl="torch")


def test_draws_follow_torch_seed():
    """The seed comes from torch's generator: manual_seed replays it (what exact resume relies on)."""
    a, b = _draw(0.1, 5), _draw(0.1, 5)
    assert torch.equal(a.seed, b.seed) and a.seed.dtype == torch.int64 and a.seed.shape == (1,)
    assert not torch.equal(_draw(0.1, 6).seed, a.seed)


def test_draws_use_the_high_32_bits_of_the_seed():
    """Seeds span [0, 2^62), so the Philox key's high word varies too; drawn below 2^32 there were only 2^32
    masks, and two draws collided after ~65k of them (birthday bound)."""
    seeds = [int(_draw(0.1, 0).seed.item())] + [int(D.draw(0.1, DEV).seed.item()) for _ in range(15)]
    assert all(0 <= s < 2 ** 62 for s in seeds)
    assert any(s >> 32 for s in seeds)  # all 16 below 2^32 from [0, 2^62): chance 2^-480


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,cols", [(13, 70), (5, 1000)])
def test_add_dropped_also_writes_drop_of_a_second_input_with_the_same_mask(impl, dtype, rows, cols):
    """``also`` is read through its own row stride (a slice of a wider tensor here) and drop(also) written
    contiguous; 1000 columns take two column programs of the kernel."""
    d = _draw(0.3, 9)
    t = torch.randn(rows, cols, device=DEV, dtype=dtype)
    x = torch.randn(rows, cols + 7, device=DEV, dtype=dtype)[:, 3:cols + 3]  # row stride cols + 7
    buf = torch.randn(rows, cols + 10, device=DEV, dtype=dtype)
    want_base = D.add_dropped_(buf[:, :cols].clone(), t, d, impl="torch")
    got_base, got_x = D.add_dropped_(buf[:, :cols], t, d, also=x, impl=impl)
    tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got_base, want_base, **tol)
    torch.testing.assert_close(got_x, D.dropped(x.contiguous(), d, impl="torch"), **tol)
    assert got_x.is_contiguous() and got_base.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match=rf"also \({rows}, {cols - 1}\) .* must have base's shape and dtype"):
        D.add_dropped_(buf[:, :cols], t, d, also=x[:, :cols - 1], impl=impl)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_a_column_strided_input_gives_the_contiguous_result(impl):
    """The kernel reads unit column stride: a transposed x (column stride 8) is copied first, so the result equals
    that of x.contiguous() (and the twin's); without the copy the kernel read the wrong elements."""
    d = _draw(0.5, 1)
    x = torch.randn(40, 8, device=DEV).t()  # (8, 40), strides (1, 8)
    want = D.dropped(x.contiguous(), d, impl="torch")
    assert torch.equal(D.dropped(x, d, impl=impl), want)
    assert torch.equal(D.add_dropped_(torch.zeros(8, 40, device=DEV), x, d, impl=impl), want)


def test_also_must_share_bases_dtype():
    """drop(also) is written in base's math: an ``also`` of another dtype is refused with the fix."""
    d = _draw(0.1, 2)
    base, t = torch.zeros(4, 8, device=DEV), torch.randn(4, 8, device=DEV)
    with pytest.raises(ValueError, match=r"also \(4, 8\) torch.float64 must have base's shape and dtype"):
        D.add_dropped_(base, t, d, also=torch.randn(4, 8, device=DEV, dtype=torch.float64), impl="torch")


def test_tensors_and_the_seed_must_share_one_device():
    """x (or base, t) and the draw's seed on one device, refused by name before the twin or the kernel reads them; a
    meta tensor stands in for a second device (the twin made a meta result of a meta x and a CPU seed, silently)."""
    d = _draw(0.1, 0)
    meta = torch.zeros(4, 8, device="meta")
    with pytest.raises(ValueError, match=r"dropout: all tensors must be on one device"):
        D.dropped(meta, d, impl="torch")
    with pytest.raises(ValueError, match=r"dropout: all tensors must be on one device"):
        D.add_dropped_(torch.zeros(4, 8, device=DEV), meta, d, impl="torch")
