"""The SwiGLU kernels that also make a LoRA down_proj's x A^T and dA (``ops.swiglu_lora``) against the kernels plus
GEMMs they replace, at the 0.5B LoRA protocol (16,384 x 4,864, r = 32) and the 8B one (8,192 x 14,336), on the GPU.

Forward: ``swiglu_gate_up_forward(gu)`` then ``act @ A^T`` vs ``swiglu_gate_up_xa`` (autotuned).
Backward: the in-place ``swiglu_gate_up_backward_`` (writes d_gu and act) then ``dyb^T @ act`` vs
``swiglu_gate_up_backward_da`` in place, for each backward launch shape (the shipped one first); and with the
gate/up pair's dB (two more GEMMs over d_gu) vs the same kernel given their xa. Each fused
result is checked against the unfused one first (act and d_gu bit for bit, xa and dA to bf16 rounding).

    PYTHONPATH=src python3 benchmarks/probe_swiglu_lora.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbs, do_bench, require_cuda, write_results  # noqa: E402

from chronicals.ops import swiglu_lora as sl  # noqa: E402
from chronicals.ops.swiglu import swiglu_gate_up_backward_, swiglu_gate_up_forward  # noqa: E402

SHAPES = {"0.5b": (16384, 4864, 32), "8b": (8192, 14336, 32)}
BWD_SHAPES = [  # (BLOCK_R, BLOCK_C, warps, stages); the shipped one first
    (64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 128, 4, 3), (64, 128, 8, 3),
    (32, 128, 4, 3), (128, 128, 8, 2), (64, 64, 8, 4)]


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run(name: str, n: int, i: int, r: int) -> list[dict]:
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(n, 2 * i, device=dev, generator=g).to(bf)
    a = (torch.randn(r, i, device=dev, generator=g) / i ** 0.5).to(bf)
    d_act = torch.randn(n, i, device=dev, generator=g).to(bf)
    dyb = torch.randn(n, r, device=dev, generator=g).to(bf)
    rows = []
    # correctness first: fused against the kernels + GEMMs it replaces
    act, xa = sl.swiglu_gate_up_xa(gu, a)
    act_ref = swiglu_gate_up_forward(gu)
    xa_ref = act_ref @ a.t()
    d_gu_ref, act_b = swiglu_gate_up_backward_(d_act.clone(), gu.clone())
    da_ref = dyb.t() @ act_b
    d_gu, da, _ = sl.swiglu_gate_up_backward_da(d_act, gu.clone(), dyb, in_place=True)
    checks = {"act_bits": torch.equal(act, act_ref), "d_gu_bits": torch.equal(d_gu, d_gu_ref),
              "xa_rel_err": rel_err(xa, xa_ref), "da_rel_err": rel_err(da, da_ref)}
    ok = checks["act_bits"] and checks["d_gu_bits"] and checks["xa_rel_err"] < 1e-2 and checks["da_rel_err"] < 1e-2
    print(f"{name}: {checks} -> {'ok' if ok else 'FAIL'}", flush=True)
    buf_gu, buf_d = gu.clone(), d_act.clone()
    # forward
    t_base = do_bench(lambda: torch.mm(swiglu_gate_up_forward(gu), a.t()))
    t_fused = do_bench(lambda: sl.swiglu_gate_up_xa(gu, a))
    best = getattr(sl._swiglu_xa_fwd_kernel, "best_config", None)
    rows.append(dict(shape=name, part="forward", variant="swiglu + mm", us=t_base * 1e3))
    rows.append(dict(shape=name, part="forward", variant=f"fused ({best})", us=t_fused * 1e3))
    # backward (in place: timing does not depend on the values gu takes on)

    def base_bwd():
        _, act2 = swiglu_gate_up_backward_(buf_d, buf_gu)
        return torch.mm(dyb.t(), act2)

    rows.append(dict(shape=name, part="backward", variant="in-place swiglu bwd + mm", us=do_bench(base_bwd) * 1e3))
    shipped = (sl._BWD_BLOCK_R, sl._BWD_BLOCK_C, sl._BWD_WARPS, sl._BWD_STAGES)
    # with the gate/up pair's dB too: against the two dB GEMMs over d_gu they replace
    xa_gu = torch.randn(n, 2 * r, device=dev, generator=g).to(bf)
    spec = (xa_gu, r, r, 2.0, 2.0)
    _, _, (dbg, dbu) = sl.swiglu_gate_up_backward_da(d_act, gu.clone(), dyb, True, spec)
    checks["db_rel_err"] = max(rel_err(dbg, 2.0 * (d_gu_ref[:, :i].t() @ xa_gu[:, :r])),
                               rel_err(dbu, 2.0 * (d_gu_ref[:, i:].t() @ xa_gu[:, r:])))
    print(f"{name}: dB rel err {checks['db_rel_err']:.2e}", flush=True)

    def base_bwd_db():
        d_gu2, act2 = swiglu_gate_up_backward_(buf_d, buf_gu)
        return (torch.mm(dyb.t(), act2), torch.addmm(dyb.new_empty(()), d_gu2[:, :i].t(), xa_gu[:, :r], beta=0,
                                                     alpha=2.0),
                torch.addmm(dyb.new_empty(()), d_gu2[:, i:].t(), xa_gu[:, r:], beta=0, alpha=2.0))

    rows.append(dict(shape=name, part="backward+dB", variant="in-place swiglu bwd + 3 mm",
                     us=do_bench(base_bwd_db) * 1e3))
    rows.append(dict(shape=name, part="backward+dB", variant="fused (shipped shape)",
                     us=do_bench(lambda: sl.swiglu_gate_up_backward_da(d_act, buf_gu, dyb, True, spec)) * 1e3))
    for shape in BWD_SHAPES:
        sl._BWD_BLOCK_R, sl._BWD_BLOCK_C, sl._BWD_WARPS, sl._BWD_STAGES = shape
        try:
            _, da_v, _ = sl.swiglu_gate_up_backward_da(d_act, gu.clone(), dyb, in_place=True)
            err = rel_err(da_v, da_ref)
            t = do_bench(lambda: sl.swiglu_gate_up_backward_da(d_act, buf_gu, dyb, in_place=True))
            rows.append(dict(shape=name, part="backward", variant=f"fused {shape}", us=t * 1e3, da_rel_err=err))
        except Exception as e:  # a launch shape that does not fit (shared memory): say so, go on
            rows.append(dict(shape=name, part="backward", variant=f"fused {shape}", error=str(e)[:200]))
    sl._BWD_BLOCK_R, sl._BWD_BLOCK_C, sl._BWD_WARPS, sl._BWD_STAGES = shipped
    shipped_per_sm = sl._PROGRAMS_PER_SM
    for per_sm in (1, 4, 8):  # row shares: programs per SM
        sl._PROGRAMS_PER_SM = per_sm
        t = do_bench(lambda: sl.swiglu_gate_up_backward_da(d_act, buf_gu, dyb, True, spec))
        rows.append(dict(shape=name, part="backward+dB", variant=f"fused, {per_sm} programs/SM", us=t * 1e3))
    sl._PROGRAMS_PER_SM = shipped_per_sm
    for row in rows:
        row["checks_ok"] = ok
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    require_cuda("probe_swiglu_lora.py")
    rows = []
    for name, (n, i, r) in SHAPES.items():
        rows += run(name, n, i, r)
    bw = copy_bandwidth_gbs()
    for row in rows:
        print(f"{row['shape']:5} {row['part']:8} {row['variant']:44} "
              + (f"{row['us']:8.1f} us" if "us" in row else row.get("error", "")), flush=True)
    write_results("probe_swiglu_lora", {"copy_gbs": bw, "rows": rows}, out_dir=args.out)


if __name__ == "__main__":
    main()
