"""Data parallelism on 2 GPUs: the trainer's step (``accumulate_data_parallel``: exact global loss-token
divisor, bucketed NCCL all-reduce of the gradients) eager vs replayed as CUDA graphs, full fine-tuning and
LoRA, on the bench protocol's 0.5B shape (each rank 16 x 1024 random tokens per step, its own batches; fused
AdamW). The all-reduce either overlaps the backward (``GradBuckets``, opt-in ``train.overlap_grad_reduce``:
"overlap") or follows it (``DistContext.all_reduce_grads``, the trainer's default: "after"). One process per GPU (mp.spawn), both ranks timed
between two synchronizations.

Rows: tokens/s over both ranks (loss tokens), per GPU, peak GiB (rank 0), the smallest gradient norm over the
timed steps and the loss first -> last (the all-reduced values, the same on both ranks).

    PYTHONPATH=src python benchmarks/bench_dp.py [--out DIR] [--methods full,lora]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

from common import free_port, markdown_table, torchrun_env, write_results

WORLD = 2


def _worker(rank: int, port: int, method: str, graphs: bool, out: str, device: str, shape: str, reduce: str) -> None:
    from chronicals.bench.contenders import get_contender
    from chronicals.bench.protocol import RunSpec, timed_run, validate_row
    from chronicals.bench.shapes import get_shape
    from chronicals.train.distributed import init_distributed
    from chronicals.train.grad_buckets import GradBuckets
    from chronicals.train.graphs import GraphedStep
    from chronicals.train.step import accumulate_data_parallel

    torchrun_env(rank, WORLD, port)
    dp = init_distributed(device)
    torch.set_num_threads(1)
    if os.environ.get("BENCH_DP_STACKS_AFTER"):  # a hang's whereabouts: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["BENCH_DP_STACKS_AFTER"]), exit=True)
    try:
        dev = dp.device
        sh = get_shape(shape)  # the shape's own batch on a GPU (2 x 64 on the CPU: a dry run); --shape 8b ran
        # 2 x 64 and the row said neither (a bench walk)
        spec = RunSpec(contender=f"chronicals-{method}", shape=shape, warmup=3, steps=10, device=device,
                       **({"rows": sh.rows, "seq": sh.seq} if device == "cuda" else {"rows": 2, "seq": 64}))
        built = get_contender(spec.contender).build(spec, get_shape(spec.shape), dev)
        reducer = GradBuckets(dp, built.params) if reduce == "overlap" else None
        graphed = GraphedStep(built.model, dev, params=built.params, reducer=reducer) if graphs else None
        prepare = built.prepare
        built.prepare = lambda ids: prepare((ids + 7919 * rank) % built.vocab_size)  # each rank its own batches
        built.forward_backward = lambda batch: accumulate_data_parallel(built.model, [batch], dev, dp, built.params,
                                                                        graphed, reducer)[0]
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        res = timed_run(built, spec, dev)
        if rank == 0:
            tok = res["tokens_per_s"] * WORLD  # both ranks ran the same count of loss tokens in the window
            row = {"shape": shape, "rows": spec.rows, "seq": spec.seq, "method": method, "cuda_graphs": graphs,
                   "all_reduce": reduce, "ranks": WORLD,
                   "tokens_per_s": round(tok),
                   "tokens_per_s_per_gpu": round(tok / WORLD), "step_ms": round(res["step_ms"], 2),
                   "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
                   "losses": res["losses"], "grad_norms": res["grad_norms"]}
            row = validate_row(row)
            row["loss_first_last"] = f"{res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}"
            with open(out, "w") as f:
                json.dump(row, f)
        # graphs that captured NCCL collectives must go before their process group: with them alive,
        # destroy_process_group hung on 2 H200s (both ranks, after the timed steps; faulthandler stacks, b796b3d)
        del built, graphed, reducer
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    finally:
        dp.destroy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--methods", default="full,lora")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a gloo dry run of the plumbing (eager only), with --shape tiny")
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--reduce", default="after,overlap", help="comma list of after | overlap")
    ap.add_argument("--graphs", default="eager,graphs", help="comma list of eager | graphs (graphs: CUDA only)")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        sys.exit(f"bench_dp: needs {WORLD} GPUs (found {torch.cuda.device_count()})")
    rows = []
    cols = ["shape", "method", "cuda_graphs", "all_reduce", "tokens_per_s", "tokens_per_s_per_gpu", "step_ms", "peak_gib",
            "min_grad_norm", "loss_first_last", "status"]

    def save():  # after every row: a call cut short by its time limit keeps the rows it finished
        return write_results(f"bench_dp_{args.shape}", {"rows": rows, "ranks": WORLD, "planned_rows": len(runs)},
                             markdown=markdown_table(rows, cols), out_dir=args.out)

    modes = [g == "graphs" for g in args.graphs.split(",") if args.device == "cuda" or g == "eager"]
    runs = [(m, g, r) for m in args.methods.split(",") for g in modes for r in args.reduce.split(",")]
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        for method, graphs, reduce in runs:
            path = os.path.join(tmp, f"{method}_{graphs}_{reduce}.json")
            try:
                mp.spawn(_worker, args=(free_port(), method, graphs, path, args.device, args.shape, reduce), nprocs=WORLD,
                         join=True)
                rows.append(json.load(open(path)))
            except Exception as e:  # one failing row must not hide the others
                rows.append({"method": method, "cuda_graphs": graphs, "all_reduce": reduce, "status": "error",
                             "reason": f"{type(e).__name__}: {str(e)[-300:]}"})
            print(rows[-1] if "losses" not in rows[-1] else
                  {k: v for k, v in rows[-1].items() if k not in ("losses", "grad_norms")}, flush=True)
            path = save()
    print(markdown_table(rows, cols))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
