"""Greedy decoding with a LoRA adapter on a bf16 base: fp32 A and B (load_adapter's default there, PEFT's
computation through the reference branch) against bf16 ones (the fused layouts and groups), and the base alone;
each eager and with one CUDA-graph replay per token (generate's default on CUDA, models/decode_graph.py).

Decoding one token at a time is launch-bound: the fp32 branch runs ~7 small kernels per projection where the fused
bf16 path runs 3-4 and groups q/k/v and gate/up. This says what that costs `chronicals chat` on a GPU, and what the captured step (one launch per token) saves.

`--rows B` adds the base model decoding B prompts of one length together (``generate.greedy_rows``, as eval's held-out
answers are decoded), eager and through the captured B-row step.

Usage: PYTHONPATH=src python benchmarks/bench_generate_adapter_dtype.py [--shape 0.5b] [--tokens 64] [--rows 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from chronicals.bench.contenders import build_chronicals_model
from chronicals.bench.shapes import get_shape
from chronicals.lora import apply_lora, load_adapter, save_adapter
from chronicals.models.generate import generate, greedy_rows
from common import require_cuda


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def profile_decode(model, prompt, name: str) -> None:
    """torch.profiler over 8 new tokens (after the timed run): the ops that take the host's and the device's time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        generate(model, prompt, 8, eos_token_id=None)
        sync(next(model.parameters()).device)
    print(f"--- {name}: 8 new tokens (and the 32-token prompt)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def bench_rows(shape, dev: torch.device, b: int, tokens: int) -> None:
    """The base model decoding b random 32-token prompts together, eager and graphed: new tokens/s over all rows."""
    model = build_chronicals_model(shape, dev, "auto", seed=0).eval()
    vocab = min(1000, shape.hf_config["vocab_size"])
    ids = torch.randint(0, vocab, (b, 32), generator=torch.Generator().manual_seed(1))
    outs = {}
    for graph in (False, True):
        if graph and dev.type != "cuda":
            continue
        greedy_rows(model, ids, tokens, set(), cuda_graph=graph)  # warm-up over the timed length (see main)
        sync(dev)
        t = time.perf_counter()
        out = greedy_rows(model, ids, tokens, set(), cuda_graph=graph)
        sync(dev)
        dt = time.perf_counter() - t
        outs[graph] = out
        print(f"  {b} rows, base only, {'CUDA graph' if graph else 'eager':10s} {sum(map(len, out)) / dt:8.1f} "
              f"tokens/s ({dt * 1e3 / tokens:.2f} ms a step)")
    if True in outs:
        same = sum(a == g for a, g in zip(outs[False], outs[True]))
        print(f"  {b} rows: CUDA graph and eager tokens the same in {same} of {b} rows")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=0, help="also decode this many prompts together (base only)")
    ap.add_argument("--profile", action="store_true", help="print each variant's top ops for 8 decoded tokens")
    args = ap.parse_args()
    require_cuda(__file__)
    dev = torch.device(args.device)
    shape = get_shape(args.shape)
    prompt = torch.randint(0, min(1000, shape.hf_config["vocab_size"]), (1, 32), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        src = build_chronicals_model(shape, dev, "auto", seed=0)
        apply_lora(src, r=16, alpha=32)
        with torch.no_grad():  # B = 0 would leave the branch invisible
            for n, p in src.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        save_adapter(src, tmp)
        del src
        rows = {}
        for name, dtype in (("base only", None), ("adapter fp32 (default)", "default"),
                            ("adapter bf16", torch.bfloat16)):
            model = build_chronicals_model(shape, dev, "auto", seed=0).eval()
            if dtype == "default":
                load_adapter(model, tmp)
            elif dtype is not None:
                load_adapter(model, tmp, adapter_dtype=dtype)
            for graph in (False, True):
                if graph and dev.type != "cuda":
                    continue
                with torch.no_grad():
                    # warm-up over the timed length: SDPA's backends build a plan per KV-cache length on first use,
                    # and a shorter warm-up left them to the first variant's timed run (session 21: "base only"
                    # 12.2 tokens/s timed first, against 28.1 and 33.8 for the two adapters timed after it)
                    generate(model, prompt, args.tokens, eos_token_id=None, cuda_graph=graph)
                    sync(dev)
                    t = time.perf_counter()
                    out = generate(model, prompt, args.tokens, eos_token_id=None, cuda_graph=graph)
                    sync(dev)
                    dt = time.perf_counter() - t
                rows[name + (", CUDA graph" if graph else ", eager")] = (out.numel() / dt, out)
            if args.profile:
                profile_decode(model, prompt, name)
            del model
    print(f"{args.shape}, greedy, prompt 32 tokens, {args.tokens} new tokens, {dev}")
    for name, (tps, _) in rows.items():
        print(f"  {name:38s} {tps:8.1f} tokens/s")
    same = torch.equal(rows["adapter fp32 (default), eager"][1], rows["adapter bf16, eager"][1])
    print(f"  fp32 and bf16 adapters chose the same tokens: {same}")
    for name in ("base only", "adapter fp32 (default)", "adapter bf16"):
        if name + ", CUDA graph" in rows:
            a, b = rows[name + ", eager"][1], rows[name + ", CUDA graph"][1]
            n = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
            print(f"  {name}: CUDA graph and eager tokens " + ("the same" if n is None and len(a) == len(b) else
                                                             f"first differ at new token {n}"))
    if args.rows > 1:
        bench_rows(shape, dev, args.rows, args.tokens)


if __name__ == "__main__":
    main()
