"""Both impls of each op run the same argument checks before choosing an implementation: a bad call raises
the same ValueError on impl="torch" as on impl="triton" (the torch path used to compute garbage or fail
deep inside PyTorch). Nothing here launches a kernel: ~1 s."""

import importlib

import pytest
import torch

from chronicals import ops
from chronicals.ops import linear_cross_entropy, rms_norm
from chronicals.ops._impl import triton_interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch"] + (["triton"] if DEV == "cuda" or triton_interpreting() else [])


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype=dtype, device=DEV)


def lce(**kw):
    args = dict(hidden=t(4, 17), weight=t(29, 17), labels=torch.tensor([0, 3, -100, 28], device=DEV))
    args.update(kw)
    return lambda impl: ops.linear_cross_entropy(impl=impl, **args)


CASES = {
    "rope odd R": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8), t(1, 2, 5), t(1, 2, 5), impl=impl),
                   r"rotary dims R=5 must be even and <= head_dim 8"),
    "rope R > D": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8), t(1, 2, 10), t(1, 2, 10), impl=impl),
                   r"rotary dims R=10 must be even and <= head_dim 8"),
    "rope cos seq": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8), t(1, 3, 8), t(1, 3, 8), impl=impl),
                     r"cos/sin must be \(1 or 1, 2, R\)"),
    "rope q/k head dim": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 6), t(1, 2, 6), t(1, 2, 6), impl=impl),
                          r"expected q \(B, S, Hq, D\) and k \(B, S, Hk, D\)"),  # torch rotated both silently
    "rope cos batch": (lambda impl: ops.rope_qk(t(3, 2, 2, 8), t(3, 2, 1, 8), t(2, 2, 8), t(2, 2, 8), impl=impl),
                       r"cos/sin must be \(3 or 1, 2, R\)"),  # neither 1 nor B: a raw broadcast error
    "rope q/k dtype": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8, dtype=torch.float64), t(1, 2, 8),
                                                t(1, 2, 8), impl=impl), r"q and k must share a dtype"),
    # each was a broadcast error from inside the torch impl, or (4-D cos) a 5-D result without a word
    "rope q/k tokens": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 3, 1, 8), t(1, 2, 8), t(1, 2, 8), impl=impl),
                        r"expected q \(B, S, Hq, D\) and k \(B, S, Hk, D\)"),
    "rope k 3-D": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 8), t(1, 2, 8), t(1, 2, 8), impl=impl),
                   r"expected q \(B, S, Hq, D\) and k \(B, S, Hk, D\)"),
    "rope sin R": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8), t(1, 2, 8), t(1, 2, 6), impl=impl),
                   r"cos/sin must be \(1 or 1, 2, R\), got \(1, 2, 8\) and \(1, 2, 6\)"),
    "rope cos 4-D": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8), t(1, 2, 1, 8), t(1, 2, 1, 8), impl=impl),
                     r"cos/sin must be \(1 or 1, 2, R\)"),
    "rope devices": (lambda impl: ops.rope_qk(t(1, 2, 2, 8), t(1, 2, 1, 8), *(torch.randn(1, 2, 8, device="meta"),) * 2,
                                              impl=impl), r"rope_qk: all tensors must be on one device"),
    "rope int q and cos": (lambda impl: ops.rope_qk(*(torch.ones(1, 2, 2, 8, dtype=torch.long, device=DEV),) * 2,
                                                    *(torch.ones(1, 2, 8, dtype=torch.long, device=DEV),) * 2,
                                                    impl=impl), r"must be floating point"),
    "swiglu shapes": (lambda impl: ops.swiglu(t(3, 4), t(3, 5), impl=impl), r"swiglu: gate \(3, 4\)"),
    "swiglu broadcast": (lambda impl: ops.swiglu(t(3, 4), t(4), impl=impl), r"must have one shape and dtype"),
    "swiglu dtypes": (lambda impl: ops.swiglu(t(3, 4), t(3, 4, dtype=torch.float64), impl=impl),
                      r"must have one shape and dtype"),
    "swiglu devices": (lambda impl: ops.swiglu(t(3, 4), torch.randn(3, 4, device="meta"), impl=impl),
                       r"swiglu: all tensors must be on one device"),
    "rms weight": (lambda impl: ops.rms_norm(t(3, 4), t(5), 1e-6, impl=impl),
                   r"weight has shape \(5,\), expected \(4,\)"),
    "rms residual": (lambda impl: ops.rms_norm(t(3, 4), t(4), 1e-6, residual=t(2, 4), impl=impl),
                     r"residual \(2, 4\)"),
    # meta: a second device (as "lce devices" below); the torch impl added a meta residual without a word
    "rms devices": (lambda impl: ops.rms_norm(t(3, 4), t(4), 1e-6, residual=torch.randn(3, 4, device="meta"),
                                              impl=impl), r"rms_norm: all tensors must be on one device, got \[.*'meta'\]"),
    "attn Hq % Hk": (lambda impl: ops.attention(t(1, 3, 3, 8), t(1, 3, 2, 8), t(1, 3, 2, 8), impl=impl),
                     r"Hq=3 query heads are not a multiple of Hk=2"),
    "attn k/v shapes": (lambda impl: ops.attention(t(1, 3, 2, 8), t(1, 3, 2, 8), t(1, 3, 1, 8), impl=impl),
                        r"expected q \(B, S, Hq, D\) and k, v \(B, S, Hk, D\)"),
    # SDPA takes a query of 3 tokens against keys of 4 and returns (a causal mask aligned at the top left)
    "attn q/k tokens": (lambda impl: ops.attention(t(1, 3, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), impl=impl),
                        r"expected q \(B, S, Hq, D\) and k, v \(B, S, Hk, D\)"),
    "attn cu float": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8),
                                                 cu_seqlens=torch.tensor([0.0, 2.0, 4.0], device=DEV), impl=impl),
                      r"cu_seqlens must be int32 .* \(got torch.float32 \(3,\)\)"),
    "attn cu one entry": (lambda impl: ops.attention(t(2, 6, 2, 8), t(2, 6, 2, 8), t(2, 6, 2, 8), impl=impl,
                                                     cu_seqlens=torch.tensor([0], dtype=torch.int32, device=DEV)),
                          r"cu_seqlens must be int32 \(num_docs \+ 1,\).*\(got torch.int32 \(1,\)\)"),  # no document
    "attn cu int64": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8),
                                                 cu_seqlens=torch.tensor([0, 4], device=DEV), impl=impl),
                      r"cu_seqlens must be int32"),
    "lce softcap 0": (lce(softcap=0.0), r"softcap=0.0 must be None .* or a finite number > 0"),
    "lce softcap < 0": (lce(softcap=-2.0), r"softcap=-2.0 must be None"),
    "lce softcap nan": (lce(softcap=float("nan")), r"softcap=nan must be None"),
    "lce softcap inf": (lce(softcap=float("inf")), r"softcap=inf must be None"),  # inf * tanh(z / inf) = NaN
    "lce softcap bool": (lce(softcap=True), r"softcap=True must be None"),
    "lce softcap str": (lce(softcap="30"), r"softcap='30' must be None"),  # a config string, not a TypeError
    "lce devices": (lce(bias=torch.randn(29, device="meta")), r"all tensors must be on one device"),  # meta: a 2nd
    "lce label device": (lce(labels=torch.tensor([0, 3, -100, 28], device="meta")), r"must be on one device"),
    "lce float labels": (lce(labels=torch.tensor([0.0, 3.0, -100.0, 28.0], device=DEV)),
                         r"labels must be int64 or int32 .* got torch.float32"),
    "lce labels 2-D": (lce(labels=torch.tensor([[0, 3, -100, 28]], device=DEV)), r"labels \(1, 4\) must be \(4,\)"),
    "lce hidden 3-D": (lce(hidden=t(1, 4, 17)), r"must be \(N, H\) and \(V, H\)"),
    "lce dtypes": (lce(hidden=t(4, 17, dtype=torch.float64)), r"must share one dtype"),
    # a bias of another dtype or shape: without the check impl="torch" raised PyTorch's own dtype or "expanded
    # size" error, not the fix
    "lce bias dtype": (lce(bias=t(29, dtype=torch.float64)), r"bias torch.float64 must share one dtype"),
    "lce bias V + 1": (lce(bias=t(30)), r"bias \(30,\) must be \(29,\)"),
    "lce bias (1, V)": (lce(bias=t(1, 29)), r"bias \(1, 29\) must be \(29,\)"),
    "lce reduction": (lce(reduction="avg"), r"reduction='avg' is not one of"),
    "lce vocab_parts": (lce(vocab_parts=0), r"vocab_parts=0 must be an integer >= 1"),
    "lce vocab_parts 2.5": (lce(vocab_parts=2.5), r"vocab_parts=2.5 must be an integer >= 1"),
    "lce vocab_parts True": (lce(vocab_parts=True), r"vocab_parts=True must be an integer >= 1"),
    "lce ignore_index True": (lce(ignore_index=True), r"ignore_index=True must be an integer label"),
    "lce weight 3-D": (lce(weight=t(29, 17, 1)), r"must be \(N, H\) and \(V, H\)"),  # torch: F.linear's own error
    # found by an ops walk: each was a raw error from inside torch / triton, or a silent wrong value
    "lce ignore_index 0.5": (lce(ignore_index=0.5), r"ignore_index=0.5 must be an integer label"),  # triton: 0
    "lce V = 0": (lce(weight=t(0, 17), labels=torch.tensor([-100] * 4, device=DEV)), r"V >= 1"),
    "attn Hk = 0": (lambda impl: ops.attention(t(1, 3, 2, 8), t(1, 3, 0, 8), t(1, 3, 0, 8), impl=impl),
                    r"k and v have 0 heads"),
    "attn max_seqlen 0": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), max_seqlen=0,
                                                     cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=DEV),
                                                     impl=impl), r"max_seqlen=0; expected the longest document"),
    # FA2 takes max_seqlen as a C++ int: True (a bool is an Integral) became 1, a reshape error inside its call
    "attn max_seqlen True": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), max_seqlen=True,
                                                        cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=DEV),
                                                        impl=impl), r"max_seqlen=True; expected the longest document"),
    "attn max_seqlen 2.5": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), max_seqlen=2.5,
                                                       cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=DEV),
                                                       impl=impl), r"max_seqlen=2\.5; expected the longest document"),
    "attn max_seqlen 4.0": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), max_seqlen=4.0,
                                                       cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=DEV),
                                                       impl=impl), r"max_seqlen=4\.0; expected the longest document"),
    "attn cu from 2": (lambda impl: ops.attention(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), impl="torch",
                                                  cu_seqlens=torch.tensor([2, 4], dtype=torch.int32, device=DEV)),
                       r"cu_seqlens must start at 0 and never decrease"),
    "attn cu decreasing": (lambda impl: ops.attention(
        t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), impl="torch",
        cu_seqlens=torch.tensor([0, 3, 1, 4], dtype=torch.int32, device=DEV)), r"never decrease"),
    "gate_up I = 0": (lambda impl: ops.swiglu_gate_up(t(3, 0), impl=impl), r"even dim 2I >= 2"),
    "rms int x": (lambda impl: ops.rms_norm(torch.ones(3, 4, dtype=torch.long, device=DEV), t(4), 1e-6, impl=impl),
                  r"must be floating point"),
    "rope cos dtype": (lambda impl: ops.rope_qk(t(1, 2, 2, 8, dtype=torch.bfloat16), t(1, 2, 1, 8, dtype=torch.bfloat16),
                                                t(1, 2, 8), t(1, 2, 8), impl=impl), r"cos/sin .* of the same dtype"),
    "rope int q": (lambda impl: ops.rope_qk(*(torch.ones(1, 2, 2, 8, dtype=torch.long, device=DEV),) * 2,
                                            t(1, 2, 8), t(1, 2, 8), impl=impl), r"must be floating point"),
    # the other halves of the two checks above (a mutation walk: dropping either survived)
    "rms int weight": (lambda impl: ops.rms_norm(t(3, 4), torch.ones(4, dtype=torch.long, device=DEV), 1e-6, impl=impl),
                       r"must be floating point"),
    "rope sin dtype": (lambda impl: ops.rope_qk(t(1, 2, 2, 8, dtype=torch.bfloat16), t(1, 2, 1, 8, dtype=torch.bfloat16),
                                                t(1, 2, 8, dtype=torch.bfloat16), t(1, 2, 8), impl=impl),
                       r"cos/sin .* of the same dtype"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_same_check_on_both_impls(case, impl):
    call, match = CASES[case]
    with pytest.raises(ValueError, match=match):
        call(impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_positive_still_runs(impl):
    loss = lce(softcap=30.0)(impl)
    assert loss.shape == () and torch.isfinite(loss)


def test_autotune_env_picks_first_config_or_refuses(monkeypatch):
    """CHRONICALS_AUTOTUNE=first gives one config per kernel (quick GPU test runs); a typo is refused by name."""
    import triton

    from chronicals.ops import _triton_utils

    configs = [triton.Config({"BLOCK": b}) for b in (64, 128, 256)]
    monkeypatch.setattr(_triton_utils, "triton_interpreting", lambda: False)  # as on CUDA
    monkeypatch.delenv("CHRONICALS_AUTOTUNE", raising=False)
    assert _triton_utils.tune_configs(configs) == configs
    monkeypatch.setenv("CHRONICALS_AUTOTUNE", "first")
    assert _triton_utils.tune_configs(configs) == configs[:1]
    monkeypatch.setenv("CHRONICALS_AUTOTUNE", "fist")
    with pytest.raises(ValueError, match=r"CHRONICALS_AUTOTUNE='fist': use 'all' .* or 'first'"):
        _triton_utils.tune_configs(configs)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_hidden_size_is_a_clear_error(impl):
    with pytest.raises(ValueError, match=r"H >= 1"):
        rms_norm(torch.randn(3, 0, device=DEV), torch.randn(0, device=DEV), 1e-6, impl=impl)
    with pytest.raises(ValueError, match=r"H >= 1"):
        linear_cross_entropy(torch.randn(3, 0, device=DEV), torch.randn(7, 0, device=DEV),
                             torch.zeros(3, dtype=torch.long, device=DEV), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_dtypes_are_one_floating_dtype(impl):
    with pytest.raises(TypeError, match=r"q, k and v must share one floating dtype"):
        ops.attention(t(1, 3, 2, 8), t(1, 3, 2, 8), t(1, 3, 2, 8, dtype=torch.float64), impl=impl)
    with pytest.raises(TypeError, match=r"q, k and v must share one floating dtype"):
        ops.attention(*(torch.ones(1, 3, 2, 8, dtype=torch.long, device=DEV),) * 3, impl=impl)


def test_dropout_refuses_what_it_cannot_do():
    """dropped(impl='triton') returned a tensor without grad_fn for an x that requires grad (impl='torch' keeps
    the graph): the gradient was silently cut. A 0-d x raised a bare IndexError."""
    from chronicals.ops import dropout

    d = dropout.draw(0.5, torch.device(DEV))
    x = t(4, 8).requires_grad_()
    if "triton" in IMPLS:
        with pytest.raises(ValueError, match=r"builds no autograd graph"):
            dropout.dropped(x, d, impl="triton")
        with torch.no_grad():
            assert dropout.dropped(x, d, impl="triton").shape == (4, 8)
    assert dropout.dropped(x, d, impl="torch").grad_fn is not None
    with pytest.raises(ValueError, match=r"0-d tensor"):
        dropout.dropped(torch.tensor(1.0, device=DEV), d, impl="torch")


@pytest.mark.skipif(DEV != "cuda", reason="the packed path's FlashAttention-2 kernels run on CUDA")
@pytest.mark.parametrize("d", [68, 288])
def test_packed_cuda_attention_names_its_head_dim_limits(d):
    """FA2 said 'head_size must be a multiple of 8, this is ensured by padding!' (nothing pads) for 68, and its own
    limit for 288; the same shapes work unpacked and under impl='torch'."""
    q = t(1, 4, 2, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=rf"multiple of 8 and at most 256 \(got {d}\); pass impl='torch'"):
        ops.attention(q, q, q, cu_seqlens=cu, max_seqlen=2, impl="triton", varlen="flash")
    assert ops.attention(q, q, q, cu_seqlens=cu, max_seqlen=2, impl="torch").shape == q.shape


@pytest.mark.parametrize("d", [12, 68])
def test_the_varlen_flash_door_names_its_head_dim_limit_before_any_kernel(d):
    """attention_varlen_flash refuses a head dim that is not a multiple of 8 before calling FA2 (whose own error says
    'ensured by padding!', and nothing pads). Checked on any device: the test above needs CUDA."""
    att = importlib.import_module("chronicals.ops.attention")  # the package attribute of that name is the function
    q = t(1, 4, 2, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=rf"multiple of 8 and at most 256 \(got {d}\)"):
        att.attention_varlen_flash(q, q, q, cu, max_seqlen=2)


@pytest.mark.skipif(DEV != "cuda", reason="the packed path's varlen kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_cuda_attention_in_float32_or_64_runs_the_masked_reference(dtype):
    """model.dtype=float32 on CUDA crashed every training step (exit 4): FA2's varlen kernels take bf16/fp16 only.
    Such rows run the masked SDPA reference now (logged once)."""
    q, k, v = (t(2, 6, 2, 8, dtype=dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32, device=DEV)
    got = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=4, impl="triton")
    want = ops.attention_ref(q, k, v, cu_seqlens=cu)
    assert torch.equal(got, want)


def test_auto_is_triton_on_cuda_and_torch_elsewhere(monkeypatch):
    """The choice is host logic (no GPU needed to check it): "auto" -> "triton" for a cuda device, "torch" for the
    cpu; explicit choices pass through; without a device "auto" is only validated."""
    from chronicals.ops import _impl

    monkeypatch.setattr(_impl, "_logged", set())
    cuda = torch.device("cuda")
    assert _impl.check_impl("linear_cross_entropy", "auto", cuda) == "triton"
    assert _impl.resolve_impl("linear_cross_entropy", "auto", cuda) == "triton"
    assert _impl.check_impl("linear_cross_entropy", "torch", cuda) == "torch"
    assert _impl.check_impl("linear_cross_entropy", "auto", torch.device("cpu")) == "torch"
    assert _impl.check_impl("linear_cross_entropy", "auto", torch.device("meta")) == "torch"  # not CUDA: torch
    assert _impl.check_impl("linear_cross_entropy", "auto") == "auto"
    # the interpreter is for CPU tensors only: "triton" on a cuda device needs no TRITON_INTERPRET
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _impl.check_impl("linear_cross_entropy", "triton", cuda) == "triton"
    assert _impl.check_impl("linear_cross_entropy", "auto", cuda) == "triton"
    # ... and without the interpreter "triton" is refused on every device that is not CUDA, not only the cpu
    with pytest.raises(ValueError, match=r"impl='triton' needs a CUDA tensor \(got meta\)"):
        _impl.check_impl("linear_cross_entropy", "triton", torch.device("meta"))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("On", True), ("yes", True), ("Y", True),
                                       ("0", False), ("false", False), ("", False), (" 1", False), ("2", False)])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value, on):
    """TRITON_INTERPRET=true (or on, yes, any case) runs Triton's interpreter, as =1 does: impl="triton" on a CPU
    tensor is accepted then, and refused with the fix when it is off. Reading "1" alone refused it under =true,
    telling the user to set what was set. Triton's own reading (triton.knobs) is the reference."""
    from triton import knobs

    from chronicals.ops import _impl

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert bool(knobs.runtime.interpret) is on
    assert triton_interpreting() is on
    if on:
        assert _impl.check_impl("rms_norm", "triton", torch.device("cpu")) == "triton"
    else:
        with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
            _impl.check_impl("rms_norm", "triton", torch.device("cpu"))


def test_the_choice_is_logged_once_per_op_impl_and_device(monkeypatch, caplog):
    """One line per (op, impl, device type), not one per call (every step of training); it names the result."""
    import logging

    from chronicals.ops import _impl

    monkeypatch.setattr(_impl, "_logged", set())
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="chronicals.ops"):
        for _ in range(3):
            assert _impl.resolve_impl("walk_op", "auto", cpu) == "torch"
        _impl.resolve_impl("walk_op", "torch", cpu)
        _impl.resolve_impl("walk_op", "auto", torch.device("cuda"))  # host logic: no GPU needed
    lines = [r.getMessage() for r in caplog.records if r.name == "chronicals.ops"]
    assert lines == ["walk_op: impl=auto resolved to torch on cpu", "walk_op: impl=torch resolved to torch on cpu",
                     "walk_op: impl=auto resolved to triton on cuda"]
