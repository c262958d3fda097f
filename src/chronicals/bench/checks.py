"""Proof that the fast rows train the same model: parity with transformers, and a loss that falls.

correctness: on the same random weights and batch, our first-step loss, gradient norm and gradient
direction against transformers', both in bf16, with transformers in fp32 as the reference. Ours passes
when its error against the fp32 reference is at most 2 x transformers' own bf16 error (or under a small
floor: bf16 has 8 bits of mantissa, so 1e-3 relative on the loss and 2e-2 on the norm). Full fine-tune
and LoRA (PEFT's adapters copied into ours by name; B set non-zero so the adapters shape the loss).

learning: our model trains on a periodic sequence (a random block of 16 tokens repeated; the same batch
every step), whose next token is a function of the current one; the loss must fall by 25% of its first
value for full fine-tuning and 15% for LoRA (frozen embeddings learn slower: the tiny CPU model's LoRA
run plateaus near 0.8 x its start after 40 steps). A model with vanishing or wrong gradients stays at
ln(vocab).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from .._words import counted
from .contenders import (add_chronicals_lora, add_peft_lora, build_chronicals_model, build_hf_model,
                         chronicals_step, hf_style)
from .protocol import RunSpec, grad_norm, make_batches, make_optimizer, train_step
from .shapes import get_shape

LOSS_FLOOR, NORM_FLOOR, COS_FLOOR = 1e-3, 2e-2, 1e-2


def canonical(name: str) -> str:
    """PEFT's parameter names -> ours: drop the ``base_model.model.`` prefix and the ``.default`` adapter."""
    return name.removeprefix("base_model.model.").replace(".default", "")


def trainable_grads(model) -> dict[str, torch.Tensor]:
    return {canonical(n): p.grad.float() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@torch.no_grad()
def copy_adapters(peft_model, ours) -> int:
    """Copy PEFT's LoRA A/B into our LoRALinear modules (same names once canonical); returns the count."""
    src = {canonical(n): p for n, p in peft_model.named_parameters() if "lora_" in n}
    dst = {n: p for n, p in ours.named_parameters() if "lora_" in n}
    if set(src) != set(dst):
        only_src, only_dst = sorted(set(src) - set(dst))[:3], sorted(set(dst) - set(src))[:3]
        raise RuntimeError(f"LoRA parameter names differ between PEFT and chronicals: PEFT only {only_src}, "
                           f"ours only {only_dst}")
    for n, p in dst.items():
        p.copy_(src[n].to(p.dtype))
    return len(dst)


def first_step(fb, prepare, model, ids) -> tuple[float, float, dict]:
    loss = fb(prepare(ids))
    params = [p for p in model.parameters() if p.requires_grad]
    return float(loss), float(grad_norm(params)), trainable_grads(model)


def cosine(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    if not keys or set(a) != set(b):
        return float("nan")
    x = torch.cat([a[k].flatten().double() for k in keys])
    y = torch.cat([b[k].flatten().double() for k in keys])
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-300))


def _parity(spec: RunSpec, method: str) -> dict:
    device = torch.device(spec.device)
    shape = get_shape(spec.shape)
    hf = build_hf_model(shape, device, spec.seed)
    ours = build_chronicals_model(shape, device, spec.impl, spec.seed)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state dicts differ: ours lacks {missing[:3]}, HF has extra {unexpected[:3]}")
    if method == "lora":
        hf = add_peft_lora(hf, spec)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(spec.seed + 1)
            for n, p in hf.named_parameters():
                if "lora_B" in n:  # PEFT starts B at 0; non-zero B makes the adapters shape the loss and A's grad
                    p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02))
        add_chronicals_lora(ours, spec)
        copy_adapters(hf, ours)
    ref = copy.deepcopy(hf).float()  # fp32 reference: same weights (bf16 values), fp32 arithmetic
    ids = make_batches(spec, shape.hf_config["vocab_size"], 1, device)[0]
    prep_hf, fb_hf = hf_style(lambda x: hf(input_ids=x, labels=x, use_cache=False).loss)
    prep_ref, fb_ref = hf_style(lambda x: ref(input_ids=x, labels=x, use_cache=False).loss)
    prep_ours, fb_ours = chronicals_step(ours, spec, device)
    l_ref, n_ref, g_ref = first_step(fb_ref, prep_ref, ref, ids)
    del ref
    l_hf, n_hf, g_hf = first_step(fb_hf, prep_hf, hf, ids)
    l_ours, n_ours, g_ours = first_step(fb_ours, prep_ours, ours, ids)
    cos_hf, cos_ours = cosine(g_hf, g_ref), cosine(g_ours, g_ref)
    err = {"loss_hf": abs(l_hf - l_ref) / abs(l_ref), "loss_ours": abs(l_ours - l_ref) / abs(l_ref),
           "norm_hf": abs(n_hf - n_ref) / n_ref, "norm_ours": abs(n_ours - n_ref) / n_ref}
    ok = (err["loss_ours"] <= max(2 * err["loss_hf"], LOSS_FLOOR) and err["norm_ours"] <= max(2 * err["norm_hf"], NORM_FLOOR)
          and math.isfinite(cos_ours) and (1 - cos_ours) <= max(2 * (1 - cos_hf), COS_FLOOR) and n_ours > 0)
    return {"method": method, "loss_ref": l_ref, "loss_hf": l_hf, "loss_ours": l_ours, "grad_norm_ref": n_ref,
            "grad_norm_hf": n_hf, "grad_norm_ours": n_ours, "grad_cos_hf": cos_hf, "grad_cos_ours": cos_ours,
            "rel_err": err, "params_compared": len(g_ours), "status": "ok" if ok else "FAILED",
            "reason": "" if ok else "ours is further from the fp32 reference than 2 x transformers' bf16 error"}


def correctness(spec: RunSpec) -> dict:
    """Parity rows for full fine-tune and LoRA (each independent: one failing leaves the other)."""
    out = {"task": "correctness", "shape": spec.shape, "rows": spec.rows, "seq": spec.seq, "parity": []}
    for method in ("full", "lora"):
        try:
            if method == "lora":
                import peft  # noqa: F401 (the reference adapters: a test extra, not a dependency)
        except ImportError:  # said as the hf-peft rows say it, not a FAILED check (a bench walk)
            out["parity"].append({"method": method, "status": "not installed",
                                  "reason": "needs peft (pip install peft) for transformers' reference adapters"})
            continue
        try:
            out["parity"].append(_parity(spec, method))
        except Exception as e:
            out["parity"].append({"method": method, "status": "error", "reason": f"{type(e).__name__}: {e}"[:400]})
        if spec.device.startswith("cuda"):
            torch.cuda.empty_cache()
    out["status"] = "ok" if all(p["status"] in ("ok", "not installed") for p in out["parity"]) else "FAILED"
    out["reason"] = "; ".join(f"{p['method']}: {p['reason']}" for p in out["parity"] if p["reason"])
    return out


def periodic_batch(rows: int, seq: int, vocab: int, period: int, seed: int) -> torch.Tensor:
    """(rows, seq) int64: each row repeats its own block of ``period`` distinct random tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.stack([torch.randperm(vocab, generator=gen)[:period] for _ in range(rows)])
    return blocks.repeat(1, (seq + period - 1) // period)[:, :seq].contiguous()


def learning(spec: RunSpec, period: int = 16, min_drop_full: float = 0.25, min_drop_lora: float = 0.15) -> dict:
    """Train ours (full; LoRA with LoRA+ 16) for ``spec.steps`` steps on one periodic batch; the last loss
    must be at most (1 - min_drop) x the first. lr: ``spec.lr`` (default 3e-4) for full, a third of it
    for LoRA's A (B gets 16 x that)."""
    lr_full = spec.lr or 3e-4
    lr_lora = lr_full / 3
    device = torch.device(spec.device)
    shape = get_shape(spec.shape)
    ids = periodic_batch(spec.rows, spec.seq, shape.hf_config["vocab_size"], period, spec.seed).to(device)
    out = {"task": "learning", "shape": spec.shape, "rows": spec.rows, "seq": spec.seq, "steps": spec.steps,
           "lr_full": lr_full, "lr_lora": lr_lora,
           "period": period, "min_drop": {"full": min_drop_full, "lora": min_drop_lora}, "runs": []}
    for method in ("full", "lora"):
        try:
            model = build_chronicals_model(shape, device, spec.impl, spec.seed)
            lr = lr_lora if method == "lora" else lr_full
            min_drop = min_drop_lora if method == "lora" else min_drop_full
            if method == "lora":
                groups = add_chronicals_lora(model, dataclasses.replace(spec, lr=lr))  # A at lr, B at 16 x
            else:
                groups = [{"params": list(model.parameters())}]
            params = [p for g in groups for p in g["params"]]
            opt = make_optimizer(groups, device, lr)
            prepare, fb = chronicals_step(model, spec, device)
            batch = prepare(ids)
            losses, norms = [], []
            for _ in range(spec.steps):
                loss, gn = train_step(fb, params, opt, batch)
                losses.append(loss)
                norms.append(gn)
            losses, norms = [float(x) for x in losses], [float(x) for x in norms]
            # every norm finite, then the smallest > 0 (min() over [1.0, nan] is 1.0: a NaN after the first step
            # passed; a bench walk)
            bad_norms = sum(not math.isfinite(n) for n in norms)
            finite = not bad_norms
            smallest = min(norms) if finite else float("nan")
            bad_losses = sum(not math.isfinite(x) for x in losses)
            ok = not bad_losses and losses[-1] <= (1 - min_drop) * losses[0] and finite and smallest > 0
            why = (f"gradient norm not finite in {counted(bad_norms, 'step')}" if not finite
                   else "gradient norm 0" if smallest <= 0
                   else f"loss not finite in {counted(bad_losses, 'step')}" if bad_losses  # as the row check says
                   else f"loss did not fall by {min_drop:.0%} of its first value")
            out["runs"].append({"method": method, "losses": losses, "min_grad_norm": smallest,
                                "status": "ok" if ok else "FAILED", "reason": "" if ok else why})
            del model, opt
        except Exception as e:
            out["runs"].append({"method": method, "status": "error", "reason": f"{type(e).__name__}: {e}"[:400]})
    out["status"] = "ok" if all(r["status"] == "ok" for r in out["runs"]) else "FAILED"
    out["reason"] = "; ".join(f"{r['method']}: {r['reason']}" for r in out["runs"] if r["reason"])
    return out
