"""Training metrics: a JSONL line per step, optional TensorBoard, MFU and memory, the loss-curve PNG.

Tokens/s counts loss tokens only (the tokens that carry a target), the honest training rate; MFU
counts every computed token (padding included) at ``ModelConfig.flops_per_token``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("chronicals.train")


def measure_bf16_peak_tflops(device: torch.device, n: int = 4096, iters: int = 20) -> float:
    """bf16 matmul TFLOP/s on ``device`` (CUDA), the MFU denominator when logging.peak_tflops is 0.

    A measured rate rather than the datasheet's (989 dense TFLOP/s on H100/H200 SXM) so MFU is relative
    to what this GPU reaches at its clocks; set logging.peak_tflops to report against the datasheet.
    """
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def memory_gib(device: torch.device) -> float | None:
    """Peak allocated CUDA memory in GiB (None on CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


class MetricsLog:
    """metrics.jsonl (one JSON object per line) plus TensorBoard scalars when enabled and installed."""

    def __init__(self, out_dir: Path, tensorboard: bool, resume_step: int | None = None):
        self.path = out_dir / "metrics.jsonl"
        self.records: list[dict] = []
        if resume_step is not None and self.path.exists():
            # keep what the interrupted run logged up to its checkpoint; later steps are redone
            for line in self.path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("step", 0) <= resume_step:
                    self.records.append(rec)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self._fh = self.path.open("a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("TensorBoard not installed (pip install tensorboard); logging to metrics.jsonl only")
            else:
                self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, rec: dict) -> None:
        self.records.append(rec)
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{rec.get('kind', 'train')}/{k}", v, rec["step"])

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def plot_losses(records: list[dict], path: Path) -> Path | None:
    """loss.png: training loss per step and held-out loss at its steps."""
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("kind") == "eval"]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / loss token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
