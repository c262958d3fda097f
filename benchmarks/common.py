"""Shared benchmark plumbing: timing, the two ceilings (copy bandwidth, bf16 matmul peak), result files.

Every result file carries the GPU, torch/triton/transformers versions, the date and the git sha.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from pathlib import Path

import torch

from chronicals._jsonio import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def require_cuda(script: str, usage: str | None = None) -> None:
    """Exit with one line naming ``script`` when torch sees no CUDA GPU (the GPU-only probes raised raw CUDA
    tracebacks on a CPU machine), or, with ``usage``, when no command-line argument was given."""
    import sys

    name = Path(script).name
    if usage is not None and len(sys.argv) < 2:
        sys.exit(f"usage: python benchmarks/{name} {usage}")
    if not torch.cuda.is_available():
        sys.exit(f"{name}: needs a CUDA GPU (torch.cuda.is_available() is False here); run it on the GPU machine "
                 "with PYTHONPATH=src")


def do_bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn()`` with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def wall_seconds_per_call(fn, n: int, warmup: int) -> float:
    """Wall seconds per call of ``fn()`` over ``n`` calls after ``warmup``, the GPU synchronized at both ends only:
    host time where the host is the limit (launch costs), GPU time where the GPU is (a training step)."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def kernel_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Milliseconds per call of ``fn()`` summed over its GPU kernels (torch.profiler), without the host's launch
    cost: what the call costs inside a CUDA graph, where a Python-heavy launcher (CuTe DSL, cuDNN frontend) would
    read slow by wall time alone."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
             for e in prof.key_averages())
    return us / iters / 1000


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def matmul_peak_tflops(n: int = 8192) -> float:
    """bf16 matmul rate on random data in TFLOP/s (the MFU denominator): the library's probe, so the
    benchmarks, ``chronicals bench`` and the trainer divide by the same measurement."""
    from chronicals.train.metrics import matmul_peak_tflops as probe

    return probe(torch.device("cuda"), n)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a spawned process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int) -> None:
    """Set the variables torchrun would give rank ``rank`` of ``world`` processes on this host."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def environment() -> dict:
    """GPU name, versions, date and git sha for a result file."""
    import triton

    from chronicals.bench.report import git_sha  # one sha lookup (env CHRONICALS_GIT_SHA without git)

    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_sha": git_sha(),
           "torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def result_path(name: str, suffix: str = "json", out_dir: str | os.PathLike | None = None) -> Path:
    """benchmarks/results/<name>_<gpu>_<date>.<suffix> (or under ``out_dir``)."""
    gpu = (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu").replace(" ", "-")
    day = _dt.date.today().isoformat()
    d = Path(out_dir).expanduser() if out_dir else RESULTS  # "~/x": mkdir made ./~/x, the write went to $HOME/x
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}_{gpu}_{day}.{suffix}"


def write_results(name: str, payload: dict, markdown: str | None = None, out_dir=None) -> Path:
    """Write JSON (environment + payload) and optionally a markdown table next to it."""
    path = result_path(name, "json", out_dir)
    write_text_atomic(path, json.dumps({"environment": environment(), **payload}, indent=2))
    if markdown:
        write_text_atomic(path.with_suffix(".md"), markdown)
    return path


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |\n" for r in rows)


def quack_with_shim():
    """Import quack-kernels (dev probes and contender rows only), or None when it is not installed.

    quack 0.6.5 fingerprints the globals of the epilogue functions it compiles and refuses a value it has no key
    for; nvidia-cutlass-dsl 4.8 added one such global, the ContextVar ``_LOC_TRANSFORMS`` (source locations for
    the generated IR, not the math), which reaches other unkeyable helpers (``code.co_positions``). The shim
    keys a ContextVar by its name and any other unkeyable value by its identity, so those kernels compile.
    """
    import contextvars
    import importlib.util

    if importlib.util.find_spec("quack") is None:
        return None
    import quack
    from quack.gemm_runtime import identity

    if not getattr(identity, "_chronicals_shim", False):
        keyer = identity.semantic_value_key

        def key(value, seen):
            if isinstance(value, contextvars.ContextVar):
                return ("contextvar", value.name)
            try:
                return keyer(value, seen)
            except TypeError:  # e.g. code.co_positions, reached through 4.8's location helpers: keyed by
                # identity, which is stable within the process; a new process recompiles (no stale reuse)
                return ("opaque", type(value).__module__, type(value).__qualname__, id(value))

        identity.semantic_value_key, identity._chronicals_shim = key, True
    return quack
