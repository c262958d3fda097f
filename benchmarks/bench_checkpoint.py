"""How long a checkpoint stops training: synchronous save vs the background writer (``train.async_save``).

Full fine-tuning state at a bench shape (bf16 weights + AdamW moments after one step, 3 GiB at 0.5B; fused on
CUDA; on the CPU a step is one row of 32 tokens): per mode, the seconds ``save()`` blocks the training thread and the seconds until the
checkpoint is published (written, fsynced, renamed), median of ``--repeats``; and, for the background writer,
the time of ``--steps`` training steps run while it writes against the same steps without a write (the
thread competes for the host and the GIL).

    PYTHONPATH=src python benchmarks/bench_checkpoint.py --shape 0.5b [--out DIR]
    PYTHONPATH=src python benchmarks/bench_checkpoint.py --device cpu --shape 0.5b   # CPU run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from common import markdown_table, require_cuda, write_results


def _state(shape_name: str, dev: torch.device):
    from chronicals.bench.contenders import build_chronicals_model
    from chronicals.bench.shapes import get_shape

    shape = get_shape(shape_name)
    model = build_chronicals_model(shape, dev, "auto", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rows, seq = (shape.rows, shape.seq) if dev.type == "cuda" else (1, 32)  # the CPU: the state, not the step
    ids = torch.randint(0, shape.hf_config["vocab_size"], (rows, seq), device=dev)

    def step():
        model(ids, labels=ids).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    step()
    return model, opt, sched, step


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    from chronicals.train.checkpoint import CheckpointWriter

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)
    dev = torch.device(args.device)
    model, opt, sched, step = _state(args.shape, dev)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for background in (False, True):
            blocked, published, with_write = [], [], []
            for r in range(args.repeats):
                writer = CheckpointWriter(background=background)
                _sync(dev)
                t0 = time.perf_counter()
                writer.save(tmp, r + 1, model, opt, sched, {"position": r}, keep_last=1)
                blocked.append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                for _ in range(args.steps if background else 0):
                    step()
                _sync(dev)
                with_write.append(time.perf_counter() - t1)
                writer.wait()
                published.append(time.perf_counter() - t0)
            rows.append({"mode": "background" if background else "synchronous", "state_gib": round(nbytes / 2**30, 2),
                         "blocked_s": round(statistics.median(blocked), 3),
                         "published_s": round(statistics.median(published), 3),
                         "steps_during_write_s": round(statistics.median(with_write), 3) if background else None})
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        _sync(dev)
        rows.append({"mode": "no checkpoint", "steps_during_write_s": round(time.perf_counter() - t0, 3)})
    for r in rows:
        print(r, flush=True)
    table = markdown_table(rows, ["mode", "state_gib", "blocked_s", "published_s", "steps_during_write_s"])
    path = write_results(f"bench_checkpoint_{args.shape}", {"rows": rows, "steps": args.steps,
                                                            "repeats": args.repeats}, markdown=table,
                         out_dir=args.out)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
