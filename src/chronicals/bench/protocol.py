"""The benchmark protocol of ANCHORS.md, the same for every contender.

Batch: ``rows`` x ``seq`` random tokens, no padding; labels are the input ids (Hugging Face form), so
every position but the last of each row predicts the next token: rows * (seq - 1) loss tokens per step
(16 * 1023 = 16,368 at the 0.5B protocol), counted identically for every contender.
Timing: ``warmup`` steps, then ``steps`` timed steps between two device synchronizations.
A row records tokens/s (loss tokens), MFU, peak memory, every loss and gradient norm; it is FAILED when
the smallest gradient norm is not finite or is 0 (a model whose gradients vanish is not training).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields

import torch

from .._words import counted
from ..ops.attention import VARLEN_KERNELS
from ..train.step import grad_norm_fp32

LORA_R, LORA_ALPHA, LORA_PLUS_RATIO = 32, 64, 16
LR_FULL, LR_LORA = 1e-5, 1e-4


@dataclass
class RunSpec:
    """What one worker process runs: one contender on one shape and batch."""
    contender: str
    shape: str = "0.5b"
    rows: int = 16
    seq: int = 1024
    warmup: int = 4
    steps: int = 12
    device: str = "cuda"
    checkpointing: bool = False  # activation checkpointing (off in the protocol; on for long contexts)
    impl: str = "auto"  # chronicals op implementations: "auto" | "triton" | "torch"
    step: str = "trainer"  # chronicals rows: "trainer" (chronicals.train's accumulate_gradients) | "bench"
    layout: str = "rows"  # chronicals rows: "rows" (dense causal) | "packed" (cu_seqlens, one document per row)
    attention: str = "auto"  # chronicals packed rows' kernel (model.attention): "auto" | "cudnn" | "flash" | "fa4"
    # (FA4 runs unpacked rows too)
    lora_r: int = LORA_R
    lora_alpha: int = LORA_ALPHA
    lr: float = 0.0  # 0: the protocol's (1e-5 full, 1e-4 LoRA); the learning check reads it as its full-FT lr
    seed: int = 0

    def __post_init__(self):
        if self.rows < 1 or self.seq < 2:
            raise ValueError(f"rows={self.rows}, seq={self.seq}: need rows >= 1 and seq >= 2 (seq - 1 loss tokens per row)")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1 and warmup >= 0")
        if self.attention not in VARLEN_KERNELS:
            raise ValueError(f"attention={self.attention!r} must be one of {VARLEN_KERNELS}")
        if self.step not in ("trainer", "bench") or self.layout not in ("rows", "packed"):
            raise ValueError(f"step={self.step!r} must be 'trainer' or 'bench'; layout={self.layout!r} must be "
                             "'rows' or 'packed'")

    @property
    def loss_tokens(self) -> int:
        return self.rows * (self.seq - 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"RunSpec: unknown keys {sorted(unknown)} (known: {sorted(names)})")
        return cls(**d)


def make_batches(spec: RunSpec, vocab_size: int, count: int, device) -> list[torch.Tensor]:
    """``count`` distinct batches of input ids (rows, seq) int64, uniform over the vocabulary."""
    gen = torch.Generator().manual_seed(spec.seed)
    return [torch.randint(0, vocab_size, (spec.rows, spec.seq), generator=gen).to(device) for _ in range(count)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_norm(params) -> torch.Tensor:
    """L2 norm over the gradients of ``params``, computed and kept in fp32 for every contender alike (torch's
    get_total_norm rounds a bf16 run's norm to bf16: 3 significant digits); no host sync."""
    return grad_norm_fp32(params)


def make_optimizer(param_groups, device: torch.device, lr: float) -> torch.optim.Optimizer:
    """torch AdamW(fused=True): states in the parameters' dtype, one kernel for all tensors."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)


def train_step(forward_backward, params, optimizer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns (loss, grad norm) as device tensors (read after the timed window).

    forward_backward(batch) runs forward and backward and returns the detached mean loss.
    """
    loss = forward_backward(batch)
    gn = grad_norm(params)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float(), gn.detach()


def timed_run(built, spec: RunSpec, device: torch.device) -> dict:
    """Warm up, then time ``spec.steps`` steps between two synchronizations; no host sync inside.

    built: a ``contenders.Built`` (prepare, forward_backward, params, optimizer, vocab_size).
    """
    ids = make_batches(spec, built.vocab_size, min(spec.warmup + spec.steps, 8), device)
    batches = [built.prepare(x) for x in ids]
    losses, norms = [], []
    for i in range(spec.warmup):
        losses.append(train_step(built.forward_backward, built.params, built.optimizer, batches[i % len(batches)])[0])
    synchronize(device)
    t0 = time.perf_counter()
    for i in range(spec.steps):
        loss, gn = train_step(built.forward_backward, built.params, built.optimizer,
                              batches[(spec.warmup + i) % len(batches)])
        losses.append(loss)
        norms.append(gn)
    synchronize(device)
    seconds = time.perf_counter() - t0
    tokens = spec.loss_tokens * spec.steps
    return {"seconds": seconds, "step_ms": 1e3 * seconds / spec.steps, "tokens_per_s": tokens / seconds,
            "losses": [float(x) for x in losses], "grad_norms": [float(x) for x in norms]}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def validate_row(row: dict) -> dict:
    """Set ``status``/``reason`` of a measured row: FAILED when the smallest gradient norm over the
    timed steps is not finite or is 0, or a loss is not finite. Rows already marked (error, not
    installed, timeout) are left as they are."""
    if row.get("status") not in (None, "ok"):
        return row
    norms, losses = row.get("grad_norms") or [], row.get("losses") or []
    if not norms:
        row.update(status="FAILED", reason="no timed steps recorded")
        return row
    finite = [g for g in norms if math.isfinite(g)]
    row["min_grad_norm"] = min(finite) if len(finite) == len(norms) else float("nan")
    if len(finite) != len(norms):
        bad = counted(len(norms) - len(finite), "timed step")
        row.update(status="FAILED", reason=f"gradient norm not finite in {bad}")
    elif row["min_grad_norm"] == 0.0:
        row.update(status="FAILED", reason="gradient norm 0: the model is not training")
    elif not all(math.isfinite(x) for x in losses):
        row.update(status="FAILED", reason="loss not finite")
    else:
        row.update(status="ok", reason="")
    return row
