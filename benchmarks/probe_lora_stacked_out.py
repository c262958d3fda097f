"""Probe (dev): a LoRA projection's x A^T made by the base GEMM itself, x @ [W ; A]^T (N = out + r), against the
separate skinny GEMM that reads x again, at the bench shapes. It decided LoRALinear's "rows" layout (8c5fab4): taken
for wide inputs (down_proj), not for o_proj, whose 8B GEMM lost more to the r extra columns than the skinny GEMM took
(results/logs/log_ab_rows_session57.txt).

    current: y = x W^T;  xa = x A^T;  y += s xa B^T               (x read twice: once per GEMM)
    stacked: [y | xa] = x [W ; A]^T;  xa copied out;  y += s xa B^T   (y a row-strided view, row stride out + r)

Also times the consumer of y (the fused residual-add RMSNorm) on the strided view against a contiguous y, and the
per-call [W ; A] cat a persistent buffer would save. Prints microseconds per call (median, CUDA events).

    PYTHONPATH=src python benchmarks/probe_lora_stacked_out.py [OUT.json]
"""
import json
import sys

import torch

from common import do_bench, require_cuda

require_cuda(__file__)
from chronicals.ops import rms_norm  # noqa: E402

dev, bf, R, S = "cuda", torch.bfloat16, 32, 2.0


def us(fn):
    return round(do_bench(fn, warmup_ms=25, rep_ms=150) * 1e3, 1)


def case(n, fin, fout):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, fin, device=dev, dtype=bf, generator=g)
    w = (torch.randn(fout, fin, device=dev, generator=g) * fin ** -0.5).to(bf)
    a = (torch.randn(R, fin, device=dev, generator=g) * fin ** -0.5).to(bf)
    b = (torch.randn(fout, R, device=dev, generator=g) * 0.1).to(bf)
    wa = torch.cat([w, a])  # the persistent buffer's contents
    res = torch.randn(n, fout, device=dev, dtype=bf, generator=g)
    nw = torch.ones(fout, device=dev, dtype=bf)

    def current():
        y = torch.mm(x, w.t())
        xa = torch.mm(x, a.t())
        return y.addmm_(xa, b.t(), alpha=S), xa

    def stacked():
        ye = torch.mm(x, wa.t())
        xa = ye[:, fout:].contiguous()
        return ye[:, :fout].addmm_(xa, b.t(), alpha=S), xa

    y0, xa0 = current()
    y1, xa1 = stacked()
    row = {
        "current": us(current), "stacked": us(stacked),
        "mm x W^T": us(lambda: torch.mm(x, w.t())), "mm x [W;A]^T": us(lambda: torch.mm(x, wa.t())),
        "mm x A^T": us(lambda: torch.mm(x, a.t())),
        "addmm_ y contiguous": us(lambda: y0.addmm_(xa0, b.t(), alpha=0.0)),
        "addmm_ y strided": us(lambda: y1.addmm_(xa1, b.t(), alpha=0.0)),
        "norm(y + res) contiguous": us(lambda: rms_norm(y0, nw, 1e-6, residual=res, impl="triton")),
        "norm(y + res) strided": us(lambda: rms_norm(y1, nw, 1e-6, residual=res, impl="triton")),
        "cat [W;A] per call": us(lambda: torch.cat([w, a])),
        "y max rel diff": float((y1.float() - y0.float()).abs().max() / y0.float().abs().max()),
        "xa max rel diff": float((xa1.float() - xa0.float()).abs().max() / xa0.float().abs().max()),
        "y1 strides": list(y1.stride()),
    }
    return row


out = {}
for tag, n, h, i in (("0.5b", 16384, 896, 4864), ("8b", 8192, 4096, 14336)):
    for name, fin, fout in (("o_proj", h, h), ("down_proj", i, h)):
        row = case(n, fin, fout)
        out[f"{tag} {name}"] = row
        print(f"{tag} {name:9s} (N {n}, {fin} -> {fout}, r {R}): " + ", ".join(f"{k}: {v}" for k, v in row.items()),
              flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out}, f, indent=1)
