"""profile_step's GEMM table names each call's (M, K) x (K, N) right, on CPU ops (no GPU: CPU times)."""

import importlib.util
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_SPEC = importlib.util.spec_from_file_location(
    "profile_step", Path(__file__).resolve().parents[2] / "benchmarks" / "profile_step.py")
profile_step = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(profile_step)


def test_gemm_calls_reads_a_and_b_whatever_the_op_carries():
    a, b, c = torch.randn(7, 5), torch.randn(5, 3), torch.randn(3)
    out = torch.empty(7, 3)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(a, b)
        torch.mm(a, b, out=out)  # the loss head's logits GEMM writes into a chunk buffer like this
        torch.addmm(c, a, b)
        out.addmm_(a, b)
    rows = profile_step.gemm_calls(prof, steps=1, peak_tflops=1.0, time_us=lambda e: max(e.cpu_time_total, 1.0))
    assert {r["op"] for r in rows} == {"aten::mm", "aten::addmm", "aten::addmm_"}
    # (M, K, N) = (7, 5, 3) for all four; taking the last two shapes read mm's out= as b: (K, N) = (3, 3)
    assert [r["mkn"] for r in rows] == [[7, 5, 3]] * 4, rows
    assert [r["calls_per_step"] for r in rows] == [1] * 4  # mm(a, b) and mm(a, b, out=) are two shape groups


def test_the_profiled_lora_model_is_the_bench_contenders():
    """profile_step's LoRA row built its adapters from a stand-in settings class that lacked the `lr` the bench's
    add_chronicals_lora reads since the lr flag came in (AttributeError on the GPU, session 56). It now takes the
    bench's own RunSpec: the protocol's rank and LoRA+ groups (B at 16 x the lr of A)."""
    from chronicals.bench.protocol import LORA_PLUS_RATIO, LORA_R, LR_LORA

    model, groups = profile_step.model_and_groups("lora", "tiny", torch.device("cpu"))
    a = [m for n, m in model.named_parameters() if n.endswith("lora_A.weight")]
    assert a and all(t.shape[0] == LORA_R for t in a)
    assert sorted({g["lr"] for g in groups if g["params"]}) == [LR_LORA, LR_LORA * LORA_PLUS_RATIO]
    model, groups = profile_step.model_and_groups("full", "tiny", torch.device("cpu"))
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_kernel_families_take_the_low_rank_updates_and_cudnns_attention_helpers():
    """The 8B LoRA profile put 12.8 ms a step in "other" (floor 0): 6.8 of ops.lowrank's updates (adapter GEMM work)
    and 5.4 of cuDNN's attention backward helpers."""
    assert profile_step.family("_lowrank_update_kernel") == "gemm"
    assert profile_step.family("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)") == "flash/attn"
    assert profile_step.family("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)") == "flash/attn"
    assert profile_step.family("_swiglu_gate_up_bwd_inplace_kernel") == "swiglu"
    assert profile_step.family("some_unknown_kernel") == "other"
