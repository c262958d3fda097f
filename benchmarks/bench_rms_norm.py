"""RMSNorm forward / backward / both: chronicals Triton vs torch eager, torch.compile and Liger-Kernel (bf16).

    PYTHONPATH=src python benchmarks/bench_rms_norm.py --out DIR

Shapes: Qwen2.5-0.5B (16,384 tokens x 896) and Llama-3-8B (8,192 tokens x 4096). Two variants: the plain
norm (all contenders) and norm with the fused residual add (ours vs torch; Liger's RMSNorm has no residual).
Bytes that must move (bf16): plain forward 2NH (read x, write y), backward 3NH (read x, dy, write dx);
residual forward 4NH (read x, r, write y, s), backward 4NH (read s, dy, ds, write dx). Weight bytes ignored.
Correctness against a float64 reference is checked on the GPU before anything is timed.
Two timings per contender: "ms" (do_bench, launched from Python each call: includes CPU launch overhead,
which dominates at these sizes for any op that is not CUDA-graphed) and "graph ms" (CUDA-graph replay: GPU
time alone, the honest basis for bandwidth claims). Both columns use the same bytes.

The generic helpers here (check_close, time_modes, run_table) are shared with bench_swiglu.py and bench_rope.py.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import copy_bandwidth_gbs, do_bench, markdown_table, write_results

SHAPES = {"qwen2.5-0.5b": 16384, "llama-3-8b": 8192}  # tokens; hidden below
HIDDEN = {"qwen2.5-0.5b": 896, "llama-3-8b": 4096}
COLUMNS = ["shape", "variant", "mode", "contender", "ms", "GB/s", "% copy", "x vs liger",
           "graph ms", "graph GB/s", "graph % copy", "graph x vs liger"]


GRAPH_NOTE = ("ms / GB/s: eager do_bench (Python launch each call, L2 flushed); graph ms / GB/s: CUDA-graph "
              "replay, the GPU time without launch overhead (no L2 flush; tensors >= 29 MB)")

# ---------------------------------------------------------------- shared helpers


def require_cuda():
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (run it on the GPU machine with PYTHONPATH=src)")


def _outputs_and_grads(fn, inputs, grad_outs):
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(outs, diff, [g.to(o.dtype) for o, g in zip(outs, grad_outs)])
    return [o.detach() for o in outs] + list(grads)


def check_close(name, ours, ref, inputs, grad_outs, k=2.0):
    """Our bf16 outputs and gradients vs a float64 run of ``ref``: error <= k x torch-bf16 error + eps x max."""
    exact = _outputs_and_grads(ref, [t.double() if t.is_floating_point() else t for t in inputs],
                               [g.double() for g in grad_outs])
    theirs = _outputs_and_grads(ref, inputs, grad_outs)
    mine = _outputs_and_grads(ours, inputs, grad_outs)
    for i, (m, t, e) in enumerate(zip(mine, theirs, exact)):
        err = (m.double() - e).abs().max().item()
        terr = (t.double() - e).abs().max().item()
        tol = k * terr + torch.finfo(m.dtype).eps * e.abs().max().item()
        if not err <= tol:
            sys.exit(f"{name}: output/gradient #{i} error {err:.3g} > {tol:.3g} (torch bf16 error {terr:.3g}); "
                     "not timing a wrong kernel")
    print(f"ok  {name}: outputs and gradients within 2x torch-bf16 error of float64")


def graph_bench(fn, target_ms: float = 20.0, replays: int = 10) -> float:
    """Median ms of ``fn()`` replayed from a CUDA graph: kernel time without Python/launch overhead.

    Like triton.testing.do_bench_cudagraph (n calls unrolled into one graph, mean per call per replay), but
    on a stream we own: the backward timing must capture autograd, whose backward kernels run on the stream
    the forward ran on, so the forward outputs are made on this same stream (see ``time_modes``). No L2
    flush, as in do_bench_cudagraph; every tensor here (>= 29 MB) is far above what L2 keeps between calls.
    """
    stream = torch.cuda.current_stream()
    for _ in range(3):  # warm up: autotuning, compilation, lazy init all stay out of the capture
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    n = max(2, min(200, int(target_ms / max(start.elapsed_time(end) / 3, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return sorted(times)[len(times) // 2]


def time_modes(fn, inputs, grad_outs) -> dict[str, dict[str, float]]:
    """Median ms of forward (grad enabled, so it saves what backward needs), backward, and both, in two
    timings: "eager" (do_bench: each call launched from Python, what an eager training step pays) and
    "graph" (CUDA-graph replay: the GPU time alone). A contender that cannot be captured gets NaN in
    "graph" and the reason printed; its eager column stands."""
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    diff = [t for t in inputs if t.requires_grad]

    def fwd():
        out = fn(*inputs)
        return out if isinstance(out, tuple) else (out,)

    res = {"eager": {}, "graph": {}}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for timing in ("eager", "graph"):
        # graph mode runs forward and backward on the side stream, so the captured backward is on it too
        with torch.cuda.stream(side if timing == "graph" else torch.cuda.current_stream()):
            outs = fwd()
            gos = [g.to(o.dtype) for o, g in zip(outs, grad_outs)]
            modes = {"fwd": fwd, "bwd": lambda: torch.autograd.grad(outs, diff, gos, retain_graph=True),
                     "both": lambda: torch.autograd.grad(fwd(), diff, gos)}
            for mode, f in modes.items():
                if timing == "eager":
                    res[timing][mode] = do_bench(f)
                    continue
                try:
                    res[timing][mode] = graph_bench(f)
                except RuntimeError as e:  # reported, not hidden: the row shows NaN
                    print(f"graph timing failed ({mode}): {str(e).splitlines()[0]}")
                    res[timing][mode] = float("nan")
            del outs
        torch.cuda.current_stream().wait_stream(side)
    return res


def run_table(cases, copy_gbs):
    """cases: (shape, variant, {contender: fn}, inputs, grad_outs, {mode: bytes}) -> result rows, one per
    (mode, contender), each with the eager and the CUDA-graph timing side by side."""
    rows = []
    for shape, variant, fns, inputs, grad_outs, nbytes in cases:
        times = {c: time_modes(f, inputs, grad_outs) for c, f in fns.items()}
        for mode in ("fwd", "bwd", "both"):
            for c, t in times.items():
                row = {"shape": shape, "variant": variant, "mode": mode, "contender": c}
                for timing, pre in (("eager", ""), ("graph", "graph ")):
                    ms = t[timing][mode]
                    gbs = nbytes[mode] / ms / 1e6
                    row.update({f"{pre}ms": round(ms, 4), f"{pre}GB/s": round(gbs) if gbs == gbs else gbs,
                                f"{pre}% copy": round(100 * gbs / copy_gbs, 1)})
                    if "liger" in times:
                        row[f"{pre}x vs liger"] = round(times["liger"][timing][mode] / ms, 2)
                rows.append(row)
    return rows


def finish(name, rows, copy_gbs, notes, out_dir):
    table = markdown_table(rows, COLUMNS)
    md = f"# {name}\n\ncopy bandwidth measured in this run: {copy_gbs:.0f} GB/s\n\n{table}\n" + "".join(
        f"- {n}\n" for n in notes)
    path = write_results(name, {"copy_bandwidth_gbs": copy_gbs, "rows": rows, "notes": notes}, md, out_dir=out_dir)
    print(md)
    print(f"wrote {path}")


def liger(import_path: str):
    """Liger's autograd Function, or (None, note) when liger-kernel is not importable here."""
    module, attr = import_path.rsplit(".", 1)
    try:
        mod = __import__(module, fromlist=[attr])
        return getattr(mod, attr), None
    except ImportError as e:
        return None, f"Liger-Kernel not importable ({e}); its column is missing (carry the wheel, see GPU.md)"


# ---------------------------------------------------------------- this op


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    args = ap.parse_args()
    require_cuda()
    from chronicals.ops import rms_norm, rms_norm_ref

    eps = 1e-6
    liger_fn, note = liger("liger_kernel.ops.rms_norm.LigerRMSNormFunction")
    notes = [note] if note else []
    copy_gbs = copy_bandwidth_gbs()
    compiled = torch.compile(rms_norm_ref, dynamic=False)
    cases = []
    for shape, n in SHAPES.items():
        h = HIDDEN[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        r = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
        dy = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        ds = torch.randn(n, h, device="cuda", generator=g).bfloat16()

        def ours(x_, w_):
            return rms_norm(x_, w_, eps, impl="triton")

        def ours_res(x_, w_, r_):
            return rms_norm(x_, w_, eps, residual=r_, impl="triton")

        check_close(f"rms_norm {shape}", ours, lambda x_, w_: rms_norm_ref(x_, w_, eps), [x, w], [dy])
        check_close(f"rms_norm+residual {shape}", ours_res, lambda x_, w_, r_: rms_norm_ref(x_, w_, eps, r_),
                    [x, w, r], [dy, ds])
        b = n * h * 2
        fns = {"chronicals": ours, "torch": lambda x_, w_: rms_norm_ref(x_, w_, eps),
               "torch.compile": lambda x_, w_: compiled(x_, w_, eps)}
        if liger_fn is not None:
            fns["liger"] = lambda x_, w_: liger_fn.apply(x_, w_, eps)
        cases.append((shape, "plain", fns, [x, w], [dy], {"fwd": 2 * b, "bwd": 3 * b, "both": 5 * b}))
        fns_res = {"chronicals": ours_res, "torch": lambda x_, w_, r_: rms_norm_ref(x_, w_, eps, r_),
                   "torch.compile": lambda x_, w_, r_: compiled(x_, w_, eps, r_)}
        cases.append((shape, "residual", fns_res, [x, w, r], [dy, ds], {"fwd": 4 * b, "bwd": 4 * b, "both": 8 * b}))
    rows = run_table(cases, copy_gbs)
    notes.append("bytes: plain fwd 2NH, bwd 3NH; residual fwd 4NH, bwd 4NH (bf16, weight ignored)")
    notes.append(GRAPH_NOTE)
    finish("bench_rms_norm", rows, copy_gbs, notes, args.out)


if __name__ == "__main__":
    main()
