"""LoRA r=32 (all 7 projections, LoRA+ groups) against our own full fine-tuning, protocol of ANCHORS.md.

    PYTHONPATH=src python benchmarks/bench_lora.py --out DIR                # Qwen2.5-0.5B shape, 16 x 1024
    PYTHONPATH=src python benchmarks/bench_lora.py --shape 8b --out DIR     # Llama-3-8B shape LoRA, 4 x 2048
    ... --shape 8b --checkpoint-layers 4,6   # also rows checkpointing the first 4, then 6, decoder layers

The 8B shape also runs a row that keeps the SwiGLU product for backward (the path before the LoRA MLP
recomputed it) so the memory each knob saves shows side by side.

Random-init bf16 weights, fused AdamW (states in the parameters' dtype), no activation checkpointing,
4 warm-up + 12 timed steps between cuda synchronizes, the same fixed batch every step. Rows report loss
tokens/s, MFU (against a bf16 matmul peak measured in this run), peak max_memory_allocated, the smallest
gradient norm seen, and the first / last loss. Correctness first: the fused LoRA linear against the
reference at a bench shape, and a zero-B LoRA model giving the base model's logits bit for bit.
Targets (issue 6): 0.5B LoRA >= 1.3x our full FT and >= 240,000 tok/s; 8B LoRA >= 19,000 tok/s, <= 40 GiB.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, matmul_peak_tflops, write_results  # noqa: E402

from chronicals.lora import apply_lora, lora_linear, lora_modules, lora_plus_param_groups  # noqa: E402
from chronicals.models import CausalLM, ModelConfig  # noqa: E402
from chronicals.models.config import rope_inv_freq  # noqa: E402
from chronicals.train.metrics import train_flops_per_token  # noqa: E402

SHAPES = {
    "0.5b": dict(config=dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             max_position_embeddings=32768),
                 rows=16, seq=1024),
    "8b": dict(config=dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                           rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           max_position_embeddings=8192),
               rows=4, seq=2048),
    # --smoke: the whole script on the CPU in seconds (checks the code path, measures nothing)
    "smoke": dict(config=dict(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=80,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True), rows=2, seq=16),
}
DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
TARGETS7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(cfg: ModelConfig, impl: str) -> CausalLM:
    """``CausalLM(cfg).to("cuda", torch.bfloat16)`` with init_weights' distribution, but initialized on the
    GPU: an 8B model's fp32 CPU init would take minutes. Built on meta, so buffers and ties are redone."""
    with torch.device("meta"):
        model = CausalLM(cfg, impl=impl)
    model = model.to_empty(device=DEV)
    model.model.inv_freq = rope_inv_freq(cfg)[0].to(DEV)  # to_empty left the buffer uninitialized
    if cfg.tie_word_embeddings:  # to_empty gives each module its own new Parameter: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model.to(torch.bfloat16)


def flops_per_token(cfg: ModelConfig, seq: int, lora: bool) -> float:
    """6 x matmul params + attention for full FT; LoRA skips the frozen weights' dW GEMMs: 4 x params."""
    return train_flops_per_token(cfg, seq, "lora" if lora else "full")


def check_lora_linear(n=4096, fin=896, fout=4864, r=32):
    """bf16 fused (both GEMM layouts) vs the reference, each against float64: error at most 2x the reference's."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(n, fin, device=DEV, generator=g, dtype=torch.float64)
    w = torch.randn(fout, fin, device=DEV, generator=g, dtype=torch.float64) * fin ** -0.5
    a = torch.randn(r, fin, device=DEV, generator=g, dtype=torch.float64) * fin ** -0.5
    b = torch.randn(fout, r, device=DEV, generator=g, dtype=torch.float64) * 0.1
    dy = torch.randn(n, fout, device=DEV, generator=g, dtype=torch.float64)

    def run(impl, dtype, concat=False):
        xs, as_, bs = (t.to(dtype).requires_grad_() for t in (x, a, b))
        y = lora_linear(xs, w.to(dtype), None, as_, bs, 2.0, impl=impl, concat=concat)
        return [y.double(), *(t.double() for t in torch.autograd.grad(y, (xs, as_, bs), dy.to(dtype)))]

    exact, ref = run("torch", torch.float64), run("torch", torch.bfloat16)
    for concat in (False, True):
        for f, rf, e, what in zip(run("fused", torch.bfloat16, concat), ref, exact, ("y", "dx", "dA", "dB")):
            err_f, err_r = (f - e).abs().max().item(), (rf - e).abs().max().item()
            if not err_f <= 2 * err_r + 1e-2 * e.abs().max().item():
                raise SystemExit(f"lora_linear fused (concat={concat}) {what}: error {err_f:.3g} "
                                 f"vs reference {err_r:.3g}")
    print("check: fused LoRA linear (bf16, both layouts) within 2x the reference's error on", (n, fin, fout, r))


def check_zero_b(cfg, impl):
    """B = 0: with the addmm_ layout the logits are the base model's bit for bit (y + 0 is exact); the
    concatenated layout changes the GEMM's K (in + r), so its sums may round differently: bf16-close."""
    ids = torch.randint(0, cfg.vocab_size, (1, 128), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    for concat in (False, "auto"):
        model = build_model(cfg, impl).eval()
        with torch.no_grad():
            base = model(ids)
            apply_lora(model, r=32, alpha=64, target_modules=TARGETS7, concat=concat)
            got = model(ids)
        diff = (got.float() - base.float()).abs().max().item()
        del model
        if (concat is False and diff != 0) or diff > 2e-2 * base.float().abs().max().item():
            raise SystemExit(f"zero-B LoRA model (concat={concat}): logits differ from the base model's by {diff:.3g}")
        print(f"check: zero-B LoRA logits vs base model (concat={concat}): max abs diff {diff:.3g}")


def train_row(name, cfg, args, rows, seq, lora: bool, peak_tflops: float, lora_impl="fused", concat="auto",
              checkpoint_layers: int = 0, recompute_swiglu: bool = True):
    if DEV == "cuda":
        torch.cuda.empty_cache()
    model = build_model(cfg, args.impl).train()
    model.set_checkpointing(checkpoint_layers)
    if lora:
        apply_lora(model, r=32, alpha=64, target_modules=TARGETS7, impl=lora_impl, concat=concat)
        for _, mod in lora_modules(model):
            mod.recompute_swiglu = recompute_swiglu
        groups = lora_plus_param_groups(model, lr=2e-4, ratio=16.0)
    else:
        groups = [{"params": [p for p in model.parameters()], "lr": 2e-5}]
    if args.compile:
        for layer in model.model.layers:
            layer.compile()
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, fused=True, weight_decay=0.0)
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq + 1), device=DEV, generator=g)
    inp, tgt = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # every token a loss token, no padding

    def step():
        loss = model(inp, shift_labels=tgt, reduction="mean")
        loss.backward()
        gn = torch.nn.utils.get_total_norm([p.grad for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), gn

    sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = [step() for _ in range(args.warmup)]
    sync()
    t0 = time.perf_counter()
    out += [step() for _ in range(args.steps)]
    sync()
    dt = time.perf_counter() - t0
    losses = [l.item() for l, _ in out]
    gnorms = [gn.item() for _, gn in out]
    tps = rows * seq * args.steps / dt
    mfu = 100 * tps * flops_per_token(cfg, seq, lora) / (peak_tflops * 1e12)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0
    row = {"row": name, "tokens/s": round(tps), "MFU %": round(mfu, 1), "peak GiB": round(peak_gib, 2),
           "min grad norm": f"{min(gnorms):.4g}", "loss first": round(losses[0], 4),
           "loss last": round(losses[-1], 4), "ms/step": round(1e3 * dt / args.steps, 1),
           "trainable params": sum(p.numel() for p in params), "checkpointed layers": checkpoint_layers,
           "recompute swiglu": recompute_swiglu if lora else None}
    del model, opt, params, groups, out
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    if not all(torch.isfinite(torch.tensor(gnorms))) or min(gnorms) <= 0:
        raise SystemExit(f"{name}: gradient norm zero or not finite ({min(gnorms)}): not training")
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results/)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--impl", default="auto", choices=("auto", "triton", "torch"), help="decoder op implementations")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="0.5b: also LoRA with concat off and the plain-autograd (PEFT-style) LoRA path; "
                         "8b: also LoRA keeping the SwiGLU product (no recompute)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script runs")
    ap.add_argument("--checkpoint-layers", default="",
                    help="comma-separated k values: extra LoRA rows checkpointing the first k decoder layers")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV, args.shape, args.warmup, args.steps = "cpu", "smoke", 1, 2
        if args.out is None:  # its peak is a made-up 1 TFLOP/s: not a result for benchmarks/results/
            import tempfile

            args.out = tempfile.mkdtemp(prefix="bench_lora_smoke_")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_lora needs a CUDA GPU (run it on the GPU machine), or --smoke for a CPU dry run")
    spec = SHAPES[args.shape]
    cfg = ModelConfig.from_hf_dict(spec["config"])
    rows, seq = spec["rows"], spec["seq"]
    check_lora_linear(n=4096 if DEV == "cuda" else 64, fin=cfg.hidden_size, fout=cfg.intermediate_size)
    if args.shape != "8b":
        check_zero_b(cfg, args.impl)
    peak = matmul_peak_tflops() if DEV == "cuda" else 1.0
    tag = " +compile" if args.compile else ""
    results = []
    if args.shape != "8b":
        results.append(train_row(f"ours full FT{tag}", cfg, args, rows, seq, False, peak))
    results.append(train_row(f"ours LoRA r=32 LoRA+{tag}", cfg, args, rows, seq, True, peak))
    lora = results[-1]
    ks = [int(k) for k in args.checkpoint_layers.split(",") if k.strip()]
    for k in ks:
        results.append(train_row(f"ours LoRA, checkpoint first {k}{tag}", cfg, args, rows, seq, True, peak,
                                 checkpoint_layers=k))
    if args.shape == "8b" and args.variants:  # the knob's effect: the SwiGLU product kept for backward
        results.append(train_row(f"ours LoRA, SwiGLU product kept{tag}", cfg, args, rows, seq, True, peak,
                                 recompute_swiglu=False))
    if args.variants and args.shape != "8b":
        results.append(train_row(f"ours LoRA, concat off{tag}", cfg, args, rows, seq, True, peak, concat=False))
        results.append(train_row(f"ours LoRA, plain autograd{tag}", cfg, args, rows, seq, True, peak,
                                 lora_impl="torch"))
    if args.shape != "8b":
        speedup = lora["tokens/s"] / results[0]["tokens/s"]
        targets = {"LoRA / full FT >= 1.3": (round(speedup, 3), speedup >= 1.3),
                   "LoRA tok/s >= 240,000": (lora["tokens/s"], lora["tokens/s"] >= 240_000)}
    else:
        # the fastest row within 40 GiB (no checkpointing if it fits, else the fewest layers tried)
        fits = [r for r in results if r["peak GiB"] <= 40 and r["recompute swiglu"]] or [lora]
        best = max(fits, key=lambda r: r["tokens/s"])
        targets = {f"LoRA tok/s >= 19,000 ({best['row']})": (best["tokens/s"], best["tokens/s"] >= 19_000),
                   f"LoRA peak <= 40 GiB ({best['row']})": (best["peak GiB"], best["peak GiB"] <= 40)}
    cols = ["row", "tokens/s", "MFU %", "peak GiB", "min grad norm", "loss first", "loss last", "ms/step",
            "checkpointed layers"]
    md = (f"bench_lora, shape {args.shape} ({rows} x {seq} tokens/step), bf16 matmul peak {peak:.0f} TFLOP/s\n\n"
          + markdown_table(results, cols) + "\n"
          + "".join(f"- {k}: {v} -> {'PASS' if ok else 'FAIL'}\n" for k, (v, ok) in targets.items()))
    path = write_results(f"bench_lora_{args.shape}{'_compile' if args.compile else ''}",
                         {"shape": args.shape, "rows": rows, "seq": seq, "matmul_peak_tflops": peak,
                          "args": vars(args), "results": results,
                          "targets": {k: {"value": v, "pass": ok} for k, (v, ok) in targets.items()}},
                         markdown=md, out_dir=args.out)
    print("\n" + md + f"\nwritten: {path}")


if __name__ == "__main__":
    main()
