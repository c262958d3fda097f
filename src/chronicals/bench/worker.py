"""One bench task in its own process, so memory peaks and compile caches never leak between rows.

    python -m chronicals.bench.worker --task contender --contender hf-sdpa --shape 0.5b --json-out row.json
    python -m chronicals.bench.worker --task peak --json-out peak.json

Tasks: contender (one timed row), peak (the bf16 matmul peak), correctness (ours vs transformers on one
batch), learning (ours on a learnable task). A task never raises: failures become the row's status
("error", "OOM", "not installed") with the reason, and the process exits 0 once the JSON is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import fields
from pathlib import Path

from .._jsonio import write_text_atomic
from .protocol import RunSpec

TASKS = ("contender", "peak", "correctness", "learning")


def spec_argv(spec: RunSpec) -> list[str]:
    """RunSpec -> worker command-line flags (the inverse of ``parse_args``)."""
    out = []
    for f in fields(RunSpec):
        v = getattr(spec, f.name)
        if isinstance(v, bool):
            out += [f"--{f.name}"] if v else []
        else:
            out += [f"--{f.name}", str(v)]
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m chronicals.bench.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=TASKS, default="contender")
    ap.add_argument("--json-out", required=True, help="where the row (JSON) is written")
    for f in fields(RunSpec):
        if f.type in ("bool", bool):
            ap.add_argument(f"--{f.name}", action="store_true")
        else:
            kind = {"int": int, "float": float}.get(f.type, f.type if f.type in (int, float) else str)
            ap.add_argument(f"--{f.name}", type=kind,
                            default=None if f.name == "contender" else f.default)
    return ap.parse_args(argv)


def base_row(spec: RunSpec) -> dict:
    return {"contender": spec.contender, "shape": spec.shape, "rows": spec.rows, "seq": spec.seq,
            "warmup": spec.warmup, "steps": spec.steps, "checkpointing": spec.checkpointing,
            "loss_tokens_per_step": spec.loss_tokens, "status": None, "reason": ""}


def _error_row(row: dict, e: BaseException) -> dict:
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        row["status"] = "OOM"
    elif isinstance(e, ImportError):
        row["status"] = "not installed"
    else:
        row["status"] = "error"
    row["reason"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    row["traceback"] = traceback.format_exc()[-4000:]
    return row


def run_contender(spec: RunSpec) -> dict:
    """Build and time one contender; returns its row (never raises)."""
    import torch

    from .contenders import get_contender, missing_requirements
    from ..train.metrics import memory_gib, private_pool_bytes
    from .protocol import reset_peak_memory, timed_run, validate_row
    from .shapes import get_shape, model_config, train_flops_per_token

    row = base_row(spec)
    try:
        c = get_contender(spec.contender)
        shape = get_shape(spec.shape)
        row.update(label=c.label, method=c.method,
                   flops_per_token=train_flops_per_token(model_config(shape), spec.seq, c.method))
        missing = missing_requirements(c)
        if missing:
            row.update(status="not installed", reason=f"needs {', '.join(missing)}")
            return row
        device = torch.device(spec.device)
        t0 = time.perf_counter()
        built = c.build(spec, shape, device)
        row["build_s"] = round(time.perf_counter() - t0, 2)
        row["notes"] = built.notes
        row["trainable_params"] = sum(p.numel() for p in built.params)
        reset_peak_memory(device)  # the peak counts weights, grads, optimizer states and activations
        t0 = time.perf_counter()
        row.update(timed_run(built, spec, device))
        row["run_s"] = round(time.perf_counter() - t0, 2)
        # None on CPU (no allocator peak): the row says "n/a". CUDA graphs: at least what a replay holds, since
        # max_memory_allocated misses their pools after capture (train.metrics.memory_gib)
        pools = private_pool_bytes(device) if device.type == "cuda" else None
        row["peak_gib"] = memory_gib(device, pools if pools and pools[0] else None)
        if pools and pools[0]:
            row["graph_pool_gib"] = round(pools[0] / 2**30, 2)
    except BaseException as e:  # a failed contender is a row, never a crashed table
        if isinstance(e, KeyboardInterrupt):
            raise
        return _error_row(row, e)
    return validate_row(row)


def run_peak(spec: RunSpec) -> dict:
    import torch

    from ..train.metrics import matmul_peak_tflops

    device = torch.device(spec.device)
    row = {"task": "peak", "device": spec.device, "status": "ok", "reason": ""}
    try:
        row["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        row["peak_tflops"] = matmul_peak_tflops(device)
    except Exception as e:
        _error_row(row, e)
    return row


def run_task(task: str, spec: RunSpec) -> dict:
    if task == "contender":
        return run_contender(spec)
    if task == "peak":
        return run_peak(spec)
    from . import checks

    try:
        return checks.correctness(spec) if task == "correctness" else checks.learning(spec)
    except Exception as e:
        return _error_row({"task": task, "shape": spec.shape, "status": None}, e)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    kw = {f.name: getattr(args, f.name) for f in fields(RunSpec)}
    kw["contender"] = kw["contender"] or args.task
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.task == "contender" and kw["contender"].startswith("unsloth"):
        import importlib.util

        if importlib.util.find_spec("unsloth") is not None:
            import unsloth  # noqa: F401  (must patch transformers before anything imports it)
    try:
        spec = RunSpec(**kw)
    except ValueError as e:
        row = {"contender": kw["contender"], "status": "error", "reason": str(e)}
    else:
        row = run_task(args.task, spec)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(row, indent=1, default=str))  # a cut-off row is no row, not bad JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
