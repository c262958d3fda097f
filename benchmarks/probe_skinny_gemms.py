"""Probe (dev): the LoRA step's skinny GEMMs (one side r or R = 32..96 wide) as the code calls them, against the same
product asked of cuBLAS the other way round (C^T = B^T A^T: another kernel choice, same math), beside the time their
bytes take at the measured copy bandwidth. cuBLAS picks its kernel by shape and layout; a split-K kernel for
(r x N) @ (N x I) ran at 10-12% of the matmul peak in the H100 profiles (70.9 us for 159 MB of input at 0.5B).

    dA   = (s dy B)^T x          (r, N) @ (N, in)     down_proj: x = act (N, I); a group: x a row-strided view
    dB   = s dy^T (x A^T)         (out, N) @ (N, r)
    xA   = x A^T                  (N, in) @ (in, R)    a group's forward, x row-strided (the norm's buffer)
    acc  = y += (N, r) @ (r, out)                      o_proj's forward, a group's dx

Prints microseconds per call (median of CUDA-event timings) and writes them as JSON.

    PYTHONPATH=src python benchmarks/probe_skinny_gemms.py [OUT.json]
"""
import json
import sys

import torch

from common import copy_bandwidth_gbs, do_bench, require_cuda

require_cuda(__file__)
dev, bf = "cuda", torch.bfloat16


def us(fn):
    return round(do_bench(fn, warmup_ms=25, rep_ms=150) * 1e3, 1)


def rnd(*shape, g):
    return torch.randn(*shape, device=dev, dtype=bf, generator=g)


def case(name, n, fin, fout, r, strided_x, gbs):
    """One projection's skinny GEMMs. strided_x: x is the first fin columns of an (n, fin + r) buffer."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = rnd(n, fin + r, g=g)[:, :fin] if strided_x else rnd(n, fin, g=g)
    dyb = rnd(n, fin + r, g=g)[:, fin:] if strided_x else rnd(n, r, g=g)  # a group's dyb: columns of dy @ M
    dy, xa, a, b = rnd(n, fout, g=g), rnd(n, r, g=g), rnd(r, fin, g=g), rnd(fout, r, g=g)
    y = rnd(n, fout, g=g)
    floor = lambda nbytes: round(nbytes / gbs / 1e3, 1)  # us at copy bandwidth
    e = 2
    row = {"case": name, "n": n, "in": fin, "out": fout, "r": r, "x_row_stride": x.stride(0)}
    row["dA"], row["dA_flipped"] = us(lambda: torch.mm(dyb.t(), x)), us(lambda: torch.mm(x.t(), dyb).t())
    row["dA_floor"] = floor(e * (n * fin + n * r))
    row["dB"], row["dB_flipped"] = us(lambda: torch.mm(dy.t(), xa)), us(lambda: torch.mm(xa.t(), dy).t())
    row["dB_floor"] = floor(e * (n * fout + n * r))
    row["xA"], row["xA_flipped"] = us(lambda: torch.mm(x, a.t())), us(lambda: torch.mm(a, x.t()).t())
    row["xA_floor"] = floor(e * (n * fin + n * r))
    row["acc"] = us(lambda: y.addmm_(xa, b.t()))
    row["acc_floor"] = floor(e * 2 * n * fout)
    # the flipped products agree with the direct ones up to summation order
    d1, d2 = torch.mm(dyb.t(), x).float(), torch.mm(x.t(), dyb).t().float()
    row["dA_rel_diff"] = float((d1 - d2).norm() / d1.norm())
    return row


def main():
    gbs = copy_bandwidth_gbs()
    rows = [
        case("0.5b down (act)", 16384, 4864, 896, 32, False, gbs),
        case("0.5b q/k/v group", 16384, 896, 1152, 96, True, gbs),
        case("0.5b gate/up group", 16384, 896, 9728, 64, True, gbs),
        case("0.5b o_proj", 16384, 896, 896, 32, False, gbs),
        case("8b down (act)", 8192, 14336, 4096, 32, False, gbs),
        case("8b q/k/v group", 8192, 4096, 6144, 96, True, gbs),
        case("8b gate/up group", 8192, 4096, 28672, 64, True, gbs),
        case("8b o_proj", 8192, 4096, 4096, 32, False, gbs),
    ]
    keys = ["dA", "dA_flipped", "dA_floor", "dB", "dB_flipped", "dB_floor", "xA", "xA_flipped", "xA_floor", "acc",
            "acc_floor"]
    print(f"copy bandwidth {gbs:.0f} GB/s; us per call")
    print(f"{'case':22s} " + " ".join(f"{k:>10s}" for k in keys))
    for r in rows:
        print(f"{r['case']:22s} " + " ".join(f"{r[k]:10.1f}" for k in keys))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": gbs, "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
