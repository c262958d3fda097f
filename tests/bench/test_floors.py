"""The step-floor arithmetic behind profile_step's "where the time goes" (no GPU: numbers only)."""

import pytest

from chronicals.bench.floors import lora_adapter_flops_per_token, step_floors_ms, where_time_goes
from chronicals.bench.shapes import get_shape, model_config


def test_lora_adapter_flops_count_each_projection_by_hand():
    cfg = model_config(get_shape("0.5b"))  # hidden 896, q 896, kv 128, intermediate 4864, 24 layers
    per_layer = (896 + 896) + (896 + 128) * 2 + (896 + 896) + (896 + 4864) * 2 + (4864 + 896)
    assert lora_adapter_flops_per_token(cfg, 32) == 6 * 32 * per_layer * 24


def test_floors_at_the_protocol_shape():
    shape = get_shape("0.5b")
    cfg = model_config(shape)
    n = 16 * 1024
    full = step_floors_ms(cfg, 16, 1024, "full", peak_tflops=500.0, copy_tb_s=2.0)
    # 494.0M matmul parameters (357.8M in the layers + 136.1M lm_head), 6 FLOPs each per token
    assert full["gemm"] == pytest.approx(6 * 493_961_216 * n / 500e12 * 1e3)
    assert full["flash/attn"] == pytest.approx(3 * 4 * 1024 * 896 * 24 / 2 * n / 500e12 * 1e3)
    assert full["swiglu"] == pytest.approx(24 * 8 * n * 4864 * 2 / 2e12 * 1e3)
    assert full["rms_norm"] == pytest.approx(49 * 5 * n * 896 * 2 / 2e12 * 1e3)
    assert full["linear CE"] == pytest.approx(2 * n * 151936 * 2 / 2e12 * 1e3)
    assert full["adam"] == pytest.approx(7 * 493_961_216 * 2 / 2e12 * 1e3)
    lora = step_floors_ms(cfg, 16, 1024, "lora", peak_tflops=500.0, copy_tb_s=2.0)
    adapters = lora_adapter_flops_per_token(cfg, 32)
    assert lora["gemm"] == pytest.approx((4 * 493_961_216 + adapters) * n / 500e12 * 1e3)
    assert lora["adam"] == pytest.approx(7 * adapters / 6 * 2 / 2e12 * 1e3)
    assert lora["swiglu"] == full["swiglu"] and lora["flash/attn"] == full["flash/attn"]


def test_floors_refuse_an_unknown_method():
    with pytest.raises(ValueError, match="'full' or 'lora'"):
        step_floors_ms(model_config(get_shape("tiny")), 2, 32, "qlora", 100.0, 1.0)


def test_where_time_goes_sums_gaps_and_keeps_families_without_a_floor():
    out = where_time_goes({"gemm": 80.0, "swiglu": 9.0, "elementwise/copy": 3.0}, {"gemm": 70.0, "swiglu": 7.0, "rope": 1.0},
                          tokens=16384)
    rows = {r["family"]: r for r in out["families"]}
    assert rows["gemm"]["gap_ms"] == 10.0 and rows["elementwise/copy"]["floor_ms"] == 0.0
    assert rows["rope"]["measured_ms"] == 0.0 and rows["rope"]["gap_ms"] == -1.0
    assert [r["family"] for r in out["families"]][0] == "gemm"  # largest gap first
    assert out["measured_ms"] == 92.0 and out["floor_ms"] == 78.0
    assert out["tokens_per_s_at_floor"] == round(16384 / 78.0 * 1e3)
    assert out["tokens_per_s_at_measured_kernels"] == round(16384 / 92.0 * 1e3)
