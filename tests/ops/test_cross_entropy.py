"""Fused linear cross-entropy vs a float64 reference, with PyTorch's own error in the same dtype as the yardstick.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how `make test` runs it). The interpreter converts
bf16/fp16 element by element in Python, so the grid is thinned: every dtype x reduction runs on four
shapes covering N 1 / 7 / 300, H 64 / 96, V 1000 / 1031 / 32000, with bias and softcap cycling over them;
the largest shape (300 x 32000) runs once in fp32. About a minute here in all.
"""

import itertools

import pytest
import torch
from ops_tolerance import assert_tracks_torch

from chronicals.ops import linear_cross_entropy, linear_cross_entropy_ref
from chronicals.ops._impl import triton_interpreting
from chronicals.ops import cross_entropy
from chronicals.ops._linear_ce_kernels import BLOCK_V_ROWS, lce_rows
from chronicals.ops.cross_entropy import default_chunk_rows, linear_cross_entropy_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not triton_interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)")
IGNORE = -100
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
# (N, H, V, chunk_rows): None = the default (256 rows here, so 300 rows take two chunks); 3 rows per chunk
# (<= H) runs the path where the logits workspace becomes dW's storage, with a 1-row tail chunk at N = 7.
SHAPES = [(1, 64, 1000, None), (7, 96, 1031, 3), (300, 64, 1031, None), (7, 64, 32000, None)]
# (bias, softcap) cycles over the shapes so each dtype and reduction meets all four combinations
FEATURES = [(False, None), (True, None), (False, 30.0), (True, 5.0)]
CASES = [(dt, red, *shape, *feat) for dt, red in itertools.product(DTYPES, REDUCTIONS)
         for shape, feat in zip(SHAPES, FEATURES)]
CASES.append((torch.float32, "mean", 300, 96, 32000, None, True, 30.0))


def exact_lce(hidden, weight, labels, bias, reduction, softcap):
    """float64 all the way, written out here (independent of linear_cross_entropy_ref)."""
    z = hidden @ weight.T + (0 if bias is None else bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != IGNORE
    nll = -torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    per_tok = torch.where(valid, nll, torch.zeros_like(nll))
    if reduction == "none":
        return per_tok
    return per_tok.sum() if reduction == "sum" else per_tok.sum() / valid.sum().clamp(min=1)


def make_inputs(n, h, v, dtype, bias, seed, ignore_every=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h ** -0.5 * 2  # logits of std ~2
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1::ignore_every] = IGNORE
    cast = (lambda t: None if t is None else t.to(dtype).to(DEV))
    return cast(x), cast(w), cast(b), labels.to(DEV)


def run(fn, x, w, b, labels, grad_out):
    """Forward + backward; returns [loss, dx, dw(, db)]."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    loss = fn(*leaves[:2], labels, leaves[2] if b is not None else None)
    grads = torch.autograd.grad(loss, leaves, grad_out.to(loss.dtype))
    return [loss] + list(grads)


@pytest.mark.parametrize("dtype,reduction,n,h,v,chunk_rows,bias,softcap", CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}-{c[2]}x{c[3]}x{c[4]}-c{c[5]}-b{int(c[6])}-s{c[7]}"
                              for c in CASES])
def test_matches_reference(dtype, reduction, n, h, v, chunk_rows, bias, softcap):
    x, w, b, labels = make_inputs(n, h, v, dtype, bias, seed=n * 7919 + v)
    shape = (n,) if reduction == "none" else ()
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)

    def ours(x_, w_, labels_, b_):
        return linear_cross_entropy_triton(x_, w_, labels_, bias=b_, ignore_index=IGNORE, reduction=reduction,
                                           softcap=softcap, chunk_rows=chunk_rows)

    def same_dtype(x_, w_, labels_, b_):
        return linear_cross_entropy_ref(x_, w_, labels_, bias=b_, ignore_index=IGNORE, reduction=reduction,
                                        softcap=softcap)

    def exact(x_, w_, labels_, b_):
        return exact_lce(x_, w_, labels_, b_, reduction, softcap)

    got = run(ours, x, w, b, labels, grad_out)
    torch_out = run(same_dtype, x, w, b, labels, grad_out)
    ref = run(exact, *(None if t is None else t.double() for t in (x, w, b)), labels, grad_out)
    assert got[0].dtype == torch.float32 and got[0].shape == shape
    for name, o, t, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], got, torch_out, ref):
        assert o.dtype == t.dtype, f"{name}: dtype {o.dtype}, torch gives {t.dtype}"
        assert_tracks_torch(name, o, t, r, dtype=dtype)  # the inputs' eps: see ops_tolerance


@pytest.mark.parametrize("softcap", [0.5, 30.0, 1e4, 1e6, 1e8])
def test_any_softcap_is_exact_in_float32(softcap):
    """The kernel's tanh (1 - 2 / (exp2(2x) + 1)) has an absolute error of ~1e-7, which near 0 is all of it: a
    large softcap (a user's "practically no cap") gave z off by softcap x 1e-7, the loss off by 8e-3 at 1e6 and
    log V at 1e8 (every logit 0). Loss and both gradients against float64, at fp32's own accuracy."""
    x, w, _, labels = make_inputs(7, 64, 1031, torch.float32, False, seed=5)

    def ours(x_, w_, labels_, b_):
        return linear_cross_entropy_triton(x_, w_, labels_, ignore_index=IGNORE, softcap=softcap)

    got = run(ours, x, w, None, labels, torch.tensor(1.0, device=DEV))
    ref = run(lambda x_, w_, l_, b_: exact_lce(x_, w_, l_, b_, "mean", softcap), x.double(), w.double(), None,
              labels, torch.tensor(1.0, dtype=torch.float64, device=DEV))
    for name, o, r in zip(["loss", "d_hidden", "d_weight"], got, ref):
        err = ((o.double() - r).abs().max() / r.abs().max().clamp(min=1e-30)).item()
        assert err < 2e-5, f"{name}: relative error {err:.2e} at softcap {softcap:g}"


@pytest.mark.parametrize("dtype,reduction,bias,softcap,parts", [
    (torch.float32, "mean", True, None, 2), (torch.bfloat16, "sum", False, 30.0, 3),
    (torch.float32, "none", True, 20.0, 7), (torch.bfloat16, "none", False, None, 2)])
def test_vocab_parts_match_reference(dtype, reduction, bias, softcap, parts):
    """vocab_parts k: the weight gradient accumulated one vocabulary part per pass (V = 1031: the last of 7
    parts is shorter); loss and every gradient track the reference as the one-part path does. "none" runs
    the parts in its backward, from the saved log-sum-exp."""
    n, h, v = 300, 64, 1031
    x, w, b, labels = make_inputs(n, h, v, dtype, bias, seed=17)
    shape = (n,) if reduction == "none" else ()
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEV)

    def ours(x_, w_, labels_, b_):
        return linear_cross_entropy(x_, w_, labels_, bias=b_, ignore_index=IGNORE, reduction=reduction,
                                    softcap=softcap, impl="triton", vocab_parts=parts)

    def same_dtype(x_, w_, labels_, b_):
        return linear_cross_entropy_ref(x_, w_, labels_, bias=b_, ignore_index=IGNORE, reduction=reduction,
                                        softcap=softcap)

    got = run(ours, x, w, b, labels, grad_out)
    torch_out = run(same_dtype, x, w, b, labels, grad_out)
    ref = run(lambda x_, w_, l_, b_: exact_lce(x_, w_, l_, b_, reduction, softcap),
              *(None if t is None else t.double() for t in (x, w, b)), labels, grad_out)
    for name, o, t, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], got, torch_out, ref):
        assert_tracks_torch(name, o, t, r, dtype=dtype)  # the inputs' eps: see ops_tolerance


@pytest.mark.parametrize("c,v,h", [(37, 1031, 200), (300, 77, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dw_accumulate_adds_the_product_into_fp32(dtype, c, v, h):
    """The weight-gradient GEMM (``dw_accumulate``: the Triton kernel under the interpreter and on torch builds
    without cuBLAS's fp32-output addmm) adds d (C, V)^T @ x (C, H) into an fp32 (V, H) accumulator; against float64,
    within 2x PyTorch's fp32 GEMM error. The head tests above have H <= 96, inside one column tile (BLOCK_H = 128 in
    the interpreter): H = 200 and 129 run a second, masked one, V = 1031 a second row tile, C = 300 three K steps."""
    from chronicals.ops._linear_ce_kernels import dw_accumulate

    g = torch.Generator().manual_seed(c + v + h)
    d = torch.randn(c, v, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    x = torch.randn(c, h, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    acc0 = torch.randn(v, h, generator=g, dtype=torch.float64).float().to(DEV)
    acc = acc0.clone()
    dw_accumulate(d, x, acc)
    ref64 = acc0.double() + d.double().T @ x.double()
    torch_fp32 = torch.addmm(acc0, d.float().T, x.float())  # PyTorch's GEMM on the same values, fp32
    assert acc.dtype == torch.float32
    assert_tracks_torch("dW", acc, torch_fp32, ref64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_part_one_accumulator_is_rounded_in_place(dtype):
    """vocab_parts > 1 keeps part 1's fp32 accumulator in dW's own bytes; rounding it into dW's first rows
    in place (staging 3 rows at a time, so the blocks overlap rows not yet read) gives acc.to(dtype)."""
    v, h, rows = 11, 6, 5  # 5 fp32 rows fit in the bytes of 11 16-bit rows
    dw = torch.full((v, h), 7.0, dtype=dtype)
    acc = cross_entropy.fp32_rows_of(dw, rows)
    assert acc.data_ptr() == dw.data_ptr() and acc.dtype == torch.float32
    acc.copy_(torch.randn(rows, h, generator=torch.Generator().manual_seed(0)))
    want = acc.clone().to(dtype)
    cross_entropy.downcast_in_place_(acc, dw, torch.empty(3 * h, dtype=dtype))
    assert torch.equal(dw[:rows], want)
    # V odd: 516 fp32 rows would not fit in dW's bf16 bytes; 515, rounded down to a multiple of 8
    assert cross_entropy.part_one_rows(1031, 2, 2) == 512 and cross_entropy.part_one_rows(151936, 2, 2) == 75968
    assert cross_entropy.part_one_rows(1031, 2, 4) == 512 and cross_entropy.part_one_rows(1031, 1, 2) == 1031
    assert cross_entropy.part_one_rows(5, 2, 2) == 2


def test_bias_gradient_sums_chunks_in_fp32():
    """dbias adds each chunk's column sum in fp32 and rounds once: with bf16 d_logits a per-chunk bf16 sum drops
    chunk 1's 2^-10 (1 + 2^-10 rounds to 1), leaving 0 after chunk 2's -1 where the true value is ~1.0e-3."""
    x = torch.tensor([[10.0], [-6.9375], [-10.0], [-10.0]], dtype=torch.bfloat16, device=DEV)
    w = torch.tensor([[1.0], [0.0]], dtype=torch.bfloat16, device=DEV)  # logits (x, 0): p0 = sigmoid(x)
    labels = torch.tensor([1, 1, 0, 1], device=DEV)
    b = torch.zeros(2, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    linear_cross_entropy_triton(x, w, labels, bias=b, reduction="sum", chunk_rows=2).backward()
    want = float((torch.sigmoid(x.double()[:, 0]) - (labels == 0).double()).sum())
    assert abs(float(b.grad[0]) - want) < 2.5e-4, (float(b.grad[0]), want)


@pytest.mark.parametrize("n", [1, 5])
def test_vocab_parts_with_a_vocabulary_narrower_than_hidden(n):
    """V < H with one row: the workspace (1 x V) is smaller than one row of dW, which the in-place rounding
    stages through; the gradients still match the one-part head."""
    x, w, _, labels = make_inputs(n, 96, 40, torch.bfloat16, False, seed=5, ignore_every=7)
    grads = []
    for parts in (1, 2):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        linear_cross_entropy(xs, ws, labels, impl="triton", vocab_parts=parts).backward()
        grads.append((xs.grad, ws.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_rows_give_zero_loss_and_zero_gradients(parts, reduction):
    """N = 0 (a micro-batch with no loss rows): loss 0 and an all-zero weight gradient, every part written."""
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    w = torch.randn(100, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=DEV)
    loss = linear_cross_entropy(x, w, labels, reduction=reduction, impl="triton", vocab_parts=parts)
    loss.sum().backward()
    assert loss.sum().item() == 0 and x.grad.shape == (0, 64)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_vocab_parts_second_pass_in_many_vocabulary_chunks(monkeypatch):
    """The second pass in chunks of DW_CHUNK_BYTES (37 fp32 rows of dW, aligned down to 32; the last one shorter),
    bf16 with bias and ignored rows: no chunk is wider (the fp32 staging buffer's bound; without the cap it took
    the whole workspace's width), and loss and gradients track the reference like the one-part head."""
    monkeypatch.setattr(cross_entropy, "DW_CHUNK_BYTES", 37 * 4 * 64)
    widths, real = [], cross_entropy.lce_rows

    def spy(logits, *a, **k):
        if k.get("col0"):  # a second-pass chunk
            widths.append(logits.shape[1])
        return real(logits, *a, **k)

    monkeypatch.setattr(cross_entropy, "lce_rows", spy)
    n, h, v = 90, 64, 1000
    x, w, b, labels = make_inputs(n, h, v, torch.bfloat16, True, seed=23)
    grad_out = torch.ones((), dtype=torch.float64, device=DEV)

    def ours(x_, w_, labels_, b_):
        return linear_cross_entropy(x_, w_, labels_, bias=b_, ignore_index=IGNORE, impl="triton", vocab_parts=2)

    got = run(ours, x, w, b, labels, grad_out)
    assert max(widths) == 32 and sum(widths) == v - cross_entropy.part_one_rows(v, 2, 2), widths
    torch_out = run(lambda x_, w_, l_, b_: linear_cross_entropy_ref(x_, w_, l_, bias=b_, ignore_index=IGNORE),
                    x, w, b, labels, grad_out)
    ref = run(lambda x_, w_, l_, b_: exact_lce(x_, w_, l_, b_, "mean", None),
              *(t.double() for t in (x, w, b)), labels, grad_out)
    for name, o, t, r in zip(["loss", "d_hidden", "d_weight", "d_bias"], got, torch_out, ref):
        assert_tracks_torch(name, o, t, r, dtype=torch.bfloat16)


def test_model_loss_vocab_parts_reaches_the_head(monkeypatch):
    """CausalLM's training loss with opts.loss_vocab_parts = 3 runs the head in 3 parts, with the same loss and
    gradients as one part."""
    import transformers

    from chronicals.models import CausalLM, ModelConfig

    seen, real = [], cross_entropy.linear_ce_chunked
    monkeypatch.setattr(cross_entropy, "linear_ce_chunked", lambda *a, **k: seen.append(k["vocab_parts"]) or real(*a, **k))

    cfg = ModelConfig.from_hf_dict(transformers.LlamaConfig(
        vocab_size=211, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True).to_dict())
    ids = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    out = []
    for parts in (1, 3):
        model = CausalLM(cfg, impl="triton").init_weights(seed=0).to(DEV).train()
        model.opts.loss_vocab_parts = parts
        loss = model(ids, shift_labels=torch.roll(ids, -1, 1), reduction="mean")
        loss.backward()
        out.append((loss.detach(), model.lm_head.weight.grad.clone()))
    assert seen == [1, 3]
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-5, atol=1e-6)


def test_vocab_parts_rejects_bad_values():
    x, w, _, labels = make_inputs(4, 64, 1000, torch.float32, False, seed=1)
    with pytest.raises(ValueError, match="vocab_parts"):
        linear_cross_entropy(x, w, labels, impl="triton", vocab_parts=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_labels_ignored_gives_zero_loss_and_grads(reduction):
    x, w, b, labels = make_inputs(5, 64, 1000, torch.bfloat16, True, seed=3)
    labels[:] = IGNORE
    grad_out = torch.ones((5,) if reduction == "none" else (), device=DEV)
    loss, dx, dw, db = run(lambda x_, w_, l_, b_: linear_cross_entropy(
        x_, w_, l_, bias=b_, reduction=reduction, impl="triton"), x, w, b, labels, grad_out)
    for t in (loss, dx, dw, db):
        assert torch.isfinite(t).all() and (t == 0).all()


def test_a_first_vocab_tile_masked_by_minus_inf_bias_keeps_the_loss_finite():
    """A bias of -inf over the whole first vocab tile (BLOCK_V_ROWS tokens masked out of the vocabulary): the online
    softmax's running max is clamped at -1e30, so that tile gives s = 0, not exp(-inf - -inf) = NaN; loss and
    d_hidden are finite and match the reference (without the clamp both were NaN)."""
    g = torch.Generator().manual_seed(4)
    n, h, v = 3, 8, BLOCK_V_ROWS + 40
    x = torch.randn(n, h, generator=g).to(DEV)
    w = (torch.randn(v, h, generator=g) * 0.5).to(DEV)
    bias = torch.zeros(v)
    bias[:BLOCK_V_ROWS] = float("-inf")
    labels = torch.randint(BLOCK_V_ROWS, v, (n,), generator=g).to(DEV)
    out = []
    for fn in (linear_cross_entropy_triton, linear_cross_entropy_ref):
        xs = x.clone().requires_grad_()
        loss = fn(xs, w, labels, bias=bias.to(DEV), reduction="none")
        out.append((loss.detach(), *torch.autograd.grad(loss, [xs], torch.ones(n, device=DEV))))
    (loss, dx), (loss_r, dx_r) = out
    assert torch.isfinite(loss).all() and torch.isfinite(dx).all()
    torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_r, rtol=1e-5, atol=1e-5)


def test_rows_without_loss_get_zero_d_logits_even_with_inf_logits():
    """Two-pass kernel, fp16 chunk: an ignored row and an out-of-range row holding +inf (an fp16 GEMM output that
    overflowed) get d_logits exactly 0 (lse = inf there gives exp(inf - inf) = NaN before the row mask), so dW stays
    finite; the other rows are float64's softmax - onehot. Per row: on CUDA (one row per program) the ignored row
    takes the all-ignored branch and the out-of-range row the masked one; in the interpreter all share a program."""
    c, v = 5, 32
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(c, v, generator=g).to(torch.float16)
    buf[2, 7] = buf[4, 3] = float("inf")
    labels = torch.tensor([1, 2, IGNORE, 4, v + 3])
    ref = torch.softmax(buf.double(), -1)
    ref[[0, 1, 3], labels[[0, 1, 3]]] -= 1
    ref[[2, 4]] = 0
    b = buf.to(DEV)
    loss, lse = torch.empty(c, device=DEV), torch.empty(c, device=DEV)
    lce_rows(b, labels.to(DEV), 0, None, torch.ones(1, device=DEV), loss, lse, ignore_index=IGNORE, softcap=None,
             compute_lse=True, write_grad=True)
    assert torch.isfinite(b).all() and (b[[2, 4]] == 0).all()
    assert loss[2] == 0 and torch.isnan(loss[4])
    torch.testing.assert_close(b.double().cpu(), ref, rtol=2e-3, atol=1e-3)


def test_sum_over_global_count_equals_mean():
    """The trainer's contract: reduction="sum" / count of non-ignored labels == reduction="mean"."""
    x, w, _, labels = make_inputs(9, 64, 1000, torch.float32, False, seed=5)
    total = linear_cross_entropy(x, w, labels, reduction="sum", impl="triton")
    mean = linear_cross_entropy(x, w, labels, reduction="mean", impl="triton")
    torch.testing.assert_close(total / (labels != IGNORE).sum(), mean)


def test_tied_embeddings_gradient_lands_in_shared_weight():
    """An embedding and the head share one weight: its gradient is the sum of both uses."""
    v, h, n = 1031, 64, 7
    g = torch.Generator().manual_seed(11)
    w0 = (torch.randn(v, h, generator=g) * 0.2).to(DEV)
    ids = torch.randint(0, v, (n,), generator=g).to(DEV)
    labels = torch.randint(0, v, (n,), generator=g).to(DEV)
    labels[2] = IGNORE

    def grad_of(fn):
        w = w0.clone().requires_grad_()
        hid = torch.tanh(torch.nn.functional.embedding(ids, w))
        fn(hid, w).backward()
        return w.grad

    ours = grad_of(lambda hid, w: linear_cross_entropy(hid, w, labels, impl="triton"))
    ref = grad_of(lambda hid, w: linear_cross_entropy_ref(hid, w, labels))
    emb_only = grad_of(lambda hid, w: linear_cross_entropy_ref(hid, w.detach(), labels))
    assert (emb_only - ref).abs().max() > 1e-3  # the head's share is not negligible, so the test can fail
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strided", ["hidden", "frozen weight", "labels", "bias"])
def test_non_contiguous_inputs_match_the_reference(strided):
    """A transposed hidden (in chunks, with dW) or a transposed frozen weight (the one-pass path) gives the
    contiguous copy's loss and gradients: the dW accumulation and dh_finish read rows by stride(0) alone, so
    without the driver's .contiguous() both were silently wrong. Likewise labels as a column of an (N, 2) int64
    tensor (.long() keeps the stride-2 view) and a bias taking every other element: the kernel reads both by unit
    stride, so without .contiguous() it took other rows' labels and the first V elements of the bias' storage."""
    x, w, b, labels = make_inputs(7, 16, 101, torch.float32, strided == "bias", seed=3)
    chunk_rows = None
    if strided == "hidden":
        x, w, chunk_rows = x.t().contiguous().t(), w.requires_grad_(), 3
    elif strided == "frozen weight":
        w = w.t().contiguous().t()
    elif strided == "labels":
        labels = torch.stack([labels, (labels + 5) % 101], 1)[:, 0]  # column 1 differs from column 0
    else:
        b = torch.stack([b, torch.randn(101, generator=torch.Generator().manual_seed(9)).to(DEV) * 3], 1)[:, 0]
    assert not {"hidden": x, "frozen weight": w, "labels": labels, "bias": b}[strided].is_contiguous()

    def grads(fn, x_, w_):
        x_ = x_.detach().requires_grad_()
        w_ = w_.detach().requires_grad_(w.requires_grad)
        loss = fn(x_, w_)
        return [loss, *torch.autograd.grad(loss, [x_] + ([w_] if w.requires_grad else []))]

    got = grads(lambda x_, w_: linear_cross_entropy_triton(x_, w_, labels, bias=b, chunk_rows=chunk_rows), x, w)
    ref = grads(lambda x_, w_: linear_cross_entropy_ref(x_, w_, labels.contiguous(), bias=b), x.contiguous(),
                w.contiguous())
    for o, r in zip(got, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)


def test_no_grad_eval_and_frozen_weight(monkeypatch):
    """Eval runs only the loss, also with trainable hidden, weight and bias: no dH, dW or dbias is asked for ("mean"
    computed them in the forward: a V x H dW and two GEMMs in every eval step, thrown away). A frozen head (LoRA)
    yields d_hidden alone and no weight gradient."""
    needs, real = [], cross_entropy.linear_ce_chunked
    monkeypatch.setattr(cross_entropy, "linear_ce_chunked",
                        lambda *a, **k: needs.append((k["need_dh"], k["need_dw"], k["need_db"])) or real(*a, **k))
    x, w, b, labels = make_inputs(7, 64, 1031, torch.float32, True, seed=9)
    xt, wt, bt = (t.clone().requires_grad_() for t in (x, w, b))
    for reduction in ("none", "mean"):
        with torch.no_grad():
            loss = linear_cross_entropy(xt, wt, labels, bias=bt, reduction=reduction, impl="triton")
        torch.testing.assert_close(loss, linear_cross_entropy_ref(x, w, labels, bias=b, reduction=reduction))
    assert needs == [(False, False, False)] * 2
    xg = x.clone().requires_grad_()
    linear_cross_entropy(xg, w, labels, impl="triton").backward()
    xr = x.clone().requires_grad_()
    linear_cross_entropy_ref(xr, w, labels).backward()
    assert w.grad is None
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_allocates_no_zero_gradients_for_unused_outputs(reduction):
    """The op also outputs lse and (for "mean"/"sum") the gradients; nobody differentiates them, and autograd
    must not build zero tensors for them in backward (a zeros_like(dW) was the backward's memory peak on the
    GPU: 0.84 vs 0.56 GiB at Qwen2.5-0.5B). Counted: every (V, H) tensor an aten op makes during backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, _, labels = make_inputs(7, 64, 1031, torch.float32, False, seed=4)
    x.requires_grad_(), w.requires_grad_()
    made = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)}  # views (detach) share an input's storage: not new memory
            made.extend(str(func) for t in outs if isinstance(t, torch.Tensor) and t.shape == w.shape
                        and t.untyped_storage().data_ptr() not in seen)
            return out

    loss = linear_cross_entropy(x, w, labels, reduction=reduction, impl="triton").sum()
    with Count():
        gx, gw = torch.autograd.grad(loss, [x, w])
    assert len(made) == 1 and "zeros" not in made[0], made  # the op that writes (or scales) dW, nothing else
    rx, rw = torch.autograd.grad(linear_cross_entropy_ref(x, w, labels, reduction=reduction).sum(), [x, w])
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_through_lse_alone_gives_no_gradient(reduction):
    """The op's other outputs (lse, the forward's gradients) are not differentiated: a backward that reaches only
    lse hands back no gradient (it crashed on the missing loss gradient: an AttributeError or inside the backward
    op)."""
    x, w, _, labels = make_inputs(5, 64, 1000, torch.float32, False, seed=19)
    x.requires_grad_(), w.requires_grad_()
    out = torch.ops.chronicals.linear_cross_entropy(x, w, labels, None, IGNORE, reduction, None, True, True, False,
                                                   3, 1)
    assert torch.autograd.grad(out[1].sum(), [x, w], allow_unused=True) == (None, None)


def test_default_chunk_rows():
    # with a weight gradient the chunk is max(H, 1,792) rows (dW's fp32 accumulator traffic per FLOP halved
    # at 0.5B against C = H; dW lives in the workspace's first V x H elements): 1,792 at 0.5B, 4,096 at 8B
    assert default_chunk_rows(16384, 896, 151936, True, 2) == 1792
    # ... or every row in one chunk where that takes no more memory (dW from one GEMM, no fp32 accumulator):
    # at 8B, N 8,192 takes 2.1 GB of logits + 1.05 GB of dW, as two chunks took 1.05 + 2.1 GB; N 8,200 does not
    assert default_chunk_rows(8192, 4096, 128256, True, 2) == 8192
    assert default_chunk_rows(8200, 4096, 128256, True, 2) == 4096
    assert default_chunk_rows(2688, 896, 151936, True, 2) == 2688  # 0.5B: up to 1,792 + H rows
    assert default_chunk_rows(2689, 896, 151936, True, 2) == 1792
    # vocab_parts > 1 is the low-memory mode: chunks of H keep its workspace at V x H (0.56 GiB in all at 0.5B)
    assert default_chunk_rows(16384, 896, 151936, True, 2, vocab_parts=2) == 896
    # ... also where one chunk of all rows would fit at one part (N <= 2H here)
    assert default_chunk_rows(1792, 896, 151936, True, 2, vocab_parts=1) == 1792
    assert default_chunk_rows(1792, 896, 151936, True, 2, vocab_parts=2) == 896
    # frozen head: ~256 MB of bf16 logits, 883 rows at V = 151,936; never more rows than the batch
    assert default_chunk_rows(16384, 896, 151936, False, 2) == 883
    # ... but never below MIN_CHUNK_ROWS GEMM rows: 256 MB holds only 111 rows of a 600,000 fp32 vocabulary
    assert default_chunk_rows(16384, 896, 600000, False, 4) == cross_entropy.MIN_CHUNK_ROWS == 256
    assert default_chunk_rows(100, 896, 600000, False, 4) == 100
    assert default_chunk_rows(5, 896, 151936, True, 2) == 5


def test_frozen_head_default_chunk_follows_the_workspace_target(monkeypatch):
    """Without a weight gradient (a frozen head, LoRA) the op's default chunk is WORKSPACE_BYTES of logits (floored
    at MIN_CHUNK_ROWS), not the weight-gradient rule (max(H, 1,792) rows, or all rows): sized by that rule the
    workspace grew past its target. Scaled down: 5 rows of fp32 logits."""
    monkeypatch.setattr(cross_entropy, "WORKSPACE_BYTES", 101 * 4 * 5)
    monkeypatch.setattr(cross_entropy, "MIN_CHUNK_ROWS", 4)
    seen, real = [], cross_entropy.linear_ce_chunked
    monkeypatch.setattr(cross_entropy, "linear_ce_chunked",
                        lambda *a, **k: seen.append(k["chunk_rows"]) or real(*a, **k))
    x, w, _, labels = make_inputs(12, 8, 101, torch.float32, False, seed=1)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = linear_cross_entropy_triton(xg, w, labels)  # w frozen
    loss.backward()
    assert seen == [5]
    ref = linear_cross_entropy_ref(xr, w, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_torch_compile_sees_one_op(reduction):
    """fullgraph compile with backward; "none" computes its gradients in the backward op, traced through that op's
    fake (whose dW shape must be the real op's (V, H))."""
    x, w, _, labels = make_inputs(7, 64, 1000, torch.float32, False, seed=13)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step(x_, w_):
        return linear_cross_entropy(x_, w_, labels, reduction=reduction, impl="triton").sum() * 0.5

    step(x, w)  # resolve_impl logs its choice on the first call; dynamo cannot trace a logger call
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(xg, wg)
    loss.backward()
    ref = linear_cross_entropy_ref(x.requires_grad_(), w.requires_grad_(), labels, reduction=reduction).sum() * 0.5
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(xg.grad, x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wg.grad, w.grad, rtol=1e-5, atol=1e-7)


def test_opcheck():
    x, w, b, labels = make_inputs(5, 64, 1000, torch.float32, True, seed=17)
    for reduction, parts in (("mean", 1), ("none", 1), ("mean", 2)):
        args = (x, w, labels, b, IGNORE, reduction, 10.0, True, True, True, 3, parts)
        torch.library.opcheck(torch.ops.chronicals.linear_cross_entropy.default, args,
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("bad,match", [
    (dict(reduction="avg"), "reduction='avg'"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), "labels"),
    (dict(weight=torch.zeros(10, 32)), "must be \\(N, H\\) and \\(V, H\\)"),
    (dict(hidden=torch.zeros(5, 64, dtype=torch.float64)), "share one dtype"),
])
def test_errors_say_what_to_fix(bad, match):
    kw = dict(hidden=torch.zeros(5, 64), weight=torch.zeros(10, 64), labels=torch.zeros(5, dtype=torch.long),
              reduction="mean")
    kw.update(bad)
    kw = {k: (t.to(DEV) if isinstance(t, torch.Tensor) else t) for k, t in kw.items()}
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("labels"), impl="triton", **kw)


@pytest.mark.parametrize("chunk_rows,accumulators", [(None, 0), (3, 1)])
def test_one_chunk_makes_no_fp32_weight_gradient_accumulator(chunk_rows, accumulators):
    """All rows in one chunk (the default where that fits: 7 rows here, Llama-3-8B's head at N 8,192) take dW from
    one GEMM over every row, so no (V, H) fp32 buffer is made; in chunks of 3 rows one accumulator is. Both track
    the reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from chronicals.ops.cross_entropy import linear_ce_chunked

    n, h, v = 7, 64, 1031
    x, w, _, labels = make_inputs(n, h, v, torch.bfloat16, False, seed=23)
    rows = default_chunk_rows(n, h, v, True, 2) if chunk_rows is None else chunk_rows
    made = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            made.extend(str(func) for t in outs if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                        and t.numel() >= v * h)
            return out

    scale = torch.ones(1, device=DEV, dtype=torch.float32)
    with Count():
        _, _, dh, dw, _ = linear_ce_chunked(x, w, labels, None, scale, None, ignore_index=IGNORE, softcap=None,
                                            need_dh=True, need_dw=True, need_db=False, chunk_rows=rows)
    assert len({m for m in made if "zero" in m or "empty" in m}) == accumulators, made
    ours = [dh, dw]  # scale 1: the gradients of the "sum" loss
    same_dtype = run(lambda a, b, y, _: linear_cross_entropy_ref(a, b, y, reduction="sum"), x, w, None, labels,
                     torch.ones(()))[1:]
    exact = run(lambda a, b, y, _: exact_lce(a, b, y, None, "sum", None), x.double(), w.double(), None, labels,
                torch.ones(()))[1:]
    for name, o, t, r in zip(["d_hidden", "d_weight"], ours, same_dtype, exact):
        assert_tracks_torch(name, o, t, r, dtype=torch.bfloat16)
