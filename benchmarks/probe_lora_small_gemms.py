"""Probe (dev): the LoRA backward's skinny K = N GEMMs (dA, dB) as called now vs alternatives (operands swapped, fp32
output, split-K bmm), and the loss head's forward vs backward memory per vocab_parts. Results: results/logs/log_lora_small_gemm_probe_*.

    PYTHONPATH=src python benchmarks/probe_lora_small_gemms.py OUT.json
"""
import json
import sys

import torch
from triton.testing import do_bench

from common import require_cuda

require_cuda(__file__, "OUT.json")
dev, bf = "cuda", torch.bfloat16

def variants(A, B):
    out = {"mm(A^T,B)": lambda: torch.mm(A.t(), B), "mm(B^T,A)^T": lambda: torch.mm(B.t(), A).t()}
    out["mm fp32 out"] = lambda: torch.mm(A.t(), B, out_dtype=torch.float32).to(bf)
    n = A.shape[0]
    for s in (8, 16, 32, 64):
        if n % s == 0:
            out[f"bmm split {s}"] = (lambda s_: lambda: torch.bmm(A.view(s_, n // s_, -1).transpose(1, 2),
                                                                   B.view(s_, n // s_, -1), out_dtype=torch.float32).sum(0).to(bf))(s)
    return out
res = {}
for tag, n, shapes in (("0.5b", 16384, [("dA qkv", 96, 896), ("dA gate_up", 64, 896), ("dA o", 32, 896), ("dA down", 32, 4864),
                                         ("dB q/o/down", 896, 32), ("dB k/v", 128, 32), ("dB gate/up", 4864, 32),
                                         ("dB qkv joint", 1152, 96), ("dB gate_up joint", 9728, 64)]),
                       ("8b", 8192, [("dA qkv", 96, 4096), ("dA gate_up", 64, 4096), ("dA o", 32, 4096), ("dA down", 32, 14336),
                                     ("dB q/o/down", 4096, 32), ("dB k/v", 1024, 32), ("dB gate/up", 14336, 32),
                                     ("dB qkv joint", 6144, 96), ("dB gate_up joint", 28672, 64)])):
    for name, m, k in shapes:
        A = torch.randn(n, m, device=dev, dtype=bf); B = torch.randn(n, k, device=dev, dtype=bf)
        ref = torch.mm(A.t().float(), B.float())
        row = {}
        for vn, fn in variants(A, B).items():
            try:
                err = float((fn().float() - ref).abs().max() / ref.abs().max())
                row[vn] = (round(do_bench(fn, warmup=10, rep=50) * 1e3, 1), round(err, 5))
            except Exception as e:
                row[vn] = str(e)[:80]
        res[f"{tag} {name} ({m}x{k}, K={n})"] = row
        print(f"{tag} {name:18s} {m}x{k} K={n}: " + ", ".join(f"{k_}: {v if isinstance(v, str) else v[0]} us" for k_, v in row.items()), flush=True)
# CE vocab_parts memory: peak in forward vs backward
from chronicals.ops import linear_cross_entropy
N, H, V = 16384, 896, 151936
x = torch.randn(N, H, device=dev, dtype=bf).requires_grad_(); w = (torch.randn(V, H, device=dev) * H ** -0.5).to(bf).requires_grad_()
y = torch.randint(0, V, (N,), device=dev)
for k in (1, 2, 4):
    for _ in range(2):
        torch.cuda.synchronize(); torch.cuda.empty_cache(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        loss = linear_cross_entropy(x, w, y, impl="triton", vocab_parts=k); torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base; after_fwd = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        gx, gw = torch.autograd.grad(loss, [x, w]); torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated() - base
        del loss, gx, gw
    print(f"CE vocab_parts {k}: forward peak {fwd / 2**30:.3f} GiB, held after forward {after_fwd / 2**30:.3f}, backward peak {bwd / 2**30:.3f}", flush=True)
    res[f"ce k={k}"] = [fwd, after_fwd, bwd]
json.dump(res, open(sys.argv[1], "w"), indent=1)
