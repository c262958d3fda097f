"""Does the loss head's row kernel hide behind its GEMMs when each row chunk is split in sub-chunks on two streams?

With a weight gradient the head runs, per chunk of C rows (1,792 at Qwen2.5-0.5B): logits GEMM -> row kernel
(memory-bound, ~3 x C x V x 2 B) -> dH GEMM -> dW GEMM, one after the other. Split in S sub-chunks on two CUDA
streams, staggered by one logits GEMM, sub-chunk j's row kernel runs beside sub-chunk j+1's logits GEMM and
sub-chunk j-1's dH GEMM; dW stays one GEMM over the whole chunk (K = C: the fp32 accumulator's traffic does not
grow) on the main stream. No memory is added: the sub-chunks are row blocks of the same workspace.

The variant replaces ``cross_entropy.linear_ce_chunked`` in this process for the cases it covers (CUDA, a weight
gradient, one vocabulary part, several chunks, no bias, lse computed here); anything else runs the library's.

    PYTHONPATH=src python3 benchmarks/probe_lce_overlap.py head              # head alone: ms and differences
    PYTHONPATH=src python3 benchmarks/probe_lce_overlap.py step --subs 2     # one bench row with the variant
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from chronicals.ops import cross_entropy as ce
from chronicals.ops._linear_ce_kernels import dw_accumulate, lce_rows

ORIGINAL = ce.linear_ce_chunked
_SIDE: dict = {}


def overlapped(subs: int, cuda_only: bool = True):
    def chunked(hidden, weight, labels, bias, scale, lse_in, *, ignore_index, softcap, need_dh, need_dw, need_db,
                chunk_rows, vocab_parts=1):
        n, h = hidden.shape
        v = weight.shape[0]
        c = max(1, min(n, chunk_rows))
        covered = need_dw and need_dh and not need_db and bias is None and vocab_parts == 1 and lse_in is None
        if not ((hidden.is_cuda or not cuda_only) and covered and n > c and subs > 1):
            return ORIGINAL(hidden, weight, labels, bias, scale, lse_in, ignore_index=ignore_index, softcap=softcap,
                            need_dh=need_dh, need_dw=need_dw, need_db=need_db, chunk_rows=chunk_rows,
                            vocab_parts=vocab_parts)
        dev, dt = hidden.device, hidden.dtype
        loss_rows = torch.empty(n, device=dev, dtype=torch.float32)
        lse = torch.empty(n, device=dev, dtype=torch.float32)
        dh = torch.empty((n, h), device=dev, dtype=dt)
        ws = torch.empty(max(c * v, v * h), device=dev, dtype=dt)
        dw32 = torch.zeros((v, h), device=dev, dtype=torch.float32)
        main = torch.cuda.current_stream()
        side = _SIDE.setdefault(dev, [torch.cuda.Stream(dev), torch.cuda.Stream(dev)])  # made before any capture
        for r0 in range(0, n, c):
            rows = min(c, n - r0)
            x = hidden[r0:r0 + rows]
            buf = ws[:rows * v].view(rows, v)
            step = -(-rows // subs)
            step += -step % 8  # 16-byte aligned row blocks
            prev = None
            for j, a in enumerate(range(0, rows, step)):
                b = min(rows, a + step)
                s = side[j % 2]
                s.wait_stream(main) if prev is None else s.wait_event(prev)
                with torch.cuda.stream(s):
                    torch.mm(x[a:b], weight.t(), out=buf[a:b])
                    prev = torch.cuda.Event()
                    prev.record(s)
                    lce_rows(buf[a:b], labels, r0 + a, None, scale, loss_rows, lse, ignore_index=ignore_index,
                             softcap=softcap, compute_lse=True, write_grad=True)
                    torch.mm(buf[a:b], weight, out=dh[r0 + a:r0 + b])
            for s in side:
                main.wait_stream(s)
            dw_accumulate(buf, x, dw32)
        dw = ws[:v * h].view(v, h)
        dw.copy_(dw32)
        return loss_rows, lse, dh, dw, torch.empty(0, device=dev, dtype=dt)

    return chunked


def head(args) -> dict:
    from common import do_bench

    torch.manual_seed(0)
    n, h, v = args.n, args.h, args.v
    x = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    y[::7] = -100

    def run():
        x.grad = w.grad = None
        loss = ce.linear_cross_entropy(x, w, y, impl="triton")
        loss.backward()
        return loss

    out = {}
    ref = None
    for name, fn in [("library", ORIGINAL)] + [(f"subs{s}", overlapped(s)) for s in args.subs_list]:
        ce.linear_ce_chunked = fn
        loss = run()
        got = (loss.detach().clone(), x.grad.clone(), w.grad.clone())
        if ref is None:
            ref = got
        diff = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = do_bench(run, warmup_ms=100, rep_ms=1000)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        out[name] = {"ms": round(ms, 3), "extra_peak_gib": round(peak, 3), "max_diff_loss_dx_dw": diff}
        print(name, json.dumps(out[name]), flush=True)
    ce.linear_ce_chunked = ORIGINAL
    return out


def step(args) -> dict:
    from chronicals.bench.protocol import RunSpec
    from chronicals.bench.worker import run_contender

    if args.subs > 1:
        ce.linear_ce_chunked = overlapped(args.subs)
    row = run_contender(RunSpec(args.contender, shape="0.5b", warmup=args.warmup, steps=args.steps, device="cuda"))
    losses = row.get("losses") or [None]
    keep = ("contender", "status", "reason", "tokens_per_s", "step_ms", "peak_gib", "min_grad_norm")
    out = {**{k: row.get(k) for k in keep}, "subs": args.subs, "loss_first": losses[0], "loss_last": losses[-1]}
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    from common import require_cuda

    require_cuda(__file__)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["head", "step"])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--h", type=int, default=896)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--subs-list", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--subs", type=int, default=2, help="step: 1 runs the library's head")
    ap.add_argument("--contender", default="chronicals-full-graphs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    (head if args.what == "head" else step)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
