"""The trainer loop's own tokens/s against the bench protocol's, same model, shape and step, one process.

The bench protocol (``chronicals.bench.protocol.timed_run``) enqueues its steps without a host sync, while
``train()`` syncs every step: ``loss.item()`` before the update (the NaN stop), ``float(grad_norm)``,
``torch.cuda.synchronize`` for the step time, plus its batch copies from pageable host memory and the metrics
it writes. This measures what those cost (benchmarks/NOTES.md, "Next"): per method, the protocol row
(``chronicals-full-graphs`` / ``chronicals-lora-graphs``: the trainer's step, graphed as train.cuda_graphs=auto
does) and ``train()`` on the same random batches (CPU tensors, as ``PackedLoader`` yields them), its tokens/s
from metrics.jsonl over the steps after warm-up. Both rows carry their gradient norms and losses. On the CPU
(dry run) the protocol rows are eager and bf16 while train() runs fp32: the ratio means nothing there.

    PYTHONPATH=src python benchmarks/bench_trainer.py [--out DIR] [--methods full,lora] [--steps 12]
    PYTHONPATH=src python benchmarks/bench_trainer.py --device cpu --shape tiny     # CPU dry run of the plumbing
    PYTHONPATH=src python benchmarks/bench_trainer.py --world 2      # train() on 2 GPUs (bench_dp.py: the protocol)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from common import free_port, markdown_table, torchrun_env, write_results

CONTENDER = {"full": "chronicals-full-graphs", "lora": "chronicals-lora-graphs"}  # as train.cuda_graphs=auto


class _Batches:
    """The loader protocol ``train()`` takes (len, iter, state_dict), cycling fixed CPU batches."""

    def __init__(self, batches):
        self.batches, self.position = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


def protocol_row(method: str, shape: str, dev: torch.device, warmup: int, steps: int) -> dict:
    from chronicals.bench.contenders import get_contender
    from chronicals.bench.protocol import RunSpec, timed_run, validate_row
    from chronicals.bench.shapes import get_shape

    name = CONTENDER[method] if dev.type == "cuda" else CONTENDER[method].replace("-graphs", "")
    sh = get_shape(shape)  # the shape's rows x seq, as trainer_row uses (RunSpec's defaults are 0.5B's 16 x 1024)
    spec = RunSpec(contender=name, shape=shape, warmup=warmup, steps=steps, device=dev.type,
                   **({"rows": sh.rows, "seq": sh.seq} if shape != "tiny" else {"rows": 2, "seq": 64}))
    built = get_contender(name).build(spec, get_shape(shape), dev)
    res = timed_run(built, spec, dev)
    row = validate_row({"method": method, "how": name, "tokens_per_s": round(res["tokens_per_s"]),
                        "step_ms": round(res["step_ms"], 2), "losses": res["losses"], "grad_norms": res["grad_norms"]})
    del built
    return row


MASTER_WEIGHTS = "false"  # --master-weights: "false" trains AdamW on the bf16 weights as the protocol does


def trainer_row(method: str, shape_name: str, dev: torch.device, warmup: int, steps: int, out: Path,
                rank: int = 0) -> dict | None:
    """train() on fixed random batches; its tokens/s from metrics.jsonl after warm-up (None on ranks > 0).

    Under data parallelism (``rank``: this process's rank; torchrun's variables set) each rank draws its own
    batches, and the row counts every rank's loss tokens (the trainer's all-ranks count)."""
    from chronicals.bench.contenders import build_chronicals_model, rows_as_packed_batch
    from chronicals.bench.protocol import LORA_ALPHA, LORA_R, validate_row
    from chronicals.bench.shapes import get_shape
    from chronicals.train import train

    shape = get_shape(shape_name)
    rows, seq = (shape.rows, shape.seq) if shape_name != "tiny" else (2, 64)
    g = torch.Generator().manual_seed(1000 * rank)
    vocab = shape.hf_config["vocab_size"]
    batches = [rows_as_packed_batch(torch.randint(0, vocab, (rows, seq), generator=g), "rows") for _ in range(8)]
    if dev.type == "cuda":  # metrics.jsonl's mem_gib is max_memory_allocated: not the earlier rows' peak
        torch.cuda.reset_peak_memory_stats(dev)
    model = build_chronicals_model(shape, dev, "auto", seed=0)
    lora = method == "lora"
    cfg = {"model": {"device": dev.type, "dtype": "bfloat16" if dev.type == "cuda" else "float32"},
           "lora": {"enabled": lora, "rank": LORA_R, "alpha": LORA_ALPHA},
           "optim": {"lr": 1e-4 if lora else 1e-5, "master_weights": MASTER_WEIGHTS},
           "train": {"max_steps": warmup + steps, "out_dir": str(out / method), "resume": "none", "save_final": False},
           "eval": {"qa": False}, "logging": {"progress": False, "tensorboard": False, "plot": False}}
    seen = _watch_optimizer(dev)
    train(cfg, model=model, train_loader=_Batches(batches))
    if rank:
        return None
    recs = [json.loads(x) for x in (out / method / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if r["kind"] == "train"][warmup:]
    seconds = sum(r["step_s"] for r in timed)
    row = validate_row({"method": method, "how": "metrics.jsonl after warm-up",
                        "tokens_per_s": round(sum(r["loss_tokens"] for r in timed) / seconds),
                        "step_ms": round(1e3 * seconds / len(timed), 2), "losses": [r["loss"] for r in timed],
                        "grad_norms": [r["grad_norm"] for r in timed],
                        "peak_gib": max((r.get("mem_gib") or 0 for r in timed), default=0) or None,
                        "master_weights": MASTER_WEIGHTS, **seen})
    del model
    return row


def _watch_optimizer(dev: torch.device) -> dict:
    """Wraps the loop's build_optimizer for the next train(): the dict it returns fills in with the optimizer's
    class, its state's size after the run (masters and moments) and the most memory allocated right after a step.

    Session 9's arithmetic put fp32 masters at +3.7 GiB for 0.5B full fine-tuning, yet train()'s peak with them
    read 12.9 GiB against the protocol's 12.1 (session 10): these say what the optimizer really holds."""
    import chronicals.train.loop as loop

    seen: dict = {}
    build = loop.build_optimizer

    def after_step(opt, args, kwargs):
        if dev.type == "cuda":
            seen["alloc_after_step_gib"] = max(seen.get("alloc_after_step_gib", 0.0),
                                               round(torch.cuda.memory_allocated(dev) / 2**30, 2))
        seen["optimizer_state_gib"] = round(sum(t.numel() * t.element_size() for st in opt.state.values()
                                                for t in st.values() if torch.is_tensor(t)) / 2**30, 2)

    def wrapped(*a, **k):
        loop.build_optimizer = build  # this train() only
        opt = build(*a, **k)
        seen["optimizer"] = type(opt).__name__
        opt.register_step_post_hook(after_step)
        return opt

    loop.build_optimizer = wrapped
    return seen


def _dp_worker(rank: int, world: int, port: int, method: str, shape: str, device: str, warmup: int, steps: int,
               out: str) -> None:
    """One rank of the data-parallel train() row; rank 0 writes the row to out/row.json."""
    torchrun_env(rank, world, port)
    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    row = trainer_row(method, shape, dev, warmup, steps, Path(out), rank=rank)
    if row is not None:
        (Path(out) / "row.json").write_text(json.dumps(row))


def dp_trainer_row(method: str, shape: str, dev: torch.device, warmup: int, steps: int, out: Path, world: int) -> dict:
    """train() under data parallelism on ``world`` processes (mp.spawn, as torchrun would start them)."""
    import torch.multiprocessing as mp

    port = free_port()
    run = out / f"dp_{method}"
    run.mkdir(parents=True, exist_ok=True)
    mp.spawn(_dp_worker, args=(world, port, method, shape, dev.type, warmup, steps, str(run)), nprocs=world, join=True)
    return {**json.loads((run / "row.json").read_text()), "ranks": world}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--methods", default="full,lora")
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--world", type=int, default=1,
                    help="> 1: train() under data parallelism on that many GPUs (gloo processes with --device cpu); "
                         "compare with bench_dp.py's protocol rows")
    ap.add_argument("--master-weights", default="false", choices=("false", "auto", "true"),
                    help="optim.master_weights of the train() rows (auto: fp32 masters for bf16 weights, the "
                         "trainer's default; false: AdamW on the bf16 weights, as the protocol rows)")
    ap.add_argument("--train-only", action="store_true",
                    help="only the train() rows: their peak memory then owes nothing to a protocol row run before "
                         "them in this process")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():  # it wrote a results file of error rows, exit 0
        sys.exit("bench_trainer.py needs a CUDA GPU (--device cuda, the default); on the CPU run the dry run: "
                 "--device cpu --shape tiny --out DIR")
    global MASTER_WEIGHTS
    MASTER_WEIGHTS = args.master_weights
    dev = torch.device(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            loops = ((("bench protocol", protocol_row), ("train()", trainer_row)) if args.world == 1 else
                     ((f"train(), {args.world} ranks", dp_trainer_row),))
            if args.train_only:
                loops = tuple(lp for lp in loops if lp[1] is not protocol_row)
            for loop, fn in loops:
                extra = (() if fn is protocol_row else (Path(tmp),)) + ((args.world,) if fn is dp_trainer_row else ())
                try:
                    row = {"loop": loop, **fn(method, args.shape, dev, args.warmup, args.steps, *extra)}
                except Exception as e:  # one failing row must not hide the others
                    row = {"method": method, "loop": loop, "status": "error", "reason": f"{type(e).__name__}: {str(e)[-300:]}"}
                if row.get("losses"):
                    row["loss_first_last"] = f"{row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}"
                rows.append(row)
                print({k: v for k, v in row.items() if k not in ("losses", "grad_norms")}, flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    by = {(r["method"], r["loop"]): r for r in rows}
    for m in args.methods.split(","):  # the loop's rate as a share of the protocol's
        p, t = by.get((m, "bench protocol"), {}), by.get((m, "train()"), {})
        if p.get("tokens_per_s") and t.get("tokens_per_s"):
            t["vs_protocol"] = round(t["tokens_per_s"] / p["tokens_per_s"], 3)
    cols = ["method", "loop", "how", "master_weights", "optimizer", "tokens_per_s", "step_ms", "vs_protocol",
            "peak_gib", "optimizer_state_gib", "alloc_after_step_gib", "min_grad_norm", "loss_first_last", "status"]
    table = markdown_table(rows, cols)
    name = (f"bench_trainer_{args.shape}" + (f"_dp{args.world}" if args.world > 1 else "")
            + ("_train_only" if args.train_only else "")
            + (f"_master_{args.master_weights}" if args.master_weights != "false" else ""))
    path = write_results(name, {"rows": rows, "warmup": args.warmup, "steps": args.steps, "world": args.world},
                         markdown=table, out_dir=args.out)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
