"""Training metrics: a JSONL line per step, optional TensorBoard, MFU and memory, the loss-curve PNG.

Tokens/s counts loss tokens only (the tokens that carry a target), the honest training rate; MFU
counts every computed token (padding included) at ``ModelConfig.flops_per_token``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from .._jsonio import atomic_open, write_text_atomic

log = logging.getLogger("chronicals.train")


def rate_text(per_s: float) -> str:
    """A rate as the step lines and the summary print it: whole numbers from 100 up ("1,623"), three significant
    digits below ("12.3", "0.312"): a step of a few loss tokens that took 10-30 s read "0 loss tokens/s"."""
    if per_s >= 100 or per_s == 0 or not math.isfinite(per_s):
        return f"{per_s:,.0f}"
    return f"{per_s:.3g}"


def matmul_peak_tflops(device: torch.device, n: int = 8192) -> float | None:
    """bf16 (n x n) @ (n x n) rate in TFLOP/s on ``device`` (median of CUDA-event timings); None off CUDA.

    The MFU denominator of the trainer (when logging.peak_tflops is 0) and of ``chronicals bench``: a
    measured rate rather than the datasheet's (989 dense TFLOP/s on H100/H200 SXM), so MFU is relative to
    what this GPU reaches at its clocks. The operands come from a private generator: drawing them from
    the global CUDA RNG would shift the dropout masks of a resumed run off the uninterrupted run's.
    """
    if device.type != "cuda":
        return None
    import triton.testing

    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=300, return_mode="median")
    return 2 * n**3 / ms / 1e9


def matmul_params(cfg) -> int:
    """Parameters of ``cfg`` (a ModelConfig) that take part in a matmul per token: every projection + lm_head."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return cfg.num_hidden_layers * (2 * h * q + 2 * h * kv + 3 * h * i) + cfg.vocab_size * h


def train_flops_per_token(cfg, seq: int, method: str) -> float:
    """Training FLOPs per token for MFU (the trainer's and the bench's).

    full: 6 x matmul params + causal attention (``ModelConfig.flops_per_token``): 3.10 GFLOP for the
    0.5B shape at seq 1024. lora: frozen weights need no weight-gradient GEMM, so 4 x matmul params
    + the same attention (the adapters' own ~1% is left out, as in ANCHORS.md): 31.6 GFLOP for the 8B
    shape at seq 2048.
    """
    full = cfg.flops_per_token(seq)
    if method == "full":
        return full
    if method == "lora":
        return full - 2 * matmul_params(cfg)
    raise ValueError(f"method {method!r} is not 'full' or 'lora'")


def head_flops_per_token(cfg, method: str) -> float:
    """The loss head's share of ``train_flops_per_token``: 6 V h (full), 4 V h (lora: lm_head frozen). The head runs
    on loss tokens only (CausalLM's loss rows), so the trainer's MFU counts it per loss token, not per token: with
    prompt-masked data the head's FLOPs for every token overstated it (a third of a step's FLOPs at the 0.5B
    shape, V = 151,936)."""
    if method not in ("full", "lora"):
        raise ValueError(f"method {method!r} is not 'full' or 'lora'")
    return (6 if method == "full" else 4) * cfg.vocab_size * cfg.hidden_size


def private_pool_bytes(device: torch.device) -> tuple[int, int]:
    """(reserved, allocated) bytes in the caching allocator's private pools on a CUDA ``device``: the CUDA graphs'
    pools (``train.graphs.GraphedStep``), where a replayed step's activations live. From the allocator's snapshot:
    a few ms, so callers take it once per capture, not per step."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    reserved = allocated = 0
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] == index and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            reserved += seg["total_size"]
            allocated += seg["allocated_size"]
    return reserved, allocated


def memory_gib(device: torch.device, pools: tuple[int, int] | None = None) -> float | None:
    """Peak CUDA memory in GiB (None on CPU): ``max_memory_allocated``, and under CUDA graphs at least what a
    replay holds.

    pools: ``private_pool_bytes(device)`` when CUDA graphs replay. A replay allocates nothing (its tensors live
    in the graph's pool, allocated once at capture), so max_memory_allocated keeps the capture's peak, taken
    before the optimizer's first step made its state: at 0.5B full fine-tuning with fp32 masters it read
    12.11 GiB, the same as without them, while the optimizer held 5.52 GiB instead of 1.84 (H200, 29c6ce2).
    With pools, the peak is also at least what is allocated outside them now plus all they reserve (the
    optimizer's transients between steps, outside both, are not in that term)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    if pools is not None:
        reserved, allocated = pools
        peak = max(peak, torch.cuda.memory_allocated(device) - allocated + reserved)
    return peak / 2**30


TB_FLUSH_SECS = 10  # how often TensorBoard's event file is flushed


class MetricsLog:
    """metrics.jsonl (one JSON object per line) plus TensorBoard scalars when enabled and installed.

    TensorBoard shows what metrics.jsonl holds. Its event files are only ever appended to, so the writer opened at
    the first record carries a ``purge_step``: TensorBoard hides the steps >= it that earlier event files in
    out_dir/tensorboard logged. A resume at step k purges from k + 1 (records are numbered by the optimizer step
    they follow, 1-based, so k's records are kept and the interrupted run's k + 1.. are redone, not shown twice);
    a fresh run purges from 0 (an earlier run's curves in a reused out_dir are not this run's). Kept records at or
    past the purge step (another run's records taken at its checkpoint; those at k when k's closing "after"
    evaluation was dropped) are written again.
    """

    def __init__(self, out_dir: Path, tensorboard: bool, resume_step: int | None = None, on_open=None):
        """The file is rewritten (or made) at the first ``write``, when ``on_open()`` also runs and the TensorBoard
        writer opens: a run that stops before logging anything leaves an earlier run's metrics.jsonl and
        TensorBoard curves as they were."""
        self.path = out_dir / "metrics.jsonl"
        if self.path.is_dir():  # found now, not at the first record, when a fresh run has removed the old checkpoints
            raise IsADirectoryError(f"{self.path} is a directory: a run writes its metrics to that file; move it "
                                    "away or set another train.out_dir")
        self.records: list[dict] = []
        # the first step TensorBoard forgets: every one on a fresh run, those the resumed run redoes on a resume
        self.tb_purge_step = 0 if resume_step is None else resume_step + 1
        if resume_step is not None and self.path.exists():
            # keep what the interrupted run logged up to its checkpoint, but not its closing "after" evaluation;
            # later steps are redone
            logged = read_records(self.path, resume_step)
            self.records = [rec for rec in logged if rec.get("step", 0) <= resume_step and rec.get("tag") != "after"]
            dropped = [rec.get("step", 0) for rec in logged if rec.get("step", 0) <= resume_step
                       and rec.get("tag") == "after"]
            self.tb_purge_step = min([self.tb_purge_step, *dropped])
        self._fh = None
        self._on_open = on_open
        self.tb = None
        self._tb_dir = out_dir / "tensorboard"
        self._summary_writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("TensorBoard not installed (pip install tensorboard); logging to metrics.jsonl only")
            except Exception as e:  # a broken install (tensorboard against another protobuf: a TypeError) was exit 4
                log.warning("TensorBoard could not be imported (%s: %s); logging to metrics.jsonl only (set "
                            "logging.tensorboard=false to skip it)", type(e).__name__, str(e).splitlines()[0][:200])
            else:
                self._summary_writer = SummaryWriter

    def write(self, rec: dict) -> None:
        self.open()
        self.records.append(rec)
        try:
            _append_whole(self._fh, _json_line(rec).encode())
        except OSError as e:  # a full disk named no file ('error: [Errno 28] ...'; a checkpoint walk)
            raise OSError(f"could not append to {self.path} ({e}); is its disk full? free space and resume with "
                          "train.resume=auto (the last checkpoint's records are kept)") from e
        self._add_scalars(rec)

    def open(self) -> None:
        """Write the kept records (the file replaced whole) and run ``on_open``, once; ``write`` does it first."""
        if self._fh is None:
            if self._summary_writer is not None:  # before on_open, which removes an earlier run's checkpoints:
                # a writer that cannot be made (a file named tensorboard) failed after them, nothing trained
                try:
                    # flush_secs: TensorBoard's default of 120 s leaves a run's first two minutes of curves unseen;
                    # one flush of a few scalars every 10 s costs nothing next to a training step
                    self.tb = self._summary_writer(str(self._tb_dir), purge_step=self.tb_purge_step,
                                                   flush_secs=TB_FLUSH_SECS)
                except OSError as e:
                    raise OSError(f"{self._tb_dir}: TensorBoard's writer cannot be made there ({e.strerror or e}); "
                                  "move it away or set logging.tensorboard=false") from e
            if self._on_open is not None:
                self._on_open()
            # the kept records, replaced whole: a run killed (or out of disk) while writing them leaves the old file
            write_text_atomic(self.path, "".join(_json_line(r) for r in self.records))
            # unbuffered: a record is on disk once written (tail -f, a SIGKILL), and a failed one leaves no
            # buffered rest for close() to write again
            self._fh = self.path.open("ab", buffering=0)
            for kept in self.records:
                if kept.get("step", 0) >= self.tb_purge_step:
                    self._add_scalars(kept)

    def _add_scalars(self, rec: dict) -> None:
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{rec.get('kind', 'train')}/{k}", v, rec["step"])

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self.tb is not None:
            self.tb.close()


def _append_whole(fh, data: bytes) -> None:
    """Append ``data`` to the unbuffered file ``fh`` whole or not at all: a full disk takes the part that fits, then
    refuses the rest (ENOSPC), and that part is cut off again, so the file ends in a whole record. (Through Python's
    buffer the half record stayed, and close() wrote the buffered rest again: its bare "[Errno 28] No space left on
    device" replaced the error naming metrics.jsonl, a 1 MB tmpfs walk.)"""
    start = fh.seek(0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[fh.write(view):]
    except BaseException:  # a Ctrl-C between two pieces too
        try:
            fh.truncate(start)
        except OSError:  # the half record stays: read_records leaves out an unfinished last line
            pass
        raise


def _json_line(rec: dict) -> str:
    """One record as a line of strict JSON: NaN / inf as null (json.dumps wrote NaN, which JSON.parse and other
    strict readers refuse; eval --json writes null for them too)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}) + "\n"


def read_records(path: Path, resume_step: int) -> list[dict]:
    """metrics.jsonl's records; ValueError naming the file and line of one that is not a record. Blank lines are
    skipped, and so is an unfinished last line (no newline after it: the run writing it was killed), with a warning."""
    again = (f"fix or delete that line, or move {path} away (a new one then holds the steps from "
             f"{resume_step + 1} on)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); move it away (a new one then "
                         f"holds the steps from {resume_step + 1} on)") from None
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            if i == len(lines):  # after the last newline: a write cut short
                log.warning("%s:%d: left out an unfinished record (%s), the last line of a run that was stopped while "
                            "writing it", path, i, line[:60])
                continue
            raise ValueError(f"{path}:{i}: not a JSON record ({e}); {again}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i}: not a JSON object but {type(rec).__name__}; {again}")
        if type(rec.get("step", 0)) is not int:
            raise ValueError(f"{path}:{i}: its step is {rec['step']!r}, not an integer; {again}")
        records.append(rec)
    return records


def plot_losses(records: list[dict], path: Path) -> Path | None:
    """loss.png: training loss per step and held-out loss at its steps."""
    def points(kind: str, key: str) -> list[tuple]:  # null (non-finite) and missing values are left out
        return [(r["step"], r[key]) for r in records if r.get("kind") == kind and isinstance(r.get(key), (int, float))
                and math.isfinite(r[key]) and isinstance(r.get("step"), int)]

    train, evals = points("train", "loss"), points("eval", "eval_loss")
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: a 4-step run had ticks at 1.5, 2.5, ...
    ax.set_ylabel("cross-entropy (nats / loss token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_open(path, "wb") as fh:  # a failed write keeps the earlier curve, not half a PNG
            fig.savefig(fh, format="png")
    except OSError as e:  # the run's checkpoint, model and metrics are written: a plot is no reason to fail it
        log.warning("could not write the loss curve %s (%s); the losses are in %s", path, e.strerror or e,
                    path.with_name("metrics.jsonl"))
        return None
    finally:
        plt.close(fig)
    return path
