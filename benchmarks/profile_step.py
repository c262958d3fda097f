"""Where a training step's time goes: torch.profiler over our full and LoRA steps at a protocol shape.

Prints, per method, the step time, the GPU-busy time (sum of kernel times: well under the step time
means the step is launch/CPU bound) and the top kernels by GPU time, grouped into op families.

    PYTHONPATH=src python benchmarks/profile_step.py --shape 0.5b --out DIR
    PYTHONPATH=src python benchmarks/profile_step.py --graphs --out DIR   # each method eager, then CUDA graphs

With --graphs the graphed step (train.graphs.GraphedStep) is first checked against the eager one on the
same weights and batch (loss and gradients), then profiled; a closing table compares step vs GPU-busy time.

Eager runs also list every GEMM op by input shapes (``gemm_calls``): which projection each cuBLAS kernel serves.

Each method also gets "where the time goes" (chronicals.bench.floors): every family's kernel time against
its floor at the bf16 matmul rate and copy bandwidth measured at the start of the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from chronicals.bench.contenders import add_chronicals_lora, build_chronicals_model, rows_as_packed_batch
from chronicals.bench.floors import step_floors_ms, where_time_goes
from chronicals.bench.protocol import RunSpec
from chronicals.bench.shapes import get_shape, model_config
from chronicals.train.metrics import matmul_peak_tflops
from chronicals.train.graphs import GraphedStep
from chronicals.train.step import accumulate_gradients

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also when imported by a test
from common import require_cuda, wall_seconds_per_call  # noqa: E402

# ops.lowrank's rank-r updates are adapter GEMM work, whose FLOPs the gemm floor counts; cuDNN's attention backward
# runs helper kernels (compute_dot_do_o, convert_dq_to_16bits) named only "cudnn::fusion": both were "other"
FAMILIES = [("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "_lowrank_update")),
            ("flash/attn", ("flash", "fmha", "attn", "cudnn::fusion")),
            ("rms_norm", ("_rms_norm",)), ("swiglu", ("_swiglu",)), ("rope", ("_rope",)),
            ("linear CE", ("_lce", "_dw_accumulate", "_scale_kernel", "_dh_finish")), ("adam", ("adam",)),
            ("lora", ("lora",)),
            ("elementwise/copy", ("elementwise", "vectorized", "copy", "fill", "reduce"))]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def device_us(evt, children: bool = False) -> float:
    """An event's own device time; ``children``: with its child ops' kernels too (a GEMM op launches cuBLAS's)."""
    attrs = ("device_time_total", "cuda_time_total") if children else ("self_device_time_total", "self_cuda_time_total")
    for attr in attrs:
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_")


def gemm_calls(prof, steps: int, peak_tflops: float, time_us=None, top: int = 30) -> list[dict]:
    """Every GEMM op of an eager profile by input shapes: ms and calls per step, TFLOP/s and % of the measured peak.

    The kernel table names cuBLAS kernels, not what they compute (which projection a 45 us split-K kernel serves
    was a guess from call counts in session 14); this says it. Needs ``record_shapes=True``; a replayed CUDA graph's
    kernels belong to no op, so graphed runs have no rows."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        # mm(a, b[, out]), addmm(c, a, b[, out]) with the scalars (empty shapes) dropped: a and b sit after c,
        # not last (taking the last two read mm's out= as b: the loss head's logits GEMM showed 18,454% of peak)
        shapes = [list(s) for s in (e.input_shapes or []) if s]
        first = 0 if e.key == "aten::mm" else 1
        if e.key not in GEMM_OPS or len(shapes) < first + 2:
            continue
        a, b = shapes[first], shapes[first + 1]
        if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            continue
        us = time_us(e) if time_us else device_us(e, children=True)
        if us <= 0:
            continue
        (m, k), n = a, b[1]
        tflops = 2 * m * k * n * e.count / (us * 1e-6) / 1e12
        rows.append({"op": e.key, "shapes": shapes, "mkn": [m, k, n], "calls_per_step": e.count // steps,
                     "ms_per_step": round(us / steps / 1e3, 3), "us_per_call": round(us / e.count, 1),
                     "tflops": round(tflops, 1), "pct_of_peak": round(100 * tflops / peak_tflops, 1)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def check_graphed(model, batch, dev, graphed) -> dict:
    """Gradients of one graphed step vs one eager step on the same weights and batch (no optimizer step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss_e = accumulate_gradients(model, [batch], dev)[0].float()
    ref = [p.grad.detach().float().clone() for p in params]
    for p in params:
        p.grad = None
    loss_g = accumulate_gradients(model, [batch], dev, graphed)[0].float()
    num = sum(float((p.grad.float() - r).norm()) ** 2 for p, r in zip(params, ref)) ** 0.5
    den = sum(float(r.norm()) ** 2 for r in ref) ** 0.5
    for p in params:
        p.grad = None
    out = {"loss_eager": float(loss_e), "loss_graphed": float(loss_g), "grad_rel_err": num / max(den, 1e-30)}
    if abs(out["loss_eager"] - out["loss_graphed"]) > 1e-3 * abs(out["loss_eager"]) or out["grad_rel_err"] > 2e-2:
        raise SystemExit(f"graphed step disagrees with the eager step: {out}")
    return out


def copy_bandwidth_tb_s(nbytes: int = 2**30) -> float:
    """Device-to-device copy rate in TB/s, bytes read + written (1 GiB source: ~20x the H200's L2)."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * nbytes / ms / 1e9


def model_and_groups(method: str, shape_name: str, dev: torch.device):
    """The bench's model of ``shape_name`` on ``dev`` and its optimizer groups: LoRA through the bench's own spec
    (rank, alpha and the protocol's LoRA+ lr, as its contenders read them), or every parameter."""
    model = build_chronicals_model(get_shape(shape_name), dev, "auto", seed=0)
    if method == "lora":
        return model, add_chronicals_lora(model, RunSpec("chronicals-lora", shape=shape_name))
    return model, [{"params": [p for p in model.parameters() if p.requires_grad]}]


def profile(method: str, shape_name: str, steps: int, graphs: bool = False, ceilings=None) -> dict:
    shape = get_shape(shape_name)
    dev = torch.device("cuda")
    model, groups = model_and_groups(method, shape_name, dev)
    opt = torch.optim.AdamW(groups, lr=1e-5, fused=True)
    ids = torch.randint(0, shape.hf_config["vocab_size"], (shape.rows, shape.seq), device=dev)
    batch = rows_as_packed_batch(ids, "rows")
    graphed, check = None, None
    if graphs:
        graphed = GraphedStep(model, dev)
        check = check_graphed(model, batch, dev, graphed)  # also captures the graph (warm-up + capture)

    def step():
        accumulate_gradients(model, [batch], dev, graphed)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_ms = wall_seconds_per_call(step, steps, warmup=3) * 1e3
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=not graphs) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    # "Optimizer.step#AdamW.step" and other record_function ranges show up as CUDA events spanning their kernels:
    # counting them would count those kernels twice (2.9 ms of "adam" in the full step at a871e6d)
    kernels = [e for e in prof.key_averages() if device_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and "#" not in e.key]
    busy = sum(device_us(e) for e in kernels) / steps / 1e3
    fams: dict[str, float] = defaultdict(float)
    for e in kernels:
        fams[family(e.key)] += device_us(e) / steps / 1e3
    top = sorted(kernels, key=device_us, reverse=True)[:25]
    out = {"method": method + ("+graphs" if graphs else ""), "shape": shape_name, "check": check, "step_ms": round(step_ms, 2), "gpu_busy_ms": round(busy, 2),
           "families_ms": {k: round(v, 2) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
           "top_kernels": [{"name": e.key[:110], "ms_per_step": round(device_us(e) / steps / 1e3, 3),
                            "calls_per_step": e.count // steps} for e in top],
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           # every kernel of the two families with no floor, however small: what "other" holds (1.7 ms at 0.5B
           # LoRA in session 59's profile, beyond cuDNN's helpers, was named by no top-25 row)
           "unfloored_kernels": [{"name": e.key[:110], "family": family(e.key),
                                  "ms_per_step": round(device_us(e) / steps / 1e3, 3),
                                  "calls_per_step": e.count // steps}
                                 for e in sorted(kernels, key=device_us, reverse=True)
                                 if family(e.key) in ("other", "elementwise/copy")]}
    if ceilings and not graphs:
        out["gemm_calls"] = gemm_calls(prof, steps, ceilings[0])
    if ceilings:
        floors = step_floors_ms(model_config(shape), shape.rows, shape.seq, method, *ceilings)
        # loss tokens, as every tokens/s here (all tokens read 0.1% high; a bench walk)
        out["where_time_goes"] = where_time_goes(out["families_ms"], floors, shape.rows * (shape.seq - 1))
    del model, opt
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--methods", default="full,lora")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--graphs", action="store_true", help="each method eager, then as replayed CUDA graphs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)
    peak, copy = matmul_peak_tflops(torch.device("cuda")), copy_bandwidth_tb_s()
    print(f"ceilings: bf16 matmul {peak:.0f} TFLOP/s, copy {copy:.2f} TB/s")
    results = []
    runs = [(m, g) for m in args.methods.split(",") for g in ((False, True) if args.graphs else (False,))]
    for m, g in runs:
        r = profile(m, args.shape, args.steps, graphs=g, ceilings=(peak, copy))
        r["ceilings"] = {"matmul_tflops": round(peak, 1), "copy_tb_s": round(copy, 3)}
        results.append(r)
        m = r["method"]
        if r["check"]:
            print(f"\n{m}: graphed vs eager loss {r['check']['loss_graphed']:.5f} vs {r['check']['loss_eager']:.5f}, "
                  f"gradient rel. error {r['check']['grad_rel_err']:.2e}")
        print(f"\n== {m} @ {args.shape}: step {r['step_ms']} ms, GPU busy {r['gpu_busy_ms']} ms, peak {r['peak_gib']} GiB")
        for k, v in r["families_ms"].items():
            print(f"   {k:18s} {v:8.2f} ms")
        for k in r["top_kernels"][:15]:
            print(f"   {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4d} {k['name']}")
        print("   kernels of no floored family (other, elementwise/copy):")
        for k in r["unfloored_kernels"][:20]:
            print(f"   {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4d} {k['name']}")
        if r.get("gemm_calls"):
            print("   GEMM calls by shape (ms/step, calls/step, us/call, % of the matmul peak):")
            for g in r["gemm_calls"][:20]:
                print(f"   {g['ms_per_step']:8.3f} ms  x{g['calls_per_step']:<4d} {g['us_per_call']:8.1f} us "
                      f"{g['pct_of_peak']:5.1f}%  {g['op']} {g['shapes']}")
        w = r["where_time_goes"]
        print(f"   where the time goes (kernel ms: measured / floor / gap), sum {w['measured_ms']} / {w['floor_ms']}: "
              f"{w['tokens_per_s_at_measured_kernels']:,} vs {w['tokens_per_s_at_floor']:,} tokens/s")
        for f in w["families"]:
            print(f"   {f['family']:18s} {f['measured_ms']:8.2f} {f['floor_ms']:8.2f} {f['gap_ms']:8.2f}")
    print(f"\n{'method':14s} {'step ms':>8s} {'GPU busy ms':>12s} {'host-bound ms':>14s} {'peak GiB':>9s}")
    for r in results:  # GPU busy from the profiler's kernel records; graph-replayed kernels are included by CUPTI
        print(f"{r['method']:14s} {r['step_ms']:8.2f} {r['gpu_busy_ms']:12.2f} "
              f"{r['step_ms'] - r['gpu_busy_ms']:14.2f} {r['peak_gib']:9.2f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_{args.shape}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
