"""The GPU-only scripts under benchmarks/ say so in one line on a machine without CUDA (several raised raw CUDA
tracebacks: "Torch not compiled with CUDA enabled", "Cannot get CUDA generator", an IndexError on sys.argv)."""

import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
# script -> arguments a user would give it (each script's own usage)
SCRIPTS = {
    "ab_lce_heads.py": ["--tag", "x"], "bench_checkpoint.py": [], "bench_generate_adapter_dtype.py": [],
    "check_lora_dropout_cuda.py": [], "probe_attention_cudnn.py": ["out.json"],
    "probe_attention_cudnn_fe.py": ["out.json"], "probe_cudnn_plans.py": [], "probe_gemm_swiglu.py": ["out.json"],
    "probe_lce_overlap.py": ["head"], "probe_lce_rows.py": [], "probe_lora_small_gemms.py": ["out.json"],
    "probe_step_memory.py": [], "probe_power_cap.py": [], "probe_lora_stacked_out.py": [],
    "profile_step.py": [], "bench_attention.py": [], "bench_rope.py": [], "bench_swiglu.py": [],
    "run_cuda_mutants.py": ["spec.json"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_gpu_script_on_a_cpu_machine_exits_with_one_line(script, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing written where the test runs from
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *SCRIPTS[script]])
    monkeypatch.syspath_prepend(str(BENCH))  # as `python benchmarks/x.py` puts the script's folder first
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert isinstance(e.value.code, str) and "needs a CUDA GPU" in e.value.code, e.value.code
    assert list(tmp_path.iterdir()) == []


def test_a_probe_without_its_output_argument_says_its_usage(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH / "probe_lora_small_gemms.py")])
    monkeypatch.syspath_prepend(str(BENCH))
    with pytest.raises(SystemExit, match=r"usage: python benchmarks/probe_lora_small_gemms.py OUT.json"):
        runpy.run_path(str(BENCH / "probe_lora_small_gemms.py"), run_name="__main__")


def test_bench_lora_smoke_writes_its_made_up_numbers_outside_the_results(monkeypatch, tmp_path):
    """bench_lora --smoke (a CPU dry run, MFU against a made-up 1 TFLOP/s peak) wrote its file into
    benchmarks/results beside the measured ones; without --out it goes to a temporary directory now."""
    import tempfile

    results = BENCH / "results"
    before = set(results.iterdir())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_lora.py"), "--smoke", "--no-variants"])
    monkeypatch.syspath_prepend(str(BENCH))
    runpy.run_path(str(BENCH / "bench_lora.py"), run_name="__main__")
    assert set(results.iterdir()) == before
    written = list(tmp_path.glob("bench_lora_smoke_*/bench_lora_smoke_*.json"))
    assert len(written) == 1, list(tmp_path.rglob("*"))
