"""RMSNorm forward / backward / both: chronicals Triton vs torch eager, torch.compile and Liger-Kernel (bf16).

    PYTHONPATH=src python benchmarks/bench_rms_norm.py --out DIR

Shapes: Qwen2.5-0.5B (16,384 tokens x 896) and Llama-3-8B (8,192 tokens x 4096). Two variants: the plain
norm (all contenders) and norm with the fused residual add (ours vs torch; Liger's RMSNorm has no residual).
Bytes that must move (bf16): plain forward 2NH (read x, write y), backward 3NH (read x, dy, write dx);
residual forward 4NH (read x, r, write y, s), backward 4NH (read s, dy, ds, write dx). Weight bytes ignored.
Correctness against a float64 reference is checked on the GPU before anything is timed.

The generic helpers here (check_close, time_modes, run_table) are shared with bench_swiglu.py and bench_rope.py.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import copy_bandwidth_gbs, do_bench, markdown_table, write_results

SHAPES = {"qwen2.5-0.5b": 16384, "llama-3-8b": 8192}  # tokens; hidden below
HIDDEN = {"qwen2.5-0.5b": 896, "llama-3-8b": 4096}
COLUMNS = ["shape", "variant", "mode", "contender", "ms", "GB/s", "% copy", "x vs liger"]


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


def time_modes(fn, inputs, grad_outs) -> dict[str, float]:
    """Median ms of forward (grad enabled, so it saves what backward needs), backward, and both."""
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    diff = [t for t in inputs if t.requires_grad]

    def fwd():
        out = fn(*inputs)
        return out if isinstance(out, tuple) else (out,)

    outs = fwd()
    gos = [g.to(o.dtype) for o, g in zip(outs, grad_outs)]
    res = {"fwd": do_bench(fwd),
           "bwd": do_bench(lambda: torch.autograd.grad(outs, diff, gos, retain_graph=True))}
    res["both"] = do_bench(lambda: torch.autograd.grad(fwd(), diff, gos))
    return res


def run_table(cases, copy_gbs):
    """cases: (shape, variant, {contender: fn}, inputs, grad_outs, {mode: bytes}) -> result rows."""
    rows = []
    for shape, variant, fns, inputs, grad_outs, nbytes in cases:
        times = {c: time_modes(f, inputs, grad_outs) for c, f in fns.items()}
        for mode in ("fwd", "bwd", "both"):
            for c, t in times.items():
                gbs = nbytes[mode] / t[mode] / 1e6
                row = {"shape": shape, "variant": variant, "mode": mode, "contender": c, "ms": round(t[mode], 4),
                       "GB/s": round(gbs), "% copy": round(100 * gbs / copy_gbs, 1)}
                if "liger" in times:
                    row["x vs liger"] = round(times["liger"][mode] / t[mode], 2)
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
    finish("bench_rms_norm", rows, copy_gbs, notes, args.out)


if __name__ == "__main__":
    main()
