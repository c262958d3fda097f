"""Burst against sustained bf16 GEMM rate: how much the card's power cap takes from a GEMM that runs for seconds.

The bench's matmul peak is a short burst (`chronicals.train.metrics.matmul_peak_tflops`: do_bench's 100 ms of
warm-up and 300 ms of 8192^3 GEMMs, the L2 flushed between them). A graphed training
step keeps the GPU busy without gaps, and on an H100 80GB (700 W limit) it ran into the SW power cap (throttle
reason 0x4) with the SM clock at 1,515-1,965 MHz instead of 1,980 (session 56): the step's GEMMs took 3-5% longer
graphed than eager, same kernels. This prints, per shape, the rate in each second of an 8-second back-to-back
loop; watch `nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 500`
beside it.

    python3 benchmarks/probe_power_cap.py
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda  # noqa: E402

# the square shape of the bench's peak, then the 0.5B MLP's gate/up forward (K = H) and down forward (K = I)
SHAPES = [(8192, 8192, 8192), (16384, 4864, 896), (16384, 896, 4864)]


def rates(m, n, k, seconds):
    """TFLOP/s of (m, k) @ (k, n) bf16 in each ~1 s window of a loop of `seconds`."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    out, t0 = [], time.perf_counter()
    win, calls = t0, 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        calls += 20
        now = time.perf_counter()
        if now - win > 1.0:
            out.append(2 * m * n * k * calls / (now - win) / 1e12)
            win, calls = now, 0
    return out


def main():
    require_cuda(__file__)
    print(torch.cuda.get_device_name(), flush=True)
    for shape in SHAPES:
        print(shape, "TFLOP/s per second:", " ".join(f"{x:.0f}" for x in rates(*shape, 8.0)), flush=True)
        time.sleep(3)  # let the clock recover between shapes


if __name__ == "__main__":
    main()
