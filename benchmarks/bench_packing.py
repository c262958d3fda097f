"""Packing efficiency on a chat-like length distribution (CPU, seconds).

Lengths: lognormal with median 380 tokens and sigma 1.0 (mean ~630, 90th percentile ~1,370), clipped
to [16, max_seq_len]: a rough fit to multi-turn chat SFT sets such as UltraChat / OpenHermes rendered
with a chat template; the loss-token share (assistant tokens) is drawn per example, uniform in [0.4, 0.8].

Compared per epoch, with slots = tokens of compute the batches occupy:
- pad to max_seq_len: every example its own row of max_seq_len;
- pad to the batch's longest: shuffled batches of B examples, each padded to its longest;
- BFD rows: pack_bfd into rows of max_seq_len (B rows a step);
- BFD token budget: padding-free rows of B * max_seq_len tokens.
Efficiency = loss tokens / slots; fill = real tokens / slots.

    PYTHONPATH=src python benchmarks/bench_packing.py [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from chronicals.data import pack_bfd
from common import markdown_table, write_results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--median", type=float, default=380.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    s, b = args.max_seq_len, args.batch
    lengths = np.clip(rng.lognormal(np.log(args.median), args.sigma, args.n).astype(np.int64), 16, s)
    loss_share = rng.uniform(0.4, 0.8, args.n)
    tokens = int(lengths.sum())
    loss = int((lengths * loss_share).astype(np.int64).sum())

    rows = []

    def add(name, slots, seconds=0.0, steps=None):
        rows.append({"method": name, "slots": int(slots), "efficiency": round(loss / slots, 4),
                     "fill": round(tokens / slots, 4), "compute_vs_bfd": None, "steps": steps,
                     "pack_seconds": round(seconds, 3)})

    add("pad to max_seq_len", args.n * s, steps=-(-args.n // b))
    order = rng.permutation(args.n)
    longest = [int(lengths[order[i:i + b]].max()) * len(order[i:i + b]) for i in range(0, args.n, b)]
    add("pad to batch longest", sum(longest), steps=len(longest))
    t = time.perf_counter()
    bins = pack_bfd(lengths.tolist(), s)
    add("BFD rows of max_seq_len", len(bins) * s, time.perf_counter() - t, -(-len(bins) // b))
    t = time.perf_counter()
    budget = pack_bfd(lengths.tolist(), b * s)
    add("BFD token budget (padding-free)", tokens, time.perf_counter() - t, len(budget))
    bfd_slots = rows[2]["slots"]
    for r in rows:
        r["compute_vs_bfd"] = round(r["slots"] / bfd_slots, 3)

    dist = {"n": args.n, "max_seq_len": s, "batch_rows": b, "lognormal_median": args.median,
            "lognormal_sigma": args.sigma, "loss_share": [0.4, 0.8], "mean_length": round(float(lengths.mean()), 1),
            "p90_length": int(np.percentile(lengths, 90)), "clipped_at_max": int((lengths == s).sum()),
            "tokens": tokens, "loss_tokens": loss}
    cols = ["method", "efficiency", "fill", "slots", "compute_vs_bfd", "steps", "pack_seconds"]
    table = markdown_table(rows, cols)
    path = write_results("packing", {"distribution": dist, "rows": rows},
                         markdown=f"Lengths: {dist}\n\n" + table, out_dir=args.out)
    print(f"lengths: {dist}")
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
