"""Every execution plan cuDNN offers for our ragged attention graphs, timed, at the 0.5B and 8B protocol shapes.

``ops/attention_cudnn.py`` builds only the first plan of heuristics mode A (``build_plans()``' default policy).
In the 8B LoRA profile (a871e6d) the kernels it picks run the backward at ~383 TFLOP/s and the forward at ~434
(causal FLOPs), where FlashAttention-3-class kernels reach ~450 / ~560 on this chip. This probe asks modes A, B
and FALLBACK for their plans, builds all of them, checks every plan's outputs against plan 0's on the same inputs
(max abs difference of o, dq, dk, dv) and times each forward and backward plan with CUDA events.

Second part, for the fused q/k/v GEMM's bias gradient (``dy.sum(0)`` in F.linear's backward; ~0.8 ms a step in the
graphed 0.5B full profile, f619e17): the reduction against a GEMV on the same (16,384, 1,152) bf16 gradient, and
the weight concatenations ``models/fused_proj.py`` runs per layer.

    PYTHONPATH=src python3 benchmarks/probe_cudnn_plans.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import do_bench, markdown_table, require_cuda, write_results  # noqa: E402

from chronicals.ops import attention_cudnn as ac  # noqa: E402

SHAPES = [  # name, rows, seq, hq, hk, d, mean document (None: one per row)
    ("0.5b rows", 16, 1024, 14, 2, 64, None),
    ("0.5b chat", 16, 1024, 14, 2, 64, 420),
    ("8b rows", 4, 2048, 32, 8, 128, None),
]


def _finish_all(cudnn, g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)


def causal_flops(cu: torch.Tensor, hq: int, d: int) -> float:
    lens = (cu[1:] - cu[:-1]).double()
    return float((2 * 2 * hq * d * lens * (lens + 1) / 2).sum())  # QK^T and PV over the causal half


def cu_for(b, s, gen, mean):
    if mean is None:
        return torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    lens = []
    for _ in range(b):
        left = s
        while left > 0:
            n = min(left, max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=gen))))
            lens.append(n)
            left -= n
    return torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)


def probe_shape(name, b, s, hq, hk, d, mean):
    cudnn = ac.cudnn_frontend()
    gen = torch.Generator().manual_seed(0)
    cu = cu_for(b, s, gen, mean)
    docs = cu.numel() - 1
    max_seq = int((cu[1:] - cu[:-1]).max())
    t = b * s
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    cap, sb = ac.bucket(docs, ac.MIN_DOCS), ac.bucket(max_seq, ac.MIN_SEQ)
    saved = ac._finish
    ac._finish = _finish_all
    try:
        plan = ac._build(cudnn, ac._handle(cudnn, q.device), ac._dtype(cudnn, q.dtype), cap, sb, hq, hk, d, d ** -0.5, t)
    finally:
        ac._finish = saved
    meta = ac.ragged_meta(cu, cap, hq, hk, d)
    handle = ac._handle(cudnn, q.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    flops = causal_flops(cu, hq, d)
    rows = []
    for kind, graph, prefix in (("fwd", plan.fwd, "f_"), ("bwd", plan.bwd, "b_")):
        ref = None
        n = graph.get_execution_plan_count()
        for i in range(n):
            try:
                ws = torch.empty(max(graph.get_workspace_size_plan_at_index(i), 1), device="cuda", dtype=torch.uint8)
            except Exception as e:  # noqa: BLE001 (a plan that did not build)
                rows.append({"shape": name, "pass": kind, "plan": i, "name": f"not built: {e}"[:80]})
                continue
            o = torch.empty_like(q)
            stats = torch.empty(t, hq, 1, device="cuda", dtype=torch.float32)
            if kind == "fwd":
                bufs = {"q": q, "k": k, "v": v, "o": o, "stats": stats, **meta}
                outs = [o]
            else:  # the backward reads plan 0's forward outputs
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                bufs = {"q": q, "k": k, "v": v, "o": fwd_o, "dO": do, "stats": fwd_stats, "dq": dq, "dk": dk,
                        "dv": dv, **meta}
                outs = [dq, dk, dv]
            vp = {plan.t[prefix + key]: val for key, val in bufs.items()}

            def call(vp=vp, ws=ws, i=i, graph=graph):
                graph.execute_plan_at_index(vp, ws, i, handle=handle)

            call()
            torch.cuda.synchronize()
            got = [x.float().clone() for x in outs]
            if ref is None:
                ref = got
                if kind == "fwd":
                    fwd_o, fwd_stats = o, stats
            err = max(float((a - r).abs().max()) for a, r in zip(got, ref))
            ms = do_bench(call)
            work = flops * (2.5 if kind == "bwd" else 1.0)
            rows.append({"shape": name, "docs": docs, "pass": kind, "plan": i, "name": graph.get_plan_name_at_index(i),
                         "ms": round(ms, 4), "tflops": round(work / ms / 1e9, 1), "max_diff_vs_plan0": err})
            print(rows[-1], flush=True)
    return rows


def probe_bias(n: int = 16384):
    rows = []
    for cols in (1152, 896, 9728):
        dy = torch.randn(n, cols, device="cuda", dtype=torch.bfloat16)
        ones = torch.ones(n, device="cuda", dtype=torch.bfloat16)
        ref = dy.double().sum(0)
        for label, fn in (("dy.sum(0)", lambda: dy.sum(0)),
                          ("dy.sum(0, dtype=fp32)", lambda: dy.sum(0, dtype=torch.float32)),
                          ("torch.mv(dy.t(), ones)", lambda: torch.mv(dy.t(), ones)),
                          ("ones[None] @ dy", lambda: (ones[None] @ dy)[0])):
            err = float((fn().double() - ref).abs().max() / ref.abs().max())
            ms = do_bench(fn)
            rows.append({"op": label, "shape": f"({n}, {cols})", "us": round(ms * 1e3, 1),
                         "GB/s": round(n * cols * 2 / ms / 1e6), "rel_err": f"{err:.2e}"})
            print(rows[-1], flush=True)
    for label, parts in (("cat q/k/v weights", (896, 128, 128)), ("cat gate/up weights", (4864, 4864))):
        ws = [torch.randn(p, 896, device="cuda", dtype=torch.bfloat16) for p in parts]
        ms = do_bench(lambda ws=ws: torch.cat(ws))
        rows.append({"op": label, "shape": str(parts), "us": round(ms * 1e3, 1),
                     "GB/s": round(2 * sum(parts) * 896 * 2 / ms / 1e6), "rel_err": "-"})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)
    cudnn = ac.cudnn_frontend()
    plans = []
    for shape in SHAPES:
        try:
            plans += probe_shape(*shape)
        except Exception as e:  # noqa: BLE001 (report and go on to the next shape)
            plans.append({"shape": shape[0], "error": repr(e)[:300]})
            print(plans[-1], flush=True)
    bias = probe_bias()
    md = ("## cuDNN plans\n\n" + markdown_table([p for p in plans if "ms" in p],
                                               ["shape", "docs", "pass", "plan", "name", "ms", "tflops", "max_diff_vs_plan0"])
          + "\n## bias gradient and weight cats\n\n" + markdown_table(bias, ["op", "shape", "us", "GB/s", "rel_err"]))
    print(md)
    path = write_results("probe_cudnn_plans", {"cudnn": cudnn.backend_version(), "plans": plans, "bias": bias}, md,
                         out_dir=args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
